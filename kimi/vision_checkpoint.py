"""The vision tower and projector alone from a checkpoint whose text model this package may not load (K2.5's is
DeepSeek-V3), by the official names and the same checks as :func:`kimi.checkpoint.load_checkpoint`."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import jax.numpy as jnp
from flax import nnx

from kimi.checkpoint import CONFIG_FILE, _collect, _dtype_name, _entries, _fill, _plan_load
from kimi.jsonfile import read_json_object
from kimi.layers import shape_only_init
from kimi.safetensors_io import LoadReport, fmt_shape
from kimi.vision import MoonViT, Projector, VisionConfig

__all__ = ["load_vision"]


class _VisionPair(nnx.Module):
    """The vision tower and projector alone, under their checkpoint paths."""

    def __init__(self, vcfg, text_dim: int, dtype, rngs: nnx.Rngs):
        self.vision_tower = MoonViT(vcfg, dtype=dtype, rngs=rngs)
        self.mm_projector = Projector(vcfg, text_dim, dtype=dtype, rngs=rngs)


_VISION_KEY = re.compile(r"(?:model\.)?(?:vision_tower|mm_projector)\..*")


def load_vision(path, dtype="float32"):
    """``(MoonViT, Projector)`` from the ``vision_tower.*`` / ``mm_projector.*`` tensors of a checkpoint directory
    (K2.5's, transformers' ``save_pretrained`` of ``Kimi_K25ForConditionalGeneration``, K3's or ours), the text
    model left unread; ``config.json`` supplies ``vision_config`` and the text width. The same checks as
    :func:`load_checkpoint` (missing / unexpected / mis-shaped vision tensors in one ValueError)."""
    path = os.fspath(path)
    cfg_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_file):
        raise ValueError(f"load_vision: {cfg_file} not found")
    top = read_json_object(cfg_file)
    vcfg = VisionConfig.from_hf_config(top.get("vision_config") or {}, top)
    if vcfg is None:
        raise ValueError(f"load_vision: {cfg_file} has no vision_config (a text-only checkpoint)")
    text_dim = int((top.get("text_config") or top)["hidden_size"])
    with shape_only_init():
        abstract = nnx.eval_shape(lambda: _VisionPair(vcfg, text_dim, jnp.dtype(_dtype_name(dtype)), nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(abstract_state))
    entries = _entries(flat)
    report = LoadReport(path)
    provided = _collect(path, report, lambda key: not _VISION_KEY.fullmatch(key))
    plans, used = _plan_load(entries, provided, SimpleNamespace(vision=vcfg), report)  # shapes need .vision only
    for official, src in provided.items():
        if official not in used:
            report.unexpected.append(f"{official} (from {src.where()}): {fmt_shape(src.shape)} {src.dtype}")
    report.raise_if_any()
    pair = _fill(graphdef, flat, plans, None, None)
    return pair.vision_tower, pair.mm_projector
