"""Generate with the shipped default pair (target + DSpark drafter), streaming the text, then report acceptance
and the speedup over plain decoding measured in the same run.

  python scripts/generate.py --prompt "def fibonacci(n):"            # DSpark on
  python scripts/generate.py --prompt "..." --no-draft               # plain decoding
  python scripts/generate.py --demo                                  # the code prompt `make demo` uses
  python scripts/generate.py --demo --num-speculative-tokens 7 3 2   # DSpark at 7, 3 and 2 drafts a step, timed
  python scripts/generate.py --prompt-file long.py --drafter-window none   # a long prompt; the drafter reads all
  python scripts/generate.py --prompt "..." --json-schema '{"type": "object", "properties": {...}}'  # JSON output
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

from flax import nnx  # noqa: E402

import jdspark  # noqa: E402
import kimi  # noqa: E402

DEFAULT_DIR = os.path.join(ROOT, "checkpoints", "default")
DEMO_PROMPT = '''import os


def list_python_files(root):
    """Return the paths of all .py files under root."""
'''


# --heldout's prompts: as long as scripts/bench.py's (--prompt-len), so the figures compare with its code rows
HELDOUT_PROMPT_LEN = 128
DEMO_FEWER_DRAFTS = 3  # --demo also times DSpark verifying this many drafts a step (this CPU's best count for the
# shipped pair, docs/performance.md "Fewer drafts a step")

# Generations serve bf16 matmul weights (fp32 accumulation; kimi/ops/linear.py): on this CPU both plain decoding
# and DSpark run faster than with fp32 weights, and the shipped pair's greedy output on the bench prompts is the same.
DEFAULT_SERVING_DTYPE = "bfloat16"


def load_pair(ckpt_dir: str, serving_dtype: str = DEFAULT_SERVING_DTYPE):
    """(target, drafter, note). The shipped pair from ``ckpt_dir``; a folder without target/config.json gives a tiny
    random pair, said loudly; no folder at all is an error (SystemExit naming it).
    ``serving_dtype``: the dtype of the matmul weights a generation serves (``KimiConfig.serving_dtype``)."""
    if not os.path.isdir(ckpt_dir):  # every script's --checkpoint comes here: a typo is said, not served at random
        raise SystemExit(f"--checkpoint {ckpt_dir}: no such folder (expected one with target/ and drafter/)")
    tdir, ddir = os.path.join(ckpt_dir, "target"), os.path.join(ckpt_dir, "drafter")
    if os.path.isfile(os.path.join(tdir, "config.json")):
        target = kimi.load_checkpoint(tdir, config_overrides={"serving_dtype": serving_dtype})
        drafter = jdspark.load_drafter(ddir, target=target) if os.path.isfile(os.path.join(ddir, "config.json")) \
            else None
        return target, drafter, f"loaded {ckpt_dir}"
    cfg = kimi.KimiConfig.demo(expert_format="dense", serving_dtype=serving_dtype)
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    drafter = jdspark.DSparkDrafter(jdspark.DSparkConfig.for_target(cfg, block_size=7, mask_token_id=258),
                                    target=target, rngs=nnx.Rngs(1))
    return target, drafter, f"no checkpoint at {ckpt_dir}: using an UNTRAINED random demo() pair"


def load_tokenizer(ckpt_dir: str, cfg):
    """The target's tokenizer (``kimi.load_tokenizer`` of ``ckpt_dir/target``: tokenizer.json, tiktoken.model, or
    the byte vocabulary when it ships neither), checked against the model's vocabulary and special ids."""
    import kimi

    tdir = os.path.join(ckpt_dir, "target")
    tok = kimi.load_tokenizer(tdir if os.path.isdir(tdir) else ckpt_dir, vocab_size=cfg.vocab_size)
    if tok.bos_id != cfg.bos_token_id:
        raise ValueError(f"tokenizer: bos id {tok.bos_id} differs from the model's bos_token_id {cfg.bos_token_id}")
    return tok


def encode(text: str, tokenizer) -> np.ndarray:
    """``[BOS] + ids`` of the prompt text."""
    return np.asarray(tokenizer.encode(text, bos=True), np.int32)


class _Streamer:
    """Prints committed tokens as text, holding back bytes that do not yet form a character; ``skip_prefix`` (a
    healed prompt's last token, printed with the prompt) is not printed again."""

    def __init__(self, tokenizer, skip_prefix: str = ""):
        self.dec = tokenizer.incremental_decoder(skip_prefix=skip_prefix)

    def _write(self, text: str):
        sys.stdout.write(text)
        sys.stdout.flush()

    def __call__(self, ids):
        self._write(self.dec.add(np.asarray(ids).reshape(-1)))

    def close(self):
        self._write(self.dec.flush())


def with_images(ids, paths, cfg, ckpt):
    """(prompt ids with one expanded placeholder per image after BOS, the preprocessed images)."""
    if cfg.vision is None:
        raise SystemExit(f"--image: the checkpoint {ckpt} is text-only (its config has no vision_config)")
    from PIL import Image

    from kimi import image as image_lib

    frames = []
    for p in paths:
        try:
            with Image.open(p) as im:
                frames.append(np.asarray(im.convert("RGB")))
        except OSError as e:
            raise SystemExit(f"--image {p}: not a readable image ({e})")
    vin = image_lib.preprocess(frames, cfg.vision)
    ids = [int(t) for t in ids]
    ph = [cfg.vision.media_placeholder_token_id] * len(paths)
    ids = ids[:1] + ph + ids[1:] if ids and ids[0] == cfg.bos_token_id else ph + ids
    return np.array(image_lib.expand_placeholders(ids, vin.grid_thw, cfg.vision), np.int32), vin


def side_by_side(target, drafter, runs, repeats: int, also=()) -> dict:
    """Plain decoding against DSpark (``drafter``; None: plain only) on each (prompt ids, ``jdspark.generate``
    keywords) of ``runs``: every mode compiled and warmed up first (excluded), then ``repeats`` timed runs of each,
    the modes interleaved; the fastest run of each (prompt, mode) counts (a shared machine's noise only adds time).
    Returns tok/s over all the prompts (new tokens / summed seconds, each prompt's prefill included) and DSpark's
    pooled acceptance: accept_len = (accepted + steps) / steps and the per-position acceptance, summed over the
    prompts' steps. Each count n in ``also`` is one more DSpark mode, ``num_speculative_tokens=n``, timed in the same
    rounds (``also``: {n: its tok/s, speedup, accept_len})."""
    modes = [("ar", None, {})] + ([("spec", drafter, {})] if drafter is not None else [])
    modes += [(n, drafter, {"num_speculative_tokens": n}) for n in (also if drafter is not None else ())]
    for ids, kw in runs:
        for _, d, extra in modes:
            jdspark.generate(target, d, ids, **{**kw, **extra})
    seconds, tokens = {m: 0.0 for m, _, _ in modes}, {m: 0 for m, _, _ in modes}
    steps = {m: 0 for m, _, _ in modes[1:]}
    accepted, counts = dict(steps), dict(steps)
    for ids, kw in runs:
        best = {}
        for _ in range(repeats):
            for name, d, extra in modes:
                t0 = time.perf_counter()
                out = jdspark.generate(target, d, ids, **{**kw, **extra})
                sec = time.perf_counter() - t0
                if sec < best.get(name, (float("inf"),))[0]:
                    best[name] = (sec, out)
        for name, (sec, out) in best.items():
            seconds[name] += sec
            tokens[name] += out.num_tokens
            if name in steps:
                st = out.stats
                steps[name], accepted[name] = steps[name] + int(st.target_steps), accepted[name] + int(st.accepted)
                counts[name] = counts[name] + np.asarray(st.accept_counts, np.int64)

    def figures(m):
        tok_s = tokens[m] / seconds[m]
        return {"spec_tok_s": tok_s, "accept_len": (accepted[m] + steps[m]) / steps[m],
                "per_position_accept": (counts[m] / steps[m]).tolist(), "speedup": tok_s / res["ar_tok_s"]}

    res = {"ar_tok_s": tokens["ar"] / seconds["ar"]}
    if drafter is not None:
        res.update(figures("spec"))
    if also and drafter is not None:
        res["also"] = {str(n): figures(n) for n in also}
    return res


def heldout_code_prompts(tokenizer, n: int) -> list:
    """The first ``n`` prompts of ``scripts/bench.py``'s code workload (held-out stdlib files, cut at line starts,
    ``HELDOUT_PROMPT_LEN`` tokens with BOS; seed 0): files no part of the pair was trained on."""
    from jdspark import data as jdata
    from jdspark import workloads

    cut = jdata.prompts_from_documents(workloads.documents("code"), n, HELDOUT_PROMPT_LEN, seed=0,
                                       tokenizer=tokenizer)
    return [np.asarray(p, np.int32) for p in cut]


def constraint(ap, a, tokenizer, cfg):
    """--json-schema / --regex as a ``jdspark.grammar.TokenFSM`` (None: neither), EOS its stop."""
    from jdspark.grammar import regex_automaton, vocab_fsm
    from jdspark.json_schema import any_object_regex, schema_regex

    if a.json_schema is not None and a.regex is not None:
        ap.error("give one of --json-schema and --regex")
    if a.json_schema is None and a.regex is None:
        return None
    try:
        if a.regex is not None:
            pattern = a.regex
        else:
            text = a.json_schema
            if text.startswith("@"):
                with open(text[1:], encoding="utf-8") as f:
                    text = f.read()
            schema = json.loads(text)
            pattern = any_object_regex() if schema == {} else schema_regex(schema)
        automaton = regex_automaton(pattern)
    except (OSError, ValueError) as e:
        ap.error(f"--{'regex' if a.regex is not None else 'json-schema'}: {e}")
    return vocab_fsm(automaton, tokenizer, cfg.vocab_size, (cfg.eos_token_id,))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", help="prompt text")
    ap.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a UTF-8 file (a long prompt)")
    ap.add_argument("--demo", action="store_true", help="use the built-in code prompt")
    ap.add_argument("--checkpoint", default=DEFAULT_DIR, help="folder with target/ and drafter/")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the likeliest's probability")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-draft", action="store_true", help="plain decoding only")
    ap.add_argument("--drafter-window", type=jdspark.drafter.parse_context_window,
                    default=jdspark.drafter.CHECKPOINT_WINDOW, metavar="N|none",
                    help="the drafter reads only the last N context positions, from a ring buffer (its memory and "
                         "draft cost stop growing with the context; lossless either way); none: all of them; "
                         "default: the checkpoint's (the shipped drafter's: 64, from which it accepts more than "
                         "from a longer context, docs/performance.md)")
    ap.add_argument("--num-speculative-tokens", type=int, nargs="+", default=None, metavar="N",
                    help="verify only the block's first N drafts a step (default: the whole block; on this CPU, "
                         "where each verified position costs compute, fewer can pay: docs/performance.md); more "
                         "counts after the first are timed beside it in the side-by-side figures (--demo: the "
                         f"block, then {DEMO_FEWER_DRAFTS})")
    ap.add_argument("--no-compare", action="store_true", help="skip the side-by-side timing")
    ap.add_argument("--heldout", type=int, default=None, metavar="N", help="also time both modes on N held-out "
                    "code prompts (bench.py's code workload: one prompt's figures move far from the next's); "
                    "default 4 with --demo, else 0")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each mode, interleaved (the fastest "
                    "counts)")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default=DEFAULT_SERVING_DTYPE,
                    help="the matmul weights' dtype (fp32 accumulation either way)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill the prompt in chunks of N tokens (0: "
                    "one pass; default: kimi.dispatch.prefill_chunk decides by the prompt's length)")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image for a checkpoint with a vision tower (repeatable): one placeholder per image "
                         "after BOS, expanded to its merged patches")
    ap.add_argument("--json-schema", metavar="SCHEMA", help="constrain the output to a JSON document this JSON "
                    "Schema validates (inline JSON, or @PATH; '{}' any JSON object; jdspark.json_schema), then EOS")
    ap.add_argument("--regex", metavar="PATTERN", help="constrain the output to a text PATTERN matches whole, then EOS")
    ap.add_argument("--no-token-healing", dest="token_healing", action="store_false",
                    help="keep the prompt's last token (by default it is taken off and the first new token must "
                         "begin with its text: a prompt ending in a newline gets its indentation; "
                         "kimi.tokenizer.Tokenizer.heal)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line, last")
    a = ap.parse_args(argv)
    if sum(x is not None for x in (a.prompt, a.prompt_file)) + bool(a.demo) != 1:
        ap.error("give one of --prompt TEXT, --prompt-file PATH or --demo")
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                a.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"--prompt-file {a.prompt_file}: expected a readable UTF-8 text file ({e})")
    if a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--max-new-tokens and --repeats must be >= 1")
    plain_text = a.json_schema is None and a.regex is None and not a.image
    if a.heldout is None:
        a.heldout = 4 if a.demo and plain_text and not a.no_compare else 0
    if a.heldout < 0 or (a.heldout and (not plain_text or a.no_compare)):
        ap.error(f"--heldout: expected a count >= 0, and 0 with --no-compare, --json-schema, --regex or --image; "
                 f"got {a.heldout}")
    if a.prefill_chunk is not None and a.prefill_chunk < 0:
        ap.error("--prefill-chunk must be >= 0")
    counts = a.num_speculative_tokens or []
    if counts and (a.no_draft or min(counts) < 1 or len(set(counts)) < len(counts)):
        ap.error(f"--num-speculative-tokens: expected distinct counts >= 1 (the drafter's block size at most), and "
                 f"none with --no-draft; got {' '.join(map(str, counts))}")
    try:  # the sampling flags, checked where generate checks them, before the pair loads
        jdspark.sampling.SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p)
    except ValueError as e:
        ap.error(f"--{str(e).replace('_', '-')}")
    prompt = DEMO_PROMPT if a.prompt is None else a.prompt

    target, drafter, note = load_pair(a.checkpoint, a.serving_dtype)
    print(f"[jdspark] {note}", file=sys.stderr)
    if a.no_draft:
        drafter = None
    else:
        drafter = jdspark.drafter.apply_context_window(drafter, a.drafter_window)
        G = drafter.config.block_size
        try:  # the range: where generate and the server check it
            for n in counts:
                jdspark.speculative.verify_width(drafter, n)
        except ValueError as e:
            ap.error(f"--{str(e).replace('_', '-')}")
        if not counts and a.demo:  # the demo shows what fewer drafts a step buy on this CPU, beside the block
            counts = [G] + ([DEMO_FEWER_DRAFTS] if DEMO_FEWER_DRAFTS < G else [])
    n_drafts, *also = counts or [None]
    tokenizer = load_tokenizer(a.checkpoint, target.config)
    ids = encode(prompt, tokenizer)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
              seed=a.seed, prefill_chunk=a.prefill_chunk, grammar=constraint(ap, a, tokenizer, target.config),
              num_speculative_tokens=n_drafts)
    healed = tokenizer.heal(ids) if a.token_healing and kw["grammar"] is None and not a.image else None
    if healed is not None:  # not with a constraint (it takes the text from the prompt's end) or images
        ids, kw["first_token_ids"] = np.asarray(healed.ids, np.int32), healed.first_ids

    sys.stdout.write(prompt)
    sys.stdout.flush()
    streamer = _Streamer(tokenizer, skip_prefix="" if healed is None else healed.text)
    streamed = jdspark.generate(target, drafter, ids, stream=streamer, **kw)
    streamer.close()
    sys.stdout.write("\n")
    result = {"mode": "ar" if drafter is None else "dspark", "new_tokens": streamed.num_tokens,
              "stats": streamed.stats.as_dict(), "token_healing": None if healed is None else healed.text}
    if drafter is not None:
        result["num_speculative_tokens"] = n_drafts or drafter.config.block_size
    if not a.no_compare:
        runs = side_by_side(target, drafter, [(ids, kw)], a.repeats, also)
        result["ar_tok_s"] = runs["ar_tok_s"]
        if drafter is not None:
            result.update({k: runs[k] for k in ("spec_tok_s", "speedup", "accept_len", "per_position_accept")})
            result.update({k: runs[k] for k in ("also",) if k in runs})
        if a.heldout:
            held = heldout_code_prompts(tokenizer, a.heldout)
            hkw = {k: v for k, v in kw.items() if k not in ("grammar", "first_token_ids")}
            runs = side_by_side(target, drafter, [(p, dict(hkw, seed=a.seed + i)) for i, p in enumerate(held)],
                                a.repeats, also)
            result["heldout_code"] = {"prompts": len(held), "prompt_len": HELDOUT_PROMPT_LEN,
                                      "new_tokens": a.max_new_tokens, **runs}
    how = "greedy" if a.temperature == 0 else (f"sampled: temperature {a.temperature}, top-k {a.top_k or 'off'}, "
                                               f"top-p {a.top_p}, min-p {a.min_p or 'off'}, seed {a.seed}")
    heal = "" if healed is None else f"; token healing: the prompt's last token {healed.text!r} drawn again"
    lines = [f"mode {result['mode']}, {result['new_tokens']} new tokens ({how}; {tokenizer.kind} tokenizer{heal})"]
    st = result["stats"]
    if drafter is not None:
        pp = " ".join(f"{x:.2f}" for x in st["per_position_accept"])
        lines.append(f"accept_len {st['accept_len']:.2f} tokens/step (block {drafter.config.block_size}, "
                     f"{result['num_speculative_tokens']} drafts verified a step); "
                     f"per-position acceptance [{pp}]")
    if "ar_tok_s" in result:
        lines.append(f"plain decoding {result['ar_tok_s']:.1f} tok/s")
    if "spec_tok_s" in result:
        lines.append(f"DSpark {result['spec_tok_s']:.1f} tok/s  ->  speedup {result['speedup']:.2f}x "
                     f"(measured side by side, compile excluded, "
                     f"the prompt's prefill included)")
    for n, f in result.get("also", {}).items():
        lines.append(f"DSpark, {n} drafts a step: {f['spec_tok_s']:.1f} tok/s -> speedup {f['speedup']:.2f}x, "
                     f"accept_len {f['accept_len']:.2f}")
    h = result.get("heldout_code")
    if h is not None:  # one prompt's figures move far: the same on held-out code (bench.py's code workload)
        ratio = "" if "speedup" not in h else (f", DSpark {h['spec_tok_s']:.1f} tok/s -> speedup {h['speedup']:.2f}x, "
                                              f"accept_len {h['accept_len']:.2f}")
        lines.append(f"held-out code ({h['prompts']} stdlib prompts of {h['prompt_len']} tokens cut at line starts, "
                     f"not healed; {h['new_tokens']} new tokens each): plain {h['ar_tok_s']:.1f} tok/s{ratio}")
        lines += [f"held-out code, DSpark with {n} drafts a step: {f['spec_tok_s']:.1f} tok/s -> speedup "
                  f"{f['speedup']:.2f}x, accept_len {f['accept_len']:.2f}" for n, f in h.get("also", {}).items()]
    print("\n".join("[jdspark] " + ln for ln in lines), file=sys.stderr)
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
