"""Single-stream speculative-decoding cost model (seed 000, "standard" bs=1 model).

One decode step: the drafter proposes ``gamma`` tokens at a cost of ``r`` target forward passes, the target
verifies them in one pass, and the longest accepted prefix plus one target token is committed. With an
independent per-draft acceptance probability ``p``::

    E[tokens per step] = sum_{k=0..gamma} p**k = (1 - p**(gamma + 1)) / (1 - p)      (gamma + 1 at p = 1)
    speedup            = E[tokens per step] / (1 + r)
                         (/ (v + r) when a verify pass costs v decode steps instead of one: see
                          speedup_from_per_position)

With measured acceptance instead, let ``a[i]`` be the fraction of steps whose draft ``i`` (0-based) was
accepted, i.e. ``P(accept length > i)`` (a marginal, non-increasing in ``i``; not the conditional rate
``P(accept i | accepted i-1)``). Then ``E = 1 + sum_i a[i]``; the independent model is ``a[i] = p**(i+1)``.

Seed anchors (gamma 7, r 0.1 assumed): 118 tok/s without drafting, 370 tok/s (3.14x) and 464 tok/s (3.93x)
with DSpark. The seed's implied acceptances 0.7347 and 0.8129 come from the unrounded ratios 370/118 and
464/118; the rounded 3.14 and 3.93 give 0.7352 and 0.8127.

CLI: ``python -m jdspark.costmodel [--table] [--json] [--gamma G] [--r R] [--p P ...] [--speedup S ...]
[--per-position A0 A1 ...]``; ``--json`` prints one JSON object on one line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

DEFAULT_GAMMA = 7
DEFAULT_R = 0.1
DEFAULT_PS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
BASELINE_TOK_S = 118.0
ANCHOR_TOK_S = (370.0, 464.0)
DEFAULT_SPEEDUPS = tuple(t / BASELINE_TOK_S for t in ANCHOR_TOK_S)  # 3.1356 and 3.9322, the seed's anchors

__all__ = [
    "expected_tokens_per_step",
    "speedup",
    "p_from_speedup",
    "expected_tokens_from_per_position",
    "speedup_from_per_position",
    "table",
    "main",
]


def _check_p(p, name: str = "p") -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return p


def _check_gamma(gamma, name: str = "gamma") -> int:
    if isinstance(gamma, bool) or int(gamma) != gamma:
        raise ValueError(f"{name} must be an integer >= 1, got {gamma!r}")
    gamma = int(gamma)
    if gamma < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {gamma}")
    return gamma


def _check_r(r, name: str = "r") -> float:
    r = float(r)
    if not (r >= 0.0 and math.isfinite(r)):
        raise ValueError(f"{name} must be a finite number >= 0, got {r}")
    return r


def expected_tokens_per_step(p: float, gamma: int) -> float:
    """``(1 - p**(gamma+1)) / (1 - p)``: committed tokens per step (accepted drafts + the target's token).

    Evaluated as ``sum_{k=0..gamma} p**k``, which equals the closed form, is ``gamma + 1`` at ``p = 1`` and
    stays accurate near 1.
    """
    p = _check_p(p)
    gamma = _check_gamma(gamma)
    return math.fsum(p**k for k in range(gamma + 1))


def speedup(p: float, gamma: int, r: float) -> float:
    """Speedup over plain decoding: ``expected_tokens_per_step(p, gamma) / (1 + r)``."""
    return expected_tokens_per_step(p, gamma) / (1.0 + _check_r(r))


def p_from_speedup(target_speedup: float, gamma: int, r: float, tol: float = 1e-13) -> float:
    """The per-draft acceptance ``p`` in [0, 1] with ``speedup(p, gamma, r) == target_speedup`` (bisection;
    speedup is strictly increasing in ``p``). ValueError if the target lies outside
    ``[1 / (1 + r), (gamma + 1) / (1 + r)]``, the range reachable for p in [0, 1]."""
    gamma = _check_gamma(gamma)
    r = _check_r(r)
    target = float(target_speedup)
    lo_s, hi_s = speedup(0.0, gamma, r), speedup(1.0, gamma, r)
    if not lo_s <= target <= hi_s:  # also rejects NaN
        raise ValueError(
            f"speedup {target} is unreachable with gamma={gamma}, r={r}: it must lie in "
            f"[{lo_s:.6g}, {hi_s:.6g}] (p = 0 .. 1)"
        )
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if speedup(mid, gamma, r) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def expected_tokens_from_per_position(per_position_accept: Sequence[float]) -> float:
    """``1 + sum(per_position_accept)``, with ``per_position_accept[i] = P(accept length > i)``: the fraction of
    steps whose draft ``i`` (0-based) was accepted. Entries must be in [0, 1] and non-increasing (a draft is
    only accepted after all earlier ones were); ``[p**(i+1) for i in range(gamma)]`` reproduces
    :func:`expected_tokens_per_step`."""
    acc = [_check_p(a, f"per_position_accept[{i}]") for i, a in enumerate(per_position_accept)]
    if not acc:
        raise ValueError("per_position_accept must hold at least one entry (one per drafted position)")
    for i in range(1, len(acc)):
        if acc[i] > acc[i - 1] + 1e-12:
            raise ValueError(
                f"per_position_accept must be non-increasing (P(accept length > i)), but entry {i} "
                f"({acc[i]}) exceeds entry {i - 1} ({acc[i - 1]}); conditional rates must be cumulated first"
            )
    return 1.0 + math.fsum(acc)


def speedup_from_per_position(per_position_accept: Sequence[float], r: float, v: float = 1.0) -> float:
    """``expected_tokens_from_per_position(per_position_accept) / (v + r)``: ``v`` is the verify pass's cost in
    plain decode steps (the seed's model takes 1: a memory-bound accelerator reads the weights once either way;
    on a CPU, where a block of gamma + 1 tokens costs several steps, measure it)."""
    v = float(v)
    if not v > 0 or math.isinf(v):
        raise ValueError(f"v must be a positive finite number, got {v}")
    return expected_tokens_from_per_position(per_position_accept) / (v + _check_r(r))


def table(ps: Sequence[float] = DEFAULT_PS, gamma: int = DEFAULT_GAMMA, r: float = DEFAULT_R) -> list[dict]:
    """One row per ``p``: ``{"p", "tokens_per_step", "speedup"}``."""
    return [
        {"p": float(p), "tokens_per_step": expected_tokens_per_step(p, gamma), "speedup": speedup(p, gamma, r)}
        for p in ps
    ]


# ---------------------------------------------------------------------------------------------------- CLI


def _arg_type(cast, check):
    """An argparse type: cast the text, then validate it with one of the _check_* functions."""
    def parse(text: str):
        try:
            return check(cast(text), "value")
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return parse


_arg_p = _arg_type(float, _check_p)
_arg_gamma = _arg_type(int, _check_gamma)
_arg_r = _arg_type(float, _check_r)


def _arg_positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r}: a speedup must be a finite number > 0")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jdspark.costmodel",
        description="Speculative-decoding cost model: tokens/step and speedup vs per-draft acceptance p.",
    )
    ap.add_argument("--table", action="store_true", help="print the sensitivity table (the default output)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    ap.add_argument("--gamma", type=_arg_gamma, default=DEFAULT_GAMMA, help="drafted tokens per step (>= 1)")
    ap.add_argument("--r", type=_arg_r, default=DEFAULT_R, help="drafter cost / one target step (>= 0)")
    ap.add_argument("--p", type=_arg_p, nargs="+", default=list(DEFAULT_PS), help="acceptance rates in [0, 1]")
    ap.add_argument(
        "--speedup", type=_arg_positive, nargs="+", default=list(DEFAULT_SPEEDUPS),
        help="speedups to invert into p (default: the seed's anchors 370/118 and 464/118)",
    )
    ap.add_argument(
        "--per-position", type=_arg_p, nargs="+", default=None, metavar="A",
        help="measured P(accept length > i) for i = 0, 1, ...",
    )
    return ap


def _report(args, ap: argparse.ArgumentParser) -> dict:
    out = {"gamma": args.gamma, "r": args.r, "rows": table(args.p, args.gamma, args.r), "inverse": []}
    for s in args.speedup:
        try:
            out["inverse"].append({"speedup": s, "p": p_from_speedup(s, args.gamma, args.r)})
        except ValueError as e:
            ap.error(f"argument --speedup: {e}")
    if args.per_position is not None:
        try:
            out["per_position"] = {
                "accept": list(args.per_position),
                "tokens_per_step": expected_tokens_from_per_position(args.per_position),
                "speedup": speedup_from_per_position(args.per_position, args.r),
            }
        except ValueError as e:
            ap.error(f"argument --per-position: {e}")
    return out


def _format_text(rep: dict) -> str:
    lines = [f"gamma = {rep['gamma']}, r = {rep['r']}", "", f"{'p':>8} {'tokens/step':>12} {'speedup':>9}"]
    lines += [f"{row['p']:>8.4f} {row['tokens_per_step']:>12.4f} {row['speedup']:>8.2f}x" for row in rep["rows"]]
    lines += ["", f"{'speedup':>8} {'implied p':>10} {'tokens/step':>12}"]
    lines += [
        f"{inv['speedup']:>7.4f}x {inv['p']:>10.4f} {inv['speedup'] * (1 + rep['r']):>12.4f}"
        for inv in rep["inverse"]
    ]
    if "per_position" in rep:
        pp = rep["per_position"]
        lines += ["", f"per-position acceptance {pp['accept']}:",
                  f"  tokens/step {pp['tokens_per_step']:.4f}, speedup {pp['speedup']:.2f}x"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    rep = _report(args, ap)
    if args.json:
        sys.stdout.write(json.dumps(rep, separators=(",", ":")) + "\n")
    else:
        print(_format_text(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
