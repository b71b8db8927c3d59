"""The adaptive-verification scheduler (jdspark.adaptive): expected committed tokens against a simulation of the
acceptance process it models, the width it picks against brute force, the monotone cost table, the tracker."""

import itertools

import numpy as np
import pytest

from jdspark.adaptive import (
    PROBE_BUDGET,
    CostTable,
    SurvivalTracker,
    choose_width,
    expected_by_width,
    expected_tokens,
    monotone_costs,
    next_width,
    probe_interval,
    retime_extra,
)


def test_expected_tokens_equals_a_simulated_acceptance_process():
    """Draft k is accepted with probability c_k given drafts 1..k-1 were (survival a_k = prod c_i); a step of width
    W commits the accepted prefix (at most W - 1 drafts, at most the row's cap) plus the bonus. 200k simulated
    steps per row; the mean is within 5 standard errors (false-failure rate < 1e-6 per row and width)."""
    rng = np.random.default_rng(0)
    c_RG = rng.uniform(0.3, 0.99, size=(3, 7))
    caps = np.array([7, 3, 0])
    surv = np.cumprod(c_RG, axis=1)
    n = 200_000
    for W in (1, 2, 4, 8):
        total = 0.0
        for r in range(3):
            ok = rng.random((n, 7)) < c_RG[r]
            run = np.cumprod(ok, axis=1).sum(axis=1)  # accepted prefix length of a whole block
            committed = 1 + np.minimum(run, min(W - 1, caps[r]))
            total += committed.mean()
            one = expected_tokens(surv[r:r + 1], caps[r:r + 1], W)
            assert abs(committed.mean() - one) < 5 * committed.std() / np.sqrt(n) + 1e-12, (W, r)
        assert expected_tokens(surv, caps, W) == pytest.approx(total, abs=0.02)
    assert expected_tokens(surv, caps, 1) == 3.0  # width 1: the bonus only


def test_expected_by_width_equals_expected_tokens_per_width():
    """The scheduler's one-pass form against the per-width definition, caps below, at and above the block."""
    rng = np.random.default_rng(5)
    surv = np.cumprod(rng.uniform(0.2, 1.0, size=(6, 7)), axis=1)
    caps = np.array([0, 1, 3, 7, 9, 7])
    widths = (1, 2, 3, 4, 6, 8)
    got = expected_by_width(surv, caps, widths)
    assert list(got) == list(widths)
    for w in widths:
        assert got[w] == pytest.approx(expected_tokens(surv, caps, w), rel=1e-12)


def test_choose_width_is_the_brute_force_argmax():
    rng = np.random.default_rng(1)
    widths = (1, 2, 4, 8)
    for _ in range(200):
        b = int(rng.integers(1, 5))
        surv = np.cumprod(rng.uniform(0, 1, size=(b, 7)) ** rng.uniform(0.1, 3), axis=1)
        caps = rng.integers(0, 8, size=b)
        costs = monotone_costs({(b, w): float(rng.uniform(0.5, 2.0)) * (1 + rng.uniform(0, 0.3) * w)
                                for w in widths})
        w, e, t = choose_width(surv, caps, b, widths, costs)
        rates = {v: expected_tokens(surv, caps, v) / costs[(b, v)] for v in widths}
        assert rates[w] == pytest.approx(max(rates.values())) and e / t == pytest.approx(rates[w])
    # the two extremes: drafts that never survive -> plain decoding; always survive at equal cost -> whole blocks
    flat = {(1, w): 1.0 for w in widths}
    assert choose_width(np.zeros((1, 7)), np.array([7]), 1, widths, flat)[0] == 1
    assert choose_width(np.ones((1, 7)), np.array([7]), 1, widths, flat)[0] == 8
    with pytest.raises(KeyError, match="batch 2 x width 1"):
        choose_width(np.ones((2, 7)), np.array([7, 7]), 2, widths, flat)


def test_monotone_costs():
    raw = {(1, 1): 1.0, (1, 2): 0.8, (1, 4): 1.5, (2, 1): 0.9, (2, 2): 2.0, (2, 4): 1.7}
    m = monotone_costs(raw)
    assert m == {(1, 1): 0.8, (1, 2): 0.8, (1, 4): 1.5, (2, 1): 0.9, (2, 2): 1.7, (2, 4): 1.7}
    for (b, w), (b2, w2) in itertools.product(m, m):
        if b <= b2 and w <= w2:
            assert m[(b, w)] <= m[(b2, w2)]
    ok = {(1, 1): 1.0, (1, 2): 2.0}
    assert monotone_costs(ok) == ok


def test_cost_table_is_the_median_of_recent_timings_made_monotone():
    """One slow step (a timing that waited on something else) does not move a width's cost; a lasting change
    does, once it holds most of the window; the table stays monotone; a bad timing is refused."""
    t = CostTable(window=5)
    for s in (1.0, 1.1, 0.9):
        t.observe((1, 1), s)
        t.observe((1, 8), 2 * s)
    assert t.table == {(1, 1): 1.0, (1, 8): 2.0} and (1, 8) in t and (2, 1) not in t and len(t) == 2
    t.observe((1, 8), 90.0)  # an outlier
    assert t.table[(1, 8)] == pytest.approx(2.1)  # median of 1.8, 2, 2.2, 90: between the middle two
    for _ in range(3):
        t.observe((1, 8), 0.5)  # the width got cheaper and stays so: 3 of the 5 latest samples
    # the median is 0.5; monotone from below: width 1 costs no more than the whole block
    assert t.table == {(1, 1): 0.5, (1, 8): 0.5}
    t.observe((1, 1), 0.2)
    t.observe((1, 1), 0.2)
    assert t.table == {(1, 1): 0.5, (1, 8): 0.5}  # width 1's median (0.2, 0.2, 0.9, 1.0, 1.1) = 0.9, capped
    t.observe((1, 1), 0.2)
    assert t.table == {(1, 1): 0.2, (1, 8): 0.5}
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            t.observe((1, 1), bad)
    with pytest.raises(ValueError, match="window"):
        CostTable(window=0)


def test_cost_table_carries_a_served_width_s_drift_to_widths_not_run():
    """The load moves every width's cost: when the running key's median (most of its batch's recent observations)
    rises by f, every stale key of its batch (none of them) scales by f, so the choice between them stays; a key
    observed recently keeps its own, another batch is untouched, warm-up's (unserved) observations do not
    propagate, and re-timings (one timed step now and then) correct a stale key without propagating."""
    t = CostTable(window=5)
    for w, c in ((1, 1.0), (4, 1.5), (8, 2.0)):
        for _ in range(5):
            t.observe((1, w), c)  # warm-up: each key in turn
    t.observe((2, 8), 5.0)
    assert t.table[(1, 4)] == 1.5 and t.table[(1, 1)] == 1.0  # unserved: nothing propagated
    surv, caps = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]]), np.array([7])
    before = choose_width(surv, caps, 1, (1, 4, 8), t.table)[0]
    for _ in range(5):
        t.observe((1, 8), 3.0, served=True)  # the machine got 1.5x slower while the whole block was served
    assert t.table[(1, 8)] == pytest.approx(3.0)
    assert t.table[(1, 4)] == pytest.approx(2.25) and t.table[(1, 1)] == pytest.approx(1.5)
    assert t.table[(2, 8)] == 5.0  # another batch bucket
    assert choose_width(surv, caps, 1, (1, 4, 8), t.table)[0] == before == 8
    stale = dict(t.table)  # without the drift, a stale W = 4 at 1.5 against W = 8 at 3.0 narrows the step
    stale[(1, 4)], stale[(1, 1)] = 1.5, 1.0
    assert choose_width(surv, caps, 1, (1, 4, 8), stale)[0] == 4
    for w in (4, 8, 8, 4, 8, 4):  # re-timings of W = 4 between served whole blocks: its own cost, 2.0
        t.observe((1, w), 2.0 if w == 4 else 3.0, served=True)
    assert t.table[(1, 4)] == pytest.approx(2.0) and t.table[(1, 1)] == pytest.approx(1.5)
    for _ in range(3):
        t.observe((1, 8), 4.0, served=True)  # W = 8's median 3.0 -> 4.0, W = 4 among the last 5 observations
    assert t.table[(1, 4)] == pytest.approx(2.0)  # recent: its own
    assert t.table[(1, 1)] == pytest.approx(2.0)  # stale: 1.5 x 4.0 / 3.0


def test_a_cheaper_re_timing_replaces_a_stale_key_s_samples_a_dearer_one_joins_them():
    """Warm-up priced W = 8 at 2x W = 4; served, the whole block costs 1.1x. One re-timing of W = 8 (its batch ran
    only W = 4 within the window) sets its price at once, where a median over its stale samples would have kept it
    until most of the window were re-timings; a key in the batch's recent observations joins its samples as before,
    and warm-up's (unserved) observations never replace. A dearer re-timing joins: one outlier does not price a
    width out (it would not run again to correct it), most of a window of them does."""
    t = CostTable(window=5)
    for w, c in ((4, 1.0), (8, 2.0)):
        for _ in range(5):
            t.observe((1, w), c)
    for _ in range(5):
        t.observe((1, 4), 1.0, served=True)  # W = 4 served at its warm-up price: nothing drifts
    assert t.table[(1, 8)] == pytest.approx(2.0)
    t.observe((1, 8), 1.1, served=True)  # the re-timing
    assert t.table[(1, 8)] == pytest.approx(1.1)
    surv, caps = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]]), np.array([7])
    assert choose_width(surv, caps, 1, (4, 8), t.table)[0] == 8  # (1 + 4.2) / 1.1 against (1 + 2.4) / 1.0
    t.observe((1, 8), 3.0, served=True)  # recent now: one outlier joins the fresh sample, median between them
    assert t.table[(1, 8)] == pytest.approx(2.05)
    t.observe((1, 8), 1.2)  # unserved: joins
    assert t.table[(1, 8)] == pytest.approx(1.2)

    t = CostTable(window=5)
    for w, c in ((1, 1.0), (2, 1.5)):
        for _ in range(5):
            t.observe((1, w), c)
    surv, caps = np.array([[0.3] * 7]), np.array([7])  # W = 1 (1 token) beats W = 2 (1.3) unless dearer than 1.3x
    for dear in range(3):
        for _ in range(5):
            t.observe((1, 2), 1.5, served=True)  # W = 2 served, nothing drifts: W = 1 is stale again
        t.observe((1, 1), 1.6, served=True)  # a dear re-timing of W = 1
        if dear < 2:
            assert t.table[(1, 1)] == pytest.approx(1.0)  # joined: the median of (1.0 x 4 - dear, 1.6 x dear + 1)
            assert choose_width(surv, caps, 1, (1, 2), t.table)[0] == 1
    assert t.table[(1, 1)] == pytest.approx(1.5)  # three of five: 1.6, capped by W = 2's 1.5 (monotone)
    assert choose_width(surv, caps, 1, (1, 2), t.table)[0] == 2


def test_tracker():
    tr = SurvivalTracker(2, 3, momentum=0.5, relax=0.5)
    assert (tr.curve_SG == 1).all()
    tr.observe(0, np.array([0.5, 0.2, 0.1]))
    np.testing.assert_allclose(tr.curve_SG[0], [0.5, 0.2, 0.1])
    np.testing.assert_allclose(tr.prior, [0.75, 0.6, 0.55])
    tr.stepped_plain(0)  # halfway back to the prior
    np.testing.assert_allclose(tr.curve_SG[0], [0.625, 0.4, 0.325])
    tr.reset(1)
    np.testing.assert_allclose(tr.curve_SG[1], tr.prior)


def test_tracker_continues_a_narrow_step_s_curve_by_the_prior_s_shape():
    """A narrow step decodes only the drafts it verifies, so its curve stops short of the block: past it the
    slot's curve is a_n * prior_k / prior_n (kept a non-increasing survival curve), and calibration counts only
    the positions verified."""
    tr = SurvivalTracker(2, 4, momentum=0.5, calibration_decay=1.0)
    tr.prior = np.array([0.8, 0.6, 0.3, 0.15])
    tr.observe(0, np.array([0.4]), drafted=1, accepted=1)
    a1 = 0.4 * (1 + 1) / (0.4 + 1)  # calibrated by position 1's ratio (hits + 1) / (predicted + 1)
    np.testing.assert_allclose(tr.curve_SG[0], [a1, a1 * 0.6 / 0.8, a1 * 0.3 / 0.8, a1 * 0.15 / 0.8])
    np.testing.assert_allclose(tr.hits_G, [1, 0, 0, 0])
    np.testing.assert_allclose(tr.predicted_G, [0.4, 0, 0, 0])
    tr.prior = np.array([0.5, 0.6, 0.6, 0.1])  # not a survival curve: the continuation is clipped and made monotone
    tr.observe(1, np.array([0.9, 0.8]))
    c = tr.curve_SG[1]
    assert (np.diff(c) <= 0).all() and (c >= 0).all() and (c <= 1).all() and c[2] == c[1]
    with pytest.raises(ValueError, match="survival_G: expected 1..4 positions"):
        tr.observe(0, np.ones(5))


def test_tracker_asks_for_a_drafting_step_after_a_run_of_plain_ones():
    """A plain step brings no curve: after a run of them a slot needs a drafting width (one slot is enough for the
    step); a drafted block, or a new request, starts the count again. The run's length is ``probe_interval`` of
    the cheapest drafting width's extra cost, so refreshing costs PROBE_BUDGET of the time at every batch."""
    tr = SurvivalTracker(3, 4)
    for _ in range(2):
        tr.stepped_plain(0)
        tr.stepped_plain(1)
    assert not tr.needs_refresh([0, 1, 2], after=3)
    tr.stepped_plain(1)
    assert tr.needs_refresh([0, 1], 3) and tr.needs_refresh([1], 3) and not tr.needs_refresh([0, 2], 3)
    tr.observe(1, np.array([0.5, 0.2, 0.1, 0.0]), drafted=1, accepted=0)
    assert not tr.needs_refresh([0, 1, 2], 3)
    for _ in range(3):
        tr.stepped_plain(2)
    assert tr.needs_refresh([2], 3)
    tr.reset(2)
    assert not tr.needs_refresh([2], 3)
    with pytest.raises(ValueError, match="refresh_budget"):
        SurvivalTracker(1, 4, refresh_budget=-0.1)
    with pytest.raises(ValueError, match="refresh_min"):
        SurvivalTracker(1, 4, refresh_min=0)
    # the interval: ceil(extra / budget); a budget of 0 never probes
    assert probe_interval(0.2, 0.02) == 10 and probe_interval(1.2, 0.02) == 60 and probe_interval(0.0) == 1
    assert probe_interval(5.0, 0.0) == float("inf")
    with pytest.raises(ValueError, match="budget"):
        probe_interval(1.0, -1.0)
    # the scheduler's pick: choose_width over the curves, or the cheapest drafting width for a refresh; a drafting
    # step costing 0.5 plain steps more (2 -> 3 s) refreshes after ceil(0.5 / PROBE_BUDGET) plain steps
    costs = {(1, w): 1.0 + w for w in (1, 2, 4)}
    after = probe_interval(costs[(1, 2)] / costs[(1, 1)] - 1)
    assert after == int(np.ceil(0.5 / PROBE_BUDGET))
    tr.reset(0)
    tr.curve_SG[:] = 0.01  # plain pays
    picks = []
    for _ in range(after + 1):
        picks.append(next_width(tr, [0], np.array([3]), 1, (1, 2, 4), costs))
        if picks[-1] == 1:
            tr.stepped_plain(0)
        tr.curve_SG[:] = 0.01
    assert picks == [1] * after + [2]
    # at a batch where drafting costs more, the run is longer
    costs16 = {(16, 1): 1.0, (16, 2): 2.2, (16, 4): 3.0}
    tr.reset(0)
    tr.curve_SG[:] = 0.01
    for _ in range(after):
        tr.stepped_plain(0)
        tr.curve_SG[:] = 0.01
    assert next_width(tr, [0], np.array([3]), 16, (1, 2, 4), costs16) == 1
    # drafting at no extra cost: still not before refresh_min plain steps
    free = {(1, w): 1.0 for w in (1, 2, 4)}
    tr.reset(0)
    for n in range(tr.refresh_min):
        tr.curve_SG[:] = 0.0  # drafts never survive: only a refresh drafts
        assert next_width(tr, [0], np.array([3]), 1, (1, 2, 4), free) == 1, n
        tr.stepped_plain(0)
    tr.curve_SG[:] = 0.0
    assert next_width(tr, [0], np.array([3]), 1, (1, 2, 4), free) == 2
    never = SurvivalTracker(1, 4, refresh_budget=0.0)
    never.curve_SG[:] = 0.01
    never.plain_run_S[:] = 10 ** 6
    assert next_width(never, [0], np.array([3]), 1, (1, 2, 4), costs) == 1


def test_tracker_calibrates_an_overconfident_head():
    """A head that predicts survival 0.9^k while drafts survive at 0.5^k: after enough verified blocks the curves
    the scheduler reads are the measured ones (within the pseudo-count's pull), non-increasing, and a position
    never verified keeps the head's own value."""
    rng = np.random.default_rng(0)
    G = 4
    tr = SurvivalTracker(1, G, calibration_decay=0.999)
    head = 0.9 ** np.arange(1, G + 1)
    for _ in range(3000):
        accepted = 0
        while accepted < 3 and rng.random() < 0.5:  # only 3 of the 4 positions verified (a width-4 step)
            accepted += 1
        tr.observe(0, head, drafted=3, accepted=accepted)
    got = tr.curve_SG[0]
    np.testing.assert_allclose(got[:3], 0.5 ** np.arange(1, 4), atol=0.03)
    assert np.all(np.diff(got) <= 0)
    assert got[3] <= got[2]  # the unverified position: the head's value (0.66) capped by the curve before it
    # the width this drives: against a table where the whole block costs 2x a plain step, the calibrated curve
    # (E(5) ~ 1.9 tokens) no longer pays for W = 5
    costs = {(1, 1): 1.0, (1, 5): 2.0}
    assert choose_width(head[None], np.array([G]), 1, (1, 5), costs)[0] == 5
    assert choose_width(got[None], np.array([G]), 1, (1, 5), costs)[0] == 1


def test_retime_extra_prices_a_step_against_the_width_the_scheduler_would_run():
    """A narrower width than the scheduler's pick costs the tokens it does not verify, a wider one its extra time;
    the pick itself costs nothing more."""
    e = {1: 1.0, 2: 1.8, 4: 2.9, 8: 3.4}
    flat = {1: 6.0, 2: 6.0, 4: 6.0, 8: 6.0}  # b = 1 on two cores: every width costs about a step
    assert retime_extra(e, flat, 8) == 0.0
    assert retime_extra(e, flat, 1) == pytest.approx(1 - 1.0 / 3.4)
    assert retime_extra(e, flat, 4) == pytest.approx(1 - 2.9 / 3.4)
    steep = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}  # b = 16: a whole block costs 8 plain steps, the pick is plain
    assert retime_extra(e, steep, 1) == 0.0
    assert retime_extra(e, steep, 8) == pytest.approx(80.0 / 10.0 - 3.4 / 1.0)
