"""Multi-head latent attention (MLA) over a latent cache: unabsorbed (prefill, reference) and absorbed (decode).

Per token the cache holds c_kv (kv_lora_rank values, after kv_a_layernorm) and k_pe (the rope slice, one key
shared by all heads). With W_kvb reshaped to [H, N + V, L] (N = nope dim, V = value dim, L = kv_lora_rank):

  unabsorbed:  k_nope[s,h] = W_kvb[h,:N] c_kv[s],  v[s,h] = W_kvb[h,N:] c_kv[s]
               logit[t,h,s] = scale * (q_nope[t,h] . k_nope[s,h] + q_pe[t,h] . k_pe[s])
  absorbed:    q_lat[t,h] = W_kvb[h,:N]^T q_nope[t,h]                          (L values)
               logit[t,h,s] = scale * (q_lat[t,h] . c_kv[s] + q_pe[t,h] . k_pe[s])
               o_lat[t,h] = sum_s p[t,h,s] c_kv[s];  o[t,h] = W_kvb[h,N:] o_lat[t,h]

Both are the same function of the inputs; scale = (N + R)^-1/2. Masking: key s is visible to query t iff
s <= q_pos[t] and s < kv_len; the mask is applied to the logits before the fp32 softmax.
"""

import jax
import jax.numpy as jnp

_NEG = -1e30


def split_kv_b(w_kvb_LP, num_heads: int, nope_dim: int, v_dim: int):
    """kv_b kernel [L, H*(N+V)] (x @ kernel layout) -> (w_uk_HNL, w_uv_HVL)."""
    L = w_kvb_LP.shape[0]
    w = w_kvb_LP.reshape(L, num_heads, nope_dim + v_dim)
    w_uk_HNL = jnp.transpose(w[:, :, :nope_dim], (1, 2, 0))
    w_uv_HVL = jnp.transpose(w[:, :, nope_dim:], (1, 2, 0))
    return w_uk_HNL, w_uv_HVL


def attention_mask_BTS(q_pos_BT, kv_len_B, S: int):
    """Visible[b,t,s] = (s <= q_pos[b,t]) & (s < kv_len[b])."""
    s = jnp.arange(S, dtype=jnp.int32)
    return (s[None, None, :] <= q_pos_BT[:, :, None]) & (s[None, None, :] < kv_len_B[:, None, None])


def _softmax_masked(logits_BHTS, mask_BTS):
    logits = jnp.where(mask_BTS[:, None], logits_BHTS, _NEG)
    return jax.nn.softmax(logits, axis=-1)


def _rope_logits(logits_BHTS, q_pe_BTHR, kpe_BSR):
    """The rope slice's share of the attention logits (none when the rope slice is empty)."""
    if not q_pe_BTHR.shape[-1]:
        return logits_BHTS
    return logits_BHTS + jnp.einsum("bthr,bsr->bhts", q_pe_BTHR.astype(jnp.float32), kpe_BSR.astype(jnp.float32))


def mla_attend_unabsorbed(q_nope_BTHN, q_pe_BTHR, ckv_BSL, kpe_BSR, w_kvb_LP, q_pos_BT, kv_len_B, v_dim: int):
    """Reference form: expand every cached latent to per-head keys and values. Returns o_BTHV (fp32)."""
    H, N = q_nope_BTHN.shape[2], q_nope_BTHN.shape[3]
    R, S, f32 = q_pe_BTHR.shape[-1], ckv_BSL.shape[1], jnp.float32
    w_uk_HNL, w_uv_HVL = split_kv_b(w_kvb_LP.astype(f32), H, N, v_dim)
    k_nope_BSHN = jnp.einsum("bsl,hnl->bshn", ckv_BSL.astype(f32), w_uk_HNL)
    v_BSHV = jnp.einsum("bsl,hvl->bshv", ckv_BSL.astype(f32), w_uv_HVL)
    scale = (N + R) ** -0.5
    logits = _rope_logits(jnp.einsum("bthn,bshn->bhts", q_nope_BTHN.astype(f32), k_nope_BSHN), q_pe_BTHR, kpe_BSR)
    p = _softmax_masked(logits * scale, attention_mask_BTS(q_pos_BT, kv_len_B, S))
    return jnp.einsum("bhts,bshv->bthv", p, v_BSHV)


def mla_attend_absorbed(q_nope_BTHN, q_pe_BTHR, ckv_BSL, kpe_BSR, w_kvb_LP, q_pos_BT, kv_len_B, v_dim: int):
    """Absorbed form: MQA in latent space with (L + R)-wide keys and L-wide values. Returns o_BTHV (fp32)."""
    H, N = q_nope_BTHN.shape[2], q_nope_BTHN.shape[3]
    R, S, f32 = q_pe_BTHR.shape[-1], ckv_BSL.shape[1], jnp.float32
    w_uk_HNL, w_uv_HVL = split_kv_b(w_kvb_LP.astype(f32), H, N, v_dim)
    q_lat_BTHL = jnp.einsum("bthn,hnl->bthl", q_nope_BTHN.astype(f32), w_uk_HNL)
    scale = (N + R) ** -0.5
    logits = _rope_logits(jnp.einsum("bthl,bsl->bhts", q_lat_BTHL, ckv_BSL.astype(f32)), q_pe_BTHR, kpe_BSR)
    p = _softmax_masked(logits * scale, attention_mask_BTS(q_pos_BT, kv_len_B, S))
    o_lat_BTHL = jnp.einsum("bhts,bsl->bthl", p, ckv_BSL.astype(f32))
    return jnp.einsum("bthl,hvl->bthv", o_lat_BTHL, w_uv_HVL)

