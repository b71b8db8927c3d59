"""scripts/spec_metrics.py: a live server's acceptance and what it buys, from its /metrics, against what its
responses' usage says was served (the scripted backend's steps: 4 drafts verified, 2 accepted, 5 tokens verified
a slot-step, and a cost table of its own)."""

import contextlib
import io
import json
import os
import sys

import httpx
import pytest

from tests.jdspark.serve_helpers import LiveServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import spec_metrics  # noqa: E402


def test_spec_metrics_reads_what_was_served():
    s = LiveServer(num_slots=2)
    try:
        before = httpx.get(s.url + "/metrics").text
        usage = [httpx.post(s.url + "/v1/completions", json={"prompt": "ab" + c, "max_tokens": 7}).json()["usage"]
                 for c in "xyz"]  # 1 + 3 + 3 tokens each: two speculative steps
        after = httpx.get(s.url + "/metrics").text
        r = spec_metrics.report(before, after, 2.0)
        assert r["requests_finished"]["length"] == 3 and r["requests_finished"]["stop"] == 0
        assert r["generation_tokens"] == sum(u["completion_tokens"] for u in usage) == 21
        assert r["generation_tok_s"] == pytest.approx(21 / 2.0)
        assert (r["draft_tokens"], r["accepted_tokens"]) == (sum(u["drafted"] for u in usage),
                                                             sum(u["accepted"] for u in usage))
        assert r["drafts"] == 6 and r["accept_len"] == pytest.approx(usage[0]["accept_len"]) == pytest.approx(3.0)
        assert r["acceptance_rate"] == pytest.approx(0.5) and r["per_position_accept"] == [1.0, 1.0]
        assert r["verified_per_slot_step"] == pytest.approx(5.0) and r["ttft_ms_mean"] > 0
        costs = s.backend.costs  # the cost table the engine exposed: batch buckets 1 and 2, widths 1 and 5
        for row in r["what_it_buys"]:
            w5 = row["widths"]["5"]
            even = costs[(row["batch"], 5)] / costs[(row["batch"], 1)]
            assert row["plain_ms"] == pytest.approx(costs[(row["batch"], 1)] * 1e3)
            assert w5["break_even"] == pytest.approx(even) and w5["expected"] == pytest.approx(3.0)
            assert w5["speedup"] == pytest.approx(3.0 / even)
            assert row["best_width"] == (5 if 3.0 / even > 1 else 1)  # the only drafting width, where it pays
        assert [row["batch"] for row in r["what_it_buys"]] == [1, 2]
        out = io.StringIO()  # (not capsys: the server's threads log to the stream they found at start)
        with contextlib.redirect_stdout(out):
            assert spec_metrics.main(["--url", s.url, "--window", "0", "--json"]) == 0
        since_start = json.loads(out.getvalue().strip().splitlines()[-1])
        assert since_start["generation_tokens"] >= 21 and since_start["window_s"] is None
    finally:
        s.close()
    with pytest.raises(SystemExit, match="spec_metrics: .*/metrics"):
        spec_metrics.main(["--url", s.url, "--window", "0"])  # nothing answers there now


def test_acceptance_when_verified_counts_only_the_steps_that_verified_each_draft():
    """Steps of mixed verify widths (as adaptive verification serves them): draft k's acceptance when verified is
    over the slot-steps of width >= k + 2 (from jdspark:verified_tokens_per_step), vLLM's per-position figure over
    every speculative step; a window's figures are the deltas between two texts."""
    import types

    from jdspark.engine import StepOutput
    from jdspark.serve_metrics import ServeMetrics

    m = ServeMetrics("m", max_positions=8)
    req = types.SimpleNamespace(first_token_at=0.0, last_token_at=0.0, arrival=0.0)
    before = m.exposition().decode()
    outs = [StepOutput([1, 2], drafted=1, accepted=1, verified=2)] * 6  # width 2: draft 0 kept six times
    outs += [StepOutput([1] * 4, drafted=7, accepted=3, verified=8)] * 2  # width 8: drafts 0-2 kept, 3 rejected
    outs += [StepOutput([1], drafted=0, accepted=0, verified=1)] * 3  # plain steps
    m.step(req, outs, [1] * 19, 1.0, prefill=False)
    r = spec_metrics.report(before, m.exposition().decode(), None)
    assert (r["drafts"], r["draft_tokens"], r["accepted_tokens"]) == (8, 20, 12)
    assert r["accept_len"] == pytest.approx(1 + 12 / 8) and r["verified_per_slot_step"] == pytest.approx(31 / 11)
    assert r["per_position_accept"] == pytest.approx([1.0, 2 / 8, 2 / 8])
    assert r["verified_steps"] == [8, 2, 2]
    assert r["per_position_accept_when_verified"] == pytest.approx([1.0, 1.0, 1.0])
    assert spec_metrics.report(m.exposition().decode(), m.exposition().decode(), 1.0)["drafts"] == 0
    with pytest.raises(ValueError, match="the server restarted during the window"):
        spec_metrics.report(m.exposition().decode(), before, 1.0)


def test_the_best_width_is_the_one_this_traffic_gains_most_at_or_plain():
    """``best_width`` per batch bucket: the width of the highest speedup(W) = expected(W) / break_even above 1, else
    1 (plain decoding), from a hand-made cost table (seconds by batch and width) and acceptance when verified."""
    def cost(b, w, s):
        return ("jdspark:step_cost_seconds", (("batch", str(b)), ("width", str(w)))), s

    m = dict([cost(1, 1, 1.0), cost(1, 2, 1.2), cost(1, 4, 1.5), cost(1, 8, 2.5),
              cost(16, 1, 1.0), cost(16, 2, 2.2), cost(16, 4, 3.0), cost(16, 8, 5.0)])
    rates = [0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]
    rows = {row["batch"]: row for row in spec_metrics._buys(m, rates)}
    # batch 1: W 2 1.8 / 1.2 = 1.5x, W 4 2.8 / 1.5 = 1.87x, W 8 3.17 / 2.5 = 1.27x; batch 16: all below 1
    assert rows[1]["widths"]["4"]["speedup"] == pytest.approx(2.8 / 1.5) and rows[1]["best_width"] == 4
    assert max(x["speedup"] for x in rows[16]["widths"].values()) < 1 and rows[16]["best_width"] == 1
