"""Chunked prefill equals a one-pass prefill: logits, taps and the cache, for chunk sizes that do and do not divide
the prompt, on tiny K3 (AttnRes, MLA + KDA) and tiny Kimi-Linear (plain residual) configs, with padded rows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi
from kimi.prefill import chunked_positions, prefill_chunked

T = 37
CONFIGS = {"k3": dict(), "kimi_linear": dict(attn_res_block_size=None)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return kimi.KimiForCausalLM(kimi.KimiConfig.tiny(**CONFIGS[request.param]), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def one_pass(model):
    toks = jax.random.randint(jax.random.key(3), (2, T), 0, model.config.vocab_size)
    valid = jnp.array([T, 29])
    out = model.forward(toks, model.init_cache(2, 64), mode="prefill", tap_layers=(1, 3), valid_len_B=valid)
    return toks, valid, out


@pytest.mark.parametrize("chunk", [8, 37, 64])  # several chunks, the last partial; one; one past the end
def test_chunked_prefill_equals_one_pass(model, one_pass, chunk):
    toks, valid, ref = one_pass
    fn = jax.jit(lambda t, c, v: prefill_chunked(model, t, c, chunk=chunk, tap_layers=(1, 3), valid_len_B=v,
                                                 all_logits=True))
    logits, cache, taps = fn(toks, model.init_cache(2, 64 + chunk), valid)
    for b, n in enumerate(np.asarray(valid)):
        np.testing.assert_allclose(logits[b, :n], ref.logits[b, :n], atol=1e-4, rtol=0)
        np.testing.assert_allclose(taps[b, :n], ref.taps[b, :n], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(cache.length, ref.cache.length)
    np.testing.assert_allclose(cache.kda_state, ref.cache.kda_state, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache.conv_state, ref.cache.conv_state, atol=1e-5, rtol=0)
    for b, n in enumerate(np.asarray(valid)):
        np.testing.assert_allclose(cache.mla_ckv[:, b, :n], ref.cache.mla_ckv[:, b, :n], atol=1e-4, rtol=0)
    # the last-token logits a generation starts from
    last, _, _ = jax.jit(lambda t, c, v: prefill_chunked(model, t, c, chunk=chunk, valid_len_B=v))(
        toks, model.init_cache(2, 64 + chunk), valid)
    for b, n in enumerate(np.asarray(valid)):
        np.testing.assert_allclose(last[b], ref.logits[b, n - 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", ["unabsorbed", "absorbed"])
def test_chunked_prefill_with_key_tiles_equals_one_pass(model, one_pass, monkeypatch, form):
    """The long-context form: every chunk attends over the cache key tile by key tile (thresholds lowered so a
    tiny cache takes that path), in either form of the tiles, equal to the whole-cache one-pass prefill."""
    from kimi import dispatch
    monkeypatch.setattr(dispatch, "MLA_TILED_MIN_KEYS", 16)
    monkeypatch.setattr(dispatch, "MLA_PREFILL_TILED_FORM", {jax.default_backend(): form})
    monkeypatch.setattr(dispatch, "MLA_KEY_TILE", {form: 12})
    assert dispatch.mla_key_tile(80) == (form, 12)
    toks, valid, ref = one_pass
    logits, cache, _ = jax.jit(lambda t, c, v: prefill_chunked(model, t, c, chunk=16, valid_len_B=v,
                                                               all_logits=True))(toks, model.init_cache(2, 80), valid)
    for b, n in enumerate(np.asarray(valid)):
        np.testing.assert_allclose(logits[b, :n], ref.logits[b, :n], atol=1e-4, rtol=0)


def test_one_compiled_body_for_any_number_of_chunks(model):
    """The chunk loop is a scan: the lowered program has one forward whatever T is."""
    def n_dots(T_):
        toks = jnp.zeros((1, T_), jnp.int32)
        hlo = jax.jit(lambda t, c: prefill_chunked(model, t, c, chunk=8)[0]).lower(
            toks, model.init_cache(1, 256)).as_text()
        return hlo.count("dot_general")
    assert n_dots(16) == n_dots(128)


def test_cache_too_small_for_the_last_chunk_is_an_error(model):
    toks = jnp.zeros((1, 20), jnp.int32)
    assert chunked_positions(20, 8) == 24
    with pytest.raises(ValueError, match="max_len=20"):
        prefill_chunked(model, toks, model.init_cache(1, 20), chunk=8)
    with pytest.raises(ValueError, match="chunk"):
        chunked_positions(20, 0)


def test_prefill_on_a_prompt_sized_cache_padded_equals_the_full_cache(model, one_pass):
    """``KimiCache.padded_to``: prefill on a cache of the prompt's own length, padded to 64, then decode: the same
    logits and cache as a prefill into the 64-position cache (what ``prefill_stream`` relies on)."""
    toks, valid, ref = one_pass
    small = model.forward(toks, model.init_cache(2, T), mode="prefill", tap_layers=(1, 3), valid_len_B=valid)
    padded = small.cache.padded_to(64)
    assert padded.max_len == 64
    np.testing.assert_array_equal(padded.mla_ckv[:, :, T:], 0)
    for b, n in enumerate(np.asarray(valid)):
        np.testing.assert_allclose(small.logits[b, :n], ref.logits[b, :n], atol=1e-4, rtol=0)
    nxt = jnp.argmax(ref.logits[jnp.arange(2), valid - 1], -1)[:, None]
    a = model.forward(nxt, padded, mode="decode")
    b = model.forward(nxt, ref.cache, mode="decode")
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(a.cache.length, b.cache.length)
    with pytest.raises(ValueError, match="max_len: expected >= the cache's 37 positions"):
        small.cache.padded_to(36)


def test_the_lm_head_runs_on_the_last_position_only(model):
    """Without all_logits the compiled chunk loop keeps no product of the forward's LM head (named scope
    ``lm_head``) over the chunk's C rows: the last valid row's logits come from its hidden state alone. With
    all_logits it stays; a logits_fn gets the chunk's logits on demand (here under a cond, as prompt
    log-probabilities ask for them)."""
    V, C = model.config.vocab_size, 8
    toks = jnp.zeros((1, 24), jnp.int32)

    def lm_head_products(fn):
        hlo = jax.jit(fn).lower(toks, model.init_cache(1, 64)).compile().as_text()
        return [ln for ln in hlo.splitlines() if "lm_head/dot_general" in ln and f"f32[{C},{V}]" in ln
                and re.search(r"= \S+ (dot|fusion)\(", ln)]

    assert not lm_head_products(lambda t, c: prefill_chunked(model, t, c, chunk=C)[0])
    assert lm_head_products(lambda t, c: prefill_chunked(model, t, c, chunk=C, all_logits=True)[0])
    ref = prefill_chunked(model, toks, model.init_cache(1, 64), chunk=C, all_logits=True)[0]

    def lazy(chunk_logits, start):
        return jax.lax.cond(start >= 0, lambda: chunk_logits()[..., 0], lambda: jnp.zeros((1, C), jnp.float32))

    (last, firsts), _, _ = jax.jit(lambda t, c: prefill_chunked(model, t, c, chunk=C, logits_fn=lazy))(
        toks, model.init_cache(1, 64))
    np.testing.assert_allclose(firsts, ref[..., 0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(last, ref[:, -1], atol=1e-5, rtol=0)
