"""jdspark.costmodel: the seed-000 table, its inversion, per-position acceptance, the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jdspark import costmodel as cm

ROOT = Path(__file__).resolve().parents[2]

SEED_TABLE = {0.95: 6.12, 0.90: 5.18, 0.80: 3.78, 0.70: 2.86, 0.60: 2.23, 0.50: 1.81}


def test_seed_table_gamma7_r01():
    for p, want in SEED_TABLE.items():
        assert round(cm.speedup(p, 7, 0.1), 2) == want
    rows = cm.table()
    assert [row["p"] for row in rows] == list(SEED_TABLE)
    assert [round(row["speedup"], 2) for row in rows] == list(SEED_TABLE.values())
    # seed's "implied tok/s" column: 118 tok/s baseline
    assert round(118 * cm.speedup(0.95, 7, 0.1), 1) == 722.1


def test_closed_form_and_limits():
    for p in (0.0, 0.3, 0.9, 0.999999):
        assert cm.expected_tokens_per_step(p, 7) == pytest.approx((1 - p**8) / (1 - p), rel=1e-9)
    assert cm.expected_tokens_per_step(1.0, 7) == 8.0
    assert cm.expected_tokens_per_step(0.0, 3) == 1.0
    assert cm.speedup(1.0, 7, 0.0) == 8.0


def test_inversion_matches_seed():
    # the seed's 0.7347 / 0.8129 come from the unrounded anchors 370/118 and 464/118
    assert round(cm.p_from_speedup(370 / 118, 7, 0.1), 4) == 0.7347
    assert round(cm.p_from_speedup(464 / 118, 7, 0.1), 4) == 0.8129
    assert round(cm.expected_tokens_per_step(cm.p_from_speedup(370 / 118, 7, 0.1), 7), 2) == 3.45
    assert round(cm.expected_tokens_per_step(cm.p_from_speedup(464 / 118, 7, 0.1), 7), 2) == 4.33
    # the rounded multiples land slightly off the seed's 4-decimal values
    assert round(cm.p_from_speedup(3.14, 7, 0.1), 4) == 0.7352
    assert round(cm.p_from_speedup(3.93, 7, 0.1), 4) == 0.8127
    for p in (0.0, 0.42, 1.0):
        assert cm.p_from_speedup(cm.speedup(p, 5, 0.2), 5, 0.2) == pytest.approx(p, abs=1e-9)
    with pytest.raises(ValueError, match="unreachable"):
        cm.p_from_speedup(7.3, 7, 0.1)  # > 8 / 1.1
    with pytest.raises(ValueError, match="unreachable"):
        cm.p_from_speedup(0.5, 7, 0.1)  # < 1 / 1.1


def test_per_position():
    for p in (0.5, 0.8, 0.95, 1.0):
        cumulative = [p ** (i + 1) for i in range(7)]  # P(accept length > i) under independent acceptance
        assert cm.expected_tokens_from_per_position(cumulative) == pytest.approx(cm.expected_tokens_per_step(p, 7))
        assert cm.speedup_from_per_position(cumulative, 0.1) == pytest.approx(cm.speedup(p, 7, 0.1))
        # a verify that costs v decode steps: the same tokens over v + r steps
        assert cm.speedup_from_per_position(cumulative, 0.1, v=3.0) == pytest.approx(
            cm.expected_tokens_per_step(p, 7) / 3.1)
    # all entries equal to p: every step accepts all drafts or none (fully correlated) -> 1 + gamma * p
    assert cm.expected_tokens_from_per_position([0.8] * 7) == pytest.approx(1 + 7 * 0.8)
    with pytest.raises(ValueError, match=r"non-increasing"):
        cm.expected_tokens_from_per_position([0.5, 0.9])
    with pytest.raises(ValueError, match=r"per_position_accept\[1\]"):
        cm.expected_tokens_from_per_position([0.5, 1.5])


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"^p must be in \[0, 1\]"):
        cm.speedup(1.1, 7, 0.1)
    with pytest.raises(ValueError, match=r"^gamma must be an integer >= 1"):
        cm.expected_tokens_per_step(0.5, 0)
    with pytest.raises(ValueError, match=r"^gamma must be an integer >= 1"):
        cm.expected_tokens_per_step(0.5, 2.5)
    with pytest.raises(ValueError, match=r"^r must be"):
        cm.speedup(0.5, 7, -0.1)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jdspark.costmodel", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_cli_json_is_one_line():
    res = _cli("--table", "--json", "--speedup", "3.14", "3.93", "--per-position", "0.9", "0.8", "0.7")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1
    rep = json.loads(lines[0])
    assert rep["gamma"] == 7 and rep["r"] == 0.1
    assert {row["p"]: round(row["speedup"], 2) for row in rep["rows"]} == SEED_TABLE
    assert [inv["speedup"] for inv in rep["inverse"]] == [3.14, 3.93]
    assert [round(inv["p"], 4) for inv in rep["inverse"]] == [0.7352, 0.8127]
    assert rep["per_position"]["tokens_per_step"] == pytest.approx(3.4)
    assert rep["per_position"]["speedup"] == pytest.approx(3.4 / 1.1)


def test_cli_rejects_bad_flags(capsys):
    """Each bad flag: argparse's exit status 2 and a message naming the flag, nothing on stdout (in-process: the
    subprocess form of the CLI is tested above; five more interpreters would add half a minute)."""
    for args, flag in ((("--p", "1.5"), "--p"), (("--gamma", "0"), "--gamma"), (("--r", "-0.1"), "--r"),
                       (("--speedup", "9"), "--speedup"), (("--per-position", "0.2", "0.4"), "--per-position")):
        with pytest.raises(SystemExit) as exit_:
            cm.main(["--json", *args])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and f"argument {flag}" in err, (args, err)
        assert out == ""
