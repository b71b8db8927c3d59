"""Log-probabilities of served tokens (``jdspark.logprobs``): the device form against NumPy, then a served
request's entries against an independent computation, the target's prefill of prompt + completion (every
position's logits in one pass), for greedy and sampled requests whose drafts were both accepted and rejected,
speculation off, a first token from a prefix-cache hit, a request without them beside the others, and launches of two
steps (multi-step scheduling: reading step t of a launch as step 0 fails); and
scripts/bench_logprobs.py's arms side by side (on the same pair and shapes, so its programs with log-probabilities
are the served test's)."""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.logprobs import host_entries, token_logprobs, when
from jdspark.slots import SlotBackend
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))

import bench_logprobs  # noqa: E402


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_token_logprobs_equal_numpy_and_skip_when_not_asked():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(5, 37)) * 3).astype(np.float32)
    toks = rng.integers(0, 37, 5).astype(np.int32)
    ref = _log_softmax(logits)
    lp = token_logprobs(jnp.asarray(logits), jnp.asarray(toks), 4)
    np.testing.assert_allclose(lp.chosen_K, ref[np.arange(5), toks], atol=1e-5)
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :4]
    assert (np.asarray(lp.top_ids_KL) == order).all()
    np.testing.assert_allclose(lp.top_KL, np.take_along_axis(ref, order, -1), atol=1e-5)
    fn = jax.jit(lambda flag: when(flag, jnp.asarray(logits), jnp.asarray(toks), 4))
    off, on = fn(False), fn(True)
    assert not np.asarray(off.chosen_K).any() and not np.asarray(off.top_ids_KL).any()
    np.testing.assert_array_equal(on.top_ids_KL, lp.top_ids_KL)
    e = host_entries(np.asarray(lp.chosen_K), np.asarray(lp.top_ids_KL), np.asarray(lp.top_KL), 2, 3)
    assert len(e) == 2 and len(e[1][1]) == 3 and e[1][1][0][0] == int(order[1, 0])
    assert e[0][0] == pytest.approx(float(ref[0, toks[0]]), abs=1e-5)
    assert lp.rank_K is None  # ranks only where asked (the prompt's)
    ranked = token_logprobs(jnp.asarray(logits), jnp.asarray(toks), 4, with_rank=True)
    np.testing.assert_array_equal(ranked.rank_K, (ref >= ref[np.arange(5), toks][:, None]).sum(-1))
    e = host_entries(np.asarray(ranked.chosen_K), np.asarray(ranked.top_ids_KL), np.asarray(ranked.top_KL), 2, 1,
                     np.asarray(ranked.rank_K))
    assert [x[2] for x in e] == np.asarray(ranked.rank_K)[:2].tolist()


@pytest.fixture(scope="module")
def pair():
    """test_slots.py's tiny pair: a built target whose context matters, a drafter whose drafts are partly wrong."""
    cfg = kimi.KimiConfig.tiny(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts=16)
    target = scaled_target(cfg, 0.3, seed=5)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0, seed=5)), 0.2, 4.0, seed=5)
    return target, drafter


def test_served_logprobs_equal_the_targets_prefill_of_the_whole_sequence(pair):
    target, drafter = pair
    be = SlotBackend(target, drafter, num_slots=2, max_len=96, prompt_buckets=(32,), batch_buckets=(2,),
                     prefix_pool=2, prefix_min_tokens=8, max_logprobs=3, multi_step=2, insert_batch=2)
    eng = Engine(be, ByteTokenizer(), eos_token_id=None, max_waiting=8).start()
    rng = np.random.default_rng(1)
    base = [1] + rng.integers(3, 64, 19).tolist()
    asks = [  # (prompt, max_tokens, sampling, logprobs asked)
        (base, 24, dict(), 3),
        (base + rng.integers(3, 64, 6).tolist(), 20, dict(temperature=1.0, seed=7), 2),  # a prefix-cache hit
        ([1] + rng.integers(3, 64, 14).tolist(), 16, dict(speculative=False), 0),
        ([1] + rng.integers(3, 64, 11).tolist(), 18, dict(temperature=0.8, top_p=0.9, seed=3), None),
        ([1] + rng.integers(3, 64, 17).tolist(), 22, dict(temperature=1.0, top_k=5, seed=2), 1),
        # the prompt's too (echo): prefilled whole, past the kept `base` it begins with; and the prompt alone
        (base + rng.integers(3, 64, 4).tolist(), 6, dict(prompt_logprobs=2), 2),
        ([1] + rng.integers(3, 64, 9).tolist(), 0, dict(prompt_logprobs=0), None),
        # last in, so it ends the run with nothing waiting: launches of 2 steps (multi_step), log-probabilities
        # asked, read back by ``collect`` step by step
        ([1] + rng.integers(3, 64, 12).tolist(), 30, dict(), 2),
    ]
    got = [None] * len(asks)
    try:  # the first and the third arrive together: one group insert (insert_batch), their first tokens' entries
        for group in ([0, 2], [1], [3], [4], [5], [6], [7]):
            reqs = []
            for i in group:
                prompt, n, kw, top = asks[i]
                events = []
                reqs.append(Request(SamplingRequest(tuple(prompt), n, logprobs=top, **kw), events.append,
                                    ignore_eos=True))
                got[i] = (reqs[-1], events)
            eng.submit_all(reqs)
        deadline = time.time() + 300
        while not all(r.finished for r, _ in got):
            assert time.time() < deadline and eng.error is None, eng.error
            time.sleep(0.05)
    finally:
        eng.shutdown()
    assert be.launch_steps[2] > 0 and be.launch_steps[1] > 0 and be.insert_groups[2] >= 1
    assert got[1][0].cached_tokens == len(base)  # its first token came from the extension program
    assert got[5][0].cached_tokens == 0  # the prompt's log-probabilities: no cache hit
    with pytest.raises(ValueError, match=r"largest prompt bucket \(32\); prefilled in slices"):  # none past 32
        be.insert(0, SamplingRequest(tuple(base + base), 2, prompt_logprobs=1))
    drafted = sum(r.drafted for r, _ in got)
    accepted = sum(r.accepted for r, _ in got)
    assert 0 < accepted < drafted  # drafts both accepted and rejected among the entries checked below
    # the reference: every prompt + completion in one prefill, right-padded (causal: the padding changes nothing
    # before it), so one program serves them all
    seqs = [prompt + req.output_ids for (prompt, *_), (req, _) in zip(asks, got)]
    T = max(map(len, seqs))
    padded = np.zeros((len(seqs), T), np.int32)
    for i, q in enumerate(seqs):
        padded[i, :len(q)] = q
    refs = _log_softmax(np.asarray(target.prefill(padded, target.init_cache(len(seqs), T)).logits, np.float32))
    for (prompt, n, kw, top), (req, events), ref_T in zip(asks, got, refs):
        ids = [t for ev in events for t in ev.token_ids]
        assert ids == req.output_ids and len(ids) == n
        ptop = kw.get("prompt_logprobs")
        assert all(ev.prompt_logprobs is None for ev in events[ptop is not None:])  # the first event's, if any
        if ptop is not None:  # prompt token i from position i - 1's logits; the first has none
            plp = events[0].prompt_logprobs
            ref = ref_T
            assert len(plp) == len(prompt) and plp[0] is None
            np.testing.assert_allclose([e[0] for e in plp[1:]], ref[np.arange(len(prompt) - 1), prompt[1:]],
                                       atol=2e-4)
            for i, (lp, tops, rank) in enumerate(plp[1:]):
                assert len(tops) == ptop
                np.testing.assert_allclose([v for _, v in tops], np.sort(ref[i])[::-1][:ptop], atol=2e-4)
                # rank: #{v : logp_v >= the token's} (vLLM's), up to float32's reading of near-ties
                assert np.sum(ref[i] > lp + 2e-4) < rank <= np.sum(ref[i] >= lp - 2e-4), (i, rank)
            assert len({e[2] for e in plp[1:]}) > 1  # not all likeliest: the ranks say something
        if top is None:
            assert all(ev.logprobs is None for ev in events)
            continue
        entries = [e for ev in events for e in ev.logprobs]
        assert len(entries) == n
        if n == 0:
            continue
        ref = ref_T[len(prompt) - 1:len(prompt) - 1 + n]  # position len(prompt) - 1 + i predicts token i
        np.testing.assert_allclose([lp for lp, _ in entries], ref[np.arange(n), ids], atol=2e-4)
        for i, (_, tops) in enumerate(entries):
            assert len(tops) == top
            if top:  # the likeliest `top` tokens, most likely first (ids compared by value: ties may swap)
                np.testing.assert_allclose([v for _, v in tops], np.sort(ref[i])[::-1][:top], atol=2e-4)
                np.testing.assert_allclose([v for _, v in tops], ref[i, [j for j, _ in tops]], atol=2e-4)
        if not req.sampling.temperature:  # greedy: each token is the likeliest one
            assert top == 0 or all(tops[0][0] == t for (_, tops), t in zip(entries, ids))


# (--feature guided is the same three arms with other backend arguments; its compiles cost CI ~10 s more: run by
# hand, docs/bench_guided_default_pair.json)
@pytest.mark.parametrize("feature", ["logprobs", "penalties"])
def test_bench_logprobs_times_the_arms_side_by_side(pair, feature):
    target, drafter = pair
    G = drafter.config.block_size
    prompts = [[1] + np.random.default_rng(i).integers(3, 64, 31).tolist() for i in range(2)]
    res = bench_logprobs.run(target, drafter, prompts, slots=2, max_len=96, batches=[2], widths=[G + 1], iters=2,
                             repeats=1, top=3, feature=feature)
    assert res["feature"] == feature
    assert [(c["batch"], c["width"]) for c in res["cells"]] == [(2, G + 1)]
    for c in res["cells"]:
        assert all(c[f"{a}_ms"] > 0 for a in bench_logprobs.ARMS)
        assert c["unasked_over_off"] > 0 and c["asked_over_off"] > 0
    assert all(res["insert"][f"{a}_ms"] > 0 for a in bench_logprobs.ARMS)
    assert set(res["compiled"]) == {"off", "on"} and all(v["compile_s"] > 0 for v in res["compiled"].values())
    with pytest.raises(ValueError, match="overflow"):
        bench_logprobs.run(target, drafter, prompts, slots=2, max_len=40, batches=[2], widths=[G + 1], iters=8,
                           repeats=1, feature=feature)
