"""Write the shipped target's own continuations of training-split prompts as text files: a corpus for
``train_drafter.py --corpus``, so the drafter also learns the text it is asked to draft when serving (the target's
generations), not only the training text.

  python scripts/distill_corpus.py --out runs/distill_corpus --prompts 400

Prompts are cut from the training split of the stdlib corpus (or of ``--corpus DIR``), never from the held-out
files bench.py measures on. Each file is the prompt followed by the target's continuation (plain decoding: greedy
and sampled at the given temperatures in turn, T > 0 with nucleus ``--top-p``, so the drafter meets the text
sampled serving produces); special tokens are dropped. Files are written whole
(temporary name, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate as gen  # noqa: E402
import numpy as np  # noqa: E402

import jdspark  # noqa: E402
from jdspark import data as jdata  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="folder with target/ (default: the shipped pair)")
    ap.add_argument("--corpus", default=None, help="cut prompts from this directory's training split instead")
    ap.add_argument("--out", required=True, help="directory to write the text files into")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; prompts cycle through them")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus for the sampled continuations (T > 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        temps = [float(t) for t in a.temperatures.split(",")]
    except ValueError:
        ap.error(f"--temperatures: expected comma-separated numbers, got {a.temperatures!r}")
    if a.prompts < 1 or a.prompt_len < 2 or a.max_new_tokens < 1 or any(t < 0 for t in temps):
        ap.error("--prompts, --prompt-len (>= 2), --max-new-tokens must be positive and temperatures >= 0")
    if not 0 < a.top_p <= 1:
        ap.error(f"--top-p: expected 0 < p <= 1, got {a.top_p}")

    ckpt = a.checkpoint or gen.DEFAULT_DIR
    target, _, note = gen.load_pair(ckpt)
    tokenizer = gen.load_tokenizer(ckpt, target.config)
    print(f"[distill] {note}", file=sys.stderr)
    docs = jdata.read_documents(jdata.list_files(a.corpus, "train"))
    prompts = jdata.prompts_from_documents(docs, a.prompts, a.prompt_len, seed=a.seed, tokenizer=tokenizer)
    os.makedirs(a.out, exist_ok=True)
    t0, n_tok = time.time(), 0
    for i, p in enumerate(prompts):
        temp = temps[i % len(temps)]
        out = jdspark.generate(target, None, p, max_new_tokens=a.max_new_tokens, temperature=temp,
                               top_p=a.top_p if temp > 0 else 1.0, seed=a.seed * 100_003 + i)
        text = tokenizer.decode_bytes(np.concatenate([p, out.tokens]))  # special tokens dropped
        path = os.path.join(a.out, f"gen_{i:05d}.txt")
        with open(path + ".tmp", "wb") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        n_tok += out.num_tokens
        if (i + 1) % 50 == 0:
            print(f"[distill] {i + 1}/{len(prompts)} prompts, {n_tok / (time.time() - t0):.0f} tok/s", file=sys.stderr)
    res = {"files": len(prompts), "generated_tokens": n_tok, "out": a.out}
    if a.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
