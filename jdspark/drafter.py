"""DSparkDrafter: speculators' DSpark drafter (0.9.0) in Flax NNX, plus its decode cache, losses and checkpoint I/O.

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
Parameters are named like speculators' state_dict (``layers[i].self_attn.q_proj.kernel`` <->
``layers.{i}.self_attn.q_proj.weight``, transposed); norms hold ``scale``, the Markov W1 an ``embedding``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.config import DSparkConfig
from kimi.layers import fuse_projections, project_many, weights_to_bf16
from kimi.ops import linear as linear_ops

f32 = jnp.float32
_LOSS_REDUCTION_EPS = 1e-5  # speculators losses/utils.py
_CONF_EPS = 1e-8  # speculators dspark/metrics.py
_NLA_EPS = 1e-5


# ====================================================================== pure math
def rms_norm(x, weight, eps: float):
    """Qwen3RMSNorm: variance in fp32, cast back to the input dtype *before* the weight multiply."""
    xf = x.astype(f32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope(x_SHK, pos_S, theta: float):
    """NeoX-style RoPE (Qwen3 'default'): x [..., S, H, K], pos [..., S] broadcastable to x's leading axes."""
    k = x_SHK.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, k, 2, dtype=f32) / k))
    ang = jnp.asarray(pos_S).astype(f32)[..., None] * inv
    emb = jnp.concatenate([ang, ang], axis=-1)
    cos = jnp.cos(emb).astype(x_SHK.dtype)[..., None, :]
    sin = jnp.sin(emb).astype(x_SHK.dtype)[..., None, :]
    x1, x2 = x_SHK[..., : k // 2], x_SHK[..., k // 2:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_SHK * cos + rot * sin


def _attend(q_BGKRH, kT_ctx, v_ctx, ctx_mask_BS, k_blk_BGKH, v_blk_BGKH, blk_mask_GG, scale: float):
    """Softmax attention of block queries over [context ; own block].

    q: [B, G, KVh, R, hd] (query head h = kv_head * R + r, i.e. torch's repeat_kv order). Context K/V in the
    layout the two matmuls read without a copy (see ``DrafterCache``): kT [Bc, KVh, hd, S], v [Bc, KVh, S, hd],
    with Bc = B, or Bc = 1 shared by every block (training). ctx_mask: [B, S]."""
    B = q_BGKRH.shape[0]
    shared = kT_ctx.shape[0] == 1 and B != 1
    q = jnp.transpose(q_BGKRH, (0, 2, 3, 1, 4))  # [B, KVh, R, G, hd]: the order in which no context K/V is copied
    if shared:
        s_ctx = jnp.einsum("bkrgh,khs->bkrgs", q, kT_ctx[0], preferred_element_type=f32)
    else:
        s_ctx = jnp.einsum("bkrgh,bkhs->bkrgs", q, kT_ctx, preferred_element_type=f32)
    s_blk = jnp.einsum("bkrgh,bjkh->bkrgj", q, k_blk_BGKH, preferred_element_type=f32)
    s = jnp.concatenate([s_ctx, s_blk], axis=-1) * scale
    G, S = q_BGKRH.shape[1], kT_ctx.shape[-1]
    mask = jnp.concatenate([
        jnp.broadcast_to(ctx_mask_BS[:, None, None, None, :], (B, 1, 1, G, S)),
        jnp.broadcast_to(blk_mask_GG[None, None, None], (B, 1, 1, G, G)),
    ], axis=-1)
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_blk_BGKH.dtype)
    p_ctx, p_blk = p[..., :S], p[..., S:]
    if shared:
        out = jnp.einsum("bkrgs,ksh->bkrgh", p_ctx, v_ctx[0])
    else:
        out = jnp.einsum("bkrgs,bksh->bkrgh", p_ctx, v_ctx)
    out = out + jnp.einsum("bkrgj,bjkh->bkrgh", p_blk, v_blk_BGKH)
    return jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, G, KVh, R, hd]


def _attention_layout(k_LBSKH, v_LBSKH):
    """Context K/V [L, B, S, KVh, hd] (as projected) -> (kT [L, B, KVh, hd, S], v [L, B, KVh, S, hd])."""
    return jnp.transpose(k_LBSKH, (0, 1, 3, 4, 2)), jnp.transpose(v_LBSKH, (0, 1, 3, 2, 4))


# ====================================================================== small modules
def _concrete(x) -> Optional[np.ndarray]:
    """x as a NumPy array, or None when it is a tracer (inside jit / grad / eval_shape)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
            jax.errors.TracerIntegerConversionError):
        return None


def _random(key, shape, kind: str, scale: float):
    """N(0, scale^2) or U(-scale, scale) draws. With a concrete key they come from NumPy seeded by the key's bits
    (no XLA compile per parameter shape: building a drafter eagerly takes milliseconds, not seconds); under a
    trace (nnx.jit / eval_shape) from jax.random."""
    bits = _concrete(jax.random.key_data(key))
    if bits is not None:
        g = np.random.default_rng(bits.astype(np.uint64).ravel().tolist())
        x = g.standard_normal(shape, np.float32) if kind == "normal" else g.uniform(-1.0, 1.0, shape)
        return jnp.asarray(np.float32(scale) * x.astype(np.float32))
    if kind == "normal":
        return scale * jax.random.normal(key, shape, f32)
    return jax.random.uniform(key, shape, f32, -scale, scale)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (torch's weight transposed)."""

    def __init__(self, din: int, dout: int, *, use_bias: bool = False, init: str = "normal", rngs: nnx.Rngs,
                 dtype=f32):
        key = rngs.params()
        if init == "normal":  # speculators post_init: N(0, 0.02) weights, zero bias
            w = _random(key, (din, dout), "normal", 0.02)
            b = jnp.zeros((dout,), f32)
        else:  # torch nn.Linear default: U(+-1/sqrt(fan_in)) for weight and bias
            bound = 1.0 / math.sqrt(din)
            kw, kb = jax.random.split(key)
            w = _random(kw, (din, dout), "uniform", bound)
            b = _random(kb, (dout,), "uniform", bound)
        self.kernel = nnx.Param(w.astype(dtype))
        self.bias = nnx.Param(b.astype(dtype)) if use_bias else None

    def __call__(self, x):
        k = self.kernel[...]
        y = linear_ops.matmul(x if k.dtype == jnp.bfloat16 else x.astype(k.dtype), k)  # bf16: the serving copy
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=f32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
    def __init__(self, num: int, dim: int, *, std: float, rngs: nnx.Rngs, dtype=f32):
        self.embedding = nnx.Param(_random(rngs.params(), (num, dim), "normal", std).astype(dtype))

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0)


class Attention(nnx.Module):
    """speculators' Qwen3DFlashAttention: block queries, [context ; block] keys/values."""

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype):
        D, H, KV, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(use_bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        self.q_proj = Linear(D, H * hd, **kw)
        self.k_proj = Linear(D, KV * hd, **kw)
        self.v_proj = Linear(D, KV * hd, **kw)
        self.o_proj = Linear(H * hd, D, **kw)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, hd
        self.rope_theta = cfg.rope_theta

    def kv(self, x_BSD, pos_BS):
        """Keys (k_norm'ed, RoPE'd at pos) and values of rows x: [B, S, KVh, hd] each."""
        return self._kv(*project_many(self, x_BSD, ("k_proj", "v_proj")), pos_BS)

    def _kv(self, k_BSP, v_BSP, pos_BS):
        B, S, _ = k_BSP.shape
        k = self.k_norm(k_BSP.reshape(B, S, self.num_kv_heads, self.head_dim))
        return rope(k, pos_BS, self.rope_theta), v_BSP.reshape(B, S, self.num_kv_heads, self.head_dim)

    def __call__(self, h_BGD, pos_BG, k_ctx, v_ctx, ctx_mask_BS, blk_mask_GG):
        B, G, _ = h_BGD.shape
        KV, hd = self.num_kv_heads, self.head_dim
        q, k, v = project_many(self, h_BGD, ("q_proj", "k_proj", "v_proj"))
        q = self.q_norm(q.reshape(B, G, self.num_heads, hd))
        q = rope(q, pos_BG, self.rope_theta).reshape(B, G, KV, self.num_heads // KV, hd)
        k_blk, v_blk = self._kv(k, v, pos_BG)
        out = _attend(q, k_ctx, v_ctx, ctx_mask_BS, k_blk, v_blk, blk_mask_GG, hd ** -0.5)
        return self.o_proj(out.reshape(B, G, self.num_heads * hd))


class MLP(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(D, F, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(D, F, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(F, D, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        gate, up = project_many(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm Qwen3DFlashDecoderLayer. The context K/V enter precomputed (no input_layernorm on the context)."""

    def __init__(self, cfg: DSparkConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype):
        if cfg.attention == "mla":
            raise NotImplementedError(
                "DSparkConfig.attention='mla' (the K3-native MLA draft layer) is not implemented yet; "
                "use attention='gqa' (speculators' Qwen3 layer)")
        self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        lt = cfg.resolved_layer_types[layer_idx]
        # speculators: a sliding layer without a window is a full-attention layer (non-causal, unbounded)
        self.sliding = lt == "sliding_attention" and cfg.sliding_window is not None
        self.causal = self.sliding and not cfg.sliding_window_non_causal

    def __call__(self, x_BGD, pos_BG, k_ctx, v_ctx, ctx_mask_BS, blk_mask_GG):
        x = x_BGD + self.self_attn(self.input_layernorm(x_BGD), pos_BG, k_ctx, v_ctx, ctx_mask_BS, blk_mask_GG)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nnx.Module):
    """Low-rank sequential logit bias. markov_w1: [V, r] embedding (verifier vocab); markov_w2.kernel: [r, Vd]."""

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype):
        r, D = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = Embed(cfg.vocab_size, r, std=0.01, rngs=rngs, dtype=dtype)
        self.markov_w2 = Linear(r, cfg.draft_vocab_size, init="torch", rngs=rngs, dtype=dtype)
        self.gate_proj = Linear(D + r, r, use_bias=True, init="torch", rngs=rngs, dtype=dtype) \
            if self.head_type == "gated" else None
        self.joint_proj = Linear(2 * r + D, 3 * r, use_bias=True, init="torch", rngs=rngs, dtype=dtype) \
            if self.head_type == "rnn" else None

    def prev_embeddings(self, tokens):
        return self.markov_w1(tokens)

    def step(self, e_Br, h_BD, state_Br):
        """One slot: (bias [B, Vd], new state). e = W1[prev]; h = the slot's final-normed draft hidden."""
        e = e_Br.astype(self.markov_w2.kernel.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(e), state_Br
        h = h_BD.astype(e.dtype)
        if self.head_type == "gated":
            g = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, e], axis=-1)))
            return self.markov_w2(g * e), state_Br
        z = self.joint_proj(jnp.concatenate([state_Br.astype(e.dtype), e, h], axis=-1))
        a, c, o = jnp.split(z, 3, axis=-1)
        a = jax.nn.sigmoid(a)
        state = a * state_Br + (1.0 - a) * jnp.tanh(c)
        return self.markov_w2(jnp.tanh(o)), state

    def block(self, e_NGr, h_NGD):
        """Teacher-forced bias for whole blocks, [N, G, Vd]; the rnn state restarts at zero in every block."""
        if self.head_type != "rnn":
            return self.step(e_NGr, h_NGD, None)[0]
        N, G, _ = e_NGr.shape
        state = jnp.zeros((N, self.rank), self.markov_w2.kernel.dtype)
        out = []
        for k in range(G):
            b, state = self.step(e_NGr[:, k], h_NGD[:, k], state)
            out.append(b)
        return jnp.stack(out, axis=1)


class ConfidenceHead(nnx.Module):
    def __init__(self, din: int, *, rngs: nnx.Rngs, dtype):
        self.proj = Linear(din, 1, use_bias=True, init="torch", rngs=rngs, dtype=dtype)

    def __call__(self, f):
        return self.proj(f)[..., 0]


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


def _concrete_int(x) -> Optional[int]:
    v = _concrete(x)
    return None if v is None else int(v)


# ====================================================================== the drafter
class DSparkDrafter(nnx.Module):
    """speculators' DSpark drafter. ``target`` (optional) is only used to check hidden_size / vocab / tap ids."""

    def __init__(self, cfg: DSparkConfig, target: Any = None, *, rngs: nnx.Rngs, param_dtype=None):
        if not isinstance(cfg, DSparkConfig):
            raise ValueError(f"cfg: expected a DSparkConfig, got {type(cfg).__name__}")
        check_target(cfg, target)
        dtype = jnp.dtype(param_dtype) if param_dtype is not None else cfg.dtype
        D = cfg.hidden_size
        self.config = cfg
        self.fc = Linear(cfg.num_taps * D, D, rngs=rngs, dtype=dtype)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.markov_head = MarkovHead(cfg, rngs=rngs, dtype=dtype) if cfg.markov_rank > 0 else None
        if cfg.enable_confidence_head:
            din = D + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(din, rngs=rngs, dtype=dtype)
        else:
            self.confidence_head = None

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
    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> DrafterCache:
        cfg = self.config
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"init_cache: batch_size and max_len must be positive, got {batch_size}, {max_len}")
        L, KVh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        dt = jnp.dtype(dtype) if dtype is not None else self.dtype
        return DrafterCache(jnp.zeros((L, batch_size, KVh, hd, max_len), dt),
                            jnp.zeros((L, batch_size, KVh, max_len, hd), dt), jnp.zeros((), jnp.int32))

    def append_context(self, cache: DrafterCache, taps_BNX, n_valid, start_pos=None) -> DrafterCache:
        """Write context K/V of N (static) new positions at slots [length, length + N) and advance length by
        n_valid (traced OK). Rows >= n_valid are written but stay masked, and the next append overwrites them.
        RoPE positions are start_pos + i (default: the slot index, i.e. cache.length + i; [B] allowed).
        The caller guarantees length + N <= max_len (checked here when the values are concrete)."""
        B, N, _ = taps_BNX.shape
        if B != cache.batch_size:
            raise ValueError(f"taps_BNX: batch {B} does not match the cache's batch {cache.batch_size}")
        length = cache.length
        cl, nv = _concrete_int(length), _concrete_int(n_valid)
        if nv is not None and not 0 <= nv <= N:
            raise ValueError(f"n_valid: expected 0..{N} (the number of rows passed), got {nv}")
        if cl is not None and cl + N > cache.max_len:
            raise ValueError(f"append_context: {cl} cached + {N} new positions exceed the cache's max_len "
                             f"{cache.max_len}")
        if start_pos is None:
            start_pos = length
        pos = jnp.asarray(start_pos, jnp.int32).reshape(-1, 1) + jnp.arange(N, dtype=jnp.int32)
        pos = jnp.broadcast_to(pos, (B, N))
        k, v = _attention_layout(*self._context_kv(self.context(taps_BNX), pos))
        at = length.astype(jnp.int32)
        k = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, 0, 0, 0, at))
        v = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, 0, 0, at, 0))
        return DrafterCache(k, v, (length + jnp.asarray(n_valid, jnp.int32)).astype(jnp.int32))

    def draft_logits(self, cache: DrafterCache, anchor_token_B, anchor_pos, embed_VD, lm_head_DV):
        """One parallel block pass. Returns (base_logits [B, G, Vd] fp32, hidden [B, G, D] after the final norm).

        Block = [anchor, MASK x (G-1)] at RoPE positions anchor_pos + k (scalar or [B]; None -> cache.length).
        Context = cache slots < cache.length (and >= length - sliding_window for sliding layers)."""
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
        slots = jnp.arange(cache.max_len)
        full = jnp.broadcast_to(slots < cache.length, (B, cache.max_len))
        slide = full & (slots >= cache.length - (cfg.sliding_window or 0))
        hid = self._run_layers(x, pos, cache.k, cache.v, self._block_masks(full, slide))
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

    def greedy_block(self, base_logits_BGV, hidden_BGD, anchor_token_B):
        """Sequential greedy Markov decode of one block: prev_0 = anchor, prev_{k+1} = argmax of slot k's
        corrected logits. Returns (tokens [B, G], corrected logits [B, G, Vd], confidence logits [B, G] or None)."""
        G = base_logits_BGV.shape[1]
        prev = jnp.asarray(anchor_token_B, jnp.int32)
        state = self.init_markov_state(prev.shape[0])
        toks, logits, confs = [], [], []
        for k in range(G):
            bias, state = self.markov_bias(prev, hidden_BGD[:, k], state)
            z = base_logits_BGV[:, k] + bias.astype(f32)
            c = self.confidence_logit(hidden_BGD[:, k], prev)
            prev = jnp.argmax(z, axis=-1).astype(jnp.int32)
            toks.append(prev)
            logits.append(z)
            confs.append(c)
        conf = jnp.stack(confs, 1) if self.confidence_head is not None else None
        return jnp.stack(toks, 1), jnp.stack(logits, 1), conf

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
        a = _concrete(anchors)
        if a is not None and a.size and (a.min() < 0 or a.max() + G > T):
            raise ValueError(f"anchors_N: every anchor needs anchor + block_size <= T={T}, got {a.tolist()}")
        ids_T = jnp.asarray(input_ids_1T, jnp.int32)[0]
        pos_T = jnp.arange(T, dtype=jnp.int32) if position_ids_1T is None else \
            jnp.asarray(position_ids_1T, jnp.int32)[0]
        doc_T = jnp.zeros((T,), jnp.int32) if document_ids_1T is None else jnp.asarray(document_ids_1T, jnp.int32)[0]

        k_ctx, v_ctx = _attention_layout(*self._context_kv(self.context(taps_1TX), pos_T[None]))
        idx = anchors[:, None] + jnp.arange(G, dtype=jnp.int32)  # [N, G]
        blk_ids = jnp.full(idx.shape, cfg.mask_token_id, jnp.int32).at[:, 0].set(ids_T[anchors])
        x = self._embed(blk_ids, embed_VD)
        blk_pos = pos_T[anchors][:, None] + jnp.arange(G, dtype=jnp.int32)
        t = jnp.arange(T)
        a_doc = doc_T[anchors]
        full = (t[None] < anchors[:, None]) & (doc_T[None] == a_doc[:, None]) & (a_doc != -1)[:, None]
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
        return training_loss(self, *args, **kwargs)


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


# ====================================================================== anchors
def select_anchors(key, loss_mask_1T, num_anchors: int, block_size: int):
    """speculators' select_anchors with jax.random: up to num_anchors distinct positions with loss_mask set,
    excluding the last block_size positions, sorted; padding anchors are 0 with anchor_valid False."""
    m = jnp.asarray(loss_mask_1T)[0].astype(bool)
    T = m.shape[0]
    valid = m & (jnp.arange(T) < T - block_size)
    score = jnp.where(valid, jax.random.uniform(key, (T,)), 2.0)
    order = jnp.argsort(score)
    if num_anchors > T:
        order = jnp.concatenate([order, jnp.zeros((num_anchors - T,), order.dtype)])
    order = order[:num_anchors]
    k = jnp.minimum(num_anchors, valid.sum())
    anchor_valid = jnp.arange(num_anchors) < k
    anchors = jnp.sort(jnp.where(anchor_valid, order, T))
    return jnp.where(anchor_valid, anchors, 0).astype(jnp.int32), anchor_valid


# ====================================================================== losses (speculators losses/eager.py)
def _lsm(x):
    return jax.nn.log_softmax(x.astype(f32), axis=-1)


def kl_div_loss(logits, targets):
    lq, p = _lsm(logits), jax.nn.softmax(targets.astype(f32), axis=-1)
    return jnp.sum(jax.scipy.special.xlogy(p, p) - p * lq, axis=-1)


def reverse_kl_div_loss(logits, targets):
    lq, lp = _lsm(logits), _lsm(targets)
    return jnp.sum(jnp.exp(lq) * (lq - lp), axis=-1)


def js_div_loss(logits, targets):
    lq, lp = _lsm(logits), _lsm(targets)
    lm = jnp.logaddexp(lq, lp) - math.log(2.0)
    return 0.5 * (jnp.sum(jnp.exp(lp) * (lp - lm), -1) + jnp.sum(jnp.exp(lq) * (lq - lm), -1))


def ce_loss(logits, targets):
    tgt = jnp.argmax(targets, axis=-1)
    return -jnp.take_along_axis(_lsm(logits), tgt[..., None], axis=-1)[..., 0]


def _overlap(logits, targets):
    q = jax.nn.softmax(logits.astype(f32), axis=-1)
    p = jax.nn.softmax(targets.astype(f32), axis=-1)
    return jnp.sum(jnp.minimum(q, p), axis=-1)


def tv_loss(logits, targets):
    return 1.0 - _overlap(logits, targets)


def neg_log_acceptance_loss(logits, targets):
    return -jnp.log(jnp.maximum(_overlap(logits, targets), _NLA_EPS))


def lk_hybrid_loss(logits, targets, eta: float = 3.0):
    ov = _overlap(logits, targets)
    w = jnp.exp(-eta * jax.lax.stop_gradient(ov))
    return w * kl_div_loss(logits, targets) + (1.0 - w) * (1.0 - ov)


LOSS_FNS: dict[str, Callable] = {
    "kl_div": kl_div_loss, "rkl": reverse_kl_div_loss, "jsd": js_div_loss, "ce": ce_loss, "tv": tv_loss,
    "nla": neg_log_acceptance_loss, "lk_hybrid": lk_hybrid_loss,
}


def resolve_loss(spec) -> dict[str, tuple[Callable, float]]:
    """'kl_div', a JSON dict string '{"ce": 0.1, "tv": 0.9}', or a dict {name: weight} -> {name: (fn, weight)}."""
    if isinstance(spec, str):
        if spec in LOSS_FNS:
            return {spec: (LOSS_FNS[spec], 1.0)}
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(f"loss: unknown loss {spec!r}; use one of {sorted(LOSS_FNS)} or a JSON dict") from None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"loss: expected a loss name or a non-empty {{name: weight}} dict, got {spec!r}")
    out = {}
    for name, w in spec.items():
        if name not in LOSS_FNS:
            raise ValueError(f"loss: unknown loss {name!r}; use one of {sorted(LOSS_FNS)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"loss: weight for {name!r} must be a number, got {w!r}")
        out[name] = (LOSS_FNS[name], float(w))
    return out


def dflash_loss_decay(pos, gamma: float, sample_from_anchor: bool):
    pos = pos.astype(f32)
    if sample_from_anchor:
        return jnp.exp(-pos / gamma)
    return jnp.exp(-jnp.maximum(pos - 1.0, 0.0) / gamma) * (pos != 0)


def dpace_loss_decay(masked_elementwise, mask, block_size: int, alpha: float):
    q = jnp.exp(-jax.lax.stop_gradient(masked_elementwise)).astype(f32).reshape(-1, block_size)
    m = mask.reshape(-1, block_size).astype(f32)
    smooth = jnp.where(m > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1)
    w = jnp.flip(jnp.cumsum(jnp.flip(prefix * m, -1), -1), -1) * m
    return jax.lax.stop_gradient(w.reshape(-1))


def dspark_loss(logits_MV, targets_MV, confidence_M, mask_M, block_size: int, *, loss="kl_div", gamma: float = 4.0,
                confidence_head_alpha: float = 1.0, per_position_loss_weight: str = "fixed-exp-decay",
                dpace_alpha: float = 0.5, sample_from_anchor: bool = True):
    """speculators dspark/metrics.py::compute_metrics on flattened blocks (M = N * block_size rows).
    Returns (loss, metrics) with speculators' ``*_sum`` / ``*_total`` metric pairs."""
    if per_position_loss_weight not in ("fixed-exp-decay", "dpace"):
        raise ValueError(f"per_position_loss_weight: expected 'fixed-exp-decay' or 'dpace', "
                         f"got {per_position_loss_weight!r}")
    terms = resolve_loss(loss)
    M = logits_MV.shape[0]
    G = block_size
    nb = M // G
    pos = jnp.arange(M) % G
    start = 0 if sample_from_anchor else 1
    mask = mask_M.astype(f32)
    denom = mask.sum() + _LOSS_REDUCTION_EPS
    fixed = dflash_loss_decay(pos, gamma, sample_from_anchor)

    total = jnp.zeros((), f32)
    metrics: dict[str, Any] = {}
    for name, (fn, w) in terms.items():
        el = fn(logits_MV, targets_MV) * mask
        decay = dpace_loss_decay(el, mask, G, dpace_alpha) if per_position_loss_weight == "dpace" else fixed
        term = jnp.sum(el * decay) / denom
        if len(terms) > 1:
            metrics[f"{name}_loss_sum"] = jax.lax.stop_gradient(term)
            metrics[f"{name}_loss_total"] = jnp.ones((), f32)
        total = total + w * term

    sg = jax.lax.stop_gradient
    accept = sg(1.0 - tv_loss(logits_MV, targets_MV))
    acc_blk = accept.reshape(nb, G)
    draft_mask = mask.reshape(nb, G)[:, start:]
    accept_prefix = jnp.cumprod(acc_blk[:, start:] * draft_mask, axis=-1)
    mask_total = jnp.maximum(mask.sum(), 1.0)
    if confidence_M is not None:
        c = confidence_M.astype(f32)
        bce = (1.0 - accept) * c - jax.nn.log_sigmoid(c)
        conf_loss = jnp.sum(bce * mask * fixed) / (mask.sum() + _CONF_EPS)
        total = total + confidence_head_alpha * conf_loss
        prob = sg(jax.nn.sigmoid(c))
        conf_prefix = jnp.cumprod(prob.reshape(nb, G)[:, start:] * draft_mask, axis=-1)
        metrics.update({
            "confidence_loss_sum": sg(conf_loss), "confidence_loss_total": jnp.ones((), f32),
            "confidence_abs_error_sum": jnp.sum(jnp.abs(prob - accept) * mask),
            "confidence_abs_error_total": mask_total,
            "confidence_pred_mean_sum": jnp.sum(prob * mask), "confidence_pred_mean_total": mask_total,
            "confidence_cumprod_bias_sum": jnp.sum((conf_prefix - accept_prefix) * draft_mask),
            "confidence_cumprod_bias_total": jnp.maximum(draft_mask.sum(), 1.0),
        })
    metrics["loss_sum"] = sg(total)
    metrics["loss_total"] = jnp.ones((), f32)
    metrics["accept_rate_sum"] = jnp.sum(accept * mask)
    metrics["accept_rate_total"] = mask_total
    block_valid = (draft_mask.sum(-1) > 0).astype(f32)
    metrics["accept_len_sum"] = jnp.sum((accept_prefix.sum(-1) + 1.0) * block_valid)
    metrics["accept_len_total"] = jnp.maximum(block_valid.sum(), 1.0)

    correct = jnp.argmax(logits_MV, -1) == jnp.argmax(targets_MV, -1)
    on = mask_M != 0
    corr_pos = jnp.sum((correct & on).reshape(nb, G), axis=0).astype(f32)
    tot_pos = jnp.sum(on.reshape(nb, G), axis=0).astype(f32)
    metrics["full_acc_sum"] = corr_pos[start:].sum()
    metrics["full_acc_total"] = tot_pos[start:].sum()
    for k in range(start, G):
        metrics[f"position_{k}_acc_sum"] = corr_pos[k]
        metrics[f"position_{k}_acc_total"] = tot_pos[k]
    ok = (correct.reshape(nb, G)[:, start:] & (draft_mask != 0)).astype(f32)
    bv = jnp.any(draft_mask != 0, axis=-1).astype(f32)
    metrics["eal_sum"] = jnp.sum((jnp.cumprod(ok, -1).sum(-1) + 1.0) * bv)
    metrics["eal_total"] = bv.sum()
    return total, metrics


def verifier_targets(verifier_last_hidden_1TD, verifier_norm_D, lm_head_DV, rows, eps: float):
    """Target logits = lm_head(RMSNorm_verifier(last hidden[rows])) (fp32, no gradient)."""
    h = jnp.asarray(verifier_last_hidden_1TD)[0][rows]
    t = jnp.matmul(rms_norm(h, jnp.asarray(verifier_norm_D), eps).astype(lm_head_DV.dtype), lm_head_DV,
                   preferred_element_type=f32)
    return jax.lax.stop_gradient(t)


def training_loss(drafter: DSparkDrafter, taps_1TX, input_ids_1T, loss_mask_1T, anchors_N, anchor_valid_N,
                  verifier_last_hidden_1TD, verifier_norm_D, embed_VD, lm_head_DV, document_ids_1T=None,
                  position_ids_1T=None, loss="kl_div", gamma: float = 4.0, confidence_head_alpha: float = 1.0,
                  per_position_loss_weight: str = "fixed-exp-decay", dpace_alpha: float = 0.5,
                  verifier_lm_head_DV=None, verifier_norm_eps: Optional[float] = None, return_outputs: bool = False):
    """speculators' ``DSparkDraftModel.forward`` loss for explicit anchors (0.9.0 defaults: kl_div, exp(-k/gamma)
    weights with gamma 4, confidence BCE against 1 - TV with alpha 1). Differentiable w.r.t. the drafter
    (``nnx.value_and_grad(training_loss, has_aux=True)``; no keyword-only parameters, so nnx transforms can bind
    them). Returns (loss, metrics) [, outputs]."""
    cfg = drafter.config
    out = drafter.training_outputs(taps_1TX, input_ids_1T, anchors_N, embed_VD, lm_head_DV,
                                   document_ids_1T=document_ids_1T, position_ids_1T=position_ids_1T)
    idx = out["block_indices"]
    T = taps_1TX.shape[1]
    tgt_rows = idx if cfg.sample_from_anchor else (idx - 1) % T
    vlm = lm_head_DV if verifier_lm_head_DV is None else verifier_lm_head_DV
    eps = cfg.rms_norm_eps if verifier_norm_eps is None else verifier_norm_eps
    targets = verifier_targets(verifier_last_hidden_1TD, verifier_norm_D, vlm, tgt_rows, eps)
    m = jnp.asarray(loss_mask_1T)[0][idx].astype(f32) * jnp.asarray(anchor_valid_N).astype(f32)[:, None]
    if not cfg.sample_from_anchor:
        m = m.at[:, 0].set(0.0)
    N, G = idx.shape
    conf = out["confidence_logits"]
    loss_val, metrics = dspark_loss(
        out["logits"].reshape(N * G, -1), targets.reshape(N * G, -1), None if conf is None else conf.reshape(-1),
        m.reshape(-1), G, loss=loss, gamma=gamma, confidence_head_alpha=confidence_head_alpha,
        per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha,
        sample_from_anchor=cfg.sample_from_anchor)
    if return_outputs:
        out = dict(out, targets=targets, loss_mask=m)
        return loss_val, metrics, out
    return loss_val, metrics


# ====================================================================== checkpoints (speculators format)
_IGNORED_ON_LOAD = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def _torch_name(path) -> tuple[str, bool]:
    """nnx param path -> (speculators state_dict key, transpose?)."""
    *mod, leaf = [str(p) for p in path]
    name = ".".join(mod)
    if leaf == "kernel":
        return name + ".weight", True
    if leaf in ("embedding", "scale"):
        return name + ".weight", False
    if leaf == "bias":
        return name + ".bias", False
    raise ValueError(f"no speculators name for parameter {'.'.join(map(str, path))}")


def state_dict(drafter: DSparkDrafter) -> dict[str, jax.Array]:
    """The drafter's parameters under speculators' state_dict keys, in torch layout ([out, in] for Linear)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        name, tr = _torch_name(path)
        val = var.get_value()
        out[name] = val.T if tr else val
    return out


def save_drafter(drafter: DSparkDrafter, path) -> str:
    """Write speculators' format (config.json + model.safetensors; no embed/lm_head/verifier tensors) to path.
    Everything is written to a temporary sibling directory first and renamed into place."""
    from safetensors.flax import save_file

    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(drafter.config.to_speculators_config(), f, indent=2, sort_keys=True)
            f.write("\n")
        tensors = {k: jnp.asarray(v) for k, v in state_dict(drafter).items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".old-", dir=parent)
            os.rename(path, os.path.join(old, "d"))
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _weight_files(path: str) -> list[str]:
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
        return [single]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    raise ValueError(f"{path}: no model.safetensors (or model.safetensors.index.json) found")


def load_drafter(path, target: Any = None, *, param_dtype=None) -> DSparkDrafter:
    """Load a speculators-format DSpark checkpoint. Every missing, unexpected or mis-shaped tensor is reported in
    one ValueError. embed_tokens / lm_head / verifier_* in the file are ignored (the target's are used)."""
    from safetensors import safe_open

    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json found")
    cfg = DSparkConfig.from_speculators_config(cfg_file)
    if param_dtype is not None:
        cfg = cfg.replace(param_dtype=str(jnp.dtype(param_dtype)))
    check_target(cfg, target)
    abstract = nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    expected = {}
    for p, var in flat:
        name, tr = _torch_name(p)
        shape = tuple(var.get_value().shape)
        expected[name] = (shape[::-1] if tr else shape, tr)

    files = _weight_files(path)
    found: dict[str, tuple[str, tuple]] = {}
    for fn in files:
        with safe_open(fn, framework="flax") as f:
            for k in f.keys():
                found[k] = (fn, tuple(f.get_slice(k).get_shape()))
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(k for k in set(found) - set(expected) if k not in _IGNORED_ON_LOAD)
    misshaped = sorted(f"{k}: expected {list(expected[k][0])}, got {list(found[k][1])}"
                       for k in set(expected) & set(found) if tuple(found[k][1]) != expected[k][0])
    if missing or unexpected or misshaped:
        lines = [f"{path}: checkpoint does not match the DSpark config"]
        if missing:
            lines.append("missing tensors: " + ", ".join(missing))
        if unexpected:
            lines.append("unexpected tensors: " + ", ".join(unexpected))
        if misshaped:
            lines.append("mis-shaped tensors: " + "; ".join(misshaped))
        raise ValueError("\n".join(lines))

    by_file: dict[str, list[str]] = {}
    for k in expected:
        by_file.setdefault(found[k][0], []).append(k)
    values = {}
    for fn, keys in by_file.items():
        with safe_open(fn, framework="flax") as f:
            for k in keys:
                values[k] = f.get_tensor(k)
    for p, var in flat:
        name, tr = _torch_name(p)
        arr = jnp.asarray(values[name])
        var.set_value((arr.T if tr else arr).astype(var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


__all__ = [
    "DSparkDrafter", "DrafterCache", "DSparkConfig", "load_drafter", "save_drafter", "state_dict", "training_loss",
    "dspark_loss", "select_anchors", "resolve_loss", "rms_norm", "rope", "check_target", "verifier_targets",
]


def with_serving_layout(drafter: DSparkDrafter, serving_dtype: str = "float32") -> DSparkDrafter:
    """The drafter as a generation serves it, made once inside the generation's program (not once per step): the
    projections that read the same input side by side (``kimi.layers.project_many``: q|k|v and k|v of each layer's
    attention, gate|up of its MLP), the matmul weights in ``serving_dtype`` (the target's). Same weights, same
    results up to float summation order (and bf16 rounding of the matmul inputs)."""
    drafter = nnx.merge(*nnx.split(drafter))
    for layer in drafter.layers:
        fuse_projections(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        fuse_projections(layer.self_attn, ("k_proj", "v_proj"))
        fuse_projections(layer.mlp, ("gate_proj", "up_proj"))
    if serving_dtype == "bfloat16":
        weights_to_bf16(drafter, (Linear,))
    return drafter
