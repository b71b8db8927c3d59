"""The engine's host loop over a pipelined backend (``launch`` / ``collect``): what it launches near a request's
max_tokens. A scripted backend (no model): every step of a row commits ``k`` tokens (``k`` per launch, in order, the
last repeating), (t + 1) % 256 after t; it records every launch and each listed row that its earlier launches had
already carried to its max_tokens (a launch run for nothing)."""

import threading
import time

from jdspark.engine import IDLE_GRACE_S, Engine, Request, SamplingRequest, StepOutput
from kimi.tokenizer import ByteTokenizer


class PipelinedBackend:
    def __init__(self, num_slots, tokens_per_step, multi_step=4, all_slots=False):
        self.num_slots, self.multi_step, self.all_slots = num_slots, multi_step, all_slots
        self.ks = list(tokens_per_step) if isinstance(tokens_per_step, (list, tuple)) else [tokens_per_step]
        self.last, self.launches = {}, []  # launches: (slots listed, steps)
        self.produced, self.max_tokens, self.for_nothing = {}, {}, []

    def insert(self, slot, req):
        self.last[slot] = (req.prompt_ids[-1] + 1) % 256
        self.produced[slot], self.max_tokens[slot] = 1, req.max_tokens
        return StepOutput([self.last[slot]])

    def steps_for(self, n):
        return self.multi_step

    def launch(self, slots, steps=1):
        k = self.ks[min(len(self.launches), len(self.ks) - 1)]
        self.launches.append((list(slots), steps))
        self.for_nothing += [s for s in slots if self.produced[s] >= self.max_tokens[s]]
        out = {}
        for s in (range(self.num_slots) if self.all_slots else slots):  # the largest bucket steps every slot
            if s not in self.last:
                continue
            per_step = []
            for _ in range(steps):
                toks = []
                for _ in range(k):
                    self.last[s] = (self.last[s] + 1) % 256
                    toks.append(self.last[s])
                per_step.append(StepOutput(toks, drafted=k - 1, accepted=k - 1, verified=k))
            self.produced[s] += steps * k
            out[s] = per_step
        return out

    def collect(self, handle):
        return handle

    def free(self, slot):
        del self.last[slot]


def _serve(backend, max_tokens_list):
    tok = ByteTokenizer()
    eng = Engine(backend, tok, eos_token_id=None).start()
    done, results = threading.Semaphore(0), {}

    def on_event(i):
        def f(ev):
            results.setdefault(i, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                done.release()
        return f

    for i, n in enumerate(max_tokens_list):
        eng.submit(Request(SamplingRequest(prompt_ids=(10 + i,), max_tokens=n), on_event(i), ignore_eos=True))
    for _ in max_tokens_list:
        assert done.acquire(timeout=20)
    eng.shutdown()
    return results


def _want(first, n):
    return [(first + 1 + j) % 256 for j in range(n)]


def test_plain_rows_get_no_launch_after_the_one_that_ends_them():
    """Plain decoding (1 token a step), one request of 10: the prefill's token, then launches of 4 steps at 1, 5
    and 9 tokens committed (the third carries it to 10 and runs 3 steps past it). The launch that used to be made
    while the third computed (4 steps for nothing) is not."""
    be = PipelinedBackend(num_slots=2, tokens_per_step=1)
    res = _serve(be, [10])
    assert res[0] == _want(10, 10)
    assert be.launches == [([0], 4)] * 3 and be.for_nothing == []


def test_drafting_rows_skip_the_launch_their_last_one_likely_ends():
    """3 tokens a step, 30 tokens: launched at 1 committed (none in flight) and at 1 again (4 steps in flight, no
    rate known yet: 1 a step), then at 13 (in flight 4 steps x 3 likely, 17 left); at 25 with 4 steps in flight
    the 5 left are likely covered: nothing is launched, and that launch ends the request."""
    be = PipelinedBackend(num_slots=2, tokens_per_step=3)
    res = _serve(be, [30])
    assert res[0] == _want(10, 30)
    assert be.launches == [([0], 4)] * 3 and be.for_nothing == []


def test_a_likely_end_that_does_not_come_is_launched_after_the_collect():
    """The rate so far (3 a step) overstates the launch in flight (1 a step): at 25 committed nothing is launched,
    the launch in flight brings 4 (29), and the row is launched after the collect for its last token."""
    be = PipelinedBackend(num_slots=2, tokens_per_step=[3, 3, 1])
    res = _serve(be, [30])
    assert res[0] == _want(10, 30)
    assert be.launches == [([0], 4)] * 4 and be.for_nothing == []


def test_under_load_every_request_is_whole():
    """Four requests of different lengths at once, the largest bucket stepping every slot (as SlotBackend's does,
    listed or not, so a row left out of a launch that has not ended would lose tokens): each gets exactly its
    tokens, in order, at steady and varying rates (3, 3, then 1 a step: the rate so far overstates the launches in
    flight, and rows are judged likely ended that are not). A row likely but not surely ended is still listed
    while other rows launch: the largest bucket computes it anyway."""
    for k, lengths in ((1, [7, 30, 13, 50]), (3, [17, 30, 41, 50]), ([3, 1, 2], [7, 30, 13, 50]),
                       ([3, 3, 1], [30, 60, 45, 80]), (3, [7, 2, 13, 5])):
        be = PipelinedBackend(num_slots=4, tokens_per_step=k, all_slots=True)
        res = _serve(be, lengths)
        for i, n in enumerate(lengths):
            assert res[i] == _want(10 + i, n), (k, i)


class FewerStepsBackend(PipelinedBackend):
    """Runs one step in every other launch asked for several (as ``SlotBackend`` does where the width it picks is
    not multi-stepped at that batch bucket) and says so in the handle's ``"steps"``."""

    def launch(self, slots, steps=1):
        run = 1 if len(self.launches) % 2 else steps
        out = super().launch(slots, run)
        out["steps"] = run
        return out


def test_a_launch_that_runs_fewer_steps_than_asked_is_planned_by_what_it_runs():
    """The engine plans the next launch by the steps the launch in flight runs (its handle's ``"steps"``), not by
    the steps it asked for: judged by the 4 asked, a row with 2 tokens left would be left out of the next launch
    while its last launch ran 1 step, and the largest bucket, which steps it anyway, would drop its tokens."""
    for k, lengths in ((1, [7, 30, 13, 50]), (3, [17, 30, 41, 50]), ([3, 1, 2], [7, 30, 13, 50])):
        be = FewerStepsBackend(num_slots=4, tokens_per_step=k, all_slots=True)
        res = _serve(be, lengths)
        for i, n in enumerate(lengths):
            assert res[i] == _want(10 + i, n), (k, i)
        assert {steps for _, steps in be.launches} == {1, 4}


class AnswerKeepingBackend(PipelinedBackend):
    """Records what the engine hands ``keep_answer`` and when it runs ``idle_step`` (the slots then in use)."""

    def __init__(self):
        super().__init__(num_slots=2, tokens_per_step=3)
        self.kept, self.idle_runs, self.idle_at, self.todo = [], [], [], 0

    def keep_answer(self, req, answer_ids):
        self.kept.append((req.prompt_ids, list(answer_ids)))
        self.todo += 1

    def idle_pending(self):
        return self.todo > 0

    def idle_step(self):
        self.todo -= 1
        self.idle_runs.append(sorted(self.last))  # rows still placed: none, or the engine was not idle
        self.idle_at.append(time.monotonic())


def test_a_finished_answer_is_kept_as_its_client_saw_it_and_only_while_idle():
    """The ids a conversation's next turn repeats: all of them at max_tokens (EOS ignored), all but an EOS that
    ended the answer (a chat template closes the turn its own way; EOS as the last allowed token is a stop, as in
    vLLM), none where a stop string cut the text (the ids hold more than the text); the idle work runs only with
    every slot free and nothing waiting, from IDLE_GRACE_S after the last request's work."""
    be = AnswerKeepingBackend()
    eng = Engine(be, ByteTokenizer(), eos_token_id=20).start()
    cases = [((10,), 5, True, ()), ((12,), 50, False, ()), ((15,), 5, False, ()), ((40,), 20, True, ("+",))]
    events, finished_at = [], []
    try:
        for prompt, max_tokens, ignore_eos, stop in cases:
            done = threading.Event()

            def on_event(ev, done=done):
                if ev.finish_reason is not None:
                    events.append((ev.finish_reason, ev.usage["completion_tokens"]))
                    finished_at.append(time.monotonic())
                    done.set()

            eng.submit(Request(SamplingRequest(prompt_ids=prompt, max_tokens=max_tokens), on_event,
                               ignore_eos=ignore_eos, stop=stop))
            assert done.wait(20)
            for _ in range(400):
                if not be.idle_pending():
                    break
                threading.Event().wait(0.01)
    finally:
        eng.shutdown()
    assert events == [("length", 5), ("stop", 8), ("stop", 5), ("stop", 3)]
    assert be.kept == [((10,), _want(10, 5)), ((12,), _want(12, 7)), ((15,), _want(15, 4))]
    assert be.idle_runs == [[], [], []]
    # each after IDLE_GRACE_S with nothing to run (a next request sent at once would find the engine free)
    assert all(t >= f + IDLE_GRACE_S for t, f in zip(be.idle_at, finished_at))


def test_idle_work_that_fails_is_turned_off_and_serving_goes_on():
    """An answer's idle prefill is an optimisation: when it raises, the engine says why (``idle_error``), stops
    calling it, and serves the next requests whole."""

    class Failing(AnswerKeepingBackend):
        def idle_step(self):
            super().idle_step()
            raise RuntimeError("no room")

    be = Failing()
    eng = Engine(be, ByteTokenizer(), eos_token_id=None).start()
    try:
        got = []
        for i in range(3):
            done = threading.Event()

            def on_event(ev, done=done):
                got.extend(ev.token_ids)
                if ev.finish_reason is not None:
                    done.set()

            eng.submit(Request(SamplingRequest(prompt_ids=(10 * i,), max_tokens=6), on_event, ignore_eos=True))
            assert done.wait(20)
            time.sleep(3 * IDLE_GRACE_S)
    finally:
        eng.shutdown()
    assert got == _want(0, 6) + _want(10, 6) + _want(20, 6)
    assert len(be.idle_runs) == 1 and isinstance(eng.idle_error, RuntimeError) and eng.error is None


def test_kv_cache_usage_is_the_running_requests_positions_over_the_slots_caches():
    """``vllm:kv_cache_usage_perc``'s value: prompt + output tokens of the requests in slots over slots x max_len
    (0 for a backend without a max_len)."""

    class Backend:
        num_slots, max_len = 2, 50

    eng = Engine(Backend(), ByteTokenizer(), eos_token_id=None)
    assert eng.kv_usage() == 0.0
    a = Request(SamplingRequest(tuple(range(10)), 8), lambda ev: None)
    a.output_ids = [5] * 7
    eng.slots[1] = a
    assert eng.kv_usage() == (10 + 7) / 100
    Backend.max_len = None
    assert eng.kv_usage() == 0.0


def test_eos_joins_the_stop_ids_a_backend_is_handed_unless_ignored():
    """``Engine.submit_all``: EOS is one of the ids that end a request (vLLM's), so a backend knows where a request
    ends (``slot_programs.step_rows`` stops a launch of rows all ended there) and min_tokens holds EOS back; a request
    that ignores EOS, or already lists it, is handed as it came."""
    eng = Engine(PipelinedBackend(2, 1), ByteTokenizer(), eos_token_id=7)  # not started: submit only queues
    reqs = [Request(SamplingRequest(prompt_ids=(1,), max_tokens=4, stop_token_ids=st), lambda ev: None,
                    ignore_eos=ig) for st, ig in (((), False), ((3,), False), ((), True), ((7, 3), False))]
    eng.submit_all(reqs)
    assert [r.sampling.stop_token_ids for r in reqs] == [(7,), (3, 7), (), (7, 3)]
    no_eos = Engine(PipelinedBackend(1, 1), ByteTokenizer(), eos_token_id=None)
    assert no_eos.submit(Request(SamplingRequest(prompt_ids=(1,), max_tokens=4), lambda ev: None)).sampling \
        .stop_token_ids == ()


def test_streamed_text_holds_back_only_a_tail_a_stop_string_could_begin_with():
    """One token a step ("a", "b", "c", ... from prompt 96), stop strings "cdX" and "zz": each event carries the text
    at once but for a tail that is a proper prefix of a stop string ("c", then "cd", sent with the "e" that rules the
    stop string out), and the events add up to the whole text; a stop string that does complete ("fg") cuts the
    text before it, none of it sent before."""
    for stops, want_deltas, want_text, reason in (
            (("cdX", "zz"), ["a", "b", "", "", "cde", "f", "g", "h"], "abcdefgh", "length"),
            (("fg", "zz"), ["a", "b", "c", "d", "e", "", ""], "abcde", "stop")):
        be = PipelinedBackend(num_slots=1, tokens_per_step=1, multi_step=1)
        eng = Engine(be, ByteTokenizer(), eos_token_id=None).start()
        events, done = [], threading.Event()

        def on_event(ev):
            events.append(ev)
            if ev.finish_reason is not None:
                done.set()
        try:
            eng.submit(Request(SamplingRequest(prompt_ids=(96,), max_tokens=8), on_event, stop=stops))
            assert done.wait(20)
        finally:
            eng.shutdown()
        assert [e.text for e in events] == want_deltas, stops
        assert "".join(e.text for e in events) == want_text and events[-1].finish_reason == reason


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    """vLLM's ``priority``: with every slot busy, the waiting queue holds lower priorities first and arrivals in
    order among equals (a response's choices together); the running request keeps its slot. Admission (the
    backend's inserts) follows the queue."""
    from tests.jdspark.serve_helpers import ScriptedBackend

    be = ScriptedBackend(num_slots=1)
    be.gate.clear()  # steps wait: the first request holds the slot, the rest queue
    eng = Engine(be, ByteTokenizer(), eos_token_id=None, max_waiting=16).start()
    done = threading.Semaphore(0)

    def req(p, prio):
        return Request(SamplingRequest(prompt_ids=(p,), max_tokens=2), lambda ev: ev.finish_reason and done.release(),
                       ignore_eos=True, priority=prio)

    try:
        eng.submit(req(1, 9))
        deadline = time.time() + 10
        while not be.requests:  # the first is admitted before the rest arrive
            assert time.time() < deadline
            time.sleep(0.01)
        for p, prio in ((2, 5), (3, 0), (4, -1), (5, 0)):
            eng.submit(req(p, prio))
        eng.submit_all([req(6, 0), req(7, 0)])  # two choices of one response
        eng.submit(req(8, -1))
        assert [r.sampling.prompt_ids[0] for r in eng.waiting] == [4, 8, 3, 5, 6, 7, 2]
        be.gate.set()
        for _ in range(8):
            assert done.acquire(timeout=20)
    finally:
        be.gate.set()
        eng.shutdown()
    assert [r.prompt_ids[0] for r in be.requests] == [1, 4, 8, 3, 5, 6, 7, 2]
