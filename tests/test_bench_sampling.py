"""scripts/bench_sampling.py at its default vocabulary, two calls per figure: one JSON line with every operation's
figure per shape and sampling form, the peaked logits' nucleus within top-p's fast path and the flat ones' past it
(so both of "bisect"'s paths are what is timed), and the form this backend samples with."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_sampling  # noqa: E402


def test_json_line_has_every_figure(capsys):
    assert bench_sampling.main(["--vocab", "4096", "--rows", "1", "--iters", "2", "--repeats", "1", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    peaked, flat = r["rows"]["1xpeaked"], r["rows"]["1xflat"]
    assert peaked["nucleus_tokens_row0"] <= 64 < flat["nucleus_tokens_row0"]
    assert r["default_form"] == "bisect"  # this CPU's (kimi.dispatch.sampling_form)
    for form in ("bisect", "sort"):
        for name in ("sample_top_p", "top_p_mask", "top_p_min_p_mask", "propose", "sample_rows", "propose_rows"):
            assert peaked[f"{name}_{form}"] > 0 and flat[f"{name}_{form}"] > 0
        assert f"accept_rejection_{form}" not in peaked  # a verify block needs >= 2 rows
    for name in ("gumbel_categorical_all_V", "sort_V", "argsort_V", "top_k_64"):
        assert peaked[name] > 0
    assert "sort_V" not in flat
