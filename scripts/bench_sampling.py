"""What sampling one token costs inside a program, per operation, on this machine (JSON).

  python scripts/bench_sampling.py --json
  python scripts/bench_sampling.py --vocab 163840 --json   # K3's vocabulary

Each figure is one operation on logits [rows, V] repeated ``--iters`` times inside one ``lax.fori_loop`` (so the
host's dispatch is not counted), the fastest of ``--repeats`` runs, in microseconds per call. ``peaked`` logits
(a nucleus of a few tokens at top-p 0.95, as a trained model's usually are) take top-p's fast path; ``flat`` ones
(hundreds of tokens) its bisection. The sort and ``jax.random.categorical`` rows are what sampling used before
(``jdspark/sampling.py`` says why it no longer does).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jdspark import sampling


def per_call_us(op, logits_RV, iters: int, repeats: int) -> float:
    def prog(z, key):
        def body(_, carry):
            acc, key = carry
            key, sub = jax.random.split(key)
            r = op(z + acc, sub).astype(jnp.float32)
            return acc + 0.0 * jnp.sum(jnp.where(jnp.isfinite(r), r, 0.0)), key  # a dependence, no NaN

        return jax.lax.fori_loop(0, iters, body, (jnp.float32(0), key))[0]

    f = jax.jit(prog)
    key = jax.random.key(0)
    f(logits_RV, key).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(logits_RV, key).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="logit rows per call (8: a verify block)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    if a.vocab < 2 or a.iters < 1 or a.repeats < 1 or min(a.rows) < 1:
        raise SystemExit("bench_sampling.py: --vocab >= 2, --iters >= 1, --repeats >= 1 and --rows >= 1 expected")
    sp = sampling.SamplingParams(1.0, 0, 0.95)
    ops = {
        "sample_top_p": lambda z, k: sampling.sample(k, z, sp),
        "top_p_mask": lambda z, k: sampling.process_logits(z, sp),
        "gumbel_categorical_all_V": lambda z, k: jax.random.categorical(k, z),
        "sort_V": lambda z, k: jnp.sort(z, axis=-1),
        "argsort_V": lambda z, k: jnp.argsort(z, axis=-1),
        "top_k_64": lambda z, k: jax.lax.top_k(z, 64)[0],
        "log_softmax": lambda z, k: jax.nn.log_softmax(z, axis=-1),
    }
    out = {"backend": jax.default_backend(), "vocab": a.vocab, "iters": a.iters, "unit": "us per call", "rows": {}}
    for R in a.rows:
        base = jax.random.normal(jax.random.key(1), (R, a.vocab))
        for shape, scale in (("peaked", 12.0), ("flat", 3.0)):
            z = base * scale
            kept = int(jnp.sum(jnp.isfinite(sampling.process_logits(z[:1], sp))))
            row = {"nucleus_tokens_row0": kept}
            for name, op in ops.items():
                if shape == "flat" and name in ("sort_V", "argsort_V", "top_k_64", "log_softmax"):
                    continue  # the same cost at any logits
                row[name] = round(per_call_us(op, z, a.iters, a.repeats), 1)
            out["rows"][f"{R}x{shape}"] = row
            if not a.json:
                print(f"rows {R} {shape}: {row}")
    if a.json:
        print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
