"""Held-out figures: a target's likelihood per byte (so models with different vocabularies compare), and a
drafter's acceptance when it is served.

    nll_BT = logsumexp(logits_BTV) - logits_BTV[target]       next-token negative log-likelihood (nats)
    mask_BT = doc_ids[:, 1:] == doc_ids[:, :-1]                no score across a document boundary (EOS -> BOS)
    bits_per_byte = sum(nll_BT * mask_BT) / ln 2 / sum(bytes(target) * mask_BT)

with ``bytes`` from ``jdspark.data.byte_lengths`` (special ids count as one byte, as the byte vocabulary's EOS).
``token_nll`` is the loss the target trainer minimises; ``bits_per_byte`` evaluates a model on fixed batches.
``served_acceptance``: tokens per target step of ``jdspark.generate`` on held-out prompts, greedy and sampled (the
number a drafter is trained for, measured on the serving path rather than teacher-forced).
``accept_len_interval``: how far that pooled figure can be trusted when it comes from a handful of prompts (a
percentile bootstrap over prompts: acceptance moves far more between prompts than between tokens of one prompt).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.generation import generate
from kimi.cache import KimiCache

__all__ = ["token_nll", "bits_per_byte", "served_acceptance", "accept_len_interval"]


def token_nll(logits_BTV, tokens_BT1, doc_ids_BT1):
    """(nll_BT fp32, mask_BT fp32, correct_BT bool) of the predictions ``logits_BTV`` of ``tokens_BT1[:, 1:]``."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    tgt_BT = tokens_BT1[:, 1:]
    mask_BT = (doc_ids_BT1[:, 1:] == doc_ids_BT1[:, :-1]).astype(jnp.float32)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    nll_BT = logz_BT - jnp.take_along_axis(logits_BTV, tgt_BT[..., None], axis=-1)[..., 0]
    return nll_BT, mask_BT, jnp.argmax(logits_BTV, -1) == tgt_BT


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _nll_sums(state, tokens_BT1, doc_ids_BT1, lengths_V, *, graphdef):
    model = nnx.merge(graphdef, state)
    B, T1 = tokens_BT1.shape
    logits = model.forward(tokens_BT1[:, :-1], KimiCache.init(model.config, B, T1 - 1), mode="prefill").logits
    nll_BT, mask_BT, _ = token_nll(logits, tokens_BT1, doc_ids_BT1)
    return (nll_BT * mask_BT).sum(), (lengths_V[tokens_BT1[:, 1:]] * mask_BT).sum()


def bits_per_byte(model, batches: Sequence, lengths_V: np.ndarray) -> float:
    """Bits per byte of ``model`` over ``batches`` (``jdspark.data.Batch``: tokens and doc ids [B, T+1])."""
    if not batches:
        raise ValueError("bits_per_byte: no batches")
    graphdef, state = nnx.split(model)
    nats = nbytes = 0.0
    lengths = jnp.asarray(lengths_V, jnp.float32)
    for b in batches:
        s, n = _nll_sums(state, jnp.asarray(b.tokens), jnp.asarray(b.doc_ids), lengths, graphdef=graphdef)
        nats, nbytes = nats + float(s), nbytes + float(n)
    return nats / math.log(2) / max(nbytes, 1.0)


def served_acceptance(target, drafter, prompts: Sequence, max_new_tokens: int, temperatures=(0.0, 1.0),
                      top_p: float = 0.95, seed: int = 0) -> dict:
    """Tokens per target step of ``drafter`` served with ``target`` (``jdspark.generate``, EOS ignored so every
    prompt runs ``max_new_tokens``), pooled over ``prompts``, per temperature: ``{"T=<t>": {"accept_len",
    "per_position_accept", "target_steps"}}``. Sampled rows use nucleus ``top_p`` and seed ``seed + i`` for prompt
    i, so two drafters compare on the same draws of the target's randomness."""
    if not len(prompts) or max_new_tokens < 1:
        raise ValueError(f"served_acceptance: need prompts and max_new_tokens >= 1, got {len(prompts)}, "
                         f"{max_new_tokens}")
    out = {}
    for temp in temperatures:
        steps = accepted = 0
        counts = np.zeros(drafter.config.block_size, np.int64)
        for i, p in enumerate(prompts):
            o = generate(target, drafter, p, max_new_tokens=max_new_tokens, temperature=float(temp),
                         top_p=top_p if temp > 0 else 1.0, seed=seed + i, eos_token_id=-1)
            steps += int(o.stats.target_steps)
            accepted += int(o.stats.accepted)
            counts += np.asarray(o.stats.accept_counts)
        out[f"T={float(temp):g}"] = {"accept_len": (accepted + steps) / steps, "target_steps": steps,
                                    "per_position_accept": (counts / steps).tolist()}
    return out


def accept_len_interval(steps_N: Sequence[int], accepted_N: Sequence[int], level: float = 0.95,
                        resamples: int = 2000, seed: int = 0) -> list:
    """A ``level`` percentile-bootstrap interval [lo, hi] of the pooled tokens per target step over N prompts,

        accept_len = (sum_i accepted_i + sum_i steps_i) / sum_i steps_i,

    resampling whole prompts with replacement (prompt i took ``steps_N[i]`` target steps and accepted
    ``accepted_N[i]`` drafts): the tokens of one generation are not independent, the prompts are. Seeded, so a
    report is reproducible. With few prompts the interval is wide, and percentile intervals of small samples cover a
    little less than ``level`` (tests/jdspark/test_evaluate.py measures it)."""
    steps = np.asarray(steps_N, np.float64)
    acc = np.asarray(accepted_N, np.float64)
    if steps.ndim != 1 or steps.shape != acc.shape or steps.size == 0:
        raise ValueError(f"accept_len_interval: expected two equal-length 1-D sequences, got shapes {steps.shape} "
                         f"and {acc.shape}")
    if np.any(steps < 1) or np.any(acc < 0):
        raise ValueError("accept_len_interval: every prompt needs steps >= 1 and accepted >= 0")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"accept_len_interval: expected 0 < level < 1 and resamples >= 1, got {level}, {resamples}")
    idx = np.random.default_rng(seed).integers(0, steps.size, (resamples, steps.size))
    s, a = steps[idx].sum(1), acc[idx].sum(1)
    lo, hi = np.quantile((a + s) / s, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]
