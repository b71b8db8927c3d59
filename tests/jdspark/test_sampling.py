"""jdspark.sampling against the NumPy reference written from the definitions (tests/jdspark/sampling_ref.py):
process_logits (temperature, top-k with ties, min-p, top-p), accept_greedy, and accept_rejection (acceptance
probability, the residual a rejected draft is replaced from, p == q, drafts past n_verify).

Statistical checks: Pearson chi-square / binomial tests at ALPHA = 1e-4 each, fixed seeds; each test makes at most
8 such checks, so a correct implementation fails a test with probability <= 8e-4 over the choice of seeds.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from jdspark.sampling import (
    SamplingParams,
    _draw_blocks,
    accept_greedy,
    accept_rejection,
    draw,
    process_logits,
    propose,
)
from kimi import dispatch
from tests.jdspark import sampling_ref as ref

ALPHA = 1e-4
SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.5, 4, 0.8, 0.0),
            (1.3, 0, 0.5, 0.0), (2.0, 7, 0.95, 0.0), (0.9, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 3, 0.9, 0.3),
            (1.0, 0, 1.0, 1.0)]


def _rows(seed: int, R: int = 64, V: int = 16) -> np.ndarray:
    """Half continuous logits, half small integers (many exact ties, in logits and in probabilities)."""
    rng = np.random.default_rng(seed)
    cont = rng.normal(0, 2, (R // 2, V))
    ties = rng.integers(-2, 3, (R // 2, V)).astype(np.float64)
    return np.concatenate([cont, ties]).astype(np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_process_logits_matches_the_reference(temperature, top_k, top_p, min_p, sampling_form):
    """Static and per-row parameters (the rows all alike) against the reference; min-p removes tokens the other
    filters keep (rows at its bound by rounding excluded, as at top-p's)."""
    logits = _rows(int(temperature * 10) + top_k + int(100 * min_p))
    want = ref.process(logits, temperature, top_k, top_p, min_p)
    decided = (ref.top_p_margin(logits, temperature, top_k, top_p, min_p) > 1e-5 if top_p < 1 or min_p > 0
               else np.ones(len(logits), bool))
    assert decided.mean() > 0.9  # rows within rounding of the top-p / min-p boundary are few (and not compared)
    R = len(logits)
    for sp in (SamplingParams(temperature, top_k, top_p, min_p),
               SamplingParams.rows(*(np.full(R, x) for x in (temperature, top_k, top_p, min_p)))):
        got = np.exp(np.asarray(process_logits(jnp.asarray(logits), sp)))
        np.testing.assert_array_equal(got[decided] > 0, want[decided] > 0, err_msg="kept sets differ")
        np.testing.assert_allclose(got[decided], want[decided], atol=2e-6, rtol=1e-5)
    if top_k and top_p == 1.0 and min_p == 0:  # ties at the k-th value are kept: some rows keep more than k tokens
        assert ((want > 0).sum(-1) > top_k).any()
    if min_p > 0:  # min-p bites: fewer tokens than without it; at 1, only the largest (and ties with it)
        without = ref.process(logits, temperature, top_k, top_p)
        assert ((want > 0).sum(-1) < (without > 0).sum(-1)).mean() > 0.25
        if min_p == 1.0:
            np.testing.assert_array_equal(want > 0, logits == logits.max(-1, keepdims=True))


@pytest.mark.parametrize("logits,top_k,top_p,kept", [
    ([3, 3, 3, 1, 0], 2, 1.0, [0, 1, 2]),  # a 3-way tie at the 2nd largest: all kept
    ([1, 1, 1, 1], 0, 0.5, [0, 1]),  # mass reaches 0.5 exactly at 2 tokens; ties by smaller index
    ([1, 1, 1, 1], 0, 0.51, [0, 1, 2]),
    ([0, 5, 0, 5], 0, 0.4, [1]),  # two tied maxima, each ~0.497: one reaches 0.4, the smaller index
    ([2, 0, 2, 0, 2], 2, 0.5, [0, 2]),  # top-k keeps the 3 tied; top-p then takes 2 of them (1/3 each)
])
def test_top_k_top_p_ties(logits, top_k, top_p, kept, sampling_form):
    z = np.asarray([logits], np.float32)
    want = ref.process(z, 1.0, top_k, top_p)[0]
    got = np.exp(np.asarray(process_logits(jnp.asarray(z), SamplingParams(1.0, top_k, top_p))))[0]
    assert np.flatnonzero(want).tolist() == kept
    assert np.flatnonzero(got > 0).tolist() == kept
    np.testing.assert_allclose(got, want, atol=1e-6)


def _wide_rows(V: int = 300) -> np.ndarray:
    """Rows wider than top-p's fast path (its 64 most likely tokens): peaked rows (the nucleus among them), flat
    rows (the nucleus past them: the bisection), and integer rows with many ties at the boundary, in both."""
    rng = np.random.default_rng(11)
    peaked = rng.normal(0, 4, (8, V))
    flat = rng.normal(0, 0.3, (8, V))
    ties_flat = rng.integers(-1, 2, (8, V)).astype(np.float64)
    ties_peaked = ties_flat * 3 + (np.arange(V) < 5) * 9
    return np.concatenate([peaked, flat, ties_flat, ties_peaked]).astype(np.float32)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (100, 0.95), (7, 1.0)])
def test_wide_vocabulary_nucleus_and_top_k_match_the_reference_static_and_per_row(top_k, top_p, sampling_form):
    """Both ways top-p finds its boundary (among the 64 largest, or by bisection over all of them) and the
    per-row top-k's bisection keep exactly the reference's tokens, ties included."""
    logits = _wide_rows()
    want = ref.process(logits, 1.0, top_k, top_p)
    decided = ref.top_p_margin(logits, 1.0, top_k, top_p) > 1e-5 if top_p < 1 else np.ones(len(logits), bool)
    assert decided.mean() > 0.9
    kept = (want > 0).sum(-1)
    if top_p < 1 and top_k == 0:
        assert (kept[decided] > 64).any() and (kept[decided] <= 64).any()  # both paths are taken
    R = len(logits)
    for sp in (SamplingParams(1.0, top_k, top_p), SamplingParams.rows(np.ones(R), np.full(R, top_k),
                                                                      np.full(R, top_p))):
        got = np.exp(np.asarray(process_logits(jnp.asarray(logits), sp)))
        np.testing.assert_array_equal(got[decided] > 0, want[decided] > 0, err_msg="kept sets differ")
        np.testing.assert_allclose(got[decided], want[decided], atol=2e-6, rtol=1e-5)


def test_draw_follows_the_weights(sampling_form):
    """draw: index frequencies against the normalised weights (Pearson, ALPHA each, 2 checks), zero weights never
    drawn, for a support within the 64 candidates of the fast path and for a wider one (all V)."""
    rng = np.random.default_rng(12)
    V, N = 300, 40000
    w = rng.gamma(0.5, 1.0, (2, V))
    w[0, 50:] = 0.0  # 50 candidates: the top-k path
    w[1, ::2] = 0.0  # 150: Gumbel noise for all V
    logw = np.where(w > 0, np.log(np.maximum(w, 1e-300)), -np.inf).astype(np.float32)
    keys = jax.random.split(jax.random.key(13), N)
    for r in range(2):
        got = np.asarray(jax.jit(jax.vmap(lambda k: draw(k, jnp.asarray(logw[r:r + 1]))[0]))(keys))
        counts = np.bincount(got, minlength=V)
        assert counts[w[r] == 0].sum() == 0
        assert ref.pearson_pvalue(counts, w[r] / w[r].sum()) > ALPHA, r


def test_draw_blocks_follows_the_weights():
    """_draw_blocks (block, then index within it): frequencies against the normalised weights (Pearson, ALPHA
    each, 2 checks) on a vocabulary that is not a multiple of the block, whole blocks of zero weight included."""
    rng = np.random.default_rng(21)
    V, N = 300, 40000
    w = rng.gamma(0.5, 1.0, (2, V))
    w[0, 64:192] = 0.0  # two whole blocks empty
    w[1, 1::3] = 0.0
    logw = np.where(w > 0, np.log(np.maximum(w, 1e-300)), -np.inf).astype(np.float32)
    keys = jax.random.split(jax.random.key(22), N)
    for r in range(2):
        got = np.asarray(jax.jit(jax.vmap(lambda k: _draw_blocks(k, jnp.asarray(logw[r]))))(keys))
        counts = np.bincount(got, minlength=V)
        assert counts[w[r] == 0].sum() == 0
        assert ref.pearson_pvalue(counts, w[r] / w[r].sum()) > ALPHA, r


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_propose_draws_its_q_a_near_nucleus_of_the_processed_distribution(temperature, top_k, top_p, min_p):
    """propose: q holds >= top_p of the tempered, top-k- and min-p-masked mass and contains process_logits's
    nucleus (so it is process_logits's distribution when top_p = 1), per-row parameters give the static rows' q
    and greedy rows their argmax, and the drawn tokens follow q (Pearson, ALPHA)."""
    V = 300
    z = np.random.default_rng(31).normal(0, 2, (4, V)).astype(np.float32)
    sp = SamplingParams(temperature, top_k, top_p, min_p)
    _, logq = propose(jax.random.key(0), jnp.asarray(z), sp)
    q = np.exp(np.asarray(logq))
    want = np.exp(np.asarray(process_logits(jnp.asarray(z), sp)))
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert np.all((q > 0) >= (want > 0))  # the nucleus is inside q's support
    tk = np.exp(np.asarray(process_logits(jnp.asarray(z), SamplingParams(temperature, top_k, 1.0, min_p))))
    kept = np.where(q > 0, tk, 0.0).sum(-1)
    assert np.all(kept >= top_p - 1e-5), kept
    if top_p == 1.0:
        np.testing.assert_allclose(q, want, atol=1e-6)
    rows = SamplingParams.rows([temperature, 0.0, temperature, temperature], [top_k] * 4, [top_p] * 4, [min_p] * 4)
    tok_r, logq_r = propose(jax.random.key(0), jnp.asarray(z), rows)
    np.testing.assert_allclose(np.exp(np.asarray(logq_r))[[0, 2, 3]], q[[0, 2, 3]], atol=1e-6)
    assert int(tok_r[1]) == int(z[1].argmax())
    keys = jax.random.split(jax.random.key(32), 20000)
    got = np.asarray(jax.jit(jax.vmap(lambda k: propose(k, jnp.asarray(z[0]), sp)[0]))(keys))
    counts = np.bincount(got, minlength=V)
    assert counts[q[0] == 0].sum() == 0
    if (q[0] > 0).sum() > 1:  # top_k 1: one token, drawn every time (checked just above)
        assert ref.pearson_pvalue(counts, q[0]) > ALPHA


# ---------------------------------------------------------------------------------------------------- greedy
def test_accept_greedy_is_the_longest_matching_prefix_capped_by_n_verify():
    rng = np.random.default_rng(0)
    G, V = 5, 6
    for _ in range(200):
        logits = rng.normal(size=(G + 1, V)).astype(np.float32)
        am = logits.argmax(-1)
        drafts = np.where(rng.random(G) < 0.7, am[:G], rng.integers(0, V, G)).astype(np.int32)
        n_verify = int(rng.integers(0, G + 1))
        m = 0
        while m < n_verify and drafts[m] == am[m]:
            m += 1
        n_acc, bonus = accept_greedy(jnp.asarray(drafts), jnp.asarray(logits), jnp.int32(n_verify))
        assert (int(n_acc), int(bonus)) == (m, int(am[m])), (drafts, am, n_verify)


def test_accept_greedy_never_accepts_past_n_verify():
    """Drafts all right, verification truncated to n: exactly n accepted, the bonus is the target's token n."""
    logits = np.eye(6, dtype=np.float32)[[3, 1, 4, 1, 5]]  # argmax 3 1 4 1 5
    drafts = jnp.asarray([3, 1, 4, 1], jnp.int32)
    for n in range(5):
        n_acc, bonus = accept_greedy(drafts, jnp.asarray(logits), jnp.int32(n))
        assert (int(n_acc), int(bonus)) == (n, [3, 1, 4, 1, 5][n])


# ---------------------------------------------------------------------------------------------------- rejection
@functools.lru_cache(maxsize=None)
def _vmapped_rejection(sp: SamplingParams, form: str):
    """A compiled, mapped accept_rejection per (setting, ``dispatch.sampling_form``)."""
    f = lambda k, d, lq, lt, n: accept_rejection(k, d, lq, lt, n, sp)  # noqa: E731
    return jax.jit(jax.vmap(f, in_axes=(0, 0, None, None, None)))


def _run_rejection(key_seed, drafts_ND, logq_GV, logits_G1V, n_verify, sp):
    keys = jax.random.split(jax.random.key(key_seed), drafts_ND.shape[0])
    run = _vmapped_rejection(sp, dispatch.sampling_form())
    n_acc, nxt = run(keys, jnp.asarray(drafts_ND, jnp.int32), jnp.asarray(logq_GV), jnp.asarray(logits_G1V),
                     jnp.int32(n_verify))
    return np.asarray(n_acc), np.asarray(nxt)


def _binom_ok(k: int, n: int, p: float) -> bool:
    return sps.binomtest(k, n, p).pvalue > ALPHA


SP = SamplingParams(0.8, 0, 0.9)


def test_rejection_accepts_with_min_1_p_over_q_and_resamples_from_the_residual(sampling_form):
    """One draft slot, the draft fixed at a token q over-proposes: accepted with probability p(d)/q(d); when
    rejected the token follows norm(max(p - q, 0)) (never d, never a token with p <= q); when accepted the bonus
    follows p at the next position."""
    rng = np.random.default_rng(1)
    V, N = 6, 40000
    logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    p = ref.process(logits, SP.temperature, SP.top_k, SP.top_p)
    q = 0.5 * p[0] + 0.5 * rng.dirichlet(np.ones(V))  # mass also where p is 0 (outside the nucleus)
    d = int(np.argmax(np.where(p[0] > 0, q / np.maximum(p[0], 1e-30), 0)))  # q(d) > p(d) > 0: may be rejected
    assert 0.05 < ref.accept_probability(p[0], q, d) < 0.95
    logq = np.log(np.maximum(q, 1e-38)).astype(np.float32)[None]
    logq[q[None] == 0] = -np.inf
    n_acc, nxt = _run_rejection(2, np.full((N, 1), d), logq, logits, 1, SP)
    acc = n_acc == 1
    assert _binom_ok(int(acc.sum()), N, ref.accept_probability(p[0], q, d)), acc.mean()
    assert ref.pearson_pvalue(np.bincount(nxt[~acc], minlength=V), ref.residual(p[0], q)) > ALPHA
    assert ref.pearson_pvalue(np.bincount(nxt[acc], minlength=V), p[1]) > ALPHA


def test_rejection_output_follows_p_at_every_slot():
    """Drafts drawn from q, p fixed per slot (a context-free target): the token emitted at slot j (an accepted
    draft, the replacement after a rejection, or the bonus at j = G) follows p_j, given the step reached slot j."""
    rng = np.random.default_rng(3)
    G, V, N = 3, 5, 40000
    logits = rng.normal(0, 1.2, (G + 1, V)).astype(np.float32)
    qlogits = (logits[:G] + rng.normal(0, 1.2, (G, V))).astype(np.float32)
    sp = SamplingParams(1.0, 4, 1.0)
    p = ref.process(logits, 1.0, 4, 1.0)
    q = ref.process(qlogits, 1.0, 4, 1.0)
    drafts = np.stack([rng.choice(V, N, p=q[j]) for j in range(G)], 1)
    logq = np.asarray(process_logits(jnp.asarray(qlogits), sp))
    n_acc, nxt = _run_rejection(4, drafts, logq, logits, G, sp)
    emitted = np.concatenate([drafts, np.zeros((N, 1), int)], 1)
    emitted[np.arange(N), n_acc] = nxt
    hist = np.bincount(n_acc, minlength=G + 1)
    assert (hist > 100).all(), hist  # every accepted length happens
    for j in range(G + 1):
        reached = n_acc >= j
        assert ref.pearson_pvalue(np.bincount(emitted[reached, j], minlength=V), p[j]) > ALPHA, j


def test_rejection_with_p_equal_q_accepts_every_verified_draft():
    """q == p (processed alike): every verified draft is accepted, whatever the keys; with n_verify < G the drafts
    after it count as not drafted and the next token follows p at position n_verify (a bonus, not a residual)."""
    rng = np.random.default_rng(5)
    G, V, N = 4, 7, 10000
    logits = rng.normal(0, 1.0, (G + 1, V)).astype(np.float32)
    sp = SamplingParams(1.0, 0, 0.95)
    logp = np.asarray(process_logits(jnp.asarray(logits), sp))
    p = ref.process(logits, 1.0, 0, 0.95)
    drafts = np.stack([rng.choice(V, N, p=p[j]) for j in range(G)], 1)
    for n_verify in (G, 2, 0):
        n_acc, nxt = _run_rejection(6 + n_verify, drafts, logp[:G], logits, n_verify, sp)
        assert (n_acc == n_verify).all(), np.bincount(n_acc)
        assert ref.pearson_pvalue(np.bincount(nxt, minlength=V), p[n_verify]) > ALPHA, n_verify


def test_rejection_never_accepts_past_n_verify():
    """q == p but verification truncated at n: drafts past n are never accepted (counted as drafted only up to n),
    and a rejection inside the verified drafts still resamples from the residual."""
    rng = np.random.default_rng(7)
    G, V, N = 4, 5, 20000
    logits = rng.normal(0, 1.0, (G + 1, V)).astype(np.float32)
    sp = SamplingParams(1.0, 0, 1.0)
    p = ref.process(logits, 1.0, 0, 1.0)
    q = p.copy()
    q[1] = ref.process(rng.normal(0, 1.0, (1, V)), 1.0, 0, 1.0)[0]  # slot 1 can be rejected
    drafts = np.stack([rng.choice(V, N, p=q[j]) for j in range(G)], 1)
    logq = np.array(process_logits(jnp.asarray(logits[:G]), sp))  # q == p to the bit where they agree
    logq[1] = np.log(q[1])
    n_acc, nxt = _run_rejection(8, drafts, logq, logits, 2, sp)
    assert n_acc.max() == 2 and n_acc.min() == 1  # slot 0 always passes (q = p), slot 2 is never verified
    rej = n_acc == 1
    assert ref.pearson_pvalue(np.bincount(nxt[rej], minlength=V), ref.residual(p[1], q[1])) > ALPHA
    assert ref.pearson_pvalue(np.bincount(nxt[~rej], minlength=V), p[2]) > ALPHA
