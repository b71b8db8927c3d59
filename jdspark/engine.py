"""The serving engine's host side: requests, a bounded waiting queue, slots, streaming, stop conditions, metrics.

A ``Backend`` owns the device state of S slots and runs the model (``insert`` a prompt into a free slot,
``step`` every active slot once, ``free`` a slot). The ``Engine`` runs one host thread that

    admits waiting requests into free slots (FIFO; the queue is bounded: ``QueueFull`` when it is full),
        (a backend with ``prefill_slice`` prefills a long prompt a slice a pass, between the other slots' steps)
    steps the backend, appends each slot's committed tokens to its request,
        (a backend with ``launch`` / ``collect`` is pipelined: step t + 1 is launched before step t's tokens are
        committed, so host work overlaps the device; a request that step t surely or likely ends by max_tokens
        gets no row in step t + 1 (``Engine._plan_launch``), one that ends otherwise has a row there whose tokens
        are dropped; such a backend's ``steps_for(n)`` says how many steps one launch may run for n active slots,
        used while no request waits (a launch handle that is a dict with "steps" says how many it runs, which may
        be fewer), and ``collect`` gives each slot its steps' outputs in order)
    ends a request on EOS (unless ``ignore_eos``), one of its ``stop_token_ids`` (its id kept, its text not shown,
    as EOS), a stop string (none matched before ``min_tokens``), ``max_tokens`` or cancellation, frees its slot,
    and hands each request its events (text deltas decoded incrementally, never a broken character);
    hands a backend with ``keep_answer`` each finished request's answer as its client saw it (not after a stop
    string's cut; without an EOS that ended it), and runs its ``idle_step`` while no request runs or waits (from
    ``IDLE_GRACE_S`` after the last did) and its ``idle_pending`` says there is work (``jdspark.slots``: the answer
    kept for a conversation's next turn).

Timing and acceptance are recorded into ``jdspark.serve_metrics.ServeMetrics`` (vLLM's metric names). Events reach
the caller through a callback (the server passes one that moves them onto its asyncio loop).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
import time
from typing import Callable, Optional, Protocol, Sequence

from jdspark.stop_strings import stop_fsm

__all__ = ["SamplingRequest", "StepOutput", "Backend", "Event", "Request", "Engine", "QueueFull",
           "FINISH_REASONS", "IDLE_GRACE_S"]

FINISH_REASONS = ("stop", "length", "abort")

# The engine starts a backend's idle work (``idle_step``) only after this long with nothing to run: a client that
# sends its next request at once (a load test's conversation, a script) finds the engine free, not busy with an
# answer it is about to extend anyway (measured without it, docs/serving.md: a conversation's first turn waited
# ~20 ms for the previous one's answer at c = 1); a user reading or an agent running its tool takes longer.
IDLE_GRACE_S = 0.05


class QueueFull(Exception):
    """The waiting queue holds ``max_waiting`` requests already."""


@dataclasses.dataclass(frozen=True)
class SamplingRequest:
    """What one request asks of the backend (validated by the server before it gets here)."""
    prompt_ids: tuple
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    spec_mode: Optional[str] = None  # "fixed" | "adaptive" | None (the server's default)
    images: Optional[object] = None  # kimi.image.VisionInput; prompt_ids holds its placeholders expanded
    logprobs: Optional[int] = None  # each token's log-probability and this many top ones (None: none)
    prompt_logprobs: Optional[int] = None  # the same for the prompt's tokens (``echo``): prefilled whole or in slices
    repetition_penalty: float = 1.0  # ``jdspark.sampling.Penalties`` (1, 0, 0: off)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple = ()  # ((token id, value), ...): OpenAI's logit_bias (``sampling.LogitControls``)
    min_tokens: int = 0  # vLLM's: ``stop_token_ids`` not drawn, and stop strings not matched, before this many tokens
    stop_token_ids: tuple = ()  # ids that end the request as EOS does (vLLM's; ``Engine.submit_all`` adds EOS unless
    # the request ignores it), which min_tokens holds back
    min_p: float = 0.0  # ``sampling.SamplingParams.min_p`` (0: off)
    allowed_token_ids: tuple = ()  # vLLM's: the only tokens that may be drawn (empty: all), a logit control
    first_token_ids: tuple = ()  # the only tokens the first may be (empty: all): token healing (``Request.healed``)
    grammar: Optional[object] = dataclasses.field(default=None, compare=False)  # ``jdspark.grammar.TokenFSM``: the
    # output constrained to its language (guided_choice), then EOS
    stop_fsm: Optional[object] = dataclasses.field(default=None, compare=False)  # ``jdspark.stop_strings.StopFSM``:
    # the request's stop strings as its text reads them (``Engine.submit_all``'s), so a backend may end its row there

    @property
    def has_controls(self) -> bool:
        return bool(self.logit_bias) or self.min_tokens > 0 or bool(self.allowed_token_ids)


@dataclasses.dataclass
class StepOutput:
    """One slot's result of one backend step."""
    tokens: list  # committed token ids, in order (>= 1)
    drafted: int = 0  # drafts verified this step
    accepted: int = 0  # drafts accepted this step
    verified: int = 1  # tokens the target verified for this slot this step (1 for a plain decode step)
    cached: int = 0  # an insert's: prompt tokens found in the prefix cache, not prefilled (``jdspark.prefix``)
    logprobs: Optional[list] = None  # per token (logprob, [(id, logprob), ...]) when the request asked
    prompt_logprobs: Optional[list] = None  # an insert's, per prompt token (the first None), when asked


class Backend(Protocol):
    num_slots: int

    def insert(self, slot: int, req: SamplingRequest) -> StepOutput: ...  # prefill; its first token

    def step(self, slots: Sequence[int]) -> dict: ...  # slot -> StepOutput, for every given active slot

    def free(self, slot: int) -> None: ...

    # optional: ``launch`` / ``collect`` / ``steps_for`` (pipelined, multi-step), ``keep_answer`` / ``idle_pending`` /
    # ``idle_step`` (work while nothing runs; see the module docstring), ``insert_many(pairs)`` (requests admitted
    # together: yields (index, its StepOutput or the ValueError that refused it) as each is prefilled),
    # ``slices_needed(req, busy)`` / ``prefill_slice(slot, req)`` (a long prompt prefilled a slice at a time between
    # steps; True once its ``insert`` will do the rest: ``Engine._slice``)


@dataclasses.dataclass
class Event:
    """What a request learns after a step: new text and ids; ``finish_reason`` on its last event."""
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    error: Optional[str] = None  # why the request could not be served (it ends with finish_reason "abort")
    logprobs: Optional[list] = None  # one entry per id of token_ids (StepOutput.logprobs'), when asked
    prompt_logprobs: Optional[list] = None  # on the first event, when asked (StepOutput.prompt_logprobs)
    stop_reason: object = None  # on the last: the stop string or stop token id that ended it (vLLM's; None: EOS,
    # max_tokens or abort)


@dataclasses.dataclass(eq=False)
class Request:
    sampling: SamplingRequest
    on_event: Callable[[Event], None]
    stop: tuple = ()
    ignore_eos: bool = False
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the text keeps the stop string that ended it
    keep_special: frozenset = frozenset()  # special ids its text shows (a tool-call format's markers)
    priority: int = 0  # vLLM's: a waiting request of lower priority is admitted before one of higher, FIFO among
    # equals (``Engine.submit_all``); a running request is never preempted (its slot is its own to the end)
    healed: str = ""  # token healing (``kimi.tokenizer.Tokenizer.heal``): the text of the prompt's last token, taken
    # off its prompt ids; the first token (one of ``sampling.first_token_ids``) begins with it, and it is left out
    # of the request's text (its client sent it): stop strings are matched in what follows it
    id: str = ""
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    # filled by the engine
    output_ids: list = dataclasses.field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already sent
    stop_floor: int = 0  # characters of text before its min_tokens-th token: a stop string must end past them
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    cached_tokens: int = 0  # prompt tokens its insert took from the prefix cache
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    admitted_at: Optional[float] = None
    cancelled: bool = False
    finished: Optional[str] = None
    stop_reason: object = None  # Event.stop_reason
    decoder: object = None

    def usage(self) -> dict:
        return combined_usage([self])


def combined_usage(reqs: Sequence[Request], firsts: Optional[Sequence[Request]] = None) -> dict:
    """The ``usage`` of one response whose choices are ``reqs`` (the API's ``n``: a prompt, n completions; a list of
    prompts: ``firsts`` the first completion of each, default ``reqs[0]`` alone): each prompt counted once (its
    cached tokens: its first choice's, the one that prefilled it), completion tokens, drafts and accepted drafts
    summed, ``accept_len`` over all their target steps (SGLang's per-request spec stats)."""
    firsts = reqs[:1] if firsts is None else firsts
    p, n = sum(len(r.sampling.prompt_ids) for r in firsts), sum(len(r.output_ids) for r in reqs)
    drafted, accepted, steps = (sum(getattr(r, f) for r in reqs) for f in ("drafted", "accepted", "steps"))
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}, "drafted": drafted,
            "accepted": accepted, "accept_len": (accepted + steps) / steps if steps else 0.0}


def _held(req: Request) -> int:
    """Characters at the end of the text not yet sent that a stop string still to come could begin with: the longest
    such tail that is a proper prefix of one (not the longest stop string's length - 1 whatever the text: the text
    of a code completion stopped at "\nclass" reaches its client as it comes, but for a tail like "\ncl"). Exact:
    a tail a stop string could complete always starts in text not yet sent, as each commit holds back the longest."""
    text, best = req.text, 0
    for x in req.stop:
        for k in range(min(len(x) - 1, len(text) - req.sent), best, -1):
            if text.endswith(x[:k]):
                best = k
                break
    return best


def _stop_at(req: Request) -> int:
    """Where the first of ``req.stop`` begins in its text, searched from the last characters already sent that a
    stop string could still end in (and ending past ``stop_floor``: min_tokens); -1 where none does."""
    return min((j for j in (req.text.find(x, max(0, req.sent - len(x), req.stop_floor - len(x) + 1))
                            for x in req.stop) if j >= 0), default=-1)


class Engine:
    """The host loop over a ``Backend`` (see the module docstring). ``start()`` runs it in a daemon thread."""

    def __init__(self, backend: Backend, tokenizer, *, eos_token_id: Optional[int], max_waiting: int = 64,
                 metrics=None):
        if max_waiting < 1:  # every request waits in the queue first: 0 would refuse each one
            raise ValueError(f"max_waiting: expected >= 1, got {max_waiting}")
        self.backend, self.tokenizer, self.eos = backend, tokenizer, eos_token_id
        self.max_waiting, self.metrics = int(max_waiting), metrics
        self.waiting: collections.deque = collections.deque()
        self.slots: list = [None] * backend.num_slots  # slot -> Request
        # [slot, request, slices done] whose prompts the backend prefills in slices (``prefill_slice``), oldest
        # first: their slots are taken, and they join the steps once their insert has run
        self.prefilling: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._ids = itertools.count()
        self.error: Optional[BaseException] = None
        self.idle_error: Optional[BaseException] = None  # why the backend's idle work was turned off, if it was

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, req: Request) -> Request:
        return self.submit_all([req])[0]

    def submit_all(self, reqs: Sequence[Request]) -> list:
        """Queue ``reqs`` together (one response's choices), all or none: QueueFull when they do not all fit."""
        reqs = list(reqs)
        for req in reqs:  # outside the lock: a new set of stop strings walks the vocabulary (~10 ms over 4096 ids)
            # (not for a healed request: its ids begin with text its own is not, where the host finds them alone)
            if req.stop and not req.sampling.min_tokens and not req.healed and getattr(self.backend, "stop_states", 0):
                # its stop strings as an automaton over the ids (a backend ends its row where the text holds one)
                req.sampling = dataclasses.replace(req.sampling, stop_fsm=stop_fsm(
                    tuple(req.stop), self.tokenizer, frozenset(req.keep_special), self.backend.stop_states))
        with self._cv:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            if len(self.waiting) + len(reqs) > self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue holds {self.max_waiting})"
                                + (f"; {len(reqs)} more do not fit" if len(reqs) > 1 else ""))
            for req in reqs:
                req.id = req.id or f"cmpl-{next(self._ids)}"
                # in order of priority, FIFO among equals: after every waiting request of the same or a lower one
                at = next((i for i, w in enumerate(self.waiting) if w.priority > req.priority), len(self.waiting))
                if not req.ignore_eos and self.eos is not None and self.eos not in req.sampling.stop_token_ids:
                    # EOS is one of the ids that end it (vLLM's): min_tokens holds it back too, and the backend
                    # knows the request ends there (a launch whose rows have all ended stops: slot_programs.step_rows)
                    req.sampling = dataclasses.replace(
                        req.sampling, stop_token_ids=tuple(req.sampling.stop_token_ids) + (self.eos,))
                req.decoder = self.tokenizer.incremental_decoder(keep_special=req.keep_special, skip_prefix=req.healed)
                self.waiting.insert(at, req)
            self._gauges()
            self._cv.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """Ends ``req`` (a client went away): its slot is freed before the next step."""
        with self._cv:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                self._finish(req, "abort")
            self._cv.notify()

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="jdspark-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop (engine thread)
    def _run(self) -> None:
        pending = None  # (handle, {slot: request}) of a launched step not yet committed (pipelined backends)
        pipelined = hasattr(self.backend, "launch") and hasattr(self.backend, "collect")
        idle_pending = getattr(self.backend, "idle_pending", None)  # work for a backend while nothing runs
        busy_until = time.monotonic()  # when the engine last ran a request's work
        try:
            while True:
                with self._cv:
                    while not self._stop and not self.waiting and not any(self.slots) and pending is None:
                        grace = busy_until + IDLE_GRACE_S - time.monotonic()
                        if idle_pending is None or not idle_pending():
                            self._cv.wait()
                        elif grace > 0:
                            self._cv.wait(grace)
                        else:
                            break
                    if self._stop:
                        return
                    idle = not self.waiting and not any(self.slots) and pending is None
                    admit = []  # slots filled under the lock, prefilled outside it
                    if not idle:
                        self._free_cancelled()
                        for s in range(len(self.slots)):
                            if self.slots[s] is None and self.waiting:
                                req = self.waiting.popleft()
                                self.slots[s] = req
                                admit.append((s, req))
                        self._gauges()
                if idle:  # every slot free, no request waiting, for IDLE_GRACE_S: one unit of idle work
                    try:
                        self.backend.idle_step()
                    except Exception as e:  # an optimisation: its failure must not end the serving
                        self.idle_error, idle_pending = e, None
                        print(f"[engine] idle work failed and is off from now on: {e!r}", file=sys.stderr, flush=True)
                    continue
                for s, req in admit:  # prefill outside the lock: submit() stays responsive
                    req.admitted_at = time.monotonic()
                    if self.metrics:
                        self.metrics.queue_time(req.admitted_at - req.arrival)
                admit = self._slice(admit)
                for i, first in self._insert(admit):  # each as soon as it is prefilled
                    s, req = admit[i]
                    if isinstance(first, ValueError):  # this request cannot be served (e.g. too long): it alone ends
                        with self._cv:
                            self.slots[s] = None  # nothing was placed on the device
                        self._finish(req, "abort", error=str(first))
                        continue
                    self._commit(s, req, [first], prefill=True)
                slicing = {p[0] for p in self.prefilling}
                active = [s for s, r in enumerate(self.slots)
                          if r is not None and r.finished is None and s not in slicing]
                if pipelined:  # launch this step, then commit the previous one's tokens while it computes
                    launched = None
                    active, steps = self._plan_launch(active, pending)
                    if active:  # a backend may run fewer steps than asked; a handle with "steps" says so
                        h = self.backend.launch(active, steps=steps)
                        launched = (h, {s: self.slots[s] for s in active},
                                    h.get("steps", steps) if isinstance(h, dict) else steps)
                    if pending is not None:
                        outs = self.backend.collect(pending[0])
                        for s, req in pending[1].items():
                            if self.slots[s] is req:  # not a request that ended (and maybe left its slot) since
                                self._commit(s, req, outs[s])
                    pending = launched
                elif active:
                    outs = self.backend.step(active)
                    for s in active:
                        self._commit(s, self.slots[s], [outs[s]])
                with self._cv:
                    for s, r in enumerate(self.slots):
                        if r is not None and r.finished is not None:
                            self._release(s)
                    self._gauges()
                busy_until = time.monotonic()
        except BaseException as e:  # surface device errors to every waiting caller, then stop
            self.error = e
            with self._cv:
                for r in list(self.waiting) + [r for r in self.slots if r is not None]:
                    if r.finished is None:
                        self._finish(r, "abort")
                self.waiting.clear()
                self.slots = [None] * len(self.slots)
                self._gauges()
            raise

    def _slice(self, admit: list) -> list:
        """The admitted (slot, request) pairs to insert now. A backend with ``prefill_slice`` prefills a long prompt
        in slices first (``slices_needed``; a prompt one insert could take, only while other streams run or wait):
        such a request waits in ``prefilling``, and each pass of the loop runs one slice of the oldest, or the
        insert of one whose slices are done (the extension of its last slice, which costs a slice: not in the same
        pass as that slice), then the step of the running slots, so their streams wait for one slice at a time,
        not a whole prompt. That insert goes first (its last slice is the most recently kept prompt, which it
        finds)."""
        slicer = getattr(self.backend, "prefill_slice", None)
        if slicer is None:
            return admit
        now = []
        for s, req in admit:  # busy: another stream runs, waits or is admitted with it (theirs would wait for it)
            busy = bool(self.waiting) or sum(r is not None for r in self.slots) > 1
            if self.backend.slices_needed(req.sampling, busy=busy):
                self.prefilling.append([s, req, False])
            else:
                now.append((s, req))
        while self.prefilling:
            s, req, done = self.prefilling[0]
            if self.slots[s] is not req or req.finished is not None:  # cancelled (its slot freed) since
                self.prefilling.popleft()
                continue
            if done:
                self.prefilling.popleft()
                now.insert(0, (s, req))
                break
            before = getattr(self.backend, "slices", 0)  # (a prompt found kept meanwhile needs no slice)
            try:
                self.prefilling[0][2] = slicer(s, req.sampling)
                if self.metrics and getattr(self.backend, "slices", 0) > before:
                    self.metrics.prefill_slice()
            except ValueError as e:  # what its insert would refuse: it alone ends
                self.prefilling.popleft()
                with self._cv:
                    self.slots[s] = None
                self.backend.free(s)
                self._finish(req, "abort", error=str(e))
                continue
            break
        return now

    def _insert(self, admit: list):
        """Prefill the admitted (slot, request) pairs, yielding (index, its first ``StepOutput`` or the ValueError
        that refused it) as each is done. A backend with ``insert_many`` takes them together (it may prefill
        several as one batch)."""
        if len(admit) > 1 and hasattr(self.backend, "insert_many"):
            yield from self.backend.insert_many([(s, req.sampling) for s, req in admit])
            return
        for i, (s, req) in enumerate(admit):
            try:
                yield i, self.backend.insert(s, req.sampling)
            except ValueError as e:
                yield i, e

    def _plan_launch(self, active: list, pending) -> tuple:
        """The slots the next pipelined launch steps, and its steps, given the launch still in flight (``pending``:
        its handle, {slot: request}, steps).

        A launch made while the previous one computes has a row for every active request, and a request that the
        previous launch ends runs its row for nothing; at one request that is a whole launch of device work (4
        steps of 8 verified tokens at c = 1 on a CPU: ~20 ms; docs/serving.md, "No launch for a request its launch
        in flight ends"). Each step commits at least one token, and a request's own tokens per step so far
        (``rate``, 1 for plain decoding) say how many the launch in flight will likely commit, so:

            a row the launch in flight surely ends (max_tokens - committed <= its steps) is not launched;
            when every row is likely ended by it (max_tokens - committed <= steps x rate), nothing is launched: the
                engine collects first, and a row that was not ended after all is launched then (one launch that
                does not overlap the host's commit: ~1 ms, against a launch run for nothing).

        Only max_tokens is foreseeable: a request that ends on EOS or a stop string still has its row in the launch
        after. Rows are left out only where they are certain to have ended (or where nothing is launched): a
        backend's largest bucket steps every slot, listed or not, so a row left out of a launch must be done."""
        need = {}  # slot -> tokens likely still needed after the launch in flight, in the order of ``active``
        for s in active:
            req = self.slots[s]
            k = pending[2] if pending is not None and pending[1].get(s) is req else 0  # its steps in flight
            left = req.sampling.max_tokens - len(req.output_ids)
            if left <= k:  # the launch in flight commits >= 1 token a step: this request ends there
                continue
            rate = max(1.0, (len(req.output_ids) - 1) / req.steps) if req.steps else 1.0
            need[s] = left - k * rate
        if not any(n > 0 for n in need.values()):
            return [], 1
        # several steps a launch only while no request waits for a slot or for its prompt's next slice
        return list(need), (self.backend.steps_for(len(need)) if not self.waiting and not self.prefilling else 1)

    def _free_cancelled(self) -> None:
        for s, r in enumerate(self.slots):
            if r is not None and r.cancelled:
                if r.finished is None:
                    self._finish(r, "abort")
                self._release(s)

    def _release(self, s: int) -> None:
        self.slots[s] = None
        self.backend.free(s)

    def _commit(self, s: int, req: Request, outs: Sequence[StepOutput], prefill: bool = False) -> None:
        """Append the tokens of a launch's steps (in order) to ``req``, cut at EOS / max_tokens / a stop string,
        and send one event. Steps after the one that ended the request are not counted."""
        if req.finished is not None or req.cancelled:
            return
        now = time.monotonic()
        reason, take, used, eos, lps = None, [], [], False, []
        for out in outs:
            used.append(out)
            for j, t in enumerate(out.tokens):
                take.append(int(t))
                if out.logprobs is not None:
                    lps.append(out.logprobs[j])
                if ((not req.ignore_eos and self.eos is not None and int(t) == self.eos)
                        or int(t) in req.sampling.stop_token_ids):
                    reason, eos = "stop", True
                    req.stop_reason = None if int(t) == self.eos and not req.ignore_eos else int(t)
                    break
                if len(req.output_ids) + len(take) >= req.sampling.max_tokens:
                    reason = "length"
                    break
            if reason is not None:
                if j + 1 < len(out.tokens):  # cut inside this step: drafts accepted past the cut (after EOS, a
                    # stop id or max_tokens) were never the request's, so usage and metrics do not count them
                    used[-1] = dataclasses.replace(out, accepted=min(out.accepted, j + 1))
                break
        if req.sampling.max_tokens == 0:  # an echo of the prompt alone: the insert's token is not the request's
            take, reason, eos = [], "length", False
        if prefill:
            req.cached_tokens = sum(o.cached for o in used)
        else:
            req.steps += len(used)
            req.drafted += sum(o.drafted for o in used)
            req.accepted += sum(o.accepted for o in used)
        cut = -1
        shown = take[:-1] if eos else take  # EOS / a stop token id ends the request without text (vLLM)
        if req.stop:  # token by token: the tokens after the one that completes a stop string were never the
            for i, t in enumerate(shown):  # request's (usage counts what the client got)
                req.text += req.decoder.add([t])
                if len(req.output_ids) + i + 1 < req.sampling.min_tokens:  # vLLM: no stop before min_tokens
                    req.stop_floor = len(req.text)
                    continue
                cut = _stop_at(req)
                if cut >= 0:
                    take = take[:i + 1]
                    break
        else:
            req.text += req.decoder.add(shown)
        if reason is not None and cut < 0:
            req.text += req.decoder.flush()
            cut = _stop_at(req)
        if cut >= 0:
            req.stop_reason = next(x for x in req.stop if req.text.startswith(x, cut))
            req.text, reason = req.text[:cut + len(req.stop_reason) * req.include_stop_str], "stop"
        req.output_ids += take
        lps = lps[:len(take)] if req.sampling.logprobs is not None else None
        plp = outs[0].prompt_logprobs if prefill else None
        hold = 0 if reason is not None else _held(req)  # a tail that could still become a stop string
        upto = max(req.sent, len(req.text) - hold)
        delta = req.text[req.sent:upto]
        req.sent = upto
        if self.metrics:
            self.metrics.step(req, used, take, now, prefill)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        if reason is not None:
            keep = getattr(self.backend, "keep_answer", None)
            if keep is not None and cut < 0:  # a stop string's cut: the client's text is not these ids
                keep(req.sampling, req.output_ids[:-1] if eos else req.output_ids)  # before the caller hears
            self._finish(req, reason, delta, take, logprobs=lps, prompt_logprobs=plp)
        elif delta or take or plp:
            req.on_event(Event(delta, take, logprobs=lps, prompt_logprobs=plp))

    def _finish(self, req: Request, reason: str, delta: str = "", take=(), error: Optional[str] = None,
                logprobs: Optional[list] = None, prompt_logprobs: Optional[list] = None) -> None:
        req.finished = reason
        if self.metrics:
            self.metrics.finished(req, reason, time.monotonic())
        req.on_event(Event(delta, list(take), finish_reason=reason, usage=req.usage(), error=error,
                           logprobs=logprobs if logprobs is not None or req.sampling.logprobs is None else [],
                           prompt_logprobs=prompt_logprobs, stop_reason=req.stop_reason))

    def kv_usage(self) -> float:
        """The slots' cache positions in use: the running requests' prompt + output tokens over slots x max_len
        (0 for a backend without a ``max_len``)."""
        max_len = getattr(self.backend, "max_len", None)
        if not max_len:
            return 0.0
        used = sum(len(r.sampling.prompt_ids) + len(r.output_ids) for r in self.slots if r is not None)
        return min(1.0, used / (self.backend.num_slots * max_len))

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.gauges(self.num_running, self.num_waiting, self.kv_usage())
            costs = getattr(self.backend, "costs", None)  # an adaptive backend's cost table (slots.SlotBackend)
            if costs:
                self.metrics.step_costs(costs)
