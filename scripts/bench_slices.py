"""What a long prompt's arrival costs the streams already running, with its prefill in slices and without (JSON).

  python scripts/bench_slices.py --json                  # the shipped pair: 3 streams, 1800-token prompts arriving
  python scripts/bench_slices.py --slices 0,512,256 --long-len 1800 --rounds 3 --json

A coding agent's request carries a long context; a server prefilling it in one program makes every running stream
wait for the whole prefill (on this 2-core CPU, ~1 s for 1800 tokens). With ``--prefill-slice S``
(``SlotBackend.slice_tokens``; ``Engine._slice``) the prompt is prefilled S tokens at a time into the prefix cache,
the engine stepping the running streams between slices. The serving engine runs in this process (no HTTP), over
one backend whose prompt buckets hold the long prompt (so ``0``, no slices, can serve it in one insert).

Each run: ``--streams`` requests of ``--short-len`` held-out code tokens decode ``--answer-len`` tokens (greedy,
EOS ignored); once each has its first tokens, ``--longs`` requests of ``--long-len`` tokens (other held-out
excerpts, none kept by the prefix cache, which is cleared before each run) arrive one after another, each when the
one before has its first token, and decode ``--long-answer`` tokens. The slice settings take turns within each
round (the order rotated round by round). Reported per setting (medians over rounds): the running streams' gaps
between the chunks they receive while the long prompts are in flight (ms: p50, p99, max; a multi-step launch's
tokens arrive as one chunk), the long requests' time to first token (ms), their slices, and output tokens per
second of the whole run; and each slice setting's max gap and TTFT over those of ``0``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _buckets(long_len: int) -> tuple:
    """Powers of two from 64 up to the first that holds ``long_len``."""
    out = [64]
    while out[-1] < long_len:
        out.append(out[-1] * 2)
    return tuple(out)


def one_run(eng, shorts, longs, answer_len: int, long_answer: int, seconds: float = 1800.0) -> dict:
    """One run on a started engine (see the module docstring): the running streams' chunk gaps while the long
    prompts were in flight (seconds), the long requests' TTFT (seconds) and output tokens per second."""
    from jdspark.engine import Request, SamplingRequest

    chunks = {}  # request -> [monotonic time of each event with tokens]
    lock = threading.Lock()

    def on_event(req_box):
        def f(ev):
            if ev.token_ids:
                with lock:
                    chunks.setdefault(req_box[0], []).append(time.monotonic())
        return f

    def submit(prompt, n):
        box = [None]
        box[0] = eng.submit(Request(SamplingRequest(tuple(int(t) for t in prompt), n), on_event(box),
                                    ignore_eos=True))
        return box[0]

    def wait(cond, what):
        deadline = time.monotonic() + seconds
        while not cond():
            if eng.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: {eng.error!r}")
            time.sleep(0.002)

    t0 = time.monotonic()
    running = [submit(p, answer_len) for p in shorts]
    wait(lambda: all(len(r.output_ids) >= 2 for r in running), "the streams' first tokens")
    start = time.monotonic()
    long_reqs = []
    for p in longs:
        long_reqs.append(submit(p, long_answer))
        wait(lambda: bool(long_reqs[-1].output_ids), "a long prompt's first token")
    end = time.monotonic()
    wait(lambda: all(r.finished for r in running + long_reqs), "every request's end")
    wall = time.monotonic() - t0
    if any(r.finished != "length" for r in running + long_reqs):
        raise RuntimeError(f"a request ended early: {[r.finished for r in running + long_reqs]}")
    if any(r.last_token_at < end for r in running):
        raise RuntimeError("a running stream ended before the long prompts were served: raise --answer-len")
    gaps = []
    for r in running:
        ts = [start] + [t for t in chunks[r] if start < t]
        gaps += [b - a for a, b in zip(ts, ts[1:]) if a < end]
    tokens = sum(len(r.output_ids) for r in running + long_reqs)
    return {"gaps": gaps, "ttft": [r.first_token_at - r.arrival for r in long_reqs], "tok_s": tokens / wall}


def measure(target, drafter, docs, tok=None, *, slices=(0, 512, 256), streams: int = 3, longs: int = 2,
            short_len: int = 128, long_len: int = 1800, answer_len: int = 384, long_answer: int = 8,
            rounds: int = 3, spec: str = "fixed") -> dict:
    """The JSON (see the module docstring) for prompts cut from ``docs`` (bytes; ``tok`` None: byte ids)."""
    import jax

    from jdspark import data as jdata
    from jdspark.engine import Engine
    from jdspark.slots import SlotBackend
    from kimi.tokenizer import ByteTokenizer

    buckets = _buckets(long_len)
    bad = [s for s in slices if s and s not in buckets]
    if bad or 0 not in slices:
        raise ValueError(f"slices: expected 0 (no slices, the reference) and prompt buckets of {buckets}; got "
                         f"{list(slices)}")
    G = drafter.config.block_size if drafter is not None and spec != "off" else 0
    max_len = -(-(buckets[-1] + max(answer_len, long_answer) + G + 2) // 64) * 64
    be = SlotBackend(target, drafter if spec != "off" else None, num_slots=streams + 1, max_len=max_len,
                     prompt_buckets=buckets, prefix_pool=longs + 4, prefix_answers=False, multi_step=4,
                     slice_tokens=max(slices), adaptive=False)
    be.warm_up(reps=1)
    shorts = [list(p) for p in jdata.prompts_from_documents(docs, streams, short_len, tokenizer=tok, seed=0)]
    pool = [list(p) for p in jdata.prompts_from_documents(docs, longs * (rounds + 1) * len(slices), long_len,
                                                          tokenizer=tok, seed=1)]
    runs = {s: [] for s in slices}
    used = 0
    for r in range(rounds + 1):  # round 0 runs every setting once, untimed (first calls, the host's caches)
        k = r % len(slices)
        for s in list(slices[k:]) + list(slices[:k]):
            be.slice_tokens = s
            be.prefix.clear()
            eng = Engine(be, tok or ByteTokenizer(target.config.vocab_size), eos_token_id=None).start()
            try:
                res = one_run(eng, shorts, pool[used:used + longs], answer_len, long_answer)
            finally:
                eng.shutdown()
            used += longs
            if r > 0:
                runs[s].append(res)
            print(f"[bench_slices] round {r} slice {s or 'off'}: max gap {max(res['gaps']) * 1e3:.0f} ms, long TTFT "
                  f"{np.mean(res['ttft']) * 1e3:.0f} ms, {res['tok_s']:.0f} tok/s", file=sys.stderr)
    rows = {}
    for s, rs in runs.items():
        med = lambda f: float(np.median([f(x) for x in rs]))  # noqa: E731
        rows[str(s)] = {"gap_ms_p50": round(med(lambda x: np.percentile(x["gaps"], 50)) * 1e3, 2),
                        "gap_ms_p99": round(med(lambda x: np.percentile(x["gaps"], 99)) * 1e3, 2),
                        "gap_ms_max": round(med(lambda x: max(x["gaps"])) * 1e3, 2),
                        "long_ttft_ms": round(med(lambda x: np.mean(x["ttft"])) * 1e3, 2),
                        "tok_s": round(med(lambda x: x["tok_s"]), 1)}
    for s in slices:
        if s:
            ref, row = rows["0"], rows[str(s)]
            row["gap_max_over_off"] = round(row["gap_ms_max"] / ref["gap_ms_max"], 3)
            row["long_ttft_over_off"] = round(row["long_ttft_ms"] / ref["long_ttft_ms"], 3)
    return {"backend": jax.default_backend(), "streams": streams, "longs": longs, "short_len": short_len,
            "long_len": long_len, "answer_len": answer_len, "long_answer": long_answer, "rounds": rounds,
            "spec": spec, "prompt_buckets": list(buckets), "max_len": max_len, "slices": rows,
            "slices_run": be.slices}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"))
    ap.add_argument("--slices", default="0,512,256", help="slice sizes to compare (0: none, the reference)")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--longs", type=int, default=2)
    ap.add_argument("--short-len", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=1800)
    ap.add_argument("--answer-len", type=int, default=384)
    ap.add_argument("--long-answer", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round)")
    ap.add_argument("--spec", choices=("off", "fixed"), default="fixed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    for name in ("streams", "longs", "short_len", "long_len", "answer_len", "long_answer", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(a, name)}")
    try:
        slices = tuple(int(x) for x in a.slices.split(","))
    except ValueError:
        ap.error(f"--slices: expected comma-separated ints, got {a.slices!r}")
    import generate as gen

    from jdspark import workloads

    target, drafter, note = gen.load_pair(a.checkpoint)
    print(f"[bench_slices] {note}", file=sys.stderr)
    try:
        res = measure(target, drafter, workloads.documents("code"), gen.load_tokenizer(a.checkpoint, target.config),
                      slices=slices, streams=a.streams, longs=a.longs, short_len=a.short_len, long_len=a.long_len,
                      answer_len=a.answer_len, long_answer=a.long_answer, rounds=a.rounds, spec=a.spec)
    except ValueError as e:
        ap.error(str(e))
    res["checkpoint"] = a.checkpoint
    print(json.dumps(res) if a.json else res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
