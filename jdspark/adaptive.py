"""Adaptive verification: choose each serving step's verify width from the drafter's confidences and a measured
cost table (DSpark's hardware-aware prefix scheduler, paper section 3.2.2; vLLM's ``enable_adaptive_verification``).

For slot r the confidence head gives a survival curve a_{r,k} = prod_{i<=k} sigmoid(c_{r,i}), the probability that
drafts 1..k are all accepted. Verifying W tokens (the anchor and W - 1 drafts) commits in expectation

    E_r(W) = 1 + sum_{k=1}^{W-1} a_{r,k}        (the bonus token always, draft k when 1..k all survive)

and a step of b rows at width W costs T(b, W) seconds (profiled at start-up, made monotone). The scheduler picks
the width maximising expected committed tokens per second, sum_r E_r(W) / T(b, W), over the compiled widths
(W = 1 is a plain decode step: no drafter pass at all). Both inputs are corrected by what serving measures: the
curves by the acceptance observed against them (``SurvivalTracker``'s calibration), the table by each step's own
time (``CostTable``: the median of each (b, W)'s recent timings; a step that shared the device with a prefill is
not timed).

Lossless under sampling: the width of step t is chosen from the survival curves of step t - 1 (vLLM's rule), so
it is fixed before step t's drafts are drawn and rejection sampling's output law is unchanged. (Choosing from the
current step's curves would let a draft's own value decide whether it is verified: the confidence of slot k + 1
reads token k.) The verified block is rectangular ([b, W] through ``jax.vmap``), so every row verifies the same
width: allocating a budget unevenly across rows would save nothing here; that needs ragged verification.
"""

from __future__ import annotations

import collections
import statistics
from typing import Mapping, Sequence

import numpy as np

__all__ = ["expected_tokens", "expected_by_width", "choose_width", "monotone_costs", "CostTable", "calibrated",
           "SurvivalTracker", "next_width", "probe_interval", "retime_extra", "PROBE_BUDGET"]

# The share of serving time the scheduler's probes may cost beyond what it would have run: a refresh (a drafting
# step after a run of plain ones) and a re-timing of a width it has not picked. A probe that costs ``extra`` plain
# steps more than a plain step runs once every ``probe_interval(extra)`` steps, so its cost stays at this share at
# every batch: at b = 1 a one-draft step costs ~1.2 plain steps (refresh every ~20), at b = 16 ~2.2 (every ~120,
# where the eleventh session's fixed 8 spent ~14% of a c = 16 cell on refreshes that could not pay). A re-timing
# is priced by ``retime_extra``: against the width the scheduler would run, a narrower one costs the tokens it does
# not verify, a wider one its time. 1%, not the 2% it was: at c = 1 the whole block is nearly always the pick, so
# the probes are what adaptive loses to fixed there (the twenty-third session: ~7% of launches at b = 1 were
# re-timings, verified tokens per step 7.5 of 8, ~2% slower than fixed without HTTP).
PROBE_BUDGET = 0.01


def probe_interval(extra_steps: float, budget: float = PROBE_BUDGET) -> float:
    """Steps between two probes that each cost ``extra_steps`` plain steps more than the step they replace, so
    that probing costs ``budget`` of the time: ceil(extra / budget), at least 1; ``budget`` 0: never (inf)."""
    if budget < 0:
        raise ValueError(f"budget: expected >= 0, got {budget}")
    if budget == 0:
        return float("inf")
    return max(1, int(np.ceil(max(float(extra_steps), 0.0) / budget)))


def retime_extra(expected: Mapping[int, float], costs: Mapping[int, float], width: int) -> float:
    """What a step at ``width`` costs beyond the step the scheduler would run in its place, in steps of that one:

        T(w) / T(W*) - E(w) / E(W*),    W* = argmax_W E(W) / T(W)    (>= 0 by the choice of W*)

    with E the expected committed tokens and T the step costs per width (one batch bucket). A narrower width
    than W* takes about as long and commits fewer tokens (at b = 1 on this CPU every width costs about the same,
    so a plain step in place of a whole block loses ~0.7 of a step); a wider one commits a little more in more
    time."""
    best = max(sorted(expected), key=lambda w: expected[w] / costs[w])
    return max(0.0, costs[width] / costs[best] - expected[width] / expected[best])


def expected_tokens(survival_RG: np.ndarray, caps_R: np.ndarray, width: int) -> float:
    """sum_r E_r(W) with E_r(W) = 1 + sum_{k <= min(W - 1, cap_r)} a_{r,k} (a row capped at 0 drafts commits 1)."""
    surv = np.asarray(survival_RG, np.float64)
    n_drafts = np.minimum(int(width) - 1, np.asarray(caps_R, np.int64))  # [R]
    k = np.arange(surv.shape[1])[None, :]
    return float(np.sum(1.0 + np.sum(np.where(k < n_drafts[:, None], surv, 0.0), axis=1)))


def expected_by_width(survival_RG: np.ndarray, caps_R: np.ndarray, widths: Sequence[int]) -> dict:
    """{W: ``expected_tokens(survival_RG, caps_R, W)``} for every width at once, from one cumulative sum per row
    (the scheduler's per-launch host work: every served step waits on it)."""
    surv = np.asarray(survival_RG, np.float64)
    cum_RG1 = np.concatenate([np.zeros((surv.shape[0], 1)), np.cumsum(surv, axis=1)], axis=1)
    caps = np.minimum(np.asarray(caps_R, np.int64), surv.shape[1])
    w_W = np.asarray(list(widths), np.int64)
    n_RW = np.minimum(w_W[None, :] - 1, caps[:, None])
    e_W = surv.shape[0] + np.take_along_axis(cum_RG1, n_RW, axis=1).sum(axis=0)
    return {int(w): float(e) for w, e in zip(w_W, e_W)}


def monotone_costs(costs: Mapping[tuple, float]) -> dict:
    """Make a measured cost table {(batch, width): seconds} non-decreasing in width and in batch: each entry
    becomes the least of itself and every entry of at least its batch and width (a lower envelope, suffix minima).

    Why from below: the widths the scheduler does not pick are not run again (but for a re-timing step now and
    then), so an error that lasts is a small step timed too slow, which a running maximum would copy into every
    larger step (a b = 1, W = 2 step warm-up timed at 14 ms priced the whole block, served at 11 ms, at 14); a step
    timed too fast is picked, served, and re-timed."""
    keys = sorted(costs)
    out = {}
    for b, w in keys:
        out[(b, w)] = min(float(costs[(b2, w2)]) for b2, w2 in keys if b2 >= b and w2 >= w)
    return out


class CostTable:
    """T(b, W): per (batch, width), the median of its last ``window`` step timings (warm_up's, then the steps
    served), made monotone (``monotone_costs``); ``table`` is what ``choose_width`` reads.

    A median, not a running mean: one step that waited on something else (a burst of host work, another
    process) is an outlier the median ignores, where a running mean would carry it until that width runs again,
    and a width that is not picked does not run again (the ninth session's load test: a b = 1 step timed across
    the prefills of fifteen arriving requests priced every width at 93 ms).

    Drift (``served=True`` observations): the machine's load moves every width's cost together (one process here
    timed b = 16, W = 4 at 29.9 and then 40.8 ms), but only the width being served is timed, so a width not run
    for a while kept a cost from another time and the comparison tilted (a W = 8 median risen to 8.7 ms against a
    stale W = 4 at 6.6 narrowed a c = 1 stream for nothing). When a served key's full window moves its median by a
    factor f and that key is the one running (most of its batch's last ``window`` observations), every stale key of
    the batch (none of those observations) is scaled by f too; a re-timing then corrects what is the width's own
    (and, not running, does not propagate). Warm-up's observations do not propagate (each key is timed in turn
    there, its first samples moving its median by large steps).

    Re-timing: a served observation of a key its batch has not run within its last ``window`` observations (a
    re-timing, or a width picked again after a while) cheaper than its price replaces its samples. They are
    from another time, and the drift rule carries only the running key's change, not how the widths' costs move
    against one another: warm-up times each program alone, not pipelined, and its ratios between widths were not
    the served ones (thirtieth session, in process at b = 1: warm-up's W = 8 at 1.44x W = 4, served 1.09x; at
    b = 16 a stale W = 1 at 10.5-11.0 ms against 9.7 served), while a lone re-timing sample moved a median of
    ``window`` stale ones not at all, so a width wrongly priced stayed so for ``window // 2 + 1`` re-timings, each
    a probe interval apart.

    Only a cheaper re-timing replaces; a dearer one joins the samples. One fresh sample can be an outlier, and the
    two errors are not alike: too cheap, the width runs and its own timings correct it within steps; too dear, the
    width is not picked, runs again only in re-timings, and kept the outlier as its whole price until the next one
    (thirty-second session, in process at b = 16 under sampled c = 16 traffic: W = 1 warmed up at 12.6 ms,
    re-timed at 18.0 and 16.9, then priced at 13.5-21.0 following W = 2's drift; W = 2 won on paper and the round
    ran at 0.93x off, where the next round, W = 1 re-timed back to ~12 ms, ran at 0.99x). A width whose cost truly
    rose against the others is priced up once most of its window is such re-timings (``window // 2 + 1``)."""

    def __init__(self, window: int = 9):
        if window < 1:
            raise ValueError(f"window: expected >= 1, got {window}")
        self.window = int(window)
        self.samples: dict = {}  # (batch, width) -> deque of seconds
        self.medians: dict = {}  # (batch, width) -> the median of its samples (only the observed key changes)
        self.table: dict = {}
        self.recent: dict = {}  # batch -> deque of the keys of its last ``window`` observations

    def __len__(self) -> int:
        return len(self.samples)

    def __contains__(self, key) -> bool:
        return key in self.samples

    def observe(self, key: tuple, seconds: float, *, served: bool = False) -> None:
        if not (seconds > 0 and np.isfinite(seconds)):
            raise ValueError(f"a step time must be a positive finite number of seconds, got {seconds}")
        key = tuple(key)
        b = key[0]
        samples = self.samples.setdefault(key, collections.deque(maxlen=self.window))
        recent = self.recent.setdefault(b, collections.deque(maxlen=self.window))
        if served and key not in recent and not (samples and seconds > self.medians[key]):
            samples.clear()  # a cheaper re-timing: what the key holds is from another time; the fresh one wins
        old = self.medians.get(key) if len(samples) == self.window else None
        samples.append(float(seconds))
        self.medians[key] = statistics.median(samples)  # every served step calls this: pure Python
        recent.append(key)
        running = recent.count(key) > self.window // 2  # most of the batch's latest steps: not a re-timing
        if served and running and old is not None and self.medians[key] != old:
            f = self.medians[key] / old
            for k in self.medians:
                if k[0] == b and k not in recent:
                    self.samples[k] = collections.deque((x * f for x in self.samples[k]), maxlen=self.window)
                    self.medians[k] *= f
        self.table = monotone_costs(self.medians)


def choose_width(survival_RG: np.ndarray, caps_R: np.ndarray, batch: int, widths: Sequence[int],
                 costs: Mapping[tuple, float]) -> tuple:
    """argmax_W sum_r E_r(W) / T(batch, W) over ``widths``. Returns (W, expected tokens, seconds)."""
    best = None
    expected = expected_by_width(survival_RG, caps_R, widths)
    for w in sorted(widths):
        if (batch, w) not in costs:
            raise KeyError(f"no measured cost for batch {batch} x width {w}; profile it first (warm_up)")
        e = expected[w]
        t = costs[(batch, w)]
        if best is None or e / t > best[1] / best[2] * (1 + 1e-9):
            best = (int(w), e, t)
    return best


def calibrated(survival_G: np.ndarray, ratio_G: np.ndarray) -> np.ndarray:
    """a'_k = min_{j <= k} clip(a_j * ratio_j, 0, 1): the confidence head's curve rescaled per position by the
    acceptance measured against it, kept non-increasing (a survival curve)."""
    s = np.clip(np.asarray(survival_G, np.float64) * np.asarray(ratio_G, np.float64), 0.0, 1.0)
    return np.minimum.accumulate(s)


class SurvivalTracker:
    """The survival curve each slot's next step is scheduled from: its last drafted block's, or for a slot that
    has none yet (new, or last stepped plainly) a prior, the running mean of every slot's recent curves.

    ``prior`` starts at ones (optimistic: a new server verifies whole blocks until it has measured acceptance);
    ``relax`` pulls a slot that decodes plainly back toward the prior, step by step, so a slot whose traffic got
    easier is tried again instead of staying plain forever.

    Calibration: the confidence head is trained toward acceptance, not guaranteed to match it on this traffic.
    Every verified block updates, per position k it verified, decayed sums of the predicted survival a_k and of
    the outcome [accepted > k]; ratio_k = (hits_k + 1) / (predicted_k + 1) rescales later curves (``calibrated``).
    The outcomes are those of finished steps, so a width chosen from them is still fixed before the next step's
    drafts are drawn (lossless under sampling). ``calibration_decay`` 0.998 (a window of ~500 blocks): with 0.95
    (~20 blocks) one hard prompt swung the tail ratios to ~0.2-0.5 and a served stream at b = 1 verified 4 tokens
    on 22-45% of its steps, 3-8% slower per token than the whole block; with 0.998 the ratios stay within
    0.83-1.02 of the head's and adaptive runs level with fixed (docs/serving.md).

    Refresh: a plain step drafts nothing, so it tells the tracker nothing; a slot that went plain on a pessimistic
    curve (and a prior and calibration pulled down by a hard stretch) would stay plain for good, since nothing it
    does can raise them. After a run of plain steps, ``needs_refresh`` asks the scheduler for a drafting width (the
    cheapest), whose drafts bring a fresh curve and outcome (continued past them by the prior's shape). The
    run's length is ``probe_interval`` of that width's extra cost (``next_width``; ``refresh_budget``, default
    ``PROBE_BUDGET``, 0 never refreshes), and at least ``refresh_min`` (a plain step is not second-guessed at once
    where drafting costs next to nothing). Replayed on the shipped pair's greedy blocks
    (``scripts/replay_adaptive.py``: 16 held-out code prompts, 617 whole-block steps, b = 1; docs/serving.md):
    without it the scheduler went plain for good partway through, 0.74-0.84x fixed; with it 1.04-1.17x fixed."""

    def __init__(self, num_slots: int, block_size: int, *, momentum: float = 0.9, relax: float = 0.25,
                 calibration_decay: float = 0.998, refresh_budget: float = PROBE_BUDGET, refresh_min: int = 8):
        if refresh_budget < 0:
            raise ValueError(f"refresh_budget: expected >= 0, got {refresh_budget}")
        if refresh_min < 1:
            raise ValueError(f"refresh_min: expected >= 1, got {refresh_min}")
        self.refresh_min = int(refresh_min)
        self.prior = np.ones(block_size)
        self.curve_SG = np.ones((num_slots, block_size))
        self.momentum, self.relax = float(momentum), float(relax)
        self.decay = float(calibration_decay)
        self.predicted_G, self.hits_G = np.zeros(block_size), np.zeros(block_size)
        self.refresh_budget = float(refresh_budget)
        self.plain_run_S = np.zeros(num_slots, np.int64)  # plain steps in a row per slot

    @property
    def ratio_G(self) -> np.ndarray:
        return (self.hits_G + 1.0) / (self.predicted_G + 1.0)

    def reset(self, slot: int) -> None:
        self.curve_SG[slot] = self.prior
        self.plain_run_S[slot] = 0

    def needs_refresh(self, slots: Sequence[int], after: float) -> bool:
        """Whether a slot of ``slots`` has stepped plainly ``after`` times in a row (see the class doc)."""
        return bool(np.any(self.plain_run_S[list(slots)] >= after))

    def observe(self, slot: int, survival_G: np.ndarray, drafted: int = None, accepted: int = None) -> None:
        """A slot's block: its survival curve, and (when given) how many drafts were verified and accepted.

        A step narrower than the block decodes only the drafts it verifies (``speculative.draft_block``), so its
        curve a_1..a_n may stop short of G: the rest continues it by the prior's conditional survival,
        a_k = a_n * prior_k / prior_n for k > n (what the slot's fresh head says so far, and the traffic's
        typical decay past it)."""
        raw = np.clip(np.asarray(survival_G, np.float64), 0.0, 1.0)
        n, G = raw.shape[0], self.prior.shape[0]
        if not 1 <= n <= G:
            raise ValueError(f"survival_G: expected 1..{G} positions, got {n}")
        if drafted is not None and accepted is not None and drafted > 0:
            d = min(int(drafted), n)
            self.predicted_G[:d] = self.decay * self.predicted_G[:d] + raw[:d]
            self.hits_G[:d] = self.decay * self.hits_G[:d] + (np.arange(d) < int(accepted))
        s = calibrated(raw, self.ratio_G[:n])
        if n < G:
            tail = s[-1] * self.prior[n:] / max(self.prior[n - 1], 1e-9)
            s = np.minimum.accumulate(np.clip(np.concatenate([s, tail]), 0.0, 1.0))
        self.curve_SG[slot] = s
        self.plain_run_S[slot] = 0
        self.prior = self.momentum * self.prior + (1 - self.momentum) * s

    def stepped_plain(self, slot: int) -> None:
        self.curve_SG[slot] += self.relax * (self.prior - self.curve_SG[slot])
        self.plain_run_S[slot] += 1


def next_width(tracker: SurvivalTracker, slots: Sequence[int], caps_R: np.ndarray, batch: int, widths: Sequence[int],
               costs: Mapping[tuple, float]) -> int:
    """The width of the next step of ``slots``: the cheapest drafting width when one of them needs a refresh (its
    verified drafts bring a fresh curve of the head and outcome, continued past them by the prior's shape,
    ``SurvivalTracker.observe``; after ``probe_interval`` of its extra cost over a plain step, at least
    ``refresh_min``), else ``choose_width`` over the tracker's curves."""
    cheapest = min(w for w in widths if w > 1)
    after = max(tracker.refresh_min,
                probe_interval(costs[(batch, cheapest)] / costs[(batch, 1)] - 1, tracker.refresh_budget))
    if tracker.needs_refresh(slots, after):
        return cheapest
    return choose_width(tracker.curve_SG[list(slots)], caps_R, batch, widths, costs)[0]
