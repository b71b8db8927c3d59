"""The fused draft-verify step of one stream (``spec_step``), its plain step and its prefill / extension: what
``jdspark.generation.generate`` loops over in one jitted program and the serving slots map over their rows.

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
``plain_step`` is one target decode (a generation without a drafter, or a serving slot's plain step).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jdspark import rng
from jdspark.logprobs import TokenLogprobs, token_logprobs, when
from jdspark.sampling import (
    LogitControls,
    Penalties,
    SamplingParams,
    accept,
    bonus_key,
    propose,
    sample,
    unless_greedy,
)
from jdspark.stream_logits import advanced, counted, penalized, recounted, seen
from kimi.cache import KimiCache, select_verified
from kimi.prefill import chunked_positions, prefill_chunked


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


def prefill_stream(target, drafter, prompt_1P, prompt_len, key, sp: SamplingParams, max_len: int,
                   chunk: Optional[int] = None, media_MD=None, logprobs: Optional[int] = None,
                   want_prompt_logprobs=None, penalties: Optional[Penalties] = None,
                   controls: Optional[LogitControls] = None, grammar=None, first_allowed_V=None,
                   next_token=None):
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
    ``next_token`` (traced int32; None or < 0: none): the token after the prompt, scored by the last valid position
    (a long prompt's first slice: ``jdspark.slot_insert``), whose entry is then meaningful too.

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
    if chunk is None:
        cache, taps_1PX, h_1PD = prefill_rows(target, prompt_1P, valid, max_len, taps, media_MD)
        h_PD = h_1PD[0]
        last_logits = _last_logits(target, h_PD, prompt_len)
        if drafter is not None:
            dcache = drafter.append_context(dcache, taps_1PX, prompt_len, start_pos=0)
        if with_prompt:
            next_P = _after(prompt_1P[0], prompt_len, next_token)
            prompt_lp = when(want_prompt_logprobs, lambda: target.logits_from_hidden(h_PD), next_P, logprobs,
                             with_rank=True)
    else:
        cache = KimiCache.init(target.config, 1, max_len)

        def to_drafter(dc, taps_1CX, v_1, start):
            return drafter.append_context(dc, taps_1CX, v_1[0], start_pos=start)

        # position i's logits score prompt token i + 1: each chunk reads the next C tokens, one position on
        next_Q = jnp.pad(_after(prompt_1P[0], prompt_len, next_token), (0, chunked_positions(P, chunk) - P))

        def prompt_entries(chunk_logits, start):
            next_C = jax.lax.dynamic_slice(next_Q, (start,), (chunk,))
            lp = when(want_prompt_logprobs, lambda: chunk_logits()[0], next_C, logprobs, with_rank=True)
            return jax.tree.map(lambda x: x[None], lp)

        got, cache, dcache = prefill_chunked(target, prompt_1P, cache, chunk=chunk, tap_layers=taps,
                                             valid_len_B=valid, taps_fn=to_drafter if drafter is not None else None,
                                             taps_init=dcache, logits_fn=prompt_entries if with_prompt else None)
        last_1V, prompt_lp = (got[0], jax.tree.map(lambda x: x[0], got[1])) if with_prompt else (got, None)
        last_logits = last_1V[0]
    row, first, *lp = _start(cache, dcache, last_logits, prompt_1P, prompt_len, key, sp, logprobs, penalties,
                             controls, grammar, first_allowed_V)
    return (row, first, (lp[0], prompt_lp)) if logprobs is not None else (row, first)


def _after(tokens_T, valid_len, next_token=None):
    """[T]: each position's next token, the one scored by its logits (a prompt's log-probabilities): tokens 1 ..
    T - 1, then 0; ``next_token`` (>= 0; None: none) at position valid_len - 1, the token after the valid ones."""
    next_T = jnp.concatenate([tokens_T[1:], jnp.zeros((1,), tokens_T.dtype)])
    if next_token is None:
        return next_T
    return next_T.at[valid_len - 1].set(jnp.where(next_token >= 0, next_token, next_T[valid_len - 1]))


def prefill_rows(target, prompt_BP, valid_B, max_len: int, taps=(), media_MD=None):
    """One pass over B right-padded prompts [B, P] (row b's first ``valid_B[b]`` tokens valid) on a cache of the
    prompt bucket's length, padded to ``max_len`` after (``KimiCache.padded_to``: the attention scores the prompt's
    keys, not the whole cache's): (cache [B], taps [B, P, X] or None, last hidden [B, P, D])."""
    B, P = prompt_BP.shape
    pre = target.forward(prompt_BP, KimiCache.init(target.config, B, min(P, max_len)), mode="prefill",
                         tap_layers=taps, valid_len_B=valid_B, media_MD=media_MD)
    return pre.cache.padded_to(max_len), pre.taps, pre.last_hidden


def _last_logits(target, h_PD, prompt_len):
    """[V]: the LM head on the last valid position alone (a prompt's [P, V] logits only for its log-probabilities)."""
    return target.logits_from_hidden(jax.lax.dynamic_slice_in_dim(h_PD, prompt_len - 1, 1))[0]


def _start(cache, dcache, last_logits, prompt_1P, prompt_len, key, sp: SamplingParams, logprobs, penalties,
           controls, grammar, first_allowed_V):
    """A prefilled stream's first token and its Stream (what ``prefill_stream`` and ``prefill_streams`` share):
    (Stream, first [1]) and, with ``logprobs``, the first token's ``TokenLogprobs``."""
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
        return row, first, token_logprobs(last_logits[None], first, logprobs)
    return row, first


def prefill_streams(target, drafter, prompt_kP, lens_k, keys_k, sp: SamplingParams, max_len: int,
                    logprobs: Optional[int] = None, penalties: Optional[Penalties] = None,
                    controls: Optional[LogitControls] = None, grammar=None, first_allowed_kV=None):
    """``prefill_stream`` of k prompts at once (one pass, no images, no prompt log-probabilities): the target
    prefills the k right-padded prompts [k, P] as one batch (``prefill_rows``: its matmuls read the weights once
    for k prompts), then each row's drafter context and first token as ``prefill_stream`` makes them, mapped over
    the rows. Returns (Streams stacked over a leading axis of k, each batch 1 inside; first tokens [k, 1]) and,
    with ``logprobs``, the first tokens' ``TokenLogprobs`` [k, ...]. Per-row arguments carry a leading k axis:
    ``lens_k``, ``keys_k``, ``sp`` (``SamplingParams.rows`` of [k] fields), ``penalties`` (``Penalties.rows``),
    ``controls``, ``grammar``'s three arrays, ``first_allowed_kV``.

    Each row equals its ``prefill_stream`` up to float rounding (XLA may sum a batch's rows in another order)."""
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    lens_k = lens_k.astype(jnp.int32)
    cache_k, taps_kPX, h_kPD = prefill_rows(target, prompt_kP, lens_k, max_len, taps)

    def one(cache_1, taps_PX, h_PD, prompt_P, n, key, sp1, pen, ctrl, gram, first_V):
        dcache = None
        if drafter is not None:
            dcache = drafter.append_context(drafter.init_cache(1, max_len), taps_PX[None], n, start_pos=0)
        return _start(cache_1, dcache, _last_logits(target, h_PD, n), prompt_P[None], n, key, sp1, logprobs,
                      pen, ctrl, gram, first_V)

    return jax.vmap(one)(cache_k.rows(), taps_kPX, h_kPD, prompt_kP, lens_k, keys_k, sp, penalties, controls,
                         grammar, first_allowed_kV)


def _first(row: Stream, first_1) -> Stream:
    """The stream with its first generated token as the anchor (and counted)."""
    counts = None if row.counts is None else counted(row.counts, first_1, 1)
    return dataclasses.replace(row, anchor=first_1, counts=counts, fsm=advanced(row, first_1, 1),
                               ended=jnp.zeros((), jnp.bool_))


def extend_stream(target, drafter, row: Stream, ext_1E, ext_len, key, sp: SamplingParams,
                  logprobs: Optional[int] = None, penalties: Optional[Penalties] = None,
                  controls: Optional[LogitControls] = None, first_allowed_V=None, grammar=None,
                  want_prompt_logprobs=None, next_token=None):
    """Prefill ``ext_len`` more prompt tokens (right-padded [1, E]) on top of a stream whose caches already hold a
    prefix of the prompt (a prefix-cache hit: ``jdspark.prefix``): (Stream, first token [1]), as ``prefill_stream``
    of the whole prompt would give up to float reassociation (one chunk of E on the cached state, the chunked
    prefill's form). The prefix's own anchor and key are dropped: the stream's next token is drawn from the
    extension's last logits with a fresh ``key`` (the request's seed), as a fresh prefill's is.

        cache, dcache <- prefill_chunked(ext, cache = row.cache, chunk = E)   MLA attends to the prefix's latents,
                                                                            KDA and conv continue their state
        the drafter's context gets the extension's taps at positions n .. n + ext_len - 1 (n = the prefix's length)
    The cache must hold n + E positions (the caller checks). ``logprobs``, ``want_prompt_logprobs`` and
    ``next_token``: as ``prefill_stream``'s, the prompt's entries [E] those of the extension's tokens (extension
    token i + 1's from its position i; the kept tokens' are not computed again: a long prompt in slices gathers
    them slice by slice, each slice's last entry scoring ``next_token``, the next slice's first); ``penalties`` /
    ``controls`` / ``first_allowed_V``: as ``prefill_stream``'s (the request's own controls, not the kept
    prompt's); ``grammar``: as ``prefill_stream``'s, the request's own automaton (state -1 for an unconstrained
    request) in place of the kept row's (None: the kept row's table, switched off)."""
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    E = ext_1E.shape[1]
    base_1 = row.cache.length

    def to_drafter(dc, taps_1CX, v_1, start):
        return drafter.append_context(dc, taps_1CX, v_1[0], start_pos=base_1 + start)

    prompt_entries, prompt_lp = None, None
    if logprobs is not None and want_prompt_logprobs is not None:
        next_E = _after(ext_1E[0], ext_len, next_token)

        def prompt_entries(chunk_logits, start):  # one chunk of E (start 0)
            lp = when(want_prompt_logprobs, lambda: chunk_logits()[0], next_E, logprobs, with_rank=True)
            return jax.tree.map(lambda x: x[None], lp)

    got, cache, dcache = prefill_chunked(target, ext_1E, row.cache, chunk=E, tap_layers=taps,
                                         valid_len_B=jnp.reshape(ext_len, (1,)).astype(jnp.int32),
                                         taps_fn=to_drafter if drafter is not None else None,
                                         taps_init=row.dcache, logits_fn=prompt_entries)
    last_1V = got
    if prompt_entries is not None:
        last_1V, prompt_lp = got[0], jax.tree.map(lambda x: x[0], got[1])
    k0, key = rng.split(key)
    new = Stream(None, cache, dcache, key)
    if penalties is not None:  # the kept prompt's tokens and the extension's are the prompt; nothing generated
        new = _with_controls(new, row.counts.shape[0], controls)
        new.prompt_seen = row.prompt_seen | seen(ext_1E, ext_len, row.prompt_seen.shape[0])
    if grammar is not None:  # the request's own automaton, whatever the kept prompt's request had
        new.fsm, new.fsm_next, new.fsm_class = (jnp.asarray(g, jnp.int32) for g in grammar)
    elif row.fsm is not None:
        new.fsm, new.fsm_next, new.fsm_class = jnp.int32(-1), row.fsm_next, row.fsm_class
    if first_allowed_V is not None:
        last_1V = jnp.where(first_allowed_V, last_1V, -jnp.inf)
    first = sample(k0, penalized(last_1V, new, jnp.zeros((0,), jnp.int32), penalties), sp)
    new = _first(new, first)
    if logprobs is not None:
        return new, first, (token_logprobs(last_1V, first, logprobs), prompt_lp)
    return new, first


def step_keys(key) -> tuple:
    """(the stream's next key, the drafts' key, the acceptance key) of one step. Plain and speculative steps split
    a stream's key alike and a plain step draws its token with the acceptance rule's bonus key
    (``sampling.bonus_key``), so a seeded request that verifies no drafts (``speculative: false`` among drafting
    rows, an adaptive row's narrow step) draws the same tokens whether its batch ran a plain step or a verify."""
    return rng.split(key, 3)


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
    key, _, k_acc = step_keys(st.key)
    taps = tuple(drafter.config.aux_hidden_state_layer_ids) if drafter is not None else ()
    with jax.named_scope("decode"):  # the phase's name in profiles (scripts/bench_profile.py)
        res = target.forward(st.anchor[:, None], st.cache, mode="decode", tap_layers=taps)
    with jax.named_scope("accept"):
        logits_1V = res.logits.reshape(1, -1)
        nxt = sample(bonus_key(k_acc), penalized(logits_1V, st, jnp.zeros((0,), jnp.int32), penalties), sp)
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
    key, k_draft, k_acc = step_keys(st.key)
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


def verify_width(drafter, num_speculative_tokens: Optional[int] = None) -> Optional[int]:
    """The widest verify step for ``num_speculative_tokens`` n drafts a step (vLLM's setting): n + 1, the
    anchor included (default n = the drafter's block size G); None without a drafter (plain decoding verifies no
    drafts and ignores it). A ValueError names an n outside 1..G."""
    if drafter is None:
        return None
    G = drafter.config.block_size
    n = G if num_speculative_tokens is None else num_speculative_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= G:
        raise ValueError(f"num_speculative_tokens: expected an int in 1..{G} (the drafter's block size), got {n!r}")
    return int(n) + 1
