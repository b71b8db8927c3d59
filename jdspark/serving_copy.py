"""The serving copy of a (target, drafter) pair: the modules a generation runs, made once per set of weights and
kept between calls (``serving_pair``). ``jdspark.generation.generate`` and the serving slots
(``jdspark.slots.SlotBackend``) both run it; ``kimi.dispatch.serving_copy`` decides when a copy is made."""

from __future__ import annotations

import jax
from flax import nnx

from jdspark.drafter import with_serving_layout as drafter_serving_layout
from kimi import dispatch
from kimi.model import with_serving_layout

_kept: dict = {}  # role -> (key, the weight arrays it was made from, the serving copy): one entry per role


def _serving_copy(role: str, module, make, *key_extra):
    """``make(module)``, kept for the last module of this role: keyed by its graph, ``key_extra`` and the identity
    of every weight array (jax arrays are immutable: new weights are new arrays, hence a new copy); the entry holds
    those arrays, so no identity is reused while it stands."""
    graph, state = nnx.split(module)
    weights = jax.tree_util.tree_leaves(state)
    key = (graph, key_extra, tuple(map(id, weights)))
    hit = _kept.get(role)
    if hit is not None and hit[0] == key:
        return hit[2]
    copy = make(module)
    _kept[role] = (key, weights, copy)
    return copy


def serving_pair(target, drafter):
    """The (target, drafter) a generation runs: their serving copies when ``kimi.dispatch.serving_copy`` says so
    (MXFP4 experts dequantised, projections fused, weights in ``serving_dtype``), else the modules themselves.

    Made outside any program and kept for the last target and the last drafter given (one entry each, so plain
    and DSpark generations of one target share its copy): ``generate`` used to rebuild the copy at the start of
    every call's program, a fixed cost in each call's time to the first token. Only a small model is copied
    (``dispatch.serving_copy``'s budget), so keeping the copy between calls holds at most that."""
    if not dispatch.serving_copy(target.config, target.partition.sharded):
        return target, drafter
    dtype = target.config.serving_dtype
    served_t = _serving_copy("target", target, with_serving_layout)
    served_d = None if drafter is None else _serving_copy(
        "drafter", drafter, lambda d: drafter_serving_layout(d, dtype), dtype)
    return served_t, served_d
