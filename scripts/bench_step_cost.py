"""What one DSpark step costs against context length, and the most speculation could buy at that cost.

  python scripts/bench_step_cost.py --json                                     # 1K, 8K, 32K, 128K; widths 2, 4, 8
  python scripts/bench_step_cost.py --lengths 32768,131072 --json \\
      --accept-from docs/bench_long_default_pair.json --accept-from docs/bench_long_128k_default_pair.json

Per context length S, the shipped pair's three passes, each jitted alone on the serving copy of the weights, warm,
interleaved, the fastest of ``--repeats`` rounds of ``--iters`` calls: the target's decode step (1 token), its
verify of W tokens for each ``--widths`` W (W - 1 drafts + the anchor), and the drafter's block (its context
attention + Markov head) with the drafter's whole context and with a ring of ``--window`` positions. The caches
hold S positions of random latents (attention's cost does not depend on their values, and the 20-minute prefill
of a real 128K prompt is not needed for it); the verified tokens are real held-out text, so the MoE routes a real
block to its experts.

What it reports per length, from those times alone (no generation is run):
  verify_over_decode[W]   a verify of W tokens in decode steps;
  speedup_ceiling[W]      W * decode / (verify_W + draft): the speedup if every draft were accepted (W tokens a
                          step), the windowed drafter's block counted; nothing at this width can beat it;
  breakeven_accept_len    (verify_{G+1} + draft) / decode: the tokens per step a whole block must yield to match
                          plain decoding (block G);
  predicted_speedup       accept_len * decode / (verify_{G+1} + draft) for an accept_len measured at this length
                          (``--accept-from`` a ``bench_long.py`` JSON, its windowed row), beside that run's measured
                          speedup: the cost model checked against a real run;
  prefill_tok_s_here      one prefill chunk (``--prefill-chunk`` tokens, 1024 by default) written after S cached
                          positions: what a chunked prefill runs at that depth (a prompt of S tokens averages the
                          depths up to S).
On two CPU cores a verify's attention over a long latent cache scores H * W query rows against every key, so it
grows faster with the context than a decode's (at 128K an 8-token verify is ~1.8 decode steps; docs/performance.md);
on an accelerator a decode and a verify both read the cache once. One JSON line, last: ``{"backend",
"block_size", "window", "lengths": [{"context", "decode_ms", "verify_ms", "draft_ms", ...}, ...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

from jdspark import data as jdata  # noqa: E402
from jdspark import workloads  # noqa: E402
from jdspark.drafter import with_context_window  # noqa: E402
from jdspark.drafter import with_serving_layout as drafter_serving  # noqa: E402
from jdspark.sampling import SamplingParams  # noqa: E402
from jdspark.speculative import draft_block  # noqa: E402
from kimi import dispatch  # noqa: E402
from kimi.model import with_serving_layout  # noqa: E402

DEFAULT_LENGTHS = (1024, 8192, 32768, 131072)
DEFAULT_WIDTHS = (2, 4, 8)


def _random_like(x, key, scale: float = 1.0):
    return (scale * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)


def target_cache(target, context: int, room: int, seed: int = 0):
    """A target cache of ``context`` valid positions (random latents, random KDA states) with ``room`` more."""
    cache = target.init_cache(1, context + room)
    k = jax.random.split(jax.random.key(seed), 3)
    return cache.__class__(kda_state=_random_like(cache.kda_state, k[0], 0.1), conv_state=cache.conv_state,
                           mla_ckv=_random_like(cache.mla_ckv, k[1]), mla_kpe=_random_like(cache.mla_kpe, k[2]),
                           length=jnp.full_like(cache.length, context))


def drafter_cache(drafter, context: int, room: int, seed: int = 1):
    """The drafter's context cache after ``context`` positions (random K/V): all of them, or its ring."""
    cache = drafter.init_cache(1, context + room)
    k = jax.random.split(jax.random.key(seed), 2)
    return cache.__class__(_random_like(cache.k, k[0]), _random_like(cache.v, k[1]), jnp.int32(context))


def pass_costs(target, drafter, block_ids, context: int, widths, window: int, *, iters: int, repeats: int) -> dict:
    """Seconds per call of decode, verify (each width), and the drafter's block (whole context and ring)."""
    G = drafter.config.block_size
    served_t = with_serving_layout(target)
    gt, st = nnx.split(served_t)
    taps = tuple(drafter.config.aux_hidden_state_layer_ids)
    emb, lm = target.embed_tokens.embedding[...], target.lm_head_DV()
    block = jnp.asarray(np.asarray(block_ids, np.int32))[None]

    # The target's cache is donated and handed back with its length unchanged, as the generation loop updates it
    # in place: a pass on a cache it may not overwrite would copy all of it to write its new positions.
    def verify(s, c, t):
        out = nnx.merge(gt, s).forward(t, c, mode="verify", tap_layers=taps)
        kept = dataclasses.replace(out.cache, length=c.length)
        return (out.logits, out.taps, out.kda_rollback, out.conv_states), kept  # what a commit reads

    def decode(s, c, t):
        out = nnx.merge(gt, s).forward(t, c, mode="decode")
        return out.logits, dataclasses.replace(out.cache, length=c.length)

    donated = functools.partial(jax.jit, donate_argnums=(1,))
    fns = {"decode": (donated(decode), st, block[:, :1])}
    for W in widths:
        fns[f"verify_{W}"] = (donated(verify), st, block[:, :W])
    caches = {k: target_cache(served_t, context, G + 1) for k in fns}
    for name, w in (("none", None), (str(window), window)):
        d = drafter_serving(with_context_window(drafter, w), target.config.serving_dtype)
        gd, sd = nnx.split(d)
        caches[f"draft_{name}"] = drafter_cache(d, context, G + 1)  # read only: the block does not write it
        fn = jax.jit(lambda s, c, a, gd=gd: (draft_block(nnx.merge(gd, s), c, a, jnp.array([context]), emb, lm,
                                                         jax.random.key(0), SamplingParams(), 0.0)[0], c))
        fns[f"draft_{name}"] = (fn, sd, block[0, :1])

    def call(k):
        f, s, t = fns[k]
        r, caches[k] = f(s, caches[k], t)
        return r

    for k in fns:
        jax.block_until_ready(call(k))
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k in fns:
            t0 = time.perf_counter()
            for _ in range(iters):
                r = call(k)
            jax.block_until_ready(r)
            best[k] = min(best[k], (time.perf_counter() - t0) / iters)
    return best


def prefill_chunk_cost(target, chunk_ids, context: int, *, repeats: int) -> float:
    """Seconds for one prefill chunk of ``len(chunk_ids)`` tokens written after ``context`` cached positions (the
    pass a chunked prefill runs at that depth, ``kimi.prefill``): prefill tok/s there is chunk / seconds. The
    cache is donated and handed back with its length unchanged, as for the step's passes."""
    served_t = with_serving_layout(target)
    gt, st = nnx.split(served_t)
    toks = jnp.asarray(np.asarray(chunk_ids, np.int32))[None]

    def chunk(s, c, t):
        out = nnx.merge(gt, s).forward(t, c, mode="prefill")
        return out.logits[:, -1], dataclasses.replace(out.cache, length=c.length)

    f = jax.jit(chunk, donate_argnums=(1,))
    cache = target_cache(served_t, context, toks.shape[1])
    r, cache = f(st, cache, toks)
    jax.block_until_ready(r)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        r, cache = f(st, cache, toks)
        jax.block_until_ready(r)
        best = min(best, time.perf_counter() - t0)
    return best


def summarize(context: int, secs: dict, widths, window: int, block_size: int, measured=None) -> dict:
    """The JSON entry of one length: milliseconds, ratios to a decode step, ceilings (see the module docstring)."""
    dec, draft = secs["decode"], secs[f"draft_{window}"]
    ms = lambda s: round(1e3 * s, 3)  # noqa: E731
    W_full = block_size + 1
    row = {"context": context, "decode_ms": ms(dec), "verify_ms": {str(W): ms(secs[f"verify_{W}"]) for W in widths},
           "draft_ms": {"none": ms(secs["draft_none"]), str(window): ms(draft)},
           "verify_over_decode": {str(W): round(secs[f"verify_{W}"] / dec, 3) for W in widths},
           "speedup_ceiling": {str(W): round(W * dec / (secs[f"verify_{W}"] + draft), 3) for W in widths}}
    if "prefill_chunk" in secs:
        row["prefill_chunk_ms"] = ms(secs["prefill_chunk"])
        row["prefill_tok_s_here"] = round(secs["prefill_chunk_tokens"] / secs["prefill_chunk"], 1)
    if W_full in widths:
        step = secs[f"verify_{W_full}"] + draft
        row["breakeven_accept_len"] = round(step / dec, 3)
        if measured is not None:
            row["measured"] = measured
            row["predicted_speedup"] = round(measured["accept_len"] * dec / step, 3)
    return row


def measured_rows(path: str, window: int) -> dict:
    """context -> {accept_len, speedup} of a ``bench_long.py`` JSON's rows with this drafter window."""
    text = open(path).read().strip().splitlines()[-1]
    out = {}
    for r in json.loads(text)["lengths"]:
        if r.get("drafter_window") == window and r.get("accept_len") is not None:
            out[int(r["context"])] = {"accept_len": r["accept_len"], "speedup": r["speedup"], "source": path}
    return out


def _ints(s: str) -> tuple:
    try:
        v = tuple(int(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=gen.DEFAULT_DIR, help="folder with target/ and drafter/")
    ap.add_argument("--lengths", type=_ints, default=DEFAULT_LENGTHS, help="context lengths, comma-separated")
    ap.add_argument("--widths", type=_ints, default=DEFAULT_WIDTHS, help="verify widths (tokens), comma-separated")
    ap.add_argument("--window", type=int, default=1024, help="the drafter's context window (ring) measured")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed round")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (the fastest counts)")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default=gen.DEFAULT_SERVING_DTYPE)
    ap.add_argument("--prefill-chunk", type=int, default=dispatch.prefill_limits()[1],
                    help="also time one prefill chunk of this many tokens at each length (0: do not)")
    ap.add_argument("--accept-from", action="append", default=[],
                    help="a bench_long.py JSON (repeatable): predict its windowed rows' speedup")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line, last")
    a = ap.parse_args(argv)
    if a.window < 1 or a.iters < 1 or a.repeats < 1:
        ap.error("--window, --iters and --repeats must be positive")
    if a.prefill_chunk < 0:
        ap.error(f"--prefill-chunk: expected 0 (off) or a positive number of tokens, got {a.prefill_chunk}")
    target, drafter, note = gen.load_pair(a.checkpoint, a.serving_dtype)
    if drafter is None:
        raise SystemExit(f"bench_step_cost: {a.checkpoint} has no drafter/")
    G = drafter.config.block_size
    if max(a.widths) > G + 1:
        ap.error(f"--widths: at most the drafter's block + 1 = {G + 1} tokens, got {max(a.widths)}")
    measured = {}
    for path in a.accept_from:
        measured.update(measured_rows(path, a.window))
    tokenizer = gen.load_tokenizer(a.checkpoint, target.config)
    cut = jdata.prompts_from_documents(workloads.documents("code"), 1, 64, seed=0, tokenizer=tokenizer)
    block_ids = np.asarray(cut[0])[-(G + 1):]
    result = {"backend": jax.default_backend(), "checkpoint": note, "block_size": G, "window": a.window,
              "serving_dtype": target.config.serving_dtype, "lengths": []}
    for S in a.lengths:
        t0 = time.perf_counter()
        secs = pass_costs(target, drafter, block_ids, S, a.widths, a.window, iters=a.iters, repeats=a.repeats)
        if a.prefill_chunk:
            chunk_ids = jdata.prompts_from_documents(workloads.documents("code"), 1, a.prefill_chunk, seed=0,
                                                     tokenizer=tokenizer)[0]
            secs["prefill_chunk"] = prefill_chunk_cost(target, chunk_ids, S, repeats=a.repeats)
            secs["prefill_chunk_tokens"] = a.prefill_chunk
        row = summarize(S, secs, a.widths, a.window, G, measured.get(S))
        result["lengths"].append(row)
        print(f"[step_cost] {S:>7} positions: decode {row['decode_ms']} ms, verify {row['verify_ms']} ms, draft "
              f"{row['draft_ms']} ms; verify/decode {row['verify_over_decode']}; ceiling {row['speedup_ceiling']}"
              f"{'; predicted ' + str(row['predicted_speedup']) if 'predicted_speedup' in row else ''}"
              f"{'; prefill ' + str(row['prefill_tok_s_here']) + ' tok/s here' if 'prefill_chunk_ms' in row else ''} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
