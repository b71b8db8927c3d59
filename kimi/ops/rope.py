"""Rotary position embedding, NeoX (rotate-half) layout: the DSpark drafter's (Qwen3 'default') and MLA's rope
slice (DeepSeek-style configs; K3 and Kimi-Linear are NoPE)."""

import jax.numpy as jnp


def rope_neox(x_SHK, pos_S, theta: float):
    """x * cos + rotate_half(x) * sin, angles pos * theta^(-2i/K), in x's dtype (cos and sin cast to it).

    x: [..., S, H, K]; pos: [..., S], broadcastable to x's leading axes."""
    k = x_SHK.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    ang = jnp.asarray(pos_S).astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([ang, ang], axis=-1)
    cos = jnp.cos(emb).astype(x_SHK.dtype)[..., None, :]
    sin = jnp.sin(emb).astype(x_SHK.dtype)[..., None, :]
    x1, x2 = x_SHK[..., : k // 2], x_SHK[..., k // 2:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_SHK * cos + rot * sin
