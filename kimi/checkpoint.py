"""HF / PyTorch safetensors checkpoints by the official tensor names: loading, streamed onto a mesh; the tables.

Layout
------
A checkpoint is a directory with ``config.json`` (read by :meth:`KimiConfig.from_hf_config`) and either one
``model.safetensors`` or several shards listed in ``model.safetensors.index.json``. Tensor names are the official
Kimi-Linear / K3 ones (``model.layers.N.self_attn.q_proj.weight``, ``...block_sparse_moe.experts.E.w1.weight`` or,
for MXFP4 experts, ``.weight_packed`` / ``.weight_scale``).

Two tables carry everything:

* :data:`PARAM_TABLE` maps every NNX state path of :class:`kimi.KimiForCausalLM` to its official checkpoint
  name and a transform (``linear``: our kernels are ``[in, out]``, checkpoints store ``weight [out, in]``;
  ``conv``: ``[C, K]`` here, ``[C, 1, K]`` there; ``a_log``: ``[H]`` here; ``experts``: one stacked
  ``[E, out, in]`` array here, one tensor per expert there; ``copy``: as is).
* :data:`ALIAS_TABLE` maps the other names we accept onto official names: K3's ``language_model.`` prefix
  (its text weights live under ``language_model.model.*`` / ``language_model.lm_head.*``; the bare header form
  ``language_model.layers.*`` is accepted too), what transformers' ``save_pretrained`` writes for
  ``KimiLinearForCausalLM`` (official names, except the dense layer's MLP under ``block_sparse_moe.`` and
  ``A_log`` as ``[1, 1, H, 1]``), and transformers' in-memory module names (``forget_gate.*``, one fused
  ``conv1d [3P, 1, K]``, ``mlp.*`` with fused experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``),
  split into the official per-expert tensors.

Loading (:func:`load_checkpoint`)
---------------------------------
1. The model is built abstractly (``nnx.eval_shape`` under :func:`kimi.layers.shape_only_init`): shapes and
   dtypes only, nothing allocated.
2. Every safetensors header is read and checked against the tables before any tensor data is read. All missing,
   unexpected, duplicated, mis-shaped and mis-typed tensors are reported in **one** ``ValueError``, with the
   expected and the found shape / dtype. A truncated or corrupt file is a ``ValueError`` naming the file.
3. Parameters are then filled one at a time: read (``safetensors.safe_open``; a memory map for dtypes NumPy does
   not know, such as BF16), transformed, cast to the parameter's dtype and placed on its sharding with
   ``jax.make_array_from_callback``. The host holds one parameter at a time, never the whole checkpoint.
   Floating-point tensors may be stored in any float dtype (F16 / BF16 / F32 / F64) and are cast; MXFP4 codes
   and scales must be U8.

MXFP4 experts
-------------
``cfg.expert_format`` (from ``quantization_config``, or ``config_overrides``) decides what the model holds; the
tensors present decide what the checkpoint holds. Packed to packed and dense to dense are copies. Otherwise the
loader converts explicitly with :mod:`kimi.mxfp4`: a packed checkpoint into a dense model is dequantised
(exact), a dense checkpoint into an MXFP4 model is quantised (OCP MX rounding, lossy).

Saving: :func:`kimi.checkpoint_save.save_checkpoint`, by the same tables.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping, Optional, Union

import jax
import numpy as np
from flax import nnx

from kimi import mxfp4
from kimi import safetensors_io as st
from kimi.config import KimiConfig
from kimi.model import abstract_model
from kimi.safetensors_io import INDEX_FILE, NP_TO_ST, LoadReport, TensorSource, fmt_shape

__all__ = ["load_checkpoint", "PARAM_TABLE", "ALIAS_TABLE", "checkpoint_names"]

CONFIG_FILE = "config.json"

# ---------------------------------------------------------------------------------------------------------------
# The mapping table: NNX state path (regex, dotted) -> official checkpoint name (template) and transform.
_L = r"model\.layers\.(?P<i>\d+)\."
_CL = "model.layers.{i}."
# routed experts: one checkpoint tensor per expert, dense ("weight") or MXFP4 ("weight_packed" + "weight_scale")
_V, _CV = r"vision_tower\.encoder\.blocks\.(?P<i>\d+)\.", "vision_tower.encoder.blocks.{i}."
_EXPERT = {s: _CL + "block_sparse_moe.experts.{e}.{w}." + s for s in ("weight", "weight_packed", "weight_scale")}
PARAM_TABLE: tuple[tuple[str, str, str], ...] = (
    # NNX path                                                          checkpoint name                      transform
    (r"model\.embed_tokens\.embedding", "model.embed_tokens.weight", "copy"),
    # per layer: norms and AttnRes sites ([D, 1] kernel <-> [1, D] weight)
    (_L + r"(?P<p>input_layernorm|post_attention_layernorm|self_attention_res_norm|mlp_res_norm)\.weight",
     _CL + "{p}.weight", "copy"),
    (_L + r"(?P<p>self_attention_res_proj|mlp_res_proj)\.kernel", _CL + "{p}.weight", "linear"),
    # KDA (q_proj, o_proj and g_proj also serve MLA: same names)
    (_L + r"self_attn\.(?P<p>q_proj|k_proj|v_proj|f_a_proj|f_b_proj|b_proj|g_proj|g_a_proj|g_b_proj|o_proj)"
     r"\.kernel", _CL + "self_attn.{p}.weight", "linear"),
    (_L + r"self_attn\.(?P<p>[qkv])_conv1d", _CL + "self_attn.{p}_conv1d.weight", "conv"),
    (_L + r"self_attn\.A_log", _CL + "self_attn.A_log", "a_log"),
    (_L + r"self_attn\.dt_bias", _CL + "self_attn.dt_bias", "copy"),
    (_L + r"self_attn\.o_norm\.weight", _CL + "self_attn.o_norm.weight", "copy"),
    # MLA
    (_L + r"self_attn\.(?P<p>q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.kernel", _CL + "self_attn.{p}.weight",
     "linear"),
    (_L + r"self_attn\.(?P<p>q_a_layernorm|kv_a_layernorm)\.weight", _CL + "self_attn.{p}.weight", "copy"),
    # dense MLP (first_k_dense_replace layers)
    (_L + r"mlp\.(?P<p>gate_proj|up_proj|down_proj)\.kernel", _CL + "mlp.{p}.weight", "linear"),
    # MoE: router, latent projections and norm, shared experts, routed experts (one checkpoint tensor per expert)
    (_L + r"block_sparse_moe\.gate\.(?P<p>weight|e_score_correction_bias)", _CL + "block_sparse_moe.gate.{p}",
     "copy"),
    (_L + r"block_sparse_moe\.(?P<p>routed_expert_down_proj|routed_expert_up_proj)\.kernel",
     _CL + "block_sparse_moe.{p}.weight", "linear"),
    (_L + r"block_sparse_moe\.routed_expert_norm\.weight", _CL + "block_sparse_moe.routed_expert_norm.weight", "copy"),
    (_L + r"block_sparse_moe\.shared_experts\.(?P<p>gate_proj|up_proj|down_proj)\.kernel",
     _CL + "block_sparse_moe.shared_experts.{p}.weight", "linear"),
    (_L + r"block_sparse_moe\.experts\.(?P<w>w[123])", _EXPERT["weight"], "experts"),
    (_L + r"block_sparse_moe\.experts\.(?P<w>w[123])_packed", _EXPERT["weight_packed"], "experts"),
    (_L + r"block_sparse_moe\.experts\.(?P<w>w[123])_scale", _EXPERT["weight_scale"], "experts"),
    # model level
    (r"model\.norm\.weight", "model.norm.weight", "copy"),
    (r"model\.output_attn_res_norm\.weight", "model.output_attn_res_norm.weight", "copy"),
    (r"model\.output_attn_res_proj\.kernel", "model.output_attn_res_proj.weight", "linear"),
    (r"lm_head\.kernel", "lm_head.weight", "linear"),
    # vision tower and projector (KimiConfig.vision): the official K2.5 / K3 names
    (r"vision_tower\.patch_embed\.proj\.kernel", "vision_tower.patch_embed.proj.weight", "patch"),
    (r"vision_tower\.patch_embed\.proj\.bias", "vision_tower.patch_embed.proj.bias", "copy"),
    (r"vision_tower\.patch_embed\.pos_emb\.weight", "vision_tower.patch_embed.pos_emb.weight", "copy"),
    (_V + r"(?P<p>wqkv|wo|mlp\.fc0|mlp\.fc1)\.kernel", _CV + "{p}.weight", "linear"),
    (_V + r"(?P<p>wqkv|wo|mlp\.fc0|mlp\.fc1|norm0|norm1)\.(?P<w>bias)", _CV + "{p}.{w}", "copy"),
    (_V + r"(?P<p>norm0|norm1)\.weight", _CV + "{p}.weight", "copy"),
    (r"vision_tower\.encoder\.final_layernorm\.(?P<w>weight|bias)", "vision_tower.encoder.final_layernorm.{w}",
     "copy"),
    (r"mm_projector\.pre_norm\.(?P<w>weight|bias)", "mm_projector.pre_norm.{w}", "copy"),
    (r"mm_projector\.proj(?P<j>[02])\.kernel", "mm_projector.proj.{j}.weight", "linear"),
    (r"mm_projector\.proj(?P<j>[02])\.bias", "mm_projector.proj.{j}.bias", "copy"),
    (r"mm_projector\.post_norm\.weight", "mm_projector.post_norm.weight", "copy"),  # K3's name not verified
)

# The alias table: other names found in checkpoints -> official names. Applied in order to each tensor name:
# a "rename" rewrites the name and goes on; a "split" (axis 0, equal parts) or "experts" (axis 0 is the expert,
# then axis 1 split in equal parts) turns one fused tensor into several official ones and ends the chain.
_AL = r"(?P<l>model\.layers\.\d+)\."
ALIAS_TABLE: tuple[tuple[str, str, Union[str, tuple[str, ...]]], ...] = (
    # found (regex)                                           kind       official name(s)                 written by
    (r"language_model\.(?P<rest>(?:model|lm_head)\..+)", "rename", "{rest}"),  # K3 (multimodal wrapper)
    (r"language_model\.(?P<rest>(?:layers|embed_tokens|norm|output_attn_res_norm|output_attn_res_proj)\..+)",
     "rename", "model.{rest}"),  # K3, shard-header form
    (_AL + r"block_sparse_moe\.(?P<p>gate_proj|up_proj|down_proj)\.weight", "rename",
     "{l}.mlp.{p}.weight"),  # transformers save_pretrained: the dense layer's MLP
    (_AL + r"self_attn\.forget_gate\.(?P<p>f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", "rename",
     "{l}.self_attn.{p}"),  # transformers state_dict
    (_AL + r"mlp\.(?P<p>gate\.weight|gate\.e_score_correction_bias|shared_experts\.(?:gate|up|down)_proj\.weight)",
     "rename", "{l}.block_sparse_moe.{p}"),  # transformers state_dict
    (_AL + r"self_attn\.conv1d\.weight", "split",
     ("{l}.self_attn.q_conv1d.weight", "{l}.self_attn.k_conv1d.weight", "{l}.self_attn.v_conv1d.weight")),
    (_AL + r"mlp\.experts\.gate_up_proj", "experts",
     ("{l}.block_sparse_moe.experts.{e}.w1.weight", "{l}.block_sparse_moe.experts.{e}.w3.weight")),  # [E, 2I, D]
    (_AL + r"mlp\.experts\.down_proj", "experts", ("{l}.block_sparse_moe.experts.{e}.w2.weight",)),  # [E, D, I]
    # transformers' save_pretrained of Kimi_K25ForConditionalGeneration (its reverse renaming)
    (r"vision_tower\.encoder\.patch_embed\.(?P<rest>.+)", "rename", "vision_tower.patch_embed.{rest}"),
    (r"model\.mm_projector\.(?P<rest>.+)", "rename", "mm_projector.{rest}"),
)

# Tensors a checkpoint may hold that the text model does not use: K3's vision tower and projector.
_IGNORED = re.compile(r"(?:vision_tower|mm_projector|multi_modal_projector|vision_model)\..*")

_PARAM_RES = tuple((re.compile(p), t, k) for p, t, k in PARAM_TABLE)
_ALIAS_RES = tuple((re.compile(p), k, t) for p, k, t in ALIAS_TABLE)

_FLOAT_OK = ("F16", "BF16", "F32", "F64")  # float parameters accept any of these (cast on load)

Shardings = Union[None, Mapping[str, jax.sharding.Sharding], Callable[..., Optional[jax.sharding.Sharding]]]


# ---------------------------------------------------------------------------------------------------------------
# Parameter entries: one per NNX state leaf


@dataclasses.dataclass
class _Entry:
    path: str  # dotted NNX state path
    transform: str
    names: list  # official checkpoint names (one per expert for "experts")
    shape: tuple  # parameter shape
    dtype: np.dtype  # parameter dtype
    groups: dict  # regex groups (layer index, projection, expert weight)


def _path_str(path) -> str:
    return ".".join(str(p) for p in path)


def _match_param(path: str):
    for rx, template, transform in _PARAM_RES:
        m = rx.fullmatch(path)
        if m:
            return template, transform, m.groupdict()
    raise RuntimeError(f"kimi.checkpoint.PARAM_TABLE has no checkpoint name for the model parameter {path!r}")


def _entries(flat_state) -> list[_Entry]:
    out = []
    for path, var in flat_state:
        p = _path_str(path)
        value = var.get_value()
        template, transform, groups = _match_param(p)
        shape = tuple(value.shape)
        if transform == "experts":
            names = [template.format(e=e, **groups) for e in range(shape[0])]
        else:
            names = [template.format(**groups)]
        out.append(_Entry(p, transform, names, shape, np.dtype(value.dtype), groups))
    return out


def _a_log_saved_shape(cfg: KimiConfig, H: int) -> tuple:
    """Kimi-Linear (softplus gate): [1, 1, H, 1], as transformers and the official Kimi-Linear checkpoints; K3: [H]."""
    return (1, 1, H, 1) if cfg.kda_gate_lower_bound is None else (H,)


def _ckpt_shape(entry: _Entry, cfg: KimiConfig) -> tuple:
    """The checkpoint shape of each of ``entry.names`` (as saved)."""
    s, t = entry.shape, entry.transform
    if t == "linear":
        return (s[1], s[0])
    if t == "conv":
        return (s[0], 1, s[1])
    if t == "a_log":
        return _a_log_saved_shape(cfg, s[0])
    if t == "experts":
        return s[1:]
    if t == "patch":  # Conv2d weight [D, C, p, p]
        v = cfg.vision
        return (s[1], v.in_channels, v.patch_size, v.patch_size)
    return s


def checkpoint_names(cfg: KimiConfig) -> dict:
    """{official checkpoint name: (shape, dtype name)} of what :func:`save_checkpoint` writes for ``cfg``."""
    out = {}
    for e in _entries(nnx.to_flat_state(nnx.state(abstract_model(cfg)))):
        for n in e.names:
            out[n] = (_ckpt_shape(e, cfg), NP_TO_ST[e.dtype])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Where each official tensor comes from


def _resolve_aliases(name: str, shape: tuple, problems: list) -> list:
    """Official names (with an index into the found tensor, or None) that ``name`` provides."""
    for rx, kind, target in _ALIAS_RES:
        m = rx.fullmatch(name)
        if not m:
            continue
        g = m.groupdict()
        if kind == "rename":
            name = target.format(**g)
            continue
        n = len(target)
        if kind == "split":
            if not shape or shape[0] % n:
                problems.append(f"{name}: shape {fmt_shape(shape)} cannot be split into {n} equal parts along "
                                "axis 0")
                return []
            c = shape[0] // n
            return [(t.format(**g), (slice(j * c, (j + 1) * c),)) for j, t in enumerate(target)]
        # experts: axis 0 = expert, axis 1 split into n equal parts
        if len(shape) != 3 or shape[1] % n:
            problems.append(f"{name}: shape {fmt_shape(shape)} is not [E, {n} * out, in]")
            return []
        c = shape[1] // n
        return [(t.format(e=e, **g), (e, slice(j * c, (j + 1) * c)) if n > 1 else (e,))
                for e in range(shape[0]) for j, t in enumerate(target)]
    return [(name, None)]


# ---------------------------------------------------------------------------------------------------------------
# Load


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    return np.dtype(dtype).name


def _check_src(report: LoadReport, name: str, src: TensorSource, want_shape, want_kinds) -> bool:
    ok = True
    if callable(want_shape):
        good, expected = want_shape(src.shape)
    else:
        good, expected = tuple(src.shape) == tuple(want_shape), fmt_shape(want_shape)
    if not good:
        report.shape.append(f"{name}: expected {expected}, found {fmt_shape(src.shape)} ({src.where()})")
        ok = False
    if src.dtype not in want_kinds:
        report.dtype.append(f"{name}: expected {'|'.join(want_kinds)}, found {src.dtype} ({src.where()})")
        ok = False
    return ok


def _a_log_shape_ok(H: int):
    def check(shape):
        s = tuple(shape)
        good = (len(s) == 1 and s[0] >= H) or (int(np.prod(s)) == H and sum(d != 1 for d in s) <= 1)
        return good, f"[{H}] (or [N>={H}] zero-padded, or [1,1,{H},1])"

    return check


def _load_transform(entry: _Entry, arr: np.ndarray) -> np.ndarray:
    t = entry.transform
    if t == "linear":
        return arr.T
    if t == "conv":
        return arr.reshape(arr.shape[0], arr.shape[-1])
    if t == "a_log":
        return arr.reshape(-1)[: entry.shape[0]]
    if t == "patch":
        return arr.reshape(arr.shape[0], -1).T
    return arr


def _plan_load(entries, provided: dict, cfg: KimiConfig, report: LoadReport):
    """Checks every entry against the found tensors; returns ([(paths, fn -> {path: host array})], names used)."""
    used: set = set()
    plans = []
    experts: dict = {}
    for entry in entries:
        if entry.transform == "experts":
            experts.setdefault((int(entry.groups["i"]), entry.groups["w"]), []).append(entry)
            continue
        name = entry.names[0]
        want_shape = _ckpt_shape(entry, cfg)
        kinds = ("U8",) if entry.dtype == np.uint8 else _FLOAT_OK
        src = provided.get(name)
        if src is None:
            report.missing.append(f"{name}: expected {fmt_shape(want_shape)} {'|'.join(kinds)}")
            continue
        used.add(name)
        if entry.transform == "a_log":
            want_shape = _a_log_shape_ok(entry.shape[0])
        if _check_src(report, name, src, want_shape, kinds):
            plans.append(([entry.path], lambda e=entry, s=src: {e.path: _load_transform(e, s.read())}))
    for (i, w), group in experts.items():
        plans += _plan_experts(i, w, group, provided, cfg, report, used)
    return plans, used


def _plan_experts(i, w, group, provided, cfg, report, used) -> list:
    """One expert weight (w1 / w2 / w3) of one layer: dense or MXFP4 in memory, dense or MXFP4 in the checkpoint."""
    by_kind = {("packed" if e.path.endswith("_packed") else "scale" if e.path.endswith("_scale") else "dense"): e
               for e in group}
    mem = "mxfp4" if "packed" in by_kind else "dense"
    if mem == "mxfp4":
        E, O, H2 = by_kind["packed"].shape
        I = 2 * H2
    else:
        E, O, I = by_kind["dense"].shape
    layouts = {
        "dense": {"weight": ((O, I), _FLOAT_OK)},
        "mxfp4": {"weight_packed": ((O, I // 2), ("U8",)), "weight_scale": ((O, I // mxfp4.BLOCK_SIZE), ("U8",))},
    }
    present = {fmt: sum(_EXPERT[suffix].format(i=i, e=e, w=w) in provided for suffix in lay for e in range(E))
               / (E * len(lay)) for fmt, lay in layouts.items()}
    complete = [f for f in ("mxfp4", "dense") if present[f] == 1.0]
    if complete:
        src_fmt = mem if mem in complete else complete[0]
    else:
        src_fmt = max(layouts, key=lambda f: (present[f], f == mem))
    srcs: dict = {}
    ok = True
    for suffix, (shape, kinds) in layouts[src_fmt].items():
        srcs[suffix] = []
        for e in range(E):
            name = _EXPERT[suffix].format(i=i, e=e, w=w)
            src = provided.get(name)
            if src is None:
                report.missing.append(f"{name}: expected {fmt_shape(shape)} {'|'.join(kinds)}")
                ok = False
                continue
            used.add(name)
            ok &= _check_src(report, name, src, shape, kinds)
            srcs[suffix].append(src)
    if not ok:
        return []

    def stack(suffix):
        return np.stack([s.read() for s in srcs[suffix]])

    if mem == "dense":
        path = by_kind["dense"].path
        if src_fmt == "dense":
            return [([path], lambda: {path: stack("weight")})]
        return [([path], lambda: {path: mxfp4.dequantize(stack("weight_packed"), stack("weight_scale"))})]
    pp, sp = by_kind["packed"].path, by_kind["scale"].path
    if src_fmt == "mxfp4":
        return [([pp], lambda: {pp: stack("weight_packed")}), ([sp], lambda: {sp: stack("weight_scale")})]

    def quantize():
        packed, scale = mxfp4.quantize(stack("weight").astype(np.float32))
        return {pp: packed, sp: scale}

    return [([pp, sp], quantize)]


def _sharding_for(path: str, shape, dtype, mesh, shardings: Shardings):
    sh = None
    if isinstance(shardings, Mapping):
        sh = shardings.get(path)
    elif callable(shardings):
        sh = shardings(path, shape, dtype)
    if sh is None and mesh is not None:
        # No sharding rules for this parameter: replicate it on the mesh (the rules live in sharding/rules.py).
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return sh


def _place(host: np.ndarray, sharding):
    if sharding is None:
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _collect(path: str, report: LoadReport, skip) -> dict:
    """{official name: TensorSource} of every tensor in the checkpoint at ``path`` (aliases resolved), except the
    names ``skip(name)`` is true for; duplicates and index mismatches go to ``report``."""
    files, weight_map = st.checkpoint_files(path)
    readers = [st.SafetensorsFile(f) for f in files]  # raises on a truncated / corrupt file
    provided: dict = {}
    found_in: dict = {}
    for r in readers:
        for key, info in r.tensors.items():
            dt, shape = info.dtype, info.shape
            if key in found_in:
                report.other.append(f"duplicate: {key} in both {os.path.basename(found_in[key])} and "
                                    f"{os.path.basename(r.path)}")
                continue
            found_in[key] = r.path
            if weight_map is not None and weight_map.get(key) != os.path.basename(r.path):
                report.other.append(f"index: {key} is in {os.path.basename(r.path)} but {INDEX_FILE} says "
                                    f"{weight_map.get(key)}")
            if skip(key):
                continue
            for official, index in _resolve_aliases(key, shape, report.shape):
                src = TensorSource(r, key, index, st.index_shape(shape, index), dt)
                if official in provided:
                    report.other.append(f"duplicate: {official} provided by {provided[official].where()} and "
                                        f"{src.where()}")
                    continue
                provided[official] = src
    if weight_map is not None:
        for key, fname in weight_map.items():
            if key not in found_in:
                report.other.append(f"index: {INDEX_FILE} lists {key} in {fname}, which does not hold it")

    return provided


def _fill(graphdef, flat, plans, mesh, shardings):
    """Run the load plans one parameter at a time and merge the placed values into the module."""
    by_path = {_path_str(p): v for p, v in flat}
    values: dict = {}
    for _, fn in plans:
        for p, host in fn().items():
            var = by_path[p]
            want = var.get_value()
            host = np.asarray(host)
            if tuple(host.shape) != tuple(want.shape):  # the tables above guarantee this; a bug otherwise
                raise RuntimeError(f"{p}: built shape {host.shape}, the model expects {want.shape}")
            host = host.astype(want.dtype, copy=False)
            values[p] = _place(host, _sharding_for(p, want.shape, want.dtype, mesh, shardings))
            del host
    state = nnx.from_flat_state([(p, v.replace(values[_path_str(p)])) for p, v in flat])
    return nnx.merge(graphdef, state)


def load_checkpoint(path, mesh: Optional[jax.sharding.Mesh] = None, dtype=None,
                    config_overrides: Optional[Mapping[str, Any]] = None, shardings: Shardings = None):
    """Build a :class:`kimi.KimiForCausalLM` from an HF-format directory (``config.json`` + safetensors).

    Args:
      path: the checkpoint directory.
      mesh: place every parameter on this mesh (replicated unless ``shardings`` says otherwise).
      dtype: parameter dtype (``"float32"`` / ``"bfloat16"`` or a dtype); default: the config's ``torch_dtype``.
        Tensors the model keeps in fp32 (norms, conv, gates, router) stay fp32; MXFP4 codes stay uint8.
      config_overrides: KimiConfig fields that win over config.json (e.g. ``{"expert_format": "dense"}`` to
        dequantise MXFP4 experts at load, ``{"kda_chunk_size": 64}``).
      shardings: a dict {NNX path: Sharding} or a callable ``(path, shape, dtype) -> Sharding | None``; paths are
        dotted NNX state paths such as ``"model.layers.1.block_sparse_moe.experts.w1_packed"``.

    Raises ValueError listing every missing / unexpected / mis-shaped / mis-typed tensor at once, or naming a
    truncated or corrupt file; nothing is read before the headers check out.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"load_checkpoint: {path} is not a directory (expected config.json + *.safetensors)")
    overrides = dict(config_overrides or {})
    if dtype is not None:
        overrides["param_dtype"] = _dtype_name(dtype)
    cfg = KimiConfig.from_hf_config(path, **overrides)

    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    flat = list(nnx.to_flat_state(abstract_state))
    entries = _entries(flat)

    report = LoadReport(path)
    tied = ("lm_head.weight", "language_model.lm_head.weight") if cfg.tie_word_embeddings else ()
    provided = _collect(path, report, lambda key: (cfg.vision is None and _IGNORED.fullmatch(key)) or key in tied)
    plans, used = _plan_load(entries, provided, cfg, report)
    for official, src in provided.items():
        if official not in used:
            what = official if src.key == official and src.index is None else f"{official} (from {src.where()})"
            report.unexpected.append(f"{what}: {fmt_shape(src.shape)} {src.dtype}")
    report.raise_if_any()

    return _fill(graphdef, flat, plans, mesh, shardings)
