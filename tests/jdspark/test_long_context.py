"""Long context: chunked prefill inside generate and the slots (the same caches, tokens and acceptance as one
pass), caches sized by need with an error naming the limit, and the drafter's context window (a ring buffer that
equals speculators' all-sliding-window layers, and stays lossless on the shipped pair)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi
from jdspark import data as jdata
from jdspark.drafter import ring_from_linear, with_context_window
from jdspark.engine import SamplingRequest
from jdspark.generation import cache_positions
from jdspark.sampling import SamplingParams
from jdspark.slots import SlotBackend
from jdspark.speculative import prefill_stream
from kimi import dispatch
from tests.oracle_drafter import assert_histogram, histogram, oracle_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR = os.path.join(ROOT, "checkpoints", "default")
P, N_VALID, CHUNK = 48, 45, 16


@pytest.fixture(scope="module")
def tiny():
    cfg = kimi.KimiConfig.tiny()
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    drafter = jdspark.DSparkDrafter(jdspark.DSparkConfig.for_target(cfg, block_size=4), target=target,
                                    rngs=nnx.Rngs(1))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, N_VALID).astype(np.int32)
    return target, drafter, prompt


def _stream(target, drafter, prompt, chunk):
    padded = jnp.zeros((1, P), jnp.int32).at[0, :len(prompt)].set(prompt)
    fn = jax.jit(lambda p: prefill_stream(target, drafter, p, jnp.int32(len(prompt)), jax.random.key(0),
                                          SamplingParams(), 80, chunk)[0])
    return fn(padded)


def test_chunked_prefill_stream_equals_one_pass(tiny):
    """Target cache, the drafter's ring-buffer context and the first token: chunks of 16 over 45 tokens (the last
    chunk padded) against one pass (the linear context: test_slots_insert_chunked_equals_one_pass)."""
    target, drafter, prompt = tiny
    d = with_context_window(drafter, 8)
    one, chk = _stream(target, d, prompt, None), _stream(target, d, prompt, CHUNK)
    np.testing.assert_array_equal(chk.anchor, one.anchor)
    np.testing.assert_array_equal(chk.cache.length, one.cache.length)
    np.testing.assert_allclose(chk.cache.kda_state, one.cache.kda_state, atol=1e-4, rtol=0)
    np.testing.assert_allclose(chk.cache.mla_ckv[:, :, :N_VALID], one.cache.mla_ckv[:, :, :N_VALID], atol=1e-4)
    assert int(chk.dcache.length) == int(one.dcache.length) == N_VALID and one.dcache.max_len == 8
    np.testing.assert_allclose(chk.dcache.k, one.dcache.k, atol=1e-4, rtol=0)
    np.testing.assert_allclose(chk.dcache.v, one.dcache.v, atol=1e-4, rtol=0)


def test_generate_with_chunked_prefill_is_lossless_and_equals_one_pass(tiny):
    """generate with the prompt prefilled in chunks: the tokens of plain decoding after a one-pass prefill, and
    the oracle drafter's scheduled histogram (every accepted length)."""
    target, _, prompt = tiny
    n_new = 24
    ref = jdspark.generate(target, None, prompt, max_new_tokens=n_new + 6, eos_token_id=-1, prefill_chunk=0)
    drafter, want = oracle_drafter(target, prompt, ref.tokens, n_new)
    out = jdspark.generate(target, drafter, prompt, max_new_tokens=n_new, eos_token_id=-1, prefill_chunk=CHUNK)
    np.testing.assert_array_equal(out.tokens, ref.tokens[:n_new])
    assert_histogram(out.stats, want, "chunked prefill")


def test_caches_sized_by_need_and_the_limit_named(tiny):
    target, drafter, prompt = tiny
    assert cache_positions(64, 100, 4) == 64 + 100 + 5
    assert cache_positions(45, 100, 4, chunk=16) == 48 + 100 + 5
    with pytest.raises(ValueError, match="max_len=100"):
        jdspark.generate(target, drafter, prompt, max_new_tokens=60, max_len=100)
    assert dispatch.prefill_chunk(100) is None
    one_pass, size = dispatch.prefill_limits()
    assert dispatch.prefill_chunk(one_pass) is None and dispatch.prefill_chunk(one_pass + 1) == size
    assert dispatch.prefill_chunk(100, 0) is None and dispatch.prefill_chunk(100, 32) == 32
    assert dispatch.prefill_chunk(20, 32) is None
    with pytest.raises(ValueError, match="prefill_chunk"):
        dispatch.prefill_chunk(100, -1)


def test_slots_insert_chunked_equals_one_pass(tiny):
    """A slot prefilled in chunks of 16 holds what one pass leaves (target and drafter caches, the first token),
    and the prompt's log-probabilities (echo) come out of the chunk loop equal to the target's own log_softmax of
    the whole prompt's logits: prompt token i + 1's entry from position i, across the chunks' seams."""
    target, drafter, prompt = tiny
    rows = []
    for chunk in (0, CHUNK):
        be = SlotBackend(target, drafter, num_slots=2, max_len=96, prompt_buckets=(P,), prefill_chunk=chunk,
                         max_logprobs=3)
        first = be.insert(1, SamplingRequest(tuple(int(t) for t in prompt), 8, logprobs=2, prompt_logprobs=3))
        rows.append((first, jax.tree.map(lambda a: np.asarray(a[1]), (be.state.cache, be.state.dcache))))
    assert rows[0][0].tokens == rows[1][0].tokens
    np.testing.assert_allclose(rows[1][1][0].kda_state, rows[0][1][0].kda_state, atol=1e-4, rtol=0)
    np.testing.assert_allclose(rows[1][1][1].k[..., :N_VALID], rows[0][1][1].k[..., :N_VALID], atol=1e-4)
    logits = np.asarray(target.prefill(prompt[None], target.init_cache(1, N_VALID)).logits[0], np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))  # [N_VALID, V] log_softmax
    for first, _ in rows:
        entries = first.prompt_logprobs
        assert len(entries) == N_VALID and entries[0] is None
        np.testing.assert_allclose([e[0] for e in entries[1:]], ref[np.arange(N_VALID - 1), prompt[1:]], atol=1e-4)
        np.testing.assert_allclose([[v for _, v in e[1]] for e in entries[1:]], -np.sort(-ref[:-1])[:, :3],
                                   atol=1e-4)
        (lp, tops), = first.logprobs
        assert lp == pytest.approx(ref[-1, first.tokens[0]], abs=1e-4) and len(tops) == 2
    with pytest.raises(ValueError, match="prefill_chunk"):
        SlotBackend(target, drafter, num_slots=1, max_len=66, prompt_buckets=(P + 8,), prefill_chunk=CHUNK)


def test_ring_window_equals_all_sliding_window_layers(tiny):
    """context_window=W reads what speculators' every-layer sliding_attention with sliding_window=W and
    sliding_window_non_causal=True reads (there from a linear cache, here from a ring of W slots), through appends
    of varying lengths with padded rows; a window longer than the stream reads what W=None reads."""
    target, drafter, _ = tiny
    cfg = drafter.config
    W = 6
    ring = with_context_window(drafter, W)
    slide_cfg = cfg.replace(layer_types=("sliding_attention",) * cfg.num_hidden_layers, sliding_window=W,
                            sliding_window_non_causal=True)
    gd, _ = nnx.split(nnx.eval_shape(lambda: jdspark.DSparkDrafter(slide_cfg, rngs=nnx.Rngs(0))))
    slide = nnx.merge(gd, nnx.state(drafter))
    wide = with_context_window(drafter, 64)
    X = cfg.num_taps * cfg.hidden_size
    taps = jax.random.normal(jax.random.key(5), (1, 40, X))
    emb, head = target.embed_tokens.embedding[...], target.lm_head_DV()
    caches = [m.init_cache(1, 64) for m in (ring, slide, wide, drafter)]
    assert caches[0].max_len == W and caches[2].max_len == 64
    at = 0
    for N, nv in [(13, 11), (5, 3), (5, 0), (5, 5)]:
        caches = [m.append_context(c, taps[:, at:at + N], nv, start_pos=c.length)
                  for m, c in zip((ring, slide, wide, drafter), caches)]
        at += nv
        outs = [m.draft_logits(c, jnp.array([7]), None, emb, head)[0]
                for m, c in zip((ring, slide, wide, drafter), caches)]
        np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0, err_msg=f"after {at} positions")
        np.testing.assert_allclose(outs[2], outs[3], atol=1e-5, rtol=0, err_msg=f"after {at} positions")
    assert np.abs(np.asarray(outs[0] - outs[3])).max() > 1e-3  # the window does cut the context


def test_ring_from_a_linear_cache_equals_the_ring_appended(tiny):
    """A linear context cache rearranged into a ring of W slots (ring_from_linear) holds what appending the same
    taps to the ring holds, slot for slot, once the ring has wrapped (and the drafts read the same); before it is
    full, its valid slots agree and the drafts too."""
    target, drafter, _ = tiny
    cfg = drafter.config
    W = 6
    ring = with_context_window(drafter, W)
    X = cfg.num_taps * cfg.hidden_size
    taps = jax.random.normal(jax.random.key(7), (1, 40, X))
    emb, head = target.embed_tokens.embedding[...], target.lm_head_DV()
    lin, rc = drafter.init_cache(1, 64), ring.init_cache(1, 64)
    at = 0
    for N, nv in [(4, 4), (13, 11), (5, 3), (9, 9)]:
        lin = drafter.append_context(lin, taps[:, at:at + N], nv, start_pos=lin.length)
        rc = ring.append_context(rc, taps[:, at:at + N], nv, start_pos=rc.length)
        at += nv
        got = ring_from_linear(lin, W)
        assert got.max_len == W and int(got.length) == int(rc.length) == at
        valid = min(at, W)
        slots = np.asarray(jnp.mod(jnp.arange(at - valid, at), W))
        np.testing.assert_allclose(np.asarray(got.k)[..., slots], np.asarray(rc.k)[..., slots], atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(got.v)[:, :, :, slots], np.asarray(rc.v)[:, :, :, slots], atol=1e-6,
                                   rtol=0)
        a = ring.draft_logits(got, jnp.array([7]), None, emb, head)[0]
        b = ring.draft_logits(rc, jnp.array([7]), None, emb, head)[0]
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"after {at} positions")
    with pytest.raises(ValueError, match="window"):
        ring_from_linear(lin, 0)


def test_windowed_drafter_is_lossless_on_the_shipped_pair():
    """The shipped drafter serving a window of 16 context positions (the ring wraps many times): greedy DSpark
    equals plain decoding token for token on a held-out prompt, with drafts both accepted and rejected."""
    target = kimi.load_checkpoint(os.path.join(PAIR, "target"))
    drafter = with_context_window(jdspark.load_drafter(os.path.join(PAIR, "drafter"), target=target), 16)
    G = drafter.config.block_size
    docs = jdata.read_documents(jdata.list_files(None, "val"))
    prompt = jdata.prompts_from_documents(docs, 2, 48, seed=11)[1]  # shapes as test_shipped_pair's: its plain
    ar = jdspark.generate(target, None, prompt, max_new_tokens=40, eos_token_id=-1)  # program is compiled once
    sp = jdspark.generate(target, drafter, prompt, max_new_tokens=40, eos_token_id=-1)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    h = histogram(sp.stats, G)
    print(f"window 16: accept_len {sp.stats.accept_len:.2f}, histogram (0..{G} accepted) {h.tolist()}")
    assert h[0] > 0 and h[1:].sum() > 0


def test_a_window_from_the_command_line_is_a_positive_int_or_none(tiny):
    import argparse

    from jdspark.drafter import CHECKPOINT_WINDOW, apply_context_window, parse_context_window

    drafter = tiny[1]
    assert apply_context_window(drafter, CHECKPOINT_WINDOW) is drafter and apply_context_window(None, 8) is None
    assert apply_context_window(drafter, 8).config.context_window == 8
    assert apply_context_window(with_context_window(drafter, 8), None).config.context_window is None

    assert parse_context_window("none") is None and parse_context_window("None") is None
    assert parse_context_window("1024") == 1024
    for bad in ("0", "-8", "1k", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of positions or 'none'"):
            parse_context_window(bad)
