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
from jdspark.sampling import Penalties, logit_controls, penalize
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
    # the logit controls: a bias, and min_tokens holding back two "stop" ids at the positions with fewer than 9
    # tokens generated before (the counts' sums run 5..15 here)
    bias = {3: 2.5, 7: -100.0, 30: 0.25}
    bias_V = np.zeros(37, np.float32)
    bias_V[list(bias)] = list(bias.values())
    stop_V = np.isin(np.arange(37), (5, 9))
    got = penalize(jnp.asarray(z), jnp.asarray(counts), jnp.asarray(prompt), Penalties(*PEN), jnp.asarray(bias_V),
                   jnp.asarray(stop_V), jnp.int32(9))
    want = sampling_ref.penalize(z, counts, prompt, *PEN, logit_bias=bias, stop_ids=(5, 9), min_tokens=9)
    early = counts.sum(-1) < 9
    assert early.any() and (~early).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(np.where(np.isneginf(want), 0, got), np.where(np.isneginf(want), 0, want), atol=1e-5)
    # with the penalties statically off the controls still apply (generate with logit_bias alone)
    got = penalize(jnp.asarray(z), jnp.asarray(counts), jnp.asarray(prompt), Penalties(), jnp.asarray(bias_V),
                   jnp.asarray(stop_V), jnp.int32(0))
    np.testing.assert_allclose(got, sampling_ref.penalize(z, counts, prompt, logit_bias=bias), atol=1e-5)


def test_allowed_token_ids_are_a_bias_of_minus_infinity_elsewhere():
    """vLLM's allowed_token_ids as logit controls: the bias stays where allowed and is -inf elsewhere; ids outside
    the vocabulary, and a list min_tokens would leave nothing to draw from, are ValueErrors naming them."""
    c = logit_controls(8, {3: 1.5, 6: 2.0}, 0, (2,), allowed_ids=(2, 3, 5))
    assert np.isneginf(c.bias_V).tolist() == [True, True, False, False, True, False, True, True]
    assert c.bias_V[3] == 1.5 and c.bias_V[5] == 0.0
    assert logit_controls(8, None, 0, (2,), allowed_ids=(4,)) is not None  # asked for: carried
    with pytest.raises(ValueError, match="allowed_ids: expected token ids in"):
        logit_controls(8, None, 0, allowed_ids=(1, 8))
    with pytest.raises(ValueError, match="nothing to draw"):
        logit_controls(8, None, 3, (2,), allowed_ids=(2,))


def _reference(target, prompt, n: int, pen, eos: int = -1, **controls) -> list:
    """n greedy tokens (up to EOS, when given), penalised in NumPy (``controls``: ``sampling_ref.penalize``'s
    logit_bias / stop_ids / min_tokens), by the target's own prefill and step decode (no generate loop)."""
    V = target.config.vocab_size
    out = target.prefill(np.asarray(prompt, np.int32)[None], target.init_cache(1, len(prompt) + n + 1))
    logits, cache = np.asarray(out.logits)[0, -1], out.cache
    counts, seen, toks = np.zeros(V), np.isin(np.arange(V), prompt), []
    for _ in range(n):
        tok = int(np.argmax(sampling_ref.penalize(logits, counts, seen, *pen, **controls)))
        toks.append(tok)
        if tok == eos:
            break
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


def test_greedy_with_logit_controls_equals_the_reference(pair):  # noqa: F811
    """logit_bias and min_tokens (with the penalties: one program, the penalties test's shapes) in generate, plain
    and DSpark, equal the NumPy-controlled decoder token for token, drafts accepted and rejected: EOS, pushed up by
    its bias, comes no sooner than min_tokens (without the minimum it comes sooner)."""
    target, drafter = pair
    eos, mins = target.config.eos_token_id, 9
    bias = {eos: 6.0, 7: -100.0, 11: 1.5}
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 64, 15).tolist() for _ in range(3)]
    drafted = accepted = 0
    early_without = False
    pen = dict(repetition_penalty=PEN[0], frequency_penalty=PEN[1], presence_penalty=PEN[2])
    for p in prompts:
        want = _reference(target, p, 24, PEN, eos, logit_bias=bias, stop_ids=(eos,), min_tokens=mins)
        assert eos not in want[:mins] and 7 not in want
        for d in (None, drafter):
            got = jdspark.generate(target, d, np.asarray(p), max_new_tokens=24, logit_bias=bias, min_tokens=mins,
                                   **pen)
            assert list(got.tokens) == want, (d is None, got.tokens, want)
        drafted, accepted = drafted + int(got.stats.drafted), accepted + int(got.stats.accepted)
        early_without |= eos in _reference(target, p, 24, PEN, eos, logit_bias=bias)[:mins]
    assert 0 < accepted < drafted
    assert early_without  # the minimum held EOS back
    with pytest.raises(ValueError, match="logit_bias: token ids"):
        jdspark.generate(target, None, np.asarray(prompts[0]), max_new_tokens=4, logit_bias={64: 1.0})
    with pytest.raises(ValueError, match="min_tokens"):
        jdspark.generate(target, None, np.asarray(prompts[0]), max_new_tokens=4, min_tokens=-1)


def test_served_penalties_equal_batch_one_generate(pair):  # noqa: F811
    """Requests with penalties beside one without, in one backend (per-row penalties, a prefix-cache hit's
    extension too, logit_bias and min_tokens on two of them, allowed_token_ids on the sampled one): each equals
    batch-1 generate with its own settings, token for token (greedy; sampled at the whole block's width, the same
    keys)."""
    target, drafter = pair
    be = SlotBackend(target, drafter, num_slots=4, max_len=96, prompt_buckets=(32,), batch_buckets=(4,),
                     prefix_pool=2, prefix_min_tokens=8, penalties=True)
    rng = np.random.default_rng(4)
    base = [1] + rng.integers(3, 64, 17).tolist()
    pen = dict(zip(("repetition_penalty", "frequency_penalty", "presence_penalty"), PEN))
    eos = target.config.eos_token_id
    held = dict(logit_bias=((eos, 6.0), (7, -100.0)), min_tokens=9, stop_token_ids=(eos,))  # EOS at >= 9
    asks = [(base, pen), (base + rng.integers(3, 64, 5).tolist(), {**pen, **held}),  # (the greedy tests' program)
            ([1] + rng.integers(3, 64, 12).tolist(), dict(presence_penalty=0.7, temperature=1.0, seed=2,
                                                         logit_bias=((5, 3.0), (9, -2.0)),
                                                         allowed_token_ids=tuple(range(3, 40, 2)))),
            ([1] + rng.integers(3, 64, 9).tolist(), dict())]
    outs = [[] for _ in asks]
    for s, (p, kw) in enumerate(asks):
        outs[s] += be.insert(s, SamplingRequest(tuple(p), 24, **kw)).tokens
    assert be.prefix.hits == len(base)  # the second request extended the first's kept prompt
    while min(map(len, outs)) < 24:
        for s, r in be.step([0, 1, 2, 3], width=be.G + 1).items():
            outs[s] += r.tokens
    for (p, kw), got in zip(asks, outs):
        kw = dict(kw, logit_bias=dict(kw.get("logit_bias", ())))
        eos_id = eos if kw.pop("stop_token_ids", None) else -1
        ref = jdspark.generate(target, drafter, np.asarray(p), max_new_tokens=24, eos_token_id=eos_id, **kw)
        assert got[:len(ref.tokens)] == list(ref.tokens), kw
    assert eos in outs[1] and eos not in outs[1][:9]  # the served minimum held EOS back, then its bias won
    assert set(outs[2][:24]) <= set(range(3, 40, 2)) and len(set(outs[2][:24])) > 3  # only the allowed, several
    free = jdspark.generate(target, drafter, np.asarray(asks[2][0]), max_new_tokens=24, eos_token_id=-1,
                            **dict(asks[2][1], logit_bias=dict(asks[2][1]["logit_bias"]), allowed_token_ids=()))
    assert not set(free.tokens) <= set(range(3, 40, 2))  # without the list, others come


def test_the_server_takes_penalties():
    from jdspark.serve_request import ApiError, parse_completion
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
    q = parse_completion({"prompt": "x", "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 4, "max_tokens": 9},
                         tokenizer=tok, vocab_size=tok.vocab_size, max_context=64, model_name="m")
    assert (q.sampling.logit_bias, q.sampling.min_tokens) == (((3, 2.5), (7, -100.0)), 4)
    for extra in ({"logit_bias": {"7": 1}}, {"min_tokens": 2}, {"allowed_token_ids": [3, 4]}):
        with pytest.raises(ApiError, match="start it with --penalties") as e:
            parse_completion({"prompt": "x", **extra}, tokenizer=tok, vocab_size=tok.vocab_size, max_context=64,
                             model_name="m", penalties=False)
        assert e.value.param == next(iter(extra))
    be = SlotBackend(kimi.KimiForCausalLM(kimi.KimiConfig.tiny(), rngs=nnx.Rngs(0)), None,
                     num_slots=1, max_len=64, prompt_buckets=(16,))  # the default: not compiled in
    assert be.state.counts is None
    for kw in (dict(presence_penalty=0.5), dict(logit_bias=((5, 1.0),)), dict(min_tokens=2),
               dict(allowed_token_ids=(3, 4))):
        with pytest.raises(ValueError, match="built without them"):
            be.insert(0, SamplingRequest((1, 5, 6), 4, **kw))
