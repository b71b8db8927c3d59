"""jdspark.unlikelihood (sequence-level unlikelihood) against slow references, and the fine-tuning script's batched
greedy decoder against ``jdspark.generate``'s plain decoding."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.unlikelihood import P_MAX_GAP, repeated_ngram_mask, unlikelihood_loss

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mask_reference(row, start, n):
    """Position t is marked iff some n-gram occurrence k in [start, T - n] with k <= t < k + n has an equal n-gram
    starting at some k' in [start, k) (straight from the definition, O(T^3))."""
    T = len(row)
    out = np.zeros(T, bool)
    for t in range(start, T):
        for k in range(max(start, t - n + 1), min(t, T - n) + 1):
            if any(row[k2:k2 + n] == row[k:k + n] for k2 in range(start, k)):
                out[t] = True
    return out


def test_repeated_ngram_mask_marks_later_occurrences_only():
    ids = np.array([[9, 1, 2, 3, 1, 2, 3, 4]])
    np.testing.assert_array_equal(repeated_ngram_mask(ids, 1, 3)[0], [0, 0, 0, 0, 1, 1, 1, 0])
    # what the prompt (before start) holds is not a repeat: the same row with the loop inside the prompt
    np.testing.assert_array_equal(repeated_ngram_mask(ids, 4, 3)[0], [0] * 8)


def test_repeated_ngram_mask_matches_the_definition():
    rng = np.random.default_rng(0)
    for trial in range(60):
        T, n, start = int(rng.integers(4, 40)), int(rng.integers(1, 5)), int(rng.integers(0, 6))
        ids = rng.integers(0, 3, size=(2, T))  # a small alphabet: plenty of repeats
        got = repeated_ngram_mask(ids, min(start, T), n)
        for b in range(2):
            np.testing.assert_array_equal(got[b], _mask_reference(ids[b].tolist(), min(start, T), n),
                                          err_msg=f"trial {trial}")


def test_repeated_ngram_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="ids_BT"):
        repeated_ngram_mask(np.zeros(5, int), 0, 2)
    with pytest.raises(ValueError, match="n: expected"):
        repeated_ngram_mask(np.zeros((1, 5), int), 0, 0)
    with pytest.raises(ValueError, match="start"):
        repeated_ngram_mask(np.zeros((1, 5), int), 6, 2)


def test_unlikelihood_loss_matches_numpy_and_stays_finite():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    logits[0, 0, 4] = 60.0  # p(4) rounds to 1 in fp32: clipped, finite
    targets = rng.integers(0, 7, size=(2, 5))
    targets[0, 0] = 4
    mask = rng.random((2, 5)) < 0.6
    mask[0, 0] = True
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pt = np.minimum(np.take_along_axis(p, targets[..., None], -1)[..., 0], 1 - P_MAX_GAP)
    want = -(np.log1p(-pt.astype(np.float64)) * mask).sum() / mask.size
    got = float(unlikelihood_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask)))
    assert np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    got_c = float(unlikelihood_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), count=3))
    np.testing.assert_allclose(got_c, want * mask.size / 3, rtol=1e-4)


def test_unlikelihood_gradient_lowers_only_the_marked_tokens():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, 4, 6)).astype(np.float32))
    targets = jnp.asarray([[1, 2, 3, 4]])
    mask = jnp.asarray([[True, False, True, False]])
    g = jax.grad(unlikelihood_loss)(logits, targets, mask)
    np.testing.assert_array_equal(np.asarray(g[0, 1]), 0.0)  # unmarked positions get no gradient
    np.testing.assert_array_equal(np.asarray(g[0, 3]), 0.0)
    after = jax.nn.softmax(logits - 1.0 * g, axis=-1)
    before = jax.nn.softmax(logits, axis=-1)
    for t in (0, 2):
        assert float(after[0, t, targets[0, t]]) < float(before[0, t, targets[0, t]])


@pytest.fixture(scope="module")
def ul_script():
    sys.path.insert(0, os.path.join(_ROOT, "scripts"))
    spec = importlib.util.spec_from_file_location("train_unlikelihood",
                                                  os.path.join(_ROOT, "scripts", "train_unlikelihood.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_greedy_continue_equals_plain_generate(ul_script):
    """The fine-tuning's batched greedy continuations are the model's own greedy decoding, row by row."""
    from flax import nnx

    from jdspark.generation import generate
    from kimi import KimiConfig, KimiForCausalLM

    cfg = KimiConfig.tiny()
    model = KimiForCausalLM(cfg, rngs=nnx.Rngs(3))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, cfg.vocab_size, size=(3, 16)).astype(np.int32)
    got = np.asarray(ul_script.greedy_continue(params, frozen, jnp.asarray(prefix), graphdef=graphdef, length=12))
    assert got.shape == (3, 12)
    for b in range(3):
        want = generate(model, None, prefix[b], max_new_tokens=12, eos_token_id=-1, prompt_bucket=16).tokens
        np.testing.assert_array_equal(got[b], want)
