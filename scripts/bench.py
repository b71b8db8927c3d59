"""Plain decoding vs DSpark on the shipped default pair, side by side in one run, per workload.

  python scripts/bench.py --json                    # workloads code / structured / prose
  python scripts/bench.py --corpus DIR --json       # prompts cut from your own text files

Batch 1, greedy, held-out prompts, ``--max-new-tokens`` each; compilation and a warm-up run are excluded; both modes
run the same prompts in the same process, interleaved, ``--repeats`` times each (the fastest run of each counts).
Throughput is of the decode phase (each prompt's prefill, timed alone, is subtracted); end-to-end figures are
reported beside it (``e2e_*``). Reports tokens/s of each, the speedup, accept_len (tokens per target step), per-
position acceptance, and the cost model's prediction from the measured acceptance: tokens per step over (v + r),
with r = the measured drafter pass over the measured plain decode step and v = the measured verify pass over a
decode step (``predicted_speedup``), and with v = 1 as seed 000 assumes for a memory-bound accelerator
(``predicted_speedup_verify_as_one_step``). The top-level fields describe the code workload (or the ``--corpus``
directory); ``workloads`` holds each one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate as gen  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jdspark  # noqa: E402
from jdspark import costmodel, workloads  # noqa: E402
from jdspark import data as jdata  # noqa: E402
from jdspark.drafter import with_serving_layout as drafter_serving  # noqa: E402
from jdspark.sampling import SamplingParams  # noqa: E402
from jdspark.speculative import draft_block  # noqa: E402
from kimi.model import with_serving_layout  # noqa: E402


def _pass_seconds(target, drafter, tokens, max_new: int, repeats: int = 50) -> dict:
    """Wall time of one drafter block pass (context attention + Markov head), one target verify of a block
    (G + 1 tokens) and one target decode step: each jitted alone on the serving copy of the weights, warm; modes
    interleaved, the fastest of 5 rounds counts. ``tokens`` (a real prompt): its last G + 1 tokens are the verified
    block and the ones before them the cached context, so the verify routes real text to its experts (a block of
    one repeated token picks fewer experts and costs less than a verify of real drafts). The caches are as long
    as a generation of ``max_new`` tokens after that prompt makes them (attention reads all of it, masked)."""
    G = drafter.config.block_size
    tokens = np.asarray(tokens, np.int32)
    if tokens.shape[0] < G + 2:
        raise ValueError(f"_pass_seconds: a prompt of at least {G + 2} tokens is needed, got {tokens.shape[0]}")
    ctx_ids, block_ids = tokens[:-(G + 1)], tokens[-(G + 1):]
    ctx, S = ctx_ids.shape[0], tokens.shape[0] + max_new + G + 1
    served_t, served_d = with_serving_layout(target), drafter_serving(drafter, target.config.serving_dtype)
    gt, st = nnx.split(served_t)
    gd, sd = nnx.split(served_d)
    X = len(drafter.config.aux_hidden_state_layer_ids) * target.config.hidden_size
    dcache = drafter.append_context(drafter.init_cache(1, S), jnp.zeros((1, ctx, X)), ctx)
    tcache = served_t.forward(jnp.asarray(ctx_ids)[None], served_t.init_cache(1, S), mode="prefill").cache
    emb, lm = target.embed_tokens.embedding[...], target.lm_head_DV()
    taps = tuple(drafter.config.aux_hidden_state_layer_ids)
    fns = {
        "draft": (jax.jit(lambda s, c, a, k: draft_block(nnx.merge(gd, s), c, a, jnp.array([ctx]), emb, lm, k,
                                                          SamplingParams(), 0.0)[0]),
                  (sd, dcache, jnp.asarray(block_ids[:1]), jax.random.key(0))),
        "verify": (jax.jit(lambda s, c, t: nnx.merge(gt, s).forward(t, c, mode="verify", tap_layers=taps).logits),
                   (st, tcache, jnp.asarray(block_ids)[None])),
        "decode": (jax.jit(lambda s, c, t: nnx.merge(gt, s).forward(t, c, mode="decode").logits),
                   (st, tcache, jnp.asarray(block_ids[:1])[None])),
    }
    best = {k: float("inf") for k in fns}
    for f, args in fns.values():
        jax.block_until_ready(f(*args))
    for _ in range(5):
        for k, (f, args) in fns.items():
            t0 = time.perf_counter()
            for _ in range(repeats):
                r = f(*args)
            jax.block_until_ready(r)
            best[k] = min(best[k], (time.perf_counter() - t0) / repeats)
    return best


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_workload(target, drafter, prompts, max_new: int, repeats: int = 3) -> dict:
    """Decode-phase throughput of both modes: each prompt's prefill (timed alone, as a 1-token generation) is
    subtracted from its full generation, so the figures compare decoding, not prompt processing. End-to-end
    figures (prefill included) are reported too. Every (prompt, mode) is timed ``repeats`` times, the modes
    interleaved, and the fastest run counts: the noise of a shared machine only ever adds time, to either mode."""
    kw = dict(eos_token_id=-1)  # fixed length: every prompt yields max_new tokens
    for d in (None, drafter):  # compile + warm-up of both programs (excluded)
        jdspark.generate(target, d, prompts[0], max_new_tokens=max_new, **kw)
        jdspark.generate(target, d, prompts[0], max_new_tokens=1, **kw)
    t = {"ar": 0.0, "spec": 0.0, "ar_pre": 0.0, "spec_pre": 0.0}
    n_new = steps = accepted = mismatches = 0
    counts = None
    for p in prompts:
        best = {k: float("inf") for k in t}
        for _ in range(repeats):
            for name, d in (("ar", None), ("spec", drafter)):
                best[name + "_pre"] = min(best[name + "_pre"],
                                          _timed(lambda: jdspark.generate(target, d, p, max_new_tokens=1, **kw))[0])
                dt, out = _timed(lambda: jdspark.generate(target, d, p, max_new_tokens=max_new, **kw))
                best[name] = min(best[name], dt)
                if name == "ar":
                    ar_tokens = out.tokens
                else:
                    sp = out
        for k in t:
            t[k] += best[k]
        n_new += max_new - 1  # tokens after the first (which the prefill yields)
        mismatches += int(not np.array_equal(ar_tokens, sp.tokens))
        steps += int(sp.stats.target_steps)
        accepted += int(sp.stats.accepted)
        c = np.asarray(sp.stats.accept_counts, np.int64)
        counts = c if counts is None else counts + c
    ar_dec, sp_dec = t["ar"] - t["ar_pre"], t["spec"] - t["spec_pre"]
    total = len(prompts) * max_new
    return {"prompts": len(prompts), "new_tokens": max_new, "repeats": repeats, "ar_tok_s": n_new / ar_dec,
            "spec_tok_s": n_new / sp_dec, "speedup": ar_dec / sp_dec, "accept_len": (accepted + steps) / steps,
            "per_position_accept": (counts / steps).tolist(), "greedy_mismatches": mismatches,
            "e2e_ar_tok_s": total / t["ar"], "e2e_spec_tok_s": total / t["spec"], "e2e_speedup": t["ar"] / t["spec"],
            "loop_step_over_decode_step": (sp_dec / steps) / (ar_dec / n_new), "ar_step_s": ar_dec / n_new}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="folder with target/ and drafter/ (default: the shipped one)")
    ap.add_argument("--corpus", help="measure prompts cut from the text files under this directory instead")
    ap.add_argument("--workloads", nargs="+", default=["code", "structured", "prose"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (BOS included)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per (prompt, mode), interleaved; the "
                    "fastest counts (a shared machine's noise only adds time: more runs, a steadier ratio)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default=None,
                    help="the matmul weights' dtype in both modes (default: generate.DEFAULT_SERVING_DTYPE)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line, last")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.prompt_len < 2 or a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--prompts, --prompt-len (>= 2), --max-new-tokens and --repeats must be positive")

    target, drafter, note = gen.load_pair(a.checkpoint or gen.DEFAULT_DIR, a.serving_dtype or gen.DEFAULT_SERVING_DTYPE)
    print(f"[bench] {note}", file=sys.stderr)
    if drafter is None:
        raise SystemExit("bench: the checkpoint has no drafter/")
    if a.corpus:
        sources = {"corpus": workloads.documents_from_dir(a.corpus)}
    else:
        sources = {w: workloads.documents(w) for w in a.workloads}
    passes = None
    result = {"backend": __import__("jax").default_backend(), "checkpoint": note,
              "block_size": drafter.config.block_size, "serving_dtype": target.config.serving_dtype, "workloads": {}}
    for name, docs in sources.items():
        prompts = jdata.prompts_from_documents(docs, a.prompts, a.prompt_len, seed=a.seed)
        if passes is None:  # once, on the first workload's first prompt
            passes = _pass_seconds(target, drafter, prompts[0], a.max_new_tokens)
        r = run_workload(target, drafter, prompts, a.max_new_tokens, a.repeats)
        step_s = r.pop("ar_step_s")
        r["r_draft_over_step"] = passes["draft"] / step_s
        r["v_verify_over_step"] = passes["verify"] / passes["decode"]
        r["predicted_speedup"] = costmodel.speedup_from_per_position(r["per_position_accept"], r["r_draft_over_step"],
                                                                    r["v_verify_over_step"])
        r["predicted_speedup_verify_as_one_step"] = costmodel.speedup_from_per_position(
            r["per_position_accept"], r["r_draft_over_step"])
        result["workloads"][name] = r
        print(f"[bench] {name:10s} accept_len {r['accept_len']:.2f}  AR {r['ar_tok_s']:.1f} tok/s  "
              f"DSpark {r['spec_tok_s']:.1f} tok/s  speedup {r['speedup']:.2f}x  "
              f"(cost model {r['predicted_speedup']:.2f}x with the measured verify = {r['v_verify_over_step']:.2f} "
              f"decode steps; {r['predicted_speedup_verify_as_one_step']:.2f}x if a verify cost one step; a whole "
              f"DSpark step costs {r['loop_step_over_decode_step']:.2f} decode steps in the loop)",
              file=sys.stderr)
    top = result["workloads"]["corpus" if a.corpus else ("code" if "code" in sources else next(iter(sources)))]
    for k in ("ar_tok_s", "spec_tok_s", "speedup", "accept_len", "per_position_accept", "predicted_speedup"):
        result[k] = top[k]
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
