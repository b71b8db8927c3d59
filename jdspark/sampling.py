"""Sampling: temperature / top-k / min-p / top-p, and the acceptance rules of speculative decoding.

The target's p is ``process_logits`` of its logits; the drafter's q is ``propose``'s near-nucleus of its own (the
same temperature, top-k and min-p, and a superset of the top-p nucleus found in one pass). Rejection sampling
reads the q each draft was drawn from, so it stays lossless for any (temperature, top_k, min_p, top_p) and any q:
the output follows the target's processed distribution exactly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jdspark import rng
from kimi import dispatch

_NEG = -jnp.inf
_NUCLEUS_FAST_K = 64  # top-p looks for its boundary among the 64 most likely tokens first


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0, top_p 1.0 and min_p 0.0 mean off. min_p (vLLM's, HF's):
    keep the tokens whose probability is >= min_p times the likeliest's, i.e. z_i >= max_j z_j + log(min_p) on the
    tempered logits; applied before top-p (vLLM's order: temperature, min-p, top-k, top-p; min-p and top-k commute,
    both thresholds on z below the same maximum).

    Fields are Python numbers (one setting for a whole program: the branches a setting does not need are skipped
    when tracing) or arrays of one value per row (``SamplingParams.rows``: a serving engine's slots, each with
    its own setting; every branch is computed and selected per row).

    ``batch`` (optional, with per-row fields): three scalar booleans for the whole batch, whether any row samples
    (temperature > 0), uses top-k, uses top-p, uses min-p. A mapped program (``jax.vmap`` over rows) builds its per-row
    parameters inside the map and closes over ``batch`` from outside it, so ``lax.cond`` on these stays a real
    branch (a per-row predicate under vmap runs both): a batch of greedy rows skips sampling altogether."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    batch: object = None

    def __post_init__(self):
        if not self.is_static:
            return
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected in [0, 1] (0 = off), got {self.min_p}")

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, (int, float)) for v in (self.temperature, self.top_k, self.top_p, self.min_p))

    @property
    def greedy(self) -> bool:
        """Whether every row is greedy, known when tracing (False for per-row arrays: use ``greedy_rows``)."""
        return self.is_static and self.temperature == 0.0

    def greedy_rows(self):
        """Per-row greedy flags (a Python bool for static parameters)."""
        return self.temperature == 0.0 if self.is_static else jnp.asarray(self.temperature) == 0.0

    @staticmethod
    def rows(temperature, top_k, top_p, min_p=0.0, batch=None) -> "SamplingParams":
        """Per-row parameters as arrays (validated by the caller); ``batch``: ``batch_flags`` of the whole batch."""
        return SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p, jnp.float32), jnp.asarray(min_p, jnp.float32), batch)

    @staticmethod
    def batch_flags(temperature_B, top_k_B, top_p_B, min_p_B=0.0):
        """(any row samples, any uses top-k, any uses top-p, any uses min-p) of a batch's per-row parameters."""
        t, k, p, m = (jnp.asarray(x) for x in (temperature_B, top_k_B, top_p_B, min_p_B))
        sampled = t > 0
        return jnp.any(sampled), jnp.any(sampled & (k > 0)), jnp.any(sampled & (p < 1.0)), jnp.any(sampled & (m > 0))


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p", "min_p", "batch"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Penalties:
    """Repetition penalties on the target's logits, before temperature / top-k / top-p (vLLM's and OpenAI's):

        repetition r (1: off):  a token in the prompt or generated so far: z / r where z > 0, else z * r
        frequency f (0: off):   z - f * (times the token was generated so far)
        presence p (0: off):    z - p * [the token was generated so far]

    The penalised logits define the target's law at each position, so speculative decoding applies them at every
    verified position with the drafts before it counted (``penalize``): greedy accepts against the penalised
    argmax, rejection sampling against the penalised p, and stays lossless (the drafter's q may be anything).
    Fields are Python floats (one setting for a program; all off: nothing is compiled in) or per-row arrays with
    ``any`` a scalar of the whole batch (some row penalises, or has logit controls; a batch where none does skips
    the work). A request's logit_bias and min_tokens are applied by the same ``penalize`` (``bias_V`` etc.)."""

    repetition: object = 1.0
    frequency: object = 0.0
    presence: object = 0.0
    any: object = None

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, (int, float)) for v in (self.repetition, self.frequency, self.presence))

    @property
    def off(self) -> bool:
        """Every penalty off, known when tracing (static fields)."""
        return self.is_static and (self.repetition, self.frequency, self.presence) == (1.0, 0.0, 0.0)

    @staticmethod
    def rows(repetition, frequency, presence, any_=None) -> "Penalties":
        return Penalties(jnp.asarray(repetition, jnp.float32), jnp.asarray(frequency, jnp.float32),
                         jnp.asarray(presence, jnp.float32), any_)

    @staticmethod
    def batch_flag(repetition_B, frequency_B, presence_B):
        """Whether any row of a batch penalises."""
        return jnp.any((jnp.asarray(repetition_B) != 1.0) | (jnp.asarray(frequency_B) != 0.0)
                       | (jnp.asarray(presence_B) != 0.0))


jax.tree_util.register_dataclass(Penalties, data_fields=["repetition", "frequency", "presence", "any"],
                                 meta_fields=[])


def penalize(logits_XV, counts_XV, prompt_V, pen: Penalties, bias_V=None, stop_V=None, min_tokens=None):
    """``logits_XV`` [..., V] under ``pen`` (``Penalties``' equations), fp32: ``counts_XV`` [..., V] the times
    each token was generated before each position, ``prompt_V`` [V] bool the prompt's tokens. Then, with ``bias_V``
    (float32 [V]; None: none), the request's logit controls (OpenAI's / vLLM's):

        logit_bias:  z + bias_V  (-inf outside a request's allowed_token_ids)
        min_tokens:  -inf at the ids of ``stop_V`` ([V] bool: EOS) where n < ``min_tokens``, n = sum_v counts_XV
                     (the tokens generated before the position)

    Unchanged (not even cast) when ``pen`` is statically off and there is no bias."""
    if pen.off and bias_V is None:
        return logits_XV
    z = logits_XV.astype(jnp.float32)
    if pen.is_static:
        r, f, p = (jnp.float32(v) for v in (pen.repetition, pen.frequency, pen.presence))
    else:
        r, f, p = (_lead(v, z)[..., None] for v in (pen.repetition, pen.frequency, pen.presence))

    def apply(z):
        if not pen.off:
            c = counts_XV.astype(jnp.float32)
            seen = prompt_V | (counts_XV > 0)
            z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
            z = z - f * c - p * (c > 0).astype(jnp.float32)
        if bias_V is not None:
            early_X = jnp.sum(counts_XV, axis=-1) < min_tokens
            z = jnp.where(stop_V & early_X[..., None], -jnp.inf, z + bias_V)
        return z

    return _when(None if pen.is_static else pen.any, apply, z)


class LogitControls(NamedTuple):
    """A request's logit_bias, allowed_token_ids and min_tokens as a stream carries them (``sampling.penalize``'s
    equations)."""
    bias_V: jax.Array  # float32 [V]: added to the target's logits (-inf: a token not allowed)
    stop_V: jax.Array  # bool [V]: the ids (EOS) that get -inf while fewer than min_tokens tokens are out
    min_tokens: jax.Array  # int32


def logit_controls(vocab_size: int, logit_bias: Optional[dict], min_tokens: int, stop_ids=(),
                   always: bool = False, allowed_ids=()) -> Optional[LogitControls]:
    """A request's ``LogitControls`` as host arrays (None where it asks for none, unless ``always``): ``logit_bias``
    {token id: value} (ids in the vocabulary, finite values), ``min_tokens`` >= 0 holding back ``stop_ids`` (EOS;
    ids outside the vocabulary, such as -1 for none, are dropped), ``allowed_ids`` (vLLM's allowed_token_ids; empty:
    every token) the only tokens that may be drawn. A bad value is a ValueError naming it, as is a request that
    leaves no token to draw (every allowed id held back by min_tokens)."""
    bias = np.zeros((vocab_size,), np.float32)
    for t, v in (logit_bias or {}).items():
        if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab_size:
            raise ValueError(f"logit_bias: token ids must be ints in [0, {vocab_size}), got {t!r}")
        if not np.isfinite(v):
            raise ValueError(f"logit_bias: values must be finite numbers, got {v!r} for token {t}")
        bias[int(t)] = v
    if not isinstance(min_tokens, (int, np.integer)) or min_tokens < 0:
        raise ValueError(f"min_tokens: expected an int >= 0, got {min_tokens!r}")
    if len(allowed_ids):
        ok = np.asarray(allowed_ids)
        if ok.dtype.kind not in "iu" or ok.ndim != 1 or ok.min() < 0 or ok.max() >= vocab_size:
            raise ValueError(f"allowed_ids: expected token ids in [0, {vocab_size}), got {list(allowed_ids)[:8]}")
        bias = np.where(np.isin(np.arange(vocab_size), ok), bias, -np.inf).astype(np.float32)
    if not (always or logit_bias or min_tokens or len(allowed_ids)):
        return None
    stop = np.zeros((vocab_size,), bool)
    for t in stop_ids:
        if 0 <= int(t) < vocab_size:
            stop[int(t)] = True
    if min_tokens and not np.any(np.isfinite(bias) & ~stop):
        raise ValueError("allowed_ids: every allowed token is a stop token held back by min_tokens: nothing to draw")
    return LogitControls(bias, stop, np.int32(min_tokens))


def unless_greedy(sp: SamplingParams, sampled, greedy):
    """``greedy()`` when every row is greedy, else ``sampled()``: decided when tracing for a static setting, at
    run time (``lax.cond``, in the "bisect" form of ``dispatch.sampling_form``) from ``sp.batch`` for per-row arrays
    that carry it; else ``sampled()`` (which selects per row)."""
    if sp.greedy:
        return greedy()
    if sp.is_static or sp.batch is None or dispatch.sampling_form() != "bisect":
        return sampled()
    return jax.lax.cond(sp.batch[0], sampled, greedy)


def _when(flag, fn, z):
    """``fn(z)`` where a batch flag (None: unknown) says some row needs it, else ``z`` unchanged (``fn`` selects
    per row, so outside the "bisect" form of ``dispatch.sampling_form`` it is applied unconditionally)."""
    if flag is None or dispatch.sampling_form() != "bisect":
        return fn(z)
    return jax.lax.cond(flag, fn, lambda x: x, z)


def _lead(v, z):
    """A per-row parameter broadcast to the leading axes of logits ``z`` [..., V]: shape ``z.shape[:-1]``."""
    v = jnp.asarray(v)
    return jnp.broadcast_to(v.reshape(v.shape + (1,) * (z.ndim - 1 - v.ndim)), z.shape[:-1])


def process_logits(logits_XV, sp: SamplingParams):
    """Log-probabilities of the processed distribution, fp32: logits / T, then top-k and min-p, then top-p
    (nucleus: the smallest set of most likely tokens whose mass reaches top_p; ties broken by index). Masked
    entries are -inf. Per-row parameters (arrays) broadcast over the leading axes of ``logits_XV``; top-k keeps
    ties with the k-th, min-p every token at its bound."""
    z = logits_XV.astype(jnp.float32)
    if sp.is_static:
        z = _min_p(_top_k_static(z / (sp.temperature if sp.temperature > 0 else 1.0), sp.top_k), sp.min_p)
        if sp.top_p < 1.0:
            z = _top_p(z, sp.top_p)
        return jax.nn.log_softmax(z, axis=-1)
    t, p = (_lead(v, z)[..., None] for v in (sp.temperature, sp.top_p))
    z = _min_p_rows(_top_k_rows(z / jnp.where(t > 0, t, 1.0), sp), sp)
    any_p = None if sp.batch is None else sp.batch[2]
    z = _when(any_p, lambda z: jnp.where(p < 1.0, _top_p(z, _lead(sp.top_p, z)), z), z)
    return jax.nn.log_softmax(z, axis=-1)


def _top_k_static(z, top_k: int):
    """z with entries below the top_k-th largest of each row masked (ties with it kept); 0 or >= V: z."""
    if not 0 < top_k < z.shape[-1]:
        return z
    kth = jax.lax.top_k(z, top_k)[0][..., -1:]
    return jnp.where(z >= kth, z, _NEG)


def _top_k_rows(z, sp: SamplingParams):
    """``_top_k_static`` with per-row top_k (0 = off), skipped when the batch flag says no row uses it."""
    V = z.shape[-1]
    k_X = _lead(sp.top_k, z)

    def top_k_rows(z):
        kth = _kth_largest(z, jnp.clip(k_X, 1, V))[..., None]
        k = k_X[..., None]
        return jnp.where((k > 0) & (k < V) & (z < kth), _NEG, z)

    return _when(None if sp.batch is None else sp.batch[1], top_k_rows, z)


def _min_p(z, min_p):
    """z with the entries whose probability is below min_p x the row's largest masked: kept iff z_i >= max z +
    log(min_p) (no softmax needed; min_p 0: log 0 = -inf keeps every entry). ``min_p``: a Python float (0: z as
    it is) or per-row values broadcast to z's leading axes."""
    if isinstance(min_p, (int, float)):
        if min_p <= 0:
            return z
        log_m = jnp.float32(math.log(min_p))
    else:
        log_m = jnp.log(_lead(min_p, z))[..., None]
    return jnp.where(z >= jnp.max(z, axis=-1, keepdims=True) + log_m, z, _NEG)


def _min_p_rows(z, sp: SamplingParams):
    """``_min_p`` with per-row min_p, skipped when the batch flag says no row uses it."""
    return _when(None if sp.batch is None else sp.batch[3], lambda z: _min_p(z, sp.min_p), z)


def _bisect(lo_X, hi_X, go_up, steps: int):
    """Integer bisection per row, ``steps`` halvings (enough for the range): keeps ``go_up(lo) and not
    go_up(hi)``, moving lo up where ``go_up(mid)``, else hi down. Returns (lo, hi) with hi - lo <= 1."""
    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        up, live = go_up(mid), hi - lo > 1
        return jnp.where(live & up, mid, lo), jnp.where(live & ~up, mid, hi)

    return jax.lax.fori_loop(0, steps, body, (lo_X, hi_X))


def _order_key(z):
    """float32 -> uint32 with the same order (negative floats: all bits flipped; others: the sign bit set)."""
    u = jax.lax.bitcast_convert_type(z, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _kth_largest(z, k_X):
    """The k-th largest value of each row of z [..., V] (ties counted: the largest t with #{z >= t} >= k), by
    bisection over the rows' order keys: 32 masked counts per row instead of a sort (XLA's CPU sort of a 4096
    vocabulary costs more than a small model's decode step); in the "sort" form, the k-th of the row sorted."""
    if dispatch.sampling_form() == "sort":
        desc = -jnp.sort(-z, axis=-1)
        return jnp.take_along_axis(desc, (_lead(k_X, z) - 1)[..., None], axis=-1)[..., 0]
    key = _order_key(z)
    k_X = _lead(k_X, z)
    lo = jnp.min(key, axis=-1)  # #{key >= lo} = V >= k
    hi = jnp.max(key, axis=-1) + 1  # #{key >= hi} = 0 < k (no float maps to 0xFFFFFFFF)
    lo, _ = _bisect(lo, hi, lambda t: jnp.sum(key >= t[..., None], axis=-1) >= k_X, 32)
    found = jnp.argmax(key == lo[..., None], axis=-1)  # lo is a value of the row: the count only moves at one
    return jnp.take_along_axis(z, found[..., None], axis=-1)[..., 0]


def _count_before(flag_XV):
    """#{j < i : flag_j} for every i of a boolean row, in two levels of ~sqrt(V) (XLA:CPU lowers a cumsum over a
    4096 vocabulary as a reduce-window costing more than the rest of top-p)."""
    V = flag_XV.shape[-1]
    C = max(1, int(math.ceil(math.sqrt(V))))
    nb = -(-V // C)
    f = jnp.pad(flag_XV.astype(jnp.int32), [(0, 0)] * (flag_XV.ndim - 1) + [(0, nb * C - V)])
    f = f.reshape(flag_XV.shape[:-1] + (nb, C))
    within = jnp.cumsum(f, axis=-1) - f
    block = jnp.sum(f, axis=-1)
    before_blocks = jnp.cumsum(block, axis=-1) - block
    return (within + before_blocks[..., None]).reshape(flag_XV.shape[:-1] + (nb * C,))[..., :V]


def _top_p(z, top_p):
    """The nucleus of each row of z [..., V]: in the order larger probability first, equal ones by smaller index,
    a token is kept while the mass ahead of it is < top_p.

    Without a sort: with f(t) = sum of the probabilities > t, every token above v = min{p_j : f(p_j) < top_p}
    is kept, every token below is not, and the i-th token equal to v (i = 0, 1, ... by index) is kept iff
    f(v) + i * v < top_p. v is found by bisection over the float bits of p (non-negative floats order as their
    int32 bits). In the "sort" form (``dispatch.sampling_form``) the order itself: ``_top_p_sorted``."""
    if dispatch.sampling_form() == "sort":
        return _top_p_sorted(z, top_p)
    p = jax.nn.softmax(z, axis=-1)
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    top_p_X = _lead(top_p, z).astype(jnp.float32)

    def mass_above(t_X):
        return jnp.sum(jnp.where(bits > t_X[..., None], p, 0.0), axis=-1)

    def by_bisection():
        lo = jnp.full(z.shape[:-1], -1, jnp.int32)  # below every p: f = the whole mass, taken as >= top_p
        hi = jnp.max(bits, axis=-1)  # f(max p) = 0 < top_p
        return _bisect(lo, hi, lambda t: mass_above(t) >= top_p_X, 31)[1]

    # Fast path: when the K largest probabilities already hold top_p of the mass, v is among them: the last one
    # whose mass ahead (in that sorted list) is < top_p. lax.top_k costs a fifth of the bisection on CPU.
    K = min(_NUCLEUS_FAST_K, z.shape[-1])
    top_XK = jnp.take_along_axis(p, jax.lax.top_k(z, K)[1], axis=-1)  # z and p order alike; p's own bits
    ahead_XK = jnp.cumsum(top_XK, axis=-1) - top_XK
    n_kept = jnp.sum(ahead_XK < top_p_X[..., None], axis=-1)
    fits = jnp.all(ahead_XK[..., -1] + top_XK[..., -1] >= top_p_X)
    v_fast = jnp.take_along_axis(top_XK, jnp.maximum(n_kept - 1, 0)[..., None], axis=-1)[..., 0]
    v_bits = jax.lax.cond(fits, lambda: jax.lax.bitcast_convert_type(v_fast, jnp.int32), by_bisection)
    v = jax.lax.bitcast_convert_type(v_bits, jnp.float32)[..., None]
    above = bits > v_bits[..., None]
    tie = bits == v_bits[..., None]
    # the i-th tie by index has i ties ahead of it; a lone token at v (the usual case) skips the running count
    rank = jax.lax.cond(jnp.any(jnp.sum(tie, axis=-1) > 1), lambda: _count_before(tie), lambda: jnp.zeros(
        tie.shape, jnp.int32))
    keep = above | (tie & (mass_above(v_bits)[..., None] + rank * v < top_p_X[..., None]))
    return jnp.where(keep, z, _NEG)


def _top_p_sorted(z, top_p):
    """``_top_p`` by one stable sort: the probabilities in decreasing order (equal ones by smaller index), the mass
    ahead of each by a cumulative sum, n = #{mass ahead < top_p} kept; with v and j the value and index of the n-th,
    a token is kept iff p > v, or p == v and its index <= j (ties come in index order)."""
    p = jax.nn.softmax(z, axis=-1)
    idx = jnp.broadcast_to(jnp.arange(z.shape[-1], dtype=jnp.int32), z.shape)
    neg_sorted, idx_sorted = jax.lax.sort((-p, idx), dimension=z.ndim - 1, is_stable=True, num_keys=1)
    p_sorted = -neg_sorted
    ahead = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    n = jnp.maximum(jnp.sum(ahead < _lead(top_p, z).astype(jnp.float32)[..., None], axis=-1), 1)
    v = jnp.take_along_axis(p_sorted, (n - 1)[..., None], axis=-1)
    j = jnp.take_along_axis(idx_sorted, (n - 1)[..., None], axis=-1)
    keep = (p > v) | ((p == v) & (idx <= j))
    return jnp.where(keep, z, _NEG)


def draw(key, logw_XV):
    """One index per row, i with probability exp(logw_i) / sum_j exp(logw_j) (log-weights, -inf for none), by the
    Gumbel-max trick: argmax(logw + g), g ~ Gumbel iid.

    In two stages, exact by the chain rule: the set (the K = 64 largest weights, or the rest) by Gumbel-max over
    the two sets' log-masses m_top = logsumexp(logw_top), m_rest = logsumexp(logw_rest), then the index within that
    set by Gumbel-max, so

        P(i) = (m_set / (m_top + m_rest)) * (w_i / m_set) = w_i / sum_j w_j.

    Gumbel noise for the 64 candidates always (``lax.top_k`` in place of V uniform numbers: jax.random on this CPU
    costs ~0.2 ms per 4096 of them, more than the small model's verify of a token); for the rest's V only when a row
    picks the rest (a ``lax.cond``; never when the support fits in the 64, where m_rest = -inf). Under a batch's
    vmap the cond runs both branches, with the same values, and the step then costs what one Gumbel draw over V
    costs. The noise comes from ``jdspark.rng`` (Threefry unrolled: a ``jax.random`` call is a rolled loop on CPU,
    ~30 us whatever its size), one call for the set's and the candidates' numbers. Not an inverse CDF from one
    uniform: that maps rounding-level differences in the weights (the serving engine's batched programs and batch-1
    generate round differently) to a different token whenever the uniform falls near any of the support's
    boundaries, where Gumbel-max (each stage of it) changes only on a near-tie of the two best perturbed scores.
    In the "sort" form (``dispatch.sampling_form``: not the CPU) one stage over all V: no top_k, no cond."""
    V = logw_XV.shape[-1]
    K = min(_NUCLEUS_FAST_K, V)
    logw = logw_XV.astype(jnp.float32)
    if K == V or dispatch.sampling_form() == "sort":  # one stage: Gumbel noise over V (no top_k, no cond)
        return jnp.argmax(logw + rng.gumbel(key, logw.shape), axis=-1).astype(jnp.int32)
    k_now, k_rest = rng.split(key)
    top_XK, idx_XK = jax.lax.top_k(logw, K)
    rest_XV = jnp.put_along_axis(logw, idx_XK, _NEG, axis=-1, inplace=False)
    mass_X2 = jnp.stack([jax.nn.logsumexp(top_XK, axis=-1), jax.nn.logsumexp(rest_XV, axis=-1)], axis=-1)
    g = rng.gumbel(k_now, top_XK.shape[:-1] + (2 + K,))  # the set's 2 and the 64 candidates', one call
    in_rest = jnp.argmax(mass_X2 + g[..., :2], axis=-1) == 1
    best = jnp.argmax(top_XK + g[..., 2:], axis=-1)
    from_top = jnp.take_along_axis(idx_XK, best[..., None], axis=-1)[..., 0].astype(jnp.int32)
    from_rest = jax.lax.cond(jnp.any(in_rest),
                             lambda: jnp.argmax(rest_XV + rng.gumbel(k_rest, rest_XV.shape), axis=-1).astype(
                                 jnp.int32),
                             lambda: jnp.zeros_like(from_top))
    return jnp.where(in_rest, from_rest, from_top)


def _draw_blocks(key, logw_XV, block: int = 64):
    """``draw``'s law by a two-level Gumbel-max over blocks of ``block`` consecutive indices: the block by its
    log-mass, then the index within it (exact by the chain rule); 2 * V / block Gumbel numbers instead of V."""
    V = logw_XV.shape[-1]
    nb = -(-V // block)
    w = jnp.pad(logw_XV, [(0, 0)] * (logw_XV.ndim - 1) + [(0, nb * block - V)], constant_values=_NEG)
    w = w.reshape(logw_XV.shape[:-1] + (nb, block))
    mass = jax.nn.logsumexp(w, axis=-1)
    g = rng.gumbel(key, mass.shape[:-1] + (nb + block,))  # the blocks' and the chosen block's, one call
    b = jnp.argmax(mass + g[..., :nb], axis=-1)
    row = jnp.take_along_axis(w, b[..., None, None], axis=-2)[..., 0, :]
    j = jnp.argmax(row + g[..., nb:], axis=-1)
    return (b * block + j).astype(jnp.int32)


def _nucleus_by_buckets(logp_XV, top_p_X):
    """A superset of the top-p nucleus by one radix pass: the probabilities are bucketed by their float's top
    12 bits (sign 0, 8 exponent, 3 mantissa bits: 8 buckets an octave, p within a factor 1.125 in each), the
    buckets' masses summed, and every token kept whose bucket is at or above the last one the mass from the top
    reaches ``top_p`` in. Keeps >= top_p of the mass, at most one bucket's tokens past the nucleus."""
    p = jnp.exp(logp_XV)
    bucket = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(p, jnp.int32), 20)  # 0..1016 for p <= 1
    lead, V = p.shape[:-1], p.shape[-1]
    mass = jax.vmap(lambda b, w: jnp.zeros((1024,), jnp.float32).at[b].add(w))(bucket.reshape(-1, V),
                                                                               p.reshape(-1, V))
    m = mass.reshape(-1, 32, 32)  # suffix sums over the 1024 buckets in two levels of 32 (small matmuls)
    upper = jnp.triu(jnp.ones((32, 32), jnp.float32))  # upper[i, j] = j >= i
    within = jnp.einsum("rbj,ij->rbi", m, upper)
    after = jnp.einsum("rj,ij->ri", m.sum(-1), upper) - m.sum(-1)
    from_top = (within + after[..., None]).reshape(lead + (1024,))
    last = jnp.max(jnp.where(from_top >= top_p_X[..., None], jnp.arange(1024), 0), axis=-1)
    return bucket >= last[..., None]


def propose(key, logits_XV, sp: SamplingParams):
    """A drafter's sampled proposal: (token [...], log q [..., V] fp32), q the tempered, top-k- and min-p-masked
    distribution restricted to a superset of its top-p nucleus (``_nucleus_by_buckets``: at most one bucket of
    tokens within a factor 1.125 of the nucleus's smallest past it) and renormalised.

    Speculative sampling is lossless for any proposal q the rejection rule reads (``accept_rejection``: the output
    follows the target's p whatever q is), so the drafter need not compute ``process_logits``'s exact nucleus: a
    near-nucleus keeps its acceptance (q close to the target's processed p is what acceptance needs) at a fraction
    of the cost (one scatter-add pass instead of a bisection of 31 masked sums over V for a wide nucleus) and the
    draw takes 2 * V / 64 Gumbel numbers (``_draw_blocks``), not V. Rows with temperature 0 (per-row parameters)
    get their argmax (their log q is not read: greedy rows accept by ``accept_greedy``)."""
    z = logits_XV.astype(jnp.float32)
    if sp.is_static:
        t, p = jnp.float32(sp.temperature if sp.temperature > 0 else 1.0), jnp.float32(sp.top_p)
        z = _min_p(_top_k_static(z / t, sp.top_k), sp.min_p)
    else:
        t = _lead(sp.temperature, z)
        z = _min_p_rows(_top_k_rows(z / jnp.where(t > 0, t, 1.0)[..., None], sp), sp)
        p = _lead(sp.top_p, z)
    p_X = jnp.broadcast_to(jnp.asarray(p, jnp.float32), z.shape[:-1])
    logp_XV = jax.nn.log_softmax(z, axis=-1)
    keep = (p_X[..., None] >= 1.0) | _nucleus_by_buckets(logp_XV, p_X)
    logq_XV = jax.nn.log_softmax(jnp.where(keep, z, _NEG), axis=-1)
    token = _draw_blocks(key, logq_XV)
    if not sp.is_static:
        token = jnp.where(t == 0.0, jnp.argmax(logits_XV, axis=-1).astype(jnp.int32), token)
    return token, logq_XV


def sample(key, logits_XV, sp: SamplingParams, processed_XV=None):
    """One token per row: argmax when greedy, else a draw from the processed distribution (``processed_XV``:
    ``process_logits(logits_XV, sp)`` when the caller has it already, so it is not computed twice)."""
    def greedy():
        return jnp.argmax(logits_XV, axis=-1).astype(jnp.int32)

    def sampled():
        logq = process_logits(logits_XV, sp) if processed_XV is None else processed_XV
        drawn = draw(key, logq)
        if sp.is_static:
            return drawn
        g = jnp.asarray(sp.greedy_rows())
        g = g.reshape(g.shape + (1,) * (drawn.ndim - g.ndim)) if g.ndim else g
        return jnp.where(g, greedy(), drawn)

    return unless_greedy(sp, sampled, greedy)


def accept_greedy(drafts_G, target_logits_G1V, n_verify):
    """Longest prefix of drafts equal to the target's argmax, capped at n_verify; then the target's bonus token.
    Returns (n_accepted, bonus)."""
    G = drafts_G.shape[0]
    target_G1 = jnp.argmax(target_logits_G1V, axis=-1).astype(jnp.int32)
    ok = (drafts_G == target_G1[:G]) & (jnp.arange(G) < n_verify)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    return n_acc, target_G1[n_acc]


def bonus_key(key):
    """The key ``accept_rejection(key, ...)`` draws its residual or bonus token with. A plain decode step draws its
    token with it too (``speculative.plain_step``), so a request that verifies no drafts (n_verify 0: its draft cap
    0, or a narrow step) draws the same token from the same logits whichever kind of step a batch ran."""
    return rng.split(key)[1]


def accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp: SamplingParams):
    """Speculative sampling (Leviathan et al.; Chen et al.): accept draft i with probability min(1, p_i/q_i); at
    the first rejection j resample from norm(max(p_j - q_j, 0)); if all verified drafts pass, the bonus comes
    from p at the next position. Drafts past n_verify count as not drafted. Returns (n_accepted, next_token).

    The bonus is drawn from p's log-weights themselves (not the log of their exponentials) with ``bonus_key(key)``:
    with n_verify 0 this is ``sample(bonus_key(key), logits[0], sp)``, a plain step's draw."""
    G = drafts_G.shape[0]
    k_u, k_res = rng.split(key)[0], bonus_key(key)
    logp_G1V = process_logits(target_logits_G1V, sp)
    p_G1V = jnp.exp(logp_G1V)
    q_GV = jnp.exp(logq_GV)
    p_d = jnp.take_along_axis(p_G1V[:G], drafts_G[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q_GV, drafts_G[:, None], axis=-1)[:, 0]
    u = rng.uniform(k_u, (G,))
    ok = (u * q_d < p_d) & (jnp.arange(G) < n_verify)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    rejected = n_acc < jnp.minimum(n_verify, G)
    q_pad = jnp.concatenate([q_GV, jnp.zeros_like(q_GV[:1])], axis=0)
    resid = jnp.maximum(p_G1V[n_acc] - q_pad[n_acc], 0.0)
    # resid sums to > 0 whenever p != q; if p == q exactly (no rejection possible) draw from p
    nxt = draw(k_res, jnp.where(rejected & (resid.sum() > 0), jnp.log(resid), logp_G1V[n_acc]))
    return n_acc, nxt


def accept(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp: SamplingParams):
    """The acceptance rule of ``sp``: ``accept_greedy`` when greedy, else ``accept_rejection`` (both computed and
    selected for a traced per-stream setting). Returns (n_accepted, next_token)."""
    if sp.is_static:
        if sp.greedy:
            return accept_greedy(drafts_G, target_logits_G1V, n_verify)
        return accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp)

    def per_row():
        m_g, t_g = accept_greedy(drafts_G, target_logits_G1V, n_verify)
        m_s, t_s = accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp)
        g = sp.greedy_rows()
        return jnp.where(g, m_g, m_s), jnp.where(g, t_g, t_s)

    return unless_greedy(sp, per_row, lambda: accept_greedy(drafts_G, target_logits_G1V, n_verify))
