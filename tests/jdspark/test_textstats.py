"""jdspark.textstats against hand-counted texts."""

import pytest

from jdspark.textstats import degeneracy, distinct_ngrams, mean_degeneracy, repeat_lines, run_share


def test_run_share_counts_only_runs_longer_than_the_limit():
    assert run_share(b"a" * 24 + b"bc" * 38) == 0.0  # 24 is not longer than 24
    assert run_share(b"a" * 25 + b"b" * 75) == 1.0  # both runs are long
    assert run_share(b"x" * 30 + b"abcdefghij" * 7) == pytest.approx(30 / 100)
    assert run_share(b"") == 0.0


def test_distinct_ngrams():
    assert distinct_ngrams(b"abcdefghij", 8) == 1.0  # 3 distinct of 3
    assert distinct_ngrams(b"a" * 108, 8) == pytest.approx(1 / 101)
    assert distinct_ngrams(b"abab" * 4, 2) == pytest.approx(2 / 15)
    assert distinct_ngrams(b"short", 8) == 1.0


def test_repeat_lines_ignores_blank_lines_and_indentation():
    text = "def f():\n    return 1\n\n  return 1\nreturn 2\n\n\nreturn 1\n"
    assert repeat_lines(text) == pytest.approx(2 / 5)
    assert repeat_lines("\n\n") == 0.0


def test_degeneracy_of_a_loop_and_of_code():
    loop = "x = 1\n" + " " * 200
    code = "import os\n\ndef walk(root):\n    for d, _, files in os.walk(root):\n        yield d, files\n"
    assert degeneracy(loop)["run_share"] > 0.9 and degeneracy(loop)["distinct8"] < 0.1
    d = degeneracy(code)
    assert d["run_share"] == 0.0 and d["repeat_lines"] == 0.0
    assert d["distinct8"] == pytest.approx(1 - 9 / (len(code) - 7))  # "walk(root):\n    " twice: 9 8-grams
    m = mean_degeneracy([loop, code])
    assert m["run_share"] == pytest.approx(degeneracy(loop)["run_share"] / 2)
