"""scripts/bench_slots.py on a tiny random pair: one JSON line with a step time per (rows, batch, width), and the
cache bound checked before anything runs."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_slots  # noqa: E402

from tests.random_pair import random_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    target, drafter = random_pair()
    return target, drafter


def test_step_times_per_batch_and_width(pair):
    prompts = [list(np.random.default_rng(i).integers(4, 200, 12)) for i in range(2)]
    # one step per launch: launches of several steps are tested in tests/jdspark/test_slots.py (their programs
    # here cost CI ~10 s)
    res = bench_slots.run(*pair, prompts, slots=2, max_len=64, batches=[2], widths=[1, 4], iters=2, repeats=1,
                          steps_per_launch=1, switch=True, rows_kinds=("greedy",))
    got = {(r["rows"], r["batch"], r["width"], r["steps_per_launch"]) for r in res["steps"]}
    assert got == {("greedy", 2, w, 1) for w in (1, 4)}
    for r in res["steps"]:
        assert r["step_ms"] > 0 and r["per_token_ms"] == pytest.approx(r["step_ms"] / r["batch"])
        # a launch's dispatch is part of its round trip (steps_per_launch steps)
        assert 0 < r["dispatch_ms"] < r["step_ms"] * r["steps_per_launch"] and r["pipelined_ms"] > 0
    assert res["generate_plain_ms"] > 0
    assert [(r["rows"], r["batch"], r["widths"]) for r in res["width_switch"]] == [("greedy", 2, [1, 4])]
    for r in res["width_switch"]:
        assert r["runs_ms"] > 0 and r["alternating_over_runs"] == pytest.approx(r["alternating_ms"] / r["runs_ms"])
    assert set(res["launch_arg_ms"]) == {"device_arrays_1", "device_arrays_30", "device_arrays_300",
                                         "numpy_arrays_5", "numpy_arrays_1"}
    assert all(v > 0 for v in res["launch_arg_ms"].values())
    # a plain step of drafting rows over one of rows that never draft, round by round (both rows kinds at b = 2)
    assert [(r["rows"], r["batch"], len(r["pipelined_ratios"])) for r in res["plain_context_cost"]] == [
        ("greedy", 2, 1)]
    assert all(r["pipelined_ratio_median"] > 0 for r in res["plain_context_cost"])
    json.dumps(res)
    # the backend as --spec adaptive serves it
    res = bench_slots.run(*pair, prompts, slots=2, max_len=64, batches=[2], widths=[1], iters=2, repeats=1,
                          adaptive=True, rows_kinds=("greedy",))  # sampled rows: the same loop at T = 1, their
    # programs served in tests/jdspark/test_slots.py (not compiled again here)
    assert res["adaptive"] and {(r["rows"], r["drafter_context"]) for r in res["steps"]} == {
        ("greedy", c) for c in (False, True)}
    with pytest.raises(ValueError, match="overflow"):
        bench_slots.run(*pair, prompts, slots=2, max_len=40, batches=[1], widths=[4], iters=8, repeats=1)


def test_room_problem_and_width_flags(capsys):
    """The cache bound as a rule of its own (said before the pair loads its programs), and --widths outside the
    drafter's block a usage error naming it."""
    assert bench_slots.room_problem(320, 128, 7, 8, 1, [8]) is None
    assert "overflow the 320-position caches" in bench_slots.room_problem(320, 128, 7, 100, 1, [8])
    for args, said in ((["--widths", "9"], "--widths: each in 1..8"), (["--iters", "0"], "--iters, --repeats"),
                       (["--iters", "100"], "overflow the 320-position caches")):
        with pytest.raises(SystemExit):
            bench_slots.main(args)
        assert said in capsys.readouterr().err
