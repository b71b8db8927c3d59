"""The measurements behind kimi/dispatch.py's choices, on this machine's default backend (docs/performance.md).

  python scripts/bench_dispatch.py --json

Each row times the alternatives of one decision at the shapes it was made for (jitted, compiled first, the
fastest of ``--repeats`` runs of ``--iters`` calls), in microseconds per call:
  kda_prefill   T=128 tokens, 4 heads of 64: the token scan (kda_recurrent) vs the chunked WY form (chunk 16)
  kda_verify    T=8, 4 heads of 64: the closed-form block + one rollback vs the scan keeping every state + a pick
  bf16_matvec   1 x 256 @ 256 x 1024: fp32, bf16 with 1 row, bf16 padded to dispatch.BF16_ROWS_MIN rows
  moe_verify    8 rows, 8 experts of 128 x 256, top-2 picking 2 experts: the per-expert loop vs the fused pair
  moe_prefill   T = 128 / 512 / 2048 rows, E = 8 / 32 MXFP4 experts of 192 x 192 (the shipped target's), top-2, as
                the bf16 serving copy holds them: its dense fp32 experts blocked in fp32 (experts_blocked: what a
                prefill ran before the forty-ninth session), its fused bf16 pair ('all'), its bf16 per-expert layout
                blocked (experts_blocked_fused); ``chosen``: dispatch.moe_path's pick for those shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi import dispatch, mxfp4  # noqa: E402
from kimi.ops import kda, moe  # noqa: E402


def _us(fn, args, iters: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return round(best * 1e6, 1)


def _kda_inputs(T: int, H: int = 4, K: int = 64, seed: int = 0):
    r = np.random.default_rng(seed)
    q, k = (kda.l2norm(jnp.asarray(r.standard_normal((1, T, H, K)), jnp.float32)) for _ in range(2))
    v = jnp.asarray(r.standard_normal((1, T, H, K)), jnp.float32)
    g = -jnp.asarray(r.uniform(0.01, 0.5, (1, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(0.1, 0.9, (1, T, H)), jnp.float32)
    return q, k, v, g, beta, jnp.zeros((1, H, K, K), jnp.float32)


def kda_prefill(iters, repeats) -> dict:
    args = _kda_inputs(128)
    scan = jax.jit(lambda *a: kda.kda_recurrent(*a))
    chunked = jax.jit(lambda *a: kda.kda_chunked(*a, chunk_size=16))
    return {"recurrent_us": _us(scan, args, iters, repeats), "chunked_us": _us(chunked, args, iters, repeats),
            "chosen": dispatch.kda_prefill_form(_AutoCfg)}


class _AutoCfg:
    kda_prefill = "auto"


def kda_verify(iters, repeats) -> dict:
    args = _kda_inputs(8)
    n = jnp.array([5], jnp.int32)

    def block(*a):
        o, trace = kda.kda_block(*a)
        return o, kda.kda_block_state(trace, n)

    def scan(*a):
        o, _, states = kda.kda_recurrent(*a, return_all_states=True)
        return o, states[:, 4]

    return {"block_us": _us(jax.jit(block), args, iters, repeats), "recurrent_us": _us(jax.jit(scan), args, iters,
                                                                                       repeats),
            "chosen": dispatch.kda_verify_form(8)}


def bf16_matvec(iters, repeats) -> dict:
    r = np.random.default_rng(1)
    x = jnp.asarray(r.standard_normal((1, 256)), jnp.float32)
    w = jnp.asarray(r.standard_normal((256, 1024)), jnp.float32)
    wb = w.astype(jnp.bfloat16)
    dot = dict(preferred_element_type=jnp.float32)
    f32 = jax.jit(lambda x, w: x @ w)
    one = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, **dot))
    rows = dispatch.BF16_ROWS_MIN
    padded = jax.jit(lambda x, w: jnp.dot(jnp.pad(x, ((0, rows - 1), (0, 0))).astype(jnp.bfloat16), w, **dot)[:1])
    return {"fp32_us": _us(f32, (x, w), iters, repeats), "bf16_1_row_us": _us(one, (x, wb), iters, repeats),
            f"bf16_{rows}_rows_us": _us(padded, (x, wb), iters, repeats)}


def moe_verify(iters, repeats) -> dict:
    r = np.random.default_rng(2)
    E, F, D, T = 8, 128, 256, 8
    w1, w3 = (jnp.asarray(0.05 * r.standard_normal((E, F, D)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(0.05 * r.standard_normal((E, D, F)), jnp.float32)
    x = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
    idx = jnp.asarray(np.tile([[1, 4]], (T, 1)), jnp.int32)
    w = jnp.full((T, 2), 0.5, jnp.float32)
    w13_all, w2_all = moe.fuse_experts_for_all(w1, w3, w2)
    w13_e, w2_e = moe.fuse_experts_per_expert(w1, w3, w2)
    used = jax.jit(lambda x: moe.experts_used(x, w, idx, tuple(w13_e), tuple(w2_e), "silu"))
    fused = jax.jit(lambda x: moe.experts_all_fused(x, w, idx, w13_all, w2_all, E, "silu"))
    return {"used_loop_us": _us(used, (x,), iters, repeats), "all_fused_us": _us(fused, (x,), iters, repeats),
            "experts_picked": 2, "experts": E}


def moe_prefill(iters, repeats, sizes=((8, 128), (8, 512), (8, 2048), (32, 128), (32, 512))) -> dict:
    r = np.random.default_rng(3)
    F = D = 192
    out = {}
    for E, T in sizes:
        dense = [jnp.asarray(0.05 * r.standard_normal(shape), jnp.float32) for shape in ((E, F, D),) * 2 + ((E, D, F),)]
        dense = [mxfp4.dequantize(*mxfp4.quantize(w), dtype=jnp.float32) for w in dense]  # MXFP4's values
        bf16 = [w.astype(jnp.bfloat16) for w in dense]
        w13_all, w2_all = moe.fuse_experts_for_all(*bf16)
        w13_e, w2_e = (tuple(a) for a in moe.fuse_experts_per_expert(*bf16))
        x = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
        w, idx = moe.route(jnp.asarray(r.standard_normal((T, E)), jnp.float32), jnp.zeros(E), 2)
        n = max(1, iters * 128 // (T * E // 8))  # fewer calls for the larger shapes

        fused = jax.jit(lambda x: moe.experts_all_fused(x, w, idx, w13_all, w2_all, E, "silu"))
        blocked = jax.jit(lambda x: moe.experts_blocked_fused(x, w, idx, w13_e, w2_e, "silu"))
        dense_blocked = jax.jit(lambda x: moe.experts_blocked(x, w, idx, *dense, "silu"))
        out[f"E{E}_T{T}"] = {"dense_fp32_blocked_us": _us(dense_blocked, (x,), n, repeats),
                             "all_fused_us": _us(fused, (x,), n, repeats),
                             "blocked_fused_us": _us(blocked, (x,), n, repeats),
                             "chosen": dispatch.moe_path(T, 2, E, jnp.bfloat16)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if min(a.iters, a.repeats) < 1:
        ap.error(f"--iters, --repeats: expected ints >= 1, got {a.iters}, {a.repeats}")
    out = {"backend": jax.default_backend()}
    for name, fn in (("kda_prefill", kda_prefill), ("kda_verify", kda_verify), ("bf16_matvec", bf16_matvec),
                     ("moe_verify", moe_verify), ("moe_prefill", moe_prefill)):
        out[name] = fn(a.iters, a.repeats)
        if not a.json:
            print(name, out[name])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
