"""The serving engine on a tiny built pair, batched: 20 requests of different prompt lengths, completion lengths,
sampling settings, speculation modes (off, fixed, adaptive) and arrival times, served 4 slots at a time through
the Engine's host loop and the SlotBackend, each equal token for token to its own batch-1 ``jdspark.generate``:
greedy ones in every mode, and sampled ones that verify whole blocks (the same seed drives the same draws). A
sampled request verified at another width, or with speculation off (its token drawn from p inside the verify
block), draws with other keys than generate's loop: the same law (tests/jdspark/test_sampling_law.py), other
tokens. Speculating requests accept partially (1 < accept_len < G + 1); the adaptive steps use several widths."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

import jdspark
import kimi
from jdspark.adaptive import monotone_costs
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.slots import SlotBackend, buckets_up_to
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target

MAX_NEW = 40
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)]


@pytest.fixture(scope="module")
def pair():
    """A tiny K3-shaped pair built, not trained (tests/jdspark/test_speculative.py): the target's output
    projections scaled by 0.3 (context matters, so drafts fail), the drafter's Markov head holding the target's
    bigram map with a fifth of it wrong, its confidence head reading the previous token (survival curves that move
    the adaptive scheduler). 16 experts: the MoE's gathered path, which vmaps over slots. A tiny pair keeps the
    module's compiles to seconds; the shipped pair's generate is tested in test_shipped_pair.py."""
    cfg = kimi.KimiConfig.tiny(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts=16)
    target = scaled_target(cfg, 0.3, seed=5)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0, seed=5)), 0.2, 4.0, seed=5)
    ch = drafter.confidence_head.proj
    D = cfg.hidden_size
    ch.kernel[...] = jnp.zeros_like(ch.kernel[...]).at[D:, 0].set(jnp.linspace(-1.0, 4.0, cfg.vocab_size))
    ch.bias[...] = jnp.zeros_like(ch.bias[...]) + 1.0
    return target, drafter, ByteTokenizer()


def _prompts(n: int, length: int, vocab: int) -> list:
    rng = np.random.default_rng(0)
    return [np.concatenate([[1], rng.integers(3, vocab, length - 1)]).astype(np.int32) for _ in range(n)]


def test_buckets():
    assert buckets_up_to(16) == (1, 2, 4, 8, 16) and buckets_up_to(6) == (1, 2, 4, 6) and buckets_up_to(1) == (1,)


@pytest.fixture(scope="module")
def backend(pair):
    """One 4-slot backend for the module (its programs compile once): verify widths 1, 4 and G + 1."""
    target, drafter, _ = pair
    G = drafter.config.block_size
    return SlotBackend(target, drafter, num_slots=4, max_len=128, prompt_buckets=(64,), batch_buckets=(4,),
                       adaptive=True, widths=(1, 4, G + 1))


def test_engine_outputs_equal_batch_one_generate(pair, backend):
    target, drafter, tok = pair
    G = drafter.config.block_size
    be = backend
    # a cost table where verifying grows expensive with width, so the scheduler's choice moves with the survival
    # curves (warm_up would measure this machine's, where the choice may sit at one width): the middle width pays
    # once the calibrated curve's first drafts sum past 0.2, the whole block only past 1.5
    cost = {1: 1.0, G + 1: 2.5}
    be.costs = monotone_costs({(4, w): cost.get(w, 1.2) for w in be.widths})
    eng = Engine(be, tok, eos_token_id=target.config.eos_token_id, max_waiting=32).start()
    prompts = _prompts(20, 60, target.config.vocab_size)
    reqs = []
    try:
        for i, p in enumerate(prompts):
            st = SETTINGS[i % 2]
            mode = "adaptive" if i < 10 else "fixed"  # the first half is served mostly among adaptive rows only
            sp = SamplingRequest(tuple(int(x) for x in p[:24 + (i * 7) % 37]), 8 + (i * 5) % (MAX_NEW - 7),
                                 seed=i, speculative=i % 4 != 3, spec_mode=mode, **st)
            reqs.append(eng.submit(Request(sp, lambda ev: None)))
            time.sleep(0.02 * (i % 3))  # arrivals spread over the others' steps
        deadline = time.time() + 900
        while not all(r.finished for r in reqs):
            assert time.time() < deadline and eng.error is None, eng.error
            time.sleep(0.05)
    finally:
        eng.shutdown()
    assert [r.finished for r in reqs] == ["length" if len(r.output_ids) == r.sampling.max_tokens else "stop"
                                          for r in reqs]
    spec_lens = []
    for r in reqs:
        sp = r.sampling
        ref = jdspark.generate(target, drafter, np.array(sp.prompt_ids), max_new_tokens=MAX_NEW, seed=sp.seed,
                               temperature=sp.temperature, top_p=sp.top_p)
        u = r.usage()
        if sp.temperature == 0 or (sp.speculative and sp.spec_mode == "fixed"):
            assert r.output_ids == list(ref.tokens[:sp.max_tokens]), (sp, r.output_ids, ref.tokens)
        if sp.speculative:
            spec_lens.append(u["accept_len"])
        else:
            assert u["accepted"] == 0 and u["accept_len"] == 1.0
    mean = float(np.mean(spec_lens))
    print(f"engine accept_len per speculating request: {np.round(spec_lens, 2).tolist()} (mean {mean:.2f}); "
          f"steps per verify width {dict(sorted(be.width_counts.items()))}")
    assert 1.0 < mean < G + 1
    assert len([w for w in be.width_counts if 1 < w < G + 1]) >= 1 and be.width_counts[G + 1] > 0


def test_sampled_slot_equals_generate(pair, backend):
    """A sampled request alone in the backend (one active slot of four, fixed width) draws what batch-1 generate
    draws with the same seed."""
    target, drafter, tok = pair
    ids = tuple(int(x) for x in _prompts(2, 32, target.config.vocab_size)[1])
    be = backend
    sp = SamplingRequest(ids, MAX_NEW, temperature=1.0, top_p=0.95, seed=1, spec_mode="fixed")
    out = be.insert(2, sp).tokens
    while len(out) < MAX_NEW:
        out += be.step([2])[2].tokens
    ref = jdspark.generate(target, drafter, np.array(ids), max_new_tokens=MAX_NEW, seed=1, temperature=1.0,
                           top_p=0.95, eos_token_id=-1)
    assert out[:MAX_NEW] == list(ref.tokens)


def test_adaptive_re_times_a_width_it_has_not_run(backend):
    """With a table that always prefers the whole block, every other width is still run once per EXPLORE_EVERY
    steps (so a width warm_up timed badly is re-timed), and the scheduler's pick the rest of the time."""
    from jdspark.slots import EXPLORE_EVERY

    be = backend
    G = be.G
    saved = (dict(be.costs), dict(be.measured), dict(be._adaptive_steps), dict(be._last_run), list(be.modes),
             be.params.copy(), be.tracker.curve_SG.copy())
    try:
        be.costs = monotone_costs({(4, w): 1.0 for w in be.widths})
        be.measured = dict(be.costs)
        be._adaptive_steps, be._last_run = {}, {}
        for s in range(4):
            be.params[s, 3], be.modes[s] = G, "adaptive"
        be.tracker.curve_SG[:4] = 0.9
        picks = []
        for _ in range(3 * EXPLORE_EVERY):
            w = be.choose_width([0, 1, 2, 3])
            be.ran(4, w)
            picks.append(w)
        others = [w for w in picks if w != G + 1]
        assert sorted(set(others)) == [w for w in be.widths if w != G + 1]
        assert len(others) <= 3 * len(be.widths)  # a few re-timing steps, not a change of policy
    finally:
        (be.costs, be.measured, be._adaptive_steps, be._last_run, be.modes, be.params,
         be.tracker.curve_SG) = saved
