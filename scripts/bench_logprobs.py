"""What serving log-probabilities (or penalties and logit controls, or constrained decoding) costs a step, per batch
and verify width (JSON).

  python scripts/bench_logprobs.py --json                       # the shipped pair, batches 1 and 16, W = 1 and G + 1
  python scripts/bench_logprobs.py --feature penalties --json   # the same arms for penalties
  python scripts/bench_logprobs.py --feature guided --json      # and for constrained decoding (--guided-states)

Three arms, each a ``SlotBackend`` (``jdspark/slots.py``) of the same pair with every slot filled by a held-out
prompt, steps launched back to back as the engine pipelines them (ms per step), and one prompt's insert
(``insert``; asked: the prompt's log-probabilities too, as ``echo`` asks):

    off       compiled without log-probabilities (``max_logprobs=None``: ``--no-logprobs``)
    unasked   compiled with them (``max_logprobs=20``, the server's default) and no row asking: what a server
              that offers them costs the traffic that does not use them (the branch is skipped,
              ``jdspark.logprobs.when``)
    asked     the same backend with every row asking for 20 top entries a token (device work, the read-back and
              the host's entries, ``SlotBackend.collect``)

``--feature penalties``: off = ``penalties=False`` (the default), unasked = compiled in (``--penalties``) with
no row penalised (the ``lax.cond`` skips the penalised logits and the counts' update), asked = every row with
repetition 1.1, frequency 0.2, presence 0.1 (``jdspark.sampling.Penalties``), a logit_bias on two tokens and
min_tokens 2 (``jdspark.sampling.LogitControls``); log-probabilities off in every arm. ``--feature guided``: off =
``guided_states=0``, unasked = ``guided_states=Q`` (``--guided-states Q``, default the server's) with no row
constrained (each row still carries a table and masks with it: state -1 keeps every token), asked = every row
constrained by a cyclic automaton of GUIDED_STATES states that refuses a seventh of the vocabulary from each state
(``guided_table``; ``jdspark.grammar``), held in the slots' Q-state tables.

The arms' rounds interleave (each round times every arm, the order rotating) and each ratio is the median of the
rounds' ratios taken side by side (this machine's speed drifts by more than the effect within a minute). W = 1
steps are of drafting rows (adaptive's plain steps). ``compile_s`` / ``memory_maps``: what compiling the
(largest batch, widest) step program took and added to the process, per arm's backend (the server's start-up
compiles ~45 programs; ``jdspark.graphs.check_map_budget``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

ARMS = ("off", "unasked", "asked")
GUIDED_STATES = 32  # --feature guided: the asked rows' automaton (held in tables of the slots' Q states)


def guided_table(vocab_size: int, states: int = GUIDED_STATES):
    """A ``jdspark.grammar.TokenFSM`` that never ends and moves with every token: from state q, token v goes to
    (q + v) % states, except the ids v = q (mod 7), refused."""
    from jdspark.grammar import TokenFSM

    q, v = np.arange(states)[:, None], np.arange(vocab_size)[None]
    return TokenFSM(np.where(v % 7 == q % 7, -1, (q + v) % states).astype(np.int32))


ASKED_PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                       logit_bias=((5, 0.5), (9, -1.0)), min_tokens=2)
# per feature: the backend's keyword arguments (compiled in or not), and what a request asking for it sets
FEATURES = {
    "logprobs": (lambda on, top: dict(max_logprobs=top if on else None),
                 lambda top, insert: dict(logprobs=top, prompt_logprobs=top if insert else None)),
    "penalties": (lambda on, top: dict(max_logprobs=None, penalties=on), lambda top, insert: ASKED_PENALTIES),
    "guided": (lambda on, top, states=GUIDED_STATES: dict(max_logprobs=None, guided_states=states if on else 0),
               lambda top, insert: {"grammar": "table"}),
}


def run(target, drafter, prompts, *, slots: int, max_len: int, batches, widths, iters: int, repeats: int,
        top: int = 20, steps: int = 1, feature: str = "logprobs", guided_states: int = GUIDED_STATES) -> dict:
    from jdspark.engine import SamplingRequest
    from jdspark.graphs import memory_maps
    from jdspark.slot_programs import step_rows
    from jdspark.slots import SlotBackend

    if feature not in FEATURES:
        raise ValueError(f"feature: expected one of {sorted(FEATURES)}, got {feature!r}")
    backend_kw, ask = FEATURES[feature]
    table = guided_table(target.config.vocab_size) if feature == "guided" else None
    if feature == "guided":
        if guided_states < GUIDED_STATES:
            raise ValueError(f"guided_states: expected >= {GUIDED_STATES} (the asked rows' automaton), "
                             f"got {guided_states}")
        backend_kw = (lambda kw: lambda on, top: kw(on, top, guided_states))(backend_kw)

    def asking(top, insert):  # (the guided table is the model's vocabulary's)
        return {k: (table if v == "table" else v) for k, v in ask(top, insert).items()}

    P = max(len(p) for p in prompts)
    G = drafter.config.block_size if drafter is not None else 0
    if (iters + 1) * steps * max(widths) > max_len - P - G - 2:
        raise ValueError(f"--iters {iters} steps at width {max(widths)} overflow the {max_len}-position caches "
                         f"after a {P}-token prompt; raise --max-len or lower --iters")
    backends = {m: SlotBackend(target, drafter, num_slots=slots, max_len=max_len, prompt_buckets=(P,),
                               prefix_pool=0, multi_step=steps, multi_step_max_batch=slots,
                               **backend_kw(m == "on", top)) for m in ("off", "on")}
    compiled = {}
    for m, be in backends.items():  # the dearest program, compiled alone: its time and memory maps
        b, w = max(batches), max(widths)
        before, t0 = memory_maps(), time.perf_counter()
        args, kw = be._step_args(np.arange(b, dtype=np.int32), w, steps, caps=np.full(b, float(be.G)))
        step_rows.lower(*args, **kw).compile()
        after = memory_maps()
        compiled[m] = {"compile_s": time.perf_counter() - t0,
                       "memory_maps": None if before is None or after is None else after[0] - before[0]}

    def arm_backend(arm):
        return backends["off" if arm == "off" else "on"]

    def refill(arm, n):
        be = arm_backend(arm)
        for s in range(n):
            be.insert(s, SamplingRequest(tuple(prompts[s % len(prompts)]), 1, seed=s,
                                         **(asking(top, False) if arm == "asked" else {})))
            be.params[s, 3] = be.G  # drafting rows: W = 1 is adaptive's plain step

    cells = []
    for b in batches:
        for w in widths:
            ms = {a: [] for a in ARMS}
            for r in range(repeats + 1):
                for arm in ARMS[r % 3:] + ARMS[:r % 3]:
                    be = arm_backend(arm)
                    refill(arm, b)
                    rows = list(range(b))
                    if r == 0:  # compiles
                        be.collect(be.launch(rows, width=w, steps=steps))
                        continue
                    t0 = time.perf_counter()
                    for h in [be.launch(rows, width=w, steps=steps) for _ in range(iters)]:
                        be.collect(h)
                    ms[arm].append((time.perf_counter() - t0) / (iters * steps) * 1e3)
            cell = {"batch": b, "width": w, **{f"{a}_ms": float(np.median(ms[a])) for a in ARMS}}
            for a in ("unasked", "asked"):
                cell[f"{a}_over_off"] = float(np.median([x / y for x, y in zip(ms[a], ms["off"])]))
            cells.append(cell)
    inserts = {a: [] for a in ARMS}  # one prompt's insert; "asked": its prompt's log-probabilities too (echo)
    for r in range(repeats + 1):
        for arm in ARMS[r % 3:] + ARMS[:r % 3]:
            be = arm_backend(arm)
            req = SamplingRequest(tuple(prompts[r % len(prompts)]), 1, seed=r,
                                  **(asking(top, True) if arm == "asked" else {}))
            t0 = time.perf_counter()
            be.insert(0, req)
            if r:
                inserts[arm].append((time.perf_counter() - t0) * 1e3)
    insert = {f"{a}_ms": float(np.median(inserts[a])) for a in ARMS}
    for a in ("unasked", "asked"):
        insert[f"{a}_over_off"] = float(np.median([x / y for x, y in zip(inserts[a], inserts["off"])]))
    for be in backends.values():
        for s in range(slots):
            be.free(s)
    states = {"guided_states": guided_states} if feature == "guided" else {}
    return {"feature": feature, **states, "cells": cells, "insert": insert, "top_logprobs": top,
            "steps_per_launch": steps, "slots": slots, "max_len": max_len, "prompt_len": P, "iters": iters,
            "repeats": repeats, "compiled": compiled}


def main(argv=None) -> int:
    from bench_slots import slot_bench_inputs, slot_bench_parser

    ap = slot_bench_parser(__doc__.splitlines()[0], batches="1,16", repeats=9,
                           widths_help="default: 1 and the drafter's whole block",
                           steps_help="K > 1: launches of K steps (multi-step scheduling: the server's at batch "
                                      "buckets <= 4)")
    ap.add_argument("--feature", choices=sorted(FEATURES), default="logprobs")
    ap.add_argument("--guided-states", type=int, default=GUIDED_STATES, metavar="Q",
                    help="--feature guided: the slots' automaton states (the server's --guided-states; the asked "
                         "rows' automaton has %(default)s whatever Q)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    target, drafter, prompts, batches, widths = slot_bench_inputs(ap, a, "bench_logprobs", lambda G: sorted({1, G + 1}))
    res = run(target, drafter, prompts, slots=a.slots, max_len=a.max_len, batches=batches, widths=widths,
              iters=a.iters, repeats=a.repeats, steps=a.steps_per_launch, feature=a.feature,
              guided_states=a.guided_states)
    for c in res["cells"]:
        print(f"[bench_logprobs] b={c['batch']:2d} W={c['width']}: off {c['off_ms']:7.2f} ms/step, unasked "
              f"{c['unasked_over_off']:.3f}x, asked {c['asked_over_off']:.3f}x", file=sys.stderr)
    i = res["insert"]
    print(f"[bench_logprobs] insert of {res['prompt_len']} tokens: off {i['off_ms']:.2f} ms, unasked "
          f"{i['unasked_over_off']:.3f}x, asked (its prompt's too) {i['asked_over_off']:.3f}x", file=sys.stderr)
    for m, c in res["compiled"].items():
        print(f"[bench_logprobs] widest step compiled {m}: {c['compile_s']:.1f} s, {c['memory_maps']} maps",
              file=sys.stderr)
    if a.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
