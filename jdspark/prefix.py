"""Prefix caching for the serving slots: a prompt that begins with a prompt served before prefills only its new
tokens, on top of a copy of the caches the earlier prompt left.

Why: a coding agent or a chat client sends the whole conversation again on every turn (system prompt, tools, every
earlier turn, then the new message), so without a cache each turn's time to first token grows with the whole
conversation, and a conversation past the largest prompt bucket cannot be served at all. With one, a turn pays
for its new tokens (the previous answer and the new message), and its prompt may be as long as the slots' cache.

What is kept: the whole stream state of a slot right after its prompt's prefill (target cache: KDA and conv state,
MLA latents; the drafter's context; in ``pool``, a pytree of the slots' own leaves with a leading axis of
``capacity`` rows), keyed by the prompt's token ids. A slot's state after its completion is not kept as it is:
Kimi's KDA layers are recurrent, so a state cannot be cut back to an earlier position, and that state holds the
tokens of its last draft block past the request's end (which the client never saw). vLLM's prefix caching of
hybrid (Mamba-style) models keeps states at block boundaries for the same reason.

    lookup(prompt): the longest kept prompt p with prompt[:len(p)] == p and len(p) < len(prompt)   (host, LRU)
    hit:  state[slot] <- extend_stream(pool[row], prompt[len(p):])    one chunk on the kept state (``extend``)
    miss: the slot's ordinary insert (``jdspark.slots``)
    then: pool[row'] <- state[slot] for the new prompt (``snapshot``), unless it is shorter than ``min_tokens``

Answers, when the engine is idle: the next turn of a conversation is the prompt + its answer + a new message, so a
finished request's prompt + answer (``remember``; the answer without an EOS that ended it: a chat template closes
the turn its own way) is prefilled on the kept prompt, in the extension's buckets (an answer longer than the
largest in chunks of it, each kept), while no request is running or waiting (``next_pending``, the newest first,
at most ``PENDING_ANSWERS`` waiting: a burst's older answers are dropped). The next turn then prefills only its
message. Idle time is otherwise unused (a chat user reads, an agent runs its tool); a request that arrives during
such a prefill waits for it (one extension, ~20-50 ms for the shipped pair here).

A hit's output equals a fresh prefill's up to float reassociation (the chunked prefill's form); the sampled first
token is drawn with the request's own key, as a fresh prefill's is. Requests with images are neither looked up nor
kept. ``PrefixPool`` is the host index alone (no JAX), so its policy is tested on its own.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.graphs import merge_module
from jdspark.sampling import Penalties, SamplingParams
from jdspark.speculative import extend_stream
from jdspark.stop_strings import no_stops

__all__ = ["PrefixPool", "PREFIX_MIN_TOKENS", "PENDING_ANSWERS", "default_pool_rows", "tree_bytes", "pool_like",
           "snapshot", "extend"]

# Prompts shorter than this are not kept: their prefill is a few ms, a kept row is a slot's whole cache.
PREFIX_MIN_TOKENS = 32
# The server's default pool (``--prefix-pool`` unset): this many rows, fewer where they would take more than
# PREFIX_POOL_BUDGET_BYTES (a row is a slot's whole state: ~1.4 MiB for the shipped pair at 1024 positions, ~117
# MiB of MLA latents alone at 128K), at least one.
PREFIX_POOL_ROWS = 32
PREFIX_POOL_BUDGET_BYTES = 512 << 20
# Finished requests' prompt + answer waiting to be kept while the engine is idle (``PrefixPool.remember``).
PENDING_ANSWERS = 4


def default_pool_rows(row_bytes: int) -> int:
    """Rows of the default pool for rows of ``row_bytes`` each (see PREFIX_POOL_BUDGET_BYTES)."""
    return max(1, min(PREFIX_POOL_ROWS, PREFIX_POOL_BUDGET_BYTES // max(1, int(row_bytes))))


class PrefixPool:
    """Which kept prompt each of ``capacity`` device rows holds; least recently used rows are reused first."""

    def __init__(self, capacity: int, min_tokens: int = PREFIX_MIN_TOKENS):
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1 rows, got {capacity}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens: expected >= 1, got {min_tokens}")
        self.capacity, self.min_tokens = int(capacity), int(min_tokens)
        self.rows: collections.OrderedDict = collections.OrderedDict()  # prompt ids (tuple) -> row, oldest first
        self.queries = self.hits = 0  # prompt tokens looked up, and those found kept (vLLM's counters' units)
        self.pending: collections.deque = collections.deque(maxlen=PENDING_ANSWERS)  # newest last
        self.pinned: set = set()  # kept prompts ``store`` does not evict (a long prompt's slice until its insert)
        self.answers: set = set()  # kept prompt + answer sequences (``store(answer=True)``): not ``shared``'s

    def __len__(self) -> int:
        return len(self.rows)

    def lookup(self, ids: Sequence[int], fits: Optional[Callable[[int], bool]] = None,
               count: bool = True) -> Optional[tuple]:
        """(row, n) of the longest kept prompt that is a proper prefix of ``ids`` (n its tokens; at least one token
        of ``ids`` is left to prefill, whose logits give the first token) and for which ``fits(n)`` holds (the
        caller's room for the rest), or None. A hit becomes most recent. ``count``: add to ``queries`` / ``hits``
        (False for a prompt already counted: a long prompt's later slices and its insert, ``jdspark.slot_slices``)."""
        ids = tuple(int(t) for t in ids)
        best = self._longest(ids, fits)
        if count:
            self.queries += len(ids)
            self.hits += 0 if best is None else best[1]
        return best

    def _longest(self, ids: tuple, fits) -> Optional[tuple]:
        """``lookup`` without the counters."""
        best = None
        for key, row in self.rows.items():
            n = len(key)
            if (n < len(ids) and (best is None or n > best[1]) and ids[:n] == key
                    and (fits is None or fits(n))):
                best = (row, n, key)
        if best is None:
            return None
        self.rows.move_to_end(best[2])
        return best[0], best[1]

    def shared(self, ids: Sequence[int]) -> int:
        """The most leading tokens ``ids`` has in common with a kept prompt (not a kept answer: a conversation's
        next turn begins with its prompt + answer, re-encoded perhaps differently at the answer's end, and finds
        its prompt kept), at most len(ids) - 1; 0 with none. Where this is well past ``lookup``'s longest kept
        prefix, the two prompts part after a common beginning (a system prompt and tools, a few-shot context, a
        question before its choices): ``jdspark.slot_slices`` keeps that beginning on its own (``Slices._split``)."""
        ids = tuple(int(t) for t in ids)
        ids_T, best = None, 0
        for key in self.rows:
            k = min(len(key), len(ids) - 1)
            if k <= best or key in self.answers or key[:best + 1] != ids[:best + 1]:  # (cannot share more)
                continue
            if ids_T is None:
                ids_T = np.asarray(ids, np.int64)
            differ = np.flatnonzero(ids_T[:k] != np.asarray(key[:k], np.int64))
            best = max(best, int(differ[0]) if differ.size else k)
        return best

    def remember(self, ids: Sequence[int]) -> None:
        """A finished request's prompt + answer, to keep when the engine is idle (``next_pending``)."""
        key = tuple(int(t) for t in ids)
        if len(key) >= self.min_tokens and key not in self.rows:
            self.pending.append(key)

    def next_pending(self, chunk: Callable[[int, int], Optional[int]]) -> Optional[tuple]:
        """(row, n, ids) for the newest remembered sequence: prefill ``ids[n:]`` on the kept prompt in ``row`` and
        keep the result as ``ids`` (``store``). ``chunk(n, total)``: how many of the total - n tokens after a kept
        prefix of n one prefill may take (None: none fits); where that is fewer than all, ``ids`` is the sequence
        cut there and the whole one waits again (the next call continues from the kept cut). None when nothing is
        remembered that begins with a kept prompt."""
        while self.pending:
            whole = self.pending.pop()
            if whole in self.rows:
                continue
            hit = self._longest(whole, lambda n: chunk(n, len(whole)) is not None)
            if hit is None:
                continue
            row, n = hit
            take = chunk(n, len(whole))
            if n + take < len(whole):
                self.pending.append(whole)
            return row, n, whole[:n + take]
        return None

    def store(self, ids: Sequence[int], answer: bool = False) -> Optional[int]:
        """The row to copy the state after prompt ``ids`` into (the least recently used one not ``pinned`` when all
        are taken), or None when ``ids`` is too short to keep, already kept (then it becomes most recent) or every
        row is pinned. ``answer``: ``ids`` is a finished request's prompt + answer (``next_pending``)."""
        key = tuple(int(t) for t in ids)
        if len(key) < self.min_tokens:
            return None
        if key in self.rows:
            self.rows.move_to_end(key)
            if not answer:  # a request's prompt now
                self.answers.discard(key)
            return None
        if len(self.rows) < self.capacity:
            row = len(self.rows)
        else:
            old = next((k for k in self.rows if k not in self.pinned), None)
            if old is None:
                return None
            row = self.rows.pop(old)
            self.answers.discard(old)
        self.rows[key] = row
        if answer:
            self.answers.add(key)
        return row

    def rekey(self, ids: Sequence[int], longer: Sequence[int]) -> Optional[int]:
        """The row keeping ``ids``, now to keep ``longer`` instead (most recent; the caller copies the state after
        ``longer`` into it), or None where ``ids`` is no longer kept or ``longer`` is already: one row for a long
        prompt's successive slices (``jdspark.slot_slices``), not one each."""
        key, new = tuple(int(t) for t in ids), tuple(int(t) for t in longer)
        if key not in self.rows or new in self.rows:
            return None
        row = self.rows.pop(key)
        self.rows[new] = row
        self.answers.discard(key)
        if key in self.pinned:
            self.pinned.discard(key)
            self.pinned.add(new)
        return row

    def pin(self, ids: Sequence[int], on: bool = True) -> None:
        """Keep ``ids``'s row from eviction by ``store`` (``on``), or no longer."""
        key = tuple(int(t) for t in ids)
        if on and key in self.rows:
            self.pinned.add(key)
        else:
            self.pinned.discard(key)

    def clear(self) -> None:
        self.rows.clear()
        self.pending.clear()
        self.pinned.clear()
        self.answers.clear()


def tree_bytes(tree) -> int:
    """Bytes of every array in ``tree`` (a pool's, or the slots' state)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def pool_like(state, capacity: int):
    """Device rows for ``capacity`` kept prompts, shaped as the slots' state (leading axis ``capacity``)."""
    return jax.tree.map(lambda s: jnp.zeros((capacity,) + s.shape[1:], s.dtype), state)


@functools.partial(jax.jit, donate_argnames=("pool",))
def snapshot(pool, state, slot, row):
    """pool[row] <- state[slot] (every leaf)."""
    return jax.tree.map(lambda p, s: p.at[row].set(s[slot]), pool, state)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "logprobs", "penalties"),
                   donate_argnames=("state",))
def extend(t_graph, d_graph, t_state, d_state, state, pool, slot, row, ext_1E, ext_len, key, temp, top_k, top_p,
           min_p, penalties_3, controls=None, first_allowed_V=None, grammar=None, want_prompt=None,
           next_token=None, *, logprobs=None, penalties: bool = True):
    """Prefill the extension ``ext_1E`` (``ext_len`` valid) on the kept prompt ``pool[row]`` into ``slot``:
    (state, first token [1]) and, with ``logprobs``, (its ``TokenLogprobs``, the extension's prompt entries where
    ``want_prompt`` says so: ``speculative.extend_stream``). One program per extension bucket E; slot and row
    traced; ``penalties_3``, ``controls``, ``first_allowed_V``, ``grammar`` (the request's automaton, so a
    constrained request may extend a kept prompt too) and ``next_token`` as ``slot_programs.insert_row``'s."""
    target, drafter = merge_module(t_graph, t_state), merge_module(d_graph, d_state)
    sp = SamplingParams.rows(temp, top_k, top_p, min_p)
    kept = jax.tree.map(lambda p: p[row], pool)
    pen = Penalties.rows(*(penalties_3[j] for j in range(3))) if penalties else None
    new, first, *lp = extend_stream(target, drafter, kept, ext_1E, ext_len, key, sp, logprobs=logprobs,
                                    penalties=pen, controls=controls if penalties else None,
                                    first_allowed_V=first_allowed_V, grammar=grammar,
                                    want_prompt_logprobs=want_prompt, next_token=next_token)
    new = no_stops(new, state, slot)  # a request's stop strings: ``stop_strings.set_stops`` after this
    return (jax.tree.map(lambda s, r: s.at[slot].set(r), state, new), first, *lp)
