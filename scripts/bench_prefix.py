"""Time to first token of a conversation's turns with prefix caching and without it, side by side (JSON).

  python scripts/bench_prefix.py --json                  # the shipped pair, 4 conversations of 7 turns
  python scripts/bench_prefix.py --conversations 2 --turns 4 --first-len 128 --json

A conversation as a chat client or a coding agent sends it: turn 1's prompt is a held-out code excerpt of
``--first-len`` tokens; each later turn's prompt is the previous prompt + the model's answer to it (``--answer-len``
tokens, greedy, served by the slots) + a new message (``--message-len`` tokens of another held-out excerpt).
Each turn's insert (``SlotBackend.insert``: the prefill and the first token read back, what a request waits for
before its first token) is timed three ways on one backend, in an order rotated per turn and round:
  ``off``:     no prefix cache (as ``--prefix-pool 0`` serves: the whole prompt prefilled, in its prompt bucket);
  ``on``:      the previous turn's prompt kept (inserted just before, untimed), so the previous answer and the new
               message are prefilled (``jdspark.prefix``);
  ``answers``: the previous turn's prompt and its answer kept (the answer prefilled on the kept prompt as the
               engine does while idle between turns, ``SlotBackend.idle_step``, untimed), so only the new message
               is prefilled.
Reported per turn: prompt and cached tokens, the median over ``--rounds`` of each way's ms, and off / on, off /
answers; and the sums over turns. Every way must give the same first token (greedy): the script says where they
do not. The backend has prompt buckets up to 1024 so that ``off`` can serve every turn; a server with the default
buckets (up to 512) serves turns past 512 tokens only with the cache.
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


def conversations_of(be, docs, tok, n: int, turns: int, first_len: int, answer_len: int, message_len: int) -> list:
    """``n`` conversations of ``turns`` prompts each (token id lists), the answers served greedily by ``be``."""
    from jdspark import data as jdata
    from jdspark.engine import SamplingRequest

    firsts = jdata.prompts_from_documents(docs, n, first_len, tokenizer=tok, seed=0)
    messages = jdata.prompts_from_documents(docs, n * turns, message_len + 1, tokenizer=tok, seed=1)
    out = []
    for c in range(n):
        prompt, convo = [int(t) for t in firsts[c]], []
        for t in range(turns):
            convo.append(list(prompt))
            answer = be.insert(0, SamplingRequest(tuple(prompt), answer_len)).tokens
            while len(answer) < answer_len:
                answer += be.step([0])[0].tokens
            be.free(0)
            prompt = prompt + answer[:answer_len] + [int(x) for x in messages[c * turns + t][1:]]  # no BOS inside
        out.append(convo)
    return out


def timed_insert(be, prompt) -> tuple:
    """(ms, first token, cached tokens) of one insert into slot 0."""
    from jdspark.engine import SamplingRequest

    t0 = time.perf_counter()
    out = be.insert(0, SamplingRequest(tuple(prompt), 1))
    ms = (time.perf_counter() - t0) * 1e3
    be.free(0)
    return ms, out.tokens[0], out.cached


BUCKETS = (64, 128, 256, 512, 1024)  # up to 1024, so that the uncached way serves every turn


def measure(target, drafter, docs, tok=None, *, conversations: int, turns: int, first_len: int, answer_len: int,
            message_len: int, rounds: int, buckets=BUCKETS, max_len: int = 2048) -> dict:
    """The JSON (see the module docstring) for conversations cut from ``docs`` (bytes; ``tok`` None: byte ids)."""
    import jax

    from jdspark.engine import SamplingRequest
    from jdspark.slots import SlotBackend

    G = drafter.config.block_size if drafter is not None else 0
    be = SlotBackend(target, drafter, num_slots=1, max_len=max_len, prompt_buckets=buckets, prefix_pool=turns,
                     prefix_min_tokens=1)
    longest = first_len + (turns - 1) * (answer_len + message_len)
    if longest > buckets[-1] or longest + answer_len + G + 1 > max_len:
        raise ValueError(f"the longest turn has {longest} tokens (+ {answer_len} answered): more than the largest "
                         f"prompt bucket ({buckets[-1]}) or the caches ({max_len}); use fewer turns or shorter lengths")
    convos = conversations_of(be, docs, tok, conversations, turns, first_len, answer_len, message_len)
    pool = be.prefix
    ways = ("off", "on", "answers")
    ms = {w: [[[] for _ in range(turns)] for _ in convos] for w in ways}
    cached, mismatches = {w: {} for w in ways}, []
    for r in range(rounds + 1):  # round 0 runs every program once (compiles), untimed
        for c, convo in enumerate(convos):
            for t, prompt in enumerate(convo):
                firsts = {}
                for way in ways[(r + t) % 3:] + ways[:(r + t) % 3]:
                    be.prefix = None if way == "off" else pool  # off: as --prefix-pool 0, no lookup, none kept
                    pool.clear()
                    if t > 0 and way != "off":
                        timed_insert(be, convo[t - 1])  # the previous turn, kept
                    if t > 0 and way == "answers":  # and its answer, as the engine keeps it while idle
                        before = convo[t - 1]
                        be.keep_answer(SamplingRequest(tuple(before), answer_len),
                                       prompt[len(before):len(before) + answer_len])
                        while be.idle_pending():
                            be.idle_step()
                    m, firsts[way], cached[way][(c, t)] = timed_insert(be, prompt)
                    be.prefix = pool
                    if r > 0:
                        ms[way][c][t].append(m)
                if len(set(firsts.values())) > 1:
                    mismatches.append({"conversation": c, "turn": t, **{w: int(f) for w, f in firsts.items()}})
    rows = []
    for t in range(turns):
        row = {"turn": t + 1, "prompt_tokens": float(np.mean([len(cv[t]) for cv in convos]))}
        for w in ways[1:]:
            row["cached_tokens" + ("" if w == "on" else "_" + w)] = float(np.mean(
                [cached[w][(c, t)] for c in range(len(convos))]))
        for w in ways:
            row[f"ttft_{w}_ms"] = round(float(np.mean([np.median(ms[w][c][t]) for c in range(len(convos))])), 2)
        for w in ways[1:]:
            row[f"off_over_{w}"] = round(row["ttft_off_ms"] / row[f"ttft_{w}_ms"], 3)
        rows.append(row)
    tot = {w: round(sum(r[f"ttft_{w}_ms"] for r in rows), 2) for w in ways}
    return {"backend": jax.default_backend(), "conversations": len(convos), "turns": turns, "first_len": first_len,
            "answer_len": answer_len, "message_len": message_len, "rounds": rounds, "max_len": max_len,
            "per_turn": rows, **{f"total_ttft_{w}_ms": tot[w] for w in ways},
            "total_off_over_on": round(tot["off"] / tot["on"], 3),
            "total_off_over_answers": round(tot["off"] / tot["answers"], 3),
            "total_on_over_answers": round(tot["on"] / tot["answers"], 3), "first_token_mismatches": mismatches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--first-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--message-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round that compiles)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    for name in ("conversations", "turns", "first_len", "answer_len", "message_len", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(a, name)}")
    import generate as gen

    from jdspark import workloads

    target, drafter, note = gen.load_pair(a.checkpoint)
    print(f"[bench_prefix] {note}", file=sys.stderr)
    try:
        res = measure(target, drafter, workloads.documents("code"), gen.load_tokenizer(a.checkpoint, target.config),
                      conversations=a.conversations, turns=a.turns, first_len=a.first_len, answer_len=a.answer_len,
                      message_len=a.message_len, rounds=a.rounds)
    except ValueError as e:
        ap.error(str(e))
    res["checkpoint"] = a.checkpoint
    if a.json:
        print(json.dumps(res))
    else:
        for r in res["per_turn"]:
            print(r)
        print({k: v for k, v in res.items() if k != "per_turn"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
