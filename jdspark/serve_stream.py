"""A response's choices from the engine's events: the event loop's mailbox, the collected (non-streaming) answer
and the SSE stream, for one or ``n`` choices (the API's ``n``: one prompt, n completions, each its own engine
request with its own seed, ``jdspark.serve``).

Every choice's events arrive on one queue as (choice index, ``Event``), in the order the engine made them. A
streamed response interleaves the choices' chunks (each names its ``index``, as OpenAI's do); each choice ends with
its own finish chunk; ``usage`` (``stream_options.include_usage``) and ``data: [DONE]`` come once, after the last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Optional, Sequence

from jdspark import reasoning
from jdspark.engine import Event, combined_usage
from jdspark.logprobs import chat_logprobs, completion_logprobs
from jdspark.tool_calls import Splitter

__all__ = ["Mailbox", "Choice", "collect", "sse"]


class Mailbox:
    """Engine events into the event loop's per-request queues with one wake-up per batch, not one per event.

    The engine's thread commits a step's tokens for every active request at once; ``loop.call_soon_threadsafe``
    per event writes the loop's self-pipe once per request (a system call each; with 16 streams `top` showed half
    of this machine's CPU time in the kernel). ``post`` appends under a lock and schedules one
    ``_flush`` while none is pending; ``_flush`` delivers everything posted so far, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._lock, self._items, self._scheduled = loop, threading.Lock(), [], False

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop closed (shutting down): nothing will read these; let a later post retry
            with self._lock:
                self._scheduled = False
            raise

    def _flush(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def logprobs_object(tokenizer, chat: bool, top: Optional[int], ids: list, entries: list, offset: int):
    """A choice's ``logprobs`` (None when the request asked for none)."""
    if top is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, ids, entries, top)
    return completion_logprobs(tokenizer, ids, entries, top, offset)


@dataclasses.dataclass
class Choice:
    """What one choice has received so far: its text pieces, the token ids and log-probability entries it shows
    (an echo's prompt first), and the event that ended it."""
    text: list = dataclasses.field(default_factory=list)
    ids: list = dataclasses.field(default_factory=list)
    entries: list = dataclasses.field(default_factory=list)
    last: Optional[Event] = None
    prompt: Optional[list] = None  # the prompt tokens' entries (its first event's), when asked
    logprob_sum: float = 0.0  # of the generated tokens (an echoed prompt's not counted)
    generated: int = 0

    @property
    def mean_logprob(self) -> float:
        """The generated tokens' mean log-probability (``best_of``'s ranking; 0 with none)."""
        return self.logprob_sum / self.generated if self.generated else 0.0

    def add(self, ev: Event, prompt_ids, echo: bool = False) -> None:
        """Take an event; an echoed choice's (``echo``) ids and entries begin with the prompt's."""
        self.text.append(ev.text)
        if ev.prompt_logprobs is not None:
            self.prompt = ev.prompt_logprobs
            if echo:
                self.ids, self.entries = list(prompt_ids) + self.ids, ev.prompt_logprobs + self.entries
        if ev.logprobs is not None:
            self.ids += ev.token_ids
            self.entries += ev.logprobs
            self.logprob_sum += sum(e[0] for e in ev.logprobs)
            self.generated += len(ev.logprobs)
        if ev.finish_reason is not None:
            self.last = ev


async def collect(request, engine, reqs: Sequence, events: asyncio.Queue,
                  echoes: Optional[Sequence] = None) -> Optional[list]:
    """Every choice's events until each has finished: the ``Choice`` list, or None when the client went away
    (every choice cancelled: their slots are freed). ``echoes``: per choice, its echoed prompt's text or None."""
    got = [Choice() for _ in reqs]
    left = len(reqs)
    try:
        while left:
            try:
                i, ev = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    for r in reqs:
                        engine.cancel(r)
                    return None
                continue
            got[i].add(ev, reqs[i].sampling.prompt_ids, echoes is not None and echoes[i] is not None)
            left -= ev.finish_reason is not None
    except asyncio.CancelledError:
        for r in reqs:
            engine.cancel(r)
        raise
    return got


async def sse(request, engine, reqs: Sequence, events: asyncio.Queue, chat: bool, created: int, model_name: str,
              include_usage: bool, tokenizer, echoes: Optional[Sequence] = None, tools: bool = False,
              thinking: Optional[bool] = None, firsts: Optional[Sequence] = None, continuous: bool = False):
    """The SSE stream of a response's choices (module doc); a client that goes away cancels every choice.
    ``echoes``: per choice, its prompt's text to send first (None: none); ``firsts``: ``combined_usage``'s;
    ``continuous`` (vLLM's continuous_usage_stats): every chunk carries {prompt_tokens, completion_tokens,
    total_tokens} of the tokens its response has streamed so far, this chunk's included.
    ``tools``: each choice's text goes through a ``jdspark.tool_calls.Splitter`` (its calls streamed as deltas);
    ``thinking`` (not None: the prompt opened a think block or not), first through a ``jdspark.reasoning.Splitter``
    (its reasoning sent as ``delta.reasoning_content``, the answer on to the tool splitter)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    rid = reqs[0].id
    sent = [0] * len(reqs)  # characters of text streamed so far, per choice (completions' text_offset)
    echoes = [None] * len(reqs) if echoes is None else list(echoes)
    echoed = [e is None for e in echoes]
    finished = [False] * len(reqs)
    streamed = [0] * len(reqs)  # tokens each choice's chunks have carried
    prompt_tokens = sum(len(r.sampling.prompt_ids) for r in (reqs[:1] if firsts is None else firsts))
    splitters = [Splitter() for _ in reqs] if tools else None
    thinkers = None if thinking is None else [reasoning.Splitter(thinking) for _ in reqs]

    def data(body: dict) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def chunk(i: int, text: Optional[str], finish: Optional[str], first: bool = False, ev: Optional[Event] = None,
              ids=None, entries=None, calls=None, thought: str = "") -> str:
        lp = None
        if ev is not None and ev.logprobs is not None:
            ids, entries = ev.token_ids, ev.logprobs
        if entries is not None:
            lp = logprobs_object(tokenizer, chat, reqs[i].sampling.logprobs, ids, entries, sent[i])
        sent[i] += len(text or "")
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            if thought:
                delta = {"reasoning_content": thought, **delta}
            if calls is not None:
                delta = {"tool_calls": calls}
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
        if finish is not None:  # vLLM's: the stop string or stop token id that ended the choice
            choice["stop_reason"] = reqs[i].stop_reason
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
        if continuous:
            done = sum(streamed)
            body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                             "total_tokens": prompt_tokens + done}
        return data(body)

    def events_of(i: int, ev: Event, out: list) -> bool:
        """Append choice ``i``'s SSE events for ``ev`` to ``out``; True when the whole stream has ended."""
        if not echoed[i]:  # the prompt first (and its log-probabilities: the first event carries them)
            echoed[i] = True
            out.append(chunk(i, echoes[i], None, ids=list(reqs[i].sampling.prompt_ids),
                             entries=ev.prompt_logprobs))
        streamed[i] += len(ev.token_ids)
        thought, text = ("", ev.text) if thinkers is None else thinkers[i].feed(ev.text)
        text, calls = (text, []) if splitters is None else splitters[i].feed(text)
        if thought or text or (ev.logprobs and ev.token_ids):  # held-back text's tokens still bring logprobs
            out.append(chunk(i, text, None, ev=ev, thought=thought))
        out.extend(chunk(i, None, None, calls=[c]) for c in calls)  # a call's deltas as they come
        if ev.error is not None:
            body = {"error": {"message": ev.error, "type": "invalid_request_error", "param": "prompt", "code": None}}
            out.append(f"data: {json.dumps(body)}\n\n")
        if ev.finish_reason is None:
            return False
        finish = ev.finish_reason
        if thinkers is not None:
            thought, rest = thinkers[i].finish()
            rest, calls = (rest, []) if splitters is None else splitters[i].feed(rest)
            if thought or rest:
                out.append(chunk(i, rest, None, thought=thought))
            out.extend(chunk(i, None, None, calls=[c]) for c in calls)
        if splitters is not None:
            rest, calls, called = splitters[i].finish()
            if rest:
                out.append(chunk(i, rest, None))
            out.extend(chunk(i, None, None, calls=[c]) for c in calls)
            finish = "tool_calls" if called else finish
        out.append(chunk(i, None, finish))
        finished[i] = True
        if not all(finished):
            return False
        if include_usage:
            out.append(data({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                             "usage": combined_usage(reqs, firsts)}))
        out.append("data: [DONE]\n\n")
        return True

    done = False
    try:
        if chat:
            yield "".join(chunk(i, None, None, first=True) for i in range(len(reqs)))
        while not done:
            try:
                item = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            # every event already queued goes out in the same write (each still its own SSE event): one socket
            # write per stream per engine launch, however many steps or tokens it committed
            out: list = []
            done = events_of(*item, out)
            while not done and not events.empty():
                done = events_of(*events.get_nowait(), out)
            yield "".join(out)
    finally:
        if not done:  # the client went away (or the task was cancelled): free the slots now
            for r in reqs:
                engine.cancel(r)
