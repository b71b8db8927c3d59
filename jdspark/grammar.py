"""Constrained decoding (vLLM's ``guided_choice`` / ``structured_outputs.choice``): the output must be one of a list
of strings, then a stop token. A byte automaton of the allowed texts is lifted to the vocabulary once, on the host,
as one table the device indexes:

    next_QV[q, v] = the automaton's state after token v's bytes from state q, or -1 where they leave the language
                    (a stop id: q itself where q accepts, a finished text may end; -1 elsewhere)

A stream carries its state q (-1: unconstrained) and the table; at each position the step verifies, the target's
logits are masked to {v : next_QV[q_j, v] >= 0} with q_j the state after the drafts before j
(``jdspark.speculative._penalized``), and the committed tokens advance q. The masked logits are the target's law, so
greedy and rejection sampling stay lossless; the drafter proposes unconstrained (a draft outside the language has
probability 0 and is rejected where it stands, so the states after it are never read).

Every token whose bytes walk the automaton is allowed, so every tokenization of an allowed text can be generated,
not only the tokenizer's own. Special tokens (their "bytes" are their names) and tokens of no bytes never are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["TokenFSM", "choice_automaton", "token_fsm", "choice_fsm"]


class TokenFSM(NamedTuple):
    """A constraint as the device reads it (module doc): state 0 is the start."""
    next_QV: np.ndarray  # int32 [Q, V]

    @property
    def num_states(self) -> int:
        return int(self.next_QV.shape[0])


def choice_automaton(choices: Sequence[bytes]) -> tuple:
    """The trie of ``choices`` as a byte automaton: (delta [Q, 256] int32, the next state or -1; accept [Q] bool).
    Every state leads to an accepting one (a trie has no dead ends)."""
    if not choices or any(not isinstance(c, bytes) or not c for c in choices):
        raise ValueError("choices: expected a non-empty list of non-empty byte strings")
    delta, accept = [np.full(256, -1, np.int32)], [False]
    for c in choices:
        q = 0
        for b in c:
            if delta[q][b] < 0:
                delta[q][b] = len(delta)
                delta.append(np.full(256, -1, np.int32))
                accept.append(False)
            q = int(delta[q][b])
        accept[q] = True
    return np.stack(delta), np.asarray(accept)


def token_fsm(delta_Q256: np.ndarray, accept_Q: np.ndarray, token_bytes: Sequence[Optional[bytes]],
              vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The automaton lifted to a vocabulary: ``token_bytes[v]`` the text of id v (None or b"": never allowed; ids
    past the list likewise), ``stop_ids`` allowed exactly in accepting states. All tokens walk in parallel, one byte
    position at a time (Q x the longest token's length NumPy passes over the vocabulary)."""
    Q = delta_Q256.shape[0]
    n = min(len(token_bytes), vocab_size)
    lens = np.array([len(token_bytes[v] or b"") for v in range(n)] + [0] * (vocab_size - n), np.int64)
    L = max(1, int(lens.max(initial=0)))
    bytes_VL = np.zeros((vocab_size, L), np.int64)
    for v in range(n):
        b = token_bytes[v]
        if b:
            bytes_VL[v, :len(b)] = np.frombuffer(b, np.uint8)
    stops = np.asarray([s for s in stop_ids if 0 <= s < vocab_size], np.int64)
    next_QV = np.full((Q, vocab_size), -1, np.int32)
    for q in range(Q):
        cur = np.full(vocab_size, q, np.int64)
        for j in range(L):
            live = (j < lens) & (cur >= 0)
            cur = np.where(live, delta_Q256[np.maximum(cur, 0), bytes_VL[:, j]], cur)
        cur = np.where(lens > 0, cur, -1)
        if stops.size:
            cur[stops] = q if accept_Q[q] else -1
        next_QV[q] = cur
    return TokenFSM(next_QV)


def choice_fsm(choices: Sequence[str], tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenFSM:
    """The constraint "one of ``choices`` (UTF-8), then a stop id" over ``tokenizer``'s vocabulary."""
    delta, accept = choice_automaton([c.encode("utf-8") if isinstance(c, str) else c for c in choices])
    special = set(tokenizer.special_ids)
    tb = [None if v in special else tokenizer.token_bytes(v) for v in range(min(vocab_size, tokenizer.vocab_size))]
    return token_fsm(delta, accept, tb, vocab_size, stop_ids)
