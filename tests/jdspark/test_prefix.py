"""Prefix caching in the serving slots (``jdspark.prefix``): the host index's policy, and a conversation served
turn by turn through the engine, each turn's prompt the previous prompt + its answer + a new message, equal token
for token to batch-1 ``jdspark.generate`` of the whole prompt (greedy, and sampled with the same seed), with the
later turns prefilling only their new tokens (one of them longer than the largest prompt bucket)."""

import time

import jax
import numpy as np
import pytest

import jdspark
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.prefix import PrefixPool
from jdspark.serve_metrics import ServeMetrics
from jdspark.slots import SlotBackend
from tests.jdspark.test_slots import MergingVocab, _wait_until_finished, pair  # noqa: F401  (the tiny pair fixture)


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


def test_remembered_answers_are_kept_newest_first_and_in_chunks():
    """``remember`` / ``next_pending``: the newest remembered sequence first, extended from its longest kept prefix,
    cut where ``chunk`` says (the rest waits again and continues from the cut once it is kept); a sequence with no
    kept prefix, or kept already, is dropped; at most PENDING_ANSWERS wait."""
    from jdspark.prefix import PENDING_ANSWERS

    pool = PrefixPool(4, min_tokens=3)
    a = pool.store([1, 2, 3])
    pool.remember([1, 2])  # too short to keep
    pool.remember([9, 9, 9, 9])  # no kept prefix
    pool.remember([1, 2, 3, 4, 5, 6, 7, 8])
    queries, hits = pool.queries, pool.hits

    def chunk(n, total):  # at most 3 tokens a prefill
        return min(total - n, 3)

    assert pool.next_pending(chunk) == (a, 3, (1, 2, 3, 4, 5, 6))
    b = pool.store([1, 2, 3, 4, 5, 6])
    assert pool.next_pending(chunk) == (b, 6, (1, 2, 3, 4, 5, 6, 7, 8))
    pool.store([1, 2, 3, 4, 5, 6, 7, 8])
    assert pool.next_pending(chunk) is None and not pool.pending  # [9, 9, 9, 9] had no kept prefix
    assert (pool.queries, pool.hits) == (queries, hits)  # idle work is not a request's lookup
    pool.remember([1, 2, 3, 4, 5, 6])  # kept already
    assert not pool.pending
    pool.remember([1, 2, 3, 9])
    assert pool.next_pending(lambda n, total: None) is None  # no room after any kept prefix
    for i in range(PENDING_ANSWERS + 2):
        pool.remember([1, 2, 3, 100 + i])
    assert len(pool.pending) == PENDING_ANSWERS and pool.next_pending(chunk)[2] == (1, 2, 3, 100 + PENDING_ANSWERS + 1)
    pool.clear()
    assert not pool.pending and len(pool) == 0


def test_pool_finds_where_prompts_part():
    """``shared``: the most leading tokens a prompt has in common with a kept prompt (a kept prefix counts whole), at
    most all but its last token; kept answers (``store(answer=True)``) are not looked at, until a request's prompt
    is the same sequence."""
    pool = PrefixPool(4, min_tokens=3)
    pool.store([1, 2, 3, 4, 5, 6])
    pool.store([1, 2, 7, 8, 9])
    queries, hits = pool.queries, pool.hits
    assert pool.shared([1, 2, 3, 4, 9, 9]) == 4 and pool.shared([1, 2, 7, 0]) == 3
    assert pool.shared([1, 2, 3]) == 2 and pool.shared([1, 2, 3, 4, 5, 6, 7]) == 6  # all but its last token
    assert pool.shared([9, 1, 2]) == 0 and pool.shared([]) == 0
    pool.store([5, 5, 5, 5, 5], answer=True)
    assert pool.shared([5, 5, 5, 5, 0]) == 0  # a conversation's prompt + answer
    pool.store([5, 5, 5, 5, 5])  # now a request's prompt
    assert pool.shared([5, 5, 5, 5, 0]) == 4
    pool.store([6, 6, 6, 6], answer=True)
    pool.store([7, 7, 7, 7])  # evicts the least recent ([1..6]); the answer stays an answer
    assert pool.shared([1, 2, 3, 4, 0]) == 2 and pool.shared([6, 6, 6, 0]) == 0
    assert (pool.queries, pool.hits) == (queries, hits)  # not a lookup: nothing counted


@pytest.fixture(scope="module")
def backend(pair):  # noqa: F811
    target, drafter, _ = pair
    return SlotBackend(target, drafter, num_slots=2, max_len=160, prompt_buckets=(16, 64), batch_buckets=(2,),
                       prefix_pool=2, prefix_min_tokens=8)


def _serve(eng, sp: SamplingRequest) -> Request:
    """One request, then the engine's idle work (its answer kept) before the next: a request that arrives first
    is served first, and the next turn would find only the prompt kept."""
    req = eng.submit(Request(sp, lambda ev: None, ignore_eos=True))
    _wait_until_finished(eng, [req], 600)
    deadline = time.time() + 600
    while eng.backend.idle_pending():
        assert time.time() < deadline and eng.error is None, eng.error
        time.sleep(0.01)
    return req


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)])
def test_a_conversation_prefills_only_its_new_tokens(pair, backend, setting):  # noqa: F811
    target, drafter, tok = pair
    backend.prefix.clear()
    backend.answers_kept = 0
    metrics = ServeMetrics("m", max_positions=backend.G + 1)
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id, metrics=metrics).start()
    rng = np.random.default_rng(3)
    prompt = [1] + rng.integers(3, target.config.vocab_size, 39).tolist()
    cached, total = [], 0
    try:
        for turn, (max_new, message) in enumerate(((16, 12), (16, 5), (16, 0))):  # one generate program a bucket
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
    # each turn's prompt and answer were kept (the answer while the engine was idle): a turn prefills its message
    assert cached == [0, 40 + 16, 40 + 16 + 12 + 16], cached
    assert backend.answers_kept == 3
    text = metrics.exposition().decode()
    assert f'vllm:prefix_cache_hits_total{{model_name="m"}} {float(sum(cached))}' in text
    assert f'vllm:prefix_cache_queries_total{{model_name="m"}} {float(total)}' in text


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)])
def test_prompts_that_share_a_beginning_keep_it_where_they_part(pair, backend, setting):  # noqa: F811
    """A system prompt then different messages (``Inserts._split``): the first request keeps its whole prompt, the
    second finds nothing kept but shares 30 tokens with it, so it prefills them first and keeps them, then extends
    them with its own 9; the third finds those 30 kept. Each output equals batch-1 generate of its whole prompt
    (greedy, and sampled with its seed); cached tokens 0, 0, 30; the prefix cache's counters count each prompt
    once. With the split off (``--no-prefix-split``) the same traffic finds nothing kept."""
    target, drafter, tok = pair
    rng = np.random.default_rng(11)
    system = [1] + rng.integers(3, target.config.vocab_size, 29).tolist()
    prompts = [system + rng.integers(3, target.config.vocab_size, k).tolist() for k in (6, 9, 4)]

    def run(split):
        backend.prefix.clear()
        backend.prefix_split, backend.prefix_answers = split, False  # (answers kept would evict, 2 rows)
        metrics = ServeMetrics("m", max_positions=backend.G + 1)
        eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id, metrics=metrics).start()
        splits, cached = backend.splits, []
        try:
            for i, prompt in enumerate(prompts):
                req = _serve(eng, SamplingRequest(tuple(prompt), 16, seed=i, **setting))
                ref = jdspark.generate(target, drafter, np.array(prompt), max_new_tokens=16, seed=i, eos_token_id=-1,
                                       **setting)
                assert req.output_ids == list(ref.tokens), (split, i, req.output_ids, ref.tokens)
                cached.append(req.cached_tokens)
        finally:
            eng.shutdown()
            backend.prefix_split, backend.prefix_answers = True, True
        text = metrics.exposition().decode()
        assert f'vllm:prefix_cache_hits_total{{model_name="m"}} {float(sum(cached))}' in text
        assert f'vllm:prefix_cache_queries_total{{model_name="m"}} {float(sum(map(len, prompts)))}' in text
        return cached, backend.splits - splits, set(backend.prefix.rows)

    cached, splits, rows = run(True)
    assert cached == [0, 0, 30] and splits == 1 and tuple(system) in rows and not backend.prefix.pinned
    # the kept beginning is the state a prompt of those 30 tokens leaves (target and drafter caches, the first token)
    row = backend.prefix.rows[tuple(system)]
    backend.prefix_split = False  # (split, it would keep its first 29 tokens, evicting those 30)
    backend.insert(0, SamplingRequest(tuple(system), 2))  # kept already: not stored again
    backend.free(0)
    backend.prefix_split = True
    kept, fresh = jax.tree.map(lambda p: p[row], backend.pool), jax.tree.map(lambda s: s[0], backend.state)
    for part in ("anchor", "cache", "dcache"):
        for a, b in zip(jax.tree.leaves(getattr(kept, part)), jax.tree.leaves(getattr(fresh, part))):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
    cached, splits, rows = run(False)
    assert cached == [0, 0, 0] and splits == 0 and tuple(system) not in rows


def test_a_long_prompt_without_a_kept_prefix_is_refused_by_name(pair, backend):  # noqa: F811
    target, _, _ = pair
    backend.prefix.clear()
    with pytest.raises(ValueError, match="begins with no prompt the prefix cache keeps"):
        backend.insert(0, SamplingRequest(tuple([1] + [5] * 70), 4))
    assert len(backend.prefix) == 0


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)])
def test_a_healed_prompt_extends_a_kept_one(pair, backend, setting):  # noqa: F811
    """Token healing on a prefix-cache hit: the extension program masks the first draw as the insert program does
    (the tokens equal batch-1 generate's of the whole healed prompt with the same ``first_token_ids``), and the
    healed prompt finds the kept one."""
    target, drafter, _ = pair
    backend.prefix.clear()
    rng = np.random.default_rng(5)
    kept = [1] + rng.integers(3, target.config.vocab_size, 39).tolist()
    backend.insert(0, SamplingRequest(tuple(kept), 2))  # its prompt kept
    backend.free(0)
    h = MergingVocab().heal(kept + rng.integers(3, target.config.vocab_size, 6).tolist() + [30])  # ends in "\n"
    sp = SamplingRequest(tuple(h.ids), 16, seed=2, first_token_ids=h.first_ids, **setting)
    out = backend.insert(1, sp)
    assert out.cached == len(kept)
    toks = list(out.tokens)
    while len(toks) < 16:
        toks += backend.step([1])[1].tokens
    backend.free(1)
    ref = jdspark.generate(target, drafter, np.array(h.ids), max_new_tokens=16, seed=2, eos_token_id=-1,
                           first_token_ids=h.first_ids, **setting)
    assert toks[:16] == list(ref.tokens) and toks[0] in h.first_ids


def test_a_plain_backend_extends_too(pair):  # noqa: F811
    """Without a drafter (``--spec off``) a hit extends the target's caches alone: the second prompt's tokens equal
    plain batch-1 decoding of the whole prompt. The third begins with the second and its 40-token answer, longer
    than the largest bucket (32): kept while idle in two chunks (32 + 8), its prompt prefills only its message."""
    target, _, _ = pair
    be = SlotBackend(target, None, num_slots=1, max_len=128, prompt_buckets=(16, 32), prefix_pool=1,
                     prefix_min_tokens=8)
    rng = np.random.default_rng(4)
    first = [1] + rng.integers(3, target.config.vocab_size, 20).tolist()
    second = first + rng.integers(3, target.config.vocab_size, 20).tolist()

    def serve(prompt, cached, max_new):
        out = be.insert(0, SamplingRequest(tuple(prompt), max_new))
        assert out.cached == cached
        toks = list(out.tokens)
        while len(toks) < max_new:
            toks += be.step([0])[0].tokens
        be.free(0)
        ref = jdspark.generate(target, None, np.array(prompt), max_new_tokens=max_new, eos_token_id=-1)
        assert toks[:max_new] == list(ref.tokens)
        return toks[:max_new]

    serve(first, 0, 40)  # every max_new 40: one generate program a prompt bucket
    answer = serve(second, len(first), 40)
    be.keep_answer(SamplingRequest(tuple(second), 40), answer)  # what the engine does when the request ends
    plans = 0
    while be.idle_pending():  # and what it runs while nothing else does
        be.idle_step()
        plans += 1
    assert plans == 2 and be.answers_kept == 2 and list(be.prefix.rows) == [tuple(second + answer)]
    serve(second + answer + rng.integers(3, target.config.vocab_size, 6).tolist(), len(second) + 40, 40)


def test_a_chat_s_next_turn_begins_with_its_last_prompt():
    """What makes chat traffic hit the cache: with the shipped tokenizer and chat template, the server's ids of a
    conversation's next turn begin with the ids of its previous turn's prompt (the template closes each message
    with a special token, so the encoding of what came before never changes), whatever the answer's text."""
    import kimi
    from jdspark.serve_request import parse_completion

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
