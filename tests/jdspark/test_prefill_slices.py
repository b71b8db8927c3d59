"""Long prompts in slices (``SlotBackend.prefill_slice``, ``Engine._slice``): a prompt whose insert would prefill
more than ``slice_tokens`` tokens is prefilled that many at a time into the prefix cache, the engine stepping the
running slots between slices, and its insert then extends the last kept slice. Served among a running stream, in
a backend whose one batch bucket steps every slot (the slicing one too), its tokens equal batch-1
``jdspark.generate``'s of the whole prompt, greedy and sampled; the running stream's too."""

import time

import numpy as np
import pytest

import jdspark
from jdspark.engine import Engine, Request, SamplingRequest
from jdspark.prefix import PrefixPool
from jdspark.serve_metrics import ServeMetrics
from jdspark.slots import SlotBackend, prefill_slice_plan
from tests.jdspark.test_slots import _wait_until_finished, pair  # noqa: F401  (the tiny pair fixture)

S = 16  # tokens a slice


@pytest.fixture(scope="module")
def backend(pair):  # noqa: F811
    target, drafter, _ = pair
    return SlotBackend(target, drafter, num_slots=2, max_len=128, prompt_buckets=(16, 32), batch_buckets=(2,),
                       prefix_pool=4, prefix_min_tokens=8, slice_tokens=S, multi_step=3, multi_step_max_batch=2,
                       max_logprobs=2)


def _prompt(n: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, vocab, n - 1).tolist()


def _record(backend, monkeypatch) -> list:
    """The backend's slices and launches, in order: ("slice", slot) and ("launch", slots, steps)."""
    events = []
    slice_, launch = backend.prefill_slice, backend.launch

    def sliced(slot, req):
        events.append(("slice", slot))
        return slice_(slot, req)

    def launched(slots, steps=1):
        events.append(("launch", tuple(slots), steps))
        return launch(slots, steps=steps)

    monkeypatch.setattr(backend, "prefill_slice", sliced)
    monkeypatch.setattr(backend, "launch", launched)
    return events


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)])
def test_a_long_prompt_is_prefilled_in_slices_between_the_running_stream_s_steps(
        pair, backend, setting, monkeypatch):  # noqa: F811
    target, drafter, tok = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    queries, hits, slices = backend.prefix.queries, backend.prefix.hits, backend.slices
    events = _record(backend, monkeypatch)
    metrics = ServeMetrics("m", max_positions=backend.G + 1)
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id, metrics=metrics).start()
    short, long_ = _prompt(12, V, 1), _prompt(75, V, 2)  # 75 > the largest bucket (32): served only in slices
    try:
        a = eng.submit(Request(SamplingRequest(tuple(short), 48, seed=3, **setting), lambda ev: None,
                               ignore_eos=True))
        while len(a.output_ids) < 2:  # running (a launch collected) before the long prompt arrives
            assert eng.error is None, eng.error
            time.sleep(0.005)
        b = eng.submit(Request(SamplingRequest(tuple(long_), 16, seed=4, **setting), lambda ev: None,
                               ignore_eos=True))
        _wait_until_finished(eng, [a, b], 600)
    finally:
        eng.shutdown()
    for req, prompt, n, seed in ((a, short, 48, 3), (b, long_, 16, 4)):
        ref = jdspark.generate(target, drafter, np.array(prompt), max_new_tokens=n, seed=seed, eos_token_id=-1,
                               **setting)
        assert req.finished == "length" and req.output_ids == list(ref.tokens), (req.output_ids, ref.tokens)
    # [0, 16), [16, 32), [32, 48), [48, 59) kept one after another; the insert extends [59, 75)
    assert backend.slices - slices == 4
    assert 'jdspark:prefill_slices_total{model_name="m"} 4.0' in metrics.exposition().decode()
    first = next(i for i, e in enumerate(events) if e[0] == "slice")
    slot_b = events[first][1]
    cut = next(i for i, e in enumerate(events) if e[0] == "launch" and slot_b in e[1])
    assert all(slot_b not in e[1] for e in events[:cut] if e[0] == "launch"), events  # not stepped before its insert
    # one step of the running stream between one slice and the next, and between the last and the insert (one-step
    # launches while a prompt is being sliced, as while a request waits): it waited for a slice at a time
    assert [e[0] for e in events[first:cut]] == ["slice", "launch"] * 4, events
    assert all(e[2] == 1 for e in events[first:cut] if e[0] == "launch")
    assert any(e[2] == 3 for e in events[:first]), events  # multi-step launches before it
    # the client's own prompt was looked up once and had nothing kept: the slices are not its cache hits
    assert b.cached_tokens == 0 and a.cached_tokens == 0
    assert (backend.prefix.queries - queries, backend.prefix.hits - hits) == (len(short) + len(long_), 0)
    assert not backend.sliced and not eng.prefilling
    # one row kept the long prompt's slices, one its whole prompt (and one the short prompt): not a row a slice
    assert sorted(len(k) for k in backend.prefix.rows) == [len(short), 59, len(long_)]


def test_a_refused_or_cancelled_long_prompt_frees_its_slot(pair, backend, monkeypatch):  # noqa: F811
    """A long prompt its insert would refuse ends at its first slice with the reason; one cancelled between its
    slices ends there, nothing of it inserted; the slot then serves the next request."""
    target, drafter, tok = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id).start()
    slice_ = backend.prefill_slice
    try:
        bad = eng.submit(Request(SamplingRequest(tuple(_prompt(75, V, 5)), 100), lambda ev: None))
        _wait_until_finished(eng, [bad], 600)
        assert bad.finished == "abort" and not bad.output_ids and eng.num_running == 0
        box = []

        def cancel_at_second(slot, req):  # the client goes away after the first slice
            if backend.slices > box[0]:
                eng.cancel(box[1])
            return slice_(slot, req)

        monkeypatch.setattr(backend, "prefill_slice", cancel_at_second)
        box[:] = [backend.slices, None]
        box[1] = gone = eng.submit(Request(SamplingRequest(tuple(_prompt(75, V, 6)), 8), lambda ev: None))
        _wait_until_finished(eng, [gone], 600)
        deadline = time.time() + 60
        while eng.num_running and time.time() < deadline:
            time.sleep(0.01)
        assert gone.finished == "abort" and not gone.output_ids and eng.num_running == 0 and not eng.prefilling
        assert not backend.sliced
        monkeypatch.setattr(backend, "prefill_slice", slice_)
        ok = eng.submit(Request(SamplingRequest(tuple(_prompt(12, V, 7)), 8), lambda ev: None, ignore_eos=True))
        _wait_until_finished(eng, [ok], 600)
        assert ok.finished == "length" and len(ok.output_ids) == 8
    finally:
        eng.shutdown()


def test_a_prompt_alone_is_sliced_only_where_one_insert_could_not_take_it(pair, backend):  # noqa: F811
    """With no other stream running or waiting, a prompt one insert can take (<= the largest bucket, 32) is not
    sliced (in slices its first token would come later, and no stream waits for it); one past it is."""
    target, drafter, tok = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id).start()
    try:
        for n, slices in ((30, 0), (75, 4)):
            before = backend.slices
            req = eng.submit(Request(SamplingRequest(tuple(_prompt(n, V, n)), 4), lambda ev: None, ignore_eos=True))
            _wait_until_finished(eng, [req], 600)
            assert req.finished == "length" and backend.slices - before == slices, (n, backend.slices - before)
    finally:
        eng.shutdown()
    assert backend.slices_needed(SamplingRequest(tuple(_prompt(30, V, 15)), 4))  # while others run: sliced
    assert not backend.slices_needed(SamplingRequest(tuple(_prompt(30, V, 15)), 4), busy=False)


def test_a_slice_s_row_outlives_the_prompts_kept_meanwhile(pair, backend):  # noqa: F811
    """Between two slices more prompts are kept than the pool has rows: the slice's row is pinned, so the next
    slice continues from it (no slice prefilled twice), and the insert's hit unpins it."""
    target, _, _ = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    long_ = _prompt(75, V, 13)
    req, slices = SamplingRequest(tuple(long_), 4), backend.slices
    assert not backend.prefill_slice(1, req)  # [0, 16)
    for i in range(backend.prefix.capacity + 1):  # each kept: the least recent unpinned row goes
        backend.insert(0, SamplingRequest(tuple(_prompt(12, V, 20 + i)), 2))
        backend.free(0)
    assert [backend.prefill_slice(1, req) for _ in range(3)] == [False, False, True]  # [16, 32), [32, 48), [48, 59)
    assert backend.slices - slices == 4 and backend.prefix.pinned == {tuple(long_[:59])}
    assert backend.insert(1, req).cached == 0 and not backend.prefix.pinned
    backend.free(1)


def test_a_row_keeps_the_next_slice():
    pool = PrefixPool(2, min_tokens=2)
    a = pool.store([1, 2, 3])
    pool.store([7, 7])
    assert pool.rekey([1, 2, 3], [1, 2, 3, 4, 5]) == a and pool.lookup([1, 2, 3, 4, 5, 6]) == (a, 5)
    assert pool.lookup([1, 2, 3, 4]) is None  # [1, 2, 3] is no longer kept
    assert pool.rekey([1, 2, 3], [1, 2, 3, 4]) is None and pool.rekey([1, 2, 3, 4, 5], [7, 7]) is None
    assert pool.store([8, 8]) != a  # the re-keyed row is the most recent: [7, 7]'s goes first
    pool.pin([1, 2, 3, 4, 5])
    pool.lookup([8, 8, 1])  # [8, 8] the most recent: the pinned row is the least recent, and still stays
    assert pool.store([9, 9]) != a and pool.lookup([1, 2, 3, 4, 5, 6]) == (a, 5)
    assert pool.rekey([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]) == a and pool.pinned == {(1, 2, 3, 4, 5, 6)}
    pool.pin([9, 9])
    assert pool.store([4, 4]) is None  # every row pinned
    pool.pin([9, 9], on=False)
    assert pool.store([4, 4]) is not None


def test_what_is_sliced_and_what_its_insert_reports(pair, backend):  # noqa: F811
    """``slices_needed``: only a prompt whose insert would prefill more than S tokens, that the prefix cache may
    keep (text; one asking for its prompt's log-probabilities counts every token). A prompt that begins with a kept
    one is sliced from there, and its insert reports the tokens kept before its slices as cached. A bad request is
    refused at its first slice, before any work; a slot freed between slices (a cancelled request) starts over."""
    target, _, _ = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    base = _prompt(24, V, 7)
    long_ = base + _prompt(60, V, 8)[1:]  # 83 tokens, its first 24 kept below
    assert not backend.slices_needed(SamplingRequest(tuple(long_[:S]), 4))  # one slice's worth
    assert backend.slices_needed(SamplingRequest(tuple(long_[:S + 1]), 4))
    backend.insert(0, SamplingRequest(tuple(base), 2))  # kept
    backend.free(0)
    assert not backend.slices_needed(SamplingRequest(tuple(base + long_[24:24 + S]), 4))  # the rest is one slice
    asks = SamplingRequest(tuple(base + long_[24:32]), 4, prompt_logprobs=0)  # the kept 24 tokens' entries too
    assert backend.slices_needed(asks) and not backend.slices_needed(asks, busy=False)  # alone: one insert of 32
    asks = SamplingRequest(tuple(base + long_[24:24 + S]), 4, prompt_logprobs=0)
    assert backend.slices_needed(asks, busy=False)  # 40 tokens: past the largest bucket, served only in slices
    req = SamplingRequest(tuple(long_), 4)
    assert backend.slices_needed(req)
    slices = backend.slices
    with pytest.raises(ValueError, match="exceed the slots' cache"):
        backend.prefill_slice(1, SamplingRequest(tuple(long_), 100))
    assert backend.slices == slices and not backend.sliced
    assert not backend.prefill_slice(1, req)  # [24, 40) after the kept 24
    backend.free(1)  # cancelled: the next request of the slot is its own
    assert not backend.sliced
    done = [backend.prefill_slice(1, req) for _ in range(2)]  # [40, 56), then [56, 67)
    assert done == [False, True] and backend.slices - slices == 3
    out = backend.insert(1, req)  # extends [67, 83)
    assert out.cached == 40 and not backend.sliced  # what the cache held when this request's slices began
    backend.free(1)


def test_the_server_s_slice(pair):  # noqa: F811
    """``prefill_slice_plan``: the largest prompt bucket up to 512 tokens that the prefix cache would keep; the
    backend takes a bucket of at least the cache's minimum, with the cache on."""
    assert prefill_slice_plan((64, 128, 256, 512)) == 512 and prefill_slice_plan((128, 1024, 4096)) == 128
    assert prefill_slice_plan((1024, 2048)) == 1024 and prefill_slice_plan((16,), min_tokens=32) == 0
    target, drafter, _ = pair
    for kw in (dict(prefix_pool=0, slice_tokens=16), dict(prefix_pool=2, slice_tokens=24),
               dict(prefix_pool=2, prefix_min_tokens=32, slice_tokens=16)):
        with pytest.raises(ValueError, match="slice_tokens: expected 0"):
            SlotBackend(target, drafter, num_slots=1, max_len=128, prompt_buckets=(16, 32), **kw)


@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95, seed=6)])
def test_a_constrained_request_extends_a_kept_prompt_and_is_sliced(pair, setting):  # noqa: F811
    """A constrained request (a grammar) on a prefix-cache hit gets its own automaton from the extension, not the
    kept row's: its tokens equal batch-1 generate's with the grammar, for a short hit and for a long prompt served
    in slices; an unconstrained request then hitting the constrained one's kept prompt is unconstrained."""
    from tests.jdspark.test_grammar import _ids_fsm

    target, drafter, _ = pair
    V = target.config.vocab_size
    be = SlotBackend(target, drafter, num_slots=1, max_len=128, prompt_buckets=(16, 32), prefix_pool=4,
                     prefix_min_tokens=8, slice_tokens=16, guided_states=16)
    fsm = _ids_fsm([[5, 6, 7, 8, 9], [5, 10], [20, 21, 22, 23, 24, 25]], V)
    kept = _prompt(24, V, 9)

    def served(prompt, n, **kw):
        req = SamplingRequest(tuple(prompt), n, **{**setting, **kw})
        while be.slices_needed(req) and not be.prefill_slice(0, req):
            pass
        out = be.insert(0, req)
        toks = list(out.tokens)
        while len(toks) < n and toks[-1] != target.config.eos_token_id:
            toks += be.step([0])[0].tokens
        be.free(0)
        return toks, out.cached

    served(kept, 2)  # kept, unconstrained
    slices = be.slices
    for prompt, cached in ((kept + _prompt(11, V, 10)[1:], len(kept)), (_prompt(75, V, 11), 0)):
        toks, got_cached = served(prompt, 12, grammar=fsm)
        ref = jdspark.generate(target, drafter, np.array(prompt), max_new_tokens=12, grammar=fsm,
                               **setting).tokens.tolist()
        assert toks[:len(ref)] == ref and got_cached == cached, (toks, ref, got_cached)
    assert be.slices - slices == 4  # the long prompt's
    free_prompt = _prompt(75, V, 11) + _prompt(6, V, 12)[1:]  # begins with the constrained long prompt, kept
    toks, got_cached = served(free_prompt, 12)
    ref = jdspark.generate(target, drafter, np.array(free_prompt), max_new_tokens=12, **setting).tokens.tolist()
    assert got_cached == 75 and toks[:12] == ref, (toks, ref)


def test_mixed_traffic_with_slices_equals_batch_one_generate(pair, backend):  # noqa: F811
    """Twelve requests through 2 slots and a 4-row pool: prompts of 12, 40 (past the largest bucket, 32) and 75
    tokens, some beginning with an earlier one's prompt, greedy and sampled, arriving while others run (so long ones
    are sliced among the others' steps and the pool's rows turn over), two cancelled after their first token: every
    other request's tokens equal batch-1 generate's of its whole prompt."""
    target, drafter, tok = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    slices = backend.slices
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id).start()
    asks, reqs = [], []
    base = _prompt(40, V, 30)
    try:
        for i in range(12):
            n = (12, 40, 75)[i % 3]
            prompt = base[:24] + _prompt(n - 24, V, 40 + i)[1:] + [5] if i in (4, 7) else _prompt(n, V, 40 + i)
            setting = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, top_p=0.95, seed=i)
            asks.append((prompt, setting))
            reqs.append(eng.submit(Request(SamplingRequest(tuple(prompt), 10, **setting), lambda ev: None,
                                           ignore_eos=True)))
            if i in (2, 9):  # gone after its first token
                deadline = time.time() + 600
                while not reqs[-1].output_ids and reqs[-1].finished is None:
                    assert time.time() < deadline and eng.error is None, eng.error
                    time.sleep(0.002)
                eng.cancel(reqs[-1])
            elif i % 4 == 3:
                time.sleep(0.05)
        _wait_until_finished(eng, reqs, 900)
    finally:
        eng.shutdown()
    assert backend.slices > slices and not backend.sliced and not backend.prefix.pinned
    for i, ((prompt, setting), req) in enumerate(zip(asks, reqs)):
        if i in (2, 9):
            assert req.finished in ("abort", "length")
            continue
        ref = jdspark.generate(target, drafter, np.array(prompt), max_new_tokens=10, eos_token_id=-1, **setting)
        assert req.finished == "length" and req.output_ids == list(ref.tokens), (i, req.output_ids, ref.tokens)


def test_a_long_prompt_s_log_probabilities_come_from_its_slices(pair, backend):  # noqa: F811
    """A request asking for its prompt's log-probabilities (echo) past the largest bucket is served in slices too:
    from its own first token (not from another request's kept prompt that begins it, whose tokens' entries nobody
    kept), each slice's last position scoring the next slice's first token; the entries equal the target's
    log-softmax over the whole sequence in one pass, with their ranks, and its tokens batch-1 generate's."""
    target, drafter, tok = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    long_ = _prompt(75, V, 21)
    backend.insert(0, SamplingRequest(tuple(long_[:24]), 2))  # kept: it begins the long prompt
    backend.free(0)
    slices = backend.slices
    eng = Engine(backend, tok, eos_token_id=target.config.eos_token_id).start()
    got = []
    try:
        a = eng.submit(Request(SamplingRequest(tuple(_prompt(12, V, 22)), 40, seed=3), lambda ev: None,
                               ignore_eos=True))
        while len(a.output_ids) < 2:  # running before the long prompt arrives
            assert eng.error is None, eng.error
            time.sleep(0.005)
        b = eng.submit(Request(SamplingRequest(tuple(long_), 6, prompt_logprobs=2), got.append, ignore_eos=True))
        _wait_until_finished(eng, [a, b], 600)
    finally:
        eng.shutdown()
    # [0, 16), [16, 32), [32, 48), [48, 59) from the start (the kept 24 tokens would have left 3), the insert
    # extending [59, 75); nothing counted as cached
    assert backend.slices - slices == 4 and b.cached_tokens == 0 and not backend.sliced
    ref = jdspark.generate(target, drafter, np.array(long_), max_new_tokens=6, eos_token_id=-1)
    assert b.output_ids == list(ref.tokens)
    assert all(ev.prompt_logprobs is None for ev in got[1:])
    _assert_prompt_entries(target, long_, got[0].prompt_logprobs, 2)
    # the same prompt twice more: the first from its first token, the second from the first's last slice, whose
    # entries were kept with it (and the entry of the token after it)
    backend.prefix.clear()
    req = SamplingRequest(tuple(long_), 2, prompt_logprobs=1)
    for slices, cached in (([False, False, False, True], 0), ([True], 59)):
        assert [backend.prefill_slice(1, req) for _ in slices] == slices
        out = backend.insert(1, req)
        backend.free(1)
        assert out.cached == cached and not backend.sliced and not backend.prefix.pinned
        _assert_prompt_entries(target, long_, out.prompt_logprobs, 1)
    # a slice whose prompt is kept already (here by a request of 16 tokens): it goes on from that row (it looked up
    # its own last slice only, so a slice it did not keep itself would start it over, again and again)
    backend.insert(0, SamplingRequest(tuple(long_[:S]), 2))
    backend.free(0)
    req40 = SamplingRequest(tuple(long_[:40]), 2, prompt_logprobs=1)
    assert [backend.prefill_slice(1, req40) for _ in range(2)] == [False, True]  # [0, 16), [16, 24)
    out = backend.insert(1, req40)
    backend.free(1)
    _assert_prompt_entries(target, long_[:40], out.prompt_logprobs, 1)
    # were its last slice gone between slices (the cache cleared), it starts over from its first token
    backend.prefix.clear()
    assert not backend.prefill_slice(1, req)  # [0, 16)
    backend.prefix.clear()
    assert [backend.prefill_slice(1, req) for _ in range(4)] == [False, False, False, True]  # [0, 16) .. [48, 59)
    out = backend.insert(1, req)
    backend.free(1)
    assert out.cached == 0 and not backend.sliced
    _assert_prompt_entries(target, long_, out.prompt_logprobs, 1)


def test_prompt_log_probabilities_of_a_shared_beginning_are_computed_once(pair, backend):  # noqa: F811
    """lm-eval's loglikelihood of a multiple-choice question: each request is the question + one choice, asking for
    its prompt's log-probabilities. The second prefills the question but its last token first and keeps it with
    the entries (and the entry of that token, the same for every choice); the choices after it extend it. Every
    request's entries equal the one-pass log-softmax; a choice asking more top entries than were kept computes
    them again (and keeps those); a long one continues in slices from the kept question; a request without
    log-probabilities finds the kept question as any kept prompt."""
    target, _, _ = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    question = _prompt(20, V, 31)
    choices = [[3 + i] + _prompt(4, V, 40 + i)[1:] for i in range(6)]  # first tokens differ: they part at 20

    def ask(prompt, top, slot=0):
        out = backend.insert(slot, SamplingRequest(tuple(prompt), 0 if top is not None else 2, prompt_logprobs=top))
        backend.free(slot)
        assert not backend.sliced and not backend.prefix.pinned
        if top is not None:
            _assert_prompt_entries(target, prompt, out.prompt_logprobs, top)
        return out.cached

    splits = backend.splits
    assert [ask(question + c, 1) for c in choices[:4]] == [0, 0, 19, 19]
    assert backend.splits - splits == 1 and tuple(question[:19]) in backend.prefix.rows
    assert ask(question + choices[4], 2) == 0  # 1 top entry kept, 2 asked: computed again, kept
    assert ask(question + choices[5], 1) == 19 and backend.splits - splits == 2
    long_ = question + _prompt(31, V, 50)[1:]  # 50 tokens: one slice [19, 34) from the question, then the insert
    req = SamplingRequest(tuple(long_), 0, prompt_logprobs=1)
    assert backend.slices_needed(req) and backend.prefill_slice(1, req)
    out = backend.insert(1, req)
    backend.free(1)
    assert out.cached == 19 and not backend.prefix.pinned
    _assert_prompt_entries(target, long_, out.prompt_logprobs, 1)
    assert ask(question + choices[0][:2], None) == 19  # a plain request: any kept prompt


def test_a_sliced_prompt_keeps_where_it_parts_from_a_kept_one(pair, backend):  # noqa: F811
    """A prompt prefilled in slices that shares 26 tokens with a kept prompt: its second slice ends at 26 ([16, 26)
    instead of [16, 32)) and is kept on its own (the next slice takes a new row), so a later prompt that shares
    those 26 tokens finds them kept; the sliced prompt's tokens equal batch-1 generate's."""
    target, drafter, _ = pair
    V = target.config.vocab_size
    backend.prefix.clear()
    base = _prompt(26, V, 61)
    backend.insert(0, SamplingRequest(tuple(base + [5, 6, 7]), 2))
    backend.free(0)
    long_ = base + [9] + _prompt(39, V, 62)[1:]  # 65 tokens: [0, 16), [16, 26), [26, 42), [42, 49), then the insert
    req = SamplingRequest(tuple(long_), 8)
    assert [backend.prefill_slice(1, req) for _ in range(4)] == [False, False, False, True]
    out = backend.insert(1, req)
    toks = list(out.tokens)
    while len(toks) < 8:
        toks += backend.step([1])[1].tokens
    backend.free(1)
    ref = jdspark.generate(target, drafter, np.array(long_), max_new_tokens=8, eos_token_id=-1)
    assert toks[:8] == list(ref.tokens) and out.cached == 0
    assert tuple(base) in backend.prefix.rows and tuple(long_[:49]) in backend.prefix.rows
    out = backend.insert(0, SamplingRequest(tuple(base + [11, 12, 13]), 2))
    backend.free(0)
    assert out.cached == 26


def _assert_prompt_entries(target, prompt, plp, top):
    """``plp`` (prompt entries as served: None, then (logprob, top entries, rank) per token) against the log-softmax
    of the target's logits over the whole prompt in one pass."""
    assert len(plp) == len(prompt) and plp[0] is None
    seq = np.array([prompt], np.int32)
    logits = np.asarray(target.prefill(seq, target.init_cache(1, seq.shape[1])).logits, np.float64)[0]
    ref_T = logits - logits.max(-1, keepdims=True)
    ref_T -= np.log(np.exp(ref_T).sum(-1, keepdims=True))
    np.testing.assert_allclose([e[0] for e in plp[1:]], ref_T[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
    for i, (lp, tops, rank) in enumerate(plp[1:]):
        assert len(tops) == top
        np.testing.assert_allclose([v for _, v in tops], np.sort(ref_T[i])[::-1][:top], atol=2e-4)
        assert np.sum(ref_T[i] > lp + 2e-4) < rank <= np.sum(ref_T[i] >= lp - 2e-4), (i, rank)
