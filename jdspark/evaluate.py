"""Held-out likelihood of a target, per byte, so models with different vocabularies compare.

    nll_BT = logsumexp(logits_BTV) - logits_BTV[target]       next-token negative log-likelihood (nats)
    mask_BT = doc_ids[:, 1:] == doc_ids[:, :-1]                no score across a document boundary (EOS -> BOS)
    bits_per_byte = sum(nll_BT * mask_BT) / ln 2 / sum(bytes(target) * mask_BT)

with ``bytes`` from ``jdspark.data.byte_lengths`` (special ids count as one byte, as the byte vocabulary's EOS).
``token_nll`` is the loss the target trainer minimises; ``bits_per_byte`` evaluates a model on fixed batches.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi.cache import KimiCache

__all__ = ["token_nll", "bits_per_byte"]


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
