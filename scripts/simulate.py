"""Full-size dry run: Kimi K3 plus its DSpark drafter, sharded by sharding/rules.py over 16 simulated devices.
Nothing of the model is allocated: shapes come from ``nnx.eval_shape`` of the real modules.

  python scripts/simulate.py --preset k3 --mesh tp16 --json
  python scripts/simulate.py --preset k3 --mesh dp16-ep16 --json
  python scripts/simulate.py --preset k3 --mesh data=2,tensor=8 --context 131072

It reports:
  * per-device bytes: parameters (routed experts as packed MXFP4 codes + E8M0 scales), the KDA state, the MLA
    latent cache at ``--context`` positions, the drafter's parameters and context K/V, and whether it all fits a
    GB300's HBM (288 GB), plus the longest context that would; the same per ``--batches`` (default 1 and 16:
    ``memory_by_batch``), e.g. ``--context 1000000`` for K3's million-token context;
  * an AOT ``jax.jit(...).lower(...).compile()`` of one full-width decode step of a KDA layer, an MLA layer (its
    cache at ``--context``) and a MoE layer, on the simulated devices with abstract, sharded inputs: XLA's memory
    analysis and the collectives in the compiled HLO (count and result bytes per device);
  * a roofline for batch-1 decode on 16 GB300s (HBM ``--hbm-tbps`` each, every collective ``--coll-latency-us``
    plus its bytes over ``--link-gbps``): plain decoding, and DSpark at ``--accept-len`` tokens per step, printed
    beside seed 000's measured 118 / 370 / 464 tokens/s. A bound from bytes and collective counts, not a
    measurement.

The K3 drafter is published with MLA draft layers (``DSparkConfig.k3()``, attention="mla"), which jdspark does
not implement yet; the drafter sized here is the gqa layer at the K3 widths (64 heads x 192, 64 KV heads,
MLP 14336, 5 layers, Markov rank 256), said so in the output, with the MLA drafter's latent cache as an estimate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB300_HBM_BYTES = 288e9
SEED_000 = {"plain": 118.0, "dspark": 370.0, "dspark_peak": 464.0}  # tokens/s, bs=1, 16 GB300s (seed 000)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_COLL_RE = re.compile(r"=\s*(?P<res>\([^()]*\)|\S+)\s+(?P<op>" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
_SHAPE_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def _device_count(spec: str) -> int:
    m = re.fullmatch(r"tp(\d+)", spec) or re.fullmatch(r"dp(\d+)-ep\d+", spec)
    if m:
        return int(m.group(1))
    return math.prod(int(kv.split("=")[1]) for kv in spec.split(","))


def _mesh_spec(spec: str):
    if "=" in spec:
        return {kv.split("=")[0].strip(): int(kv.split("=")[1]) for kv in spec.split(",")}
    return spec


# ---------------------------------------------------------------------------------------------------- HLO
def collectives(hlo_text: str) -> dict:
    """Collective ops in compiled HLO text: count, result bytes per device, and both by op (async pairs counted
    once, at their -start)."""
    by_op: dict = {}
    for m in _COLL_RE.finditer(hlo_text):
        nbytes = 0
        for dt, dims in _SHAPE_RE.findall(m.group("res")):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            nbytes += n * _DTYPE_BYTES.get(dt, 1)
        e = by_op.setdefault(m.group("op"), {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += nbytes
    return {"count": sum(e["count"] for e in by_op.values()), "bytes": sum(e["bytes"] for e in by_op.values()),
            "by_op": by_op}


# ---------------------------------------------------------------------------------------------------- sizes
def _shard_bytes(shape, dtype, mesh, spec) -> int:
    import numpy as np
    from jax.sharding import NamedSharding

    local = NamedSharding(mesh, spec).shard_shape(tuple(shape))
    return int(math.prod(local)) * np.dtype(dtype).itemsize


def _total_bytes(shape, dtype) -> int:
    import numpy as np

    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def param_memory(model, mesh, rules) -> dict:
    """Per-device and total bytes of every parameter leaf, split into routed experts / embedding / the rest."""
    from flax import nnx

    from sharding.rules import param_specs, path_parts

    specs = param_specs(model, mesh, rules)
    out = {"per_device": {}, "total": {}}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        dotted = ".".join(path_parts(path))
        part = ("vision" if dotted.startswith(("vision_tower.", "mm_projector."))
                else "routed_experts" if ".experts." in dotted and "shared" not in dotted
                else "embedding" if dotted.endswith("embed_tokens.embedding") or "markov_w1" in dotted
                else "lm_head" if dotted.startswith("lm_head") else "other")
        for k, v in (("per_device", _shard_bytes(var.shape, var.dtype, mesh, specs[dotted])),
                     ("total", _total_bytes(var.shape, var.dtype))):
            out[k][part] = out[k].get(part, 0) + v
    out["per_device_bytes"] = sum(out["per_device"].values())
    out["total_bytes"] = sum(out["total"].values())
    return out


def vision_memory(cfg, tmem: dict, max_patches: int) -> dict | None:
    """The vision tower's share: its parameters per device (replicated, ``kimi.partitioning``) and the encoder's
    largest live activations for one image of ``max_patches`` patches (the preprocessor's cap), by formula: the
    residual stream, q|k|v, the MLP's hidden and one clip's fp32 attention scores [H, N, N] (the tower attends clip
    by clip, ``kimi.vision.clip_attention``); the merged features [N / (kh kw), text hidden] enter the prefill."""
    v = cfg.vision
    if v is None:
        return None
    import numpy as np
    N, it = max_patches, np.dtype(cfg.param_dtype).itemsize
    kh, kw = v.merge_kernel_size
    act = {"residual": N * v.hidden_size * it, "qkv": N * 3 * v.qkv_dim * it,
           "mlp_hidden": N * v.intermediate_size * it, "attention_scores_fp32": v.num_attention_heads * N * N * 4}
    return {"per_device_param_bytes": tmem["per_device"].get("vision", 0),
            "param_bytes_total": tmem["total"].get("vision", 0), "image_patches": N, "merged_tokens": N // (kh * kw),
            "encoder_activation_bytes": act, "encoder_peak_activation_bytes": sum(act.values()),
            "features_bytes": N // (kh * kw) * cfg.hidden_size * 4}


def cache_memory(cache, mesh, rules) -> dict:
    import dataclasses

    from sharding.rules import cache_specs

    specs = cache_specs(cache, mesh, rules)
    return {f.name: _shard_bytes(getattr(cache, f.name).shape, getattr(cache, f.name).dtype, mesh,
                                 getattr(specs, f.name)) for f in dataclasses.fields(cache)}


def _param_count(model) -> int:
    from flax import nnx

    n = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = str(path[-1])
        if name.endswith("_scale"):
            continue
        n += int(math.prod(var.shape)) * (2 if name.endswith("_packed") else 1)
    return n


# ---------------------------------------------------------------------------------------------------- AOT
def compile_layer(kind: str, cfg, mesh, rules, batch: int, context: int) -> dict:
    """Lower and compile one full-width decode step of a KDA mixer, an MLA mixer or a LatentMoE on ``mesh`` from
    abstract, sharded inputs, with the sharding plan a sharded model carries."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from kimi.layers import GatedMLA, KimiDeltaAttention, LatentMoE, shape_only_init
    from kimi.partitioning import set_partitioner
    from sharding.rules import CACHE_AXES, logical_to_spec, module_param_specs, path_parts
    from sharding.shard import ShardingPlan

    t0 = time.time()
    Mod = {"kda": KimiDeltaAttention, "mla": GatedMLA, "moe": LatentMoE}[kind]
    with shape_only_init():
        mod = nnx.eval_shape(lambda: Mod(cfg, rngs=nnx.Rngs(0)))
    set_partitioner(mod, ShardingPlan(mesh, rules))
    graphdef, state = nnx.split(mod)
    specs = module_param_specs(mod, kind, mesh, rules)
    def placed(p, v):
        sh = NamedSharding(mesh, specs[".".join(path_parts(p))])
        return v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh))

    state = nnx.from_flat_state([(p, placed(p, v)) for p, v in nnx.to_flat_state(state)])

    def arg(shape, dtype, axes, where):
        sh = NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules, where))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh), sh

    D, dt, B = cfg.hidden_size, cfg.dtype, batch
    x, x_sh = arg((B, 1, D), dt, ("batch", None, None), "x")
    ca = CACHE_AXES["KimiCache"]
    if kind == "kda":
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        s, s_sh = arg((B, H, K, K), jnp.float32, ca["kda_state"][1:], "kda_state")
        c, c_sh = arg((B, cfg.short_conv_kernel_size - 1, 3 * cfg.kda_proj_dim), dt, ca["conv_state"][1:], "conv")

        def step(st, x, s, c):
            o = nnx.merge(graphdef, st)(x, s, c, "decode")
            return o.y_BTD, o.state_BHKV, o.conv_BWC

        fn = jax.jit(step, donate_argnums=(2, 3), out_shardings=(x_sh, s_sh, c_sh))
        args = (state, x, s, c)
    elif kind == "mla":
        # the layer writes into the stacked latent caches [n_mla, B, S, .]: here a stack of one
        ckv, ckv_sh = arg((1, B, context, cfg.kv_lora_rank), dt, ca["mla_ckv"], "mla_ckv")
        kpe, kpe_sh = arg((1, B, context, cfg.qk_rope_head_dim), dt, ca["mla_kpe"], "mla_kpe")
        ln, _ = arg((B,), jnp.int32, ca["length"], "length")

        def step(st, x, ckv, kpe, ln):
            return nnx.merge(graphdef, st)(x, ckv, kpe, 0, ln, absorbed=True)

        fn = jax.jit(step, donate_argnums=(2, 3), out_shardings=(x_sh, ckv_sh, kpe_sh))
        args = (state, x, ckv, kpe, ln)
    else:
        def step(st, x):
            return nnx.merge(graphdef, st)(x)

        fn = jax.jit(step, out_shardings=x_sh)
        args = (state, x)
    compiled = fn.lower(*args).compile()
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                             "temp_size_in_bytes", "generated_code_size_in_bytes")} if ma else {}
    return {"compile_s": round(time.time() - t0, 2), "memory": mem, "collectives": collectives(compiled.as_text())}


# ---------------------------------------------------------------------------------------------------- roofline
def roofline(a: argparse.Namespace, cfg, dcfg, mesh, rules, target_mem, drafter_mem, expert_bytes: float,
             coll_count: int, coll_bytes: int, draft_colls: int, kda_state_dev: int, draft_kv_dev_per_pos: float,
             accept_lens: dict) -> dict:
    """Batch-1 decode bound per device: bytes read from HBM / bandwidth + collectives x latency + collective bytes
    / link bandwidth. Routed experts: uniform independent routing (sharding.moe_ep.expert_load)."""
    from sharding.moe_ep import expert_load

    ms = dict(mesh.shape)
    size = lambda logical: math.prod(ms[x] for x in rules.mesh_axes(logical))  # noqa: E731
    e_shards, h_shards = size("experts"), size("expert_hidden")
    n_moe = sum(k == "moe" for k in cfg.ffn_kinds)
    n_mla = cfg.num_mla_layers
    hbm, lat, link = a.hbm_tbps * 1e12, a.coll_latency_us * 1e-6, a.link_gbps * 1e9
    pd = target_mem["per_device"]
    dense = pd.get("other", 0) + pd.get("lm_head", 0)  # every non-expert weight; the embedding is a lookup
    ctx = a.roofline_context
    mla_read = n_mla * ctx * cfg.mla_cache_dim * cfg.dtype.itemsize / max(1, size("cache_seq"))
    G = dcfg.block_size

    def target_pass(n_tok: int) -> dict:
        load = expert_load(cfg.num_experts, cfg.num_experts_per_token, e_shards, tokens=n_tok)
        experts = n_moe * load["busiest_shard_experts"] * expert_bytes / h_shards
        kda = kda_state_dev * (1 + n_tok)  # read once; written after every position (verify keeps them all)
        mem_bytes = dense + experts + kda + mla_read
        t_mem = mem_bytes / hbm
        t_coll = coll_count * lat + 2 * coll_bytes * n_tok / link
        return {"bytes_per_device": int(mem_bytes), "expert_bytes_per_device": int(experts),
                "experts_on_busiest_device_per_layer": round(load["busiest_shard_experts"], 2),
                "hbm_ms": round(t_mem * 1e3, 4), "collectives_ms": round(t_coll * 1e3, 4),
                "step_ms": round((t_mem + t_coll) * 1e3, 4), "_t": t_mem + t_coll}

    plain = target_pass(1)
    verify = target_pass(G + 1)
    dpd = drafter_mem["per_device"]
    draft_bytes = (dpd.get("other", 0) + pd.get("lm_head", 0)  # drafter weights + the target's lm_head
                   + draft_kv_dev_per_pos * ctx)  # its context K/V
    t_draft = draft_bytes / hbm + draft_colls * lat
    step = verify["_t"] + t_draft
    out = {
        "assumptions": {"devices": math.prod(ms.values()), "hbm_tbps_per_device": a.hbm_tbps,
                        "collective_latency_us": a.coll_latency_us, "link_gbps_per_device": a.link_gbps,
                        "context": ctx, "batch": 1, "routing": "uniform, independent per token",
                        "collectives_per_target_pass": coll_count,
                        "drafter_collectives_per_step": draft_colls},
        "plain": {"tokens_per_s": round(1.0 / plain["_t"], 1),
                  **{k: v for k, v in plain.items() if not k.startswith("_")}},
        "dspark": {"accept_len": a.accept_len, "tokens_per_s": round(a.accept_len / step, 1),
                   "step_ms": round(step * 1e3, 4), "verify_ms": verify["step_ms"],
                   "draft_ms": round(t_draft * 1e3, 4),
                   "verify_experts_on_busiest_device_per_layer": verify["experts_on_busiest_device_per_layer"]},
        # DSpark at the tokens per step that seed 000's measured 370 and 464 tok/s imply (its cost model)
        "dspark_at_seed_accept_lens": {k: {"accept_len": round(v, 2), "tokens_per_s": round(v / step, 1)}
                                       for k, v in accept_lens.items()},
        "seed_000_tokens_per_s": SEED_000,
    }
    return out


# ---------------------------------------------------------------------------------------------------- main
def simulate(a: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    import jdspark
    import kimi
    from jdspark import costmodel
    from jdspark.drafter import DrafterCache, DSparkDrafter
    from kimi.cache import KimiCache
    from kimi.info import abstract_model, param_counts
    from sharding import cache_specs, make_mesh, mesh_name, rules_for

    t_start = time.time()
    cfg = getattr(kimi.KimiConfig, a.preset)()
    mesh = make_mesh(_mesh_spec(a.mesh))
    rules = rules_for(mesh)
    ms = dict(mesh.shape)
    batch = a.batch or (ms["data"] if rules.batch else 1)  # one stream per data-parallel rank

    # ---- target parameters and caches
    counts = param_counts(cfg)
    model = abstract_model(cfg)
    tmem = param_memory(model, mesh, rules)
    ex_total = tmem["total"].get("routed_experts", 0)
    expert_bytes = ex_total / max(1, sum(k == "moe" for k in cfg.ffn_kinds)) / max(1, cfg.num_experts)

    # ---- drafter (gqa layer at the K3 widths; see the module docstring)
    dcfg = (jdspark.DSparkConfig.k3(attention="gqa") if a.preset == "k3"
            else jdspark.DSparkConfig.for_target(cfg, param_dtype=cfg.param_dtype, num_attention_heads=16,
                                                 num_key_value_heads=16))
    drafter = nnx.eval_shape(lambda: DSparkDrafter(dcfg, rngs=nnx.Rngs(1)))
    dmem = param_memory(drafter, mesh, rules)
    hbm = a.hbm_gb * 1e9

    def memory_at(b: int) -> dict:
        """Per-device bytes at batch ``b`` and ``--context`` positions: weights, caches, drafter, fit."""
        cmem = cache_memory(KimiCache.abstract(cfg, b, a.context), mesh, rules)
        kv_shape = (dcfg.num_hidden_layers, b, a.context, dcfg.num_key_value_heads, dcfg.head_dim)
        sds = jax.ShapeDtypeStruct(kv_shape, dcfg.dtype)
        dcache = DrafterCache(sds, sds, jax.ShapeDtypeStruct((), jnp.int32))
        dc = cache_memory(dcache, mesh, rules)
        # the published MLA drafter would cache one 576-wide latent per position and layer (replicated over heads)
        rows = NamedSharding(mesh, cache_specs(dcache, mesh, rules).k).shard_shape(kv_shape)[1]
        m = {"batch": b, "context": a.context, "weights": tmem["per_device_bytes"],
             "drafter_weights": dmem["per_device_bytes"], "kda_states": cmem["kda_state"] + cmem["conv_state"],
             "mla_latent_cache": cmem["mla_ckv"] + cmem["mla_kpe"], "drafter_cache": dc["k"] + dc["v"],
             "mla_drafter_cache_estimate": dcfg.num_hidden_layers * rows * a.context * (512 + 64)
             * dcfg.dtype.itemsize}
        m["total"] = (m["weights"] + m["drafter_weights"] + m["kda_states"] + m["mla_latent_cache"]
                      + m["drafter_cache"])
        m["fits"] = m["total"] <= hbm
        return m

    mem = memory_at(batch)
    kda_bytes, mla_bytes, dcache_bytes = mem["kda_states"], mem["mla_latent_cache"], mem["drafter_cache"]
    mla_draft_est = mem["mla_drafter_cache_estimate"]
    per_device_param_bytes = tmem["per_device_bytes"]
    total = mem["total"]
    fixed = per_device_param_bytes + kda_bytes + dmem["per_device_bytes"]
    per_pos = (mla_bytes + dcache_bytes) / a.context
    by_batch = {str(b): (mem if b == batch else memory_at(b)) for b in sorted({batch, *a.batches})}
    cmem = cache_memory(KimiCache.abstract(cfg, batch, a.context), mesh, rules)

    # ---- one full-width decode step of each layer kind, compiled
    aot = {}
    if not a.no_compile:
        for kind in ("kda", "mla", "moe"):
            aot[kind] = compile_layer(kind, cfg, mesh, rules, batch, a.context)
    n_moe = sum(k == "moe" for k in cfg.ffn_kinds)
    tp = ms["tensor"] > 1
    # not compiled, counted by structure: the dense MLP of layer 0 (1 all-reduce), the embedding lookup from a
    # vocabulary-split table (1) and the vocabulary-split logits' argmax (1) under tensor parallelism
    other = 3 if tp else 0
    if aot:
        c = {k: aot[k]["collectives"] for k in aot}
        coll_count = cfg.num_kda_layers * c["kda"]["count"] + cfg.num_mla_layers * c["mla"]["count"] \
            + n_moe * c["moe"]["count"] + other
        coll_bytes = cfg.num_kda_layers * c["kda"]["bytes"] + cfg.num_mla_layers * c["mla"]["bytes"] \
            + n_moe * c["moe"]["bytes"] + other * cfg.hidden_size * 4
    else:
        coll_count, coll_bytes = 0, 0
    draft_tp = ms["tensor"] > 1 and rules.draft_heads is not None
    # tensor-parallel drafter: o_proj and down_proj all-reduces per layer, fc, logits; per Markov slot the
    # vocabulary-split bias + argmax (1) and the next token's embedding row (1)
    draft_colls = (2 * dcfg.num_hidden_layers + 2 + 2 * dcfg.block_size) if draft_tp else 0
    kda_state_dev = cmem["kda_state"] // batch
    draft_kv_dev_per_pos = dcache_bytes / batch / a.context
    # the tokens per step seed 000's 370 and 464 tok/s imply (its cost model: gamma 7, r 0.1, from 118 tok/s)
    seed_lens = {}
    for tok_s in costmodel.ANCHOR_TOK_S:
        p = costmodel.p_from_speedup(tok_s / costmodel.BASELINE_TOK_S, costmodel.DEFAULT_GAMMA, costmodel.DEFAULT_R)
        e = costmodel.expected_tokens_per_step(p, costmodel.DEFAULT_GAMMA)
        seed_lens[f"{tok_s:.0f}"] = e
    if a.accept_len is None:
        a.accept_len = round(min(seed_lens.values()), 2)
    roof = roofline(a, cfg, dcfg, mesh, rules, tmem, dmem, expert_bytes, coll_count, coll_bytes, draft_colls,
                    kda_state_dev, draft_kv_dev_per_pos, seed_lens) if aot else None

    workspace = max((v["memory"].get("temp_size_in_bytes", 0) for v in aot.values()), default=0)
    return {
        "preset": a.preset, "mesh": mesh_name(mesh), "mesh_shape": ms, "rules": rules.name,
        "devices": math.prod(ms.values()), "batch": batch, "context": a.context,
        "total_params": counts["total_params"], "active_params_per_token": counts["active_params_per_token"],
        "per_device_param_bytes": per_device_param_bytes,
        "per_device_param_bytes_by_part": tmem["per_device"],
        "vision": vision_memory(cfg, tmem, a.max_image_patches),
        "param_bytes_total": tmem["total_bytes"],
        "per_device_kda_state_bytes": kda_bytes,
        "per_device_mla_cache_bytes": mla_bytes,
        "drafter": {"built_as": f"gqa layers at the K3 drafter widths ({dcfg.num_hidden_layers} layers, "
                                f"{dcfg.num_attention_heads}x{dcfg.head_dim} q, {dcfg.num_key_value_heads} kv heads, "
                                f"mlp {dcfg.intermediate_size}); the published K3 drafter uses MLA layers "
                                f"(not implemented)" if a.preset == "k3" else "DSparkConfig.for_target",
                    "params": _param_count(drafter),
                    "per_device_param_bytes": dmem["per_device_bytes"],
                    "per_device_cache_bytes": dcache_bytes,
                    "mla_drafter_cache_bytes_estimate": mla_draft_est},
        "per_device_total_bytes": total,
        "hbm_bytes": int(hbm),
        "fits": total <= hbm,
        "fits_with_mla_drafter_cache": total - dcache_bytes + mla_draft_est <= hbm,
        "max_context_that_fits": int(max(0.0, hbm - fixed) // per_pos) if per_pos else None,
        "memory_by_batch": by_batch,
        "largest_layer_temp_bytes": workspace,
        "aot_decode_step": aot,
        "collectives_per_token": {"count": coll_count, "bytes": coll_bytes,
                                  "not_compiled_counted_by_structure": other},
        "roofline": roof,
        "runtime_s": round(time.time() - t_start, 1),
    }


def _gb(x) -> str:
    return f"{x / 1e9:8.2f} GB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/simulate.py", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3", choices=("k3", "kimi_linear_48b", "demo", "tiny"))
    ap.add_argument("--mesh", default="tp16", help="tp16, dp16-ep16, or explicit dims such as data=2,tensor=8")
    ap.add_argument("--context", type=int, default=1 << 20, help="cached positions for the memory figures")
    ap.add_argument("--batch", type=int, default=0, help="default: one stream per data-parallel rank")
    ap.add_argument("--batches", default="1,16", help="batch sizes of the memory_by_batch figures (comma-separated)")
    ap.add_argument("--hbm-gb", type=float, default=GB300_HBM_BYTES / 1e9)
    ap.add_argument("--hbm-tbps", type=float, default=8.0, help="HBM bandwidth per device (GB300: 8 TB/s)")
    ap.add_argument("--coll-latency-us", type=float, default=5.0,
                    help="latency of one small collective (default 5 us: a one-shot NVLink all-reduce of a few KB "
                         "within an NVL72 domain; NCCL's ring is nearer 10-20 us)")
    ap.add_argument("--link-gbps", type=float, default=900.0, help="NVLink bandwidth per device and direction")
    ap.add_argument("--roofline-context", type=int, default=8192, help="context length the roofline decodes at")
    ap.add_argument("--accept-len", type=float, default=None,
                    help="DSpark tokens per target step (default: 3.45, what seed 000's 370 tok/s implies)")
    ap.add_argument("--no-compile", action="store_true", help="skip the AOT compiles (and the roofline)")
    ap.add_argument("--max-image-patches", type=int, default=16384,  # kimi.image.MAX_PATCHES (not imported: jax)
                    help="patches of the largest image the vision memory figure assumes (kimi.image.MAX_PATCHES)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    try:
        a.batches = [int(b) for b in a.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers, got {a.batches!r}")
    if any(b < 1 for b in a.batches):
        ap.error("--batches: each must be >= 1")

    n = _device_count(a.mesh)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    out = simulate(a)
    if a.json:
        print(json.dumps(out, separators=(",", ":")))
        return 0
    print(f"{a.preset} on {out['mesh']} ({out['devices']} devices, rules {out['rules']}), batch {out['batch']}, "
          f"context {out['context']:,}")
    print(f"  total params {out['total_params']:,}   active/token {out['active_params_per_token']:,}")
    print(f"  per device: params {_gb(out['per_device_param_bytes'])}  KDA state "
          f"{_gb(out['per_device_kda_state_bytes'])}  MLA cache {_gb(out['per_device_mla_cache_bytes'])}")
    d = out["drafter"]
    print(f"  drafter: {d['params']:,} params, {_gb(d['per_device_param_bytes'])} + cache "
          f"{_gb(d['per_device_cache_bytes'])} per device ({d['built_as']})")
    print(f"  total {_gb(out['per_device_total_bytes'])} of {_gb(out['hbm_bytes'])}: fits={out['fits']} "
          f"(longest context that fits: {out['max_context_that_fits']:,})")
    for b, m in out["memory_by_batch"].items():
        print(f"  batch {b:>3}: weights {_gb(m['weights'] + m['drafter_weights'])}  MLA cache "
              f"{_gb(m['mla_latent_cache'])}  KDA {_gb(m['kda_states'])}  drafter cache {_gb(m['drafter_cache'])}"
              f"  total {_gb(m['total'])}  fits={m['fits']}")
    for k, v in out["aot_decode_step"].items():
        m, c = v["memory"], v["collectives"]
        print(f"  AOT {k}: compile {v['compile_s']} s, args {_gb(m.get('argument_size_in_bytes', 0))}, temp "
              f"{_gb(m.get('temp_size_in_bytes', 0))}, collectives {c['count']} ({c['bytes']:,} B) {c['by_op']}")
    r = out["roofline"]
    if r:
        print(f"  collectives per token: {out['collectives_per_token']['count']}")
        s = r["seed_000_tokens_per_s"]
        print(f"  roofline (bound)  plain {r['plain']['tokens_per_s']:7.1f} tok/s   "
              f"(seed 000 measured {s['plain']:.0f})")
        print(f"                    DSpark {r['dspark']['tokens_per_s']:6.1f} tok/s at accept_len "
              f"{r['dspark']['accept_len']}   (seed 000 measured {s['dspark']:.0f}; later peak {s['dspark_peak']:.0f})")
        for k, v in r["dspark_at_seed_accept_lens"].items():
            print(f"                    DSpark {v['tokens_per_s']:6.1f} tok/s at accept_len {v['accept_len']} "
                  f"(the seed's {k} tok/s implies it)")
    print(f"  runtime {out['runtime_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
