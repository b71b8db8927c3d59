"""Sampling: temperature / top-k / top-p, and the acceptance rules of speculative decoding.

The same ``process_logits`` is applied to the target's p and the drafter's q, so rejection sampling stays lossless
for any (temperature, top_k, top_p): the output follows the target's processed distribution exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean off.

    Fields are Python numbers (one setting for a whole program: the branches a setting does not need are skipped
    when tracing) or arrays of one value per row (``SamplingParams.rows``: a serving engine's slots, each with
    its own setting; every branch is computed and selected per row)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.is_static:
            return
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, (int, float)) for v in (self.temperature, self.top_k, self.top_p))

    @property
    def greedy(self) -> bool:
        """Whether every row is greedy, known when tracing (False for per-row arrays: use ``greedy_rows``)."""
        return self.is_static and self.temperature == 0.0

    def greedy_rows(self):
        """Per-row greedy flags (a Python bool for static parameters)."""
        return self.temperature == 0.0 if self.is_static else jnp.asarray(self.temperature) == 0.0

    @staticmethod
    def rows(temperature, top_k, top_p) -> "SamplingParams":
        """Per-row parameters as arrays (validated by the caller)."""
        return SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p, jnp.float32))


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p"], meta_fields=[])


def _row(v, z):
    """A per-row parameter broadcast against logits ``z`` [..., V] (scalars as they are)."""
    v = jnp.asarray(v)
    return v.reshape(v.shape + (1,) * (z.ndim - v.ndim)) if v.ndim else v


def process_logits(logits_XV, sp: SamplingParams):
    """Log-probabilities of the processed distribution, fp32: logits / T, then top-k, then top-p (nucleus: the
    smallest set of most likely tokens whose mass reaches top_p; ties broken by index). Masked entries are -inf.
    Per-row parameters (arrays) broadcast over the leading axes of ``logits_XV``; top-k keeps ties with the k-th."""
    z = logits_XV.astype(jnp.float32)
    V = z.shape[-1]
    if sp.is_static:
        z = z / (sp.temperature if sp.temperature > 0 else 1.0)
        if 0 < sp.top_k < V:
            kth = jax.lax.top_k(z, sp.top_k)[0][..., -1:]
            z = jnp.where(z >= kth, z, _NEG)
        if sp.top_p < 1.0:
            z = _top_p(z, sp.top_p)
        return jax.nn.log_softmax(z, axis=-1)
    t, k, p = _row(sp.temperature, z), _row(sp.top_k, z), _row(sp.top_p, z)
    z = z / jnp.where(t > 0, t, 1.0)
    desc = -jnp.sort(-z, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, V - 1) * jnp.ones(z.shape[:-1] + (1,), jnp.int32), axis=-1)
    z = jnp.where((k > 0) & (k < V) & (z < kth), _NEG, z)
    z = jnp.where(p < 1.0, _top_p(z, p), z)
    return jax.nn.log_softmax(z, axis=-1)


def _top_p(z, top_p):
    order = jnp.argsort(-z, axis=-1, stable=True)
    z_sorted = jnp.take_along_axis(z, order, axis=-1)
    p_sorted = jax.nn.softmax(z_sorted, axis=-1)
    mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    keep_sorted = mass_before < top_p
    # back to vocabulary order by scattering through the permutation (one sort per row, not a second argsort)
    rows = z.reshape(-1, z.shape[-1]).shape[0]
    keep = jnp.zeros((rows, z.shape[-1]), bool).at[jnp.arange(rows)[:, None], order.reshape(rows, -1)].set(
        keep_sorted.reshape(rows, -1)).reshape(z.shape)
    return jnp.where(keep, z, _NEG)


def sample(key, logits_XV, sp: SamplingParams, processed_XV=None):
    """One token per row: argmax when greedy, else a draw from the processed distribution (``processed_XV``:
    ``process_logits(logits_XV, sp)`` when the caller has it already, so it is not computed twice)."""
    if sp.greedy:
        return jnp.argmax(logits_XV, axis=-1).astype(jnp.int32)
    logq = process_logits(logits_XV, sp) if processed_XV is None else processed_XV
    drawn = jax.random.categorical(key, logq, axis=-1).astype(jnp.int32)
    if sp.is_static:
        return drawn
    g = jnp.asarray(sp.greedy_rows())
    g = g.reshape(g.shape + (1,) * (drawn.ndim - g.ndim)) if g.ndim else g
    return jnp.where(g, jnp.argmax(logits_XV, axis=-1).astype(jnp.int32), drawn)


def accept_greedy(drafts_G, target_logits_G1V, n_verify):
    """Longest prefix of drafts equal to the target's argmax, capped at n_verify; then the target's bonus token.
    Returns (n_accepted, bonus)."""
    G = drafts_G.shape[0]
    target_G1 = jnp.argmax(target_logits_G1V, axis=-1).astype(jnp.int32)
    ok = (drafts_G == target_G1[:G]) & (jnp.arange(G) < n_verify)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    return n_acc, target_G1[n_acc]


def accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp: SamplingParams):
    """Speculative sampling (Leviathan et al.; Chen et al.): accept draft i with probability min(1, p_i/q_i); at
    the first rejection j resample from norm(max(p_j - q_j, 0)); if all verified drafts pass, the bonus comes
    from p at the next position. Drafts past n_verify count as not drafted. Returns (n_accepted, next_token)."""
    G = drafts_G.shape[0]
    k_u, k_res = jax.random.split(key)
    logp_G1V = process_logits(target_logits_G1V, sp)
    p_G1V = jnp.exp(logp_G1V)
    q_GV = jnp.exp(logq_GV)
    p_d = jnp.take_along_axis(p_G1V[:G], drafts_G[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q_GV, drafts_G[:, None], axis=-1)[:, 0]
    u = jax.random.uniform(k_u, (G,))
    ok = (u * q_d < p_d) & (jnp.arange(G) < n_verify)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    rejected = n_acc < jnp.minimum(n_verify, G)
    q_pad = jnp.concatenate([q_GV, jnp.zeros_like(q_GV[:1])], axis=0)
    resid = jnp.maximum(p_G1V[n_acc] - jnp.where(rejected, q_pad[n_acc], 0.0), 0.0)
    # resid sums to > 0 whenever p != q; if p == q exactly (no rejection possible) fall back to p
    resid = jnp.where(resid.sum() > 0, resid, p_G1V[n_acc])
    nxt = jax.random.categorical(k_res, jnp.log(resid)).astype(jnp.int32)
    return n_acc, nxt


def accept(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp: SamplingParams):
    """The acceptance rule of ``sp``: ``accept_greedy`` when greedy, else ``accept_rejection`` (both computed and
    selected for a traced per-stream setting). Returns (n_accepted, next_token)."""
    if sp.is_static:
        if sp.greedy:
            return accept_greedy(drafts_G, target_logits_G1V, n_verify)
        return accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp)
    m_g, t_g = accept_greedy(drafts_G, target_logits_G1V, n_verify)
    m_s, t_s = accept_rejection(key, drafts_G, logq_GV, target_logits_G1V, n_verify, sp)
    g = sp.greedy_rows()
    return jnp.where(g, m_g, m_s), jnp.where(g, t_g, t_s)
