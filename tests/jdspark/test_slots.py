"""The serving engine on a tiny built pair, batched: 20 requests of different prompt lengths, completion lengths,
sampling settings, speculation modes (off, fixed, adaptive) and arrival times, served 4 slots at a time through
the Engine's host loop and the SlotBackend, each equal token for token to its own batch-1 ``jdspark.generate``:
greedy ones in every mode, sampled ones that verify whole blocks (the same seed drives the same draws), and sampled
ones with speculation off equal to batch-1 plain decoding with their seed, though their batches verified other
rows' drafts (a step that verifies no drafts draws as a plain step: ``speculative.step_keys``). A sampled request
verified at another width draws with other keys than generate's loop: the same law
(tests/jdspark/test_sampling_law.py), other tokens. Speculating requests accept partially (1 < accept_len < G + 1);
the adaptive steps use several widths."""

import itertools
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdspark
import kimi
from jdspark.adaptive import CostTable, monotone_costs
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.slots import SlotBackend, buckets_up_to
from jdspark.stop_strings import stop_fsm
from kimi.tokenizer import ByteTokenizer, Tokenizer
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


def _wait_until_finished(eng, reqs, seconds: float) -> None:
    """Poll until every request has finished; fail on the engine's error or after ``seconds``."""
    deadline = time.time() + seconds
    while not all(r.finished for r in reqs):
        assert time.time() < deadline and eng.error is None, eng.error
        time.sleep(0.05)


def test_buckets():
    assert buckets_up_to(16) == (1, 2, 4, 8, 16) and buckets_up_to(6) == (1, 2, 4, 6) and buckets_up_to(1) == (1,)


@pytest.fixture(scope="module")
def backend(pair):
    """One 4-slot backend for the module (its programs compile once): verify widths 1, 4 and G + 1; multi-step
    launches of 3 steps whenever the engine has no request waiting; requests admitted together prefill two at a
    time (``insert_batch``)."""
    target, drafter, _ = pair
    G = drafter.config.block_size
    return SlotBackend(target, drafter, num_slots=4, max_len=128, prompt_buckets=(64,), batch_buckets=(4,),
                       adaptive=True, widths=(1, 4, G + 1), multi_step=3, multi_step_max_batch=4, insert_batch=2)


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
    be.insert_groups.clear()
    try:
        for i, p in enumerate(prompts):
            st = SETTINGS[i % 2]
            mode = "adaptive" if i < 10 else "fixed"  # the first half is served mostly among adaptive rows only
            sp = SamplingRequest(tuple(int(x) for x in p[:24 + (i * 7) % 37]), 8 + (i * 5) % (MAX_NEW - 7),
                                 seed=i, speculative=i % 4 != 3, spec_mode=mode, **st)
            reqs.append(Request(sp, lambda ev: None))
            if i in (0, 1, 2):  # the first three arrive together: admitted at once, two prefill as one batch
                continue
            eng.submit_all(reqs[:4] if i == 3 else reqs[-1:])
            time.sleep(0.02 * (i % 3))  # arrivals spread over the others' steps
        _wait_until_finished(eng, reqs, 900)
    finally:
        eng.shutdown()
    assert be.insert_groups[2] >= 1, be.insert_groups  # (the fifth and later may join groups too)
    eos = target.config.eos_token_id  # EOS ends a request as "stop", also when it is the max_tokens-th token
    assert [r.finished for r in reqs] == ["stop" if r.output_ids[-1] == eos else "length" for r in reqs]
    assert all(len(r.output_ids) == r.sampling.max_tokens for r in reqs if r.finished == "length")
    spec_lens = []
    for r in reqs:
        sp = r.sampling
        ref = jdspark.generate(target, drafter, np.array(sp.prompt_ids), max_new_tokens=MAX_NEW, seed=sp.seed,
                               temperature=sp.temperature, top_p=sp.top_p)
        u = r.usage()
        if sp.temperature == 0 or (sp.speculative and sp.spec_mode == "fixed"):
            assert r.output_ids == list(ref.tokens[:sp.max_tokens]), (sp, r.output_ids, ref.tokens)
        elif not sp.speculative:  # sampled, speculation off, stepped among drafting rows (verifies at cap 0 and
            # plain steps alike): batch-1 plain decoding's draws with the same seed (speculative.step_keys)
            plain = jdspark.generate(target, None, np.array(sp.prompt_ids), max_new_tokens=sp.max_tokens,
                                     seed=sp.seed, temperature=sp.temperature, top_p=sp.top_p)
            assert r.output_ids == list(plain.tokens), (sp, r.output_ids, plain.tokens)
        if sp.speculative:
            spec_lens.append(u["accept_len"])
        else:
            assert u["accepted"] == 0 and u["accept_len"] == 1.0
    mean = float(np.mean(spec_lens))
    print(f"engine accept_len per speculating request: {np.round(spec_lens, 2).tolist()} (mean {mean:.2f}); "
          f"steps per verify width {dict(sorted(be.width_counts.items()))}")
    assert 1.0 < mean < G + 1
    assert len([w for w in be.width_counts if 1 < w < G + 1]) >= 1 and be.width_counts[G + 1] > 0
    # served both ways: 3 steps per launch while nothing waited, one per launch while arrivals queued
    assert be.launch_steps[3] > 0 and be.launch_steps[1] > 0, be.launch_steps


def test_inserts_admitted_together(pair, backend):
    """``insert_many``: a request it refuses yields its ValueError alone (its slot untouched); the others of one
    prompt bucket prefill two at a time (``insert_batch``), the last alone, each yielded as it is done; each row
    and first token as its insert alone makes them (up to float rounding: XLA sums a batch's rows in its own
    order), the rows no group touched bit for bit."""
    target, drafter, _ = pair
    be = backend
    ids = [tuple(int(x) for x in p[:20 + 9 * i]) for i, p in enumerate(_prompts(4, 60, target.config.vocab_size))]
    reqs = [SamplingRequest(ids[0], 8, seed=1), SamplingRequest(ids[1], 200, seed=2),  # too long: refused
            SamplingRequest(ids[2], 8, temperature=1.0, seed=3), SamplingRequest(ids[3], 8, seed=4)]
    for s in range(4):
        be.free(s)
    alone = {}
    for s, r in ((0, reqs[0]), (2, reqs[2]), (3, reqs[3])):
        alone[s] = be.insert(s, r).tokens
    rows_alone = jax.device_get(be.state)
    for s in range(4):
        be.free(s)
    be.insert_groups.clear()
    freed = be.params[1].copy()
    got = list(be.insert_many(list(enumerate(reqs))))
    assert [i for i, _ in got] == [1, 0, 2, 3]  # the refusal at once; 0 waits for 2, its partner; 3 last, alone
    out = dict(got)
    assert isinstance(out[1], ValueError) and "exceed the slots' cache" in str(out[1])
    np.testing.assert_array_equal(be.params[1], freed)  # refused before its slot's bookkeeping
    assert {s: out[s].tokens for s in (0, 2, 3)} == alone
    assert dict(be.insert_groups) == {2: 1}
    rows = jax.device_get(be.state)
    for x, y in zip(jax.tree.leaves(rows_alone), jax.tree.leaves(rows)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(x[3], y[3])  # inserted alone both times
        np.testing.assert_allclose(x[[0, 2]].astype(np.float64), y[[0, 2]].astype(np.float64), rtol=1e-5, atol=1e-5)
    for s in range(4):
        be.free(s)


def test_multi_step_launch_equals_single_steps(pair, backend):
    """A launch of 3 steps commits what 3 launches of one commit (greedy and sampled rows, per-step outputs in
    order), and a launch of an uncompiled step count is refused by name."""
    target, _, _ = pair
    be = backend
    ids = [tuple(int(x) for x in p) for p in _prompts(2, 30, target.config.vocab_size)]
    reqs = [SamplingRequest(ids[0], 16, seed=3, spec_mode="fixed"),
            SamplingRequest(ids[1], 16, temperature=1.0, top_p=0.9, seed=4, spec_mode="fixed")]
    runs = []
    for steps in (1, 3):
        for s, r in enumerate(reqs):
            be.insert(s, r)
        got = {0: [], 1: []}
        for _ in range(3 // steps):
            for s, outs in be.collect(be.launch([0, 1], width=be.G + 1, steps=steps)).items():
                assert len(outs) == steps
                got[s] += [(o.tokens, o.drafted, o.accepted) for o in outs]
        runs.append(got)
        for s in range(2):
            be.free(s)
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="steps: 2 per launch"):
        be.launch([0], steps=2)


def test_sampled_slot_equals_generate(pair, backend):
    """A sampled request alone in the backend (one active slot of four, fixed width) draws what batch-1 generate
    draws with the same seed: with top-p, with a top-k (the launch packs it into float32 with the other per-row
    inputs), with a top-k beyond the vocabulary (the same as none: clamped to V, never overflowing int32), and with
    min-p (a per-row column of the launch, a static setting of generate's program)."""
    target, drafter, tok = pair
    ids = tuple(int(x) for x in _prompts(2, 32, target.config.vocab_size)[1])
    be = backend
    outs = []
    for top_k, ref_top_k, min_p in ((0, 0, 0.0), (37, 37, 0.0), (10**12, 0, 0.0), (0, 0, 0.1)):
        sp = SamplingRequest(ids, MAX_NEW, temperature=1.0, top_p=0.95, top_k=top_k, seed=1, spec_mode="fixed",
                             min_p=min_p)
        out = be.insert(2, sp).tokens
        while len(out) < MAX_NEW:
            out += be.step([2])[2].tokens
        ref = jdspark.generate(target, drafter, np.array(ids), max_new_tokens=MAX_NEW, seed=1, temperature=1.0,
                               top_p=0.95, top_k=ref_top_k, eos_token_id=-1, min_p=min_p)
        assert out[:MAX_NEW] == list(ref.tokens), (top_k, min_p)
        outs.append(out[:MAX_NEW])
    assert outs[3] != outs[0]  # min-p changed the draws (same seed)


class MergingVocab(Tokenizer):
    """64 ids whose pieces extend one another as a BPE vocabulary's do ("\n" < "\n " < "\n  " < "\n    ", "a" <
    "ab" < "abc"), for the tiny pair: a healed prompt ending in "\n" or "a" leaves its first token a choice."""

    kind = "test"

    def __init__(self):
        pieces = [None] * 3 + [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]
        pieces += [b" ", b"\n", b"\n ", b"\n  ", b"\n    ", b"ab", b"abc"]
        pieces += [bytes([a, b]) for a in b"bcdef" for b in b"aeiou"][:64 - len(pieces)]
        super().__init__(pieces, {"<pad>": 0, "<bos>": 1, "<eos>": 2}, vocab_size=64)


def test_healed_requests_equal_batch_one_generate_and_leave_out_the_healed_text(pair, backend):
    """Token healing served (``SamplingRequest.first_token_ids``, ``Request.healed``): among requests that are not
    healed, each healed request's ids equal batch-1 generate's with the same ``first_token_ids`` (greedy, and
    sampled at the fixed width), its first token one of them (not always the prompt's own last token); its text is
    its ids' text without the healed text, and a stop string is found in that text only (one that the healed text
    itself holds does not end the request at its first token, and none is set on the device)."""
    target, drafter, _ = pair
    tok = MergingVocab()
    assert tok.heal([1, 30]).first_ids == (30, 31, 32, 33) and len(tok.heal([1, 3]).first_ids) > 2
    cases = []  # (SamplingRequest, Healing or None, the reference's ids)
    for i, p in enumerate(_prompts(10, 40, target.config.vocab_size)):
        p = [int(t) for t in p[:28 + i]]
        h = tok.heal(p[:-1] + [(30, 3)[i % 4 // 2]]) if i % 2 == 0 else None
        sp = SamplingRequest(tuple(p if h is None else h.ids), 12 + i, seed=i, spec_mode="fixed",
                             first_token_ids=() if h is None else h.first_ids, **SETTINGS[i // 2 % 2])
        # (MAX_NEW tokens for every reference, cut to the request's: one program per setting, not per length)
        ref = jdspark.generate(target, drafter, np.array(sp.prompt_ids), max_new_tokens=MAX_NEW, seed=sp.seed,
                               temperature=sp.temperature, top_p=sp.top_p, eos_token_id=-1,
                               first_token_ids=sp.first_token_ids)
        cases.append((sp, h, [int(t) for t in ref.tokens[:sp.max_tokens]]))
    texts = [tok.decode(ids)[len(h.text) if h else 0:] for _, h, ids in cases]
    # stop strings: the healed text itself ("\n": the ids' text begins with it, the request's does not), and
    # three characters of another healed request's text
    stops = {0: (cases[0][1].text,), 4: (texts[4][5:8],)}
    on_device = backend.stops_on_device["set"]
    eng = Engine(backend, tok, eos_token_id=None, max_waiting=32).start()
    try:
        reqs = [eng.submit(Request(sp, lambda ev: None, healed="" if h is None else h.text, stop=stops.get(i, ())))
                for i, (sp, h, _) in enumerate(cases)]
        _wait_until_finished(eng, reqs, 300)
    finally:
        eng.shutdown()
    firsts = []
    for r, (sp, h, ids), text in zip(reqs, cases, texts):
        assert r.output_ids == ids[:len(r.output_ids)], (sp, r.output_ids, ids)
        if h is not None:
            assert r.output_ids[0] in h.first_ids and tok.decode(ids).startswith(h.text)
            firsts.append(r.output_ids[0] != p_last(h, tok))
        cut = min((text.find(x) for x in r.stop if x in text), default=-1)
        if cut >= 0:
            assert r.finished == "stop" and r.text == text[:cut] and len(r.output_ids) > 1
        else:
            assert r.finished == "length" and r.output_ids == ids and r.text == text
    assert reqs[4].finished == "stop"
    # no stop automaton on the device for a healed request: it would read the healed text and end the row there
    assert backend.stops_on_device["set"] == on_device
    assert any(firsts), "every healed request drew its prompt's own last token: the mask was not exercised"


def p_last(h, tok) -> int:
    """The id a healed prompt ended on (the one whose bytes are the healed text)."""
    return next(i for i in h.first_ids if tok.token_bytes(i) == h.text.encode())


def test_adaptive_re_times_a_width_it_has_not_run(backend):
    """With a table that always prefers the whole block, every other width is still run twice in a row now and
    then (so a width warm_up timed badly is re-timed: the second step is the steady-state one collect times), at
    most once per EXPLORE_EVERY steps and, priced by the tokens a narrower step does not verify
    (``adaptive.retime_extra``), within ``adaptive.PROBE_BUDGET`` of the steps; the scheduler's pick the rest of
    the time."""
    from jdspark.adaptive import PROBE_BUDGET, expected_tokens
    from jdspark.slots import EXPLORE_EVERY

    be = backend
    G = be.G
    saved = (dict(be.costs), be.timings, dict(be._adaptive_steps), dict(be._last_run), list(be.modes),
             be.params.copy(), be.tracker.curve_SG.copy(), dict(be._explore))
    try:
        be.costs = monotone_costs({(4, w): 1.0 for w in be.widths})
        be.timings = CostTable()
        for k, v in be.costs.items():
            be.timings.observe(k, v)
        be._adaptive_steps, be._last_run, be._explore = {}, {}, {}
        for s in range(4):
            be.params[s, 3], be.modes[s] = G, "adaptive"
        be.tracker.curve_SG[:4] = 0.9
        picks = []
        n_steps = 1000
        for _ in range(n_steps):
            w = be.choose_width([0, 1, 2, 3])
            be.ran(4, w)
            picks.append(w)
        others = [w for w in picks if w != G + 1]
        assert sorted(set(others)) == [w for w in be.widths if w != G + 1]
        runs = [(w, len(list(g))) for w, g in itertools.groupby(picks) if w != G + 1]
        assert runs and all(n % 2 == 0 for _, n in runs)  # each re-timing is two steps of its width
        for w in set(others):  # no width re-timed more often than every EXPLORE_EVERY steps
            assert others.count(w) <= 2 * (n_steps // EXPLORE_EVERY + 1)
        # what the re-timings cost in tokens: each step of width w commits E(w) where the whole block commits
        # E(G + 1) at the same cost (the flat table); the loss stays within the budget (+ one round of rounding)
        curves, caps = be.tracker.curve_SG[:4], be.params[:4, 3].astype(np.int64)
        e = {w: expected_tokens(curves, caps, w) for w in be.widths}
        lost = sum(1 - e[w] / e[G + 1] for w in others)
        assert lost <= PROBE_BUDGET * n_steps + 2 * len(be.widths)
        assert lost > 0.5 * PROBE_BUDGET * n_steps / len(be.widths)  # and they do happen: a budget, not a ban
    finally:
        (be.costs, be.timings, be._adaptive_steps, be._last_run, be.modes, be.params,
         be.tracker.curve_SG, be._explore) = saved


def test_served_steps_time_the_cost_table_except_across_a_prefill(pair, backend):
    """A served (scheduler-chosen) step adds its time to its (batch, width) timings in steady state: after a step
    of the same (batch, width), and not when it shared the device with a prefill (an insert between its launch
    and its collect, as an arriving request does: its wall time is the prefill's as much as the step's)."""
    target, _, _ = pair
    be = backend
    saved = (dict(be.costs), be.timings, list(be.modes), be.params.copy(), be._adaptive_steps, be._last_run,
             be._explore)
    try:
        be._adaptive_steps, be._last_run, be._explore = {}, {}, {}  # no re-timing step due from earlier tests
        be.timings = CostTable()
        for w in be.widths:
            be.timings.observe((4, w), 1.0)
        be.costs = dict(be.timings.table)
        ids = tuple(int(x) for x in _prompts(1, 24, target.config.vocab_size)[0])
        for s in range(4):
            be.insert(s, SamplingRequest(ids, 8, spec_mode="adaptive"))
        counts = lambda: {k: len(v) for k, v in be.timings.samples.items()}  # noqa: E731
        before = counts()
        be.collect(be.launch([0, 1, 2, 3], width=1))  # an explicit width (not timed): a plain step
        h = be.launch([0, 1, 2, 3])
        assert h["W"] > 1  # a flat table: the widest width pays
        be.collect(h)
        assert counts() == before  # its predecessor was a plain step, whose commit its time would hold
        h2 = be.launch([0, 1, 2, 3])
        assert h2["W"] == h["W"]
        be.insert(3, SamplingRequest(ids, 8, spec_mode="adaptive"))  # a request arrives while the step runs
        be.collect(h2)
        assert counts() == before
        h3 = be.launch([0, 1, 2, 3])
        assert h3["W"] == h["W"]
        be.collect(h3)
        grown = {k for k in counts() if counts()[k] != before[k]}
        assert grown == {(4, h["W"])} and counts()[(4, h["W"])] == before[(4, h["W"])] + 1
        assert 0 < be.timings.samples[(4, h["W"])][-1] < 1.0  # a real step's seconds, not the seeded 1.0
    finally:
        be.costs, be.timings, be.modes, be.params, be._adaptive_steps, be._last_run, be._explore = saved
        for s in range(4):
            be.free(s)


def test_adaptive_drafts_again_after_a_run_of_plain_steps(backend):
    """Curves that make a plain step pay keep the step plain until a slot has stepped plainly a run of times
    (``adaptive.probe_interval`` of the cheapest drafting width's extra cost); then the scheduler picks that width
    (the tracker's refresh), not plain again."""
    from jdspark.adaptive import probe_interval

    be = backend
    saved = (dict(be.costs), be.timings, list(be.modes), be.params.copy(), be.tracker.curve_SG.copy(),
             be.tracker.plain_run_S.copy())
    try:
        be.timings = CostTable()  # a table set from outside: no re-timing steps
        be.costs = monotone_costs({(4, w): 1.0 + w for w in be.widths})
        for s in range(4):
            be.params[s, 3], be.modes[s] = be.G, "adaptive"
        be.tracker.curve_SG[:4] = 0.05
        be.tracker.plain_run_S[:4] = 0
        cheapest = min(w for w in be.widths if w > 1)
        after = probe_interval(be.costs[(4, cheapest)] / be.costs[(4, 1)] - 1)
        assert after == 150  # width 4: (1 + 4) / (1 + 1) - 1 = 1.5 plain steps extra, at a budget of 0.01
        picks = []
        for _ in range(after + 1):
            picks.append(be.choose_width([0, 1, 2, 3]))
            if picks[-1] == 1:
                for s in range(4):
                    be.tracker.stepped_plain(s)
            be.tracker.curve_SG[:4] = 0.05  # the prior stays pessimistic too
        assert picks[:-1] == [1] * after and picks[-1] == cheapest
    finally:
        (be.costs, be.timings, be.modes, be.params, be.tracker.curve_SG, be.tracker.plain_run_S) = saved


def _lengths(be, slot: int) -> tuple:
    """(target cache length, drafter context length) of one slot."""
    return int(np.asarray(be.state.cache.length)[slot].reshape(-1)[0]), int(np.asarray(be.state.dcache.length)[slot])


def test_a_plain_step_extends_the_drafters_context(pair, backend):
    """A slot stepped plainly (width 1, as adaptive verification chooses) still appends the decoded position to
    its drafter context, so the next drafted block reads every committed position: the drafter's context length
    follows the target cache's through plain and drafted steps (a hole per plain step degraded later drafts)."""
    target, _, _ = pair
    be = backend
    ids = tuple(int(x) for x in _prompts(1, 20, target.config.vocab_size)[0])
    be.insert(1, SamplingRequest(ids, 30, spec_mode="fixed"))
    try:
        for w in (1, 1, be.G + 1, 1, 4):
            be.step([1], width=w)
            t_len, d_len = _lengths(be, 1)
            assert d_len == t_len, (w, d_len, t_len)
    finally:
        be.free(1)


def test_rows_that_never_draft_step_without_the_drafter(pair, backend):
    """A request with ``speculative: false`` (draft cap 0 for its whole life) is stepped by the drafter-free plain
    program: its drafter context stays at the prompt while its target cache grows (no drafter work is paid for
    traffic that never drafts). A step that holds a drafting row as well (width 1, as adaptive verification
    chooses) extends every row's context: the rows share one program. (This backend's one batch bucket is all 4
    slots: a step runs every slot, and its drafter-free form needs every slot's cap to be 0.)"""
    target, _, _ = pair
    be = backend
    prompts = _prompts(2, 20, target.config.vocab_size)
    be.insert(1, SamplingRequest(tuple(int(x) for x in prompts[0]), 30, speculative=False))

    try:
        t0, d0 = _lengths(be, 1)
        assert d0 == t0
        h = be.launch([1])
        assert h["W"] == 1 and not h["extend"] and not h["timed"]
        be.collect(h)
        be.step([1])
        assert _lengths(be, 1) == (t0 + 2, d0)  # two decoded positions; the drafter's context untouched
        be.insert(2, SamplingRequest(tuple(int(x) for x in prompts[1]), 30, spec_mode="fixed"))
        t2, d2 = _lengths(be, 2)
        be.step([1, 2], width=1)  # slot 2 drafts on other steps: its context follows its cache
        assert _lengths(be, 2) == (t2 + 1, d2 + 1) and _lengths(be, 1)[1] == d0 + 1
    finally:
        be.free(1)
        be.free(2)


def test_a_windowed_drafter_serves_what_batch_one_generate_makes(pair, backend):
    """The drafter reading a ring of 8 context positions (``with_context_window``: the ring wraps several times in
    a slot of 128) serves, under the slots' vmap, what batch-1 generate with the same windowed drafter makes,
    token for token, with the same acceptance where both verify whole blocks: greedy requests in fixed and adaptive
    mode and one that never drafts, 2 slots. A slot's ring holds what the whole context holds of its last 8
    positions: the same stream stepped in the module's whole-context backend, rearranged (``ring_from_linear``)."""
    from jdspark.drafter import DrafterCache, ring_from_linear, with_context_window

    target, drafter, tok = pair
    ring = with_context_window(drafter, 8)
    G = ring.config.block_size
    be = SlotBackend(target, ring, num_slots=2, max_len=128, prompt_buckets=(64,), batch_buckets=(2,),
                     adaptive=True, widths=(1, G + 1))
    assert be.state.dcache.k.shape[-1] == 8 and be.state.dcache.v.shape[-2] == 8
    be.costs = monotone_costs({(2, 1): 1.0, (2, G + 1): 1.5})
    eng = Engine(be, tok, eos_token_id=target.config.eos_token_id, max_waiting=8).start()
    prompts = _prompts(5, 60, target.config.vocab_size)
    reqs = []
    try:
        for i, p in enumerate(prompts):
            n_new = MAX_NEW if i % 2 == 0 else MAX_NEW - 3 * i  # fixed-mode rows whole: their stats compare
            sp = SamplingRequest(tuple(int(x) for x in p[:30 + 6 * i]), n_new, seed=i,
                                 speculative=i != 4, spec_mode="adaptive" if i % 2 else "fixed")
            reqs.append(eng.submit(Request(sp, lambda ev: None)))
        _wait_until_finished(eng, reqs, 600)
    finally:
        eng.shutdown()
    for r in reqs:
        sp = r.sampling
        # one max_new_tokens for every reference: one generate program compiled, not one per length
        ref = jdspark.generate(target, ring, np.array(sp.prompt_ids), max_new_tokens=MAX_NEW, seed=sp.seed)
        assert r.output_ids == list(ref.tokens[:sp.max_tokens]), (sp, r.output_ids, ref.tokens)
        if sp.speculative and sp.spec_mode == "fixed":
            assert sp.max_tokens == MAX_NEW
            # the same drafts as generate's windowed drafter (whole blocks verified both ways): the same acceptance;
            # greedy tokens alone would match whatever the drafter read (lossless)
            u = r.usage()
            assert (u["drafted"], u["accepted"]) == (int(ref.stats.drafted), int(ref.stats.accepted)), (u, ref.stats)
    ids = tuple(int(x) for x in prompts[0][:40])
    for b in (be, backend):
        b.insert(0, SamplingRequest(ids, 30, spec_mode="fixed"))
    try:
        for _ in range(3):
            for b in (be, backend):
                b.step([0], width=G + 1)
        assert _lengths(be, 0) == _lengths(backend, 0) and _lengths(be, 0)[1] > 8
        d = backend.state.dcache
        want = ring_from_linear(DrafterCache(d.k[0], d.v[0], d.length[0]), 8)
        np.testing.assert_allclose(be.state.dcache.k[0], want.k, atol=1e-5, rtol=0)
        np.testing.assert_allclose(be.state.dcache.v[0], want.v, atol=1e-5, rtol=0)
    finally:
        be.free(0)
        backend.free(0)


def test_warm_up_runs_what_compile_all_compiled(pair):
    """``compile_all`` compiles every program a backend serves ahead of time, two at a time; ``warm_up`` then runs
    each of them without one more compile (no compile request reaches XLA or the persistent cache): the ahead-of-
    time arguments and a launch's are built in one place and name the same programs. A backend of a shape no other
    test builds (12 slots, caches of 96), so its programs are new to this process. With prefix caching: each
    bucket's insert, extension and the copy into the pool run in warm-up too (the jitted calls' caches do not grow
    when requests of either bucket and a prefix-cache hit are served after, healed or not), and warm-up keeps no
    prompt."""
    from jax import monitoring

    from jdspark import prefix
    from jdspark.slot_programs import insert_row as _insert
    from jdspark.slot_programs import insert_rows as _rows

    target, drafter, _ = pair
    be = SlotBackend(target, drafter, num_slots=12, max_len=96, prompt_buckets=(16, 32), batch_buckets=(12,),
                     widths=(1, drafter.config.block_size + 1), prefix_pool=3, prefix_min_tokens=8, insert_batch=4)
    events = []
    compiles = {"/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/compile_requests_use_cache"}

    def on_event(name, *args, **kw):
        if name in compiles:
            events.append(name)

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_event)
    try:
        # 2 inserts, 4 group inserts (2 and 4 prompts a bucket) and 2 extensions; the snapshot; a request's stop
        # strings; width 1 twice (without and with the drafter's context); G + 1
        assert be.group_sizes() == (2, 4) and len(be.programs()) == 9 and len(be.group_programs()) == 4
        assert be.compile_all(threads=2) == 13 and be.insert_batch == 4
        # a compile request per program: through the persistent cache where it is on (tests/conftest.py), else
        # straight to XLA
        req = "/jax/compilation_cache/compile_requests_use_cache"
        assert (events.count(req) or events.count("/jax/core/compile/backend_compile_duration")) >= 13
        del events[:]
        be.warm_up()
        assert events == [] and len(be.prefix) == 0
        sizes = [f._cache_size() for f in (_insert, _rows, prefix.extend, prefix.snapshot)]
        a, b = tuple(range(3, 13)), tuple(range(60, 90))
        for ids in (a, b, a + tuple(range(20, 40)), b + (50,)):  # buckets 16 and 32, then their extensions
            be.insert(0, SamplingRequest(ids, 4))
        assert be.prefix.hits == len(a) + len(b)
        # admitted together: prompts of a bucket prefill as groups of the compiled sizes (3: 2, then 1 alone; no
        # compile); a prompt that begins with a waiting one lets it go first (alone) and finds it kept, a hit, as
        # one at a time
        be.insert_groups.clear()
        hits = be.prefix.hits
        list(be.insert_many([(0, SamplingRequest(tuple(range(30, 44)), 4)),
                             (1, SamplingRequest(tuple(range(5, 17)), 4)),
                             (5, SamplingRequest(tuple(range(60, 47, -1)), 4))]))
        assert dict(be.insert_groups) == {2: 1} and be.prefix.hits == hits
        f = tuple(range(40, 51))
        list(be.insert_many([(2, SamplingRequest(f, 4)), (3, SamplingRequest(f + (7,), 4))]))
        assert dict(be.insert_groups) == {2: 1} and be.prefix.hits == hits + len(f)
        be.insert(0, SamplingRequest(a, 4, stop_fsm=stop_fsm(("ab",), ByteTokenizer())))  # its automaton set
        assert be.stops_on_device["set"] == 1
        # token healing's first-token mask, on an insert and on a prefix-cache hit: the same programs
        be.insert(0, SamplingRequest(b[:-1], 4, first_token_ids=(5, 7)))
        be.insert(0, SamplingRequest(a + tuple(range(20, 31)), 4, first_token_ids=(9,)))
        assert [f._cache_size() for f in (_insert, _rows, prefix.extend, prefix.snapshot)] == sizes and events == []
    finally:
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_event)


def test_compile_all_refuses_programs_past_the_memory_map_limit(backend, monkeypatch):
    """XLA:CPU maps each fused kernel of a program on its own; past Linux's vm.max_map_count a compile aborts the
    process inside LLVM. ``compile_all`` compiles one program, prices the rest by its maps and raises a clear error
    before the others compile (here: 1000 maps a program against a limit of 6000 less the headroom)."""
    from jdspark import graphs

    reads = iter([(1000, 6000), (2000, 6000)])  # before and after the one program priced
    monkeypatch.setattr(graphs, "memory_maps", lambda: next(reads))

    class NoPool:  # the remaining programs must not start compiling
        def __init__(self, *a, **k):
            raise AssertionError("compiled the rest past the budget")

    monkeypatch.setattr(graphs.concurrent.futures, "ThreadPoolExecutor", NoPool)
    with pytest.raises(RuntimeError, match=r"vm\.max_map_count.*--prompt-buckets"):
        backend.compile_all(threads=1)
    assert next(reads, None) is None  # both reads taken: the price came from a compile


def test_compile_all_leaves_out_the_group_inserts_where_the_maps_would_not_hold_them(backend, monkeypatch, capsys):
    """The group inserts are optional programs: where the memory maps would hold every other program but not them
    too, ``compile_all`` compiles the others, says so, and the backend inserts one prompt at a time from then on
    (the default server's 4 prompt buckets on a CPU: 62 programs would need ~67k maps of Linux's 65530)."""
    from jdspark import graphs, slots
    from jdspark.graphs import MAP_HEADROOM, TYPICAL_SHARE

    n, g = len(backend.programs()), len(backend.group_programs())
    assert backend.insert_batch == 2 and g == 1
    monkeypatch.setattr(backend, "insert_batch", 2)  # restored after the test
    limit = 2000 + (n - 1) * int(TYPICAL_SHARE * 1000) + MAP_HEADROOM  # the n fit exactly, n + 1 do not
    reads = iter([(1000, limit)] + [(2000, limit)] * (2 * n + 2))
    monkeypatch.setattr(graphs, "memory_maps", lambda: next(reads))
    compiled = []
    fake = types.SimpleNamespace(lower=lambda *a, **k: types.SimpleNamespace(compile=lambda: compiled.append(1)))
    real = slots.SlotBackend.programs
    monkeypatch.setattr(slots.SlotBackend, "programs", lambda self: [(fake, (), {})] * (n - 1) + real(self)[-1:])
    assert backend.compile_all(threads=1) == n and len(compiled) == n - 1  # the priced one compiled for real
    assert backend.insert_batch == 1 and backend.group_sizes() == ()
    assert "batched inserts off: their 1 programs would not fit" in capsys.readouterr().err


def test_compile_all_stops_before_a_compile_that_could_pass_the_limit(backend, monkeypatch):
    """The start-up estimate prices the programs at TYPICAL_SHARE of the first (a typical figure, not a bound), so
    a start-up it lets through is still guarded compile by compile (``graphs.MapGuard``): here the estimate fits,
    then the process's maps grow faster than it said, and the next compile is refused with the same advice
    before it starts."""
    from jdspark import graphs, slots
    from jdspark.graphs import LARGEST_SHARE, MAP_HEADROOM, TYPICAL_SHARE, MapBudgetError

    n = len(backend.programs())
    limit = 2000 + (n - 1) * int(TYPICAL_SHARE * 1000) + MAP_HEADROOM  # the estimate fits exactly
    reads = iter([(1000, limit), (2000, limit), (limit - MAP_HEADROOM - int(LARGEST_SHARE * 1000) + 1, limit)])
    monkeypatch.setattr(graphs, "memory_maps", lambda: next(reads))
    compiled = []
    real = slots.SlotBackend.programs

    def programs(self):  # the first (priced) compile is real; any later one would be recorded
        progs = real(self)
        return [(types.SimpleNamespace(lower=lambda *a, **k: compiled.append(1)), (), {})] * (n - 1) + progs[-1:]

    monkeypatch.setattr(slots.SlotBackend, "programs", programs)
    with pytest.raises(MapBudgetError, match=rf"{n - 1} serving programs are still to compile.*--prompt-buckets"):
        backend.compile_all(threads=1)
    assert compiled == [] and next(reads, None) is None


def test_pin_cpu_workers_gives_each_worker_thread_its_own_core():
    """``graphs.pin_cpu_workers``: XLA:CPU's worker threads (named as the pinned jaxlib names them) each pinned to one
    core of the process's set, round robin, as it reports; a name no thread has pins nothing. The threads' own sets
    are restored after (the rest of this process's tests run on them)."""
    from jdspark import graphs

    jnp.ones(8).sum().block_until_ready()  # the runtime has made its threads
    tids = sorted(int(t) for t in os.listdir("/proc/self/task")
                  if open(f"/proc/self/task/{t}/comm").read().strip() == graphs.XLA_CPU_WORKER)
    assert tids, f"no thread named {graphs.XLA_CPU_WORKER!r}: the jaxlib names its workers otherwise"
    cpus = sorted(os.sched_getaffinity(0))
    before = {t: os.sched_getaffinity(t) for t in tids}
    try:
        pinned = graphs.pin_cpu_workers()
        if len(cpus) < 2:
            assert pinned == []
        else:
            assert pinned == [(t, cpus[k % len(cpus)]) for k, t in enumerate(tids)]
            assert all(os.sched_getaffinity(t) == {c} for t, c in pinned)
            assert len({c for _, c in pinned}) == min(len(tids), len(cpus))
        assert graphs.pin_cpu_workers("no-such-thread") == []
    finally:
        for t, a in before.items():
            os.sched_setaffinity(t, a)


def test_the_memory_map_budget():
    """``check_map_budget``: used + remaining x per program against the limit less MAP_HEADROOM; ``memory_maps``
    reads this process's maps and the system's limit (Linux)."""
    from jdspark.graphs import MAP_HEADROOM, MapBudgetError, MapGuard, check_map_budget, memory_maps

    check_map_budget(40, 1000, 3000, 65530)  # the default server's shape: 44 programs
    check_map_budget(0, 1000, 65530 - MAP_HEADROOM, 65530)  # exactly at the budget
    with pytest.raises(RuntimeError, match="about 66530 memory maps"):
        check_map_budget(60, 1000, 6530, 65530)
    guard = MapGuard(3, 1000, read=lambda: (10_000, 10_000 + MAP_HEADROOM + 2 * 1250))
    guard.enter()  # one compile priced at 1250: fits
    guard.enter()  # and a second beside it: 2 x 1250 fits exactly
    with pytest.raises(MapBudgetError, match="1 serving programs are still to compile, ~850 memory maps"):
        guard.enter()  # a third at once would not
    guard.leave()
    guard.enter()  # one done: room again
    got = memory_maps()
    if os.path.exists("/proc/self/maps"):
        assert got is not None and 0 < got[0] < got[1]
