"""Prefix caching in the serving slots (``jdspark.prefix``): the host index's policy, and a conversation served
turn by turn through the engine, each turn's prompt the previous prompt + its answer + a new message, equal token
for token to batch-1 ``jdspark.generate`` of the whole prompt (greedy, and sampled with the same seed), with the
later turns prefilling only their new tokens (one of them longer than the largest prompt bucket)."""

import numpy as np
import pytest

import jdspark
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.prefix import PrefixPool
from jdspark.serve_metrics import ServeMetrics
from jdspark.slots import SlotBackend
from tests.jdspark.test_slots import _wait_until_finished, pair  # noqa: F401  (the module's tiny pair fixture)


def test_pool_keeps_the_longest_proper_prefix_and_evicts_the_least_recent():
    pool = PrefixPool(2, min_tokens=3)
    assert pool.store([1, 2]) is None  # too short to keep
    a, b = pool.store([1, 2, 3]), pool.store([1, 2, 3, 4, 5])
    assert {a, b} == {0, 1} and pool.store([1, 2, 3]) is None  # kept already
    assert pool.lookup([1, 2, 3, 4, 5, 6]) == (b, 5)  # the longest
    assert pool.lookup([1, 2, 3, 4, 5]) == (a, 3)  # a prompt equal to a kept one leaves nothing to prefill
    assert pool.lookup([1, 2, 3, 4, 5, 6], fits=lambda n: n < 5) == (a, 3)  # the caller's room decides
    assert pool.lookup([9, 1, 2, 3]) is None and pool.lookup([1, 2]) is None
    assert pool.queries == 6 + 5 + 6 + 4 + 2 and pool.hits == 5 + 3 + 3
    pool.lookup([1, 2, 3, 4, 5, 6])  # [1..5] is now the most recent: [1, 2, 3] goes first
    c = pool.store([7, 7, 7, 7])
    assert c == a and pool.lookup([1, 2, 3, 9]) is None and pool.lookup([7, 7, 7, 7, 1]) == (c, 4)
    assert len(pool) == 2
    with pytest.raises(ValueError, match="capacity"):
        PrefixPool(0)


@pytest.fixture(scope="module")
def backend(pair):  # noqa: F811
    target, drafter, _ = pair
    return SlotBackend(target, drafter, num_slots=2, max_len=160, prompt_buckets=(16, 64), batch_buckets=(2,),
                       prefix_pool=2, prefix_min_tokens=8)


def _serve(eng, sp: SamplingRequest) -> Request:
    req = eng.submit(Request(sp, lambda ev: None, ignore_eos=True))
    _wait_until_finished(eng, [req], 600)
    return req


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)])
def test_a_conversation_prefills_only_its_new_tokens(pair, backend, setting):  # noqa: F811
    target, drafter, tok = pair
    backend.prefix.clear()
    metrics = ServeMetrics("m", max_positions=backend.G + 1)
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id, metrics=metrics).start()
    rng = np.random.default_rng(3)
    prompt = [1] + rng.integers(3, target.config.vocab_size, 39).tolist()
    cached, total = [], 0
    try:
        for turn, (max_new, message) in enumerate(((20, 12), (16, 5), (12, 0))):
            sp = SamplingRequest(tuple(prompt), max_new, seed=turn, **setting)
            req = _serve(eng, sp)
            ref = jdspark.generate(target, drafter, np.array(prompt), max_new_tokens=max_new, seed=turn,
                                   eos_token_id=-1, **setting)
            assert req.output_ids == list(ref.tokens), (turn, req.output_ids, ref.tokens)
            assert req.usage()["prompt_tokens_details"]["cached_tokens"] == req.cached_tokens
            cached.append(req.cached_tokens)
            total += len(prompt)
            prompt = prompt + req.output_ids + rng.integers(3, target.config.vocab_size, message).tolist()
            if turn == 0:
                assert len(prompt) > backend.prompt_buckets[-1]  # served only through the kept first prompt
    finally:
        eng.shutdown()
    assert cached == [0, 40, 40 + 20 + 12], cached
    text = metrics.exposition().decode()
    assert f'vllm:prefix_cache_hits_total{{model_name="m"}} {float(sum(cached))}' in text
    assert f'vllm:prefix_cache_queries_total{{model_name="m"}} {float(total)}' in text


def test_a_long_prompt_without_a_kept_prefix_is_refused_by_name(pair, backend):  # noqa: F811
    target, _, _ = pair
    backend.prefix.clear()
    with pytest.raises(ValueError, match="begins with no prompt the prefix cache keeps"):
        backend.insert(0, SamplingRequest(tuple([1] + [5] * 70), 4))
    assert len(backend.prefix) == 0


def test_a_plain_backend_extends_too(pair):  # noqa: F811
    """Without a drafter (``--spec off``) a hit extends the target's caches alone: the second prompt's tokens equal
    plain batch-1 decoding of the whole prompt."""
    target, _, _ = pair
    be = SlotBackend(target, None, num_slots=1, max_len=96, prompt_buckets=(16, 32), prefix_pool=1,
                     prefix_min_tokens=8)
    rng = np.random.default_rng(4)
    first = [1] + rng.integers(3, target.config.vocab_size, 20).tolist()
    second = first + rng.integers(3, target.config.vocab_size, 20).tolist()
    for prompt, cached in ((first, 0), (second, len(first))):
        out = be.insert(0, SamplingRequest(tuple(prompt), 12))
        assert out.cached == cached
        toks = list(out.tokens)
        while len(toks) < 12:
            toks += be.step([0])[0].tokens
        be.free(0)
        ref = jdspark.generate(target, None, np.array(prompt), max_new_tokens=12, eos_token_id=-1)
        assert toks[:12] == list(ref.tokens)


def test_a_chat_s_next_turn_begins_with_its_last_prompt():
    """What makes chat traffic hit the cache: with the shipped tokenizer and chat template, the server's ids of a
    conversation's next turn begin with the ids of its previous turn's prompt (the template closes each message
    with a special token, so the encoding of what came before never changes), whatever the answer's text."""
    import kimi
    from jdspark.serve import parse_completion

    tok = kimi.load_tokenizer("checkpoints/default/target", vocab_size=4096)

    def ids(messages):
        sp = parse_completion({"messages": messages, "max_tokens": 1}, tokenizer=tok, vocab_size=4096,
                              max_context=10 ** 6, model_name="m", chat=True)[0]
        return list(sp.prompt_ids)

    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    for answer in ("    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "  x = 'é'  ", "", "<|im_end|> text"):
        first = ids(msgs)
        nxt = ids(msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now?"}])
        assert len(nxt) > len(first) and nxt[:len(first)] == first, answer
