"""Prompts that share a beginning: what keeping it where they part buys (``Slices._split``), side by side (JSON).

  python scripts/bench_shared.py --json          # the shipped pair: 4 groups of 4 requests, each traffic
  python scripts/bench_shared.py --groups 2 --requests 8 --beginning-len 384 --json

Two traffics, cut from held-out code (never trained on), each a group of ``--requests`` requests whose prompts
share a ``--beginning-len``-token beginning:
  ``choices``: lm-eval's multiple choice: the beginning is a question, each request the question + one choice of
               ``--choice-len`` tokens asking for its prompt's log-probabilities (echo, 1 top entry), no completion;
  ``system``:  the beginning is a system prompt (and tools), each request it + one user's message of
               ``--message-len`` tokens, for its first token.
Each request's insert (``SlotBackend.insert``: the prefill and, where asked, its prompt's entries read back: what a
request waits for before its first token or its scores) is timed with the shared beginning kept where the prompts
part (``on``, the server's default) and without (``off``, ``--no-prefix-split``: whole prompts kept only, as
before), the prefix cache cleared before each group, the two ways alternating first round by round. Reported per
traffic: each request's insert ms by its place in a group (the median over ``--rounds``, the mean over groups) each
way, their sum (a group's) and off / on, the cached tokens of each request in a group (``on``), and the largest
difference between the two ways' prompt entries (``choices``; bf16 serving: the split prefills the beginning and
the rest in two programs) or the first tokens that differ (``system``, greedy).
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

BUCKETS = (64, 128, 256, 512)  # the server's default prompt buckets


def groups_of(docs, tok, groups: int, requests: int, beginning_len: int, rest_len: int, seed: int) -> list:
    """``groups`` lists of ``requests`` prompts (token id lists): a held-out beginning, then each its own rest
    (another excerpt's ``rest_len`` tokens, no BOS inside)."""
    from jdspark import data as jdata

    beginnings = jdata.prompts_from_documents(docs, groups, beginning_len, tokenizer=tok, seed=seed)
    rests = jdata.prompts_from_documents(docs, groups * requests, rest_len + 1, tokenizer=tok, seed=seed + 1)
    return [[[int(t) for t in beginnings[g]] + [int(t) for t in rests[g * requests + i][1:]]
             for i in range(requests)] for g in range(groups)]


def timed(be, prompt, entries: bool) -> tuple:
    """(ms, cached tokens, what it gave: its prompt's entries, or its first token) of one insert into slot 0."""
    from jdspark.engine import SamplingRequest

    req = SamplingRequest(tuple(prompt), 0 if entries else 1, prompt_logprobs=1 if entries else None)
    t0 = time.perf_counter()
    out = be.insert(0, req)
    ms = (time.perf_counter() - t0) * 1e3
    be.free(0)
    return ms, out.cached, out.prompt_logprobs if entries else out.tokens[0]


def measure(be, groups: list, entries: bool, rounds: int) -> dict:
    """One traffic's JSON (see the module docstring) on backend ``be``."""
    ways = ("on", "off")
    ms = {w: {(g, i): [] for g, prompts in enumerate(groups) for i in range(len(prompts))} for w in ways}
    cached, gave = {w: {} for w in ways}, {w: {} for w in ways}
    for r in range(rounds + 1):  # round 0 runs every program once (compiles), untimed
        for g, prompts in enumerate(groups):
            for way in (ways if (r + g) % 2 == 0 else ways[::-1]):
                be.prefix_split = way == "on"
                be.prefix.clear()
                for i, prompt in enumerate(prompts):
                    m, cached[way][(g, i)], gave[way][(g, i)] = timed(be, prompt, entries)
                    if r > 0:
                        ms[way][(g, i)].append(m)
    be.prefix_split = True
    by_request = {w: [float(np.mean([np.median(ms[w][(g, i)]) for g in range(len(groups))]))
                      for i in range(len(groups[0]))] for w in ways}
    per = {w: sum(by_request[w]) for w in ways}
    out = {"groups": len(groups), "requests": len(groups[0]), "prompt_tokens": len(groups[0][0]),
           **{f"group_{w}_ms": round(per[w], 2) for w in ways}, "off_over_on": round(per["off"] / per["on"], 3),
           **{f"ms_{w}_by_request": [round(x, 2) for x in by_request[w]] for w in ways},
           "cached_tokens_on": [float(np.mean([cached["on"][(g, i)] for g in range(len(groups))]))
                                for i in range(len(groups[0]))]}
    if entries:
        out["max_abs_entry_diff"] = float(max(abs(a[0] - b[0]) for k in gave["on"]
                                              for a, b in zip(gave["on"][k], gave["off"][k]) if a is not None))
    else:
        out["first_token_mismatches"] = sum(gave["on"][k] != gave["off"][k] for k in gave["on"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="requests sharing one beginning (choices, users)")
    ap.add_argument("--beginning-len", type=int, default=256)
    ap.add_argument("--choice-len", type=int, default=8)
    ap.add_argument("--message-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed round that compiles)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    for name in ("groups", "requests", "beginning_len", "choice_len", "message_len", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(a, name)}")
    longest = a.beginning_len + max(a.choice_len, a.message_len)
    if longest > BUCKETS[-1]:
        ap.error(f"--beginning-len + the longer of --choice-len and --message-len: {longest} tokens, past the largest "
                 f"prompt bucket ({BUCKETS[-1]})")
    import generate as gen
    import jax

    from jdspark import workloads
    from jdspark.slots import SlotBackend

    target, drafter, note = gen.load_pair(a.checkpoint)
    print(f"[bench_shared] {note}", file=sys.stderr)
    tok = gen.load_tokenizer(a.checkpoint, target.config)
    docs = workloads.documents("code")
    G = drafter.config.block_size if drafter is not None else 0
    be = SlotBackend(target, drafter, num_slots=1, max_len=BUCKETS[-1] + 2 * G + 2, prompt_buckets=BUCKETS,
                     prefix_pool=2 * a.requests, max_logprobs=1)
    res = {"backend": jax.default_backend(), "checkpoint": a.checkpoint, "beginning_len": a.beginning_len,
           "rounds": a.rounds}
    for name, rest, entries in (("choices", a.choice_len, True), ("system", a.message_len, False)):
        groups = groups_of(docs, tok, a.groups, a.requests, a.beginning_len, rest, seed=2 if entries else 4)
        res[name] = measure(be, groups, entries, a.rounds)
        print(f"[bench_shared] {name}: {res[name]}", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(res))
    else:
        print(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
