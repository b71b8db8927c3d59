"""A request's per-request inputs to the serving slots' insert programs (``slot_programs.insert_row``,
``prefix.extend``), as NumPy arrays of fixed shapes: whatever a request asks, a prompt bucket's one compiled program
takes them (a request asking for none gets the inputs that do nothing, not another program).

    controls     logit_bias, min_tokens, allowed_token_ids (``sampling.LogitControls``), where compiled in
    grammar      (state, table by token classes [Q, C], each id's class [V]) of a constrained request
                 (``jdspark.grammar``): state 0, or -1 and an unused table for any other
    first        bool [V]: the ids the first token may be (token healing, ``SamplingRequest.first_token_ids``),
                 every id for any other request

Each is a ValueError naming what is wrong when the request asks for what the slots were not built to serve."""

from __future__ import annotations

from typing import Optional

import numpy as np

from jdspark.engine import SamplingRequest
from jdspark.sampling import logit_controls

__all__ = ["controls_input", "grammar_input", "first_token_input"]


def controls_input(vocab_size: int, req: Optional[SamplingRequest], compiled: bool):
    """The request's ``LogitControls`` (``req`` None: those of a request asking for none) where the programs carry
    them (``compiled``: the backend's ``penalties``), else None."""
    if not compiled:
        return None
    if req is None:
        return logit_controls(vocab_size, None, 0, always=True)
    return logit_controls(vocab_size, dict(req.logit_bias), req.min_tokens, req.stop_token_ids, always=True,
                          allowed_ids=req.allowed_token_ids)


def grammar_input(vocab_size: int, states: int, classes: int, req: Optional[SamplingRequest]):
    """The request's automaton as the insert program takes it, (state, table by token classes [Q, C] padded to the
    slots' ``states`` x ``classes``, each id's class [V]): state 0 for a constrained request, -1 for any other;
    None where the slots carry none (``states`` 0)."""
    if not states:
        if req is not None and req.grammar is not None:
            raise ValueError("grammar (guided decoding): this backend was built without it "
                             "(SlotBackend(guided_states=Q); the server's --guided-states)")
        return None
    V, Q, C = vocab_size, states, classes
    table = np.full((Q, C), -1, np.int32)
    if req is None or req.grammar is None:
        return np.int32(-1), table, np.zeros((V,), np.int32)
    t = np.asarray(req.grammar.next_QV, np.int32)
    if t.ndim != 2 or t.shape[1] != V or t.shape[0] > Q:
        raise ValueError(f"grammar: a table of {t.shape[0] if t.ndim == 2 else '?'} states over "
                         f"{t.shape[-1] if t.ndim else '?'} tokens; these slots take at most {Q} states over {V}")
    next_QC, class_V = req.grammar.device_tables(C)
    table[:t.shape[0]] = next_QC
    return np.int32(0), table, class_V


def first_token_input(vocab_size: int, req: Optional[SamplingRequest]) -> np.ndarray:
    """The ids the request's first token may be, bool [V]: every id but for token healing
    (``SamplingRequest.first_token_ids``), which is not served with a grammar (whose own mask could leave none)."""
    allowed = np.ones(vocab_size, bool)
    if req is None or not req.first_token_ids:
        return allowed
    if req.grammar is not None:
        raise ValueError("first_token_ids (token healing) with a grammar: not served (the two masks may leave no "
                         "token to draw)")
    ids = np.asarray(req.first_token_ids, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"first_token_ids: expected ids in [0, {vocab_size}), got {bad[:4].tolist()}")
    allowed[:] = False
    allowed[ids] = True
    return allowed
