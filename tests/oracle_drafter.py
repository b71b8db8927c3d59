"""A drafter that is right a known fraction of the time, for lossless tests that must see every accepted length.

``OracleDrafter`` is a ``jdspark.DSparkDrafter`` whose block, for the anchor at position n, drafts the reference
continuation ref[n+1 .. n+G] (the target's own greedy tokens, computed beforehand by an independent decoder) with
slot ``cut[n]`` replaced by a token that differs from the reference. Under a correct greedy step exactly cut[n]
drafts are accepted and the bonus is ref[n+1+cut[n]]; the next anchor sits at n+cut[n]+1. ``schedule`` picks the
cuts along the positions a correct generation visits, cycling through every length 0..G, so the acceptance
histogram of a lossless run is known in advance and holds every length. A commit or acceptance bug moves the
generation off the scheduled positions: the tokens and the histogram both stop matching.

With ``verify_cuts`` it also drives confidence-threshold truncation: the confidence logit of slot k is +20 for
k < verify_cuts[n] and -20 from there on, so for any threshold in (0, 1) the step verifies exactly verify_cuts[n]
drafts (survival is 1 up to there, ~2e-9 after), and accepts min(cut[n], verify_cuts[n]).

The drafter's own layers are not run (``draft_logits`` is replaced); its cache, the context append, the Markov
slot loop (rank 0: no bias) and everything after drafting are the real code. The reference and the schedule are
static (Python tuples, part of the graph): one compiled program per (target, reference).

Use in any generate test (plain, serving copy, bf16, Pallas, sharded):
    ref = greedy_reference(target, prompt, n_new + G + 1)          # or transformers' tokens, or plain generate's
    drafter, want = oracle_drafter(target, prompt, ref, n_new)      # want: the expected step lengths
    out = jdspark.generate(target, drafter, prompt, max_new_tokens=n_new, eos_token_id=-1)
    assert_histogram(out.stats, want)                               # and out.tokens == ref[:n_new]
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jdspark

CONF = 20.0  # |confidence logit|: sigmoid(20) rounds to 1 in fp32, sigmoid(-20) ~ 2e-9


class OracleDrafter(jdspark.DSparkDrafter):
    def __init__(self, cfg: jdspark.DSparkConfig, target, full_ids: Sequence[int], cuts: Sequence[int],
                 wrong: Sequence[int], verify_cuts: Optional[Sequence[int]] = None, *, rngs: nnx.Rngs,
                 scale: float = 30.0):
        if cfg.markov_rank != 0:
            raise ValueError("OracleDrafter: markov_rank must be 0 (its drafts come from the base logits only)")
        super().__init__(cfg, target, rngs=rngs)
        self.full_ids = tuple(int(t) for t in full_ids)  # prompt + reference continuation, by position
        self.cuts = tuple(int(c) for c in cuts)  # by anchor position: the slot drafted wrong (G = none)
        self.wrong = tuple(int(t) for t in wrong)  # by position: a token != full_ids[pos]
        self.verify_cuts = None if verify_cuts is None else tuple(int(c) for c in verify_cuts)
        self.scale = float(scale)

    def draft_logits(self, cache, anchor_token_B, anchor_pos, embed_VD, lm_head_DV, n_slots=None):
        cfg = self.config
        G, V, D = cfg.block_size, cfg.draft_vocab_size, cfg.hidden_size
        n_B = jnp.asarray(cache.length if anchor_pos is None else anchor_pos, jnp.int32).reshape(-1)
        B = jnp.asarray(anchor_token_B).reshape(-1).shape[0]
        n_B = jnp.broadcast_to(n_B, (B,))
        pos_BG = n_B[:, None] + 1 + jnp.arange(G)
        ref_BG = jnp.take(jnp.asarray(self.full_ids, jnp.int32), pos_BG, mode="clip")
        bad_BG = jnp.take(jnp.asarray(self.wrong, jnp.int32), pos_BG, mode="clip")
        cut_B1 = jnp.take(jnp.asarray(self.cuts, jnp.int32), n_B, mode="clip")[:, None]
        tok_BG = jnp.where(jnp.arange(G) == cut_B1, bad_BG, ref_BG)
        logits = self.scale * jax.nn.one_hot(tok_BG, V, dtype=jnp.float32)
        hid = jnp.zeros((B, G, D), self.dtype)
        if self.verify_cuts is not None:  # the confidence logit travels in hidden[..., 0] to confidence_logit
            vc_B1 = jnp.take(jnp.asarray(self.verify_cuts, jnp.int32), n_B, mode="clip")[:, None]
            conf = jnp.where(jnp.arange(G) < vc_B1, CONF, -CONF).astype(self.dtype)
            hid = hid.at[..., 0].set(conf)
        n = G if n_slots is None else int(n_slots)  # the first n slots, as the drafter's own (a narrow step)
        return logits[:, :n], hid[:, :n]

    def confidence_logit(self, hidden_BD, prev_token_B):
        if self.verify_cuts is None:
            return super().confidence_logit(hidden_BD, prev_token_B)
        return hidden_BD[:, 0].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a lossless greedy generation with the oracle must report."""

    lengths: tuple  # accepted drafts per step, in step order
    verified: tuple  # drafts sent to verification per step
    block_size: int

    @property
    def histogram(self) -> np.ndarray:
        return np.bincount(np.asarray(self.lengths, int), minlength=self.block_size + 1)

    @property
    def accept_counts(self) -> np.ndarray:
        """GenStats.accept_counts: steps whose draft i was accepted."""
        m = np.asarray(self.lengths)[:, None]
        return (m > np.arange(self.block_size)).sum(0)


def greedy_reference(model, prompt, n: int) -> np.ndarray:
    """n greedy tokens by the model's own prefill + step decode (public methods, no generate loop, no serving
    copy): the independent decoder the oracle's reference comes from."""
    prompt = np.asarray(prompt, np.int32).reshape(1, -1)
    out = model.prefill(prompt, model.init_cache(1, prompt.shape[1] + n + 1))
    tok = int(np.argmax(np.asarray(out.logits)[0, -1]))
    toks, cache = [tok], out.cache
    for _ in range(n - 1):
        out = model.decode(np.asarray([tok], np.int32), cache)
        cache = out.cache
        tok = int(np.argmax(np.asarray(out.logits)[0]))
        toks.append(tok)
    return np.asarray(toks, np.int32)


def schedule(prompt_len: int, max_new: int, G: int, seed: int = 0, truncate: bool = False,
             num_drafts: Optional[int] = None):
    """(cuts, verify_cuts, Expected) along the anchor positions a correct greedy generation of max_new tokens
    visits. Cut lengths cycle through random permutations of 0..G (every length appears once per G+1 steps); with
    ``truncate`` each step also gets a verify count, cycling through 0..G independently of the cut.
    ``num_drafts``: the generation verifies at most that many drafts a step (``num_speculative_tokens``)."""
    rng = np.random.default_rng(seed)
    L = prompt_len + max_new + G + 2
    cuts = np.full(L, G, np.int64)
    vcuts = np.full(L, G, np.int64)
    c_cycle, v_cycle = [], []
    lengths, verified = [], []
    pos, n_out = prompt_len, 1  # the prefill emits the first token; it is the first anchor, at position P
    while n_out < max_new:
        if not c_cycle:
            c_cycle = list(rng.permutation(G + 1))
        if not v_cycle:
            v_cycle = list(rng.permutation(G + 1)) if truncate else [G]
        c, v = int(c_cycle.pop()), int(v_cycle.pop())
        cuts[pos], vcuts[pos] = c, v
        v = v if num_drafts is None else min(v, num_drafts)
        m = min(c, v)
        lengths.append(min(m, max_new - n_out))  # drafts accepted past max_new are not the output's: not counted
        verified.append(v)
        pos += m + 1
        n_out += m + 1
    return cuts, (vcuts if truncate else None), Expected(tuple(lengths), tuple(verified), G)


def oracle_drafter(target, prompt, reference, max_new: int, *, block_size: int = 4, seed: int = 0,
                   truncate: bool = False, config: Optional[jdspark.DSparkConfig] = None,
                   num_drafts: Optional[int] = None):
    """An OracleDrafter for ``target`` generating ``max_new`` tokens after ``prompt`` whose greedy continuation
    is ``reference`` (at least max_new + block_size + 1 tokens: the last block drafts past the end). ``config``:
    a DSparkConfig to start from (e.g. a sharded test's); markov_rank is set to 0 and the confidence head on;
    ``num_drafts``: the Expected of a generation with ``num_speculative_tokens`` that many.
    Returns (drafter, Expected)."""
    prompt = np.asarray(prompt).reshape(-1)
    reference = np.asarray(reference).reshape(-1)
    tc = target.config
    if config is None:
        config = jdspark.DSparkConfig.for_target(tc, block_size=block_size)
    config = dataclasses.replace(config, markov_rank=0, enable_confidence_head=True,
                                 confidence_head_with_markov=False)
    G = config.block_size
    if len(reference) < max_new + G + 1:
        raise ValueError(f"reference: need {max_new + G + 1} tokens, got {len(reference)}")
    full = np.concatenate([prompt, reference])
    cuts, vcuts, want = schedule(len(prompt), max_new, G, seed, truncate, num_drafts)
    rng = np.random.default_rng(seed + 1)
    V = tc.vocab_size
    wrong = (full + 1 + rng.integers(0, V - 1, full.shape)) % V  # never the reference token
    d = OracleDrafter(config, target, full, cuts[:len(full)], wrong,
                      None if vcuts is None else vcuts[:len(full)], rngs=nnx.Rngs(seed))
    return d, want


def histogram(stats, block_size: int) -> np.ndarray:
    """Steps per accepted length 0..G, from GenStats (accept_counts[i] = steps with accepted length > i)."""
    s = int(stats.target_steps)
    c = np.concatenate([[s], np.asarray(stats.accept_counts), [0]])
    assert c.shape[0] == block_size + 2, c
    return c[:-1] - c[1:]


def assert_histogram(stats, want: Expected, label: str = "", longest: Optional[int] = None):
    """The run's acceptance is exactly the scheduled one, and every accepted length 0..``longest`` (default G)
    occurred."""
    h = histogram(stats, want.block_size)
    print(f"acceptance histogram{' ' + label if label else ''} (steps with 0..{want.block_size} accepted): "
          f"{h.tolist()}")
    np.testing.assert_array_equal(np.asarray(stats.accept_counts), want.accept_counts, err_msg=label)
    assert int(stats.target_steps) == len(want.lengths), label
    assert int(stats.accepted) == sum(want.lengths), label
    assert int(stats.drafted) == sum(want.verified), label
    top = want.block_size if longest is None else longest
    assert (h[:top + 1] > 0).all(), f"{label}: some accepted length 0..{top} never occurred: {h.tolist()}"
