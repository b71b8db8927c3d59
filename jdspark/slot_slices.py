"""Prefix-cache work before an insert (a mixin of ``jdspark.slots.SlotBackend`` through ``slot_insert.Inserts``,
split from it by concern): a long prompt's slices (``prefill_slice``), the beginning a prompt shares with a kept one
kept on its own where they part (``_split``), and the prompt log-probabilities kept with a kept prompt
(``_keep_entries``). Each leaves the slot a record (``_Sliced``: what was kept before, the last kept prompt it
extends, pinned, and its entries) that the insert (``Inserts._prepare``, ``_finish_insert``) reads.

Long prompts in slices (``slice_tokens`` S): a prompt whose insert would prefill more than S tokens is prefilled S at
a time into the prefix cache (``prefill_slice``), the engine stepping the running slots between slices
(``jdspark.engine.Engine._slice``), and its insert is then a prefix-cache hit on the last slice: a long prompt stalls
the other streams one slice at a time, and prompts past the largest bucket are served (docs/serving.md, "Long
prompts in slices").

Shared beginnings (``_split``): a prompt that shares a long beginning with a kept prompt and then parts from it (a
system prompt before each user's message, a question before each choice) prefills that beginning first and keeps
it, so the prompts after it find it kept (docs/serving.md, "Shared beginnings kept where prompts part").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jdspark.engine import SamplingRequest
from jdspark.logprobs import host_entries
from jdspark.prefix import snapshot
from jdspark.slot_programs import SAMPLING_OFF
from kimi import dispatch

__all__ = ["Slices"]


@dataclasses.dataclass
class _Sliced:
    """A slot's record from its prompt's slices, shared beginning or kept entries until its insert
    (``Slices.prefill_slice``, ``_split``, ``_from_entries``; ``SlotBackend.sliced``)."""
    before: int  # its prompt tokens the prefix cache kept before its slices (its insert reports them as cached)
    last: Optional[tuple]  # the prompt its last slice kept (pinned in the prefix cache), None before the first
    ptop: int  # the top entries of its prompt's log-probabilities asked (-1: none)
    entries: Optional[list] = None  # with ptop: prompt tokens 0 .. (its last slice's end)'s entries (the first None)
    own: bool = False  # ``last`` was kept by its own slices (its row goes on to keep the next one), not found kept

    def __post_init__(self):
        if self.ptop >= 0 and self.entries is None:
            self.entries = [None]


def _prompt_entries(lp, n: int, top: int) -> list:
    """The host entries (``host_entries``, with ranks) of the first ``n`` prompt positions of ``lp``."""
    return host_entries(lp.chosen_K, lp.top_ids_KL, lp.top_KL, n, top, lp.rank_K)


class Slices:
    """``prefill_slice``, ``slices_needed`` and the shared beginnings and kept entries of ``SlotBackend``."""

    # ------------------------------------------------------------------ long prompts in slices
    def slices_needed(self, req: SamplingRequest, busy: bool = True) -> bool:
        """Whether ``req``'s prompt is prefilled in slices (``prefill_slice``, the engine stepping the other slots
        between them) before its insert: slicing is on (``slice_tokens``), the prefix cache may keep the prompt
        (text) and its insert would prefill more than ``slice_tokens`` tokens after the longest kept prompt it
        begins with (a request asking for its prompt's log-probabilities: whose entries were kept with it,
        ``_entries_kept``; after none, its slices computing them).
        Not ``busy`` (no other stream runs or waits, so no stream would wait for it): only where one insert could
        not take the prompt at all (past the largest bucket, and no kept prompt leaves a rest that fits): in slices
        its first token comes later (docs/serving.md)."""
        S = self.slice_tokens
        if not S or not self._keeps(req) or len(req.prompt_ids) <= S:
            return False
        n = len(req.prompt_ids)
        if not busy and n <= self.prompt_buckets[-1]:
            return False
        most = S if busy else self.prompt_buckets[-1]
        fits = (lambda m: n - m <= most and self.extension_bucket(m, n) is not None)  # noqa: E731
        if req.prompt_logprobs is not None:
            return self._entries_kept(req.prompt_ids, int(req.prompt_logprobs), fits) is None
        return self.prefix.lookup(req.prompt_ids, fits, count=False) is None

    def prefill_slice(self, slot: int, req: SamplingRequest) -> bool:
        """Prefill the next slice (at most ``slice_tokens`` tokens) of ``req``'s prompt after the longest prefix of
        it the prefix cache keeps, using ``slot`` (free until its insert) as scratch, and keep the result in the
        prefix cache; True once ``insert(slot, req)`` will prefill the rest as one extension (a hit). ValueError,
        at the first slice, for what ``insert`` would refuse.

        Each slice starts from what the cache keeps, not from the slot: a launch of the largest batch bucket steps
        every slot, this one too, and a kept row is copied whole into the slot by the next extension. A prompt of n
        tokens (n > S) is cut as [0, S), [S, 2S), ... up to n - S, then [n - S, n) is the insert's own extension,
        so every padded slice ends inside the cache (kept + its bucket <= n); a slice ends early where the prompt
        parts from a kept one (``_part_point``, at least the cache's minimum past what it had kept), so the shared
        beginning is kept on its own, as ``_split`` keeps it. The last slice's row is pinned until
        the insert (``PrefixPool.pin``: the prompts kept meanwhile evict other rows); were it gone anyway (the cache
        cleared), the next slice starts from the longest prefix still kept: more work, the same prompt.

        A request asking for its prompt's log-probabilities starts from a kept prompt whose entries were kept with
        its next token (``_from_entries``), else from its first token, then from its own slices only: each slice
        computes its tokens' entries, the last one scoring the next slice's first token, gathered in its record
        (``_Sliced``) until the insert adds the rest, and kept with the slice (``_keep_entries``); were its last
        slice gone, it starts over."""
        S, ids, n = self.slice_tokens, tuple(int(t) for t in req.prompt_ids), len(req.prompt_ids)

        def finishes(m):  # from m kept tokens, either another slice or the insert's extension does the rest
            return n - m > S or self.extension_bucket(m, n) is not None

        first = slot not in self.sliced
        if first:
            _, _, ptop = self._check(req)
            self._controls(req), self._first(req)  # a bad bias or first-token set is refused before any work
        rec = self.sliced[slot] if not first else self._from_entries(ids, ptop, finishes) or _Sliced(0, None, ptop)
        if rec.ptop < 0:
            hit = self.prefix.lookup(ids, finishes, count=first)
        else:  # its last slice, a kept prompt whose entries were kept (``_from_entries``), or from the start (its
            # prompt never counts a prefix-cache query: the metrics count what a request reports cached)
            hit = None if rec.last is None else self.prefix.lookup(
                ids, lambda m: m == len(rec.last) and finishes(m), count=False)
        kept = 0 if hit is None else hit[1]
        if rec.ptop >= 0:  # the entries of prompt tokens 0 .. kept (the first: None), as the slices gave them
            rec.entries = rec.entries[:kept + 1]
        if first:  # the prompt tokens its client had kept (``StepOutput.cached``), and its last slice kept (pinned)
            rec.before = kept
            self.sliced[slot] = rec
        if n - kept <= S:
            return True
        end = min(kept + S, n - S)
        cut = self._part_point(ids, rec.ptop) if self.prefix_split else 0
        if kept + self.prefix.min_tokens <= cut < end:  # it parts from a kept prompt here: a slice ends there,
            end = cut  # kept on its own (the next slice's row is a new one), as ``_split`` keeps it
        self._prefill_part(slot, rec, ids, None if hit is None else hit[0], kept, end)
        if end == cut:
            rec.own = False
        self.slices += 1
        return n - end <= S

    def _part_point(self, ids: tuple, ptop: int) -> int:
        """Where ``ids`` parts from the kept prompts (``PrefixPool.shared``), a token before for a request asking for
        its prompt's entries (the entry of the token after the kept ones is then the same for all that share it)."""
        return self.prefix.shared(ids) - (ptop >= 0)

    def _prefill_part(self, slot: int, rec: "_Sliced", ids: tuple, row: Optional[int], kept: int, end: int) -> None:
        """Prefill prompt tokens ``ids[kept:end]`` into ``slot`` (scratch until its insert), on the kept prompt
        in pool ``row`` (None: from nothing, ``kept`` 0), and keep ``ids[:end]`` in the prefix cache, pinned as
        ``rec.last`` (``prefill_slice``'s slice, ``_split``'s shared beginning). With ``rec.ptop``, the tokens'
        entries are added to ``rec.entries``, the last scoring ``ids[end]``."""
        padded = self._padded(ids[kept:end])
        P = padded.shape[1]
        asks = rec.ptop >= 0
        if row is None:  # a plain insert of them (its first token drawn greedily, dropped)
            _, lp = self._prefill(slot, padded, end, 0, SAMPLING_OFF, None,
                                  dispatch.prefill_chunk(P, self.prefill_chunk), asks, next_token=ids[end])
        else:
            _, lp = self._extend(slot, row, padded, end - kept, 0, prompt_logprobs=asks, next_token=ids[end])
        if asks:  # its tokens kept + 1 .. end (the last the next slice's first token)
            rec.entries += _prompt_entries(jax.device_get(lp[1]), end - kept, rec.ptop)
        # the slice before this one's row now keeps this one (one row for all its slices), else a row of its own;
        # pinned until the insert, so that the prompts kept meanwhile cannot evict it (``_unslice``)
        own = rec.own and rec.last == ids[:kept]
        new = self.prefix.rekey(rec.last, ids[:end]) if own else self.prefix.store(ids[:end])
        if new is not None:
            self.pool = snapshot(self.pool, self.state, np.int32(slot), np.int32(new))
        if new is not None or ids[:end] in self.prefix.rows:  # kept now, or already (the state after these tokens:
            # a request asking for prompt log-probabilities, which looks up its own last slice only, goes on from it)
            if rec.last is not None and rec.last != ids[:end]:
                self.prefix.pin(rec.last, on=False)
            self.prefix.pin(ids[:end])
            rec.last, rec.own = ids[:end], new is not None
            if asks:  # its tokens' entries up to the next one, for the prompts that begin with these tokens and it
                self._keep_entries(ids[:end + 1], rec.ptop, rec.entries[:end + 1])
        # done before the engine's next launch is dispatched: queued behind it instead, the slice, the pool's copy
        # and the launch ran slower together (a 512-token slice's pass ~280 ms of the streams' time, ~150 so)
        jax.block_until_ready((self.state, self.pool))

    # ------------------------------------------------------------------ a shared beginning kept on its own
    def _split(self, slot: int, req: SamplingRequest) -> None:
        """Keep the beginning ``req``'s prompt shares with a kept prompt, where it parts from it, before the insert.

        The prefix cache keeps the state after whole prompts (a recurrent state cannot be cut back), so prompts
        that share a long beginning and then part (a coding agent's system prompt and tools before each user's
        message, a few-shot context, a multiple-choice question before each choice) found nothing kept: each
        prefilled the beginning again. Where ``req``'s prompt shares at least ``prefix.min_tokens`` more leading
        tokens with a kept prompt (``PrefixPool.shared``: L) than the longest kept prompt it begins with (m), its
        tokens m .. L are prefilled first (into ``slot``, on the kept m) and kept as a prompt of their own, and its
        insert extends that: this request pays one more program, and every later prompt beginning with those L
        tokens finds them kept (SGLang and vLLM keep recurrent states at such branch points or at block
        boundaries for the same reason). Not for images, nor where the two parts would not fit the buckets.

        A request asking for its prompt's log-probabilities (lm-eval's loglikelihood: a question, then each
        choice) needs the kept tokens' entries too, and the entry of the first token after them, which the kept
        state alone cannot give (its last position's logits are gone): it extends only a kept prompt whose entries
        were kept with that next token (``_keep_entries``, by such a request's slice or split), and its own split
        stops a token short of where the prompts part (that token's entry is the same for all of them), computing
        and keeping the entries. The slot's record (``_Sliced``) says what was kept before (the request's
        ``cached`` tokens, counted once here) and carries the entries; ValueError for what its insert would
        refuse, before any work."""
        if not self._keeps(req) or slot in self.sliced:
            return
        ids, n, least = tuple(int(t) for t in req.prompt_ids), len(req.prompt_ids), self.prefix.min_tokens
        ptop = -1 if req.prompt_logprobs is None else int(req.prompt_logprobs)
        if ptop >= 0:  # a kept prompt it begins with whose tokens' entries were kept: it extends that
            self._check(req)  # (before any pin: a refused request leaves none)
            self._controls(req), self._first(req)
            rec = self._from_entries(ids, ptop, lambda m: self.extension_bucket(m, n) is not None)
            if rec is not None:
                self.sliced[slot] = rec
                return
        if not self.prefix_split:
            return
        L = self._part_point(ids, ptop)
        if L < least or self.extension_bucket(L, n) is None:
            return

        def part_fits(m):  # tokens m .. L in one program: an extension of the kept m, or (m 0) a prompt bucket
            return L - m >= least and (self.extension_bucket(m, L) is not None if m else L <= self.prompt_buckets[-1])

        if ptop >= 0:  # on a kept prompt whose entries were kept (pinned, its record), or from its first token
            rec = self._from_entries(ids, ptop, lambda m: m and part_fits(m))
            base = None if rec is None else (self.prefix.rows[rec.last], len(rec.last))
            if base is None and not part_fits(0):
                return
            rec = rec or _Sliced(0, None, ptop)
        else:
            longest = self.prefix.lookup(ids, count=False)
            if longest is not None and not part_fits(longest[1]):  # kept already (nearly) as far as it is shared
                return
            base = self.prefix.lookup(ids, part_fits, count=False)
            if base is None and not part_fits(0):
                return
            self._check(req)
            self._controls(req), self._first(req)  # a bad bias or first-token set is refused before any work
            before = self.prefix.lookup(ids, lambda m: self.extension_bucket(m, n) is not None)  # counted, as an insert
            rec = _Sliced(0 if before is None else before[1], None, -1)
        self.sliced[slot] = rec
        self._prefill_part(slot, rec, ids, None if base is None else base[0], 0 if base is None else base[1], L)
        self.splits += 1

    # ------------------------------------------------------------------ prompt entries kept with a kept prompt
    def _keep_entries(self, ids: tuple, ptop: int, entries: list) -> None:
        """Keep the entries of prompt tokens 0 .. k (``entries``, the first None; ``ptop`` top ones each) with the
        kept prompt ``ids[:k]`` (``ids`` one token longer: the entry of the last is the one after it, scored by
        its last position). Kept while that prompt is: what is no longer kept is dropped here."""
        for key in [k for k in self.kept_entries if k[:-1] not in self.prefix.rows]:
            del self.kept_entries[key]
        old = self.kept_entries.get(ids)
        if old is None or old[0] < ptop:
            self.kept_entries[ids] = (ptop, entries)

    def _entries_kept(self, ids, ptop: int, fits) -> Optional[tuple]:
        """(kept prompt, its entries) of the longest kept prompt that ``ids`` begins with, leaving at least one
        token, whose entries were kept (``_keep_entries``) with ``ids``' next token and at least ``ptop`` top ones,
        where ``fits(its length)``; None without one. A request asking for its prompt's log-probabilities may
        extend only such a prompt: the kept tokens' entries are served from here."""
        ids = tuple(int(t) for t in ids)
        best = None
        for key, (top, entries) in self.kept_entries.items():
            k = len(key) - 1
            if (k < len(ids) and top >= ptop and key[:-1] in self.prefix.rows and ids[:k + 1] == key and fits(k)
                    and (best is None or k > len(best[0]))):
                best = (key[:-1], entries)
        return best

    def _from_entries(self, ids: tuple, ptop: int, fits) -> Optional["_Sliced"]:
        """A slicing record that starts ``ids`` (``ptop`` >= 0) from the kept prompt ``_entries_kept`` finds
        (pinned until its insert, reported as cached), or None."""
        if ptop < 0:
            return None
        found = self._entries_kept(ids, ptop, fits)
        if found is None:
            return None
        key, entries = found
        self.prefix.lookup(ids, lambda m: m == len(key), count=False)  # most recent
        self.prefix.pin(key)
        return _Sliced(len(key), key, ptop, [None if e is None else (e[0], e[1][:ptop], *e[2:]) for e in entries])

    def _unslice(self, slot: int) -> "_Sliced":
        """Drop ``slot``'s slicing record (its insert ran, was refused, or its request went away) and unpin its last
        slice: the record (an empty one without)."""
        rec = self.sliced.pop(slot, None) or _Sliced(0, None, -1)
        if rec.last is not None:
            self.prefix.pin(rec.last, on=False)
        return rec
