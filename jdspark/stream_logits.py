"""A stream's logits under its penalties and its automaton, and what its committed tokens move: the penalties'
token counts and the automaton's state. Pure functions of a ``speculative.Stream`` (its ``counts``, ``prompt_seen``,
``bias``, ``stop_ids``, ``min_tokens``, ``fsm``, ``fsm_next``, ``fsm_class``), shared by the prefill, the plain step
and the fused draft-verify step (split from ``jdspark.speculative`` by concern).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp

from jdspark.sampling import Penalties, penalize

if TYPE_CHECKING:  # annotations only: speculative imports this module
    from jdspark.speculative import Stream

__all__ = ["seen", "counted", "recounted", "penalized", "fsm_step", "constrained", "advanced"]


def seen(prompt_1P, prompt_len, V: int):
    """[V] bool: the tokens among the first ``prompt_len`` of ``prompt_1P``."""
    P = prompt_1P.shape[1]
    ids = jnp.where(jnp.arange(P) < prompt_len, prompt_1P[0], V)  # padding: out of range, dropped
    return jnp.zeros((V,), bool).at[ids].set(True, mode="drop")


def counted(counts_V, new_K, n_new):
    """``counts_V`` plus the first ``n_new`` of ``new_K``."""
    K, V = new_K.shape[0], counts_V.shape[0]
    live = (jnp.arange(K) < n_new).astype(jnp.int32)
    return counts_V + jnp.zeros((V,), jnp.int32).at[new_K].add(live, mode="drop")


def recounted(st: Stream, new_K, n_new, pen: Optional[Penalties]):
    """The stream's counts after committing the first ``n_new`` of ``new_K`` (None where it keeps none). Under a
    batch flag (``pen.any``) a batch whose rows do not penalise skips the update: their counts are never read, and
    a row that penalises does so on every step it takes, so the flag is set whenever its counts move."""
    if st.counts is None:
        return None
    if pen is None or pen.any is None:
        return counted(st.counts, new_K, n_new)
    return jax.lax.cond(pen.any, lambda: counted(st.counts, new_K, n_new), lambda: st.counts)


def penalized(logits_KV, st: Stream, drafts_k, pen: Optional[Penalties]):
    """A step's logits at its K positions under ``pen``: position j counts the stream's generated tokens and the
    drafts before it (``drafts_k`` [K - 1]; position j predicts the token after the anchor and drafts 1..j); then,
    for a constrained stream, masked to the tokens its automaton allows there (``constrained``)."""
    z = logits_KV
    if pen is not None and st.counts is not None:
        V = logits_KV.shape[-1]
        hot = jnp.zeros((drafts_k.shape[0], V), jnp.int32).at[jnp.arange(drafts_k.shape[0]), drafts_k].set(1)
        counts_KV = st.counts[None] + jnp.concatenate([jnp.zeros((1, V), jnp.int32), jnp.cumsum(hot, axis=0)])
        z = penalize(logits_KV, counts_KV, st.prompt_seen, pen, st.bias, st.stop_ids, st.min_tokens)
    return z if st.fsm is None else constrained(z, st, drafts_k)


def fsm_step(st: Stream, q, token):
    """The automaton's state after ``token`` from ``q`` (-1 stays -1: unconstrained, or past a token it refused)."""
    return jnp.where(q >= 0, st.fsm_next[jnp.maximum(q, 0), st.fsm_class[token]], -1)


def constrained(logits_KV, st: Stream, drafts_k):
    """``jdspark.grammar``'s mask: position j keeps {v : next[q_j, v] >= 0}, q_0 the stream's state and q_{j+1} =
    next[q_j, draft j]; a position whose state is -1 keeps every token (an unconstrained stream; or a position past
    a draft the automaton refused: that draft has probability 0 where it stands, so nothing past it is read)."""
    q, states = st.fsm, [st.fsm]
    for j in range(drafts_k.shape[0]):
        q = fsm_step(st, q, drafts_k[j])
        states.append(q)
    q_K = jnp.stack(states)
    ok_KV = (q_K[:, None] < 0) | (jnp.take(st.fsm_next[jnp.maximum(q_K, 0)], st.fsm_class, axis=1) >= 0)
    return jnp.where(ok_KV, logits_KV, -jnp.inf)


def advanced(st: Stream, new_K, n_new):
    """The stream's automaton state after committing the first ``n_new`` of ``new_K`` (None without one)."""
    if st.fsm is None:
        return None
    q = st.fsm
    for j in range(new_K.shape[0]):
        q = jnp.where(j < n_new, fsm_step(st, q, new_K[j]), q)
    return q
