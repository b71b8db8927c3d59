"""scripts/bench_prefix.py on a tiny random pair: a conversation's turns timed without the prefix cache, with the
previous turn's prompt kept, and with its answer kept too, the later turns served from what is kept, every way
giving the same first token."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_prefix  # noqa: E402

from tests.random_pair import random_pair, source_docs  # noqa: E402


def test_turns_timed_both_ways():
    target, drafter = random_pair()
    docs = source_docs()
    kw = dict(conversations=1, turns=3, first_len=20, answer_len=6, message_len=6, rounds=1, buckets=(16, 64),
              max_len=128)
    res = bench_prefix.measure(target, drafter, docs, **kw)
    # on: the previous prompt kept; answers: its answer too (6 tokens), so a turn prefills its 6-token message
    assert [(r["turn"], r["prompt_tokens"], r["cached_tokens"], r["cached_tokens_answers"])
            for r in res["per_turn"]] == [(1, 20, 0, 0), (2, 32, 20, 26), (3, 44, 32, 38)]
    assert all(r[f"ttft_{w}_ms"] > 0 for r in res["per_turn"] for w in ("off", "on", "answers"))
    assert res["first_token_mismatches"] == []
    for a, b in (("off", "on"), ("off", "answers"), ("on", "answers")):
        assert res[f"total_{a}_over_{b}"] == pytest.approx(res[f"total_ttft_{a}_ms"] / res[f"total_ttft_{b}_ms"],
                                                           rel=1e-3)
    json.dumps(res)
    with pytest.raises(ValueError, match="largest prompt bucket"):
        bench_prefix.measure(target, drafter, docs, **{**kw, "turns": 5})
