"""Sharding rules: the one place that maps logical axis names to mesh axes.

Two tables, read together:

1. ``ShardingRules`` (a small frozen dataclass, one instance per preset): logical axis name -> mesh axis
   (``"data"``, ``"tensor"``, a tuple of them, or ``None`` = replicated). Kept here.
2. ``PARAM_AXES`` / ``CACHE_AXES``: every parameter of ``KimiForCausalLM`` and ``DSparkDrafter`` and every cache
   field -> one logical name (or ``None``) per dimension, declared by each model package
   (``kimi/partitioning.py``, ``jdspark/partitioning.py``) and merged here. Modules carry no mesh names; the
   parameter's path (its official checkpoint name) is the key; a parameter that matches nothing is an error.

A dimension whose size is not divisible by its mesh axes is an error naming the parameter, except ``batch``, which
is replicated when the rows do not divide (a batch-1 stream on a data-parallel mesh runs on every data rank).
Mesh axes of size 1 are dropped from the specs.

Why these layouts (K3 on 16 GB300s, batch-1 decode reads about 12 GB per device per token under tp16):
  * tp16: heads, projected widths, dense/shared hidden, vocabulary, each expert's hidden (F = 3072 -> 192 = 6
    MXFP4 blocks per device) and the LatentMoE width are split 16 ways, so every device reads 1/16 of the 16
    routed experts of a token (balanced, unlike experts spread over devices). The MLA latent cache is one
    576-wide MQA key shared by all heads: replicated (as vLLM does without decode context parallelism). The
    router (896 x 7168 fp32, 26 MB) is replicated: reading it costs less than the collective that sharding it adds.
  * KDA's conv state is stored as q|k|v side by side ([.., 3P]), so no contiguous split of it matches the heads:
    it and the conv kernels are replicated, and each KDA layer gathers the new token's q/k/v projections once
    (``KimiDeltaAttention`` constrains them), runs the tiny depthwise conv on all channels and keeps its heads.
  * dp16-ep16: every dense weight replicated (attention is data parallel, one stream per rank); routed experts
    split over the same 16 devices (56 each) and run by ``sharding/moe_ep.py`` under ``jax.shard_map``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdspark import partitioning as drafter_axes
from jdspark.drafter import DSparkDrafter
from kimi import partitioning as target_axes
from sharding.mesh import mesh_dims

Axis = Union[None, str, tuple]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name(s); None replicates."""

    name: str = "custom"
    batch: Axis = None  # batch rows of caches and activations
    vocab: Axis = None  # embedding rows, lm_head columns, the Markov head's vocabulary
    kda_heads: Axis = None  # KDA heads and the projected width P = heads x head_dim (q/k/v/g, conv, gates, o rows)
    mla_heads: Axis = None  # MLA heads (q_b / kv_b / g columns, o rows)
    mla_latent: Axis = None  # the latent cache's width (c_kv): contracted by every head
    cache_seq: Axis = None  # cached positions (MLA latent cache, drafter context K/V)
    experts: Axis = None  # routed experts E
    expert_hidden: Axis = None  # a routed expert's hidden F
    moe_latent: Axis = None  # the LatentMoE width (routed_expert_down_proj columns, up_proj rows)
    router: Axis = None  # the router's expert dim (weight rows, score-correction bias)
    mlp_hidden: Axis = None  # dense MLP (layer 0) and shared experts' hidden
    draft_taps: Axis = None  # the drafter's fc input (n_taps x hidden)
    draft_heads: Axis = None  # drafter query heads x head_dim
    draft_kv_heads: Axis = None  # drafter key/value heads (projections and the context K/V cache)
    draft_mlp: Axis = None  # drafter MLP hidden

    def mesh_axes(self, logical: str) -> tuple:
        """The mesh axes of a logical name as a tuple (empty: replicated)."""
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
        v = getattr(self, logical)
        if v is None:
            return ()
        return (v,) if isinstance(v, str) else tuple(v)

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in LOGICAL_AXES}


LOGICAL_AXES = tuple(f.name for f in dataclasses.fields(ShardingRules) if f.name != "name")

_TP = dict(vocab="tensor", kda_heads="tensor", mla_heads="tensor", expert_hidden="tensor", moe_latent="tensor",
           mlp_hidden="tensor", draft_taps="tensor", draft_heads="tensor", draft_kv_heads="tensor",
           draft_mlp="tensor")
RULES: dict[str, ShardingRules] = {
    # batch-1 latency: tensor parallel everywhere, experts split along their hidden dim
    "tp": ShardingRules(name="tp", **_TP),
    # throughput: attention data parallel (dense weights replicated), experts expert parallel on the same devices
    "dp-ep": ShardingRules(name="dp-ep", batch="data", experts="data"),
    # both axes > 1 (explicit dims): data-parallel rows and experts over "data", everything else as tp
    "dp-tp-ep": ShardingRules(name="dp-tp-ep", batch="data", experts="data", **_TP),
}


def rules_for(mesh_or_name: Any) -> ShardingRules:
    """The rules for a mesh (by which axes are > 1) or a preset name ('tp16', 'dp16-ep16', 'tp', 'dp-ep', ...)."""
    if isinstance(mesh_or_name, ShardingRules):
        return mesh_or_name
    if isinstance(mesh_or_name, str):
        if mesh_or_name in RULES:
            return RULES[mesh_or_name]
        dims = mesh_dims(mesh_or_name)
    else:
        dims = mesh_shape(mesh_or_name)
    data, tensor = dims.get("data", 1), dims.get("tensor", 1)
    if data > 1 and tensor > 1:
        return RULES["dp-tp-ep"]
    if data > 1:
        return RULES["dp-ep"]
    return RULES["tp"]


def mesh_shape(mesh: Any) -> dict[str, int]:
    """{axis: size} of a Mesh, an AbstractMesh or a plain dict."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


# ------------------------------------------------------------------------------------------------ the models' tables
# Each model package declares its own parameters' and caches' logical axes (kimi/partitioning.py,
# jdspark/partitioning.py); drafter keys are prefixed "drafter." here.
PARAM_AXES: dict[str, tuple] = {**target_axes.PARAM_AXES,
                                **{f"drafter.{k}": v for k, v in drafter_axes.PARAM_AXES.items()}}
CACHE_AXES: dict[str, dict[str, tuple]] = {"KimiCache": target_axes.CACHE_AXES,
                                           "DrafterCache": drafter_axes.CACHE_AXES}
path_parts = target_axes.path_parts


def canonical_key(path, layer_kinds: Optional[Sequence[str]] = None, drafter: bool = False) -> str:
    """The PARAM_AXES key of a parameter path (tuple or dotted string)."""
    if drafter:
        return "drafter." + drafter_axes.canonical_key(path)
    return target_axes.canonical_key(path, layer_kinds)


def param_axes(key: str, ndim: Optional[int] = None) -> tuple:
    """Logical axes of a canonical parameter key (ValueError when no rule covers it)."""
    if key in PARAM_AXES:
        axes = PARAM_AXES[key]
    elif target_axes.REPLICATED.search(key):
        axes = (None,) * (ndim if ndim is not None else 1)
    else:
        raise ValueError(f"no sharding rule for parameter {key!r}: add it to PARAM_AXES in kimi/partitioning.py "
                         "(or jdspark/partitioning.py)")
    if ndim is not None and len(axes) != ndim:
        raise ValueError(f"parameter {key!r}: the rule names {len(axes)} dims {axes}, the array has {ndim}")
    return axes


def logical_to_spec(axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Any, rules: ShardingRules,
                    where: str = "array") -> P:
    """PartitionSpec of an array from its logical axes. Checks divisibility (``batch`` falls back to replicated),
    drops mesh axes of size 1, and refuses a mesh axis used twice."""
    ms = mesh_shape(mesh)
    if len(axes) != len(shape):
        raise ValueError(f"{where}: {len(axes)} logical axes {tuple(axes)} for a {len(shape)}-d shape {tuple(shape)}")
    out, used = [], set()
    for d, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        mesh_ax = tuple(a for a in rules.mesh_axes(name) if ms.get(a, 1) > 1 or a not in ms)
        missing = [a for a in mesh_ax if a not in ms]
        if missing:
            raise ValueError(f"{where}: rule {rules.name}.{name} names mesh axes {missing} that the mesh "
                             f"{ms} does not have")
        if not mesh_ax:
            out.append(None)
            continue
        size = math.prod(ms[a] for a in mesh_ax)
        if shape[d] % size:
            if name == "batch":
                out.append(None)
                continue
            raise ValueError(f"{where}: dim {d} (size {shape[d]}, logical {name!r}) is not divisible by mesh axes "
                             f"{mesh_ax} (size {size}) under rules {rules.name!r}")
        if used & set(mesh_ax):
            raise ValueError(f"{where}: mesh axes {mesh_ax} used by two dims of one array")
        used |= set(mesh_ax)
        out.append(mesh_ax[0] if len(mesh_ax) == 1 else mesh_ax)
    return P(*out)


def param_specs(model, mesh: Any, rules: Optional[ShardingRules] = None) -> dict[str, P]:
    """{dotted path: PartitionSpec} for every state leaf of a KimiForCausalLM or a DSparkDrafter (concrete or
    abstract, e.g. from ``nnx.eval_shape``)."""
    rules = rules or rules_for(mesh)
    drafter = isinstance(model, DSparkDrafter)
    kinds = None if drafter else model.config.layer_kinds
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        dotted = ".".join(path_parts(path))
        key = canonical_key(path, kinds, drafter)
        shape = tuple(var.shape)
        out[dotted] = logical_to_spec(param_axes(key, len(shape)), shape, mesh, rules, where=dotted)
    return out


def module_param_specs(module, prefix: str, mesh: Any, rules: Optional[ShardingRules] = None) -> dict[str, P]:
    """Specs of a single layer module (a KimiDeltaAttention ``prefix='kda'``, GatedMLA ``'mla'``, LatentMoE
    ``'moe'``, DenseMLP ``'mlp'``): used to compile one full-width layer on its own."""
    rules = rules or rules_for(mesh)
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module)):
        dotted = ".".join(path_parts(path))
        shape = tuple(var.shape)
        key = f"{prefix}.{dotted}"
        out[dotted] = logical_to_spec(param_axes(key, len(shape)), shape, mesh, rules, where=key)
    return out


def cache_specs(cache, mesh: Any, rules: Optional[ShardingRules] = None):
    """The cache pytree (KimiCache or DrafterCache; concrete or ShapeDtypeStruct leaves) with a PartitionSpec in
    every field."""
    rules = rules or rules_for(mesh)
    name = type(cache).__name__
    if name not in CACHE_AXES:
        raise ValueError(f"no sharding rules for cache type {name}; known: {sorted(CACHE_AXES)}")
    specs = {}
    for field, axes in CACHE_AXES[name].items():
        leaf = getattr(cache, field)
        specs[field] = logical_to_spec(axes, tuple(leaf.shape), mesh, rules, where=f"{name}.{field}")
    return dataclasses.replace(cache, **specs)


def named(mesh, spec_tree):
    """PartitionSpec pytree -> NamedSharding pytree on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, P))


def checkpoint_shardings(mesh, cfg, rules: Optional[ShardingRules] = None):
    """The ``shardings=`` callable for ``kimi.load_checkpoint(path, mesh=mesh, shardings=...)``: every tensor is
    placed on its rule's sharding as it streams in (``cfg = KimiConfig.from_hf_config(path)``)."""
    rules = rules or rules_for(mesh)
    kinds = cfg.layer_kinds

    def sharding_of(path: str, shape, dtype):
        key = canonical_key(path, kinds)
        return NamedSharding(mesh, logical_to_spec(param_axes(key, len(shape)), tuple(shape), mesh, rules, path))

    return sharding_of


def spec_to_json(spec: P) -> list:
    """A PartitionSpec as a JSON-able list (None, an axis name, or a list of names per dim)."""
    return [list(a) if isinstance(a, tuple) else a for a in spec]
