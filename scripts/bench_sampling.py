"""What sampling one token costs inside a program, per operation, on this machine (JSON).

  python scripts/bench_sampling.py --json
  python scripts/bench_sampling.py --vocab 163840 --json   # K3's vocabulary

Each figure is one operation on logits [rows, V] repeated ``--iters`` times inside one ``lax.fori_loop`` (so the
host's dispatch is not counted), the fastest of ``--repeats`` runs, in microseconds per call. ``peaked`` logits (a
nucleus of a few tokens at top-p 0.95, as a trained model's usually are) take top-p's fast path; ``flat`` ones
(hundreds of tokens) its bisection. The sampling operations are timed in each of ``kimi.dispatch.sampling_form``'s
forms (``--forms``; "bisect" is the CPU's, "sort" every other backend's: ``dispatch.sampling_form_as`` sets which
one is traced, to compare them side by side on one machine); ``accept_rejection`` is a verify block's (``rows`` - 1
drafts); ``top_p_min_p_mask`` is ``top_p_mask`` with min-p 0.05 as well; ``*_rows`` are ``sample`` and ``propose``
with per-row settings and the batch's flags, as a serving step calls them (top-k and min-p off). The sort and
``jax.random.categorical`` rows are the plain operations for scale.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jdspark import sampling
from kimi import dispatch


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
    ap.add_argument("--forms", default="bisect,sort", help="dispatch.sampling_form forms to time, of bisect,sort")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    forms = a.forms.split(",")
    if any(f not in dispatch.SAMPLING_FORMS for f in forms):
        raise SystemExit(f"bench_sampling.py: --forms: each of {dispatch.SAMPLING_FORMS}, got {a.forms!r}")
    if a.vocab < 2 or a.iters < 1 or a.repeats < 1 or min(a.rows) < 1:
        raise SystemExit("bench_sampling.py: --vocab >= 2, --iters >= 1, --repeats >= 1 and --rows >= 1 expected")
    sp = sampling.SamplingParams(1.0, 0, 0.95)
    sp_min_p = sampling.SamplingParams(1.0, 0, 0.95, 0.05)  # top_p_mask's setting with min-p as well
    def accept(z, k):  # a verify block: R - 1 drafts (the argmax of a shifted q), the target's R positions
        logq = sampling.process_logits(z[:-1] + 0.5, sp)
        drafts = jnp.argmax(logq, axis=-1).astype(jnp.int32)
        return jnp.stack(sampling.accept_rejection(k, drafts, logq, z, jnp.int32(z.shape[0] - 1), sp))

    def rows_sp(R: int):  # the serving step's form: per-row settings (all T 1, top-p 0.95) and the batch flags
        t, k, p, m = np.ones(R, np.float32), np.zeros(R, np.int32), np.full(R, 0.95, np.float32), np.zeros(R)
        return sampling.SamplingParams.rows(t, k, p, m, batch=sampling.SamplingParams.batch_flags(t, k, p, m))

    form_ops = {
        "sample_top_p": lambda z, k: sampling.sample(k, z, sp),
        "top_p_mask": lambda z, k: sampling.process_logits(z, sp),
        "top_p_min_p_mask": lambda z, k: sampling.process_logits(z, sp_min_p),
        "propose": lambda z, k: sampling.propose(k, z, sp)[0],
        "accept_rejection": accept,
        "sample_rows": lambda z, k: sampling.sample(k, z, rows_sp(z.shape[0])),
        "propose_rows": lambda z, k: sampling.propose(k, z, rows_sp(z.shape[0]))[0],
    }
    ops = {
        "gumbel_categorical_all_V": lambda z, k: jax.random.categorical(k, z),
        "sort_V": lambda z, k: jnp.sort(z, axis=-1),
        "argsort_V": lambda z, k: jnp.argsort(z, axis=-1),
        "top_k_64": lambda z, k: jax.lax.top_k(z, 64)[0],
        "log_softmax": lambda z, k: jax.nn.log_softmax(z, axis=-1),
    }
    out = {"backend": jax.default_backend(), "vocab": a.vocab, "iters": a.iters, "unit": "us per call",
           "default_form": dispatch.sampling_form(), "rows": {}}
    for R in a.rows:
        base = jax.random.normal(jax.random.key(1), (R, a.vocab))
        for shape, scale in (("peaked", 12.0), ("flat", 3.0)):
            z = base * scale
            kept = int(jnp.sum(jnp.isfinite(sampling.process_logits(z[:1], sp))))
            row = {"nucleus_tokens_row0": kept}
            for form in forms:
                with dispatch.sampling_form_as(form):
                    for name, op in form_ops.items():
                        if name == "accept_rejection" and R < 2:
                            continue
                        row[f"{name}_{form}"] = round(per_call_us(op, z, a.iters, a.repeats), 1)
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
