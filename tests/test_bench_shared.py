"""scripts/bench_shared.py on a tiny random pair: groups of prompts sharing a beginning, each request's insert timed
with the beginning kept where they part and without; the third request of a group finds it kept, and both ways
give the same prompt entries and first tokens."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_shared  # noqa: E402

from tests.random_pair import random_pair, source_docs  # noqa: E402


def test_groups_timed_both_ways():
    from jdspark.slots import SlotBackend

    target, drafter = random_pair()
    be = SlotBackend(target, drafter, num_slots=1, max_len=64, prompt_buckets=(16, 32), prefix_pool=4,
                     prefix_min_tokens=8, max_logprobs=1)
    for entries, least in ((True, 19), (False, 20)):  # entries: kept a token short of where the prompts part
        groups = bench_shared.groups_of(source_docs(), None, 1, 3, 20, 6, seed=2 if entries else 4)
        assert all(len(p) == 26 and p[:20] == groups[0][0][:20] for p in groups[0])
        res = bench_shared.measure(be, groups, entries, rounds=1)
        cached = res["cached_tokens_on"]
        assert cached[:2] == [0.0, 0.0] and least <= cached[2] < 26, cached  # (the rests may begin alike)
        assert res["group_on_ms"] == pytest.approx(sum(res["ms_on_by_request"]), rel=1e-3)
        assert res["group_off_ms"] == pytest.approx(sum(res["ms_off_by_request"]), rel=1e-3)
        assert min(res["ms_on_by_request"] + res["ms_off_by_request"]) > 0
        assert res["off_over_on"] == pytest.approx(res["group_off_ms"] / res["group_on_ms"], rel=1e-2)
        if entries:
            assert res["max_abs_entry_diff"] < 1e-3
        else:
            assert res["first_token_mismatches"] == 0
        json.dumps(res)
    assert be.prefix_split
