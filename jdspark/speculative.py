"""The fused draft-verify step and ``generate``: a whole generation is one jitted program (a ``lax.while_loop``).

One step, batch 1 (the stream one user waits on), positions n = tokens the target has cached:
  anchor a (the last committed token, at position n, not yet in the target's cache)
  drafter:  block [a, MASK x (G-1)] over its context (taps of positions < n) -> base logits [G, V]
            Markov head, sequential (lax.scan): slot k's bias from the previous token (slot 0: a); draft d_k is the
            argmax (greedy) or a draw from q_k (sampling); confidence c_k; survival_k = prod_{j<=k} sigmoid(c_j)
  target:   verify([a, d_1 .. d_G]) -> logits p_0 .. p_G (p_i predicts position n+i+1), taps, what rolls back
  accept:   greedy: the longest prefix with d_{i+1} = argmax p_i, then the bonus argmax p_m;
            sampling: rejection sampling against the q each draft was drawn from (``sampling.propose``; lossless)
  commit:   the target's KDA state at position n+m (rebuilt from the closed-form verify block's trace: one small
            matmul per layer) and conv state (selected), MLA length n+m+1; nothing is re-run; the drafter's
            context grows by the taps of positions n .. n+m; the m accepted drafts and the bonus are emitted; the
            bonus is the next anchor.
``drafter=None`` runs plain decoding through the same loop (one target decode per step). A small model is served
from a copy of its weights laid out for these passes, made once per set of weights and kept between calls
(``jdspark.serving_copy.serving_pair``; ``kimi.model.with_serving_layout``, ``jdspark.drafter.with_serving_layout``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jdspark import rng
from jdspark.drafter import check_target
from jdspark.logprobs import TokenLogprobs, token_logprobs, when
from jdspark.sampling import (
    LogitControls,
    Penalties,
    SamplingParams,
    accept,
    logit_controls,
    propose,
    sample,
    unless_greedy,
)
from jdspark.serving_copy import serving_pair
from jdspark.stream_logits import advanced, counted, penalized, recounted, seen
from kimi import dispatch
from kimi.cache import KimiCache, select_verified
from kimi.model import check_token_ids
from kimi.prefill import chunked_positions, prefill_chunked


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenStats:
    target_steps: jax.Array  # int32: target forward passes after the prefill (decode or verify)
    drafted: jax.Array  # int32: drafts sent to verification
    accepted: jax.Array  # int32: drafts accepted
    accept_counts: jax.Array  # [G] int32: steps whose draft i was accepted (i.e. accepted length > i)

    @property
    def accept_len(self) -> float:
        """Tokens per target step: (accepted + 1 bonus per step) / steps (the seeds' 'tokens per iteration')."""
        s = int(self.target_steps)
        return (int(self.accepted) + s) / s if s else 0.0

    @property
    def per_position_accept(self) -> list:
        """Fraction of steps whose draft i was accepted, i = 0 .. G-1 (P(accepted length > i))."""
        s = int(self.target_steps)
        return [float(c) / s if s else 0.0 for c in np.asarray(self.accept_counts)]

    @property
    def acceptance_rate(self) -> float:
        d = int(self.drafted)
        return int(self.accepted) / d if d else 0.0

    def as_dict(self) -> dict:
        return {"target_steps": int(self.target_steps), "drafted": int(self.drafted),
                "accepted": int(self.accepted), "accept_len": self.accept_len,
                "acceptance_rate": self.acceptance_rate, "per_position_accept": self.per_position_accept}


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [n_new] generated ids (the prompt excluded), cut at EOS (included) or max_new_tokens
    stats: GenStats

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stream:
    """One stream's state between steps (batch 1 inside): what generate's loop carries and a serving slot holds
    (the engine maps the step over a leading slot axis of every leaf)."""
    anchor: jax.Array  # [1] int32: the last committed token, not yet in the target's cache
    cache: KimiCache
    dcache: object  # DrafterCache or None
    key: jax.Array
    # with repetition penalties (``sampling.Penalties``; None without): [V] int32 times each token was generated
    # (the anchor included), [V] bool the prompt's tokens
    counts: Optional[jax.Array] = None
    prompt_seen: Optional[jax.Array] = None
    # with logit controls (``LogitControls``, which need the counts; None without): float32 [V] the logit_bias,
    # [V] bool the ids not drawn before min_tokens (EOS), int32 min_tokens
    bias: Optional[jax.Array] = None
    stop_ids: Optional[jax.Array] = None
    min_tokens: Optional[jax.Array] = None
    # with constrained decoding (``jdspark.grammar``; None without): int32 the automaton's state (-1: this stream is
    # unconstrained), its table by token classes (``grammar.token_classes``): int32 [Q, C] and the class of each id [V]
    fsm: Optional[jax.Array] = None
    fsm_next: Optional[jax.Array] = None
    fsm_class: Optional[jax.Array] = None
    # bool: the stream has committed one of the ids its request ends at (EOS, its stop ids; a serving step sets it,
    # ``slot_programs.step_rows``: a multi-step launch stops once all its rows have); False from the first token on
    ended: Optional[jax.Array] = None
    # a serving slot's stop strings (``jdspark.stop_strings``; None in ``generate``): int32 the automaton's state
    # (-1: none, MATCHED: the text contains one, which ends the row too), its table by token classes [Q, C] and
    # the class of each id [V]
    stop_q: Optional[jax.Array] = None
    stop_next: Optional[jax.Array] = None
    stop_class: Optional[jax.Array] = None


# the Stream fields a step never changes (a request's own settings, written at its prefill): a serving step of some
# slots need not scatter them back into the slots' state (``slot_programs.step_rows``)
REQUEST_CONSTANT = ("prompt_seen", "bias", "stop_ids", "min_tokens", "fsm_next", "fsm_class", "stop_next",
                    "stop_class")


def _with_controls(row: Stream, V: int, controls: Optional[LogitControls]) -> Stream:
    """``row`` carrying fresh penalty counts, and ``controls`` (None: none)."""
    row.counts = jnp.zeros((V,), jnp.int32)
    if controls is not None:
        row.bias = jnp.asarray(controls.bias_V, jnp.float32)
        row.stop_ids = jnp.asarray(controls.stop_V, bool)
        row.min_tokens = jnp.asarray(controls.min_tokens, jnp.int32)
    return row


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    new_K: jax.Array  # [K] int32: the committed tokens, the first n_new valid (K = G + 1, or 1 for plain decoding)
    n_new: jax.Array  # int32: accepted drafts + the bonus token
    drafted: jax.Array  # int32: drafts verified
    accepted: jax.Array  # int32: drafts accepted
    survival: Optional[jax.Array] = None  # [max(W - 1, 1)] fp32: a_k = prod_{i<=k} sigmoid(c_i) of the drafts
    # drafted (the whole block at the default width), if asked
    logprobs: Optional[TokenLogprobs] = None  # of new_K's tokens (``jdspark.logprobs``), if asked


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Loop:
    out: jax.Array  # [max_new + G + 1] emitted tokens
    n_out: jax.Array  # int32
    stream: Stream
    done: jax.Array  # bool
    stats: GenStats


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _emit(st: _Loop, new_K, n_new, eos_id, max_new: int, stream=None):
    """Append the first n_new of new_K to the output; stop at EOS (kept) or max_new."""
    K = new_K.shape[0]
    out = jax.lax.dynamic_update_slice(st.out, new_K, (st.n_out,))
    is_eos = (new_K == eos_id) & (jnp.arange(K) < n_new) & (eos_id >= 0)  # eos_id traced: -1 never stops
    first_eos = jnp.argmax(is_eos)
    hit = is_eos.any()
    n_take = jnp.where(hit, first_eos + 1, n_new)
    n_take = jnp.minimum(n_take, max_new - st.n_out)
    n_out = st.n_out + n_take
    done = hit | (n_out >= max_new)
    if stream is not None:
        io_callback(lambda toks, n: stream(np.asarray(toks)[: int(n)]), None, new_K, n_take, ordered=True)
    return out, n_out, done


def draft_block(drafter, dcache, anchor_1, anchor_pos, embed_VD, lm_head_DV, key, sp: SamplingParams,
                threshold: float, confidence: bool = False, n_slots: Optional[int] = None, automaton=None):
    """Drafter pass + sequential Markov head. Returns (drafts [n], logq [n, V] (the proposal ``sampling.propose``
    drew each draft from; zeros when greedy), n_verify, survival [n] or None) for the block's first n =
    ``n_slots`` slots (static; default all G): a step that verifies W tokens needs only W - 1 drafts, and the
    first n drafts (and their keys, confidences) are those of the whole block, so n changes cost, not tokens.

    survival_k = prod_{j<=k} sigmoid(c_j), the confidence head's probability that drafts 1..k are all accepted
    (computed when ``threshold > 0`` truncates the block or ``confidence`` asks for it; None without the head).
    Slot k's confidence reads the slot's hidden state and the previous token only, so truncating at the first k
    with survival_k < threshold decides on slot k before its token is drawn: the rejection rule stays lossless.
    ``automaton`` (a constrained stream: (its state [1], next_QC, class_V)): the drafts are proposed in the language
    (``DSparkDrafter.decode_block``); q is then the masked proposal, what the rejection rule reads, so any proposal
    stays lossless, and drafts the target could never accept are not drafted."""
    want = (threshold > 0 or confidence) and drafter.confidence_head is not None
    G = drafter.config.block_size
    base_BNV, hid_BND = drafter.draft_logits(dcache, anchor_1, anchor_pos, embed_VD, lm_head_DV, n_slots)
    n = base_BNV.shape[1]

    def pick(k, z):
        def greedy():
            return jnp.argmax(z, axis=-1).astype(jnp.int32), jnp.zeros_like(z, jnp.float32)

        def sampled():
            return propose(k, z, sp)  # the draft and q (a near-nucleus), what the rejection rule reads

        return unless_greedy(sp, sampled, greedy)

    drafts, _, logq, conf = drafter.decode_block(base_BNV, hid_BND, anchor_1, pick, rng.split(key, G)[:n],
                                                 confidence=want, automaton=automaton)
    drafts_N, logq_NV, conf_N = drafts[0], logq[0], conf[0]
    survival = jnp.cumprod(jax.nn.sigmoid(conf_N)) if want else None
    if threshold > 0 and survival is not None:
        n_verify = jnp.sum(jnp.cumprod((survival >= threshold).astype(jnp.int32))).astype(jnp.int32)
    else:
        n_verify = jnp.int32(n)
    return drafts_N, logq_NV, n_verify, survival


def cache_positions(P: int, max_new: int, G: int, chunk: Optional[int] = None) -> int:
    """Cache positions a generation needs: the prompt as prefilled (P padded, or every chunk whole), then
    max_new tokens and one verify block past the last (G drafts + the anchor):
        S = (P or chunked_positions(P, C)) + max_new + G + 1"""
    return (P if chunk is None else chunked_positions(P, chunk)) + max_new + G + 1


def _generate_program(t_graph, d_graph, max_new: int, sp: SamplingParams, eos_id: int, threshold: float,
                      t_state, d_state, prompt_1P, prompt_len, key, stream=None, chunk=None, media_MD=None,
                      penalties=None, controls=None, fsm=None, first_allowed_V=None):
    """The whole generation (prefill + loop) of the served pair (``serving_pair``'s modules, split). Static:
    graphs, max_new, sampling params, threshold, stream, chunk (the prefill's chunk size, None for one pass),
    penalties (``sampling.Penalties`` or None);
    traced: ``eos_id`` (-1: none), ``media_MD`` (image features merged in the prefill), ``controls``
    (``LogitControls`` or None), ``fsm`` (a ``jdspark.grammar`` table by token classes, (next_QC, class_V), or
    None), ``first_allowed_V`` (bool [V], the first token's ids, or None).

    ``stream`` (a host function of the newly committed token ids) is called once per step through
    ``io_callback``; it makes the host wait on every step, so speed is measured without it."""
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    P = prompt_1P.shape[1]
    G = drafter.config.block_size if drafter is not None else 0
    st0, first = prefill_stream(target, drafter, prompt_1P, prompt_len, key, sp,
                                cache_positions(P, max_new, G, chunk), chunk, media_MD, penalties=penalties,
                                controls=controls, grammar=None if fsm is None else (0, *fsm),
                                first_allowed_V=first_allowed_V)
    return decode_loop(target, drafter, st0, first, max_new, sp, eos_id, threshold, stream, penalties)


def decode_loop(target, drafter, st0: Stream, first, max_new: int, sp: SamplingParams, eos_id: int,
                threshold: float = 0.0, stream=None, penalties: Optional[Penalties] = None):
    """The generation after its prefill (``prefill_stream``'s Stream and first token): ``spec_step`` (or
    ``plain_step`` without a drafter) in a ``lax.while_loop`` until EOS or ``max_new`` tokens, the first included.
    Returns (out [max_new + G + 1] (the first n_out valid), n_out, GenStats). Usable inside jit; a benchmark jits
    it alone to time and measure decoding apart from the prefill (scripts/bench_long.py)."""
    G = drafter.config.block_size if drafter is not None else 0
    out = jnp.zeros((max_new + G + 1,), jnp.int32)
    st = _Loop(out=out, n_out=jnp.int32(0), stream=st0, done=jnp.bool_(False),
               stats=GenStats(jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.zeros((G,), jnp.int32)))
    o, n_out, done = _emit(st, first, jnp.int32(1), eos_id, max_new, stream)
    st = dataclasses.replace(st, out=o, n_out=n_out, done=done)

    def body(st: _Loop) -> _Loop:
        if drafter is None:
            nxt_stream, res = plain_step(target, st.stream, sp, penalties=penalties)
        else:
            nxt_stream, res = spec_step(target, drafter, st.stream, sp, threshold, penalties=penalties)
        o, n_out, done = _emit(st, res.new_K, res.n_new, eos_id, max_new, stream)
        # drafts accepted past the output's end (EOS or max_new inside the block) are not the output's: not counted
        accepted = jnp.minimum(res.accepted, n_out - st.n_out)
        acc = st.stats.accept_counts + (jnp.arange(G) < accepted).astype(jnp.int32)
        stats = GenStats(st.stats.target_steps + 1, st.stats.drafted + res.drafted,
                         st.stats.accepted + accepted, acc)
        return _Loop(o, n_out, nxt_stream, done, stats)

    st = jax.lax.while_loop(lambda s: ~s.done, body, st)
    return st.out, st.n_out, st.stats


def prefill_stream(target, drafter, prompt_1P, prompt_len, key, sp: SamplingParams, max_len: int,
                   chunk: Optional[int] = None, media_MD=None, logprobs: Optional[int] = None,
                   want_prompt_logprobs=None, penalties: Optional[Penalties] = None,
                   controls: Optional[LogitControls] = None, grammar=None, first_allowed_V=None):
    """Prefill one right-padded prompt [1, P] (``prompt_len`` valid) into fresh caches of ``max_len`` positions:
    (Stream, first token [1]). The drafter's context gets the prompt's taps (which carry the merged image features
    ``media_MD``, when given).

    ``chunk`` (static; ``kimi.dispatch.prefill_chunk`` decides): None, one pass; C, ``kimi.prefill.prefill_chunked``
    in chunks of C (the caches must hold ``chunked_positions(P, C)``), each chunk's taps appended to the drafter's
    context inside the chunk loop, so the whole prompt's activations and taps never exist at once.

    ``logprobs`` (static): also return, as a third item, (the first token's ``jdspark.logprobs.TokenLogprobs``
    with that many top entries, the prompt's or None): the prompt's [P] are prompt token i + 1's entries from
    position i's logits (the last valid one's and the padding's meaningless), computed where
    ``want_prompt_logprobs`` (a traced scalar; None: never) says so, else zeros. Chunked, each chunk's entries are
    taken inside the chunk loop (``prefill_chunked``'s ``logits_fn``), so the prompt's [P, V] logits never exist.

    ``penalties`` (``sampling.Penalties``; None: the stream carries no counts): the first token is drawn from the
    penalised logits (the prompt's tokens seen, none generated), and the stream keeps the counts the steps read;
    ``controls`` (``LogitControls``, with ``penalties``; None: none) the request's logit_bias and min_tokens.
    ``grammar`` (None: the stream carries no automaton): (state int32: 0 constrained, -1 not; table by token classes
    int32 [Q, C]; each id's class int32 [V]), ``jdspark.grammar``: the first token is drawn from the masked logits,
    and every step's after it. ``first_allowed_V`` (bool [V]; None: all): the only ids the first token is drawn
    from (token healing, ``kimi.tokenizer.Tokenizer.heal``); the steps after it are not masked."""
    if chunk is not None and media_MD is not None:
        raise ValueError("a prompt with images is prefilled in one pass (chunked prefill with images is not built)")
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    P = prompt_1P.shape[1]
    valid = jnp.reshape(prompt_len, (1,)).astype(jnp.int32)
    dcache = drafter.init_cache(1, max_len) if drafter is not None else None
    prompt_lp = None
    with_prompt = logprobs is not None and want_prompt_logprobs is not None
    if chunk is None:  # on a cache of the prompt's length, padded after (KimiCache.padded_to)
        pre = target.forward(prompt_1P, KimiCache.init(target.config, 1, min(P, max_len)), mode="prefill",
                             tap_layers=taps, valid_len_B=valid, media_MD=media_MD)
        # the LM head on the last valid position alone (the prompt's [P, V] logits only for prompt log-probabilities)
        h_PD = pre.last_hidden[0]
        last_logits = target.logits_from_hidden(jax.lax.dynamic_slice_in_dim(h_PD, prompt_len - 1, 1))[0]
        cache = pre.cache.padded_to(max_len)
        if drafter is not None:
            dcache = drafter.append_context(dcache, pre.taps, prompt_len, start_pos=0)
        if with_prompt:
            next_P = jnp.concatenate([prompt_1P[0, 1:], jnp.zeros((1,), prompt_1P.dtype)])
            prompt_lp = when(want_prompt_logprobs, lambda: target.logits_from_hidden(h_PD), next_P, logprobs,
                             with_rank=True)
    else:
        cache = KimiCache.init(target.config, 1, max_len)

        def to_drafter(dc, taps_1CX, v_1, start):
            return drafter.append_context(dc, taps_1CX, v_1[0], start_pos=start)

        # position i's logits score prompt token i + 1: each chunk reads the next C tokens, one position on
        next_Q = jnp.pad(prompt_1P[0, 1:], (0, chunked_positions(P, chunk) - P + 1))

        def prompt_entries(chunk_logits, start):
            next_C = jax.lax.dynamic_slice(next_Q, (start,), (chunk,))
            lp = when(want_prompt_logprobs, lambda: chunk_logits()[0], next_C, logprobs, with_rank=True)
            return jax.tree.map(lambda x: x[None], lp)

        got, cache, dcache = prefill_chunked(target, prompt_1P, cache, chunk=chunk, tap_layers=taps,
                                             valid_len_B=valid, taps_fn=to_drafter if drafter is not None else None,
                                             taps_init=dcache, logits_fn=prompt_entries if with_prompt else None)
        last_1V, prompt_lp = (got[0], jax.tree.map(lambda x: x[0], got[1])) if with_prompt else (got, None)
        last_logits = last_1V[0]
    if first_allowed_V is not None:
        last_logits = jnp.where(first_allowed_V, last_logits, -jnp.inf)
    k0, key = rng.split(key)
    row = Stream(None, cache, dcache, key)
    if penalties is not None:
        V = last_logits.shape[-1]
        row = _with_controls(row, V, controls)
        row.prompt_seen = seen(prompt_1P, prompt_len, V)
    if grammar is not None:
        row.fsm, row.fsm_next, row.fsm_class = (jnp.asarray(g, jnp.int32) for g in grammar)
    first = sample(k0, penalized(last_logits[None], row, jnp.zeros((0,), jnp.int32), penalties), sp)
    row = _first(row, first)
    if logprobs is not None:
        return row, first, (token_logprobs(last_logits[None], first, logprobs), prompt_lp)
    return row, first


def _first(row: Stream, first_1) -> Stream:
    """The stream with its first generated token as the anchor (and counted)."""
    counts = None if row.counts is None else counted(row.counts, first_1, 1)
    return dataclasses.replace(row, anchor=first_1, counts=counts, fsm=advanced(row, first_1, 1),
                               ended=jnp.zeros((), jnp.bool_))


def extend_stream(target, drafter, row: Stream, ext_1E, ext_len, key, sp: SamplingParams,
                  logprobs: Optional[int] = None, penalties: Optional[Penalties] = None,
                  controls: Optional[LogitControls] = None, first_allowed_V=None):
    """Prefill ``ext_len`` more prompt tokens (right-padded [1, E]) on top of a stream whose caches already hold a
    prefix of the prompt (a prefix-cache hit: ``jdspark.prefix``): (Stream, first token [1]), as ``prefill_stream``
    of the whole prompt would give up to float reassociation (one chunk of E on the cached state, the chunked
    prefill's form). The prefix's own anchor and key are dropped: the stream's next token is drawn from the
    extension's last logits with a fresh ``key`` (the request's seed), as a fresh prefill's is.

        cache, dcache <- prefill_chunked(ext, cache = row.cache, chunk = E)   MLA attends to the prefix's latents,
                                                                            KDA and conv continue their state
        the drafter's context gets the extension's taps at positions n .. n + ext_len - 1 (n = the prefix's length)
    The cache must hold n + E positions (the caller checks). ``logprobs``: as ``prefill_stream``'s (the prompt's
    None: the kept tokens' logits are not computed again); ``penalties`` / ``controls`` / ``first_allowed_V``: as
    ``prefill_stream``'s (the request's own controls, not the kept prompt's)."""
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    E = ext_1E.shape[1]
    base_1 = row.cache.length

    def to_drafter(dc, taps_1CX, v_1, start):
        return drafter.append_context(dc, taps_1CX, v_1[0], start_pos=base_1 + start)

    last_1V, cache, dcache = prefill_chunked(target, ext_1E, row.cache, chunk=E, tap_layers=taps,
                                             valid_len_B=jnp.reshape(ext_len, (1,)).astype(jnp.int32),
                                             taps_fn=to_drafter if drafter is not None else None,
                                             taps_init=row.dcache)
    k0, key = rng.split(key)
    new = Stream(None, cache, dcache, key)
    if penalties is not None:  # the kept prompt's tokens and the extension's are the prompt; nothing generated
        new = _with_controls(new, row.counts.shape[0], controls)
        new.prompt_seen = row.prompt_seen | seen(ext_1E, ext_len, row.prompt_seen.shape[0])
    if row.fsm is not None:  # a constrained request is never a prefix-cache hit (``SlotBackend.insert``)
        new.fsm, new.fsm_next, new.fsm_class = jnp.int32(-1), row.fsm_next, row.fsm_class
    if first_allowed_V is not None:
        last_1V = jnp.where(first_allowed_V, last_1V, -jnp.inf)
    first = sample(k0, penalized(last_1V, new, jnp.zeros((0,), jnp.int32), penalties), sp)
    new = _first(new, first)
    if logprobs is not None:
        return new, first, (token_logprobs(last_1V, first, logprobs), None)
    return new, first


def plain_step(target, st: Stream, sp: SamplingParams, drafter=None, logprobs: Optional[int] = None,
               want_logprobs=None, penalties: Optional[Penalties] = None):
    """One target decode of the anchor: (Stream, StepOut) with one new token.

    ``drafter`` (a stream that drafts on other steps: a serving slot whose scheduler chose a plain step): the
    decoded position's taps are appended to the drafter's context too, as a verified block's are, so the next
    block reads every committed position. Without it each plain step left a hole in the context, the drafts after
    a run of plain steps got worse, and adaptive verification, seeing them fail, stepped plainly again.

    ``logprobs`` (static; None: not computed): the new token's ``TokenLogprobs`` with that many top entries, where
    ``want_logprobs`` (a scalar of the whole batch; None: always) says so (``jdspark.logprobs.when``).
    ``penalties``: the token is drawn from the penalised logits (``sampling.Penalties``; the stream's counts)."""
    key, k = rng.split(st.key)
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    with jax.named_scope("decode"):  # the phase's name in profiles (scripts/bench_profile.py)
        res = target.forward(st.anchor[:, None], st.cache, mode="decode", tap_layers=taps)
    with jax.named_scope("accept"):
        logits_1V = res.logits.reshape(1, -1)
        nxt = sample(k, penalized(logits_1V, st, jnp.zeros((0,), jnp.int32), penalties), sp)
    dcache = st.dcache
    if drafter is not None:
        with jax.named_scope("append_context"):
            dcache = drafter.append_context(st.dcache, res.taps, 1, start_pos=st.cache.length)
    one = jnp.int32(1)
    lp = None if logprobs is None else when(want_logprobs, logits_1V, nxt, logprobs)
    counts = recounted(st, nxt, 1, penalties)
    return (dataclasses.replace(st, anchor=nxt, cache=res.cache, dcache=dcache, key=key, counts=counts,
                                fsm=advanced(st, nxt, 1)),
            StepOut(nxt, one, jnp.int32(0), jnp.int32(0), logprobs=lp))


def spec_step(target, drafter, st: Stream, sp: SamplingParams, threshold: float = 0.0, width=None,
              max_drafts=None, confidence: bool = False, logprobs: Optional[int] = None, want_logprobs=None,
              penalties: Optional[Penalties] = None):
    """One fused draft -> verify -> accept -> commit step of one stream (see the module docstring).

    ``width`` (static; default G + 1): the verified block's length, anchor included (a serving engine compiles a
    few widths and picks one per step); ``max_drafts`` (traced, optional): verify at most this many drafts (0: the
    step is a plain decode inside the block), fixed before the step's drafts are drawn (lossless under sampling);
    ``confidence`` (static): also return the confidence head's survival of this block's max(W - 1, 1) drafts (an
    adaptive scheduler reads it to choose the next step's width; only those drafts are decoded, ``draft_block``);
    ``logprobs`` / ``want_logprobs``: as ``plain_step``'s (token j of new_K reads the verified logits at j);
    ``penalties``: verified position j's logits penalised with the drafts before it counted (``penalized``).
    Returns (Stream, StepOut with new_K of ``width`` tokens)."""
    G = drafter.config.block_size
    W = G + 1 if width is None else int(width)
    if not 1 <= W <= G + 1:
        raise ValueError(f"width: expected 1..{G + 1}, got {W}")
    taps = tuple(drafter.config.aux_hidden_state_layer_ids)
    key, k_draft, k_acc = rng.split(st.key, 3)
    n = st.cache.length  # [1]
    with jax.named_scope("draft"):  # scopes name the phases in profiles (HLO op_name)
        drafts_N, logq_NV, n_verify, survival = draft_block(drafter, st.dcache, st.anchor, n,
                                                             target.embed_tokens.embedding[...],
                                                             target.lm_head_DV(), k_draft, sp, threshold,
                                                             confidence, n_slots=max(W - 1, 1),
                                                             automaton=None if st.fsm is None else (
                                                                 jnp.reshape(st.fsm, (1,)), st.fsm_next,
                                                                 st.fsm_class))
    drafts, logq = drafts_N[:W - 1], logq_NV[:W - 1]
    n_verify = jnp.minimum(n_verify, W - 1)
    if max_drafts is not None:
        n_verify = jnp.minimum(n_verify, jnp.asarray(max_drafts, jnp.int32))
    block = jnp.concatenate([st.anchor, drafts])[None]  # [1, W]
    with jax.named_scope("verify"):
        ver = target.forward(block, st.cache, mode="verify", tap_layers=taps)
    with jax.named_scope("accept"):
        m, nxt = accept(k_acc, drafts, logq, penalized(ver.logits[0], st, drafts, penalties), n_verify, sp)
    with jax.named_scope("commit"):
        cache = select_verified(ver.cache, ver.kda_rollback, ver.conv_states, n, (m + 1)[None])
    with jax.named_scope("append_context"):
        dcache = drafter.append_context(st.dcache, ver.taps, m + 1, start_pos=n)
    new = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[m].set(nxt)
    lp = None if logprobs is None else when(want_logprobs, ver.logits[0], new, logprobs)
    counts = recounted(st, new, m + 1, penalties)
    return (dataclasses.replace(st, anchor=nxt[None], cache=cache, dcache=dcache, key=key, counts=counts,
                                fsm=advanced(st, new, m + 1)),
            StepOut(new, m + 1, n_verify, m, survival, lp))


_generate_jit = jax.jit(_generate_program, static_argnums=(0, 1, 2, 3, 5, 11, 12, 14))  # eos_id, controls traced


def generate(target, drafter, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_token_id: Optional[int] = None, confidence_threshold: float = 0.0,
             prompt_bucket: int = 64, stream=None, prefill_chunk: Optional[int] = None,
             max_len: Optional[int] = None, images=None, repetition_penalty: float = 1.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logit_bias: Optional[dict] = None,
             min_tokens: int = 0, min_p: float = 0.0, allowed_token_ids=(), grammar=None,
             first_token_ids=()) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` (1-D, or [1, T]) in one device program.

    drafter=None gives plain decoding. Prompts are right-padded to a multiple of ``prompt_bucket`` (of the chunk
    size when chunked) so prompts of the same padded length share one compiled program. EOS (default: the
    target's eos_token_id; -1 disables it) ends the generation and is included in the output. ``stream(ids)``
    receives the committed tokens step by step (host callback: slower, for interactive display). A target and
    drafter placed on a mesh by ``sharding.shard_model`` run the same program there.

    ``prefill_chunk``: the prompt's prefill in chunks of that many tokens (0: one pass; None: as
    ``kimi.dispatch.prefill_chunk`` decides for the prompt's length). The caches are sized by need
    (``cache_positions``: the padded prompt + max_new_tokens + a block); ``max_len`` (optional) caps them, and a
    request that needs more is a ValueError naming it.

    ``repetition_penalty`` / ``frequency_penalty`` / ``presence_penalty``: ``sampling.Penalties`` (vLLM's
    semantics), applied at every position the step verifies; all off (the defaults): not compiled in.
    ``logit_bias`` ({token id: value}, OpenAI's) and ``min_tokens`` (EOS not drawn before that many tokens,
    vLLM's): the logit controls (``sampling.penalize``), likewise at every verified position. ``min_p``: tokens
    below min_p x the likeliest's probability are not drawn (``sampling.SamplingParams``; 0: off);
    ``allowed_token_ids`` (vLLM's; empty: all): the only tokens drawn, a logit control. ``grammar``
    (``jdspark.grammar.TokenFSM``, None: none): the output is constrained to its language, then EOS (which must be
    one of the table's stop ids), masked at every position the step verifies (lossless). ``first_token_ids``
    (empty: all): the only ids the first generated token is drawn from, the steps after it unmasked (token
    healing: ``kimi.tokenizer.Tokenizer.heal`` gives the prompt without its last token and these ids); the first
    token comes from the prefill in both modes, so DSpark stays lossless."""
    ids = np.asarray(prompt_ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"prompt_ids: generate serves one stream (batch 1); got batch {ids.shape[0]}")
        ids = ids[0]
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise ValueError("prompt_ids: expected a non-empty 1-D sequence of token ids, "
                         f"got shape {np.shape(prompt_ids)}")
    cfg = target.config
    check_token_ids(ids, cfg.vocab_size, "prompt_ids")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    sp = SamplingParams(float(temperature), int(top_k), float(top_p), float(min_p))
    if not -2 ** 63 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed: expected an int in [-2**63, 2**63), got {seed}")
    if eos_token_id is not None and int(eos_token_id) not in range(-1, cfg.vocab_size):
        raise ValueError(f"eos_token_id: expected a token id in [0, {cfg.vocab_size}) or -1 (none), got {eos_token_id}")
    if isinstance(min_tokens, (int, np.integer)) and min_tokens > max_new_tokens:  # as vLLM
        raise ValueError(f"min_tokens: expected at most max_new_tokens ({max_new_tokens}), got {min_tokens}")
    if not isinstance(prompt_bucket, (int, np.integer)) or prompt_bucket < 1:
        raise ValueError(f"prompt_bucket: expected an int >= 1, got {prompt_bucket!r}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty: expected > 0 (1: off), got {repetition_penalty}")
    pen = Penalties(float(repetition_penalty), float(frequency_penalty), float(presence_penalty))
    controls = logit_controls(cfg.vocab_size, logit_bias, min_tokens, stop_ids=(
        cfg.eos_token_id if eos_token_id is None else int(eos_token_id),), allowed_ids=tuple(allowed_token_ids))
    pen = None if pen.off and controls is None else pen
    if drafter is not None:
        check_target(drafter.config, target)
    eos = cfg.eos_token_id if eos_token_id is None else int(eos_token_id)
    if images is not None and prefill_chunk is None:
        prefill_chunk = 0  # a prompt with images: one pass (prefill_stream says so if a chunk is asked for)
    chunk = dispatch.prefill_chunk(len(ids), prefill_chunk)
    P = _bucket(len(ids), prompt_bucket if chunk is None else chunk)
    G = drafter.config.block_size if drafter is not None else 0
    need = cache_positions(P, int(max_new_tokens), G, chunk)
    if max_len is not None and need > max_len:
        raise ValueError(f"max_len: the prompt ({len(ids)} tokens, padded to {P}) + max_new_tokens "
                         f"({max_new_tokens}) + a verify block ({G + 1}) need a cache of {need} positions; the "
                         f"limit is max_len={max_len}")
    padded = np.full((1, P), cfg.pad_token_id, np.int32)
    padded[0, :len(ids)] = ids
    prompt = target.partition.replicate(padded)
    media = None if images is None else target.partition.replicate(target.image_features(ids, images))
    fsm = None
    if grammar is not None:
        table = np.asarray(grammar.next_QV, np.int32)
        if table.ndim != 2 or table.shape[1] != cfg.vocab_size:
            raise ValueError(f"grammar: expected a table [Q, {cfg.vocab_size}], got shape {table.shape}")
        C = grammar.classes[0].shape[1]  # padded to a power of two: a program per (Q, bucket), not per automaton
        fsm = grammar.device_tables(min(cfg.vocab_size, max(8, 1 << (C - 1).bit_length())))
    first_allowed = None
    if len(first_token_ids):
        check_token_ids(np.asarray(first_token_ids), cfg.vocab_size, "first_token_ids")
        first_allowed = np.zeros(cfg.vocab_size, bool)
        first_allowed[np.asarray(first_token_ids)] = True
    served_t, served_d = serving_pair(target, drafter)
    t_graph, t_state = nnx.split(served_t)
    d_graph, d_state = nnx.split(served_d) if served_d is not None else (None, None)
    out, n_out, stats = _generate_jit(t_graph, d_graph, int(max_new_tokens), sp, jnp.int32(eos),
                                      float(confidence_threshold),
                                      t_state, d_state, prompt, jnp.int32(len(ids)),
                                      jax.random.key(seed), stream, chunk, media, pen, controls, fsm,
                                      None if first_allowed is None else jnp.asarray(first_allowed))
    n = int(n_out)
    return GenerateOutput(tokens=np.asarray(out)[:n], stats=jax.device_get(stats))


def compiled_programs() -> int:
    """How many generation programs have been compiled (a test checks a second call adds none)."""
    return _generate_jit._cache_size()
