"""Acceptance and speed against context length: plain decoding vs DSpark on long prompts of held-out source files.

  python scripts/bench_long.py --json                               # 1K, 8K, 32K, 128K; drafter window none / 64
  python scripts/bench_long.py --lengths 1024,8192 --json --plot long.png
  python scripts/bench_long.py --windows none,256,4096 --prefill-chunk 2048 --json

The prompt of N tokens ends with the same question at every length: the middle of one held-out file (never
trained on; the first in a seeded order long enough), so the generation continues the same real text whatever N
is, and only the context in front of it grows. In front: the other validation files, each after a ``# file: NAME``
line, in the seeded order, and training files in front of those when they run out (``held_out_fraction`` says
how much of the prompt is held out); ``[BOS]`` first.

Per length and drafter window: the prompt's prefill (``speculative.prefill_stream``: chunked as
``kimi.dispatch.prefill_chunk`` decides, or ``--prefill-chunk``), then DSpark's decode loop
(``generation.decode_loop``, greedy, EOS off, ``--max-new-tokens``) and, once per length, plain decoding's from a
copy of the same target cache. From ``--share-prefill-from`` tokens on (default 65536: a 128K prefill takes 4-5
minutes on a 2-core CPU) the prompt is prefilled once, with the whole drafter context (window none first), and each
later window's ring is cut from that context (``jdspark.drafter.ring_from_linear``: the same K/V; those entries
have ``prefill_shared`` true and null prefill fields). Each phase is its own jitted program, compiled ahead
(compile time excluded); the prefill runs once, each decode ``--repeats`` times from a copy of its stream (the
fastest counts). Peak resident
memory of the process per phase: its VmHWM, reset before the phase (``/proc/self/clear_refs``; where that is
refused, the process peak so far, ``peak_rss_reset: false``). ``cache_bytes``: the target's cache plus the drafter's
context cache after the prefill; ``chunk_activation_bytes``: XLA's temporary buffers of the compiled prefill program
(one chunk's activations when chunked; the whole prompt's in one pass); ``memory_ratio``: the prefill's growth of
resident memory (``prefill_rss_growth_bytes``, peak minus the resident size before it) over those two together.
Decode tok/s exclude the prefill. One JSON line: ``{"lengths": [{"context", "drafter_window", "plain_tok_s",
"spec_tok_s", "speedup", "accept_len", "prefill_tok_s", "peak_rss_prefill_bytes", "peak_rss_decode_bytes",
"cache_bytes", "chunk_activation_bytes", "memory_ratio", ...}, ...]}``, one entry per length and window.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
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
from jdspark.drafter import parse_context_window, ring_from_linear, with_context_window  # noqa: E402
from jdspark.generation import cache_positions, decode_loop  # noqa: E402
from jdspark.sampling import SamplingParams  # noqa: E402
from jdspark.serving_copy import serving_pair  # noqa: E402
from jdspark.speculative import Stream, prefill_stream  # noqa: E402
from kimi import dispatch  # noqa: E402

DEFAULT_LENGTHS = (1024, 8192, 32768, 131072)
DEFAULT_WINDOWS = (None, 64)  # the whole context, and the shipped drafter's window


# ------------------------------------------------------------------------------------------------ prompts
def _doc_ids(tokenizer, path, doc: bytes):
    """``# file: NAME`` + the document's text, as token ids (None for a file that is not UTF-8)."""
    try:
        text = doc.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return np.asarray(tokenizer.encode(f"# file: {os.path.basename(str(path))}\n{text}\n"), np.int32)


def _docs_ids(tokenizer, split: str, seed: int, corpus=None, need=None):
    """The documents of one split in a seeded order, as token-id arrays (until ``need`` tokens; all when None)."""
    files = jdata.list_files(corpus, split)
    order = np.random.default_rng(seed).permutation(len(files))
    out, total = [], 0
    for i in order:
        if need is not None and total >= need:
            break
        doc = files[i].read_bytes()
        ids = _doc_ids(tokenizer, files[i], doc) if doc else None
        if ids is not None:
            out.append(ids)
            total += ids.size
    return out


def long_prompt(tokenizer, n_tokens: int, max_new: int, *, seed: int = 0, corpus=None):
    """(prompt ids [n_tokens], real continuation ids [max_new], held-out fraction of the prompt).

    Every length asks the same question: the prompt ends in the middle of the same held-out file (the first, in
    the seeded order, with at least 2 * max_new tokens; cut at its middle token, or earlier so max_new tokens
    follow), so the continuation is the same real text at every length and only the context in front of it grows:
    acceptance against context length compares like with like. In front of the cut: the rest of the held-out
    files in the seeded order, then training files when those run out; ``[BOS]`` first."""
    val = _docs_ids(tokenizer, "val", seed, corpus)
    q = next((i for i, d in enumerate(val) if d.size >= 2 * max_new), None)
    if q is None:
        raise ValueError(f"no validation file holds {2 * max_new} tokens (a question and its {max_new}-token "
                         f"continuation)")
    doc = val[q]
    cut = min(doc.size // 2, doc.size - max_new)
    front = [doc[:cut]] + [d for i, d in enumerate(val) if i != q]  # nearest the question first
    held_tokens = sum(d.size for d in front)
    if held_tokens < n_tokens - 1:
        front += _docs_ids(tokenizer, "train", seed, corpus, need=n_tokens - 1 - held_tokens)
    before = np.concatenate(front[::-1])[-(n_tokens - 1):] if n_tokens > 1 else np.zeros(0, np.int32)
    if before.size < n_tokens - 1:
        raise ValueError(f"the corpus holds {before.size + 1} tokens before the question, fewer than a prompt of "
                         f"{n_tokens}")
    prompt = np.concatenate([[tokenizer.bos_id], before]).astype(np.int32)
    held = min(n_tokens - 1, held_tokens) / max(n_tokens - 1, 1)  # of the prompt's text (the BOS is not text)
    return prompt, doc[cut:cut + max_new].astype(np.int32), float(held)


# ------------------------------------------------------------------------------------------------ memory
def _vm(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(m.group(1)) * 1024 if m else 0


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current size; False where Linux refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Bytes: VmHWM (since the last reset), else the process's lifetime peak."""
    return _vm("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")
                   and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)))


def _phase(compiled, *args):
    """Run a compiled program once: (outputs, seconds, peak RSS bytes during it)."""
    reset_peak_rss()
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    return out, time.perf_counter() - t0, peak_rss()


# ------------------------------------------------------------------------------------------------ programs
@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_len", "chunk"))
def _prefill(t_graph, d_graph, t_state, d_state, prompt_1P, n, key, *, max_len, chunk):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    return prefill_stream(target, drafter, prompt_1P, n, key, SamplingParams(), max_len, chunk)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_new"), donate_argnames=("st0",))
def _decode(t_graph, d_graph, t_state, d_state, st0, first, *, max_new):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    return decode_loop(target, drafter, st0, first, max_new, SamplingParams(), -1, 0.0)


@functools.partial(jax.jit, static_argnames=("t_graph",))
def _forced_logits(t_graph, t_state, st0, tokens_N, steps):
    """Plain decoding's logits [V] after feeding ``tokens_N[:steps]`` (the first is st0's anchor) from st0: what
    decoding predicts for token ``steps`` of a generation whose first ``steps`` tokens are those."""
    target = nnx.merge(t_graph, t_state)

    def body(k, carry):
        cache, _ = carry
        res = target.forward(tokens_N[k][None, None], cache, mode="decode")
        return res.cache, res.logits[0]

    V = target.config.vocab_size
    _, logits = jax.lax.fori_loop(0, steps, body, (st0.cache, jnp.zeros((V,), jnp.float32)))
    return logits


def divergence(t_graph, t_state, st0, plain_tokens, spec_tokens) -> dict:
    """Where a DSpark run's tokens first differ from plain decoding's, and plain decoding's own logits there: the
    gap between its token and DSpark's (a gap at rounding level is a near-tie the verify pass's other summation
    order broke the other way; a large one is a bug) and its top-2 margin."""
    n = min(plain_tokens.size, spec_tokens.size)
    diff = np.nonzero(plain_tokens[:n] != spec_tokens[:n])[0]
    if diff.size == 0:
        return {"first_divergence": None}
    i = int(diff[0])
    st = jax.tree.map(jnp.copy, st0)
    logits = np.asarray(_forced_logits(t_graph, t_state, st, jnp.asarray(plain_tokens, jnp.int32), i),
                        np.float64)
    top2 = np.sort(logits)[-2:]
    return {"first_divergence": i, "plain_token": int(plain_tokens[i]), "spec_token": int(spec_tokens[i]),
            "logit_gap_at_divergence": float(logits[plain_tokens[i]] - logits[spec_tokens[i]]),
            "plain_top2_margin": float(top2[1] - top2[0])}


def _decode_run(t_graph, t_state, d_graph, d_state, st0, first, max_new, repeats: int):
    """(tokens, GenStats, seconds, peak RSS) of the decode loop from ``st0``: the fastest of ``repeats`` runs,
    each from its own copy of st0 (the program donates it; the copy is made before the phase starts)."""
    compiled = _decode.lower(t_graph, d_graph, t_state, d_state, st0, first, max_new=max_new).compile()
    best = None
    for _ in range(repeats):
        st = jax.block_until_ready(jax.tree.map(jnp.copy, st0))
        (out, n_out, stats), sec, rss = _phase(compiled, t_state, d_state, st, first)
        if best is None or sec < best[2]:
            best = (np.asarray(out)[:int(n_out)], jax.device_get(stats), sec, max(rss, best[3] if best else 0))
    return best


@functools.partial(jax.jit, static_argnames=("window",))
def _ring_stream(st: Stream, *, window: int) -> Stream:
    return Stream(st.anchor, st.cache, ring_from_linear(st.dcache, window), st.key)


def measure_length(target, drafter, prompt, max_new: int, windows, chunk_flag=None, repeats: int = 3,
                   share_prefill: bool = False) -> list:
    """The entries of one context length (one per drafter window); see the module docstring. ``share_prefill``:
    prefill once with the whole drafter context (window None, which must come first) and give each later window
    the ring of that context (``jdspark.drafter.ring_from_linear``; its entries' prefill fields are None)."""
    N = int(prompt.shape[0])
    G = drafter.config.block_size
    if share_prefill and windows[0] is not None:
        raise ValueError("share_prefill: the first window must be none (the whole context every ring is cut from)")
    chunk = dispatch.prefill_chunk(N, chunk_flag)
    P = N if chunk is None else -(-N // chunk) * chunk
    max_len = cache_positions(P, max_new, G, chunk)
    padded = np.full((1, P), target.config.pad_token_id, np.int32)
    padded[0, :N] = prompt
    padded = jnp.asarray(padded)
    entries, plain, shared = [], None, None
    for w in windows:
        t_mod, d_mod = serving_pair(target, with_context_window(drafter, w))
        t_graph, t_state = nnx.split(t_mod)
        d_graph, d_state = nnx.split(d_mod)
        pre = dict(prefill_tok_s=None, peak_rss_prefill_bytes=None, chunk_activation_bytes=None,
                   rss_before_prefill_bytes=None, prefill_rss_growth_bytes=None, memory_ratio=None)
        if shared is None:
            args = (t_state, d_state, padded, jnp.int32(N), jax.random.key(0))
            compiled = _prefill.lower(t_graph, d_graph, *args, max_len=max_len, chunk=chunk).compile()
            mem = compiled.memory_analysis()
            rss_before = _vm("VmRSS")
            (st, first), pre_sec, pre_rss = _phase(compiled, *args)
            act = int(mem.temp_size_in_bytes) if mem else 0
            t_cache, d_cache = _nbytes(st.cache), _nbytes(st.dcache)
            pre = dict(prefill_tok_s=N / pre_sec, peak_rss_prefill_bytes=pre_rss,
                       chunk_activation_bytes=act if mem else None, rss_before_prefill_bytes=rss_before,
                       # issue 18's bound: the prefill's growth of resident memory against the caches plus one
                       # chunk's activations (<= 1.5 is the bar)
                       prefill_rss_growth_bytes=pre_rss - rss_before,
                       memory_ratio=(pre_rss - rss_before) / max(t_cache + d_cache + act, 1))
            if share_prefill:
                shared = (st, first)
        else:
            st = _ring_stream(shared[0], window=w)  # not donated; each decode run copies its stream
            first = shared[1]
        t_cache, d_cache = _nbytes(st.cache), _nbytes(st.dcache)
        if plain is None:  # plain decoding from a copy of the same target cache, once per length
            st_plain = Stream(st.anchor, st.cache, None, st.key)
            toks, _, sec, rss = _decode_run(t_graph, t_state, None, None, st_plain, first, max_new, repeats)
            plain = dict(tokens=toks, tok_s=toks.size / sec, rss=rss)
        toks, stats, sec, rss = _decode_run(t_graph, t_state, d_graph, d_state, st, first, max_new, repeats)
        spec_tok_s = toks.size / sec
        entries.append({
            "context": N, "drafter_window": w, "plain_tok_s": plain["tok_s"], "spec_tok_s": spec_tok_s,
            "speedup": spec_tok_s / plain["tok_s"], "accept_len": stats.accept_len, **pre,
            "peak_rss_decode_bytes": rss, "cache_bytes": t_cache + d_cache, "target_cache_bytes": t_cache,
            "drafter_cache_bytes": d_cache, "plain_peak_rss_decode_bytes": plain["rss"], "prefill_chunk": chunk,
            "cache_positions": max_len, "prefill_shared": shared is not None and w is not None,
            "new_tokens": int(toks.size), "per_position_accept": stats.per_position_accept,
            "lossless": bool(np.array_equal(toks, plain["tokens"])),
        })
        if not entries[-1]["lossless"]:  # say where and by how much (the first token is the prefill's: i >= 1)
            entries[-1].update(divergence(t_graph, t_state, Stream(st.anchor, st.cache, None, st.key),
                                          plain["tokens"], toks))
        del st, first
    return entries


def run(target, drafter, tokenizer, lengths, windows, max_new: int, chunk_flag=None, seed: int = 0,
        corpus=None, log=None, repeats: int = 3, share_prefill_from: int = None) -> dict:
    """The whole benchmark: ``{"lengths": [...], ...}`` (see the module docstring)."""
    if drafter is None:
        raise ValueError("bench_long: needs a drafter (plain decoding is measured beside it)")
    out = []
    for n in lengths:
        prompt, _, held = long_prompt(tokenizer, n, max_new, seed=seed, corpus=corpus)
        share = share_prefill_from is not None and n >= share_prefill_from
        for e in measure_length(target, drafter, prompt, max_new, windows, chunk_flag, repeats, share):
            e["held_out_fraction"] = held
            out.append(e)
            if log:
                log(e)
    return {"lengths": out, "max_new_tokens": max_new, "windows": list(windows), "repeats": repeats,
            "backend": jax.default_backend(), "peak_rss_reset": reset_peak_rss()}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["lengths"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for w in result["windows"]:
        rs = [r for r in rows if r["drafter_window"] == w]
        x = [r["context"] for r in rs]
        label = f"DSpark, window {w or 'none'}"
        ax1.plot(x, [r["accept_len"] for r in rs], "o-", label=label)
        ax2.plot(x, [r["spec_tok_s"] for r in rs], "o-", label=label)
    rs = [r for r in rows if r["drafter_window"] == result["windows"][0]]
    ax2.plot([r["context"] for r in rs], [r["plain_tok_s"] for r in rs], "s--", color="gray", label="plain")
    for ax, yl in ((ax1, "accept_len (tokens per target step)"), (ax2, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"acceptance and speed against context ({result['backend']}, {result['max_new_tokens']} new tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ints(s: str) -> tuple:
    return tuple(int(x) for x in s.split(",") if x)


def _windows(s: str) -> tuple:
    return tuple(parse_context_window(x) for x in s.split(",") if x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=gen.DEFAULT_DIR, help="folder with target/ and drafter/")
    ap.add_argument("--lengths", type=_ints, default=DEFAULT_LENGTHS, help="context lengths, comma-separated")
    ap.add_argument("--windows", type=_windows, default=DEFAULT_WINDOWS,
                    help="drafter context windows, comma-separated ('none': the whole context)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="0: one pass; default: kimi.dispatch decides")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default=gen.DEFAULT_SERVING_DTYPE)
    ap.add_argument("--corpus", default=None, help="a folder of text files instead of the stdlib corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed decode runs per mode (the fastest counts)")
    ap.add_argument("--share-prefill-from", type=int, default=65536,
                    help="from this context length on, prefill once (window none first) and cut each window's ring "
                         "from it (0: prefill once per window at every length)")
    ap.add_argument("--plot", default=None, help="write a PNG of accept_len and tok/s against context")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line, last")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1 or a.repeats < 1 or not a.lengths or min(a.lengths) < 2 or not a.windows:
        ap.error("--max-new-tokens and --repeats >= 1, --lengths >= 2 each, and at least one window")
    share = a.share_prefill_from if a.share_prefill_from > 0 else None
    if share is not None and max(a.lengths) >= share and a.windows[0] is not None:
        ap.error("--share-prefill-from: the first of --windows must be none (each ring is cut from its context)")
    target, drafter, note = gen.load_pair(a.checkpoint, a.serving_dtype)
    print(f"[bench_long] {note}", file=sys.stderr)
    tokenizer = gen.load_tokenizer(a.checkpoint, target.config)

    def log(e):
        pre = ("prefill shared with window none" if e["prefill_tok_s"] is None else
               f"prefill {e['prefill_tok_s']:.0f} tok/s, peak RSS prefill "
               f"{e['peak_rss_prefill_bytes'] / 2**20:.0f} MiB")
        print(f"[bench_long] context {e['context']:>7} window {str(e['drafter_window']):>5}: plain "
              f"{e['plain_tok_s']:.1f} tok/s, DSpark {e['spec_tok_s']:.1f} tok/s ({e['speedup']:.2f}x), accept_len "
              f"{e['accept_len']:.2f}, {pre} / decode {e['peak_rss_decode_bytes'] / 2**20:.0f} MiB, "
              f"caches {e['cache_bytes'] / 2**20:.1f} MiB", file=sys.stderr)

    result = run(target, drafter, tokenizer, a.lengths, a.windows, a.max_new_tokens, a.prefill_chunk, a.seed,
                 a.corpus, log, a.repeats, share)
    if a.plot:
        plot(result, a.plot)
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
