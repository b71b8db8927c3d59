"""Stop strings on the device: a request's stop strings as an automaton over its token ids, so a serving step knows
a row has ended at one (``slot_programs.step_rows``: a multi-step launch stops once all its rows have ended) where
the host learns it only after the launch, and the launch put in flight behind it.

The host ends a request where its decoded text first contains one of its stop strings (``engine._stop_at``). The
text is the UTF-8 decoding of the generated tokens' bytes (special ids skipped, but those a request shows), so a
byte automaton that matches the stop strings anywhere in that byte stream, lifted to tokens, follows it on the
device:

    delta[q, b]   Aho-Corasick over the stop strings' UTF-8 bytes: q the longest prefix of a stop string the text
                  ends with, MATCHED once the text contains one (absorbing)
    next_QV[q, v] the state after token v's bytes from q (q itself for an id the text leaves out)

The device holds it by token classes (``grammar.token_classes``: Q x C + V int32 a slot). MATCHED on the device
implies the host's match at the same token: a stop string is valid UTF-8, which begins with no continuation byte,
and Python's decoder (errors="replace") replaces only the maximal ill-formed subpart before a byte that may begin a
character, so the stop string's bytes decode to the stop string wherever they stand, and the host searches all
text generated after ``min_tokens`` (requests with ``min_tokens`` get no automaton: their stop strings count only
after it). The converse can fail only for a stop string holding U+FFFD, which the host may match on a replaced
byte: the device then does not end the row early, and the host ends the request as before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.grammar import token_classes, token_fsm

__all__ = ["MATCHED", "STOP_STATES", "STOP_CLASSES", "StopFSM", "stop_automaton", "stop_fsm", "advance_stops",
           "no_stops", "set_stops"]

MATCHED = -2  # the state of a row whose text contains a stop string (-1: a row with no stop strings; both stay)
# a serving slot's automaton: at most this many states over this many token classes (the classes' last column is
# the padded ids'), Q x C + V int32 a slot. HumanEval's stops ("\nclass", "\ndef", "\n#", "\nif", "\nprint") over
# the shipped 4096-token vocabulary: 13 states, 32 classes; ("</tool_call>", "\nObservation:"): 24 and 44
STOP_STATES = 32
STOP_CLASSES = 128


def stop_automaton(stops: Sequence[bytes]) -> np.ndarray:
    """The Aho-Corasick automaton of ``stops``: delta int32 [Q + 1, 256], state 0 the empty text, states 1 .. Q - 1
    the stop strings' proper prefixes the text may end with, state Q matched (absorbing, every byte)."""
    if not stops or any(not isinstance(s, bytes) or not s for s in stops):
        raise ValueError("stop strings: expected a non-empty list of non-empty byte strings")
    child: list = [{}]
    terminal = [False]
    for s in stops:
        u = 0
        for b in s:
            if b not in child[u]:
                child[u][b] = len(child)
                child.append({})
                terminal.append(False)
            u = child[u][b]
        terminal[u] = True
    N = len(child)
    delta = np.zeros((N, 256), np.int64)
    fail, out = np.zeros(N, np.int64), np.array(terminal)
    queue = collections.deque()
    for b, v in child[0].items():
        delta[0, b] = v
        queue.append(v)
    while queue:  # breadth first: a node's failure state is shallower, its row already complete
        u = queue.popleft()
        out[u] |= out[fail[u]]
        delta[u] = delta[fail[u]]
        for b, v in child[u].items():
            fail[v] = delta[fail[u], b]
            delta[u, b] = v
            queue.append(v)
    # the nodes whose text ends with a stop string collapse into one absorbing state; the others renumbered
    keep = np.flatnonzero(~out)
    new = np.full(N, len(keep), np.int64)
    new[keep] = np.arange(len(keep))
    table = np.concatenate([new[delta[keep]], np.full((1, 256), len(keep))])
    return table.astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class StopFSM:
    """A request's stop strings over a vocabulary (module doc): state 0 is the start."""
    next_QC: np.ndarray  # int32 [Q, C]: the state after a token of class c, or MATCHED
    class_V: np.ndarray  # int32 [V]: each id's class

    @property
    def num_states(self) -> int:
        return int(self.next_QC.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next_QC.shape[1])

    def device_tables(self, states: int, classes: int, vocab_size: int) -> Optional[tuple]:
        """(next [states, classes], class [vocab_size]) padded to a slot's tables, or None where the automaton does
        not fit (then the row is not ended early; the host still ends the request). Ids past the tokenizer's
        vocabulary (a model's padded rows) get a class of their own that leaves the state as it is; a tokenizer's
        ids past the model's are never generated."""
        Q, C = self.next_QC.shape
        if Q > states or C + 1 > classes:
            return None
        next_QC = np.full((states, classes), MATCHED, np.int32)
        next_QC[:Q, :C] = self.next_QC
        next_QC[:Q, C] = np.arange(Q)  # the padded ids' class: no bytes
        class_V = np.full((vocab_size,), C, np.int32)
        n = min(vocab_size, len(self.class_V))
        class_V[:n] = self.class_V[:n]
        return next_QC, class_V


@functools.lru_cache(maxsize=64)
def stop_fsm(stops: tuple, tokenizer, keep_special: frozenset = frozenset(), max_states: int = STOP_STATES) -> StopFSM:
    """``stops`` (strings) over ``tokenizer``'s vocabulary, as the host's text reads it: special ids leave the text
    as it is, but those in ``keep_special`` (walked as their names). Cached: a server's requests repeat a few.
    An automaton of more than ``max_states`` states is not lifted (its tables would be Q x V before the classes
    shrink them: a request's hundred long stop strings over K3's vocabulary, gigabytes): it comes back without
    tables, which no slot holds (``device_tables`` gives None)."""
    delta = stop_automaton([s.encode("utf-8") for s in stops])
    M = delta.shape[0] - 1
    if M > max_states:
        return StopFSM(np.zeros((M, 0), np.int32), np.zeros((0,), np.int32))
    V = tokenizer.vocab_size
    special = set(tokenizer.special_ids) - set(keep_special)
    tb = [None if v in special else tokenizer.token_bytes(v) for v in range(V)]
    next_QV = token_fsm(delta, np.zeros(M + 1, bool), tb, V, ()).next_QV[:M]  # -1: an id of no bytes
    next_QV = np.where(next_QV < 0, np.arange(M, dtype=np.int32)[:, None], next_QV)
    next_QV = np.where(next_QV == M, MATCHED, next_QV).astype(np.int32)
    return StopFSM(*token_classes(next_QV))


# ------------------------------------------------------------------------------------------------------ the device
def advance_stops(q_b, next_bQC, class_bV, new_bK, n_new_b):
    """Each row's state after its committed tokens ``new_bK[:, :n_new_b]`` (a step's; K static, unrolled):
    q <- next[q, class[token]] while q >= 0 (-1: no stop strings, MATCHED: ended, both stay)."""
    rows_b = jnp.arange(q_b.shape[0])
    for k in range(new_bK.shape[1]):
        c_b = jnp.take_along_axis(class_bV, new_bK[:, k:k + 1], axis=1)[:, 0]
        nxt_b = next_bQC[rows_b, jnp.maximum(q_b, 0), c_b]
        q_b = jnp.where((q_b >= 0) & (k < n_new_b), nxt_b, q_b)
    return q_b


def no_stops(row, state, slot):
    """A freshly prefilled ``row`` (a ``speculative.Stream`` without the stop fields) as a row of ``state``: no stop
    strings (state -1), the slot's tables left as they are (``set_stops`` writes a request's)."""
    if state.stop_q is None:
        return row
    return dataclasses.replace(row, stop_q=jnp.int32(-1), stop_next=state.stop_next[slot],
                               stop_class=state.stop_class[slot])


@functools.partial(jax.jit, donate_argnames=("state",))
def set_stops(state, slot, next_QC, class_V):
    """The slot's request's automaton, after its insert: the tables, and the state after its first token (the
    prefill's, the row's anchor; MATCHED where it completes a stop string already)."""
    q = next_QC[0, class_V[state.anchor[slot, 0]]]
    return dataclasses.replace(state, stop_q=state.stop_q.at[slot].set(q),
                               stop_next=state.stop_next.at[slot].set(next_QC),
                               stop_class=state.stop_class.at[slot].set(class_V))
