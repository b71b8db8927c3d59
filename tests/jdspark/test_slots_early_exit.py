"""A multi-step launch stops once every row of it has ended at one of its stop ids, EOS among them
(``slot_programs.step_rows``' early exit): the rest of the launch that committed a request's end, and the launch the
engine put in flight before it saw it, run no steps (their n_new 0, the slot's caches untouched), so at c = 1 the next
request's prefill does not wait behind them. A row whose request goes on past EOS (``ignore_eos``: EOS not among its
stop ids), or a launch with one row still going, runs every step. The same holds where a row's text comes to hold
one of its stop strings (``jdspark.stop_strings``: an automaton over the ids, spanning ids and the prefill's first
token). Served through the engine, such requests still equal batch-1 ``generate``."""

import dataclasses
import time

import jax
import numpy as np
import pytest

import jdspark
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.slot_programs import STOP_IDS
from jdspark.slots import SlotBackend
from jdspark.stop_strings import stop_fsm
from kimi import KimiConfig
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_speculative import bigram_map, markov_drafter, scaled_target

STEPS = 3


@pytest.fixture(scope="module")
def case():
    """A tiny pair (test_slots.py's recipe) whose EOS is the third token greedy decoding gives after a fixed
    prompt: the insert draws the first, a launch's steps 1 and 2 the next two, so that launch ends at its step 2."""
    cfg = KimiConfig.tiny(vocab_size=64, bos_token_id=1, eos_token_id=None, pad_token_id=0, num_experts=16)
    rng = np.random.default_rng(0)
    probe = scaled_target(cfg, 0.3, seed=5)
    for _ in range(50):  # a prompt whose third greedy token is new (so it is the first EOS) and not a special id
        prompt = np.concatenate([[1], rng.integers(3, 64, 23)]).astype(np.int32)
        ref = [int(t) for t in jdspark.generate(probe, None, prompt, max_new_tokens=8, eos_token_id=-1).tokens]
        if ref[2] > 2 and ref[2] not in ref[:2]:
            break
    else:
        raise AssertionError("no prompt whose third greedy token is new")
    eos = ref[2]
    target = scaled_target(cfg.replace(eos_token_id=eos), 0.3, seed=5)
    drafter = markov_drafter(target, bigram_map(scaled_target(cfg, 0.0, seed=5)), 0.2, 4.0, seed=5)
    be = SlotBackend(target, drafter, num_slots=2, max_len=128, prompt_buckets=(64,), batch_buckets=(1, 2),
                     multi_step=STEPS, multi_step_max_batch=2)
    return target, drafter, be, prompt, ref, eos


def _req(prompt, eos, ends=True, **kw):
    return SamplingRequest(tuple(int(x) for x in prompt), 20, speculative=False, stop_token_ids=(eos,) if ends else (),
                           **kw)


def _served(be, eos, reqs) -> list:
    """``reqs`` served to the end by an engine over ``be`` (pipelined launches of STEPS steps)."""
    eng = Engine(be, ByteTokenizer(), eos_token_id=eos, max_waiting=8).start()
    try:
        reqs = [eng.submit(r) for r in reqs]
        deadline = time.time() + 600
        while not all(r.finished for r in reqs):
            assert time.time() < deadline and eng.error is None, eng.error
            time.sleep(0.05)
    finally:
        eng.shutdown()
    return reqs


def _length(be, slot):
    return int(np.asarray(jax.device_get(be.state.cache.length)).reshape(be.num_slots, -1)[slot, 0])


def test_a_launch_stops_once_its_rows_have_ended_at_eos(case):
    target, drafter, be, prompt, ref, eos = case
    assert be.insert(0, _req(prompt, eos)).tokens == ref[:1]
    n0 = _length(be, 0)
    got = be.collect(be.launch([0], width=1, steps=STEPS))[0]
    assert [o.tokens for o in got] == [[ref[1]], [eos]]  # step 3 not run: EOS at step 2 ended the only row
    assert _length(be, 0) == n0 + 2
    assert be.collect(be.launch([0], width=1, steps=STEPS))[0] == []  # in flight after EOS: no step at all
    assert _length(be, 0) == n0 + 2
    # a drafting launch of the ended row runs nothing either (its drafter untouched)
    assert be.collect(be.launch([0], width=be.G + 1, steps=STEPS))[0] == []
    # ignore_eos (EOS not among its stop ids): every step runs, EOS and past it
    be.insert(0, _req(prompt, eos, ends=False))
    got = be.collect(be.launch([0], width=1, steps=STEPS))[0]
    assert [o.tokens for o in got] == [[ref[1]], [eos], [ref[3]]]
    # any of its stop ids ends a row (up to STOP_IDS of them on the device: one listed later lets the launch run on)
    be.insert(0, _req(prompt, ref[1]))
    assert [o.tokens for o in be.collect(be.launch([0], width=1, steps=STEPS))[0]] == [[ref[1]]]
    others = [t for t in range(3, 64) if t not in ref[:4]][:STOP_IDS]
    be.insert(0, SamplingRequest(tuple(int(x) for x in prompt), 20, speculative=False,
                                 stop_token_ids=(*others, ref[1])))
    assert len(be.collect(be.launch([0], width=1, steps=STEPS))[0]) == STEPS
    # two rows, one ended at EOS and one going on: the launch runs all its steps for both
    be.insert(0, _req(prompt, eos))
    be.insert(1, _req(prompt, eos, ends=False))
    both = be.collect(be.launch([0, 1], width=1, steps=STEPS))
    assert [len(both[0]), len(both[1])] == [STEPS, STEPS] and [o.tokens for o in both[1]][1] == [eos]
    be.free(0)
    be.free(1)


def test_requests_ended_at_eos_equal_batch_one_generate(case):
    """Through the engine (pipelined launches of 3 steps), greedy and sampled, plain and speculating: each request
    that ends at EOS equals its batch-1 generate (greedy ones token for token)."""
    target, drafter, be, prompt, ref, eos = case
    reqs = _served(be, eos, [Request(SamplingRequest(tuple(int(x) for x in prompt), 20, seed=i, speculative=spec,
                                                     temperature=temp, top_p=0.95 if temp else 1.0), lambda ev: None)
                             for i, (spec, temp) in enumerate([(False, 0.0), (True, 0.0), (True, 1.0), (False, 1.0)])])
    assert reqs[0].output_ids == ref[:3] and reqs[0].finished == "stop"
    for r in reqs[:2]:  # greedy: token for token; the sampled ones draw from the same law (test_slots.py)
        want = jdspark.generate(target, drafter if r.sampling.speculative else None, np.array(prompt),
                                max_new_tokens=20, seed=r.sampling.seed)
        assert r.output_ids == [int(t) for t in want.tokens], (r.sampling, r.output_ids, want.tokens)
    assert all(r.sampling.stop_token_ids == (eos,) for r in reqs)  # the engine adds EOS to the ids that end it


def _text(ids) -> str:
    return bytes(int(t) for t in ids).decode("utf-8")  # the tiny vocabulary's ids are ASCII bytes (ByteTokenizer)


def test_a_launch_stops_once_its_rows_text_holds_a_stop_string(case):
    target, drafter, be, prompt, ref, eos = case
    tok = ByteTokenizer()

    def run(stops, speculative=False, width=1):
        sp = dataclasses.replace(_req(prompt, eos, ends=False), speculative=speculative, stop_fsm=stop_fsm(stops, tok))
        assert be.insert(0, sp).tokens == ref[:1]
        return [o.tokens for o in be.collect(be.launch([0], width=width, steps=STEPS))[0]]

    set0 = be.stops_on_device["set"]
    assert run((_text(ref[1:3]),)) == [[ref[1]], [ref[2]]]  # spans the launch's two tokens: step 3 not run
    assert be.collect(be.launch([0], width=1, steps=STEPS))[0] == []  # nor the launch in flight
    assert run((_text(ref[0:2]),)) == [[ref[1]]]  # spans the prefill's token and step 1's
    assert run(("\x7f\x7f", _text(ref[2:4]))) == [[ref[1]], [ref[2]], [ref[3]]]  # completed at step 3: all run
    assert be.stops_on_device["set"] == set0 + 3
    # a drafting launch ends after the step whose block completes it
    steps = run((_text(ref[2:4]),), speculative=True, width=be.G + 1)
    flat = [t for step in steps for t in step]
    assert _text(ref[2:4]) in _text(ref[:1] + flat) and _text(ref[2:4]) not in _text(ref[:1] + flat[:-len(steps[-1])])
    assert len(steps) < STEPS or len(flat) < 4
    # an automaton larger than the slot's tables is not put on the device: the launch runs every step
    many = tuple(_text([60 - i, 61 - i, 62 - i, 63 - i, 59 - i]) for i in range(10)) + (_text(ref[1:3]),)
    assert len(run(many)) == STEPS and be.stops_on_device["too_large"] == 1
    # a request without stop strings, in the slot after one with them: every step runs
    assert len(be.collect(be.launch([0], width=1, steps=STEPS))[0]) == STEPS
    be.insert(0, _req(prompt, eos, ends=False))
    assert len(be.collect(be.launch([0], width=1, steps=STEPS))[0]) == STEPS
    be.free(0)


def test_requests_ended_at_a_stop_string_equal_batch_one_generate(case):
    """Through the engine (which builds each request's automaton): the ids up to the one that completes the stop
    string, the text cut before it, finish_reason "stop" with the stop string as the reason, as the host ends any
    request at a stop string; greedy, plain and speculating."""
    target, drafter, be, prompt, ref, eos = case
    set0, stop = be.stops_on_device["set"], _text(ref[1:3])
    reqs = _served(be, eos, [Request(SamplingRequest(tuple(int(x) for x in prompt), 20, speculative=spec),
                                     lambda ev: None, stop=(stop,), ignore_eos=True) for spec in (False, True)])
    for r in reqs:
        assert (r.output_ids, r.text, r.finished, r.stop_reason) == (ref[:3], _text(ref[:1]), "stop", stop)
    assert be.stops_on_device["set"] == set0 + 2
