"""Flax NNX modules of the Kimi target. Attribute paths mirror the official checkpoint names
(``self_attn.q_proj``, ``block_sparse_moe.experts``...), so checkpoint I/O is a table, not a translation.

Linear kernels are stored as ``[in, out]`` (x @ kernel); the checkpoint's ``weight`` is its transpose.
Routed experts keep the checkpoint's ``[E, out, in]`` layout, dense or MXFP4-packed (codes + E8M0 scales).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi import dispatch, mxfp4
from kimi.config import KimiConfig
from kimi.kernels.kda_decode import kda_layer_step
from kimi.kernels.mxfp4_moe import routed_experts
from kimi.ops import kda as kda_ops
from kimi.ops import linear as linear_ops
from kimi.ops import mla as mla_ops
from kimi.ops import moe as moe_ops
from kimi.ops.activations import glu
from kimi.ops.norms import qwen3_rms_norm, rms_norm
from kimi.ops.rope import rope_neox
from kimi.partitioning import NO_PARTITION

_INIT_STD = 0.02


class Packed(nnx.Variable):
    """Quantised storage (MXFP4 codes and scales): not a trainable parameter."""


class ServingLayout(nnx.Variable):
    """A copy of some weights rearranged for a serving path, derived inside a generation's program (see
    ``kimi.model.with_serving_layout``): never trained, never saved."""


def _child(module, dotted: str):
    for name in dotted.split("."):
        module = getattr(module, name)
    return module


def _fused_attr(names) -> str:
    return "fused_" + "__".join(n.replace(".", "_") for n in names)


def project_many(module, x, names):
    """[x @ k for the Linear children ``names`` of ``module``] (dotted paths allowed): one matmul over their
    kernels side by side when ``fuse_projections`` made that copy (serving), else one matmul each."""
    fused = getattr(module, _fused_attr(names), None)
    if fused is None:
        return [_child(module, n)(x) for n in names]
    y = linear_ops.matmul(x, fused[...])
    ends = np.cumsum([_child(module, n).kernel.shape[1] for n in names])
    return [y[..., a:b] for a, b in zip((0,) + tuple(ends[:-1]), ends)]


def fuse_projections(module, names):
    """Attach the kernels of the Linear children ``names`` side by side (a ``ServingLayout`` copy), so that
    ``project_many`` reads the shared input once in one matmul instead of one small matmul per projection.
    Projections with a bias, and an empty group, are left alone."""
    if not names or any(getattr(_child(module, n), "bias", None) is not None for n in names):
        return
    kernels = [_child(module, n).kernel[...] for n in names]
    setattr(module, _fused_attr(names), ServingLayout(jnp.concatenate(kernels, axis=1)))


def weights_to_bf16(root: nnx.Module, linear_types=None):
    """A serving copy's matmul weights in bf16 (``KimiConfig.serving_dtype``), in place: the kernel of every
    Linear (of ``linear_types``, default this module's Linear) and every ``ServingLayout`` (fused and per-expert
    layouts), which kimi.ops.linear.matmul then multiplies as bf16 products with fp32 accumulation. Embeddings,
    norms, router, KDA gates and convolution stay fp32."""
    linear_types = linear_types or (Linear,)
    for _, module in nnx.iter_modules(root):
        if isinstance(module, linear_types):
            module.kernel = nnx.Param(module.kernel[...].astype(jnp.bfloat16))
        for name, v in list(vars(module).items()):
            if isinstance(v, ServingLayout):
                setattr(module, name, ServingLayout(v[...].astype(jnp.bfloat16)))


_ABSTRACT = [False]


@contextlib.contextmanager
def shape_only_init():
    """Inside ``jax.eval_shape``: initialise every parameter with zeros and draw no random keys, so tracing a
    93-layer model stays linear in its size (each RNG draw would otherwise walk the whole trace)."""
    _ABSTRACT.append(True)
    try:
        yield
    finally:
        _ABSTRACT.pop()


def normal_init(rngs: nnx.Rngs, shape, dtype, std: float = _INIT_STD):
    if _ABSTRACT[-1] or std == 0.0:
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def uniform_init(rngs: nnx.Rngs, shape, dtype, lo: float, hi: float):
    if _ABSTRACT[-1]:
        return jnp.full(shape, lo, dtype)
    return jax.random.uniform(rngs.params(), shape, dtype, lo, hi)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias with ``use_bias``); kernel [in, out]. ``init`` (default: N(0, std^2) weights, zero
    bias) may be a function ``(rngs, in, out) -> (kernel, bias)`` (the drafter's speculators-style inits)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, std: float = _INIT_STD,
                 use_bias: bool = False, init=None):
        if init is None:
            w, b = normal_init(rngs, (in_features, out_features), dtype, std), None
        else:
            w, b = init(rngs, in_features, out_features)
        self.kernel = nnx.Param(w.astype(dtype))
        if use_bias:
            b = jnp.zeros((out_features,), dtype) if b is None else b
        self.bias = nnx.Param(b.astype(dtype)) if use_bias else None

    def __call__(self, x):
        y = linear_ops.matmul(x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class Embed(nnx.Module):
    """Token embedding table [V, D]; ``init`` (default N(0, 0.02^2)) may be a function ``(rngs, shape) -> array``."""

    def __init__(self, num_embeddings: int, features: int, *, dtype, rngs: nnx.Rngs, init=None):
        shape = (num_embeddings, features)
        table = normal_init(rngs, shape, dtype) if init is None else init(rngs, shape)
        self.embedding = nnx.Param(table.astype(dtype))

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class Qwen3RMSNorm(nnx.Module):
    """Qwen3's RMSNorm (the DSpark drafter's): gain named ``scale``, the normalised input cast back to its dtype
    before the gain multiplies it (``kimi.ops.norms.qwen3_rms_norm``)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return qwen3_rms_norm(x, self.scale[...], self.eps)


# ---------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAOut:
    y_BTD: jax.Array
    state_BHKV: jax.Array
    conv_BWC: jax.Array
    rollback: object = None  # verify only: the state after every position [B, T, H, K, V], or a KDABlockTrace
    convs_BTWC: Optional[jax.Array] = None  # verify only: the conv state after every position


class KimiDeltaAttention(nnx.Module):
    """Gated delta rule with channel-wise decay, short conv on q/k/v, gated RMSNorm output."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        D, H, K, P = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim
        dt = cfg.dtype
        self.cfg = cfg
        self.q_proj = Linear(D, P, dtype=dt, rngs=rngs)
        self.k_proj = Linear(D, P, dtype=dt, rngs=rngs)
        self.v_proj = Linear(D, P, dtype=dt, rngs=rngs)
        cs, Kc = 1.0 / cfg.short_conv_kernel_size, cfg.short_conv_kernel_size
        self.q_conv1d = nnx.Param(normal_init(rngs, (P, Kc), jnp.float32, cs))
        self.k_conv1d = nnx.Param(normal_init(rngs, (P, Kc), jnp.float32, cs))
        self.v_conv1d = nnx.Param(normal_init(rngs, (P, Kc), jnp.float32, cs))
        self.f_a_proj = Linear(D, K, dtype=dt, rngs=rngs)
        self.f_b_proj = Linear(K, P, dtype=dt, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(uniform_init(rngs, (H,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(normal_init(rngs, (P,), jnp.float32, 0.1))
        self.b_proj = Linear(D, H, dtype=dt, rngs=rngs)
        if cfg.kda_use_full_rank_gate:
            self.g_proj = Linear(D, P, dtype=dt, rngs=rngs)
        else:
            self.g_a_proj = Linear(D, K, dtype=dt, rngs=rngs)
            self.g_b_proj = Linear(K, P, dtype=dt, rngs=rngs)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = Linear(P, D, dtype=dt, rngs=rngs)
        self.partition = NO_PARTITION  # the sharding plan's hook (KimiForCausalLM.set_partitioner)

    def input_projections(self):
        """The projections of the layer input x (``project_many`` runs them as one matmul when fused)."""
        gate = ("g_proj",) if self.cfg.kda_use_full_rank_gate else ("g_a_proj",)
        return ("q_proj", "k_proj", "v_proj") + gate + ("f_a_proj", "b_proj")

    def conv_weight_CK(self):
        """q, k and v conv kernels side by side: [3P, kernel]."""
        return jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=0)

    def __call__(self, x_BTD, state_BHKV, conv_BWC, mode: str, valid_len_B=None) -> KDAOut:
        """``valid_len_B`` (prefill only): positions t >= valid_len are padding; they leave the recurrent state
        (beta = 0, g = 0) and the conv state untouched."""
        cfg = self.cfg
        if dispatch.kda_uses_pallas(cfg, mode):  # the fused Pallas step (kimi/kernels)
            return KDAOut(*kda_layer_step(self, x_BTD, state_BHKV, conv_BWC, verify=mode == "verify"))
        B, T, _ = x_BTD.shape
        H, K, P = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim
        q_in, k_in, v_in, gate_in, fa_in, b_in = project_many(self, x_BTD, self.input_projections())
        pre = jnp.stack([q_in, k_in, v_in], axis=2)  # [B, T, 3, P]
        # q|k|v side by side: their head splits don't line up along 3P, so gather them once
        pre = self.partition.constrain(pre, ("batch", None, None, None))
        pre_BTC = pre.reshape(B, T, 3 * P)
        w_CK = self.conv_weight_CK()
        convs = None
        if mode == "verify":
            qkv_BTC, new_conv, convs = kda_ops.causal_conv(pre_BTC, w_CK, conv_BWC, return_all_states=True)
        else:
            qkv_BTC, new_conv = kda_ops.causal_conv(pre_BTC, w_CK, conv_BWC)
        if valid_len_B is not None:
            W = conv_BWC.shape[1]
            xx = jnp.concatenate([conv_BWC, pre_BTC.astype(conv_BWC.dtype)], axis=1)
            new_conv = jax.vmap(lambda a, n: jax.lax.dynamic_slice_in_dim(a, n, W, axis=0))(xx, valid_len_B)
        conv_BWC = new_conv
        # the conv runs on the gathered channels; each device then takes its heads
        qkv_BTC = self.partition.constrain(qkv_BTC, ("batch", None, None))
        qkv = qkv_BTC.astype(jnp.float32).reshape(B, T, 3, H, K)  # (not jnp.split: keeps the head split local)
        q = kda_ops.l2norm(qkv[:, :, 0])
        k = kda_ops.l2norm(qkv[:, :, 1])
        v = qkv[:, :, 2]
        a_BTHK = self.f_b_proj(fa_in).astype(jnp.float32).reshape(B, T, H, K)
        A_log_H = self.A_log[...][:H]
        dt_bias_HK = self.dt_bias[...].reshape(H, K)
        if cfg.kda_gate_lower_bound is None:
            g = kda_ops.kda_gate_softplus(a_BTHK, A_log_H, dt_bias_HK)
        else:
            g = kda_ops.kda_gate_lower_bound(a_BTHK, A_log_H, dt_bias_HK, cfg.kda_gate_lower_bound)
        beta_BTH = jax.nn.sigmoid(b_in.astype(jnp.float32))
        if valid_len_B is not None:
            real_BT = jnp.arange(T)[None, :] < valid_len_B[:, None]
            beta_BTH = jnp.where(real_BT[..., None], beta_BTH, 0.0)
            g = jnp.where(real_BT[..., None, None], g, 0.0)
        states = None
        if mode == "prefill" and dispatch.kda_prefill_form(cfg) == "chunked":
            o, state_BHKV = kda_ops.kda_chunked(q, k, v, g, beta_BTH, state_BHKV, chunk_size=cfg.kda_chunk_size)
        elif mode == "prefill":
            o, state_BHKV = kda_ops.kda_recurrent(q, k, v, g, beta_BTH, state_BHKV)
        elif mode == "verify" and dispatch.kda_verify_form(T, B) == "block":
            o, states = kda_ops.kda_block(q, k, v, g, beta_BTH, state_BHKV)
            state_BHKV = kda_ops.kda_block_state(states, jnp.full((B,), T, jnp.int32))
        elif mode == "verify":
            o, state_BHKV, states = kda_ops.kda_recurrent(q, k, v, g, beta_BTH, state_BHKV, return_all_states=True)
        elif mode == "decode":  # one token per row
            o, state_BHKV = kda_ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta_BTH[:, 0], state_BHKV)
            o = o[:, None]
        else:
            raise ValueError(f"mode: expected 'prefill', 'decode' or 'verify', got {mode!r}")
        gate = gate_in if cfg.kda_use_full_rank_gate else self.g_b_proj(gate_in)
        y = kda_ops.gated_rms_norm(o, gate.astype(jnp.float32).reshape(B, T, H, K), self.o_norm.weight[...],
                                   cfg.rms_norm_eps)
        y_BTD = self.o_proj(y.reshape(B, T, P).astype(x_BTD.dtype))
        return KDAOut(y_BTD, state_BHKV, conv_BWC, states, convs)


# ---------------------------------------------------------------------------------------------------------------
# Gated NoPE MLA
def write_stacked(cache_NBSX, slot: int, new_BTX, start_B):
    """cache[slot, b, start_b : start_b + T] = new[b] for every row b, on the stacked array itself so XLA can
    update it in place. One row (decode, verify, a serving slot under vmap): a ``dynamic_update_slice``; several
    (a batched prefill, training): one scatter (a DUS per row would unroll B of them into the program)."""
    new = new_BTX.astype(cache_NBSX.dtype)
    B, T = new.shape[:2]
    if B == 1:
        return jax.lax.dynamic_update_slice(cache_NBSX, new[None], (slot, 0, start_B[0], 0))
    rows_B1 = jnp.arange(B)[:, None]
    cols_BT = start_B[:, None] + jnp.arange(T, dtype=start_B.dtype)[None]
    return cache_NBSX.at[slot, rows_B1, cols_BT].set(new)


class GatedMLA(nnx.Module):
    """MLA with q LoRA, a latent KV cache of (kv_lora_rank + rope) values per token and a sigmoid output gate."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        D, H = cfg.hidden_size, cfg.num_attention_heads
        dt = cfg.dtype
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * cfg.qk_head_dim, dtype=dt, rngs=rngs)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, dtype=dt, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_lora_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, dtype=dt, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dt, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_lora_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dt, rngs=rngs)
        self.o_proj = Linear(H * cfg.v_head_dim, D, dtype=dt, rngs=rngs)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(D, H * cfg.v_head_dim, dtype=dt, rngs=rngs)

    def input_projections(self):
        q = ("q_proj",) if self.cfg.q_lora_rank is None else ("q_a_proj",)
        return q + ("kv_a_proj_with_mqa",) + (("g_proj",) if self.cfg.mla_use_output_gate else ())

    def __call__(self, x_BTD, ckv_NBSL, kpe_NBSR, slot: int, length_B, absorbed: bool):
        """Writes this chunk's latents at [length, length + T) of entry ``slot`` (static) of the stacked latent
        caches [n_mla, B, S, .] and attends over that entry. Returns (y_BTD, ckv_NBSL, kpe_NBSR).

        The write goes into the stacked arrays themselves, before the attention reads them: slicing a layer's
        cache out, writing the slice and stacking the layers again made XLA copy every layer's whole cache on
        every decode step (at 32K positions most of a step's time)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, N, R, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q_in, kv_a, *gate_in = project_many(self, x_BTD, self.input_projections())
        q = q_in if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_in))
        q = q.reshape(B, T, H, N + R)
        q_nope, q_pe = q[..., :N], q[..., N:]
        ckv_new = self.kv_a_layernorm(kv_a[..., :L])
        kpe_new = kv_a[..., L:]
        pos_BT = length_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        if not cfg.mla_use_nope and R:
            # in fp32, as the rest of the attention scores; kpe has no head axis
            q_pe = rope_neox(q_pe.astype(jnp.float32), pos_BT, cfg.rope_theta).astype(q_pe.dtype)
            kpe_new = rope_neox(kpe_new.astype(jnp.float32)[:, :, None], pos_BT, cfg.rope_theta)[:, :, 0].astype(
                kpe_new.dtype)
        ckv_NBSL = write_stacked(ckv_NBSL, slot, ckv_new, length_B)
        kpe_NBSR = write_stacked(kpe_NBSR, slot, kpe_new, length_B)
        S = ckv_NBSL.shape[2]
        rest = (self.kv_b_proj.kernel[...], pos_BT, length_B + T, cfg.v_head_dim)
        # a tiled form reads its key tiles from the stacked arrays where they lie (``mla_ops._key_tile``); the
        # one-pass forms take this layer's slice (a copy of it: short caches only)
        tiles = (("absorbed", t) if (t := dispatch.mla_absorbed_key_tile(S)) else None) if absorbed \
            else dispatch.mla_key_tile(S)
        if tiles:
            form, tile = tiles
            tiled = mla_ops.mla_attend_absorbed_tiled if form == "absorbed" else mla_ops.mla_attend_tiled
            o_BTHV = tiled(q_nope, q_pe, ckv_NBSL, kpe_NBSR, *rest, tile=tile, layer=slot)
        else:
            one_pass = mla_ops.mla_attend_absorbed if absorbed else mla_ops.mla_attend_unabsorbed
            o_BTHV = one_pass(q_nope, q_pe, ckv_NBSL[slot], kpe_NBSR[slot], *rest)
        o = o_BTHV.reshape(B, T, H * cfg.v_head_dim)
        if cfg.mla_use_output_gate:
            o = o * jax.nn.sigmoid(gate_in[0].astype(jnp.float32))
        return self.o_proj(o.astype(x_BTD.dtype)), ckv_NBSL, kpe_NBSR


# ---------------------------------------------------------------------------------------------------------------
# Feed-forward
class DenseMLP(nnx.Module):
    """down(act(gate(x), up(x))): layer 0's dense MLP and the shared experts."""

    def __init__(self, cfg: KimiConfig, hidden: int, *, rngs: nnx.Rngs):
        D, dt = cfg.hidden_size, cfg.dtype
        self.cfg = cfg
        self.gate_proj = Linear(D, hidden, dtype=dt, rngs=rngs)
        self.up_proj = Linear(D, hidden, dtype=dt, rngs=rngs)
        self.down_proj = Linear(hidden, D, dtype=dt, rngs=rngs)

    def input_projections(self):
        return ("gate_proj", "up_proj")

    def __call__(self, x):
        return self.from_projections(*project_many(self, x, self.input_projections()))

    def from_projections(self, gate, up):
        """down(act(gate, up)) given the two input projections (computed together with others by the caller)."""
        c = self.cfg
        return self.down_proj(glu(gate, up, c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta))


class Router(nnx.Module):
    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.num_experts, cfg.hidden_size), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))

    def logits(self, x_TD):
        return jnp.dot(x_TD.astype(jnp.float32), self.weight[...].astype(jnp.float32).T)


class RoutedExperts(nnx.Module):
    """E experts, each W2 act(W1 z, W3 z), in the checkpoint's [E, out, in] layout: dense Params, or MXFP4
    codes [E, out, in/2] + E8M0 scales [E, out, in/32] dequantised only for the experts a token routes to."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        E, F, Din = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
        self.cfg = cfg
        self.partition = NO_PARTITION  # the sharding plan's hook: expert parallel when it runs them
        shapes = {"w1": (E, F, Din), "w3": (E, F, Din), "w2": (E, Din, F)}
        for name, shape in shapes.items():
            if cfg.expert_format == "mxfp4" and _ABSTRACT[-1]:
                packed = jnp.zeros(shape[:-1] + (shape[-1] // 2,), jnp.uint8)
                scale = jnp.zeros(shape[:-1] + (shape[-1] // mxfp4.BLOCK_SIZE,), jnp.uint8)
                setattr(self, f"{name}_packed", Packed(packed))
                setattr(self, f"{name}_scale", Packed(scale))
                continue
            w = normal_init(rngs, shape, jnp.float32)
            if cfg.expert_format == "mxfp4":
                packed, scale = mxfp4.quantize(w)
                setattr(self, f"{name}_packed", Packed(packed))
                setattr(self, f"{name}_scale", Packed(scale))
            else:
                setattr(self, name, nnx.Param(w.astype(cfg.dtype)))

    def weight(self, name: str, idx=None, dtype=jnp.float32):
        """The dense [E, out, in] weight (or [..., out, in] for the experts in ``idx``)."""
        if self.cfg.expert_format == "mxfp4":
            packed = getattr(self, f"{name}_packed")[...]
            scale = getattr(self, f"{name}_scale")[...]
            if idx is not None:
                packed, scale = packed[idx], scale[idx]
            return mxfp4.dequantize(packed, scale, dtype=dtype)
        w = getattr(self, name)[...]
        return (w if idx is None else w[idx]).astype(dtype)

    def all_layout(self, dtype):
        """(w13 [D, 2EF], w2 [EF, D]) for the 'all' path: the copy made once by ``with_serving_layout`` when
        there is one (``make_all_layout``, which also lays the experts out one by one for the 'used' path), else
        rearranged here (on every call)."""
        if hasattr(self, "all_w13_D2EF"):  # in the serving dtype, which kimi.ops.linear.matmul reads as is
            return self.all_w13_D2EF[...], self.all_w2_EFD[...]
        return moe_ops.fuse_experts_for_all(self.weight("w1", None, dtype), self.weight("w3", None, dtype),
                                            self.weight("w2", None, dtype))

    def make_all_layout(self):
        """Attach the layouts of the 'all' and 'used' paths (``ServingLayout`` variables), from the dense weights:
        the fused pair, and each expert's [W1^T | W3^T] and W2^T as arrays of their own (``used_w13_D2F_{e}``,
        ``used_w2_FD_{e}``) up to ``USED_UNROLL_MAX_EXPERTS`` experts, else stacked (``used_w13_ED2F``,
        ``used_w2_EFD``) for the loop (see ``kimi.ops.moe.experts_used``)."""
        dense = [self.weight(n, None, self.cfg.dtype) for n in ("w1", "w3", "w2")]
        w13, w2 = moe_ops.fuse_experts_for_all(*dense)
        self.all_w13_D2EF, self.all_w2_EFD = ServingLayout(w13), ServingLayout(w2)
        w13_ED2F, w2_EFD = moe_ops.fuse_experts_per_expert(*dense)
        if self.cfg.num_experts <= dispatch.USED_UNROLL_MAX_EXPERTS:
            for e in range(self.cfg.num_experts):
                setattr(self, f"used_w13_D2F_{e}", ServingLayout(w13_ED2F[e]))
                setattr(self, f"used_w2_FD_{e}", ServingLayout(w2_EFD[e]))
        else:
            self.used_w13_ED2F, self.used_w2_EFD = ServingLayout(w13_ED2F), ServingLayout(w2_EFD)

    def used_layout(self):
        """(w13, w2) of the 'used' path as ``make_all_layout`` stored them: tuples of per-expert arrays, or stacked."""
        if hasattr(self, "used_w13_ED2F"):
            return self.used_w13_ED2F[...], self.used_w2_EFD[...]
        E = self.cfg.num_experts
        return (tuple(getattr(self, f"used_w13_D2F_{e}")[...] for e in range(E)),
                tuple(getattr(self, f"used_w2_FD_{e}")[...] for e in range(E)))

    def __call__(self, z_TD, w_TX, idx_TX):
        y = self.partition.routed_experts(self, z_TD, w_TX, idx_TX)
        if y is not None:
            return y
        c = self.cfg
        T, X = idx_TX.shape
        act = (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta)
        serving_dtype = self.all_w13_D2EF[...].dtype if hasattr(self, "all_w13_D2EF") else None
        path = dispatch.moe_path(T, X, c.num_experts, serving_dtype)
        if dispatch.moe_uses_pallas(c):  # Pallas kernels on the packed weights
            return routed_experts(self, z_TD, w_TX, idx_TX, decode=path in ("gathered", "used"))
        if path == "used":
            return moe_ops.experts_used(z_TD, w_TX, idx_TX, *self.used_layout(), *act)
        if path == "gathered":
            return moe_ops.experts_gathered(z_TD, w_TX, self.weight("w1", idx_TX, z_TD.dtype),
                                            self.weight("w3", idx_TX, z_TD.dtype),
                                            self.weight("w2", idx_TX, z_TD.dtype), *act)
        if path == "all_or_used":
            return moe_ops.experts_all_or_used(z_TD, w_TX, idx_TX, self.all_w13_D2EF[...], self.all_w2_EFD[...],
                                               *self.used_layout(), *act)
        if path == "all":
            return moe_ops.experts_all_fused(z_TD, w_TX, idx_TX, *self.all_layout(z_TD.dtype), c.num_experts, *act)
        if path == "blocked" and serving_dtype is not None:  # the serving copy's experts, as they are
            return moe_ops.experts_blocked_fused(z_TD, w_TX, idx_TX, *self.used_layout(), *act)
        if path == "blocked":
            return moe_ops.experts_blocked(z_TD, w_TX, idx_TX, self.weight("w1", None, z_TD.dtype),
                                           self.weight("w3", None, z_TD.dtype), self.weight("w2", None, z_TD.dtype),
                                           *act)
        return moe_ops.experts_grouped(z_TD, w_TX, idx_TX, self.weight("w1", None, z_TD.dtype),
                                       self.weight("w3", None, z_TD.dtype), self.weight("w2", None, z_TD.dtype), *act)


class LatentMoE(nnx.Module):
    """Router on x; routed experts in the latent space (down, experts, latent RMSNorm, up); shared experts on x.
    With routed_expert_hidden_size None it is a plain MoE (Kimi-Linear)."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        D, dt = cfg.hidden_size, cfg.dtype
        self.cfg = cfg
        self.gate = Router(cfg, rngs=rngs)
        if cfg.routed_expert_hidden_size is not None:
            Lat = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = Linear(D, Lat, dtype=dt, rngs=rngs)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Lat, cfg.rms_norm_eps)
            self.routed_expert_up_proj = Linear(Lat, D, dtype=dt, rngs=rngs)
        self.experts = RoutedExperts(cfg, rngs=rngs)
        if cfg.num_shared_experts:
            self.shared_experts = DenseMLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, rngs=rngs)
        self.partition = NO_PARTITION  # the sharding plan's hook (KimiForCausalLM.set_partitioner)

    def input_projections(self):
        """The projections of x besides the router: the latent down-projection and the shared experts' gate/up."""
        down = ("routed_expert_down_proj",) if self.cfg.routed_expert_hidden_size is not None else ()
        return down + (("shared_experts.gate_proj", "shared_experts.up_proj") if self.cfg.num_shared_experts else ())

    def route(self, x_TD):
        c = self.cfg
        return moe_ops.route(self.gate.logits(x_TD), self.gate.e_score_correction_bias[...], c.num_experts_per_token,
                             c.num_expert_group, c.topk_group, c.moe_renormalize, c.routed_scaling_factor)

    def __call__(self, x_BTD):
        c = self.cfg
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        w_TX, idx_TX = self.route(x_TD)
        proj = project_many(self, x_TD, self.input_projections())
        z = proj.pop(0) if c.routed_expert_hidden_size is not None else x_TD
        y = self.experts(z, w_TX, idx_TX)
        if c.routed_expert_hidden_size is not None:
            if c.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
                # normalise whole latent rows (not latent shards: saves a reduction)
                y = self.partition.constrain(y, ("batch", None))
            y = self.routed_expert_up_proj(y)
        if c.num_shared_experts:
            y = y + self.shared_experts.from_projections(*proj)
        return y.reshape(B, T, D)


# ---------------------------------------------------------------------------------------------------------------
# Decoder layer
def attn_res_pseudo_query(norm: RMSNorm, proj: Linear):
    """w = norm.weight * proj.weight: the norm gain folded into the site's pseudo-query (fp32)."""
    return norm.weight[...].astype(jnp.float32) * proj.kernel[...][:, 0].astype(jnp.float32)


def attn_res_site(cfg: KimiConfig, *, rngs: nnx.Rngs):
    """(norm, proj) of one AttnRes site; the pseudo-query starts at zero, so the weights start uniform."""
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), Linear(cfg.hidden_size, 1, dtype=jnp.float32, rngs=rngs,
                                                                std=0.0)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: KimiConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kinds[layer_idx]
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.self_attn = KimiDeltaAttention(cfg, rngs=rngs) if self.kind == "kda" else GatedMLA(cfg, rngs=rngs)
        if cfg.ffn_kinds[layer_idx] == "dense":
            self.mlp = DenseMLP(cfg, cfg.intermediate_size, rngs=rngs)
        else:
            self.block_sparse_moe = LatentMoE(cfg, rngs=rngs)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = attn_res_site(cfg, rngs=rngs)
            self.mlp_res_norm, self.mlp_res_proj = attn_res_site(cfg, rngs=rngs)

    def ffn(self, x):
        return self.mlp(x) if self.cfg.ffn_kinds[self.layer_idx] == "dense" else self.block_sparse_moe(x)
