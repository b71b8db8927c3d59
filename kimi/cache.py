"""The decode cache: a registered dataclass pytree, donated to every jitted step.

Per KDA layer: the fp32 recurrent state [B, H, K, V] and the conv state (the last kernel-1 pre-conv q/k/v
projections, [B, W, 3P]). Per MLA layer: the latent cache, c_kv [B, S, L] and k_pe [B, S, R]. ``length`` [B] counts
the valid positions of each row; entries at or beyond it are ignored (masked), so rolling back is setting it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kimi.config import KimiConfig
from kimi.ops.kda import KDABlockTrace, kda_block_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KimiCache:
    kda_state: jax.Array  # [n_kda, B, H, K, V] fp32
    conv_state: jax.Array  # [n_kda, B, W, 3P]
    mla_ckv: jax.Array  # [n_mla, B, S, L]
    mla_kpe: jax.Array  # [n_mla, B, S, R]
    length: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.mla_ckv.shape[2]

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]

    @classmethod
    def init(cls, cfg: KimiConfig, batch_size: int, max_len: int) -> "KimiCache":
        if batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size}")
        if max_len <= 0:
            raise ValueError(f"max_len: expected a positive int, got {max_len}")
        nk, nm, B = cfg.num_kda_layers, cfg.num_mla_layers, batch_size
        H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size - 1
        return cls(
            kda_state=jnp.zeros((nk, B, H, K, K), jnp.float32),
            conv_state=jnp.zeros((nk, B, W, 3 * cfg.kda_proj_dim), cfg.dtype),
            mla_ckv=jnp.zeros((nm, B, max_len, cfg.kv_lora_rank), cfg.dtype),
            mla_kpe=jnp.zeros((nm, B, max_len, cfg.qk_rope_head_dim), cfg.dtype),
            length=jnp.zeros((B,), jnp.int32),
        )

    def padded_to(self, max_len: int) -> "KimiCache":
        """The same cache with room for ``max_len`` positions (the latent caches' empty tail zero-padded). A
        one-pass prefill runs on a cache of the prompt's own length and is padded after: its attention then
        scores the prompt's keys, not the whole cache's (a 128-token prompt into 1024-position slots: 8x)."""
        S = self.max_len
        if max_len < S:
            raise ValueError(f"max_len: expected >= the cache's {S} positions, got {max_len}")
        pad = ((0, 0), (0, 0), (0, max_len - S), (0, 0))
        return dataclasses.replace(self, mla_ckv=jnp.pad(self.mla_ckv, pad), mla_kpe=jnp.pad(self.mla_kpe, pad))

    def rows(self) -> "KimiCache":
        """The B rows as B batch-1 caches stacked on a new leading axis (kda_state [B, n_kda, 1, H, K, V], ...,
        length [B, 1]): what ``jax.vmap`` over a batch's rows reads, one batch-1 cache a row."""
        def split(x_LB):  # [layers, B, ...] -> [B, layers, 1, ...]
            return jnp.moveaxis(x_LB, 1, 0)[:, :, None]

        return KimiCache(split(self.kda_state), split(self.conv_state), split(self.mla_ckv), split(self.mla_kpe),
                         self.length[:, None])

    @classmethod
    def abstract(cls, cfg: KimiConfig, batch_size: int, max_len: int) -> "KimiCache":
        """Shapes and dtypes only (nothing allocated)."""
        return jax.eval_shape(lambda: cls.init(cfg, batch_size, max_len))


def select_verified(cache_after: KimiCache, kda_rollback, conv_states, length_before_B, n_keep_B) -> KimiCache:
    """Roll a cache that ``verify`` advanced by T positions back to the first ``n_keep`` (1..T) of them, per row.

    ``kda_rollback`` is verify's ``ModelOut.kda_rollback``: per-position states [n_kda, B, T, H, K, V] (picked),
    or a ``KDABlockTrace`` stacked over layers (the state after n_keep rebuilt from it, one small matmul per
    layer); nothing is re-run. conv_states [n_kda, B, T, W, C] are picked. MLA entries past the new length are
    masked.
    """
    idx_B = (n_keep_B - 1).astype(jnp.int32)

    def pick(states):
        if states.shape[0] == 0:
            return states[:, :, 0]
        i = idx_B.reshape((1, -1) + (1,) * (states.ndim - 2))
        return jnp.take_along_axis(states, i, axis=2)[:, :, 0]

    if kda_rollback is None:
        kda_state = cache_after.kda_state
    elif isinstance(kda_rollback, KDABlockTrace):
        kda_state = jax.vmap(kda_block_state, in_axes=(0, None))(kda_rollback, n_keep_B)
    else:
        kda_state = pick(kda_rollback)
    return dataclasses.replace(cache_after, kda_state=kda_state.astype(cache_after.kda_state.dtype),
                               conv_state=pick(conv_states), length=(length_before_B + n_keep_B).astype(jnp.int32))
