"""The DSpark drafter's layers (speculators' Qwen3 DFlash layer, Markov head, confidence head) and the block
attention they run; the Linear / Embed / RMSNorm blocks are kimi's (``kimi.layers``), initialised as speculators
does and multiplied as torch does (``SpecLinear``).

Parameters are named like speculators' state_dict (``layers[i].self_attn.q_proj.kernel`` <->
``layers.{i}.self_attn.q_proj.weight``, transposed); norms hold ``scale``, the Markov W1 an ``embedding``.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.config import DSparkConfig
from kimi.layers import Embed, Linear, Qwen3RMSNorm, project_many
from kimi.ops.rope import rope_neox as rope

f32 = jnp.float32


# ====================================================================== attention math
def attend(q_BGKRH, kT_ctx, v_ctx, ctx_mask_BS, k_blk_BGKH, v_blk_BGKH, blk_mask_GG, scale: float):
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


def attention_layout(k_LBSKH, v_LBSKH):
    """Context K/V [L, B, S, KVh, hd] (as projected) -> (kT [L, B, KVh, hd, S], v [L, B, KVh, S, hd])."""
    return jnp.transpose(k_LBSKH, (0, 1, 3, 4, 2)), jnp.transpose(v_LBSKH, (0, 1, 3, 2, 4))


# ====================================================================== initialisation (speculators')

def concrete(x) -> Optional[np.ndarray]:
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
    bits = concrete(jax.random.key_data(key))
    if bits is not None:
        g = np.random.default_rng(bits.astype(np.uint64).ravel().tolist())
        x = g.standard_normal(shape, np.float32) if kind == "normal" else g.uniform(-1.0, 1.0, shape)
        return jnp.asarray(np.float32(scale) * x.astype(np.float32))
    if kind == "normal":
        return scale * jax.random.normal(key, shape, f32)
    return jax.random.uniform(key, shape, f32, -scale, scale)



def speculators_init(rngs, din: int, dout: int):
    """speculators' post_init: N(0, 0.02) weights, zero bias."""
    return _random(rngs.params(), (din, dout), "normal", 0.02), jnp.zeros((dout,), f32)


def torch_init(rngs, din: int, dout: int):
    """torch nn.Linear's default: U(+-1/sqrt(fan_in)) for weight and bias."""
    bound = 1.0 / math.sqrt(din)
    kw, kb = jax.random.split(rngs.params())
    return _random(kw, (din, dout), "uniform", bound), _random(kb, (dout,), "uniform", bound)


def _normal_table(std: float):
    return lambda rngs, shape: _random(rngs.params(), shape, "normal", std)


class SpecLinear(Linear):
    """kimi's Linear as speculators' torch Linear multiplies: the input cast to the kernel's dtype first (except
    for the bf16 serving copy's kernels, which ``kimi.ops.linear.matmul`` reads with fp32 activations)."""

    def __init__(self, din: int, dout: int, *, use_bias: bool = False, init=speculators_init, rngs: nnx.Rngs,
                 dtype=f32):
        super().__init__(din, dout, dtype=dtype, rngs=rngs, use_bias=use_bias, init=init)

    def __call__(self, x):
        k = self.kernel[...]
        return super().__call__(x if k.dtype == jnp.bfloat16 else x.astype(k.dtype))


# ====================================================================== modules
class Attention(nnx.Module):
    """speculators' Qwen3DFlashAttention: block queries, [context ; block] keys/values."""

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype):
        D, H, KV, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(use_bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        self.q_proj = SpecLinear(D, H * hd, **kw)
        self.k_proj = SpecLinear(D, KV * hd, **kw)
        self.v_proj = SpecLinear(D, KV * hd, **kw)
        self.o_proj = SpecLinear(H * hd, D, **kw)
        self.q_norm = Qwen3RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = Qwen3RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
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
        out = attend(q, k_ctx, v_ctx, ctx_mask_BS, k_blk, v_blk, blk_mask_GG, hd ** -0.5)
        return self.o_proj(out.reshape(B, G, self.num_heads * hd))


class MLP(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = SpecLinear(D, F, rngs=rngs, dtype=dtype)
        self.up_proj = SpecLinear(D, F, rngs=rngs, dtype=dtype)
        self.down_proj = SpecLinear(F, D, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        gate, up = project_many(self, x, ("gate_proj", "up_proj"))
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm Qwen3DFlashDecoderLayer. The context K/V enter precomputed (no input_layernorm on the context)."""

    def __init__(self, cfg: DSparkConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype):
        self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
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
        self.markov_w1 = Embed(cfg.vocab_size, r, init=_normal_table(0.01), rngs=rngs, dtype=dtype)
        self.markov_w2 = SpecLinear(r, cfg.draft_vocab_size, init=torch_init, rngs=rngs, dtype=dtype)
        self.gate_proj = SpecLinear(D + r, r, use_bias=True, init=torch_init, rngs=rngs, dtype=dtype) \
            if self.head_type == "gated" else None
        self.joint_proj = SpecLinear(2 * r + D, 3 * r, use_bias=True, init=torch_init, rngs=rngs, dtype=dtype) \
            if self.head_type == "rnn" else None

    def prev_embeddings(self, tokens):
        return self.markov_w1(tokens)

    def step(self, e_Br, h_BD, state_Br):
        """One slot: (bias [B, Vd], new state). e = W1[prev]; h = the slot's final-normed draft hidden.

        On the bf16 serving copy e stays fp32, so each product takes ``kimi.ops.linear.matmul``'s serving path
        (inputs rounded to bf16, fp32 sums, rows padded): a bf16 x bf16 product of this one row made XLA:CPU
        convert the whole [r, Vd] kernel to fp32 and run an unfused vector-matrix dot on every draft step."""
        kdt = self.markov_w2.kernel.dtype
        e = e_Br.astype(jnp.float32 if kdt == jnp.bfloat16 else kdt)
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
        self.proj = SpecLinear(din, 1, use_bias=True, init=torch_init, rngs=rngs, dtype=dtype)

    def __call__(self, f):
        return self.proj(f)[..., 0]

