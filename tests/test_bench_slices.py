"""scripts/bench_slices.py on a tiny random pair: a running stream's chunk gaps while a long prompt arrives, with
the prompt prefilled in one insert and in slices, and the figures derived from them."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_slices  # noqa: E402

from tests.random_pair import random_pair, source_docs  # noqa: E402


def test_gaps_and_first_tokens_with_and_without_slices():
    target, drafter = random_pair()
    docs = source_docs()
    kw = dict(streams=1, longs=1, short_len=16, long_len=100, answer_len=96, long_answer=2, rounds=1)
    res = bench_slices.measure(target, drafter, docs, slices=(0, 64), **kw)
    assert res["prompt_buckets"] == [64, 128] and set(res["slices"]) == {"0", "64"}
    assert res["slices_run"] == 2  # 100 tokens in slices of 64: [0, 36) kept, the insert extends [36, 100); 2 runs
    for row in res["slices"].values():
        assert 0 < row["gap_ms_p50"] <= row["gap_ms_p99"] <= row["gap_ms_max"] and row["long_ttft_ms"] > 0
        assert row["tok_s"] > 0
    off, on = res["slices"]["0"], res["slices"]["64"]
    assert on["gap_max_over_off"] == pytest.approx(on["gap_ms_max"] / off["gap_ms_max"], rel=1e-2)
    assert on["long_ttft_over_off"] == pytest.approx(on["long_ttft_ms"] / off["long_ttft_ms"], rel=1e-2)
    json.dumps(res)
    with pytest.raises(ValueError, match="slices: expected 0"):
        bench_slices.measure(target, drafter, docs, slices=(64, 32), **kw)
