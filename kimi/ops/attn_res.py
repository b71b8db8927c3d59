"""Block Attention Residuals: a softmax over depth sources, per token, in fp32.

At a site with pseudo-query w (= norm.weight * proj.weight) and sources V = [b_0 .. b_{n-1}, prefix]:
  K_i = V_i / sqrt(mean(V_i^2) + eps)          (unscaled RMSNorm of each source)
  p   = softmax_i(K_i . w)
  h   = sum_i p_i V_i                          (weights applied to the raw sources)
Sealed blocks live in a static buffer [B, T, N_max, D]; slots >= n_blocks are masked before the softmax.
"""

import jax
import jax.numpy as jnp


def attn_res(prefix_BTD, blocks_BTND, n_blocks, w_D, eps: float):
    """Mix ``prefix`` with the first ``n_blocks`` sealed blocks. ``n_blocks`` may be a Python int or traced."""
    f32 = jnp.float32
    V_BTND = jnp.concatenate([blocks_BTND.astype(f32), prefix_BTD.astype(f32)[:, :, None]], axis=2)
    K = V_BTND * jax.lax.rsqrt(jnp.mean(V_BTND * V_BTND, axis=-1, keepdims=True) + eps)
    logits_BTN = jnp.einsum("btnd,d->btn", K, w_D.astype(f32))
    n_max = blocks_BTND.shape[2]
    slot = jnp.arange(n_max + 1)
    valid = (slot < n_blocks) | (slot == n_max)
    logits_BTN = jnp.where(valid, logits_BTN, -jnp.inf)
    p_BTN = jax.nn.softmax(logits_BTN, axis=-1)
    return jnp.einsum("btn,btnd->btd", p_BTN, V_BTND).astype(prefix_BTD.dtype)


def attn_res_reference(prefix_BTD, blocks, w_D, eps: float):
    """The same with a Python list of sealed blocks (the obvious form, for tests)."""
    V = jnp.stack(list(blocks) + [prefix_BTD], axis=2).astype(jnp.float32)
    K = V / jnp.sqrt(jnp.mean(V**2, axis=-1, keepdims=True) + eps)
    p = jax.nn.softmax(K @ w_D.astype(jnp.float32), axis=-1)
    return (p[..., None] * V).sum(2)
