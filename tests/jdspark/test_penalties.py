"""Repetition penalties (``jdspark.sampling.Penalties``): ``penalize`` against the definition in NumPy
(tests/jdspark/sampling_ref.py), static and per row; greedy generation with penalties against an independent
decoder (the target's own prefill and step decode, penalised in NumPy), plain and DSpark with drafts accepted and
rejected; requests served by the slots with penalties (and beside requests without) equal batch-1 ``generate``.
The sampled law under penalties: tests/jdspark/test_sampling_law.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdspark
import kimi
from jdspark.engine import SamplingRequest
from jdspark.sampling import Penalties, penalize
from jdspark.slots import SlotBackend
from tests.jdspark import sampling_ref
from tests.jdspark.test_logprobs import pair  # noqa: F401  (the tiny pair: drafts partly wrong)

PEN = (2.5, 0.6, 0.5)  # repetition, frequency, presence: all three at once


def test_penalize_equals_the_definition():
    rng = np.random.default_rng(0)
    z = (rng.normal(size=(4, 3, 37)) * 3).astype(np.float32)
    counts = rng.integers(0, 3, (4, 3, 37)) * (rng.random((4, 3, 37)) < 0.3)
    prompt = rng.random(37) < 0.2
    got = penalize(jnp.asarray(z), jnp.asarray(counts), jnp.asarray(prompt), Penalties(*PEN))
    np.testing.assert_allclose(got, sampling_ref.penalize(z, counts, prompt, *PEN), atol=1e-5)
    # per row (a batch of 4 rows, one of them off), under the batch flag; a batch with none skips the work
    per = np.array([PEN, (1.0, 0.0, 0.0), (0.7, 0.0, 0.2), (1.0, 1.5, 0.0)], np.float32)
    fn = jax.jit(lambda z, per: penalize(z, jnp.asarray(counts), jnp.asarray(prompt),
                                         Penalties.rows(*per.T, Penalties.batch_flag(*per.T))))
    got = fn(jnp.asarray(z), jnp.asarray(per))
    for r in range(4):
        np.testing.assert_allclose(got[r], sampling_ref.penalize(z[r], counts[r], prompt, *per[r]), atol=1e-5)
    off = np.tile(np.array([[1.0, 0.0, 0.0]], np.float32), (4, 1))
    np.testing.assert_array_equal(fn(jnp.asarray(z), jnp.asarray(off)), z)
    assert penalize(z, counts, prompt, Penalties()) is z  # statically off: nothing compiled in


def _reference(target, prompt, n: int, pen) -> list:
    """n greedy tokens, penalised in NumPy, by the target's own prefill and step decode (no generate loop)."""
    V = target.config.vocab_size
    out = target.prefill(np.asarray(prompt, np.int32)[None], target.init_cache(1, len(prompt) + n + 1))
    logits, cache = np.asarray(out.logits)[0, -1], out.cache
    counts, seen, toks = np.zeros(V), np.isin(np.arange(V), prompt), []
    for _ in range(n):
        tok = int(np.argmax(sampling_ref.penalize(logits, counts, seen, *pen)))
        toks.append(tok)
        counts[tok] += 1
        out = target.decode(np.asarray([tok], np.int32), cache)
        logits, cache = np.asarray(out.logits)[0], out.cache
    return toks


def test_greedy_with_penalties_equals_the_reference(pair):  # noqa: F811
    target, drafter = pair
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 64, 15).tolist() for _ in range(3)]
    drafted = accepted = 0
    changed = False
    kw = dict(max_new_tokens=24, eos_token_id=-1, repetition_penalty=PEN[0], frequency_penalty=PEN[1],
              presence_penalty=PEN[2])
    for p in prompts:
        want = _reference(target, p, 24, PEN)
        plain = jdspark.generate(target, None, np.asarray(p), **kw)
        spec = jdspark.generate(target, drafter, np.asarray(p), **kw)
        assert list(plain.tokens) == want and list(spec.tokens) == want
        drafted, accepted = drafted + int(spec.stats.drafted), accepted + int(spec.stats.accepted)
        changed |= want != _reference(target, p, 24, (1.0, 0.0, 0.0))
    assert 0 < accepted < drafted  # drafts accepted and rejected
    assert changed  # the penalties move the output
    with pytest.raises(ValueError, match="repetition_penalty"):
        jdspark.generate(target, None, np.asarray(prompts[0]), max_new_tokens=4, repetition_penalty=0.0)


def test_served_penalties_equal_batch_one_generate(pair):  # noqa: F811
    """Requests with penalties beside one without, in one backend (per-row penalties, a prefix-cache hit's
    extension too): each equals batch-1 generate with its own settings, token for token (greedy; sampled at the
    whole block's width, the same keys)."""
    target, drafter = pair
    be = SlotBackend(target, drafter, num_slots=4, max_len=96, prompt_buckets=(32,), batch_buckets=(4,),
                     prefix_pool=2, prefix_min_tokens=8, penalties=True)
    rng = np.random.default_rng(4)
    base = [1] + rng.integers(3, 64, 17).tolist()
    pen = dict(zip(("repetition_penalty", "frequency_penalty", "presence_penalty"), PEN))
    asks = [(base, pen), (base + rng.integers(3, 64, 5).tolist(), pen),  # (one program: the greedy test's)
            ([1] + rng.integers(3, 64, 12).tolist(), dict(presence_penalty=0.7, temperature=1.0, seed=2)),
            ([1] + rng.integers(3, 64, 9).tolist(), dict())]
    outs = [[] for _ in asks]
    for s, (p, kw) in enumerate(asks):
        outs[s] += be.insert(s, SamplingRequest(tuple(p), 24, **kw)).tokens
    assert be.prefix.hits == len(base)  # the second request extended the first's kept prompt
    while min(map(len, outs)) < 24:
        for s, r in be.step([0, 1, 2, 3], width=be.G + 1).items():
            outs[s] += r.tokens
    for (p, kw), got in zip(asks, outs):
        ref = jdspark.generate(target, drafter, np.asarray(p), max_new_tokens=24, eos_token_id=-1, **kw)
        assert got[:24] == list(ref.tokens), kw


def test_the_server_takes_penalties():
    from jdspark.serve import ApiError, parse_completion
    from kimi.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    q = parse_completion({"prompt": "x", "repetition_penalty": 1.2, "frequency_penalty": -0.5,
                          "presence_penalty": 2}, tokenizer=tok, vocab_size=tok.vocab_size, max_context=64,
                         model_name="m")
    s = q.sampling
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.2, -0.5, 2.0)
    with pytest.raises(ApiError, match="start it with --penalties") as e:
        parse_completion({"prompt": "x", "presence_penalty": 0.1}, tokenizer=tok, vocab_size=tok.vocab_size,
                         max_context=64, model_name="m", penalties=False)
    assert e.value.param == "presence_penalty"
    be = SlotBackend(kimi.KimiForCausalLM(kimi.KimiConfig.tiny(), rngs=nnx.Rngs(0)), None,
                     num_slots=1, max_len=64, prompt_buckets=(16,))  # the default: not compiled in
    assert be.state.counts is None
    with pytest.raises(ValueError, match="built without them"):
        be.insert(0, SamplingRequest((1, 5, 6), 4, presence_penalty=0.5))
