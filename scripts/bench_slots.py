"""What one serving-engine step costs on this machine, per batch bucket and verify width (JSON).

  python scripts/bench_slots.py --json                          # the shipped pair, 16 slots, caches of 320
  python scripts/bench_slots.py --slots 16 --max-len 1024 --batches 1,4,16 --json

Each figure is ``SlotBackend.step`` (``jdspark/slots.py``) as the engine calls it: the host's dispatch, the
device step of b active slots at verify width W and the host reading its tokens back, in milliseconds, the fastest
of ``--repeats`` rounds of ``--iters`` steps (the first call compiles, outside the timing). W = 1 is a plain decode
with no drafts, twice: ``drafter_context`` false, rows that never draft (no drafter work at all, as ``--spec off``
traffic runs); true, the drafter's context extended (as adaptive's plain steps of drafting rows run). Every slot is
filled by a held-out prompt of ``--prompt-len`` tokens first; ``greedy`` rows have temperature 0, ``sampled`` rows
T = 1 (top-p 1). ``per_token_ms`` divides by the b rows (a plain decode commits one token per row; a verify commits
accept_len). ``generate_plain_ms``: batch-1 ``jdspark.generate``'s plain decoding per token from the same prompt
(one device program, no host round trip per step), beside it for comparison.
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


def step_ms(be, refill, batch: int, width: int, iters: int, repeats: int, cap: int) -> float:
    """The fastest of ``repeats`` rounds of ``iters`` steps, each round from freshly prefilled slots whose draft
    caps are ``cap`` (at width 1: 0, rows that never draft, no drafter work; G, the drafter's context extended)."""
    slots = list(range(batch))
    best = float("inf")
    for r in range(repeats + 1):
        refill(batch)
        be.params[slots, 3] = cap
        if r == 0:
            be.step(slots, width=width)  # compile
            continue
        t0 = time.perf_counter()
        for _ in range(iters):
            be.step(slots, width=width)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def run(target, drafter, prompts, *, slots: int, max_len: int, batches, widths, iters: int, repeats: int) -> dict:
    import jdspark
    from jdspark.engine import SamplingRequest
    from jdspark.slots import SlotBackend

    P = max(len(p) for p in prompts)
    be = SlotBackend(target, drafter, num_slots=slots, max_len=max_len, prompt_buckets=(P,))
    room = max_len - P - be.G - 2  # steps run past a request's own limit here: the cache is the bound
    if (iters + 1) * max(widths) > room:
        raise ValueError(f"--iters {iters} steps at width {max(widths)} overflow the {max_len}-position caches "
                         f"after a {P}-token prompt; raise --max-len or lower --iters")
    rows = []
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        def refill(n, temp=temp):
            for s in range(n):
                be.insert(s, SamplingRequest(tuple(prompts[s % len(prompts)]), 1, temperature=temp, seed=s))

        for b in batches:
            for w in widths:
                for cap in be.program_caps(w):
                    ms = step_ms(be, refill, b, w, iters, repeats, cap)
                    rows.append({"rows": name, "batch": b, "width": w, "drafter_context": cap > 0, "step_ms": ms,
                                 "per_token_ms": ms / b})
    p0 = np.asarray(prompts[0])
    jdspark.generate(target, None, p0, max_new_tokens=64)
    t0 = time.perf_counter()
    out = jdspark.generate(target, None, p0, max_new_tokens=64)
    gen_ms = (time.perf_counter() - t0) / max(len(out.tokens), 1) * 1e3
    return {"steps": rows, "slots": slots, "max_len": max_len, "prompt_len": P, "generate_plain_ms": gen_ms,
            "iters": iters, "repeats": repeats}


def main(argv=None) -> int:
    import generate as gen

    from jdspark import data as jdata

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=gen.DEFAULT_DIR)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--widths", default=None, help="default: 1, 2, 4 and the drafter's whole block")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    target, drafter, note = gen.load_pair(a.checkpoint)
    print(f"[bench_slots] {note}", file=sys.stderr)
    tok = gen.load_tokenizer(a.checkpoint, target.config)
    batches = [int(x) for x in a.batches.split(",")]
    if any(b < 1 or b > a.slots for b in batches):
        ap.error(f"--batches: each in 1..{a.slots}")
    G = drafter.config.block_size if drafter is not None else 0
    widths = ([int(x) for x in a.widths.split(",")] if a.widths else sorted({1, 2, 4, G + 1} if G else {1}))
    prompts = [p.tolist() for p in jdata.heldout_prompts(a.slots, a.prompt_len, tokenizer=tok)]
    res = run(target, drafter, prompts, slots=a.slots, max_len=a.max_len, batches=batches, widths=widths,
              iters=a.iters, repeats=a.repeats)
    for r in res["steps"]:
        ctx = "+ctx" if r["drafter_context"] and r["width"] == 1 else ""
        print(f"[bench_slots] {r['rows']:7s} b={r['batch']:2d} W={r['width']}{ctx:4s}: {r['step_ms']:7.2f} ms/step, "
              f"{r['per_token_ms']:6.2f} ms per row", file=sys.stderr)
    print(f"[bench_slots] batch-1 generate, plain: {res['generate_plain_ms']:.2f} ms/token", file=sys.stderr)
    if a.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
