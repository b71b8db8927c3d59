"""MoonViT: the vision encoder and patch-merger projector of Kimi K2.5 / K3, NaViT-style over packed images.

Images (and video clips) of different sizes are flattened into one sequence of N patches; a clip of t frames on
an h x w patch grid contributes t*h*w patches in (frame, row, column) order. Per layer and per clip:

  x      = patches_NX @ W_patch (+ b)                   the Conv2d patch embedding, as a matmul on flat patches
  x     += interp(pos_table_HWD -> h x w) + time_t      learnable 2D table resampled to the clip's grid (bicubic
                                                         for K2.5, bilinear for K3); sin-cos time row per frame
                                                         (none for a single image)
  repeat x += wo(attn(norm0(x)));  x += fc1(gelu_tanh(fc0(norm1(x))))
         attn: softmax(q k^T / sqrt(d) + mask) v, mask = -inf across clips (segment ids), 2D RoPE on q and k
  x      = final_norm(x)
  pooled = mean over frames, then 2x2 spatial groups   [M, 4, D], M = sum (h/2)(w/2) per clip
  feats  = projector(pooled)                            [M, text hidden]

2D RoPE (the checkpoint's layout: rotation pairs are adjacent channels (2j, 2j+1) of each head): pair j turns by
  angle_j = col * theta^(-4k/d) if j even else row * theta^(-4k/d),   k = j // 2,  d = head dim.

Layouts that depend only on the grids (interpolation matrices, RoPE angles, segment ids, merge order) are built
on the host in NumPy from the static grid tuple; the jitted part sees fixed shapes per grid.
Parameter paths mirror the official checkpoint names (``vision_tower.encoder.blocks.N.wqkv``...).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi.layers import Linear, RMSNorm, normal_init
from kimi.vision_config import VisionConfig

Grid = tuple[tuple[int, int, int], ...]  # (t, h, w) patches per clip, static

__all__ = ["MoonViT", "Projector", "VisionConfig", "check_grid", "encode", "merge_media", "interp_matrix",
           "rope_angles_N", "time_embedding"]


# ---------------------------------------------------------------------------------------------------------------
# host-side layouts (NumPy, from the static grid)
def check_grid(grid, vcfg: VisionConfig, n_patches: int | None = None) -> Grid:
    """``grid`` as a tuple of (t, h, w) ints; ValueError unless every clip fits the config: h and w multiples of
    the merge kernel, t within the time table, and (given ``n_patches``) sum t*h*w == n_patches."""
    g = tuple(tuple(int(v) for v in row) for row in np.asarray(grid).reshape(-1, 3))
    kh, kw = vcfg.merge_kernel_size
    for i, (t, h, w) in enumerate(g):
        if min(t, h, w) <= 0:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: every entry must be positive")
        if h % kh or w % kw:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge kernel "
                             f"{vcfg.merge_kernel_size}")
        if t > 1 and t > vcfg.pos_emb_time:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: {t} frames, but the time embedding covers "
                             f"pos_emb_time={vcfg.pos_emb_time}")
    if n_patches is not None and sum(t * h * w for t, h, w in g) != n_patches:
        raise ValueError(f"pixel_values: {n_patches} patches, but grid_thw {list(g)} describes "
                         f"{sum(t * h * w for t, h, w in g)}")
    return g


def _kernel_weights(dist, mode: str):
    """Interpolation kernel at |distance|: bilinear hat max(0, 1 - d), or Keys' cubic with a = -0.75
    (``F.interpolate``'s): (a+2)d^3 - (a+3)d^2 + 1 for d <= 1, a d^3 - 5a d^2 + 8a d - 4a for 1 < d < 2."""
    if mode == "bilinear":
        return np.maximum(0.0, 1.0 - dist)
    a = -0.75
    near = ((a + 2) * dist - (a + 3)) * dist * dist + 1
    far = ((a * dist - 5 * a) * dist + 8 * a) * dist - 4 * a
    return np.where(dist <= 1, near, np.where(dist < 2, far, 0.0))


def interp_matrix(n_out: int, n_in: int, mode: str) -> np.ndarray:
    """[n_out, n_in] fp32 resampling matrix of ``F.interpolate(align_corners=False)`` along one axis:
    src_i = (i + 1/2) n_in / n_out - 1/2; taps floor(src) + {0, 1} (bilinear) or {-1..2} (bicubic), clamped to
    the border; weight = kernel(|src - tap|) before clamping."""
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * n_in / n_out - 0.5
    base = np.floor(src)
    offsets = np.arange(0, 2) if mode == "bilinear" else np.arange(-1, 3)
    taps = base[:, None] + offsets[None, :]
    w = _kernel_weights(np.abs(src[:, None] - taps), mode)
    out = np.zeros((n_out, n_in), np.float64)
    np.add.at(out, (np.repeat(np.arange(n_out), len(offsets)), np.clip(taps, 0, n_in - 1).astype(int).ravel()),
              w.ravel())
    return out.astype(np.float32)


def time_embedding(n_frames: int, dim: int) -> np.ndarray:
    """[n_frames, dim] fixed sin-cos table: row f = [sin(f w_0..w_{D/2-1}), cos(f w_0..)], w_i = 10000^(-2i/D)."""
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    f = np.outer(np.arange(n_frames, dtype=np.float32), inv)
    return np.concatenate([np.sin(f), np.cos(f)], axis=1).astype(np.float32)


def rope_angles_N(grid: Grid, head_dim: int, theta: float) -> np.ndarray:
    """[N, head_dim/2] rotation angle of each adjacent channel pair of every patch (see the module docstring);
    frames of a clip share their grid's angles."""
    k = np.arange(head_dim // 4, dtype=np.float32)
    inv = (1.0 / (theta ** (4.0 * k / head_dim))).astype(np.float32)
    out = []
    for t, h, w in grid:
        row, col = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
        ang = np.stack([col.reshape(-1, 1) * inv, row.reshape(-1, 1) * inv], axis=-1)  # [h*w, d/4, 2]: x, y
        out.append(np.tile(ang.reshape(h * w, head_dim // 2), (t, 1)))
    return np.concatenate(out).astype(np.float32)


def segment_ids_N(grid: Grid) -> np.ndarray:
    """[N] the clip each patch belongs to (attention stays inside a clip, all its frames together)."""
    return np.concatenate([np.full(t * h * w, i, np.int32) for i, (t, h, w) in enumerate(grid)])


# ---------------------------------------------------------------------------------------------------------------
# pure math
def layer_norm(x, weight, bias, eps: float):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last axis, in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_pairs(x_NHK, angles_NJ):
    """Rotate adjacent channel pairs: (a, b) at (2j, 2j+1) -> (a cos - b sin, a sin + b cos), angle_j; fp32."""
    N, H, K = x_NHK.shape
    x = x_NHK.astype(jnp.float32).reshape(N, H, K // 2, 2)
    c, s = jnp.cos(angles_NJ)[:, None, :], jnp.sin(angles_NJ)[:, None, :]
    a, b = x[..., 0], x[..., 1]
    return jnp.stack([a * c - b * s, a * s + b * c], -1).reshape(N, H, K).astype(x_NHK.dtype)


def full_attention(q_NHK, k_NHK, v_NHK, mask_NN=None):
    """softmax(q k^T / sqrt(K) + mask) v over one sequence (mask: -inf where False); fp32 softmax."""
    s_HNN = jnp.einsum("nhk,mhk->hnm", q_NHK.astype(jnp.float32), k_NHK.astype(jnp.float32))
    s_HNN = s_HNN / math.sqrt(q_NHK.shape[-1])
    if mask_NN is not None:
        s_HNN = jnp.where(mask_NN[None], s_HNN, -jnp.inf)
    p_HNN = jax.nn.softmax(s_HNN, axis=-1)
    return jnp.einsum("hnm,mhk->nhk", p_HNN, v_NHK.astype(jnp.float32)).astype(q_NHK.dtype)


def segment_attention(q_NHK, k_NHK, v_NHK, seg_N):
    """The packed reference: attention over all N patches with -inf between patches of different clips."""
    return full_attention(q_NHK, k_NHK, v_NHK, seg_N[:, None] == seg_N[None, :])


def clip_attention(q_NHK, k_NHK, v_NHK, grid: Grid):
    """``segment_attention`` clip by clip, what the tower runs: each clip's patches (static offsets from the grid)
    attend among themselves only, so the scores are [H, n_i, n_i] per clip instead of [H, N, N] for the packed
    sequence (a batch of large images no longer costs N^2 memory, and no score is computed only to be masked)."""
    out, start = [], 0
    for t, h, w in grid:
        n = t * h * w
        out.append(full_attention(q_NHK[start:start + n], k_NHK[start:start + n], v_NHK[start:start + n]))
        start += n
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=0)


def temporal_spatial_merge(x_ND, grid: Grid, kernel: tuple[int, int]):
    """[M, kh*kw, D]: per clip, the mean over its t frames, then each kh x kw group of patches (row-major inside
    the group, groups in row-major order over the (h/kh) x (w/kw) grid)."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grid:
        clip = x_ND[start:start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, -1).mean(axis=0)
        out.append(clip.transpose(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
        start += t * h * w
    return jnp.concatenate(out, axis=0)


def merge_media(x_BTD, tokens_BT, feats_MD, placeholder_id: int):
    """The embeddings with the placeholder positions replaced, in order (row-major over the batch), by the M
    feature rows: x[b, t] = feats[#placeholders before (b, t)] where tokens[b, t] == placeholder_id."""
    B, T = tokens_BT.shape
    mask_BT = tokens_BT == placeholder_id
    idx_BT = (jnp.cumsum(mask_BT.reshape(-1)) - 1).reshape(B, T)
    picked_BTD = jnp.take(feats_MD.astype(x_BTD.dtype), jnp.clip(idx_BT, 0, feats_MD.shape[0] - 1), axis=0)
    return jnp.where(mask_BT[..., None], picked_BTD, x_BTD)


# ---------------------------------------------------------------------------------------------------------------
# modules (attribute paths = official checkpoint names)
class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)


def make_norm(vcfg: VisionConfig, dim: int, eps: float):
    return LayerNorm(dim, eps) if vcfg.norm == "layernorm" else RMSNorm(dim, eps)


class PosEmb(nnx.Module):
    """The learnable [H, W, D] position table (``patch_embed.pos_emb.weight``)."""

    def __init__(self, vcfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vcfg.pos_emb_height, vcfg.pos_emb_width, vcfg.hidden_size),
                                            dtype))
        self.mode = vcfg.pos_emb_interpolation
        self.n_frames = vcfg.pos_emb_time

    def __call__(self, grid: Grid):
        """[N, D]: per clip interp_h @ table @ interp_w^T (+ the time row of each frame when t > 1)."""
        table_HWD = self.weight[...].astype(jnp.float32)
        H, W, D = table_HWD.shape
        time_FD = jnp.asarray(time_embedding(self.n_frames, D))
        out = []
        for t, h, w in grid:
            pos_hwD = jnp.einsum("hH,HWD,wW->hwD", jnp.asarray(interp_matrix(h, H, self.mode)), table_HWD,
                                 jnp.asarray(interp_matrix(w, W, self.mode))).reshape(1, h * w, D)
            pos_thwD = pos_hwD + (time_FD[:t, None, :] if t > 1 else 0.0)
            out.append(jnp.broadcast_to(pos_thwD, (t, h * w, D)).reshape(t * h * w, D))
        return jnp.concatenate(out, axis=0)


class PatchEmbed(nnx.Module):
    def __init__(self, vcfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.proj = Linear(vcfg.patch_dim, vcfg.hidden_size, dtype=dtype, rngs=rngs, use_bias=vcfg.patch_embed_bias)
        self.pos_emb = PosEmb(vcfg, dtype=dtype, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, vcfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.fc0 = Linear(vcfg.hidden_size, vcfg.intermediate_size, dtype=dtype, rngs=rngs, use_bias=True)
        self.fc1 = Linear(vcfg.intermediate_size, vcfg.hidden_size, dtype=dtype, rngs=rngs, use_bias=True)

    def __call__(self, x):
        return self.fc1(jax.nn.gelu(self.fc0(x), approximate=True))


class Block(nnx.Module):
    def __init__(self, vcfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.vcfg = vcfg
        self.norm0 = make_norm(vcfg, vcfg.hidden_size, vcfg.norm_eps)
        self.norm1 = make_norm(vcfg, vcfg.hidden_size, vcfg.norm_eps)
        self.wqkv = Linear(vcfg.hidden_size, 3 * vcfg.qkv_dim, dtype=dtype, rngs=rngs, use_bias=True)
        self.wo = Linear(vcfg.qkv_dim, vcfg.hidden_size, dtype=dtype, rngs=rngs, use_bias=True)
        self.mlp = MLP(vcfg, dtype=dtype, rngs=rngs)

    def __call__(self, x_ND, angles_NJ, grid: Grid):
        N, H, K = x_ND.shape[0], self.vcfg.num_attention_heads, self.vcfg.head_dim
        qkv = self.wqkv(self.norm0(x_ND)).reshape(N, 3, H, K)
        q, k, v = rope_pairs(qkv[:, 0], angles_NJ), rope_pairs(qkv[:, 1], angles_NJ), qkv[:, 2]
        x_ND = x_ND + self.wo(clip_attention(q, k, v, grid).reshape(N, H * K))
        return x_ND + self.mlp(self.norm1(x_ND))


class Encoder(nnx.Module):
    def __init__(self, vcfg: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(vcfg, dtype=dtype, rngs=rngs) for _ in range(vcfg.num_hidden_layers)])
        self.final_layernorm = make_norm(vcfg, vcfg.hidden_size, vcfg.norm_eps)


class MoonViT(nnx.Module):
    """The vision tower (``vision_tower.*``): flat patches + grid -> pooled merged patches [M, kh*kw, D]."""

    def __init__(self, vcfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.vcfg = vcfg
        self.patch_embed = PatchEmbed(vcfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(vcfg, dtype=dtype, rngs=rngs)

    def hidden_states(self, patches_NX, grid: Grid):
        """[N, D]: the encoder's output after the final norm, before pooling."""
        vcfg = self.vcfg
        x_ND = self.patch_embed.proj(patches_NX.astype(self.patch_embed.proj.kernel.dtype))
        x_ND = x_ND + self.patch_embed.pos_emb(grid).astype(x_ND.dtype)
        angles_NJ = jnp.asarray(rope_angles_N(grid, vcfg.head_dim, vcfg.rope_theta))
        for block in self.encoder.blocks:
            x_ND = block(x_ND, angles_NJ, grid)
        return self.encoder.final_layernorm(x_ND)

    def __call__(self, patches_NX, grid: Grid):
        return temporal_spatial_merge(self.hidden_states(patches_NX, grid), grid, self.vcfg.merge_kernel_size)


class Projector(nnx.Module):
    """``mm_projector``: pooled [M, kh*kw, D] -> [M, text_dim].

    patchmerger (K2.5):    LayerNorm(D) per patch -> flatten -> Linear(kD, kD) -> GELU -> Linear(kD, text_dim)
    patchmerger_v2 (K3):   flatten -> Linear(kD, kD, no bias) -> GELU -> Linear(kD, text_dim, no bias)
                           -> RMSNorm(text_dim)                                        (GELU: the exact erf form)"""

    def __init__(self, vcfg: VisionConfig, text_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.kind = vcfg.projector
        kD, bias = vcfg.merged_dim, vcfg.projector == "patchmerger"
        if bias:
            self.pre_norm = LayerNorm(vcfg.hidden_size, vcfg.projector_eps)
        self.proj0 = Linear(kD, kD, dtype=dtype, rngs=rngs, use_bias=bias)
        self.proj2 = Linear(kD, text_dim, dtype=dtype, rngs=rngs, use_bias=bias)
        if not bias:
            self.post_norm = RMSNorm(text_dim, vcfg.projector_eps)

    def __call__(self, pooled_MKD):
        M = pooled_MKD.shape[0]
        x = self.pre_norm(pooled_MKD) if self.kind == "patchmerger" else pooled_MKD
        y = self.proj2(jax.nn.gelu(self.proj0(x.reshape(M, -1)), approximate=False))
        return self.post_norm(y) if self.kind == "patchmerger_v2" else y


# ---------------------------------------------------------------------------------------------------------------
# the jitted entry point
def _encode_pure(t_graph, t_state, p_graph, p_state, patches_NX, grid):
    tower, proj = nnx.merge(t_graph, t_state), nnx.merge(p_graph, p_state)
    return proj(tower(patches_NX, grid))


_encode_jit = jax.jit(_encode_pure, static_argnums=(0, 2, 5))


def encode(tower: MoonViT, projector: Projector, pixel_values, grid_thw) -> jax.Array:
    """[M, text_dim] features of the packed clips: ``pixel_values`` [N, C, p, p] (or [N, C*p*p]) and
    ``grid_thw`` [n, 3]; one compiled program per distinct grid."""
    vcfg = tower.vcfg
    pv = np.asarray(pixel_values) if not isinstance(pixel_values, jax.Array) else pixel_values
    if pv.ndim == 4 and pv.shape[1] != vcfg.in_channels:
        raise ValueError(f"pixel_values: {pv.shape[1]} channels, the vision tower takes {vcfg.in_channels}")
    if pv.ndim == 4 and pv.shape[2:] != (vcfg.patch_size, vcfg.patch_size):
        raise ValueError(f"pixel_values: patches of {tuple(pv.shape[2:])}, expected "
                         f"{(vcfg.patch_size, vcfg.patch_size)}")
    if pv.ndim not in (2, 4) or pv.reshape(pv.shape[0], -1).shape[1] != vcfg.patch_dim:
        raise ValueError(f"pixel_values: expected [N, {vcfg.in_channels}, {vcfg.patch_size}, {vcfg.patch_size}], "
                         f"got shape {tuple(pv.shape)}")
    grid = check_grid(grid_thw, vcfg, pv.shape[0])
    t_graph, t_state = nnx.split(tower)
    p_graph, p_state = nnx.split(projector)
    return _encode_jit(t_graph, t_state, p_graph, p_state, jnp.asarray(pv, jnp.float32).reshape(pv.shape[0], -1),
                       grid)


def num_media_tokens(grid: Sequence[Sequence[int]], vcfg: VisionConfig) -> list[int]:
    """Placeholder tokens each clip takes in the prompt: (h / kh)(w / kw) (its frames are pooled into one)."""
    return [(int(h) // vcfg.merge_kernel_size[0]) * (int(w) // vcfg.merge_kernel_size[1]) for _, h, w in grid]
