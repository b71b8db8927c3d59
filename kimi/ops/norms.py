"""RMSNorm with an fp32 variance."""

import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (y * weight.astype(jnp.float32)).astype(x.dtype)
