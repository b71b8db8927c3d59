"""An independent sampling reference in NumPy (float64), written from the definitions, not from jdspark.sampling:

  temperature T > 0:  z = logits / T                       (T = 0 is greedy: argmax, no distribution)
  top-k (k > 0):      keep token i iff fewer than k tokens have a strictly larger z (so every token tied with the
                      k-th largest is kept: ties at the boundary are never broken)
  min-p (m > 0):      keep token i iff its probability (after temperature) is >= m times the largest (vLLM's
                      min-p, applied before top-p; with top-k both are kept-sets of the same probabilities)
  top-p (p < 1):      over the top-k- and min-p-renormalised distribution, order tokens by probability, larger
                      first, equal probabilities by smaller index first; keep the shortest prefix of that order
                      whose mass is >= p (the nucleus), renormalise
  speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft d ~ q is accepted with probability
                      min(1, p(d) / q(d)); after a rejection the token is drawn from norm(max(p - q, 0))
"""
from __future__ import annotations

import numpy as np


def process(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The processed distribution (probabilities, float64) of each row of logits [..., V]."""
    z = np.asarray(logits, np.float64)
    if temperature > 0:
        z = z / temperature
    V = z.shape[-1]
    keep = np.ones(z.shape, bool)
    if top_k > 0:  # fewer than k tokens strictly larger
        keep = (z[..., None, :] > z[..., :, None]).sum(-1) < top_k
    if min_p > 0:  # against the probabilities of the whole vocabulary (the ratios to the largest are the same)
        full = _softmax_where(z, np.ones(z.shape, bool))
        keep = keep & (full >= min_p * full.max(-1, keepdims=True))
    p = _softmax_where(z, keep)
    if top_p < 1.0:
        idx = np.broadcast_to(np.arange(V), z.shape)
        order = np.lexsort((idx, -p), axis=-1)  # larger probability first, then smaller index
        p_sorted = np.take_along_axis(p, order, -1)
        before = np.cumsum(p_sorted, -1) - p_sorted  # mass of the tokens ahead in the order
        # walking the order, a token joins the nucleus while the mass gathered so far is still < top_p
        in_nucleus = np.zeros(z.shape, bool)
        np.put_along_axis(in_nucleus, order, before < top_p, -1)
        p = _softmax_where(z, keep & in_nucleus)
    return p


def _softmax_where(z, keep):
    m = np.max(np.where(keep, z, -np.inf), -1, keepdims=True)
    e = np.where(keep, np.exp(z - m), 0.0)
    return e / e.sum(-1, keepdims=True)


def top_p_margin(logits, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Per row, how far the nucleus' cumulative masses are from top_p (min |mass of a prefix - top_p|) and, with
    min_p, how far any token's log-ratio to the largest probability is from log(min_p): rows with a margin below
    float32 resolution are decided by rounding, not by the definition, and are not compared."""
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    flat = z.reshape(-1, z.shape[-1])
    out = np.empty(flat.shape[0])
    for r, row in enumerate(flat):
        keep = np.ones(row.shape[0], bool) if top_k <= 0 else \
            np.array([np.sum(row > row[i]) < top_k for i in range(row.shape[0])])
        margin = np.inf
        if min_p > 0:
            below = row < row.max()  # the largest (and its ties) are kept exactly, whatever min_p <= 1
            margin = np.min(np.abs(row[below] - row.max() - np.log(min_p)), initial=np.inf)
            keep = keep & (row - row.max() >= np.log(min_p))
        p = _softmax_where(row, keep)
        cum = np.cumsum(sorted(p, reverse=True))
        out[r] = min(margin, np.min(np.abs(cum - top_p)) if top_p < 1 else np.inf)
    return out.reshape(z.shape[:-1])


def residual(p, q) -> np.ndarray:
    """The distribution a rejected draft is replaced from: norm(max(p - q, 0))."""
    r = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    return r / r.sum()


def accept_probability(p, q, d) -> float:
    return min(1.0, float(p[d]) / float(q[d]))


def pearson_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value of observed counts against cell probabilities (cells with expected count
    below min_expected pooled into one). A count in a cell of probability 0 is a certain failure (p = 0)."""
    from scipy import stats

    counts = np.asarray(counts, np.float64).reshape(-1)
    probs = np.asarray(probs, np.float64).reshape(-1)
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exp = probs * n
    small = exp < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    ex = np.append(exp[~small], exp[small].sum())
    keep = ex > 0
    assert keep.sum() >= 2, f"fewer than 2 cells with expected count >= {min_expected}: nothing to test"
    stat = float(np.sum((obs[keep] - ex[keep]) ** 2 / ex[keep]))
    return float(stats.chi2.sf(stat, keep.sum() - 1))


def penalize(logits, counts, prompt_mask, repetition: float = 1.0, frequency: float = 0.0,
             presence: float = 0.0, logit_bias=None, stop_ids=(), min_tokens: int = 0) -> np.ndarray:
    """Repetition penalties from their definition (vLLM's, float64), on logits [..., V] with ``counts`` [..., V]
    (times each token was generated before) and ``prompt_mask`` [V] (the prompt's tokens): a token seen in either
    has a positive logit divided by ``repetition`` and a negative one multiplied; then ``frequency`` times its count
    and ``presence`` if it was generated at all are subtracted. Then OpenAI's ``logit_bias`` ({id: value}) is added,
    and vLLM's ``min_tokens``: ``stop_ids`` can not be drawn (-inf) while fewer than ``min_tokens`` tokens were
    generated before (the counts' sum)."""
    z = np.array(logits, np.float64)
    c = np.asarray(counts, np.float64)
    seen = np.asarray(prompt_mask, bool) | (c > 0)
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    z = z - frequency * c - presence * (c > 0)
    for t, v in (logit_bias or {}).items():
        z[..., t] += v
    early = c.sum(-1) < min_tokens
    for t in stop_ids:
        z[..., t] = np.where(early, -np.inf, z[..., t])
    return z
