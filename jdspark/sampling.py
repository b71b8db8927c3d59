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
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits_XV, sp: SamplingParams):
    """Log-probabilities of the processed distribution, fp32: logits / T, then top-k, then top-p (nucleus: the
    smallest set of most likely tokens whose mass reaches top_p; ties broken by index). Masked entries are -inf."""
    z = logits_XV.astype(jnp.float32) / (sp.temperature if sp.temperature > 0 else 1.0)
    V = z.shape[-1]
    if 0 < sp.top_k < V:
        kth = jax.lax.top_k(z, sp.top_k)[0][..., -1:]
        z = jnp.where(z >= kth, z, _NEG)
    if sp.top_p < 1.0:
        order = jnp.argsort(-z, axis=-1, stable=True)
        z_sorted = jnp.take_along_axis(z, order, axis=-1)
        p_sorted = jax.nn.softmax(z_sorted, axis=-1)
        mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
        keep_sorted = mass_before < sp.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        z = jnp.where(keep, z, _NEG)
    return jax.nn.log_softmax(z, axis=-1)


def sample(key, logits_XV, sp: SamplingParams):
    """One token per row: argmax when greedy, else a draw from the processed distribution."""
    if sp.greedy:
        return jnp.argmax(logits_XV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits_XV, sp), axis=-1).astype(jnp.int32)


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
