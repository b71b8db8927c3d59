"""The DSpark drafter's checkpoints in speculators' format (config.json + model.safetensors, state_dict names),
through the safetensors layer the target uses too (``kimi.safetensors_io``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.config import DSparkConfig
from jdspark.drafter.model import DSparkDrafter, check_target, with_context_window
from kimi import safetensors_io as st

CHECKPOINT_WINDOW = object()  # a command line's --drafter-window not given: the checkpoint's own context window


def apply_context_window(drafter, window):
    """A command line's drafter: ``drafter`` as loaded for CHECKPOINT_WINDOW (or None), else serving ``window``
    (``parse_context_window``'s value: positions, or None for the whole context)."""
    if drafter is None or window is CHECKPOINT_WINDOW:
        return drafter
    return with_context_window(drafter, window)


def parse_context_window(s: str):
    """A drafter context window as a command line gives it: a positive int, or "none" (the whole context). An
    ``argparse`` type: anything else is an ArgumentTypeError naming what was expected."""
    if str(s).strip().lower() == "none":
        return None
    try:
        w = int(s)
    except ValueError:
        w = 0
    if w < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of positions or 'none', got {s!r}")
    return w


_IGNORED_ON_LOAD = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def _torch_name(path) -> tuple[str, bool]:
    """nnx param path -> (speculators state_dict key, transpose?)."""
    *mod, leaf = [str(p) for p in path]
    name = ".".join(mod)
    if leaf == "kernel":
        return name + ".weight", True
    if leaf in ("embedding", "scale"):
        return name + ".weight", False
    if leaf == "bias":
        return name + ".bias", False
    raise ValueError(f"no speculators name for parameter {'.'.join(map(str, path))}")


def state_dict(drafter: DSparkDrafter) -> dict[str, jax.Array]:
    """The drafter's parameters under speculators' state_dict keys, in torch layout ([out, in] for Linear)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        name, tr = _torch_name(path)
        val = var.get_value()
        out[name] = val.T if tr else val
    return out


def save_drafter(drafter: DSparkDrafter, path) -> str:
    """Write speculators' format (config.json + model.safetensors; no embed/lm_head/verifier tensors) to path.
    Everything is written to a temporary sibling directory first and renamed into place."""
    path = os.path.abspath(os.fspath(path))
    tensors = {k: np.asarray(jax.device_get(v)) for k, v in state_dict(drafter).items()}
    records = [st.TensorRecord(k, tuple(v.shape), st.NP_TO_ST[v.dtype]) for k, v in sorted(tensors.items())]
    with st.atomic_directory(path) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(drafter.config.to_speculators_config(), f, indent=2, sort_keys=True)
            f.write("\n")
        st.write_safetensors(os.path.join(tmp, st.SINGLE_FILE), records, lambda r: tensors[r.name])
    return path


def load_drafter(path, target: Any = None, *, param_dtype=None) -> DSparkDrafter:
    """Load a speculators-format DSpark checkpoint. Every missing, unexpected or mis-shaped tensor is reported in
    one ValueError. embed_tokens / lm_head / verifier_* in the file are ignored (the target's are used)."""
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json found")
    cfg = DSparkConfig.from_speculators_config(cfg_file)
    if param_dtype is not None:
        cfg = cfg.replace(param_dtype=str(jnp.dtype(param_dtype)))
    check_target(cfg, target)
    abstract = nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    expected = {}
    for p, var in flat:
        name, tr = _torch_name(p)
        shape = tuple(var.get_value().shape)
        expected[name] = (shape[::-1] if tr else shape, tr)

    files = [st.SafetensorsFile(fn) for fn in st.checkpoint_files(path, any_safetensors=False)[0]]
    found: dict[str, tuple[st.SafetensorsFile, tuple]] = {}
    for f in files:
        for k, info in f.tensors.items():
            found[k] = (f, info.shape)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(k for k in set(found) - set(expected) if k not in _IGNORED_ON_LOAD)
    misshaped = sorted(f"{k}: expected {list(expected[k][0])}, got {list(found[k][1])}"
                       for k in set(expected) & set(found) if tuple(found[k][1]) != expected[k][0])
    if missing or unexpected or misshaped:
        lines = [f"{path}: checkpoint does not match the DSpark config"]
        if missing:
            lines.append("missing tensors: " + ", ".join(missing))
        if unexpected:
            lines.append("unexpected tensors: " + ", ".join(unexpected))
        if misshaped:
            lines.append("mis-shaped tensors: " + "; ".join(misshaped))
        raise ValueError("\n".join(lines))

    for p, var in flat:
        name, tr = _torch_name(p)
        arr = jnp.asarray(found[name][0].read(name))
        var.set_value((arr.T if tr else arr).astype(var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))

