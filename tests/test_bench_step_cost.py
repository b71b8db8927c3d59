"""scripts/bench_step_cost.py on a tiny random pair: pass times per width and drafter context, and the ratios the
JSON reports derived from them (ceiling, break-even, prediction from a bench_long run's accept_len)."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_step_cost  # noqa: E402

from tests.random_pair import random_pair  # noqa: E402


def test_pass_costs_and_the_figures_derived_from_them(tmp_path):
    target, drafter = random_pair()
    block = np.random.default_rng(0).integers(4, 200, 4)
    secs = bench_step_cost.pass_costs(target, drafter, block, 40, (2, 4), 8, iters=1, repeats=1)
    assert set(secs) == {"decode", "verify_2", "verify_4", "draft_none", "draft_8"}
    assert all(v > 0 for v in secs.values())
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"lengths": [{"context": 40, "drafter_window": 8, "accept_len": 2.5, "speedup": 1.1},
                                            {"context": 40, "drafter_window": None, "accept_len": 1.0,
                                             "speedup": 0.5}]}) + "\n")
    measured = bench_step_cost.measured_rows(str(path), 8)
    assert measured[40]["accept_len"] == 2.5
    secs["prefill_chunk"] = bench_step_cost.prefill_chunk_cost(target, block, 40, repeats=1)
    secs["prefill_chunk_tokens"] = len(block)
    row = bench_step_cost.summarize(40, secs, (2, 4), 8, 3, measured[40])
    assert row["prefill_tok_s_here"] == pytest.approx(len(block) / secs["prefill_chunk"], rel=1e-2)
    step = secs["verify_4"] + secs["draft_8"]
    r3 = dict(abs=5.01e-4, rel=0)  # the row rounds ratios to 3 decimals (a relative bound failed on a ratio of 0.31)
    assert row["speedup_ceiling"]["4"] == pytest.approx(4 * secs["decode"] / step, **r3)
    assert row["breakeven_accept_len"] == pytest.approx(step / secs["decode"], **r3)
    assert row["predicted_speedup"] == pytest.approx(2.5 * secs["decode"] / step, **r3)
    assert row["verify_over_decode"]["2"] == pytest.approx(secs["verify_2"] / secs["decode"], **r3)
    json.dumps(row)
