"""``generate``: one stream's whole generation (prefill + decode loop) as one jitted program (a ``lax.while_loop``).

Each step of the loop is ``jdspark.speculative.spec_step`` (the fused draft -> verify -> accept -> commit step) or,
with ``drafter=None``, ``plain_step`` (one target decode), until EOS or ``max_new_tokens``; ``GenStats`` counts
what the steps drafted and accepted. A small model is served from a copy of its weights laid out for these passes,
made once per set of weights and kept between calls (``jdspark.serving_copy.serving_pair``;
``kimi.model.with_serving_layout``, ``jdspark.drafter.with_serving_layout``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jdspark.drafter import check_target
from jdspark.sampling import Penalties, SamplingParams, logit_controls
from jdspark.serving_copy import serving_pair
from jdspark.speculative import Stream, plain_step, prefill_stream, spec_step, verify_width
from kimi import dispatch
from kimi.model import check_token_ids
from kimi.prefill import chunked_positions


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


def cache_positions(P: int, max_new: int, G: int, chunk: Optional[int] = None) -> int:
    """Cache positions a generation needs: the prompt as prefilled (P padded, or every chunk whole), then
    max_new tokens and one verify block past the last (G drafts + the anchor):
        S = (P or chunked_positions(P, C)) + max_new + G + 1"""
    return (P if chunk is None else chunked_positions(P, chunk)) + max_new + G + 1


NEW_TOKENS_BUCKET = 16  # generate's programs hold max_new_tokens rounded up to a multiple of this (traced within)


def new_tokens_capacity(max_new: int, base: int, max_len: Optional[int] = None) -> int:
    """The new tokens ``generate``'s program for ``max_new`` holds: max_new rounded up to a multiple of
    ``NEW_TOKENS_BUCKET``, so that lengths in one bucket share a compiled program (the count generated is traced),
    at the cost of at most 15 more cache positions; held to ``max_len - base`` (``base``: the cache positions of
    the prompt and a block, ``cache_positions(P, 0, G)``) where ``max_len`` caps the caches, but never below
    max_new."""
    capacity = _bucket(max_new, NEW_TOKENS_BUCKET)
    return capacity if max_len is None else max(max_new, min(capacity, max_len - base))


def _generate_program(t_graph, d_graph, capacity: int, sp: SamplingParams, eos_id: int, threshold: float,
                      t_state, d_state, prompt_1P, prompt_len, key, stream=None, chunk=None, media_MD=None,
                      penalties=None, controls=None, fsm=None, first_allowed_V=None, width=None, max_new=None):
    """The whole generation (prefill + loop) of the served pair (``serving_pair``'s modules, split). Static:
    graphs, capacity (the most new tokens the program's output and caches hold), sampling params, threshold,
    stream, chunk (the prefill's chunk size, None for one pass), penalties (``sampling.Penalties`` or None);
    traced: ``max_new`` (the tokens generated, at most ``capacity``; None: ``capacity``), ``eos_id`` (-1: none),
    ``media_MD`` (image features merged in the prefill), ``controls``
    (``LogitControls`` or None), ``fsm`` (a ``jdspark.grammar`` table by token classes, (next_QC, class_V), or
    None), ``first_allowed_V`` (bool [V], the first token's ids, or None).

    ``stream`` (a host function of the newly committed token ids) is called once per step through
    ``io_callback``; it makes the host wait on every step, so speed is measured without it."""
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    P = prompt_1P.shape[1]
    G = drafter.config.block_size if drafter is not None else 0
    st0, first = prefill_stream(target, drafter, prompt_1P, prompt_len, key, sp,
                                cache_positions(P, capacity, G, chunk), chunk, media_MD, penalties=penalties,
                                controls=controls, grammar=None if fsm is None else (0, *fsm),
                                first_allowed_V=first_allowed_V)
    return decode_loop(target, drafter, st0, first, capacity if max_new is None else max_new, sp, eos_id, threshold,
                       stream, penalties, width, capacity)


def decode_loop(target, drafter, st0: Stream, first, max_new, sp: SamplingParams, eos_id: int,
                threshold: float = 0.0, stream=None, penalties: Optional[Penalties] = None, width=None,
                capacity: Optional[int] = None):
    """The generation after its prefill (``prefill_stream``'s Stream and first token): ``spec_step`` (or
    ``plain_step`` without a drafter) in a ``lax.while_loop`` until EOS or ``max_new`` tokens, the first included.
    ``width``: ``spec_step``'s (static; None: the whole block). ``max_new`` may be traced when ``capacity`` (static,
    >= it) sizes the output; None: ``max_new`` does (an int).
    Returns (out [capacity + G + 1] (the first n_out valid), n_out, GenStats). Usable inside jit; a benchmark jits
    it alone to time and measure decoding apart from the prefill (scripts/bench_long.py)."""
    G = drafter.config.block_size if drafter is not None else 0
    out = jnp.zeros(((max_new if capacity is None else capacity) + G + 1,), jnp.int32)
    st = _Loop(out=out, n_out=jnp.int32(0), stream=st0, done=jnp.bool_(False),
               stats=GenStats(jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.zeros((G,), jnp.int32)))
    o, n_out, done = _emit(st, first, jnp.int32(1), eos_id, max_new, stream)
    st = dataclasses.replace(st, out=o, n_out=n_out, done=done)

    def body(st: _Loop) -> _Loop:
        if drafter is None:
            nxt_stream, res = plain_step(target, st.stream, sp, penalties=penalties)
        else:
            nxt_stream, res = spec_step(target, drafter, st.stream, sp, threshold, width=width, penalties=penalties)
        o, n_out, done = _emit(st, res.new_K, res.n_new, eos_id, max_new, stream)
        # drafts accepted past the output's end (EOS or max_new inside the block) are not the output's: not counted
        accepted = jnp.minimum(res.accepted, n_out - st.n_out)
        acc = st.stats.accept_counts + (jnp.arange(G) < accepted).astype(jnp.int32)
        stats = GenStats(st.stats.target_steps + 1, st.stats.drafted + res.drafted,
                         st.stats.accepted + accepted, acc)
        return _Loop(o, n_out, nxt_stream, done, stats)

    st = jax.lax.while_loop(lambda s: ~s.done, body, st)
    return st.out, st.n_out, st.stats


_generate_jit = jax.jit(_generate_program, static_argnums=(0, 1, 2, 3, 5, 11, 12, 14, 18))  # max_new, eos traced


def generate(target, drafter, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_token_id: Optional[int] = None, confidence_threshold: float = 0.0,
             prompt_bucket: int = 64, stream=None, prefill_chunk: Optional[int] = None,
             max_len: Optional[int] = None, images=None, repetition_penalty: float = 1.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logit_bias: Optional[dict] = None,
             min_tokens: int = 0, min_p: float = 0.0, allowed_token_ids=(), grammar=None,
             first_token_ids=(), num_speculative_tokens: Optional[int] = None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` (1-D, or [1, T]) in one device program.

    drafter=None gives plain decoding. Prompts are right-padded to a multiple of ``prompt_bucket`` (of the chunk
    size when chunked) so prompts of the same padded length share one compiled program, and max_new_tokens is held
    in a program for its multiple of 16 (``new_tokens_capacity``; the count itself traced). EOS (default: the
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
    token comes from the prefill in both modes, so DSpark stays lossless.

    ``num_speculative_tokens`` (vLLM's name; default: the drafter's whole block G): each step verifies only the
    block's first n drafts (``spec_step``'s width n + 1; the drafter decodes only those). Where a verified position
    costs compute (this CPU: a verify of the shipped pair's whole block costs ~1.8-2 decode steps,
    docs/performance.md) and late drafts are seldom accepted, fewer pay better; on a GPU, where verifying a block
    costs about one decode, the whole block does. Plain decoding (drafter=None) ignores it."""
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
    width = verify_width(drafter, num_speculative_tokens)
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
    capacity = new_tokens_capacity(int(max_new_tokens), cache_positions(P, 0, G, chunk), max_len)
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
    out, n_out, stats = _generate_jit(t_graph, d_graph, capacity, sp, jnp.int32(eos),
                                      float(confidence_threshold),
                                      t_state, d_state, prompt, jnp.int32(len(ids)),
                                      jax.random.key(seed), stream, chunk, media, pen, controls, fsm,
                                      None if first_allowed is None else jnp.asarray(first_allowed), width,
                                      jnp.int32(max_new_tokens))
    n = int(n_out)
    return GenerateOutput(tokens=np.asarray(out)[:n], stats=jax.device_get(stats))


def compiled_programs() -> int:
    """How many generation programs have been compiled (a test checks a second call adds none)."""
    return _generate_jit._cache_size()
