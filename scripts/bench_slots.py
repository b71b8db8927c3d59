"""What one serving-engine step costs on this machine, per batch bucket and verify width (JSON).

  python scripts/bench_slots.py --json                          # the shipped pair, 16 slots, caches of 320
  python scripts/bench_slots.py --slots 16 --max-len 1024 --batches 1,4,16 --json
  python scripts/bench_slots.py --batches 1,16 --widths 1,8 --steps-per-launch 8 --json   # + 8-step launches
  python scripts/bench_slots.py --batches 1,16 --widths 1,2 --iters 16 --switch --json   # + does a width switch cost

Each figure is ``SlotBackend.step`` (``jdspark/slots.py``) as the engine calls it: the host's dispatch, the
device step of b active slots at verify width W and the host reading its tokens back, in milliseconds, the fastest
of ``--repeats`` rounds of ``--iters`` steps (the first call compiles, outside the timing). W = 1 is a plain decode
with no drafts, twice: ``drafter_context`` false, rows that never draft (no drafter work at all, as ``--spec off``
traffic runs); true, the drafter's context extended (as adaptive's plain steps of drafting rows run). Every slot is
filled by a held-out prompt of ``--prompt-len`` tokens first; ``greedy`` rows have temperature 0, ``sampled`` rows
T = 1 (top-p 1). ``per_token_ms`` divides by the b rows (a plain decode commits one token per row; a verify commits
accept_len). ``generate_plain_ms``: batch-1 ``jdspark.generate``'s plain decoding per token from the same prompt
(one device program, no host round trip per step), beside it for comparison. Beside ``step_ms`` (launched and
waited for one at a time), ``dispatch_ms`` (the host's part of a launch) and ``pipelined_ms`` (launches enqueued
back to back) say how much of a served step is the host's; ``--steps-per-launch K`` adds each cell in launches
of K steps (the engine's multi-step scheduling, ``jdspark.slots.multi_step_plan``). ``launch_arg_ms``: what a
launch costs the host by its arguments alone (``launch_arg_ms``'s docstring). ``--switch``: ``width_switch``, the
first two widths alternating step by step against the same steps in two runs (``switch_ms``).
``plain_context_cost``: per rows and batch, a plain step of drafting rows (the drafter's context extended) over
one of rows that never draft, pipelined, round by round (each round's two figures taken side by side) and their
median: what adaptive's plain steps pay beyond ``--spec off``'s. ``--adaptive``:
the backend as ``--spec adaptive`` serves it (its W > 1 steps also return the confidence head's survival).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def step_ms(be, refill, batch: int, width: int, iters: int, repeats: int, variants) -> tuple:
    """Per variant (cap, steps) of ``variants``: the fastest of ``repeats`` rounds of ``iters`` steps, each round
    from freshly prefilled slots whose draft caps are ``cap`` (at width 1: 0, rows that never draft, no drafter
    work; G, the drafter's context extended). The variants' rounds interleave (each round times every variant,
    the order rotating), so a machine whose speed drifts meets them alike: timed one variant's rounds after
    another's, a 2-5% difference read as 4-10% (docs/serving.md, thirty-fourth session).
    Three figures a step, in ms: ``step_ms``, launched and waited for one at a time (the engine's round trip);
    ``dispatch_ms``, the host's part of a launch (``launch`` returning: argument handling and the enqueue);
    ``pipelined_ms``, ``iters`` launches enqueued back to back and read afterwards (the device's pace with the
    host out of the way: step_ms - pipelined_ms is what the host's round trip adds to a served step).
    ``steps`` > 1: launches of that many steps (multi-step scheduling), ``iters // steps`` of them a round; the
    figures stay per step except ``dispatch_ms``, per launch. Returns ({variant: figures}, {variant: each round's
    pipelined ms}) (the second for ratios of variants round by round)."""
    slots = list(range(batch))
    variants = list(variants)
    best = {v: {"step_ms": float("inf"), "dispatch_ms": float("inf"), "pipelined_ms": float("inf")}
            for v in variants}
    rounds = {v: [] for v in variants}
    for r in range(repeats + 1):
        for cap, steps in variants[r % len(variants):] + variants[:r % len(variants)]:
            bv = best[(cap, steps)]
            launches = max(1, iters // steps)
            refill(batch)
            be.params[slots, 3] = cap
            if r == 0:
                be.collect(be.launch(slots, width=width, steps=steps))  # compile
                continue
            dispatch = 0.0
            t0 = time.perf_counter()
            for _ in range(launches):
                t1 = time.perf_counter()
                h = be.launch(slots, width=width, steps=steps)
                dispatch += time.perf_counter() - t1
                be.collect(h)
            bv["step_ms"] = min(bv["step_ms"], (time.perf_counter() - t0) / (launches * steps) * 1e3)
            bv["dispatch_ms"] = min(bv["dispatch_ms"], dispatch / launches * 1e3)
            refill(batch)
            be.params[slots, 3] = cap
            t0 = time.perf_counter()
            for h in [be.launch(slots, width=width, steps=steps) for _ in range(launches)]:
                be.collect(h)
            rounds[(cap, steps)].append((time.perf_counter() - t0) / (launches * steps) * 1e3)
            bv["pipelined_ms"] = min(bv["pipelined_ms"], rounds[(cap, steps)][-1])
    return best, rounds


def switch_ms(be, refill, batch: int, widths, iters: int, repeats: int) -> dict:
    """Does a change of verify width cost the step after it? ``iters`` steps (drafting rows, cap G) at the first
    two of ``widths`` alternating, against the same steps in two runs (all of one width, then all of the other),
    launches pipelined as the engine's are (the next enqueued before the last is read); the median of ``repeats``
    rounds of each, ms per step, the two kinds of round alternating so that the machine's drift meets both.
    A cost table times a width only after a step of its own (``SlotBackend.collect``), so a switch's cost, were
    there one, is what adaptive's mixing of widths would pay unpriced."""
    w1, w2 = widths[0], widths[1]
    slots = list(range(batch))
    n = max(2, iters - iters % 2)
    seqs = {"runs": [w1] * (n // 2) + [w2] * (n // 2), "alternating": [w1, w2] * (n // 2)}
    times = {k: [] for k in seqs}
    for r in range(repeats + 1):
        for kind, seq in seqs.items():
            refill(batch)
            be.params[slots, 3] = be.G
            be.collect(be.launch(slots, width=seq[0]))
            t0 = time.perf_counter()
            prev = be.launch(slots, width=seq[0])
            for w in seq[1:]:
                h = be.launch(slots, width=w)
                be.collect(prev)
                prev = h
            be.collect(prev)
            if r:  # round 0 warms both sequences' programs
                times[kind].append((time.perf_counter() - t0) / len(seq) * 1e3)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"batch": batch, "widths": [w1, w2], "runs_ms": med["runs"], "alternating_ms": med["alternating"],
            "alternating_over_runs": med["alternating"] / med["runs"]}


def launch_arg_ms(calls: int = 30) -> dict:
    """What a jit launch costs the host by its arguments (the median of ``calls``, ms): a trivial program taking
    1, 30 or 300 device arrays (a launch of the engine passes ~300 weight and state leaves), and 5 small NumPy
    arrays against 1 (each NumPy argument is a host-to-device transfer of its own: why a launch packs its per-row
    inputs into one [b, 5] array)."""
    import jax
    import jax.numpy as jnp

    def median_ms(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            out = f(*args)
            ts.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        return float(np.median(ts)) * 1e3

    res = {}
    for n in (1, 30, 300):
        xs = tuple(jnp.ones((256, 256)) for _ in range(n))
        res[f"device_arrays_{n}"] = median_ms(jax.jit(lambda xs, y: (y + 1, xs[0][0, 0])), xs, jnp.ones(4))
    five = [np.zeros(16, np.float32) for _ in range(5)]
    res["numpy_arrays_5"] = median_ms(jax.jit(lambda a, b, c, d, e: a + b + c + d + e), *five)
    res["numpy_arrays_1"] = median_ms(jax.jit(lambda a: a + 1), np.zeros((16, 5), np.float32))
    return res


ROWS_KINDS = {"greedy": 0.0, "sampled": 1.0}  # rows' kinds timed: their temperature


def room_problem(max_len: int, prompt_len: int, G: int, iters: int, K: int, widths) -> Optional[str]:
    """Why the timed steps would overflow the caches (they run past a request's own limit here: the cache is the
    bound), or None."""
    room = max_len - prompt_len - G - 2
    if (max(iters, K) + K) * max(widths) > room:
        return (f"--iters {iters} steps at width {max(widths)} overflow the {max_len}-position caches after a "
                f"{prompt_len}-token prompt; raise --max-len or lower --iters")
    return None


def run(target, drafter, prompts, *, slots: int, max_len: int, batches, widths, iters: int, repeats: int,
        steps_per_launch: int = 1, switch: bool = False, adaptive: bool = False,
        rows_kinds=("greedy", "sampled")) -> dict:
    import jdspark
    from jdspark.engine import SamplingRequest
    from jdspark.slots import SlotBackend

    P = max(len(p) for p in prompts)
    K = int(steps_per_launch)
    be = SlotBackend(target, drafter, num_slots=slots, max_len=max_len, prompt_buckets=(P,), multi_step=K,
                     multi_step_max_batch=slots, adaptive=adaptive)
    problem = room_problem(max_len, P, be.G, iters, K, widths)
    if problem:
        raise ValueError(problem)
    rows, switches, context = [], [], []
    for name, temp in ((n, ROWS_KINDS[n]) for n in rows_kinds):
        def refill(n, temp=temp):
            for s in range(n):
                be.insert(s, SamplingRequest(tuple(prompts[s % len(prompts)]), 1, temperature=temp, seed=s))

        for b in batches:
            for w in widths:
                variants = [(cap, k) for cap in be.program_caps(w) for k in sorted({1, K})]
                best, rounds = step_ms(be, refill, b, w, iters, repeats, variants)
                for (cap, k), ms in best.items():
                    rows.append({"rows": name, "batch": b, "width": w, "drafter_context": cap > 0,
                                 "steps_per_launch": k, **ms, "per_token_ms": ms["step_ms"] / b})
                if w == 1 and len(be.program_caps(1)) == 2:  # a plain step of drafting rows against one of off's
                    r = [x / y for x, y in zip(rounds[(be.G, 1)], rounds[(0, 1)])]
                    context.append({"rows": name, "batch": b, "pipelined_ratio_median": float(np.median(r)),
                                    "pipelined_ratios": r})
            if switch and drafter is not None and len(widths) > 1:
                switches.append({"rows": name, **switch_ms(be, refill, b, widths, iters, repeats)})
    p0 = np.asarray(prompts[0])
    jdspark.generate(target, None, p0, max_new_tokens=64)
    t0 = time.perf_counter()
    out = jdspark.generate(target, None, p0, max_new_tokens=64)
    gen_ms = (time.perf_counter() - t0) / max(len(out.tokens), 1) * 1e3
    return {"steps": rows, "slots": slots, "max_len": max_len, "prompt_len": P, "generate_plain_ms": gen_ms,
            "iters": iters, "repeats": repeats, "steps_per_launch": K, "adaptive": bool(adaptive),
            "launch_arg_ms": launch_arg_ms(),
            "width_switch": switches, "plain_context_cost": context}


def slot_bench_parser(description: str, *, batches: str, repeats: int, widths_help: str,
                      steps_help: str) -> argparse.ArgumentParser:
    """The command line the slot benches share (this one, ``bench_logprobs.py``): the pair, its slots and caches,
    the prompts, the batches and widths timed, iterations and rounds, steps per launch."""
    import generate as gen

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--checkpoint", default=gen.DEFAULT_DIR)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--widths", default=None, help=widths_help)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--steps-per-launch", type=int, default=1, help=steps_help)
    return ap


def slot_bench_inputs(ap: argparse.ArgumentParser, a, name: str, default_widths) -> tuple:
    """(target, drafter, prompts, batches, widths) of parsed ``slot_bench_parser`` arguments; ``default_widths(G)``
    when --widths is not given; argument errors through ``ap``."""
    import generate as gen

    from jdspark import data as jdata

    target, drafter, note = gen.load_pair(a.checkpoint)
    print(f"[{name}] {note}", file=sys.stderr)
    tok = gen.load_tokenizer(a.checkpoint, target.config)
    batches = [int(x) for x in a.batches.split(",")]
    if any(b < 1 or b > a.slots for b in batches):
        ap.error(f"--batches: each in 1..{a.slots}")
    if a.steps_per_launch < 1:
        ap.error(f"--steps-per-launch: expected an int >= 1, got {a.steps_per_launch}")
    if min(a.iters, a.repeats) < 1:
        ap.error(f"--iters, --repeats: expected ints >= 1, got {a.iters}, {a.repeats}")
    G = drafter.config.block_size if drafter is not None else 0
    widths = [int(x) for x in a.widths.split(",")] if a.widths else default_widths(G)
    if any(not 1 <= w <= G + 1 for w in widths):
        ap.error(f"--widths: each in 1..{G + 1} (1: plain steps; {G + 1}: the drafter's whole block), got {widths}")
    problem = room_problem(a.max_len, a.prompt_len, G, a.iters, a.steps_per_launch, widths)
    if problem:
        ap.error(problem)
    prompts = [p.tolist() for p in jdata.heldout_prompts(a.slots, a.prompt_len, tokenizer=tok)]
    return target, drafter, prompts, batches, widths


def main(argv=None) -> int:
    ap = slot_bench_parser(__doc__.splitlines()[0], batches="1,2,4,8,16", repeats=5,
                           widths_help="default: 1, 2, 4 and the drafter's whole block",
                           steps_help="K > 1: each (rows, batch, width) also in launches of K steps (multi-step "
                                      "scheduling)")
    ap.add_argument("--switch", action="store_true",
                    help="also time the first two widths alternating against in runs, per batch (switch_ms)")
    ap.add_argument("--adaptive", action="store_true",
                    help="the backend as --spec adaptive serves it (W > 1 steps also return the confidence head's "
                         "survival)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    target, drafter, prompts, batches, widths = slot_bench_inputs(
        ap, a, "bench_slots", lambda G: sorted({1, 2, 4, G + 1} if G else {1}))
    res = run(target, drafter, prompts, slots=a.slots, max_len=a.max_len, batches=batches, widths=widths,
              iters=a.iters, repeats=a.repeats, steps_per_launch=a.steps_per_launch, switch=a.switch,
              adaptive=a.adaptive)
    for r in res["steps"]:
        ctx = "+ctx" if r["drafter_context"] and r["width"] == 1 else ""
        print(f"[bench_slots] {r['rows']:7s} b={r['batch']:2d} W={r['width']}{ctx:4s} x{r['steps_per_launch']}: "
              f"{r['step_ms']:7.2f} ms/step, "
              f"{r['per_token_ms']:6.2f} ms per row; dispatch {r['dispatch_ms']:6.3f} ms a launch, pipelined "
              f"{r['pipelined_ms']:7.2f} ms/step", file=sys.stderr)
    for r in res["width_switch"]:
        print(f"[bench_slots] {r['rows']:7s} b={r['batch']:2d} W={r['widths'][0]}/{r['widths'][1]} alternating "
              f"{r['alternating_ms']:7.2f} ms/step against runs {r['runs_ms']:7.2f}: "
              f"{r['alternating_over_runs']:.3f}x", file=sys.stderr)
    for r in res["plain_context_cost"]:
        print(f"[bench_slots] {r['rows']:7s} b={r['batch']:2d} W=1+ctx over W=1, pipelined, median of rounds: "
              f"{r['pipelined_ratio_median']:.3f}x", file=sys.stderr)
    print(f"[bench_slots] batch-1 generate, plain: {res['generate_plain_ms']:.2f} ms/token", file=sys.stderr)
    if a.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
