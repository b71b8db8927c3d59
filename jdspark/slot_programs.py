"""The serving slots' device programs (``jdspark.slots.SlotBackend`` builds their arguments and runs them):

    insert_row   prefill one prompt at batch 1 into a slot of the state (slot index traced, state donated)
    insert_rows  prefill k prompts of one bucket together into k slots (``speculative.prefill_streams``)
    step_rows    ``steps`` speculative (or plain) steps of b rows at one verify width, ``jax.vmap`` over the rows

``logprobs`` (static, all; None: not compiled in): the programs also return the committed tokens'
``jdspark.logprobs.TokenLogprobs`` with that many top entries. A step computes them only when a row of its batch
asks (the host's per-row flag; ``jdspark.logprobs.when``), so a server compiled with them costs traffic that does
not ask nothing but the branch (``docs/serving.md``, "Log-probabilities").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from jdspark.graphs import merge_module
from jdspark.sampling import Penalties, SamplingParams
from jdspark.speculative import REQUEST_CONSTANT, plain_step, prefill_stream, prefill_streams, spec_step
from jdspark.stop_strings import MATCHED, advance_stops, no_stops
from kimi import dispatch

__all__ = ["buckets_up_to", "insert_row", "insert_rows", "step_rows", "HOST_COLUMNS", "SAMPLING_OFF", "STOP_IDS"]

# a prefill's sampling settings (temperature, top_k, top_p, min_p): greedy, every filter off
SAMPLING_OFF = (0.0, 0, 1.0, 0.0)

# the most stop ids of a request (its EOS among them) a step knows on the device, to stop a launch early
STOP_IDS = 4
# step_rows' per-row host inputs, in this order, packed into one float32 [b, HOST_COLUMNS] array
HOST_COLUMNS = ("slot", "top_k", "temperature", "top_p", "draft_cap", "logprobs", "repetition_penalty",
                "frequency_penalty", "presence_penalty", "logit_controls", "min_p",
                *(f"stop_id_{j}" for j in range(STOP_IDS)))


def buckets_up_to(n: int, smallest: int = 1) -> tuple:
    """Powers of two from ``smallest`` up to and including n."""
    out, b = [], smallest
    while b < n:
        out.append(b)
        b *= 2
    return tuple(out + [n])


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_len", "chunk", "logprobs", "penalties"),
                   donate_argnames=("state",))
def insert_row(t_graph, d_graph, t_state, d_state, state, slot, prompt_1P, prompt_len, key, temp, top_k, top_p,
               min_p, penalties_3, media_PD=None, want_prompt=None, controls=None, grammar=None, first_allowed_V=None,
               next_token=None, *, max_len,
               chunk=None,
               logprobs: Optional[int] = None, penalties: bool = True):
    """Prefill one request into ``slot``: (state, first token [1]) and, with ``logprobs``, (the first token's
    ``TokenLogprobs``, the prompt's where ``want_prompt`` says so: ``speculative.prefill_stream``). ``media_PD``:
    the prompt's image features, padded to the prompt bucket (a prompt of P tokens holds at most P placeholders),
    so one program serves every image prompt of a bucket. ``penalties_3``: float32 [3], the request's repetition,
    frequency and presence penalties (``sampling.Penalties``; static ``penalties`` False: not compiled in, the
    rows carry no counts), ``controls`` its logit_bias and min_tokens (``sampling.LogitControls``; with
    ``penalties``, which compiles both in), ``grammar`` its automaton (state, table by token classes [Q, C], class
    of each id [V]: ``jdspark.grammar``; state -1 for an unconstrained request; None: the slots carry none),
    ``first_allowed_V`` the ids its first token may be (bool [V], all True but for token healing), ``next_token``
    the token after the prompt that its last position's prompt entry scores (int32, -1: none; a long prompt's first
    slice, ``jdspark.slot_slices``)."""
    target, drafter = merge_module(t_graph, t_state), merge_module(d_graph, d_state)
    sp = SamplingParams.rows(temp, top_k, top_p, min_p)
    pen = Penalties.rows(*(penalties_3[j] for j in range(3))) if penalties else None
    row, first, *lp = prefill_stream(target, drafter, prompt_1P, prompt_len, key, sp, max_len, chunk, media_PD,
                                     logprobs=logprobs, want_prompt_logprobs=want_prompt, penalties=pen,
                                     controls=controls if penalties else None, grammar=grammar,
                                     first_allowed_V=first_allowed_V, next_token=next_token)
    if row.fsm is not None:  # the slot's automaton in the slots' numbering (``slot_automaton``)
        q, next_QC = slot_automaton(row.fsm, row.fsm_next, slot)
        row = dataclasses.replace(row, fsm=q, fsm_next=next_QC)
    row = no_stops(row, state, slot)  # a request's stop strings: ``stop_strings.set_stops`` after this
    state = jax.tree.map(lambda s, r: s.at[slot].set(r), state, row)
    return (state, first, *lp)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_len", "logprobs", "penalties"),
                   donate_argnames=("state",))
def insert_rows(t_graph, d_graph, t_state, d_state, state, slots_k, prompt_kP, lens_k, key_data_k2, temp_k, top_k_k,
                top_p_k, min_p_k, penalties_k3, controls=None, grammar=None, first_allowed_kV=None, *, max_len,
                logprobs: Optional[int] = None, penalties: bool = True):
    """``insert_row`` of k prompts of one bucket at once, into the k distinct slots ``slots_k``: (state, first tokens
    [k, 1]) and, with ``logprobs``, their ``TokenLogprobs`` [k, ...]. One pass each (no chunks, no images, no
    prompt log-probabilities: those insert one at a time). Per-row arguments as ``insert_row``'s with a leading k
    axis; ``key_data_k2`` the rows' ``jax.random.key_data`` (uint32 [k, 2]), wrapped here."""
    target, drafter = merge_module(t_graph, t_state), merge_module(d_graph, d_state)
    keys_k = jax.random.wrap_key_data(key_data_k2)
    sp = SamplingParams.rows(temp_k, top_k_k, top_p_k, min_p_k)
    pen = Penalties.rows(penalties_k3[:, 0], penalties_k3[:, 1], penalties_k3[:, 2]) if penalties else None
    rows, first, *lp = prefill_streams(target, drafter, prompt_kP, lens_k, keys_k, sp, max_len, logprobs=logprobs,
                                       penalties=pen, controls=controls if penalties else None, grammar=grammar,
                                       first_allowed_kV=first_allowed_kV)
    if rows.fsm is not None:  # each slot's automaton in the slots' numbering (``slot_automaton``)
        q, next_kQC = jax.vmap(slot_automaton)(rows.fsm, rows.fsm_next, slots_k)
        rows = dataclasses.replace(rows, fsm=q, fsm_next=next_kQC)
    rows = jax.vmap(no_stops, in_axes=(0, None, 0))(rows, state, slots_k)
    state = jax.tree.map(lambda s, r: s.at[slots_k].set(r), state, rows)
    return (state, first, *lp)


def slot_automaton(q, next_QC, slot):
    """A slot's automaton state and table in the numbering all slots share: state q of slot s is s * Q + q (-1 stays
    -1). ``step_rows`` then reads every row's transitions from the slots' tables as one [S * Q, C] table, unmapped,
    instead of gathering each stepped row's [Q, C] (2 MiB a row at the server's Q = 1024: a step of 8 of 16 slots
    copied 16 MiB, and a multi-step launch carried them through its loop; docs/serving.md)."""
    off = slot * next_QC.shape[0]
    return jnp.where(q >= 0, q + off, q), jnp.where(next_QC >= 0, next_QC + off, next_QC)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "width", "confidence", "all_slots", "steps",
                                             "extend_context", "logprobs", "penalties"), donate_argnames=("state",))
def step_rows(t_graph, d_graph, t_state, d_state, state, host_bC, *, width, confidence, all_slots=False, steps=1,
              extend_context=True, logprobs: Optional[int] = None, penalties: bool = True):
    """``steps`` steps of b rows, each at ``width``; outputs stacked [steps, b, ...]. ``host_bC``: float32 [b,
    len(HOST_COLUMNS)], per row its slot index, top_k, temperature, top_p, draft cap, whether it wants log-probabilities
    (> 0), its three penalties, whether it has logit controls (> 0: a logit_bias or min_tokens, which the penalties'
    batch flag covers too), its min_p and up to STOP_IDS ids its request ends at (-1: none), the host's inputs packed
    into one array (the integers are exact in float32 below 2^24): each array a launch takes from the host is a transfer
    of its own, ~60 us apiece on the H200 (docs/h200/run4). Slot indices: a padded bucket may repeat a row: only its
    first copy is written back, and copies compute the same thing. ``all_slots``: the rows are every slot in order, so
    the state is stepped as it is (no gather of the rows and scatter back: ~2 x the state's bytes of copying). ``steps``
    > 1 (a ``lax.while_loop``): one launch, one gather and scatter and one read-back for several steps (multi-step
    scheduling: the host's round trip per step is what a batch-1 step spends most on here). ``extend_context`` False
    (width 1 only): the plain step leaves the drafter's context as it is (no drafter work at all): for rows that never
    draft (draft cap 0 for their whole request).

    Early exit: a row is ``ended`` once a step commits one of the ids its request ends at (host columns
    ``stop_id_*``: its stop ids, EOS among them unless it ignores EOS) or its text comes to hold one of its stop
    strings (the row's automaton, ``jdspark.stop_strings``), and a multi-step launch runs its steps only
    while one of its rows has not ended (a ``lax.while_loop``; a step not run gives n_new 0). So the launch the
    engine put in flight before it saw a request's end, and the rest of the launch that committed it, cost no device
    time: at c = 1 the next request's prefill no longer waits behind up to ``steps`` steps of a request already done
    (docs/serving.md)."""
    target, drafter = merge_module(t_graph, t_state), merge_module(d_graph, d_state)
    rows_b, topk_b, cap_b = (host_bC[:, j].astype(jnp.int32) for j in (0, 1, 4))
    temp_b, topp_b, minp_b = host_bC[:, 2], host_bC[:, 3], host_bC[:, 10]
    # the automata's tables: every row reads the slots' [S * Q, C] table (``slot_automaton``'s numbering), unmapped
    table = state.fsm_next
    flat = None if table is None else table.reshape(-1, table.shape[-1])
    state = dataclasses.replace(state, fsm_next=None)
    sub = state if all_slots else jax.tree.map(lambda s: s[rows_b], state)
    batch = SamplingParams.batch_flags(temp_b, topk_b, topp_b, minp_b)  # outside the map: a greedy step skips sampling
    want = jnp.any(host_bC[:, 5] > 0) if logprobs is not None else None  # outside the map too: a real branch
    pen_b3 = host_bC[:, 6:9]
    penalising = (Penalties.batch_flag(pen_b3[:, 0], pen_b3[:, 1], pen_b3[:, 2])  # likewise
                  | jnp.any(host_bC[:, 9] > 0))

    def one(st, t, k, p, m, cap, pen3):
        sp = SamplingParams.rows(t, k, p, m, batch)
        kw = dict(logprobs=logprobs, want_logprobs=want,
                  penalties=Penalties.rows(*pen3, penalising) if penalties else None)
        st = dataclasses.replace(st, fsm_next=flat)
        if drafter is None or width == 1:  # extending the context of rows that draft on later steps
            new, out = plain_step(target, st, sp, drafter if extend_context else None, **kw)
        else:
            new, out = spec_step(target, drafter, st, sp, width=width, max_drafts=cap, confidence=confidence, **kw)
        return dataclasses.replace(new, fsm_next=None), out

    def mapped(rows_state, _=None):
        with dispatch.mapped_rows(int(rows_b.shape[0])):
            return jax.vmap(one)(rows_state, temp_b, topk_b, topp_b, minp_b, cap_b, pen_b3)

    stops_bS = host_bC[:, 11:11 + STOP_IDS].astype(jnp.int32)  # -1: none

    def stepped(rows_state):
        """One step of the rows; a row that commits one of its stop ids (within its n_new tokens), or whose text
        then contains one of its stop strings (``jdspark.stop_strings``), is ended."""
        new, out = mapped(rows_state)
        K = out.new_K.shape[-1]
        hit_bKS = (out.new_K[:, :, None] == stops_bS[:, None, :]) & (stops_bS[:, None, :] >= 0)
        hit_b = jnp.any(hit_bKS & (jnp.arange(K)[None, :, None] < out.n_new[:, None, None]), axis=(1, 2))
        if new.stop_q is not None:
            q_b = advance_stops(new.stop_q, new.stop_next, new.stop_class, out.new_K, out.n_new)
            new, hit_b = dataclasses.replace(new, stop_q=q_b), hit_b | (q_b == MATCHED)
        return dataclasses.replace(new, ended=new.ended | hit_b), out

    if steps == 1:
        new, out = stepped(sub)
        out = jax.tree.map(lambda x: x[None], out)
    else:  # run while a row has not ended; the outputs of the steps not run stay zero (n_new 0)
        # the step traced once (its jaxpr gives the outputs' shapes the loop's carry needs, and is the loop's body):
        # eval_shape and the loop tracing it again cost start-up ~0.45 s a multi-step program (docs/performance.md)
        closed, shapes = jax.make_jaxpr(stepped, return_shape=True)(sub)
        step_flat = jax_core.jaxpr_as_fun(closed)
        out0 = jax.tree.map(lambda a: jnp.zeros((steps,) + a.shape, a.dtype), shapes[1])

        def body(carry):
            i, st, outs = carry
            st, out = jax.tree.unflatten(jax.tree.structure(shapes), step_flat(*jax.tree.leaves(st)))
            return i + 1, st, jax.tree.map(lambda o, x: o.at[i].set(x), outs, out)

        _, new, out = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(~c[1].ended), body,
                                         (jnp.int32(0), sub, out0))
    if not all_slots:  # the rows' changed leaves scattered back; a request's constants stay where they are (an
        # automaton's table, Q x V a slot, copied back every step cost a plain b = 1 step 35%: docs/serving.md)
        kept = {f: getattr(state, f) for f in REQUEST_CONSTANT}
        none = {f: None for f in REQUEST_CONSTANT}
        state = dataclasses.replace(jax.tree.map(lambda s, n: s.at[rows_b].set(n), dataclasses.replace(state, **none),
                                                 dataclasses.replace(new, **none)), **kept)
    else:
        state = new
    return dataclasses.replace(state, fsm_next=table), out

