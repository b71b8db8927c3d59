"""Per-row sampling parameters (a serving engine's slots) give each row exactly what the static setting gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.sampling import SamplingParams, accept, process_logits, sample

SETTINGS = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 5, 0.5, 0.0),
            (2.0, 1, 0.9, 0.0), (1.0, 12, 1.0, 0.0), (1.0, 0, 1.0, 0.2), (0.9, 4, 0.9, 0.1), (0.0, 0, 1.0, 0.5)]


def _logits(rows, V=12, seed=0):
    z = jax.random.normal(jax.random.key(seed), (rows, 4, V)) * 2.0
    return z.at[:, :, 3].set(z[:, :, 7])  # ties, so top-k keeps both


def test_process_logits_per_row_equals_static(sampling_form):
    z = _logits(len(SETTINGS))
    sp = SamplingParams.rows(*map(np.array, zip(*SETTINGS)))
    got = process_logits(z, sp)
    for r, s in enumerate(SETTINGS):
        want = process_logits(z[r], SamplingParams(*s))
        np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want), atol=1e-6, rtol=0)


def test_sample_and_accept_per_row_equal_static(sampling_form):
    V, G = 12, 3
    z = _logits(len(SETTINGS), V, seed=1)
    sp = SamplingParams.rows(*map(np.array, zip(*SETTINGS)))
    key = jax.random.key(4)
    toks = sample(key, z[:, 0], sp)
    for r, (t, *_) in enumerate(SETTINGS):
        if t == 0:
            assert int(toks[r]) == int(jnp.argmax(z[r, 0]))
    drafts = jnp.argmax(z[:, :G], -1).at[:, 1].set(0).astype(jnp.int32)
    logq = jax.vmap(lambda zz, t, k, p, m: process_logits(zz, SamplingParams.rows(t, k, p, m)))(
        z[:, :G] + 0.3, *map(jnp.asarray, zip(*SETTINGS)))
    target = z[:, :G + 1] if z.shape[1] >= G + 1 else z
    for r, s in enumerate(SETTINGS):
        kr = jax.random.fold_in(key, r)
        row = SamplingParams.rows(*s)
        got = accept(kr, drafts[r], logq[r], target[r], jnp.int32(G), row)
        want = accept(kr, drafts[r], logq[r], target[r], jnp.int32(G), SamplingParams(*s))
        assert (int(got[0]), int(got[1])) == (int(want[0]), int(want[1]))


def test_static_parameters_are_still_checked():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, 0, 0.0)


@pytest.mark.parametrize("settings", [SETTINGS, [(0.0, 0, 1.0, 0.0)] * 2,
                                      [(0.0, 4, 0.5, 0.3), (1.0, 0, 0.9, 0.0)],
                                      [(0.0, 0, 1.0, 0.0), (0.8, 3, 1.0, 0.0)],
                                      [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.2)]],
                         ids=["mixed", "all-greedy", "top-p-only-sampled", "top-k-only", "min-p-only"])
def test_batch_flags_under_vmap_equal_per_row(settings, sampling_form):
    """A mapped batch with ``batch`` flags taken outside the map (the engine's step) samples, processes and
    accepts exactly as the per-row parameters without them: the flags only skip work no row needs (a greedy
    row's top-k / top-p settings included)."""
    V, G = 12, 3
    rows = len(settings)
    z = _logits(rows, V, seed=2)
    t, k, p, m = (jnp.asarray(x) for x in zip(*settings))
    flags = SamplingParams.batch_flags(t, k, p, m)
    keys = jax.random.split(jax.random.key(7), rows)
    drafts = jnp.argmax(z[:, :G], -1).at[:, 1].set(0).astype(jnp.int32)

    def one(key, zr, dr, tr, kr, pr, mr, batch):
        sp = SamplingParams.rows(tr, kr, pr, mr, batch)
        logq = process_logits(zr[:G] + 0.3, sp)
        return (sample(key, zr[0], sp), process_logits(zr, sp),
                accept(key, dr, logq, zr, jnp.int32(G), sp))

    with_flags = jax.jit(jax.vmap(lambda *a: one(*a, flags)))(keys, z, drafts, t, k, p, m)
    without = jax.jit(jax.vmap(lambda *a: one(*a, None)))(keys, z, drafts, t, k, p, m)
    (tok_f, logq_f, acc_f), (tok, logq, acc) = with_flags, without
    np.testing.assert_array_equal(np.asarray(tok_f), np.asarray(tok))
    for a, b in zip(acc_f, acc):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sampled = np.asarray(t) > 0  # a greedy row's processed distribution is never read (argmax of the raw logits)
    np.testing.assert_array_equal(np.asarray(logq_f)[sampled], np.asarray(logq)[sampled])
    assert bool(flags[0]) == any(s[0] > 0 for s in settings)
    assert bool(flags[1]) == any(s[0] > 0 and s[1] > 0 for s in settings)
    assert bool(flags[2]) == any(s[0] > 0 and s[2] < 1 for s in settings)
    assert bool(flags[3]) == any(s[0] > 0 and s[3] > 0 for s in settings)
