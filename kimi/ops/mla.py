"""Multi-head latent attention (MLA) over a latent cache: unabsorbed (prefill, reference) and absorbed (decode).

Per token the cache holds c_kv (kv_lora_rank values, after kv_a_layernorm) and k_pe (the rope slice, one key
shared by all heads). With W_kvb reshaped to [H, N + V, L] (N = nope dim, V = value dim, L = kv_lora_rank):

  unabsorbed:  k_nope[s,h] = W_kvb[h,:N] c_kv[s],  v[s,h] = W_kvb[h,N:] c_kv[s]
               logit[t,h,s] = scale * (q_nope[t,h] . k_nope[s,h] + q_pe[t,h] . k_pe[s])
  absorbed:    q_lat[t,h] = W_kvb[h,:N]^T q_nope[t,h]                          (L values)
               logit[t,h,s] = scale * (q_lat[t,h] . c_kv[s] + q_pe[t,h] . k_pe[s])
               o_lat[t,h] = sum_s p[t,h,s] c_kv[s];  o[t,h] = W_kvb[h,N:] o_lat[t,h]

  tiled:       the unabsorbed form over key tiles s in [j*K, (j+1)*K) with an online softmax (running max m,
               sum l, output acc; per tile: m' = max(m, max_s logit), acc = acc * e^(m - m') + sum_s e^(logit - m') v,
               l = l * e^(m - m') + sum_s e^(logit - m')), o = acc / l. Only the tiles below max(kv_len) run, so a
               chunk of a long prefill holds [T, K] scores per head, not [T, S], and skips the cache's empty tail.

  absorbed, tiled:  the absorbed form over key tiles with the same online softmax (a verify over a long cache on
               CPU, ``kimi.dispatch.mla_absorbed_key_tile``): the [H * T, tile] scores of a tile stay in cache where
               the whole [H * T, S] scores would be written and read back from memory by each pass over them
               (mask, max, exp-sum, weighted sum).

All are the same function of the inputs; scale = (N + R)^-1/2. Masking: key s is visible to query t iff
s <= q_pos[t] and s < kv_len; the mask is applied to the logits before the fp32 softmax (before ``exp`` in the
tiled form).
"""

import jax
import jax.numpy as jnp
import numpy as np

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
    B, T = q_pos_BT.shape
    # o_lat = p @ c_kv as one [B, H*T, S] x [B, S, L] product with the keys' axis contracted where it lies: written
    # as the einsum "bhts,bsl->bthl", XLA:CPU transposed the whole cache to [L, S] on every step (2.3x the time)
    o_lat_BQL = jax.lax.dot_general(p.reshape(B, H * T, S), ckv_BSL.astype(f32), (((2,), (1,)), ((0,), (0,))))
    o_lat_BHTL = o_lat_BQL.reshape(B, H, T, -1)
    return jnp.einsum("bhtl,hvl->bthv", o_lat_BHTL, w_uv_HVL)



def _key_tile(cache, layer, start, tile: int):
    """Keys [start, start + tile) of every row of a latent cache: ``cache`` [B, S, X], or with ``layer`` (static)
    entry ``layer`` of a stacked [n_layers, B, S, X] cache, read where it lies (``cache[layer]`` first would copy
    that layer's whole cache on every call: the slice feeds a loop, and XLA:CPU materialises it)."""
    if layer is None:
        return jax.lax.dynamic_slice_in_dim(cache, start, tile, axis=1)
    _, B, _, X = cache.shape
    return jax.lax.dynamic_slice(cache, (layer, 0, start, 0), (1, B, tile, X))[0]


def _cache_layer(cache, layer):
    """The [B, S, X] cache of ``layer`` (static) of a stacked cache, or ``cache`` itself when ``layer`` is None."""
    return cache if layer is None else cache[layer]


def _tile_visible(start, j, tile: int, q_pos_BT, kv_len_B):
    """[B, T, tile]: key start + k is visible to query t (causal, below kv_len) and not an earlier tile's (the
    last tile is shifted back to end at S, so its first keys were already covered)."""
    s_K = start + jnp.arange(tile, dtype=jnp.int32)
    return ((s_K[None, None] <= q_pos_BT[:, :, None]) & (s_K[None, None] < kv_len_B[:, None, None])
            & (s_K[None, None] >= j * tile))


def _online_softmax_tile(m, l, logits, vis):
    """One key tile's step of the online softmax: masked logits (mask before ``exp``), then
    m' = max(m, max_k logit), p = e^(logit - m') (0 where masked), alpha = e^(m - m'), l' = l alpha + sum_k p.
    Returns (m', l', p, alpha); the caller rescales its accumulator by alpha and adds p's weighted values."""
    logits = jnp.where(vis, logits, _NEG)
    m_new = jnp.maximum(m, logits.max(-1))
    p = jnp.where(vis, jnp.exp(logits - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(-1), p, alpha


def mla_attend_tiled(q_nope_BTHN, q_pe_BTHR, ckv_BSL, kpe_BSR, w_kvb_LP, q_pos_BT, kv_len_B, v_dim: int,
                     tile: int, layer=None):
    """The unabsorbed form, key tile by key tile (online softmax; see the module docstring). Returns o_BTHV (fp32).

    Tiles start at j * tile; the last one is shifted back to end at S (a ``dynamic_slice`` stays in bounds) and
    keys an earlier tile already covered are masked out of it. The loop runs ceil(max(kv_len) / tile) tiles (a
    ``fori_loop`` with a traced trip count): peak memory is one tile's keys, values and [B, H, T, tile] scores.
    With ``layer`` (static) ``ckv``/``kpe`` are stacked [n_layers, B, S, .] caches and entry ``layer`` is read, tile by
    tile where it lies (``_key_tile``)."""
    B, T, H, N = q_nope_BTHN.shape
    R, S, f32 = q_pe_BTHR.shape[-1], ckv_BSL.shape[-2], jnp.float32
    if tile >= S:
        return mla_attend_unabsorbed(q_nope_BTHN, q_pe_BTHR, _cache_layer(ckv_BSL, layer), _cache_layer(kpe_BSR, layer),
                                     w_kvb_LP, q_pos_BT, kv_len_B, v_dim)
    w_uk_HNL, w_uv_HVL = split_kv_b(w_kvb_LP.astype(f32), H, N, v_dim)
    scale = np.float32((N + R) ** -0.5)
    q_nope, q_pe = q_nope_BTHN.astype(f32) * scale, q_pe_BTHR.astype(f32) * scale

    def body(j, carry):
        m_BHT, l_BHT, acc_BTHV = carry
        start = jnp.minimum(j * tile, S - tile)
        ckv_BKL = _key_tile(ckv_BSL, layer, start, tile).astype(f32)
        kpe_BKR = _key_tile(kpe_BSR, layer, start, tile)
        k_BKHN = jnp.einsum("bkl,hnl->bkhn", ckv_BKL, w_uk_HNL)
        v_BKHV = jnp.einsum("bkl,hvl->bkhv", ckv_BKL, w_uv_HVL)
        logits = _rope_logits(jnp.einsum("bthn,bkhn->bhtk", q_nope, k_BKHN), q_pe, kpe_BKR)
        vis_BTK = _tile_visible(start, j, tile, q_pos_BT, kv_len_B)
        m_new, l_BHT, p_BHTK, alpha_BHT = _online_softmax_tile(m_BHT, l_BHT, logits, vis_BTK[:, None])
        acc_BTHV = acc_BTHV * jnp.transpose(alpha_BHT, (0, 2, 1))[..., None] + jnp.einsum(
            "bhtk,bkhv->bthv", p_BHTK, v_BKHV)
        return m_new, l_BHT, acc_BTHV

    n_tiles = (jnp.max(kv_len_B) + tile - 1) // tile
    init = (jnp.full((B, H, T), _NEG, f32), jnp.zeros((B, H, T), f32), jnp.zeros((B, T, H, v_dim), f32))
    _, l_BHT, acc_BTHV = jax.lax.fori_loop(0, n_tiles, body, init)
    l_BTH = jnp.transpose(l_BHT, (0, 2, 1))
    return acc_BTHV / jnp.where(l_BTH > 0, l_BTH, 1.0)[..., None]


def mla_attend_absorbed_tiled(q_nope_BTHN, q_pe_BTHR, ckv_BSL, kpe_BSR, w_kvb_LP, q_pos_BT, kv_len_B, v_dim: int,
                              tile: int, layer=None):
    """The absorbed form, key tile by key tile (online softmax; see the module docstring). Returns o_BTHV (fp32).

    Per tile j (keys [start, start + tile), start = min(j * tile, S - tile); keys below j * tile belong to an
    earlier tile and are masked here): s = q_lat . c_kv + q_pe . k_pe (scale folded into the queries), then
    m' = max(m, max_k s), acc = acc e^(m - m') + sum_k e^(s - m') c_kv[k], l = l e^(m - m') + sum_k e^(s - m');
    o_lat = acc / l and o = W_uv o_lat. ceil(max(kv_len) / tile) tiles run (the cache's empty tail is skipped).
    With ``layer`` (static) ``ckv``/``kpe`` are stacked [n_layers, B, S, .] caches, read as in ``mla_attend_tiled``."""
    B, T, H, N = q_nope_BTHN.shape
    R, S, f32 = q_pe_BTHR.shape[-1], ckv_BSL.shape[-2], jnp.float32
    if tile >= S:
        return mla_attend_absorbed(q_nope_BTHN, q_pe_BTHR, _cache_layer(ckv_BSL, layer), _cache_layer(kpe_BSR, layer),
                                   w_kvb_LP, q_pos_BT, kv_len_B, v_dim)
    w_uk_HNL, w_uv_HVL = split_kv_b(w_kvb_LP.astype(f32), H, N, v_dim)
    scale = np.float32((N + R) ** -0.5)
    q_lat_BQL = jnp.einsum("bthn,hnl->bhtl", q_nope_BTHN.astype(f32) * scale, w_uk_HNL).reshape(B, H * T, -1)
    q_pe_BQR = jnp.transpose(q_pe_BTHR.astype(f32) * scale, (0, 2, 1, 3)).reshape(B, H * T, R)
    keys = (((2,), (2,)), ((0,), (0,)))  # [B, Q, X] x [B, K, X] -> [B, Q, K]: the tile's keys where they lie

    def body(j, carry):
        m_BQ, l_BQ, acc_BQL = carry
        start = jnp.minimum(j * tile, S - tile)
        ckv_BKL = _key_tile(ckv_BSL, layer, start, tile).astype(f32)
        s_BQK = jax.lax.dot_general(q_lat_BQL, ckv_BKL, keys)
        if R:
            kpe_BKR = _key_tile(kpe_BSR, layer, start, tile).astype(f32)
            s_BQK = s_BQK + jax.lax.dot_general(q_pe_BQR, kpe_BKR, keys)
        vis_BTK = _tile_visible(start, j, tile, q_pos_BT, kv_len_B)
        vis_BQK = jnp.broadcast_to(vis_BTK[:, None], (B, H, T, tile)).reshape(B, H * T, tile)
        m_new, l_BQ, p_BQK, alpha_BQ = _online_softmax_tile(m_BQ, l_BQ, s_BQK, vis_BQK)
        acc_BQL = acc_BQL * alpha_BQ[..., None] + jax.lax.dot_general(p_BQK, ckv_BKL, (((2,), (1,)), ((0,), (0,))))
        return m_new, l_BQ, acc_BQL

    n_tiles = (jnp.max(kv_len_B) + tile - 1) // tile
    Q, L = H * T, ckv_BSL.shape[-1]
    init = (jnp.full((B, Q), _NEG, f32), jnp.zeros((B, Q), f32), jnp.zeros((B, Q, L), f32))
    _, l_BQ, acc_BQL = jax.lax.fori_loop(0, n_tiles, body, init)
    o_lat_BHTL = (acc_BQL / jnp.where(l_BQ > 0, l_BQ, 1.0)[..., None]).reshape(B, H, T, L)
    return jnp.einsum("bhtl,hvl->bthv", o_lat_BHTL, w_uv_HVL)
