"""Pallas kernels of issue 7 against their XLA references: the MXFP4 MoE decode and the fused KDA decode step.

  python scripts/bench_kernels.py --json          # one JSON line

On a GPU: K3 decode shapes (batch 1; 16 routed experts of 3072 x 3584 MXFP4 per token; KDA with 96 heads of a
128 x 128 fp32 state, kernel-4 conv), bf16 activations. Per kernel: bytes moved per call (counted from the
shapes: what must cross HBM at least once), time per call, achieved bandwidth, its share of the device's measured
copy bandwidth (a plain device copy of a 1 GiB buffer, read + write counted), the XLA reference's time and the
speedup over it, and the max abs difference from the reference. Calls are timed inside one jitted ``fori_loop``
of ``--iters`` dependent calls (so Python dispatch does not count), best of ``--repeats``. Each kernel is timed in
several launch variants (MXFP4: ``MOE_SWEEP``, dequantisation x tiles x warps; KDA: ``KDA_WARPS``; the verify-shaped
MoE, 8 tokens through the grouped kernels: ``MOE_GROUPED_SWEEP``): the top-level
fields are the default's (what the model runs), ``best`` the fastest correct one, ``variants`` all of them; each
variant's row also goes to stderr as it finishes.

On CPU (interpret mode): correctness only, on small shapes:
``{"backend": "cpu", "mxfp4_moe": {"max_abs_err": ...}, "kda_decode": {"max_abs_err": ...}}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from kimi import mxfp4  # noqa: E402
from kimi.kernels import kda_decode as kd  # noqa: E402
from kimi.kernels import mxfp4_moe as mm  # noqa: E402

ACT = ("situ", 4.0, 25.0)  # K3's SiTU-GLU


# ---------------------------------------------------------------------------------------------------- inputs
def moe_inputs(E, F, D, T, X, dtype, seed=0, quantize=True):
    """MXFP4 experts w1, w3 [E, F, D], w2 [E, D, F]; x [T, D]; X distinct experts per token.

    quantize=False draws the codes and scales directly (realistic bytes, no quantisation pass: K3-sized tensors)."""
    rng = np.random.default_rng(seed)
    ws = []
    for shape in ((E, F, D), (E, F, D), (E, D, F)):
        if quantize:
            ws += list(mxfp4.quantize(0.2 * rng.standard_normal(shape).astype(np.float32)))
        else:
            ws += [rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8),
                   rng.integers(117, 123, shape[:-1] + (shape[-1] // 32,), dtype=np.uint8)]
    idx = np.argsort(rng.uniform(size=(T, E)), axis=1)[:, :X].astype(np.int32)
    w = rng.uniform(size=(T, X)).astype(np.float32)
    x = rng.standard_normal((T, D)).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(idx), *[jnp.asarray(a) for a in ws])


def kda_inputs(B, T, H, K, W, dtype, seed=0):
    rng = np.random.default_rng(seed)
    C = 3 * H * K
    r = lambda shape, s=1.0, dt=dtype: jnp.asarray(s * rng.standard_normal(shape), dt)  # noqa: E731
    return (r((B, T, C)), r((C, W + 1), 0.5, jnp.float32), r((B, W, C)), r((B, T, H, K)), r((H,), 0.5, jnp.float32),
            r((H, K), 0.1, jnp.float32), r((B, T, H)), r((B, T, H, K)), 1.0 + r((K,), 0.1, jnp.float32),
            r((B, H, K, K), 0.3, jnp.float32))


def _err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


# ---------------------------------------------------------------------------------------------------- CPU: correctness
def cpu_check() -> dict:
    E, F, D = 6, 64, 96
    x, w, idx, *ws = moe_inputs(E, F, D, 2, 2, jnp.float32)
    e_moe = _err(mm.moe_decode(x, w, idx, *ws, *ACT, tn=16, tk=32), mm.moe_decode_reference(x, w, idx, *ws, *ACT))
    x, w, idx, *ws = moe_inputs(E, F, D, 7, 2, jnp.float32, seed=1)
    e_moe = max(e_moe, _err(mm.moe_grouped(x, w, idx, *ws, *ACT, tm=16, tn=32, tk=32),
                            mm.moe_grouped_reference(x, w, idx, *ws, *ACT)))
    e_kda = 0.0
    for T, lb in ((1, -5.0), (4, None)):
        args = kda_inputs(2, T, 2, 16, 3, jnp.float32, seed=T)
        kw = dict(lower_bound=lb, eps_rms=1e-5, return_all_states=T > 1)
        for a, b in zip(kd.kda_fused_step(*args, **kw), kd.kda_fused_step_reference(*args, **kw)):
            e_kda = max(e_kda, _err(a, b))
    return {"backend": "cpu", "mxfp4_moe": {"max_abs_err": e_moe}, "kda_decode": {"max_abs_err": e_kda}}


# ---------------------------------------------------------------------------------------------------- GPU: speed
def _time_loop(step, carry, consts, iters, repeats):
    """Seconds per call of ``carry = step(carry, consts)``, run ``iters`` times inside one jitted fori_loop (the
    weights travel as arguments, never as baked-in constants)."""
    run = jax.jit(lambda c, k: lax.fori_loop(0, iters, lambda i, c: step(c, k), c))
    jax.block_until_ready(run(carry, consts))  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(carry, consts))
        best = min(best, time.perf_counter() - t0)
    return best / iters


def copy_bandwidth(nbytes=1 << 30, iters=20, repeats=3):
    """Bytes/s of a plain device copy (read + write counted), a dependent chain so nothing is elided."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    sec = _time_loop(lambda c, k: c + 1.0, x, (), iters, repeats)  # one read + one write per element, a copy's traffic
    return 2 * nbytes / sec


K3_MOE = dict(E=64, F=3072, D=3584, T=1, X=16)  # 64 experts allocated; 16 routed, 3 x 3072 x 3584 MXFP4 each
K3_KDA = dict(B=1, H=96, K=128, W=3)
SMALL_MOE = dict(E=8, F=64, D=128, T=1, X=4)  # --small: exercises the timing path anywhere (interpret on CPU)
SMALL_KDA = dict(B=1, H=2, K=32, W=3)


# the decode kernel's launch choices timed on a GPU: (dequant, tn, tk, num_warps); the first is the default
_DECODE_DEFAULT = (mm.DEFAULT_DEQUANT, mm.DECODE_TUNING.tn, mm.DECODE_TUNING.tk, mm.DECODE_TUNING.num_warps)
MOE_SWEEP = (_DECODE_DEFAULT,) + tuple(
    (d, tn, tk, nw) for d in mm.DEQUANT_MODES
    for tn, tk, nw in ((32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (128, 256, 8))) + tuple(
    ("ptx", tn, 512, nw) for tn, nw in ((16, 4), (16, 2), (32, 2), (32, 8)))  # around the first H200 run's best
# the grouped (prefill / verify) kernels: the dequantisation only; the first is the default
MOE_GROUPED_SWEEP = ((mm.DEFAULT_DEQUANT,),) + tuple((d,) for d in mm.DEQUANT_MODES)
KDA_WARPS = (kd.NUM_WARPS,) + tuple(nw for nw in (1, 2, 4, 8, 16) if nw != kd.NUM_WARPS)  # the default first
KERNELS = ("mxfp4_moe", "kda_decode", "kda_verify8", "mxfp4_moe_verify8")


def _sweep(names, configs, run_one, tol):
    """Run every config (dicts of ``names``), keep going past failures; returns (rows, the default's row, the
    fastest row whose max_abs_err is within ``tol`` (or 10x the default's, if larger))."""
    rows, seen = [], set()
    for cfg in configs:
        if cfg in seen:
            continue
        seen.add(cfg)
        row = dict(zip(names, cfg))
        try:
            row.update(run_one(**row))
        except Exception as e:  # report and carry on: one failing variant must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress: the figures so far survive a time-out
    default = rows[0]
    tol = max(tol, 10 * default.get("max_abs_err", 0.0))
    ok = [r for r in rows if "time_us" in r and r["max_abs_err"] <= tol]
    best = min(ok, key=lambda r: r["time_us"]) if ok else None
    return rows, default, best


def bench_moe(copy_bw, iters, repeats, E, F, D, T, X, sweep=MOE_SWEEP, grouped=False):
    """T = 1: the decode kernels (``sweep`` of (dequant, tn, tk, num_warps)); ``grouped``: T tokens through the
    grouped kernels, as a DSpark verify of T positions runs them (``sweep`` of (dequant,))."""
    x, w, idx, *ws = moe_inputs(E, F, D, T, X, jnp.bfloat16, quantize=False)
    per_expert = sum(int(a[0].nbytes) for a in ws)
    n_experts = len(np.unique(np.asarray(idx)))  # each expert's bytes are read once, however many rows pick it
    nbytes = n_experts * per_expert + 2 * x.nbytes + T * X * F * 2 * 2 + T * X * D * 4 * 2  # weights + x, h, y
    kernel, reference = ((mm.moe_grouped, mm.moe_grouped_reference) if grouped
                         else (mm.moe_decode, mm.moe_decode_reference))

    def make(fn):  # the next call depends on this one's output (a tiny nudge), as consecutive decode steps do
        return lambda c, k: c + (1e-30 * fn(c, *k, *ACT)).astype(c.dtype)

    consts = (w, idx, *ws)
    t_r = _time_loop(make(reference), x, consts, iters, repeats)
    want = reference(x, w, idx, *ws, *ACT)
    max_abs_ref = float(jnp.max(jnp.abs(want.astype(jnp.float32))))

    def one(**launch):
        fn = functools.partial(kernel, **launch)
        err = _err(fn(x, w, idx, *ws, *ACT), want)
        return _report(nbytes, _time_loop(make(fn), x, consts, iters, repeats), t_r, copy_bw, err)

    names = ("dequant",) if grouped else ("dequant", "tn", "tk", "num_warps")
    # bf16 output: a few bf16 ulps of the largest value
    rows, default, best = _sweep(names, sweep, one, tol=2e-2 * max_abs_ref)
    return dict(default, shape=dict(E_routed=X, experts_read=n_experts, F=F, D=D, T=T),
                xla_time_us=round(t_r * 1e6, 2), max_abs_ref=max_abs_ref, best=best, variants=rows)


def bench_kda(copy_bw, iters, repeats, B, H, K, W, T=1, warps=KDA_WARPS):
    args = kda_inputs(B, T, H, K, W, jnp.bfloat16)
    kw = dict(lower_bound=-5.0, eps_rms=1e-5, return_all_states=T > 1)
    state_bytes = B * H * K * K * 4
    nbytes = 2 * state_bytes + 2 * args[2].nbytes + sum(int(args[i].nbytes) for i in (0, 3, 6, 7)) + B * T * H * K * 4
    if T > 1:
        nbytes += T * state_bytes + T * args[2].nbytes  # per-position states for rollback

    def make(fn):  # consecutive steps: the state and the conv state carry over
        def step(carry, k):
            state, conv = carry
            outs = fn(k[0], k[1], conv, *k[3:9], state, **kw)
            return outs[1], outs[2]
        return step

    carry = (args[9], args[2])
    t_r = _time_loop(make(kd.kda_fused_step_reference), carry, args, iters, repeats)
    want = kd.kda_fused_step_reference(*args, **kw)

    def one(num_warps):
        fn = functools.partial(kd.kda_fused_step, num_warps=num_warps)
        err = max(_err(a, b) for a, b in zip(fn(*args, **kw), want))
        return _report(nbytes, _time_loop(make(fn), carry, args, iters, repeats), t_r, copy_bw, err)

    rows, default, best = _sweep(("num_warps",), [(nw,) for nw in warps], one, tol=1e-3)
    return dict(default, shape=dict(B=B, T=T, H=H, K=K, V=K, W=W), xla_time_us=round(t_r * 1e6, 2), best=best,
                variants=rows)


def _report(nbytes, t_k, t_r, copy_bw, err, **extra):
    bw = nbytes / t_k
    return dict(bytes_per_call=int(nbytes), time_us=round(t_k * 1e6, 2), bw_GBps=round(bw / 1e9, 1),
                pct_copy_bw=round(100 * bw / copy_bw, 1), xla_time_us=round(t_r * 1e6, 2),
                speedup_vs_xla=round(t_r / t_k, 2), max_abs_err=err, **extra)


def gpu_bench(iters, repeats, small=False, kernels=KERNELS) -> dict:
    dev = jax.devices()[0]
    copy_bw = copy_bandwidth(1 << 20 if small else 1 << 30)
    moe, kda = (SMALL_MOE, SMALL_KDA) if small else (K3_MOE, K3_KDA)
    moe_sweep = tuple((d, 32, 64, 4) for d in (mm.DEFAULT_DEQUANT,) + mm.DEQUANT_MODES) if small else MOE_SWEEP
    res = {"backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "copy_bw_GBps": round(copy_bw / 1e9, 1)}
    for name, fn in (("mxfp4_moe", lambda: bench_moe(copy_bw, iters, repeats, sweep=moe_sweep, **moe)),
                     ("kda_decode", lambda: bench_kda(copy_bw, iters, repeats, **kda)),
                     ("kda_verify8", lambda: bench_kda(copy_bw, max(iters // 4, 5), repeats, T=8, **kda)),
                     ("mxfp4_moe_verify8", lambda: bench_moe(copy_bw, max(iters // 4, 5), repeats,
                                                             sweep=MOE_GROUPED_SWEEP, grouped=True,
                                                             **dict(moe, T=8)))):
        if name not in kernels:
            continue
        try:
            res[name] = fn()
        except Exception as e:  # report and carry on: one failing kernel must not hide the other figures
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed loop (GPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops; the best counts (GPU)")
    ap.add_argument("--speed", action="store_true", help="run the timing path even on CPU (with --small)")
    ap.add_argument("--small", action="store_true", help="small shapes for the timing path (a smoke test)")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help=f"comma-separated subset of {','.join(KERNELS)} to time (GPU)")
    args = ap.parse_args(argv)
    kernels = tuple(args.kernels.split(","))
    if unknown := sorted(set(kernels) - set(KERNELS)):
        ap.error(f"--kernels: unknown {unknown}; expected a comma-separated subset of {','.join(KERNELS)}")
    if jax.default_backend() == "cpu" and not args.speed:
        res = cpu_check()
    else:
        res = gpu_bench(args.iters, args.repeats, small=args.small, kernels=kernels)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return res


if __name__ == "__main__":
    main()
