"""Plain decoding vs DSpark on the shipped default pair, side by side in one run, per workload, greedy and sampled.

  python scripts/bench.py --json                    # workloads code / structured / prose
  python scripts/bench.py --corpus DIR --json       # prompts cut from your own text files
  python scripts/bench.py --prompt-file mine.jsonl --json   # your own prompts: {"prompt": ...} lines
  python scripts/bench.py --json --plot bench.png   # and the chart: speedup against per-token acceptance
  python scripts/bench.py --replot run.json --plot bench.png   # the chart again from a saved --json output
  python scripts/bench.py --workloads code --num-speculative-tokens 7 5 3 --json   # fewer drafts a step, side by side

Batch 1, held-out prompts, ``--max-new-tokens`` each; compilation and a warm-up run are excluded; both modes run the
same prompts in the same process, interleaved, ``--repeats`` times each (the fastest run of each counts). Each
workload has two rows: ``greedy`` and ``sampled`` (temperature ``--temperature`` 1, top-p ``--top-p`` 0.95, one fixed
seed per prompt, the same seed for plain decoding and DSpark). Throughput is of the decode phase (each prompt's
prefill, timed alone, is subtracted); end-to-end figures are reported beside it (``e2e_*``). A row holds tokens/s of
each mode, the speedup, accept_len (tokens per target step; per prompt, and a 95% bootstrap interval over the prompts,
``accept_len_ci95``), per-position acceptance, and how degenerate the plain output is (``run_share``, ``distinct8``,
``repeat_lines``: jdspark.textstats) next to the same figures of the real continuation of each prompt in its file, cut
to the same length in bytes (``reference``): acceptance is only worth reading on text that looks like real output. The
cost model's prediction from the measured acceptance: tokens per step over (v + r), with r = the measured drafter pass
over the measured plain decode step and v = the measured verify pass over a decode step (``predicted_speedup``), and
with v = 1 as seed 000 assumes for a memory-bound accelerator (``predicted_speedup_verify_as_one_step``).
``bits_per_byte``: the target on the held-out split of its training corpus. The top-level fields describe the code
workload's greedy row (or the ``--corpus`` directory's, or the ``--prompt-file``'s). An operator's own prompts
(``--prompt-file``: JSON Lines, ``jdspark.workloads.read_prompt_file``) are measured whole, each at its own length;
they have no real continuation, so their row's ``reference`` is null. ``--num-speculative-tokens N [M ...]``: DSpark
verifies only the block's first N drafts a step (the top-level ``num_speculative_tokens``); each further count is
timed in the same rounds as one more DSpark mode, reported in each row's ``also`` ({count: tok/s, speedup,
acceptance}).
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
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # before pyplot: no display here
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from flax import nnx  # noqa: E402

import jdspark  # noqa: E402
from jdspark import costmodel, textstats, workloads  # noqa: E402
from jdspark import data as jdata  # noqa: E402
from jdspark.drafter import CHECKPOINT_WINDOW, apply_context_window, parse_context_window  # noqa: E402
from jdspark.drafter import with_serving_layout as drafter_serving  # noqa: E402
from jdspark.evaluate import accept_len_interval, bits_per_byte  # noqa: E402
from jdspark.sampling import SamplingParams  # noqa: E402
from jdspark.speculative import draft_block, verify_width  # noqa: E402
from kimi.model import with_serving_layout  # noqa: E402


def _pass_seconds(target, drafter, tokens, max_new: int, repeats: int = 50, n_drafts=None) -> dict:
    """Wall time of one drafter pass (context attention + Markov head over ``n_drafts`` slots, default the block
    G), one target verify of those drafts and the anchor (n + 1 tokens) and one target decode step: each jitted
    alone on the serving copy of the weights, warm; modes interleaved, the fastest of 5 rounds counts. ``tokens``
    (a real prompt): its last n + 1 tokens are the verified block and the ones before them the cached context, so
    the verify routes real text to its experts (a block of one repeated token picks fewer experts and costs less
    than a verify of real drafts). The caches are as long as a generation of ``max_new`` tokens after that prompt
    makes them (attention reads all of it, masked)."""
    G = drafter.config.block_size
    n = G if n_drafts is None else n_drafts
    tokens = np.asarray(tokens, np.int32)
    if tokens.shape[0] < n + 2:
        raise ValueError(f"_pass_seconds: a prompt of at least {n + 2} tokens is needed, got {tokens.shape[0]}")
    ctx_ids, block_ids = tokens[:-(n + 1)], tokens[-(n + 1):]
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
                                                          SamplingParams(), 0.0, n_slots=n)[0]),
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


def run_workload(target, drafter, prompts, max_new: int, repeats: int = 3, *, temperature: float = 0.0,
                 top_p: float = 1.0, seeds=None, num_speculative_tokens=None, also=()) -> dict:
    """Decode-phase throughput of both modes: each prompt's prefill (timed alone, as a 1-token generation) is
    subtracted from its full generation, so the figures compare decoding, not prompt processing. End-to-end
    figures (prefill included) are reported too. Every (prompt, mode) is timed ``repeats`` times, the modes
    interleaved, and the fastest run counts: the noise of a shared machine only ever adds time, to either mode.
    Prompt ``i`` samples with seed ``seeds[i]`` in both modes. DSpark verifies ``num_speculative_tokens`` drafts a
    step (default: the whole block); each count in ``also`` is one more DSpark mode timed in the same rounds
    (``also``: {n: its tok/s, speedup, acceptance}). Also returns the plain outputs' ids (``_outputs``)."""
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    kw = dict(eos_token_id=-1, temperature=temperature, top_p=top_p)  # fixed length: max_new tokens each
    modes = [("ar", None, None), ("spec", drafter, num_speculative_tokens)] + [(n, drafter, n) for n in also]
    firsts = {len(p): p for p in reversed(prompts)}  # a prompt of each length (an operator's differ)
    for _, d, n in modes:  # compile + warm-up of every program for each length's bucket (excluded)
        for p in firsts.values():
            for new in (max_new, 1):
                jdspark.generate(target, d, p, max_new_tokens=new, seed=seeds[0], num_speculative_tokens=n, **kw)
    secs = {(m, pre): 0.0 for m, _, _ in modes for pre in (False, True)}
    acc = {m: dict(steps=[], accepted=[], counts=0, mismatches=0) for m, _, _ in modes[1:]}
    diverged, outputs, n_new = [], [], 0
    for p, seed in zip(prompts, seeds):
        best, outs = {k: float("inf") for k in secs}, {}
        for _ in range(repeats):
            for m, d, n in modes:
                for pre, new in ((True, 1), (False, max_new)):
                    dt, outs[m] = _timed(lambda: jdspark.generate(target, d, p, max_new_tokens=new, seed=seed,
                                                                  num_speculative_tokens=n, **kw))
                    best[m, pre] = min(best[m, pre], dt)
        for k in secs:
            secs[k] += best[k]
        n_new += max_new - 1  # tokens after the first (which the prefill yields)
        ar_tokens = outs["ar"].tokens
        for m, a in acc.items():
            st = outs[m].stats
            if not np.array_equal(ar_tokens, outs[m].tokens):
                a["mismatches"] += 1
                if temperature == 0 and m == "spec":
                    diverged.append(dict(prompt=len(outputs), **greedy_divergence(target, p, ar_tokens,
                                                                                  outs[m].tokens)))
            a["steps"].append(int(st.target_steps))
            a["accepted"].append(int(st.accepted))
            a["counts"] = a["counts"] + np.asarray(st.accept_counts, np.int64)
        outputs.append(np.asarray(ar_tokens))
    dec = {m: secs[m, False] - secs[m, True] for m, _, _ in modes}
    total = len(prompts) * max_new

    def figures(m):
        a = acc[m]
        steps, accepted = sum(a["steps"]), sum(a["accepted"])
        f = {"spec_tok_s": n_new / dec[m], "speedup": dec["ar"] / dec[m], "accept_len": (accepted + steps) / steps,
             "per_position_accept": (a["counts"] / steps).tolist(), "e2e_speedup": secs["ar", False] / secs[m, False]}
        if temperature == 0:  # greedy DSpark must be plain decoding, token for token
            f["greedy_mismatches"] = a["mismatches"]
        return f

    spec = acc["spec"]
    row = {"prompts": len(prompts), "new_tokens": max_new, "repeats": repeats, "temperature": temperature,
           "top_p": top_p, "ar_tok_s": n_new / dec["ar"], **figures("spec"),
           "accept_len_per_prompt": [(a + s) / s for s, a in zip(spec["steps"], spec["accepted"])],
           "accept_len_ci95": accept_len_interval(spec["steps"], spec["accepted"]),
           "e2e_ar_tok_s": total / secs["ar", False], "e2e_spec_tok_s": total / secs["spec", False],
           "loop_step_over_decode_step": (dec["spec"] / sum(spec["steps"])) / (dec["ar"] / n_new),
           "ar_step_s": dec["ar"] / n_new, "_outputs": outputs}
    if temperature == 0:
        row["greedy_divergences"] = diverged
    if also:
        row["also"] = {str(n): figures(n) for n in also}
    return row


def greedy_divergence(target, prompt, plain, spec) -> dict:
    """Where greedy DSpark first left plain decoding (token ``at`` of the output) and how close plain decoding's
    choice was there: logit(plain token) - logit(DSpark's token) from a one-pass prefill of the prompt and the plain
    tokens before it, by the bf16 serving copy (``gap_bf16``) and by the fp32 checkpoint (``gap_fp32``), and how far
    the serving copy's logits sit from the fp32 ones at that position (``bf16_shift``, the largest difference).
    The serving copy rounds each matmul's input rows to bf16 (kimi/ops/linear.py): a decode step and a verify block
    reach those roundings with fp32 sums taken in another order, and a sum one fp32 ulp either side of a bf16
    rounding boundary moves by a bf16 ulp. A gap below ``bf16_shift`` is a near-tie at the serving precision broken
    the other way; a gap far above it would be a bug."""
    plain, spec = np.asarray(plain), np.asarray(spec)
    n = min(plain.size, spec.size)
    at = int(np.nonzero(plain[:n] != spec[:n])[0][0])
    seq = jnp.asarray(np.concatenate([np.asarray(prompt), plain[:at]]).astype(np.int32))[None]

    def last_logits(model):
        out = model.forward(seq, model.init_cache(1, seq.shape[1]), mode="prefill")
        return np.asarray(out.logits[0, -1], np.float64)

    served, fp32 = last_logits(with_serving_layout(target)), last_logits(target)
    a, b = int(plain[at]), int(spec[at])
    return {"at": at, "plain_token": a, "spec_token": b, "gap_bf16": float(served[a] - served[b]),
            "gap_fp32": float(fp32[a] - fp32[b]), "bf16_shift": float(np.abs(served - fp32).max())}


def degeneracy_figures(tokenizer, outputs, continuations) -> dict:
    """The plain outputs' degeneracy, and the real continuations' cut to each output's length in bytes."""
    texts = [tokenizer.decode_bytes(o) for o in outputs]
    fig = textstats.mean_degeneracy(texts)
    fig["reference"] = None if any(c is None for c in continuations) else textstats.mean_degeneracy(
        [c[:len(t)] for t, c in zip(texts, continuations)])
    return fig


def _reference_text(ref) -> str:
    if ref is None:
        return "no real continuation to compare with"
    return f"real text: {ref['run_share']:.2f} / {ref['distinct8']:.2f} / {ref['repeat_lines']:.2f}"


def heldout_bits_per_byte(target, tokenizer, corpus=None, seq_len: int = 512, batches: int = 16) -> float:
    val = jdata.validation_batches(batch=4, seq_len=seq_len, num_batches=batches, corpus=corpus, tokenizer=tokenizer)
    return bits_per_byte(target, val, jdata.byte_lengths(tokenizer, target.config.vocab_size))


def plot(result: dict, path: str) -> None:
    """Speedup against per-token acceptance p: the cost model with this run's measured r and v, and with the seed's
    r = 0.1, v = 1; the seed's anchors; this run's measured points per workload and row. Per-position acceptance
    beside it. Written to a temporary name, then renamed."""
    G = result.get("num_speculative_tokens") or result["block_size"]  # drafts verified a step (older runs: a block)
    ps = np.linspace(0.0, 0.999, 200)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    code = next(iter(result["workloads"].values()))["greedy"]
    r, v = code["r_draft_over_step"], code["v_verify_over_step"]
    ax.plot(ps, [costmodel.expected_tokens_per_step(p, G) / (v + r) for p in ps], "k-",
            label=f"cost model, this machine (r={r:.2f}, v={v:.2f})")
    ax.plot(ps, [costmodel.speedup(p, G, costmodel.DEFAULT_R) for p in ps], "k--",
            label=f"cost model, seed (r={costmodel.DEFAULT_R}, v=1)")
    for s, name in zip(costmodel.DEFAULT_SPEEDUPS, ("vLLM blog 370 tok/s", "vLLM peak 464 tok/s")):
        p = costmodel.p_from_speedup(s, costmodel.DEFAULT_GAMMA, costmodel.DEFAULT_R)  # the seed's gamma 7
        ax.plot([p], [s], "*", ms=15, color="gold", mec="k", label=f"seed anchor {s:.2f}x ({name})")
    markers = {"greedy": "o", "sampled": "s"}
    for wi, (w, rows) in enumerate(result["workloads"].items()):
        for mode, row in rows.items():
            if not isinstance(row, dict) or "accept_len" not in row:
                continue
            p = _p_from_accept_len(row["accept_len"], G)
            ax.plot([p], [row["speedup"]], markers[mode], color=f"C{wi}", ms=9,
                    label=f"{w} {mode}: accept_len {row['accept_len']:.2f}, {row['speedup']:.2f}x")
            pp = row["per_position_accept"]
            bx.plot(range(1, len(pp) + 1), pp, marker=markers[mode], color=f"C{wi}",
                    ls="-" if mode == "greedy" else ":", label=f"{w} {mode}")
    ax.set(xlabel="per-token acceptance p", ylabel="speedup over plain decoding", xlim=(0, 1), ylim=(0, G + 1),
           title=f"DSpark speedup vs acceptance ({G} drafts a step, block {result['block_size']}, "
                 f"{result['backend']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    bx.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1.02), title="per-position acceptance")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _p_from_accept_len(accept_len: float, G: int) -> float:
    """The constant per-token acceptance p whose expected tokens per step (gamma = G) equal ``accept_len``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if costmodel.expected_tokens_per_step(mid, G) < accept_len else (lo, mid)
    return 0.5 * (lo + hi)


def _read_result(path: str, error) -> dict:
    """The result object of an earlier ``--json`` run: the last non-empty line of ``path`` (what the run printed
    last); ``error(message)`` names the file and what is wrong with it."""
    try:
        with open(path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError as e:
        error(f"--replot {path}: {e.strerror or e}")
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError as e:
        error(f"--replot {path}: its last line is not JSON ({e.msg}); expected bench.py --json's output")
    if not isinstance(result, dict) or not isinstance(result.get("workloads"), dict) or "block_size" not in result:
        error(f"--replot {path}: expected bench.py --json's object (with 'block_size' and 'workloads') last")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="folder with target/ and drafter/ (default: the shipped one)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--corpus", help="measure prompts cut from the text files under this directory instead")
    src.add_argument("--prompt-file", metavar="PATH", help="measure your own prompts instead: JSON Lines, one "
                     "{\"prompt\": \"text\" or [token ids]} per line, every line (--prompts, --prompt-len unused)")
    ap.add_argument("--workloads", nargs="+", default=["code", "structured", "prose"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (acceptance moves far more between "
                    "prompts than within one: each row reports accept_len_ci95 over its prompts)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (BOS included)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per (prompt, mode), interleaved; the "
                    "fastest counts (a shared machine's noise only adds time: more runs, a steadier ratio)")
    ap.add_argument("--seed", type=int, default=0, help="prompt choice; prompt i samples with seed 1000*seed + i")
    ap.add_argument("--temperature", type=float, default=1.0, help="the sampled rows' temperature")
    ap.add_argument("--top-p", type=float, default=0.95, help="the sampled rows' nucleus")
    ap.add_argument("--no-sampled", action="store_true", help="greedy rows only")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default=None,
                    help="the matmul weights' dtype in both modes (default: generate.DEFAULT_SERVING_DTYPE)")
    ap.add_argument("--drafter-window", type=parse_context_window, default=CHECKPOINT_WINDOW, metavar="N|none",
                    help="the drafter reads only the last N context positions (a ring buffer; lossless either way); "
                         "none: all of them; default: the checkpoint's (the shipped drafter's: 64; "
                         "docs/performance.md)")
    ap.add_argument("--num-speculative-tokens", type=int, nargs="+", default=None, metavar="N",
                    help="DSpark verifies only the block's first N drafts a step (default: the whole block; "
                         "jdspark.generate's num_speculative_tokens); more counts after the first are timed in the "
                         "same rounds too, each row's 'also'")
    ap.add_argument("--plot", default=None, help="write the speedup-vs-acceptance chart to this PNG")
    ap.add_argument("--replot", metavar="JSON", default=None, help="measure nothing: draw --plot from the last line "
                    "of an earlier run's --json output (a saved file)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line, last")
    a = ap.parse_args(argv)
    if a.replot is not None:
        if not a.plot:
            ap.error("--replot needs --plot FILE.png (where to draw the chart)")
        plot(_read_result(a.replot, ap.error), a.plot)
        print(f"[bench] chart of {a.replot} written to {a.plot}", file=sys.stderr)
        return 0
    if a.prompts < 1 or a.prompt_len < 2 or a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--prompts, --prompt-len (>= 2), --max-new-tokens and --repeats must be positive")
    if a.temperature <= 0 or not 0 < a.top_p <= 1:
        ap.error("--temperature must be > 0 and --top-p in (0, 1]")

    ckpt = a.checkpoint or gen.DEFAULT_DIR
    corpus_docs = None
    if a.corpus:  # read before the pair loads: a wrong folder is said at once
        try:
            corpus_docs = workloads.documents_from_dir(a.corpus)
        except (ValueError, OSError) as e:
            ap.error(str(e))
    target, drafter, note = gen.load_pair(ckpt, a.serving_dtype or gen.DEFAULT_SERVING_DTYPE)
    print(f"[bench] {note}", file=sys.stderr)
    if drafter is None:
        raise SystemExit("bench: the checkpoint has no drafter/")
    drafter = apply_context_window(drafter, a.drafter_window)
    G = drafter.config.block_size
    n_drafts, *also = a.num_speculative_tokens or [G]
    if len({n_drafts, *also}) < 1 + len(also):
        ap.error(f"--num-speculative-tokens: expected distinct counts, got {' '.join(map(str, (n_drafts, *also)))}")
    try:  # the range: where generate and the server check it (speculative.verify_width)
        for n in (n_drafts, *also):
            verify_width(drafter, n)
    except ValueError as e:
        ap.error(f"--{str(e).replace('_', '-')}")
    tokenizer = gen.load_tokenizer(ckpt, target.config)
    if a.prompt_file:
        try:
            own = workloads.read_prompt_file(a.prompt_file, tokenizer, target.config.vocab_size)
        except ValueError as e:
            ap.error(str(e))
        sources = {"prompt_file": own}  # prompts already, not documents to cut them from
    elif a.corpus:
        sources = {"corpus": corpus_docs}
    else:
        sources = {w: workloads.documents(w) for w in a.workloads}
    passes = None
    result = {"backend": __import__("jax").default_backend(), "checkpoint": note, "tokenizer": tokenizer.kind,
              "block_size": drafter.config.block_size, "num_speculative_tokens": n_drafts,
              "drafter_window": drafter.config.context_window,
              "serving_dtype": target.config.serving_dtype,
              "bits_per_byte": heldout_bits_per_byte(target, tokenizer, a.corpus), "workloads": {}}
    print(f"[bench] held-out bits per byte {result['bits_per_byte']:.3f}", file=sys.stderr)
    rows = [("greedy", 0.0, 1.0)] + ([] if a.no_sampled else [("sampled", a.temperature, a.top_p)])
    for name, docs in sources.items():
        if name == "prompt_file":  # the operator's prompts, no real continuation to compare with
            cut = [(np.asarray(p, np.int32), None) for p in docs]
        else:
            cut = jdata.prompts_from_documents(docs, a.prompts, a.prompt_len, seed=a.seed, tokenizer=tokenizer,
                                               continuations=True)
        prompts, conts = [c[0] for c in cut], [c[1] for c in cut]
        if passes is None:  # once, on the first workload's first prompt
            passes = _pass_seconds(target, drafter, prompts[0], a.max_new_tokens, n_drafts=n_drafts)
        result["workloads"][name] = {}
        for mode, temp, top_p in rows:
            r = run_workload(target, drafter, prompts, a.max_new_tokens, a.repeats, temperature=temp, top_p=top_p,
                             seeds=[1000 * a.seed + i for i in range(len(prompts))],
                             num_speculative_tokens=n_drafts, also=also)
            r.update(degeneracy_figures(tokenizer, r.pop("_outputs"), conts))
            step_s = r.pop("ar_step_s")
            r["r_draft_over_step"] = passes["draft"] / step_s
            r["v_verify_over_step"] = passes["verify"] / passes["decode"]
            r["predicted_speedup"] = costmodel.speedup_from_per_position(
                r["per_position_accept"], r["r_draft_over_step"], r["v_verify_over_step"])
            r["predicted_speedup_verify_as_one_step"] = costmodel.speedup_from_per_position(
                r["per_position_accept"], r["r_draft_over_step"])
            result["workloads"][name][mode] = r
            print(f"[bench] {name:10s} {mode:7s} accept_len {r['accept_len']:.2f} (95% over prompts "
                  f"{r['accept_len_ci95'][0]:.2f}-{r['accept_len_ci95'][1]:.2f})  AR {r['ar_tok_s']:.1f} tok/s  "
                  f"DSpark {r['spec_tok_s']:.1f} tok/s  speedup {r['speedup']:.2f}x  plain output: run_share "
                  f"{r['run_share']:.2f} distinct8 {r['distinct8']:.2f} repeat_lines {r['repeat_lines']:.2f} "
                  f"({_reference_text(r['reference'])}); cost model {r['predicted_speedup']:.2f}x with the "
                  f"measured verify = {r['v_verify_over_step']:.2f} decode steps, a whole DSpark step costs "
                  f"{r['loop_step_over_decode_step']:.2f}", file=sys.stderr)
            for n, f in r.get("also", {}).items():
                print(f"[bench] {name:10s} {mode:7s} {n} drafts a step: accept_len {f['accept_len']:.2f}  DSpark "
                      f"{f['spec_tok_s']:.1f} tok/s  speedup {f['speedup']:.2f}x", file=sys.stderr)
    top = result["workloads"]["code" if "code" in sources else next(iter(sources))]
    for k in ("ar_tok_s", "spec_tok_s", "speedup", "accept_len", "accept_len_ci95", "per_position_accept",
              "predicted_speedup"):
        result[k] = top["greedy"][k]
    if a.plot:
        plot(result, a.plot)
        print(f"[bench] chart written to {a.plot}", file=sys.stderr)
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
