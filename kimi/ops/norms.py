"""RMSNorm with an fp32 variance: Kimi's (the gain applied in fp32) and Qwen3's (the gain applied after the cast
back to the input dtype, as the DSpark drafter's torch reference does)."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def qwen3_rms_norm(x, weight, eps: float):
    """Qwen3RMSNorm: variance in fp32, normalised x cast back to the input dtype *before* the weight multiply."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)
