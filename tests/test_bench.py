"""scripts/bench.py's pieces that need no timing: the chart from a result, acceptance -> p, degeneracy rows."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench  # noqa: E402

from jdspark import costmodel  # noqa: E402
from kimi.tokenizer import ByteTokenizer  # noqa: E402


def _row(accept_len, speedup):
    return {"accept_len": accept_len, "speedup": speedup, "per_position_accept": [0.9, 0.8, 0.7],
            "r_draft_over_step": 0.2, "v_verify_over_step": 1.5}


def test_p_from_accept_len_inverts_the_cost_model():
    for p in (0.0, 0.3, 0.73, 0.95):
        assert bench._p_from_accept_len(costmodel.expected_tokens_per_step(p, 7), 7) == pytest.approx(p, abs=1e-9)


def test_plot_writes_a_png(tmp_path):
    result = {"block_size": 3, "backend": "cpu",
              "workloads": {"code": {"greedy": _row(3.1, 2.0), "sampled": _row(2.2, 1.3)},
                            "prose": {"greedy": _row(2.5, 1.5)}}}
    out = tmp_path / "chart.png"
    bench.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temporary file left


def test_degeneracy_figures_compare_with_the_real_continuation_at_the_same_length():
    tok = ByteTokenizer()
    loop = tok.encode(" " * 100)
    fig = bench.degeneracy_figures(tok, [loop], [b"def f():\n    return 1\n" * 20])
    assert fig["run_share"] == 1.0 and fig["reference"]["run_share"] == 0.0
    assert fig["reference"]["distinct8"] > 0.2
