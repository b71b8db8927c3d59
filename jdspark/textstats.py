"""How degenerate a text is: the three figures bench.py reports beside acceptance, so acceptance is read on text
that looks like real output (a model that loops on one byte is easy to draft for and useless to serve).

  run_share      share of the bytes inside runs of one repeated byte longer than ``RUN_LEN`` (24)
  distinct8      distinct byte 8-grams over all byte 8-grams (real code: ~0.9; a loop: near 0)
  repeat_lines   share of the non-blank lines (stripped) that repeat an earlier line of the same text

All three work on bytes, so they compare across vocabularies. ``degeneracy(text)`` returns them as a dict.
"""

from __future__ import annotations

import numpy as np

RUN_LEN = 24
NGRAM = 8

__all__ = ["RUN_LEN", "NGRAM", "run_share", "distinct_ngrams", "repeat_lines", "degeneracy", "mean_degeneracy"]


def _as_bytes(text) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def run_share(text, min_run: int = RUN_LEN) -> float:
    """Bytes in maximal runs of one byte value of length > ``min_run``, over all bytes (0 for empty text)."""
    b = np.frombuffer(_as_bytes(text), np.uint8)
    if b.size == 0:
        return 0.0
    starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
    lengths = np.diff(np.concatenate([starts, [b.size]]))
    return float(lengths[lengths > min_run].sum() / b.size)


def distinct_ngrams(text, n: int = NGRAM) -> float:
    """Distinct byte n-grams over the number of n-grams (1.0 for a text shorter than n + 1 bytes)."""
    b = _as_bytes(text)
    total = len(b) - n + 1
    if total <= 1:
        return 1.0
    return len({b[i:i + n] for i in range(total)}) / total


def repeat_lines(text) -> float:
    """Share of the non-blank lines whose stripped content appeared on an earlier line (0 without lines)."""
    seen, repeats, lines = set(), 0, 0
    for line in _as_bytes(text).split(b"\n"):
        s = line.strip()
        if not s:
            continue
        lines += 1
        repeats += s in seen
        seen.add(s)
    return repeats / lines if lines else 0.0


def degeneracy(text) -> dict:
    return {"run_share": run_share(text), "distinct8": distinct_ngrams(text), "repeat_lines": repeat_lines(text)}


def mean_degeneracy(texts) -> dict:
    """Each figure averaged over ``texts`` (one per prompt)."""
    rows = [degeneracy(t) for t in texts]
    return {k: float(np.mean([r[k] for r in rows])) for k in ("run_share", "distinct8", "repeat_lines")}
