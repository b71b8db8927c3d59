"""Gated MLP activations: SiTU-GLU (K3) and SwiGLU (Kimi-Linear), both in fp32."""

from typing import Optional

import jax
import jax.numpy as jnp


def situ_glu(gate, up, beta: Optional[float], linear_beta: Optional[float]):
    """SiTU(g, u) = beta * tanh(g / beta) * sigmoid(g) * lin(u), lin(u) = linear_beta * tanh(u / linear_beta).

    As the official code: beta defaults to 1.0 when None, and ``up`` is left unchanged when linear_beta is None.
    """
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    b = 1.0 if beta is None else float(beta)
    act = b * jnp.tanh(g / b) * jax.nn.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * jnp.tanh(u / linear_beta)
    return (act * u).astype(gate.dtype)


def swiglu(gate, up):
    """SwiGLU(g, u) = silu(g) * u."""
    g = gate.astype(jnp.float32)
    return (jax.nn.silu(g) * up.astype(jnp.float32)).astype(gate.dtype)


def glu(gate, up, act: str, beta=None, linear_beta=None):
    """The gated activation named by ``KimiConfig.hidden_act``."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act: expected 'situ' or 'silu', got {act!r}")
