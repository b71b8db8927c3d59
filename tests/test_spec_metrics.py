"""scripts/spec_metrics.py: a live server's acceptance and what it buys, from its /metrics, against what its
responses' usage says was served (the scripted backend's steps: 4 drafts verified, 2 accepted, 5 tokens verified
a slot-step, and a cost table of its own)."""

import json
import os
import sys

import httpx
import pytest

from tests.jdspark.serve_helpers import LiveServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import spec_metrics  # noqa: E402


def test_spec_metrics_reads_what_was_served(capsys):
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
        assert [row["batch"] for row in r["what_it_buys"]] == [1, 2]
        assert spec_metrics.main(["--url", s.url, "--window", "0", "--json"]) == 0
        since_start = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert since_start["generation_tokens"] >= 21 and since_start["window_s"] is None
    finally:
        s.close()
    with pytest.raises(SystemExit, match="spec_metrics: .*/metrics"):
        spec_metrics.main(["--url", s.url, "--window", "0"])  # nothing answers there now
