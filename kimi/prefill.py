"""Chunked prefill: a prompt of any length in chunks of C tokens, so peak memory is the caches plus one chunk's
activations instead of the whole prompt's.

    for j in 0 .. ceil(T / C) - 1:                      one lax.scan step each (one compiled body for any T)
        out_j = model.forward(tokens[:, jC:(j+1)C], cache, mode="prefill", valid_len_B=v_j)
        v_j   = clip(valid_len - jC, 0, C)              padded positions change no state
        cache = out_j.cache                             KDA carries its state, MLA attends to the latent cache
                                                        of earlier chunks plus the chunk itself

Equal to a one-pass prefill up to float reassociation (tests: <= 1e-4 fp32, chunk sizes that do and do not divide
the prompt). The cache must hold every chunk whole (``cache.length + ceil(T / C) * C`` positions): a chunk's
padded tail is written past the valid entries, masked, and would otherwise be clamped onto them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi.cache import KimiCache

__all__ = ["prefill_chunked", "chunked_positions"]


def chunked_positions(T: int, chunk: int) -> int:
    """Positions a chunked prefill of T tokens writes: T rounded up to a multiple of ``chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk: expected a positive int, got {chunk}")
    return -(-int(T) // int(chunk)) * int(chunk)


def prefill_chunked(model, tokens_BT, cache: KimiCache, *, chunk: int, tap_layers: Sequence[int] = (),
                    valid_len_B=None, all_logits: bool = False, taps_fn: Optional[Callable] = None,
                    taps_init=None, logits_fn: Optional[Callable] = None):
    """Prefill ``tokens_BT`` (right-padded rows of ``valid_len_B`` tokens; all T when None) chunk by chunk.

    Returns ``(logits, cache, taps)``: logits [B, V] of each row's last valid token ([B, T, V] of every position
    with ``all_logits``), the cache after the prompt, and taps [B, T, n_taps * D] (None without tap layers).
    With ``taps_fn`` the taps are consumed chunk by chunk instead of stacked (a drafter's context cache filled
    as the prompt goes, so the whole prompt's taps never exist at once): ``carry = taps_fn(carry, taps_BCX,
    valid_B, start)`` after each chunk (``valid_B`` of its C rows valid, ``start`` its first position), starting
    from ``taps_init``; the third return is then the final carry.
    ``logits_fn(chunk_logits, start)`` (``start`` the chunk's first position; ``chunk_logits()`` computes the
    chunk's [B, C, V] logits, so a function that calls it only under a ``lax.cond`` computes them only when the
    cond takes that branch) reduces each chunk's logits to a pytree of [B, C, ...] per position (e.g. each prompt
    token's log-probability: the whole [B, T, V] never exists); the first return is then (logits [B, V] of the last
    valid token, that pytree stacked to [B, T, ...]). Without ``all_logits`` the LM head runs on each row's last
    valid position only (and under ``logits_fn`` where it asks): at K3's vocabulary a 4096-token chunk's logits
    would be [4096, 163840] fp32, 2.7 GB, for one row kept.
    Usable inside jit; the chunk loop is a ``lax.scan``, so the program does not grow with T."""
    if all_logits and logits_fn is not None:
        raise ValueError("prefill_chunked: all_logits and logits_fn are exclusive (all_logits is logits_fn = id)")
    B, T = tokens_BT.shape
    n = chunked_positions(T, chunk) // chunk
    if not isinstance(cache.length, jax.core.Tracer):
        need = int(np.max(np.asarray(cache.length))) + n * chunk
        if need > cache.max_len:
            raise ValueError(f"prefill_chunked: {T} tokens in chunks of {chunk} write {n * chunk} positions; the "
                             f"cache holds max_len={cache.max_len} ({need} needed)")
    valid_B = jnp.full((B,), T, jnp.int32) if valid_len_B is None else jnp.asarray(valid_len_B, jnp.int32)
    pad = n * chunk - T
    toks_nBC = jnp.pad(tokens_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).transpose(1, 0, 2)
    starts_n = jnp.arange(n, dtype=jnp.int32) * chunk
    V = model.config.vocab_size

    def step(carry, xs):
        cache, last_BV, user = carry
        toks_BC, start = xs
        v_B = jnp.clip(valid_B - start, 0, chunk)
        out = model.forward(toks_BC, cache, mode="prefill", tap_layers=tap_layers, valid_len_B=v_B)
        idx_B = jnp.clip(v_B - 1, 0, chunk - 1)  # out.logits, unread but with all_logits, is dead code to XLA
        here_BV = model.logits_from_hidden(jnp.take_along_axis(out.last_hidden, idx_B[:, None, None], axis=1))[:, 0]
        last_BV = jnp.where((v_B > 0)[:, None], here_BV, last_BV)
        if taps_fn is not None:
            user = taps_fn(user, out.taps, v_B, start)
        def chunk_logits():  # the chunk's [B, C, V], computed only where a logits_fn asks for them
            return model.logits_from_hidden(out.last_hidden)

        per_position = out.logits if all_logits else (logits_fn(chunk_logits, start) if logits_fn else None)
        ys = (per_position, out.taps if taps_fn is None else None)
        return (out.cache, last_BV, user), ys

    (cache, last_BV, user), (per_position_nBC_, taps_nBCX) = jax.lax.scan(
        step, (cache, jnp.zeros((B, V), jnp.float32), taps_init), (toks_nBC, starts_n))

    def unchunk(x_nBC_):
        if x_nBC_ is None:
            return None
        return jnp.moveaxis(x_nBC_, 0, 1).reshape((B, n * chunk) + x_nBC_.shape[3:])[:, :T]

    third = user if taps_fn is not None else unchunk(taps_nBCX)
    if all_logits:
        return unchunk(per_position_nBC_), cache, third
    if logits_fn is not None:
        return (last_BV, jax.tree.map(unchunk, per_position_nBC_)), cache, third
    return last_BV, cache, third
