"""DSparkDrafter: speculators' DSpark drafter (0.9.0) in Flax NNX, and its decode cache.

The math is speculators' ``DFlashDraftModel`` backbone + ``DSparkDraftModel`` heads, reproduced to fp32 round-off:

* context: ``ctx = hidden_norm(taps @ fc)`` where taps are the target's hidden states at
  ``aux_hidden_state_layer_ids`` (concatenated features). The *same* ``ctx`` feeds every layer's ``k_proj`` /
  ``v_proj`` directly: it does **not** go through the layer's ``input_layernorm`` (only ``k_norm``, per head).
* block: ``[anchor, MASK x (block_size - 1)]`` embedded with the target's embedding, RoPE positions
  ``anchor_pos + k``. Queries come from the block only; keys/values are the context strictly before the anchor
  plus the block's own K/V (non-causal inside the block; causal for a ``sliding_attention`` layer unless
  ``sliding_window_non_causal``). Qwen3 layer: per-head q_norm / k_norm *before* NeoX RoPE, GQA, SwiGLU.
* output: ``norm`` then the target's lm_head -> base logits. Slot ``k`` predicts the token at ``anchor_pos+k+1``
  (``sample_from_anchor``).
* Markov head: slot ``k``'s bias uses ``prev_k`` = the token at ``anchor_pos + k`` (slot 0: the anchor itself;
  teacher-forced ground truth in training, the previous drafted token at inference).
* confidence head: ``proj([hid_k ; W1[prev_k]])`` (or ``proj(hid_k)``), a logit of P(slot k accepted | prefix).

The drafter never owns the target's embedding or lm_head: every entry point takes ``embed_VD`` / ``lm_head_DV``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSparkConfig
from jdspark.drafter import losses
from jdspark.drafter.layers import ConfidenceHead, DecoderLayer, MarkovHead, SpecLinear, attention_layout, concrete
from kimi.layers import Qwen3RMSNorm, fuse_projections, weights_to_bf16
from kimi.partitioning import NO_PARTITION, Partitioner

f32 = jnp.float32


# ====================================================================== cache
@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "length"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DrafterCache:
    """Context K/V of every draft layer, in the layout the block's attention reads without a copy (a [S, KVh, hd]
    cache cost a transposed copy of all of it on every draft): k: [L, B, KVh, hd, S_max] (k_norm'ed and RoPE'd
    at absolute positions), v: [L, B, KVh, S_max, hd]; length: int32 scalar = number of valid context slots
    (slots >= length are ignored)."""

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[-1]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def concrete_int(x) -> Optional[int]:
    v = concrete(x)
    return None if v is None else int(v)


def slot_positions(length, S: int, ring: bool):
    """The context position each of a cache's S slots holds after ``length`` positions (negative: none yet).

    Linear cache: slot s holds position s. Ring buffer (``context_window``): position p lives in slot p mod S, so
    slot s holds the latest p < length with p = s (mod S):  p(s) = length - 1 - ((length - 1 - s) mod S)."""
    s = jnp.arange(S, dtype=jnp.int32)
    if not ring:
        return s
    n = jnp.asarray(length, jnp.int32) - 1
    return n - jnp.mod(n - s, S)


def ring_rows(N: int, S: int, n_valid):
    """Which of N new rows a ring of S slots takes: the last min(N, S) up to n_valid (earlier ones would be
    overwritten by later ones of the same append). Returns (first row r0 (traced), rows taken R = min(N, S));
    rows r0 + i >= n_valid are dropped, so a ring never holds a position it has not committed."""
    R = min(N, S)
    r0 = jnp.clip(jnp.asarray(n_valid, jnp.int32) - R, 0, N - R) if N > R else jnp.int32(0)
    return r0, R



# ====================================================================== the drafter
class DSparkDrafter(nnx.Module):
    """speculators' DSpark drafter. ``target`` (optional) is only used to check hidden_size / vocab / tap ids."""

    def __init__(self, cfg: DSparkConfig, target: Any = None, *, rngs: nnx.Rngs, param_dtype=None):
        if not isinstance(cfg, DSparkConfig):
            raise ValueError(f"cfg: expected a DSparkConfig, got {type(cfg).__name__}")
        cfg.check_buildable()
        check_target(cfg, target)
        dtype = jnp.dtype(param_dtype) if param_dtype is not None else cfg.dtype
        D = cfg.hidden_size
        self.config = cfg
        self.fc = SpecLinear(cfg.num_taps * D, D, rngs=rngs, dtype=dtype)
        self.hidden_norm = Qwen3RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.markov_head = MarkovHead(cfg, rngs=rngs, dtype=dtype) if cfg.markov_rank > 0 else None
        if cfg.enable_confidence_head:
            din = D + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(din, rngs=rngs, dtype=dtype)
        else:
            self.confidence_head = None
        self.partition: Partitioner = NO_PARTITION

    def set_partitioner(self, partition: Partitioner):
        """Install a sharding plan (``sharding.shard_model`` does, after placing the parameters; GSPMD does the
        rest); ``NO_PARTITION`` removes it."""
        self.partition = partition

    @property
    def dtype(self):
        """The activation (and context cache) dtype: the parameters' dtype as built. Read from a norm, which the
        bf16 serving copy (``with_serving_layout``) leaves as it is: its bf16 matmul weights still take and give
        fp32 activations (kimi/ops/linear.py), and a bf16 cache would cost XLA:CPU a convert of the whole cache on
        every append."""
        return self.norm.scale.dtype

    # ------------------------------------------------------------------ shared pieces
    def context(self, taps_BTX):
        """ctx = hidden_norm(taps @ fc): [B, T, n_taps * D] -> [B, T, D]."""
        X = taps_BTX.shape[-1]
        if X != self.fc.kernel.shape[0]:
            raise ValueError(f"taps: expected {self.fc.kernel.shape[0]} features "
                             f"({self.config.num_taps} taps x hidden {self.config.hidden_size}), got {X}")
        return self.hidden_norm(self.fc(taps_BTX))

    def _context_kv(self, ctx_BSD, pos_BS):
        ks, vs = zip(*[layer.self_attn.kv(ctx_BSD, pos_BS) for layer in self.layers])
        return jnp.stack(ks), jnp.stack(vs)  # [L, B, S, KVh, hd]

    def _block_masks(self, ctx_full_BS, ctx_slide_BS):
        G = self.config.block_size
        causal = jnp.tril(jnp.ones((G, G), bool))
        full = jnp.ones((G, G), bool)
        return [(ctx_slide_BS if layer.sliding else ctx_full_BS, causal if layer.causal else full)
                for layer in self.layers]

    def _run_layers(self, x_BGD, pos_BG, k_ctx, v_ctx, masks):
        for i, layer in enumerate(self.layers):
            ctx_mask, blk_mask = masks[i]
            x_BGD = layer(x_BGD, pos_BG, k_ctx[i], v_ctx[i], ctx_mask, blk_mask)
        return self.norm(x_BGD)

    def _logits(self, hid, lm_head_DV):
        if lm_head_DV.shape[0] != self.config.hidden_size or lm_head_DV.shape[1] != self.config.draft_vocab_size:
            raise ValueError(f"lm_head_DV: expected shape ({self.config.hidden_size}, {self.config.draft_vocab_size})"
                             f", got {tuple(lm_head_DV.shape)}")
        return jnp.matmul(hid.astype(lm_head_DV.dtype), lm_head_DV, preferred_element_type=f32)

    def _embed(self, ids, embed_VD):
        if embed_VD.shape[0] != self.config.vocab_size or embed_VD.shape[1] != self.config.hidden_size:
            raise ValueError(f"embed_VD: expected shape ({self.config.vocab_size}, {self.config.hidden_size}), "
                             f"got {tuple(embed_VD.shape)}")
        return jnp.take(embed_VD, ids, axis=0).astype(self.dtype)

    # ------------------------------------------------------------------ decode cache
    @property
    def ring(self) -> bool:
        """Whether the context cache is a ring buffer of ``config.context_window`` slots."""
        return self.config.context_window is not None

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> DrafterCache:
        """Context K/V for a stream of up to ``max_len`` positions: max_len slots, or with ``context_window`` W a
        ring of min(W, max_len) slots (memory and the draft's attention stop growing with the context)."""
        cfg = self.config
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"init_cache: batch_size and max_len must be positive, got {batch_size}, {max_len}")
        if self.ring:
            max_len = min(max_len, cfg.context_window)
        L, KVh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        dt = jnp.dtype(dtype) if dtype is not None else self.dtype
        return DrafterCache(jnp.zeros((L, batch_size, KVh, hd, max_len), dt),
                            jnp.zeros((L, batch_size, KVh, max_len, hd), dt), jnp.zeros((), jnp.int32))

    def append_context(self, cache: DrafterCache, taps_BNX, n_valid, start_pos=None) -> DrafterCache:
        """Write context K/V of N (static) new positions at slots [length, length + N) and advance length by
        n_valid (traced OK). Rows >= n_valid are written but stay masked, and the next append overwrites them.
        RoPE positions are start_pos + i (default: the slot index, i.e. cache.length + i; [B] allowed).
        The caller guarantees length + N <= max_len (checked here when the values are concrete).
        Ring buffer (``context_window``): only the last min(N, S) valid rows are projected and written, position
        p to slot p mod S (``ring_rows``); rows >= n_valid are dropped, and any length fits."""
        B, N, _ = taps_BNX.shape
        if B != cache.batch_size:
            raise ValueError(f"taps_BNX: batch {B} does not match the cache's batch {cache.batch_size}")
        length = cache.length
        cl, nv = concrete_int(length), concrete_int(n_valid)
        if nv is not None and not 0 <= nv <= N:
            raise ValueError(f"n_valid: expected 0..{N} (the number of rows passed), got {nv}")
        if not self.ring and cl is not None and cl + N > cache.max_len:
            raise ValueError(f"append_context: {cl} cached + {N} new positions exceed the cache's max_len "
                             f"{cache.max_len}")
        if start_pos is None:
            start_pos = length
        at = length.astype(jnp.int32)
        r0, R = ring_rows(N, cache.max_len, n_valid) if self.ring else (jnp.int32(0), N)
        if R < N:
            taps_BNX = jax.lax.dynamic_slice_in_dim(taps_BNX, r0, R, axis=1)
        pos = jnp.asarray(start_pos, jnp.int32).reshape(-1, 1) + r0 + jnp.arange(R, dtype=jnp.int32)
        pos = jnp.broadcast_to(pos, (B, R))
        k, v = attention_layout(*self._context_kv(self.context(taps_BNX), pos))
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        n_new = (length + jnp.asarray(n_valid, jnp.int32)).astype(jnp.int32)
        if not self.ring:
            k = jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0, at))
            v = jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, at, 0))
            return DrafterCache(k, v, n_new)
        S = cache.max_len
        rows = r0 + jnp.arange(R, dtype=jnp.int32)
        slot = jnp.where(rows < jnp.asarray(n_valid, jnp.int32), jnp.mod(at + rows, S), S)  # S: dropped
        k = cache.k.at[..., slot].set(k, mode="drop")
        v = cache.v.at[:, :, :, slot, :].set(v, mode="drop")
        return DrafterCache(k, v, n_new)

    def draft_logits(self, cache: DrafterCache, anchor_token_B, anchor_pos, embed_VD, lm_head_DV,
                     n_slots: Optional[int] = None):
        """One parallel block pass. Returns (base_logits [B, n, Vd] fp32, hidden [B, n, D] after the final norm)
        of the block's first n = ``n_slots`` slots (static; default all G).

        The layers always run the whole block (its slots attend to one another), so slot k's hidden state, and
        the draft read from it, do not depend on n; only the vocabulary projection of the slots no step will
        verify is skipped, and ``draft_block`` runs the sequential head over the n slots only (together ~a fifth
        of a width-2 serving step at 16 rows, docs/performance.md).

        Block = [anchor, MASK x (G-1)] at RoPE positions anchor_pos + k (scalar or [B]; None -> cache.length).
        Context = the positions p < cache.length the slots hold (``slot_positions``; and p >= length -
        sliding_window for sliding layers): all of them, or the last ``context_window`` from a ring buffer."""
        cfg = self.config
        G = cfg.block_size
        anchor = jnp.asarray(anchor_token_B, jnp.int32).reshape(-1)
        B = anchor.shape[0]
        if B != cache.batch_size:
            raise ValueError(f"anchor_token_B: batch {B} does not match the cache's batch {cache.batch_size}")
        if anchor_pos is None:
            anchor_pos = cache.length
        ids = jnp.concatenate([anchor[:, None], jnp.full((B, G - 1), cfg.mask_token_id, jnp.int32)], axis=1)
        x = self._embed(ids, embed_VD)
        pos = jnp.broadcast_to(jnp.asarray(anchor_pos, jnp.int32).reshape(-1, 1) + jnp.arange(G), (B, G))
        p_S = slot_positions(cache.length, cache.max_len, self.ring)
        full = jnp.broadcast_to((p_S >= 0) & (p_S < cache.length), (B, cache.max_len))
        slide = full & (p_S >= cache.length - (cfg.sliding_window or 0))
        hid = self._run_layers(x, pos, cache.k, cache.v, self._block_masks(full, slide))
        if n_slots is not None:
            if not 1 <= int(n_slots) <= G:
                raise ValueError(f"n_slots: expected 1..{G} (the block size), got {n_slots}")
            hid = hid[:, :int(n_slots)]
        return self._logits(hid, lm_head_DV), hid

    # ------------------------------------------------------------------ heads
    def init_markov_state(self, batch_size: int):
        """The rnn head's recurrent state (zeros [B, r]); vanilla/gated heads carry it through unchanged."""
        return jnp.zeros((batch_size, max(self.config.markov_rank, 1)), self.dtype)

    def markov_bias(self, prev_token_B, hidden_BD, state):
        """Slot bias from the previous token (slot 0: the anchor). Returns (bias [B, Vd], new_state)."""
        if self.markov_head is None:
            return jnp.zeros((hidden_BD.shape[0], self.config.draft_vocab_size), f32), state
        e = self.markov_head.prev_embeddings(jnp.asarray(prev_token_B, jnp.int32))
        return self.markov_head.step(e, hidden_BD, state)

    def confidence_logit(self, hidden_BD, prev_token_B):
        """Confidence logit [B] for a slot: proj([hid ; W1[prev]]) (or proj(hid)). None without the head."""
        if self.confidence_head is None:
            return None
        f = hidden_BD
        if self.config.confidence_head_with_markov:
            e = self.markov_head.prev_embeddings(jnp.asarray(prev_token_B, jnp.int32))
            f = jnp.concatenate([hidden_BD, e.astype(hidden_BD.dtype)], axis=-1)
        return self.confidence_head(f).astype(f32)

    def decode_block(self, base_logits_BGV, hidden_BGD, anchor_token_B, pick, keys_G=None, confidence: bool = True,
                     automaton=None):
        """The sequential Markov-head decode of one block (a ``lax.scan`` over its slots), used by generation and
        the tests alike: slot k's corrected logits z_k = base_k + bias(prev_k, hidden_k) with prev_0 = the anchor
        and prev_{k+1} = the token ``pick(key_k, z_k)`` returns (with an auxiliary output of its own).
        ``automaton`` (constrained decoding, ``jdspark.grammar``; None: none): (q_B int32 the state after the
        anchor, -1 unconstrained; next_QC int32 [Q, C]; class_V int32 [Vd], the table by token classes): slot k's
        z_k keeps only the tokens next[q_k] allows (-inf elsewhere) and q_{k+1} = next[q_k, prev_{k+1}], so every
        draft stays in the language.
        Returns (tokens [B, G], z [B, G, Vd] fp32 (masked), aux [B, G, ...], confidence logits [B, G]: zeros
        without the head or with ``confidence=False``)."""
        G = base_logits_BGV.shape[1]
        anchor = jnp.asarray(anchor_token_B, jnp.int32)
        q0 = jnp.full(anchor.shape, -1, jnp.int32) if automaton is None else jnp.asarray(automaton[0], jnp.int32)

        def slot(carry, xs):
            prev_B, mstate, q_B = carry
            base_BV, hid_BD, key = xs
            bias, mstate = self.markov_bias(prev_B, hid_BD, mstate)
            z = base_BV + bias.astype(f32)
            if automaton is not None:
                next_QC, class_V = automaton[1], automaton[2]
                row = jnp.take(next_QC[jnp.maximum(q_B, 0)], class_V, axis=1)  # [B, Vd]
                z = jnp.where((q_B[:, None] < 0) | (row >= 0), z, -jnp.inf)
            c = self.confidence_logit(hid_BD, prev_B) if confidence else None  # only truncation reads it
            c = jnp.zeros(prev_B.shape, f32) if c is None else c
            tok, aux = pick(key, z)
            if automaton is not None:
                q_B = jnp.where(q_B >= 0, jnp.take_along_axis(row, tok[:, None], axis=1)[:, 0], -1)
            return (tok, mstate, q_B), (tok, z, aux, c)

        xs = (jnp.swapaxes(base_logits_BGV, 0, 1), jnp.swapaxes(hidden_BGD, 0, 1),
              jnp.zeros((G,), jnp.int32) if keys_G is None else keys_G)
        _, out = jax.lax.scan(slot, (anchor, self.init_markov_state(anchor.shape[0]), q0), xs)
        return jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1), out)

    def greedy_block(self, base_logits_BGV, hidden_BGD, anchor_token_B):
        """Greedy ``decode_block``: prev_{k+1} = argmax of slot k's corrected logits. Returns (tokens [B, G],
        corrected logits [B, G, Vd], confidence logits [B, G] or None)."""
        toks, z, _, conf = self.decode_block(base_logits_BGV, hidden_BGD, anchor_token_B,
                                             lambda _, z: (jnp.argmax(z, axis=-1).astype(jnp.int32), ()))
        return toks, z, conf if self.confidence_head is not None else None

    # ------------------------------------------------------------------ training forward
    def training_outputs(self, taps_1TX, input_ids_1T, anchors_N, embed_VD, lm_head_DV, *,
                         document_ids_1T=None, position_ids_1T=None) -> dict:
        """speculators' DSpark training forward (batch 1, packed) for explicit anchors.

        Returns a dict: hidden [N, G, D], base_logits / logits (Markov-corrected) [N, G, Vd] fp32,
        confidence_logits [N, G] (or None), prev_tokens [N, G], block_indices [N, G]."""
        cfg = self.config
        G = cfg.block_size
        T = taps_1TX.shape[1]
        anchors = jnp.asarray(anchors_N, jnp.int32)
        a = concrete(anchors)
        if a is not None and a.size and (a.min() < 0 or a.max() + G > T):
            raise ValueError(f"anchors_N: every anchor needs anchor + block_size <= T={T}, got {a.tolist()}")
        ids_T = jnp.asarray(input_ids_1T, jnp.int32)[0]
        pos_T = jnp.arange(T, dtype=jnp.int32) if position_ids_1T is None else \
            jnp.asarray(position_ids_1T, jnp.int32)[0]
        doc_T = jnp.zeros((T,), jnp.int32) if document_ids_1T is None else jnp.asarray(document_ids_1T, jnp.int32)[0]

        k_ctx, v_ctx = attention_layout(*self._context_kv(self.context(taps_1TX), pos_T[None]))
        idx = anchors[:, None] + jnp.arange(G, dtype=jnp.int32)  # [N, G]
        blk_ids = jnp.full(idx.shape, cfg.mask_token_id, jnp.int32).at[:, 0].set(ids_T[anchors])
        x = self._embed(blk_ids, embed_VD)
        blk_pos = pos_T[anchors][:, None] + jnp.arange(G, dtype=jnp.int32)
        t = jnp.arange(T)
        a_doc = doc_T[anchors]
        full = (t[None] < anchors[:, None]) & (doc_T[None] == a_doc[:, None]) & (a_doc != -1)[:, None]
        if cfg.context_window is not None:  # what serving's ring buffer keeps: the last context_window positions
            full = full & (t[None] >= anchors[:, None] - cfg.context_window)
        slide = full & (t[None] >= anchors[:, None] - (cfg.sliding_window or 0))
        hid = self._run_layers(x, blk_pos, k_ctx, v_ctx, self._block_masks(full, slide))
        base = self._logits(hid, lm_head_DV)

        block_tokens = ids_T[idx]
        prev = block_tokens if cfg.sample_from_anchor else \
            jnp.concatenate([block_tokens[:, :1], block_tokens[:, :-1]], axis=1)
        logits, conf, e = base, None, None
        if self.markov_head is not None:
            e = self.markov_head.prev_embeddings(prev)
            logits = base + self.markov_head.block(e, hid).astype(f32)
        if self.confidence_head is not None:
            f = jnp.concatenate([hid, e.astype(hid.dtype)], -1) if cfg.confidence_head_with_markov else hid
            conf = self.confidence_head(f).astype(f32)
        return dict(hidden=hid, base_logits=base, logits=logits, confidence_logits=conf, prev_tokens=prev,
                    block_indices=idx)

    def training_loss(self, *args, **kwargs):
        return losses.training_loss(self, *args, **kwargs)


# ====================================================================== target compatibility
def check_target(cfg: DSparkConfig, target: Any) -> None:
    """ValueError unless the target's hidden_size / vocab_size / depth fit the drafter config (None: no check)."""
    if target is None:
        return
    tc = getattr(target, "config", target)
    problems = []
    h = getattr(tc, "hidden_size", None)
    if h is not None and h != cfg.hidden_size:
        problems.append(f"hidden_size: drafter {cfg.hidden_size} != target {h}")
    v = getattr(tc, "vocab_size", None)
    if v is not None and v != cfg.vocab_size:
        problems.append(f"vocab_size: drafter {cfg.vocab_size} != target {v}")
    n = getattr(tc, "num_hidden_layers", None)
    if n is not None and max(cfg.aux_hidden_state_layer_ids) > n:
        problems.append(f"aux_hidden_state_layer_ids: {list(cfg.aux_hidden_state_layer_ids)} must be within "
                        f"[0, {n}] for a {n}-layer target")
    if problems:
        raise ValueError("drafter does not fit the target: " + "; ".join(problems))



# ====================================================================== serving
def with_context_window(drafter: DSparkDrafter, window: Optional[int]) -> DSparkDrafter:
    """The same drafter (the same weight arrays) serving with ``context_window = window``: a ring buffer of the
    last ``window`` context positions, or the whole context for None."""
    cfg = drafter.config.replace(context_window=window)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))
    out = nnx.merge(graphdef, nnx.state(drafter))
    out.set_partitioner(drafter.partition)
    return out


def with_layers(drafter: DSparkDrafter, num_layers: int) -> DSparkDrafter:
    """The drafter deepened to ``num_layers`` decoder layers, computing exactly what it computed before: each new
    layer i >= L is a copy of layer L - 1 whose two residual outputs (attention ``o_proj``, MLP ``down_proj``) are
    zero, so x + attn(.) + mlp(.) = x until training moves them (function-preserving growth). Its other weights
    start from a trained layer's rather than at random, so training has a useful direction from the first step. The
    same DSparkDrafter class with ``num_hidden_layers = num_layers``; every other weight is shared with ``drafter``."""
    L = drafter.config.num_hidden_layers
    if num_layers < L:
        raise ValueError(f"num_layers: expected >= the drafter's {L} layers, got {num_layers}")
    lt = drafter.config.layer_types
    cfg = drafter.config.replace(num_hidden_layers=int(num_layers),
                                 layer_types=None if lt is None else tuple(lt) + (lt[-1],) * (num_layers - L))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))
    out = nnx.merge(graphdef, state)  # abstract arrays; every one is replaced below
    nnx.update(out, nnx.state(drafter))
    last = nnx.state(drafter.layers[L - 1])
    for i in range(L, num_layers):
        nnx.update(out.layers[i], jax.tree.map(jnp.array, last))
        for proj in (out.layers[i].self_attn.o_proj, out.layers[i].mlp.down_proj):
            proj.kernel[...] = jnp.zeros_like(proj.kernel[...])
            if getattr(proj, "bias", None) is not None:
                proj.bias[...] = jnp.zeros_like(proj.bias[...])
    out.set_partitioner(drafter.partition)
    return out


def with_taps(drafter: DSparkDrafter, taps) -> DSparkDrafter:
    """The drafter reading the target's hidden states at ``taps`` (a superset of its own tap ids, in any order),
    computing exactly what it computed before: ``ctx = hidden_norm(taps @ fc)`` and the norm comes after ``fc``, so
    each kept tap's rows of ``fc``'s kernel [n_taps * D, D] move to that tap's new place and each new tap's D rows
    start at zero (function-preserving growth, like ``with_layers``; training moves them: their gradient is the
    new tap's features against the context's). Every other weight is shared with ``drafter``."""
    old = tuple(drafter.config.aux_hidden_state_layer_ids)
    new = tuple(int(t) for t in taps)
    missing = [t for t in old if t not in new]
    if missing:
        raise ValueError(f"taps: expected every tap of the drafter's {list(old)} (taps can be added, not dropped), "
                         f"got {list(new)}, which lacks {missing}")
    cfg = drafter.config.replace(aux_hidden_state_layer_ids=new)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))
    out = nnx.merge(graphdef, state)  # abstract arrays; every one is replaced below
    nnx.update(out, nnx.state(drafter, nnx.Not(nnx.PathContains("fc"))))
    D = cfg.hidden_size
    k_XD = drafter.fc.kernel[...]
    rows = [k_XD[old.index(t) * D:(old.index(t) + 1) * D] if t in old else jnp.zeros((D, k_XD.shape[1]), k_XD.dtype)
            for t in new]
    out.fc.kernel = nnx.Param(jnp.concatenate(rows, 0))
    if getattr(drafter.fc, "bias", None) is not None:
        out.fc.bias = nnx.Param(jnp.array(drafter.fc.bias[...]))
    out.set_partitioner(drafter.partition)
    return out


def ring_from_linear(cache: DrafterCache, window: int) -> DrafterCache:
    """The ring-buffer context of ``window`` slots (``with_context_window``'s layout) holding what a linear cache
    holds of the last ``window`` positions: slot s takes position p(s) = n - 1 - ((n - 1 - s) mod S), n = the
    cache's length, S = min(window, its slots) (``slot_positions``). The K/V are the same values (RoPE'd at
    absolute positions either way), so a long prompt prefilled once serves every window (scripts/bench_long.py)
    instead of once per window. Slots with p(s) < 0 (a stream shorter than the ring) hold position 0: masked."""
    if window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    S = min(int(window), cache.max_len)
    idx = jnp.maximum(slot_positions(cache.length, S, True), 0)
    return DrafterCache(jnp.take(cache.k, idx, axis=-1), jnp.take(cache.v, idx, axis=3), cache.length)


def with_serving_layout(drafter: DSparkDrafter, serving_dtype: str = "float32") -> DSparkDrafter:
    """The drafter as a generation serves it, made once per set of weights (``jdspark.serving_copy.serving_pair``): the
    projections that read the same input side by side (``kimi.layers.project_many``: q|k|v and k|v of each layer's
    attention, gate|up of its MLP), the matmul weights in ``serving_dtype`` (the target's). Same weights, same
    results up to float summation order (and bf16 rounding of the matmul inputs)."""
    drafter = nnx.merge(*nnx.split(drafter))
    for layer in drafter.layers:
        fuse_projections(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        fuse_projections(layer.self_attn, ("k_proj", "v_proj"))
        fuse_projections(layer.mlp, ("gate_proj", "up_proj"))
    if serving_dtype == "bfloat16":
        weights_to_bf16(drafter)
    return drafter

