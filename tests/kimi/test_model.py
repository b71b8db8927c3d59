"""KimiForCausalLM: decode == prefill, verify's per-position states, rollback, no recompiles, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi
from kimi import model as model_mod

T_PROMPT = 11


def _tokens(cfg, B, T, seed=1):
    return np.asarray(jax.random.randint(jax.random.key(seed), (B, T), 0, cfg.vocab_size), np.int32)


@pytest.fixture(scope="module", params=["k3_tiny", "kimi_linear_tiny"])
def setup(request):
    if request.param == "k3_tiny":  # the chunked (WY) prefill; the other config takes "auto" (the scan on CPU)
        cfg = kimi.KimiConfig.tiny(kda_prefill="chunked")
    else:  # Kimi-Linear features: plain residual, softplus gate, low-rank output gate, SwiGLU, no latent, no q LoRA
        cfg = kimi.KimiConfig.tiny(attn_res_block_size=None, kda_gate_lower_bound=None, kda_use_full_rank_gate=False,
                                   hidden_act="silu", routed_expert_hidden_size=None, latent_moe_use_norm=False,
                                   q_lora_rank=None, mla_use_output_gate=False, routed_scaling_factor=2.5)
    m = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    tok = _tokens(cfg, 2, T_PROMPT)
    pre = m.prefill(tok, m.init_cache(2, 32), tap_layers=(0, 2, cfg.num_hidden_layers))
    return cfg, m, tok, pre


def test_tiny_has_every_feature():
    cfg = kimi.KimiConfig.tiny()
    assert set(cfg.layer_kinds) == {"kda", "mla"}
    assert cfg.ffn_kinds[0] == "dense" and "moe" in cfg.ffn_kinds
    assert cfg.num_shared_experts >= 1 and cfg.routed_expert_hidden_size is not None
    assert cfg.attn_res_block_size is not None and cfg.num_hidden_layers % 2 == 1
    assert cfg.num_hidden_layers % cfg.attn_res_block_size != 0  # the last block is partial
    assert T_PROMPT % cfg.kda_chunk_size != 0


def test_decode_matches_prefill(setup):
    cfg, m, tok, pre = setup
    cache = m.init_cache(2, 32)
    logits = []
    for t in range(tok.shape[1]):
        out = m.decode(tok[:, t], cache)
        cache = out.cache
        logits.append(out.logits)
    dec = jnp.stack(logits, axis=1)
    assert dec.shape == pre.logits.shape == (2, T_PROMPT, cfg.vocab_size)
    np.testing.assert_allclose(dec, pre.logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache.kda_state, pre.cache.kda_state, atol=1e-4)
    np.testing.assert_array_equal(cache.length, pre.cache.length)


P_VERIFY = 6  # verify tok[:, P_VERIFY:] after prefilling tok[:, :P_VERIFY]: the fixture's prefill is the longer one


def _step_decoded(m, cache, tokens_BT):
    """Copies of the cache after step-decoding 0, 1, .., T of ``tokens_BT`` from ``cache`` (which is donated): the
    reference for verify's per-position states, by another code path (decode == prefill: test_decode_matches_
    prefill), compiled once for every length."""
    caches = [jax.tree.map(jnp.copy, cache)]
    for t in range(tokens_BT.shape[1]):
        cache = m.decode(tokens_BT[:, t], cache).cache
        caches.append(jax.tree.map(jnp.copy, cache))
    return caches


@pytest.fixture(scope="module")
def verified(setup):
    """(step-decoded caches after the first P_VERIFY tokens + k more, k = 0..T_PROMPT - P_VERIFY; verify of the
    remaining tokens after them with tap 2). Shared: one prefill and one verify program for the tests below."""
    cfg, m, tok, pre = setup
    first = m.prefill(tok[:, :P_VERIFY], m.init_cache(2, 32))
    steps = _step_decoded(m, jax.tree.map(jnp.copy, first.cache), tok[:, P_VERIFY:])
    return steps, m.verify(tok[:, P_VERIFY:], first.cache, tap_layers=(2,))


def test_verify_after_prefill_matches_longer_prefill(setup, verified):
    cfg, m, tok, pre = setup
    steps, ver = verified
    p, D, extra = P_VERIFY, cfg.hidden_size, tok[:, P_VERIFY:]
    np.testing.assert_allclose(ver.logits, pre.logits[:, p:], atol=1e-4)
    np.testing.assert_allclose(ver.taps, pre.taps[:, p:, D:2 * D], atol=1e-4)  # pre's taps: layers (0, 2, L)
    if kimi.dispatch.kda_verify_form(5, 2) == "block":  # the closed-form block (test_both_verify_forms: each)
        assert isinstance(ver.kda_rollback, kimi.ops.kda.KDABlockTrace)
        assert ver.kda_rollback.k_BTHK.shape[:3] == (cfg.num_kda_layers, 2, 5)
    else:  # the scan (on a CPU): every position's state
        assert ver.kda_rollback.shape[:3] == (cfg.num_kda_layers, 2, 5)
    np.testing.assert_allclose(ver.cache.kda_state, pre.cache.kda_state, atol=1e-5)
    # the state verify reports at accepted length k equals processing prompt + k tokens
    for k in (1, 3, 5):
        ref = steps[k]
        before = np.full((2,), p, np.int32)
        rolled = kimi.KimiForCausalLM.rollback(ver, before, np.full((2,), k, np.int32))
        np.testing.assert_allclose(rolled.kda_state, ref.kda_state, atol=1e-5)
        np.testing.assert_allclose(rolled.conv_state, ref.conv_state, atol=1e-6)
        np.testing.assert_array_equal(rolled.length, ref.length)
        # decoding after the rollback continues exactly like decoding after the longer context
        nxt = extra[:, 0]
        a = m.decode(nxt, jax.tree.map(jnp.copy, rolled)).logits  # decode donates its cache: keep ver's intact
        b = m.decode(nxt, jax.tree.map(jnp.copy, ref)).logits
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("form", kimi.dispatch.KDA_VERIFY_FORMS)
def test_both_verify_forms(setup, verified, form):
    """Either KDA verify form (``dispatch.kda_verify_form_as``; the backend picks one) gives the longer prefill's
    logits and, rolled back to k tokens, the state k decode steps reach."""
    cfg, m, tok, pre = setup
    steps = verified[0]
    with kimi.dispatch.kda_verify_form_as(form):  # traced here, not served from model.verify's jit cache
        ver = jax.jit(lambda t, c: m.forward(t, c, mode="verify"))(tok[:, P_VERIFY:], jax.tree.map(jnp.copy,
                                                                                                   steps[0]))
    assert isinstance(ver.kda_rollback, kimi.ops.kda.KDABlockTrace) == (form == "block")
    np.testing.assert_allclose(ver.logits, pre.logits[:, P_VERIFY:], atol=1e-4)
    for k in (1, 3, 5):
        rolled = kimi.KimiForCausalLM.rollback(ver, np.full((2,), P_VERIFY, np.int32), np.full((2,), k, np.int32))
        np.testing.assert_allclose(rolled.kda_state, steps[k].kda_state, atol=1e-5)
        np.testing.assert_allclose(rolled.conv_state, steps[k].conv_state, atol=1e-6)


def test_long_verify_keeps_per_position_states(setup, verified):
    """Past kda_verify_form's block limit verify scans tokens and keeps every state; rollback picks one."""
    cfg, m, tok, pre = setup
    T = kimi.dispatch.KDA_BLOCK_MAX_TOKENS + 2
    first = verified[0][0]  # after P_VERIFY tokens
    extra = _tokens(cfg, 2, T, seed=9)
    k = T - 1
    ref = _step_decoded(m, jax.tree.map(jnp.copy, first), extra[:, :k])[k]
    ver = m.verify(extra, jax.tree.map(jnp.copy, first))
    assert ver.kda_rollback.shape[:3] == (cfg.num_kda_layers, 2, T)
    rolled = kimi.KimiForCausalLM.rollback(ver, np.full((2,), P_VERIFY, np.int32), np.full((2,), k, np.int32))
    np.testing.assert_allclose(rolled.kda_state, ref.kda_state, atol=1e-5)


def test_rollback_per_row(setup, verified):
    cfg, m, tok, pre = setup
    steps, ver = verified
    n_keep = np.array([1, 3], np.int32)
    rolled = kimi.KimiForCausalLM.rollback(ver, np.full((2,), P_VERIFY, np.int32), n_keep)
    for b in range(2):
        np.testing.assert_allclose(rolled.kda_state[:, b], steps[n_keep[b]].kda_state[:, b], atol=1e-5)
    np.testing.assert_array_equal(rolled.length, P_VERIFY + n_keep)


def test_taps_are_layer_inputs(setup):
    cfg, m, tok, pre = setup
    D = cfg.hidden_size
    assert pre.taps.shape == (2, T_PROMPT, 3 * D)
    # tap 0 is the input of layer 0: the embedding
    np.testing.assert_allclose(pre.taps[..., :D], m.model.embed_tokens.embedding[...][tok], atol=1e-6)
    # tap L is the final hidden state before the final norm
    np.testing.assert_allclose(pre.taps[..., 2 * D:], pre.last_hidden, atol=1e-6)


def test_second_decode_does_not_recompile(setup):
    cfg, m, tok, pre = setup
    cache = m.init_cache(2, 32)
    out = m.decode(tok[:, 0], cache)
    n = model_mod.forward_jit._cache_size()
    out = m.decode(tok[:, 1], out.cache)
    out = m.decode(tok[:, 2], out.cache)
    jax.block_until_ready(out.logits)
    assert model_mod.forward_jit._cache_size() == n


def test_bad_input_is_a_clear_error(setup):
    cfg, m, tok, pre = setup
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.prefill(np.array([[1, cfg.vocab_size]], np.int32), m.init_cache(1, 8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.decode(np.array([-1, 0], np.int32), m.init_cache(2, 8))
    with pytest.raises(ValueError, match="max_len=8"):
        m.prefill(np.zeros((1, 9), np.int32), m.init_cache(1, 8))
    with pytest.raises(ValueError, match="tap_layers"):
        m.prefill(np.zeros((1, 2), np.int32), m.init_cache(1, 8), tap_layers=(cfg.num_hidden_layers + 1,))
    with pytest.raises(ValueError, match="batch"):
        m.prefill(np.zeros((3, 2), np.int32), m.init_cache(1, 8))


def test_padded_prefill_equals_unpadded(setup):
    cfg, m, tok, pre = setup
    n = P_VERIFY  # the prefill length compiled above
    padded = np.concatenate([tok[:, :n], np.full((2, T_PROMPT - n), cfg.pad_token_id, np.int32)], 1)
    gd, st = nnx.split(m)
    out = jax.jit(lambda s, t, c: nnx.merge(gd, s).forward(t, c, mode="prefill", valid_len_B=jnp.array([n, n])))(
        st, padded, m.init_cache(2, 32))
    ref = m.prefill(tok[:, :n], m.init_cache(2, 32))
    np.testing.assert_allclose(out.logits[:, n - 1], ref.logits[:, -1], atol=1e-4)
    np.testing.assert_allclose(out.cache.kda_state, ref.cache.kda_state, atol=1e-5)
    np.testing.assert_allclose(out.cache.conv_state, ref.cache.conv_state, atol=1e-6)
    np.testing.assert_array_equal(out.cache.length, [n, n])
    a = m.decode(tok[:, n], out.cache).logits
    b = m.decode(tok[:, n], ref.cache).logits
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_bf16_model_keeps_its_cache_dtypes_through_every_mode():
    """A bf16 model's prefill, decode and verify return caches of the dtypes they were given (a loop carries the
    cache: generate's while_loop needs equal types in and out)."""
    cfg = kimi.KimiConfig.tiny(param_dtype="bfloat16")
    m = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    cache = m.init_cache(1, 16)
    want = jax.tree.map(lambda a: a.dtype, cache)
    ids = np.array([[1, 5, 7, 9]], np.int32)
    for mode, run in (("prefill", lambda c: m.prefill(ids, c)), ("decode", lambda c: m.decode(ids[:, 0], c)),
                      ("verify", lambda c: m.verify(ids[:, :3], c))):
        cache = run(cache).cache  # the jitted entry points (eager forward compiles op by op: slow)
        assert jax.tree.map(lambda a: a.dtype, cache) == want, mode
