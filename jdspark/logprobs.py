"""Log-probabilities of the committed tokens (the OpenAI API's ``logprobs``), computed inside a serving step.

For a committed token t at a position whose target logits are z [V]:

    logprob(t) = z_t - logsumexp(z)          (fp32; the target's own distribution, before temperature, top-k,
                                              top-p: vLLM's default "raw_logprobs" and what OpenAI reports)
    top L      = the L largest log_softmax(z) entries and their ids, most likely first (``jax.lax.top_k``:
                 ties keep the lower id first)
    rank(t)    = #{v : z_v >= z_t}                (1 for the likeliest; vLLM's rank, ties counted)

A speculative step commits the accepted drafts and one more token from the logits of the positions it verified:
token j of the step (j <= accepted) reads the verified block's logits at position j (the target's prediction
after the anchor and drafts 1..j), so a token's logprob is the same whichever way it was committed (accepted
draft, resampled at a rejection, bonus, plain decode): the target's logits at that position of the sequence.

A serving program computes them only when some row of the batch asks (``when``: a ``lax.cond`` on a predicate of
the whole batch, taken outside the rows' ``vmap``, so a batch without such a row skips the work): the step's
cost is unchanged for traffic that does not ask. The host turns the arrays into per-token entries
(``host_entries``) and the server into the API's two shapes (``completion_logprobs``, ``chat_logprobs``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_LOGPROBS", "TokenLogprobs", "token_logprobs", "when", "host_entries", "completion_logprobs",
           "chat_logprobs", "prompt_logprobs_object"]

# The most top entries a request may ask per token (OpenAI's cap on ``top_logprobs``; vLLM's default
# ``max_logprobs``): a serving program computes this many for every row that asks, the host keeps each request's.
MAX_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
    """Per committed position K: the token's log-probability and rank, the L most likely tokens' (ids, log-probs)."""
    chosen_K: jax.Array  # [K] fp32
    top_ids_KL: jax.Array  # [K, L] int32
    top_KL: jax.Array  # [K, L] fp32
    rank_K: Optional[jax.Array] = None  # [K] int32, where asked (``with_rank``: the prompt's, vLLM's
    # prompt_logprobs; a generated token's is not served, so its steps do not count them)


def token_logprobs(logits_KV, tokens_K, top: int, with_rank: bool = False) -> TokenLogprobs:
    """``logprob(tokens_K[k])`` under ``log_softmax(logits_KV[k])`` and its ``top`` largest entries (module doc);
    ``with_rank`` (static): the tokens' ranks too (one more pass over V per position)."""
    logp_KV = jax.nn.log_softmax(logits_KV.astype(jnp.float32), axis=-1)
    chosen_K = jnp.take_along_axis(logp_KV, tokens_K.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    top_KL, ids_KL = jax.lax.top_k(logp_KV, top)
    rank_K = jnp.sum(logp_KV >= chosen_K[:, None], axis=-1).astype(jnp.int32) if with_rank else None
    return TokenLogprobs(chosen_K, ids_KL.astype(jnp.int32), top_KL, rank_K)


def when(flag, logits_KV, tokens_K, top: int, with_rank: bool = False) -> TokenLogprobs:
    """``token_logprobs`` where ``flag`` (a scalar of the whole batch; None: always), else zeros of its shapes.
    ``logits_KV``: the logits, or a function computing them (then computed only where ``flag`` holds)."""
    def compute():
        return token_logprobs(logits_KV() if callable(logits_KV) else logits_KV, tokens_K, top, with_rank)

    if flag is None:
        return compute()
    K = tokens_K.shape[0]
    return jax.lax.cond(flag, compute, lambda: TokenLogprobs(
        jnp.zeros((K,), jnp.float32), jnp.zeros((K, top), jnp.int32), jnp.zeros((K, top), jnp.float32),
        jnp.zeros((K,), jnp.int32) if with_rank else None))


def host_entries(chosen_K: np.ndarray, top_ids_KL: np.ndarray, top_KL: np.ndarray, n: int, top: int,
                 rank_K: Optional[np.ndarray] = None) -> list:
    """The first ``n`` positions as [(logprob, [(id, logprob), ...top of them]), ...] (Python numbers); with
    ``rank_K``, each entry has the token's rank third."""
    return [(float(chosen_K[k]), [(int(i), float(v)) for i, v in zip(top_ids_KL[k, :top], top_KL[k, :top])])
            + (() if rank_K is None else (int(rank_K[k]),)) for k in range(n)]


def prompt_logprobs_object(tokenizer, prompt_ids: Sequence[int], entries: Sequence, top: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first: nothing before it) or {"id": {"logprob",
    "rank", "decoded_token"}} for the token itself and the ``top`` likeliest (ranks 1..top; an entry without a
    rank, from a backend that gives none, reads null)."""
    out = []
    for t, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(j): {"logprob": v, "rank": r + 1, "decoded_token": _token(tokenizer, j)[0]}
             for r, (j, v) in enumerate(e[1][:top])}
        d.setdefault(str(int(t)), {"logprob": e[0], "rank": e[2] if len(e) > 2 else None,
                                   "decoded_token": _token(tokenizer, t)[0]})
        out.append(d)
    return out


def _token(tokenizer, i: int) -> tuple:
    """(text, bytes) of one token: its bytes decoded on their own (a piece of a character reads U+FFFD; ``bytes``
    carries the exact ones, as OpenAI's API does)."""
    b = tokenizer.token_bytes(int(i))
    return b.decode("utf-8", errors="replace"), list(b)


def completion_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[tuple], top: int,
                        text_offset: int = 0) -> Optional[dict]:
    """``/v1/completions``' ``logprobs`` object: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    (``top_logprobs`` a {token: logprob} per token; None when the request asked for 0 of them). An entry None (an
    echoed prompt's first token: nothing before it) reads null in both lists."""
    tokens, offsets, pos = [], [], text_offset
    for i in token_ids:
        text, _ = _token(tokenizer, i)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else {_token(tokenizer, j)[0]: v for j, v in e[1][:top]}
                             for e in entries] if top > 0 else None, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[tuple], top: int) -> dict:
    """``/v1/chat/completions``' ``logprobs`` object: {"content": [{"token", "logprob", "bytes", "top_logprobs":
    [{"token", "logprob", "bytes"}, ...]}, ...]}."""
    content = []
    for i, (lp, tops) in zip(token_ids, entries):
        text, b = _token(tokenizer, i)
        alts = []
        for j, v in tops[:top]:
            t, bj = _token(tokenizer, j)
            alts.append({"token": t, "logprob": v, "bytes": bj})
        content.append({"token": text, "logprob": lp, "bytes": b, "top_logprobs": alts})
    return {"content": content}
