"""Weight matmuls: y = x @ W (or x @ W^T), the one place that decides how a stored weight is multiplied.

  float32 W:  the fp32 product (the checkpoint's numerics; parity and training).
  bfloat16 W with fp32 x (the serving copy in bf16, ``KimiConfig.serving_dtype``):
      y = float32( bf16(x) @ W )      inputs rounded to bf16, fp32 accumulation (``preferred_element_type``);
      the result in x's dtype. A bf16 product reads half the bytes and, on CPUs with AVX512-BF16, runs the matrix
      unit at twice the fp32 rate. Rows are zero-padded to ``kimi.dispatch.bf16_rows`` (a single row to 2: the
      bf16 matrix-vector path of XLA:CPU is slower than its matrix-matrix one). Decode (1 row) and a verify
      block (8 rows) round a row at the same points, but the fp32 sums that reach those points were taken in
      another order: a sum one fp32 ulp either side of a bf16 rounding boundary comes out a bf16 ulp apart, so
      greedy speculative decoding can break a near-tie of the serving copy the other way (the shipped pair: once
      in 8 x 256 greedy code tokens, a logit gap of 0.013; ``scripts/bench.py`` reports each such divergence).
      fp32 weights keep the two at fp32 rounding.
  bfloat16 W with bf16 x (a bf16 model): the bf16 product, as jnp.dot gives it.
"""

import jax
import jax.numpy as jnp

from kimi import dispatch


def matmul(x_MK, w, *, w_transposed: bool = False):
    """x [..., K] @ w ([K, N], or [N, K] with ``w_transposed``) -> [..., N]; see the module docstring."""
    contract = (((x_MK.ndim - 1,), (1 if w_transposed else 0,)), ((), ()))
    if w.dtype != jnp.bfloat16 or x_MK.dtype == jnp.bfloat16:
        return jax.lax.dot_general(x_MK, w.astype(x_MK.dtype), contract)
    lead, K = x_MK.shape[:-1], x_MK.shape[-1]
    x2 = x_MK.reshape(-1, K)
    M = x2.shape[0]
    rows = dispatch.bf16_rows(M)
    if rows > M:
        x2 = jnp.pad(x2, ((0, rows - M), (0, 0)))
    y = jax.lax.dot_general(x2.astype(jnp.bfloat16), w, (((1,), (1 if w_transposed else 0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y[:M].reshape(lead + (y.shape[-1],)).astype(x_MK.dtype)
