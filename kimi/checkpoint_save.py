"""Saving a model as an HF / PyTorch safetensors checkpoint by the official tensor names (``kimi.checkpoint``'s
tables; split from it by concern: loading stays there).

:func:`save_checkpoint` writes ``config.json`` (``cfg.to_hf_config()``) and the tensors by their official names, in
each parameter's own dtype (MXFP4 experts as ``weight_packed`` / ``weight_scale``; ``A_log`` as ``[1, 1, H, 1]`` for
Kimi-Linear models, as transformers and the official Kimi-Linear checkpoints store it, and ``[H]`` for K3-style
models), one tensor at a time, into a temporary directory next to the target that is renamed into place at the end,
so a failed save leaves no half-written output. Loading what was saved gives back the same bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import jax
import numpy as np
from flax import nnx

from kimi import safetensors_io as st
from kimi.checkpoint import CONFIG_FILE, _a_log_saved_shape, _ckpt_shape, _entries, _Entry, _path_str
from kimi.config import KimiConfig
from kimi.safetensors_io import INDEX_FILE, NP_TO_ST, SINGLE_FILE, TensorRecord


def _save_transform(entry: _Entry, cfg: KimiConfig, host: np.ndarray, k: int) -> np.ndarray:
    t = entry.transform
    if t == "linear":
        return host.T
    if t == "conv":
        return host[:, None, :]
    if t == "a_log":
        return host.reshape(_a_log_saved_shape(cfg, entry.shape[0]))
    if t == "experts":
        return host[k]
    if t == "patch":
        return host.T.reshape(_ckpt_shape(entry, cfg))
    return host


_OWN_FILES = re.compile(r"config\.json|model(?:-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")


@dataclasses.dataclass(frozen=True)
class _SaveItem(TensorRecord):
    """One tensor to write, and where its data comes from: expert ``k`` of (or all of) ``entry``'s parameter."""

    entry: Optional[_Entry] = None
    k: int = 0


def save_checkpoint(model, out_dir, max_shard_bytes: Optional[int] = None) -> str:
    """Write ``model`` to ``out_dir`` as ``config.json`` + ``model.safetensors`` (or, with ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json``), official names.

    Tensors are fetched from the device one parameter at a time and written in the parameter's dtype. The files
    go to a temporary directory next to ``out_dir`` that replaces it at the end (files of an existing ``out_dir``
    that are not checkpoint files, such as a tokenizer, are carried over). Returns ``out_dir``.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    cfg: KimiConfig = model.config
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected a positive int or None, got {max_shard_bytes}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"save_checkpoint: {out_dir} exists and is not a directory")
    flat = list(nnx.to_flat_state(nnx.state(model)))
    entries = _entries(flat)
    arrays = {_path_str(p): v.get_value() for p, v in flat}

    items = [_SaveItem(name, _ckpt_shape(entry, cfg), NP_TO_ST[entry.dtype], entry, k)
             for entry in entries for k, name in enumerate(entry.names)]
    shards: list = [[]]
    size = 0
    for it in items:
        if max_shard_bytes is not None and shards[-1] and size + it.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes

    remaining = {}
    for it in items:
        remaining[it.entry.path] = remaining.get(it.entry.path, 0) + 1
    cache: dict = {}

    def fetch(it: _SaveItem):
        path = it.entry.path
        if path not in cache:
            cache[path] = np.asarray(jax.device_get(arrays[path]))
        host = cache[path]
        remaining[path] -= 1
        if not remaining[path]:
            del cache[path]
        return _save_transform(it.entry, cfg, host, it.k)

    with st.atomic_directory(out_dir, own_files=_OWN_FILES) as tmp:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(cfg.to_hf_config(), f, indent=2)
            f.write("\n")
        if len(shards) == 1:  # everything fits: one file, no index (as transformers does)
            st.write_safetensors(os.path.join(tmp, SINGLE_FILE), shards[0], fetch)
        else:
            n = len(shards)
            weight_map = {}
            for j, shard in enumerate(shards):
                fname = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
                st.write_safetensors(os.path.join(tmp, fname), shard, fetch)
                weight_map.update({it.name: fname for it in shard})
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": sum(it.nbytes for it in items)}, "weight_map": weight_map}, f,
                          indent=2)
                f.write("\n")
    return out_dir
