"""MLA absorbed vs unabsorbed, router selection, MoE dispatch paths, AttnRes buffer, SiTU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kimi
from kimi import dispatch, layers
from kimi.ops import activations, attn_res, linear, mla, moe


def test_mla_absorbed_equals_unabsorbed():
    B, T, S, H, N, R, L, V = 2, 5, 12, 3, 8, 4, 16, 8
    ks = jax.random.split(jax.random.key(0), 5)
    q_nope = jax.random.normal(ks[0], (B, T, H, N))
    q_pe = jax.random.normal(ks[1], (B, T, H, R))
    ckv = jax.random.normal(ks[2], (B, S, L))
    kpe = jax.random.normal(ks[3], (B, S, R))
    w_kvb = jax.random.normal(ks[4], (L, H * (N + V))) * 0.3
    length = jnp.array([3, 7], jnp.int32)
    q_pos = length[:, None] + jnp.arange(T)[None]
    a = mla.mla_attend_absorbed(q_nope, q_pe, ckv, kpe, w_kvb, q_pos, length + T, V)
    u = mla.mla_attend_unabsorbed(q_nope, q_pe, ckv, kpe, w_kvb, q_pos, length + T, V)
    np.testing.assert_allclose(a, u, atol=1e-5)
    # against an explicit per-head softmax attention, in float64 NumPy (JAX op by op compiled every slice shape)
    q_nope, q_pe, ckv, kpe, w_kvb, q_pos = (np.asarray(x, np.float64) for x in (q_nope, q_pe, ckv, kpe, w_kvb, q_pos))
    k_nope = np.einsum("bsl,lhn->bshn", ckv, w_kvb.reshape(L, H, N + V)[..., :N])
    v = np.einsum("bsl,lhv->bshv", ckv, w_kvb.reshape(L, H, N + V)[..., N:])
    for b in range(B):
        for t in range(T):
            n_vis = int(q_pos[b, t]) + 1
            for h in range(H):
                lg = (k_nope[b, :n_vis, h] @ q_nope[b, t, h] + kpe[b, :n_vis] @ q_pe[b, t, h]) / np.sqrt(N + R)
                p = np.exp(lg - lg.max())
                o = (p / p.sum()) @ v[b, :n_vis, h]
                np.testing.assert_allclose(a[b, t, h], o, atol=1e-5)


@pytest.mark.parametrize("form", ["unabsorbed", "absorbed"])
@pytest.mark.parametrize("tile", [4, 5, 11])
def test_mla_tiled_equals_one_pass(tile, form):
    """Both forms by key tiles (prefill chunks: unabsorbed; a verify over a long cache: absorbed) against their
    one-pass form: tiles that do and do not divide S (the last tile shifted back), rows whose visible keys end in
    different tiles (fewer tiles run than S holds), a row with padded queries."""
    tiled, one_pass = {"unabsorbed": (mla.mla_attend_tiled, mla.mla_attend_unabsorbed),
                       "absorbed": (mla.mla_attend_absorbed_tiled, mla.mla_attend_absorbed)}[form]
    B, T, S, H, N, R, L, V = 3, 4, 23, 2, 8, 4, 16, 8
    ks = jax.random.split(jax.random.key(1), 5)
    q_nope = jax.random.normal(ks[0], (B, T, H, N)) * 2
    q_pe = jax.random.normal(ks[1], (B, T, H, R))
    ckv = jax.random.normal(ks[2], (B, S, L))
    kpe = jax.random.normal(ks[3], (B, S, R))
    w_kvb = jax.random.normal(ks[4], (L, H * (N + V))) * 0.3
    length = jnp.array([0, 6, 19], jnp.int32)
    q_pos = length[:, None] + jnp.arange(T)[None]
    kv_len = length + jnp.array([T, T, 2], jnp.int32)
    want = one_pass(q_nope, q_pe, ckv, kpe, w_kvb, q_pos, kv_len, V)
    got = jax.jit(tiled, static_argnames=("v_dim", "tile"))(
        q_nope, q_pe, ckv, kpe, w_kvb, q_pos, kv_len, v_dim=V, tile=tile)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # the same tiles read from entry 1 of a stacked [2, B, S, .] cache (the model's layout; entry 0 is other data)
    got_stacked = jax.jit(tiled, static_argnames=("v_dim", "tile", "layer"))(
        q_nope, q_pe, jnp.stack([-ckv, ckv]), jnp.stack([-kpe, kpe]), w_kvb, q_pos, kv_len, v_dim=V, tile=tile,
        layer=1)
    np.testing.assert_allclose(got_stacked, got, atol=1e-6, rtol=0)


def test_long_cache_decode_and_verify_take_key_tiles(monkeypatch):
    """The model's decode and verify with the key-tile threshold lowered (so a tiny cache of 40 positions goes by 3
    tiles of 14) give the whole-cache logits; each has its own tile loop per MLA layer, and the tiled step reads its
    tiles from the stacked cache where they lie: no op of the compiled step makes a [B, S, L] copy of one layer's
    cache (the one-pass form does, which shows the check can fail)."""
    cfg = kimi.KimiConfig.tiny()
    model = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(3), (1, 30), 0, cfg.vocab_size)
    pre = model.forward(toks[:, :22], model.init_cache(1, 40), mode="prefill")
    layer_copy = f"[1,40,{cfg.kv_lora_rank}]"  # one layer's c_kv, sliced out of the stacked [n_mla, 1, 40, L]

    def run():
        f = jax.jit(lambda c, t1, t8: (model.forward(t1, c, mode="decode").logits,
                                       model.forward(t8, c, mode="verify").logits))
        args = (pre.cache, toks[:, 22:23], toks[:, 22:30])
        lowered = f.lower(*args)
        compiled = lowered.compile()  # run what was inspected: one compile per form
        return compiled(*args), lowered.as_text().count("stablehlo.while"), layer_copy in compiled.as_text()

    whole, loops_whole, copies_whole = run()
    monkeypatch.setattr(dispatch, "MLA_ABSORBED_TILED_MIN_KEYS", 32)
    monkeypatch.setattr(dispatch, "MLA_ABSORBED_KEY_TILE", 16)
    assert dispatch.mla_absorbed_key_tile(40) == 14  # 3 equal tiles
    assert dispatch.mla_absorbed_key_tile(32) is None
    tiled, loops_tiled, copies_tiled = run()
    assert loops_tiled == loops_whole + 2 * cfg.num_mla_layers  # a tile loop per MLA layer in decode and verify
    assert copies_whole and not copies_tiled
    for w, t in zip(whole, tiled):
        np.testing.assert_allclose(t, w, atol=1e-4, rtol=0)


def test_mla_layer_absorbed_flag():
    cfg = kimi.KimiConfig.tiny()
    layer = layers.GatedMLA(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 4, cfg.hidden_size))
    ckv = jnp.zeros((2, 1, 8, cfg.kv_lora_rank))
    kpe = jnp.zeros((2, 1, 8, cfg.qk_rope_head_dim))
    ln = jnp.array([2], jnp.int32)
    y1, c1, _ = layer(x, ckv, kpe, 1, ln, absorbed=True)
    y2 = layer(x, ckv, kpe, 1, ln, absorbed=False)[0]
    np.testing.assert_allclose(y1, y2, atol=1e-5)
    assert not np.any(np.asarray(c1[0])) and not np.any(np.asarray(c1[1, :, :2]))  # only entry 1, rows 2..5
    assert np.all(np.any(np.asarray(c1[1, 0, 2:6]) != 0, -1)) and not np.any(np.asarray(c1[1, :, 6:]))


def test_router_bias_selects_but_does_not_weight():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    w, idx = moe.route(logits, bias, top_k=2, renormalize=False)
    assert idx.tolist() == [[3, 0]]
    s = jax.nn.sigmoid(logits[0])
    np.testing.assert_allclose(w[0], [s[3], s[0]], rtol=1e-6)  # weights from the scores without the bias
    w2, _ = moe.route(logits, bias, top_k=2, renormalize=True, scaling=2.5)
    np.testing.assert_allclose(w2[0], 2.5 * np.array([s[3], s[0]]) / (s[3] + s[0] + 1e-20), rtol=1e-6)
    np.testing.assert_allclose(w2.sum(), 2.5, rtol=1e-6)


def test_router_ties_and_top1():
    logits = jnp.zeros((1, 6))
    w, idx = moe.route(logits, jnp.zeros(6), top_k=3)
    assert idx.tolist() == [[0, 1, 2]]  # ties: the lower expert index wins
    np.testing.assert_allclose(w, 1 / 3, rtol=1e-6)
    w1, idx1 = moe.route(jnp.array([[0.0, 3.0]]), jnp.zeros(2), top_k=1, renormalize=True)
    np.testing.assert_allclose(w1, jax.nn.sigmoid(3.0), rtol=1e-6)  # top-1 is not renormalised


def test_router_groups():
    # 2 groups of 3; group scores = sum of top-2 -> group 1 wins although expert 0 is the single best
    logits = jnp.array([[3.0, -5.0, -5.0, 1.0, 1.0, 1.0]])
    _, idx = moe.route(logits, jnp.zeros(6), top_k=2, n_group=2, topk_group=1)
    assert sorted(idx[0].tolist()) == [3, 4]


def _experts(E=6, F=8, D=32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (E, F, D)) * .2, jax.random.normal(ks[1], (E, F, D)) * .2,
            jax.random.normal(ks[2], (E, D, F)) * .2)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_paths_agree(act):
    w1, w3, w2 = _experts()
    T, X = 7, 2
    x = jax.random.normal(jax.random.key(3), (T, 32))
    w, idx = moe.route(jax.random.normal(jax.random.key(4), (T, 6)), jnp.zeros(6), X)
    ref = moe.experts_all(x, w, idx, w1, w3, w2, act, 4.0, 25.0)
    g = moe.experts_grouped(x, w, idx, w1, w3, w2, act, 4.0, 25.0)
    ga = moe.experts_gathered(x, w, w1[idx], w3[idx], w2[idx], act, 4.0, 25.0)
    b = moe.experts_blocked(x, w, idx, w1, w3, w2, act, 4.0, 25.0, block=4)
    w13_ED2F, w2_EFD = moe.fuse_experts_per_expert(w1, w3, w2)
    u = moe.experts_used(x, w, idx, w13_ED2F, w2_EFD, act, 4.0, 25.0)
    u_seq = moe.experts_used(x, w, idx, tuple(w13_ED2F), tuple(w2_EFD), act, 4.0, 25.0)  # per-expert arrays
    np.testing.assert_allclose(g, ref, atol=1e-5)
    np.testing.assert_allclose(u, ref, atol=1e-5)
    np.testing.assert_array_equal(u_seq, u)
    np.testing.assert_allclose(ga, ref, atol=1e-5)
    np.testing.assert_allclose(b, ref, atol=1e-5)


def _served_moe_reference(x, w, idx, w13_ED2F, w2_EFD, beta, linear_beta):
    """The serving copy's routed experts row by row in float64: x rounded to the weights' dtype, the product and
    its activation exact, c * h rounded to the weights' dtype before W2 (where experts_used and all_fused round)."""
    rnd = lambda a, dt: np.asarray(jnp.asarray(a, jnp.float32).astype(dt), np.float64)
    dt = w13_ED2F.dtype
    xb, w13, w2 = rnd(x, dt), np.asarray(w13_ED2F, np.float64), np.asarray(w2_EFD, np.float64)
    F = w2.shape[1]
    out = np.zeros((x.shape[0], w2.shape[2]))
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = xb[t] @ w13[e]
            h = np.asarray(activations.situ_glu(jnp.asarray(gu[:F], jnp.float32), jnp.asarray(gu[F:], jnp.float32),
                                                beta, linear_beta), np.float64)
            out[t] += rnd(float(w[t, j]) * h, dt) @ w2[e]
    return out


@pytest.mark.parametrize("routing", ["random", "one_expert", "unused_experts"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_experts_blocked_fused_matches_a_row_by_row_reference(routing, dtype):
    """The serving copy's blocked experts (its per-expert layout, stacked or one array an expert) equal the slow
    row-by-row sum at the serving copy's rounding points, however the rows route: spread over every expert, all
    to one (a group of many blocks), or to two of six (empty groups); and equal experts_all_fused's rounding."""
    w1, w3, w2 = _experts()
    T, X, E = 37, 2, 6
    x = jax.random.normal(jax.random.key(7), (T, 32))
    w, idx = moe.route(jax.random.normal(jax.random.key(8), (T, E)), jnp.zeros(E), X)
    if routing == "one_expert":  # every row's first slot to expert 3 (10 blocks of 4), its second elsewhere
        other = jnp.arange(T) % (E - 1)
        idx = jnp.stack([jnp.full((T,), 3), jnp.where(other >= 3, other + 1, other)], axis=1).astype(jnp.int32)
    elif routing == "unused_experts":
        idx = jnp.stack([jnp.full((T,), 4), jnp.full((T,), 1)], axis=1).astype(jnp.int32)
    w13, w2f = (a.astype(dtype) for a in moe.fuse_experts_per_expert(w1, w3, w2))
    ref = _served_moe_reference(x, w, idx, w13, w2f, 4.0, 25.0)
    got = moe.experts_blocked_fused(x, w, idx, w13, w2f, "situ", 4.0, 25.0, block=4)
    seq = moe.experts_blocked_fused(x, w, idx, tuple(w13), tuple(w2f), "situ", 4.0, 25.0, block=4)
    assert got.dtype == x.dtype and got.shape == (T, 32)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(seq, got)
    fused = moe.experts_all_fused(x, w, idx, *(a.astype(dtype) for a in moe.fuse_experts_for_all(w1, w3, w2)), E,
                                  "situ", 4.0, 25.0)
    np.testing.assert_allclose(got, fused, rtol=1e-4, atol=1e-4)
    if dtype == jnp.bfloat16:  # the rounding is the serving copy's, not fp32's
        exact = moe.experts_all(x, w, idx, w1, w3, w2, "situ", 4.0, 25.0)
        assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 1e-3


@pytest.mark.parametrize("unroll_max", [32, 0], ids=["cond-per-expert", "loop"])
def test_experts_used_reads_only_the_routed_experts(unroll_max, monkeypatch):
    """experts_used skips every expert no row picked (both forms): NaN weights there leave the result untouched."""
    monkeypatch.setattr(dispatch, "USED_UNROLL_MAX_EXPERTS", unroll_max)
    w1, w3, w2 = _experts()
    x = jax.random.normal(jax.random.key(5), (5, 32))
    idx = jnp.array([[4, 1], [1, 4], [4, 1], [1, 4], [1, 4]], jnp.int32)
    w = jnp.full(idx.shape, 0.5)
    ref = moe.experts_all(x, w, idx, w1, w3, w2, "situ", 4.0, 25.0)
    unused = jnp.array([0, 2, 3, 5])
    poison = [a.at[unused].set(jnp.nan) for a in moe.fuse_experts_per_expert(w1, w3, w2)]
    np.testing.assert_allclose(moe.experts_used(x, w, idx, *poison, "situ", 4.0, 25.0), ref, atol=1e-5)
    assert np.isnan(moe.experts_all_fused(x, w, idx, *moe.fuse_experts_for_all(
        *[a.at[unused].set(jnp.nan) for a in (w1, w3, w2)]), 6, "situ", 4.0, 25.0)).any()  # the dense form reads them


@pytest.mark.parametrize("idx", [[[4, 1], [1, 4], [4, 1]], [[0, 1], [2, 3], [4, 5]]], ids=["few", "most"])
def test_experts_all_or_used_both_branches(idx):
    """The run-time choice between the loop over used experts (2 of 6 picked) and the fused pair (all 6 picked)
    gives the reference either way."""
    w1, w3, w2 = _experts()
    x = jax.random.normal(jax.random.key(6), (3, 32))
    idx = jnp.array(idx, jnp.int32)
    w = jnp.array([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    ref = moe.experts_all(x, w, idx, w1, w3, w2, "situ", 4.0, 25.0)
    w13, w2f = moe.fuse_experts_for_all(w1, w3, w2)
    per_expert = [tuple(a) for a in moe.fuse_experts_per_expert(w1, w3, w2)]
    got = moe.experts_all_or_used(x, w, idx, w13, w2f, *per_expert, "situ", 4.0, 25.0)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_mxfp4_experts_equal_dequantised_dense():
    cfg = kimi.KimiConfig.tiny(expert_format="mxfp4", moe_intermediate_size=32, routed_expert_hidden_size=64)
    moe_q = layers.LatentMoE(cfg, rngs=nnx.Rngs(0))
    cfg_d = cfg.replace(expert_format="dense")
    moe_d = layers.LatentMoE(cfg_d, rngs=nnx.Rngs(0))
    _, st_q = nnx.split(moe_q)
    gd_d, st_d = nnx.split(moe_d)
    # copy every non-expert parameter, and the dequantised experts
    d = nnx.to_pure_dict(st_d)
    pq = nnx.to_pure_dict(st_q)
    for k in d:
        if k != "experts":
            d[k] = pq[k]
    for n in ("w1", "w3", "w2"):
        d["experts"][n] = moe_q.experts.weight(n)
    nnx.replace_by_pure_dict(st_d, d)
    moe_d = nnx.merge(gd_d, st_d)
    assert moe_q.experts.w1_packed[...].dtype == jnp.uint8
    for T in (1, 9):  # gathered (decode) and grouped (prefill) paths
        x = jax.random.normal(jax.random.key(T), (1, T, cfg.hidden_size))
        np.testing.assert_allclose(moe_q(x), moe_d(x), atol=1e-5)


def test_attn_res_buffer_matches_list():
    B, T, N, D = 2, 3, 4, 16
    ks = jax.random.split(jax.random.key(0), 3)
    blocks = jax.random.normal(ks[0], (B, T, N, D))
    prefix = jax.random.normal(ks[1], (B, T, D))
    w = jax.random.normal(ks[2], (D,))
    for n in (1, 2, 4):
        got = attn_res.attn_res(prefix, blocks, n, w, 1e-5)
        ref = attn_res.attn_res_reference(prefix, [blocks[:, :, i] for i in range(n)], w, 1e-5)
        np.testing.assert_allclose(got, ref, atol=1e-5)
    # zero pseudo-query: uniform weights over the sources
    got = attn_res.attn_res(prefix, blocks, 2, jnp.zeros(D), 1e-5)
    np.testing.assert_allclose(got, (blocks[:, :, 0] + blocks[:, :, 1] + prefix) / 3, atol=1e-5)


def test_situ_formula():
    g = jnp.linspace(-30, 30, 61)
    u = jnp.linspace(40, -40, 61)
    got = activations.situ_glu(g, u, 4.0, 25.0)
    ref = 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(activations.situ_glu(g, u, None, None), np.tanh(g) / (1 + np.exp(-g)) * u,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matmul_bf16_weights_round_inputs_and_accumulate_in_fp32(rows):
    """kimi.ops.linear.matmul: fp32 weights give the fp32 product; bf16 weights give bf16(x) @ W accumulated in
    fp32 (padded rows do not leak into the result), for x @ W and x @ W^T."""
    x = jax.random.normal(jax.random.key(0), (1, rows, 64))
    w = jax.random.normal(jax.random.key(1), (64, 48))
    np.testing.assert_allclose(linear.matmul(x, w), np.einsum("btk,kn->btn", x, w), rtol=1e-5, atol=1e-5)
    wb = w.astype(jnp.bfloat16)
    ref = np.einsum("btk,kn->btn", np.asarray(x.astype(jnp.bfloat16), np.float64), np.asarray(wb, np.float64))
    for got in (linear.matmul(x, wb), linear.matmul(x, wb.T, w_transposed=True)):
        assert got.dtype == jnp.float32 and got.shape == (1, rows, 48)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    assert np.abs(np.asarray(linear.matmul(x, wb)) - np.einsum("btk,kn->btn", x, w)).max() > 1e-3  # bf16 used


def test_moe_path_under_mapped_rows():
    """Mapped over n rows (the engine's vmap), the MoE path counts n x the rows and never one that skips work by a
    per-row lax.cond ('used', 'all_or_used'), which vmap would run as every branch."""
    assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "used"
    with dispatch.mapped_rows(1):
        assert dispatch.moe_path(1, 2, 8, None) == "gathered"
        assert dispatch.moe_path(1, 2, 8, jnp.float32) == "gathered"
        # the bf16 serving copy on a CPU: every expert's bf16 pair read in place beats copying 2 fp32 experts out
        assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "all"
        assert dispatch.moe_path(1, 2, 12, jnp.bfloat16) == "all"
        assert dispatch.moe_path(1, 2, 13, jnp.bfloat16) == "gathered"  # E > MOE_ALL_OVER_GATHERED x 2 slots
    with dispatch.mapped_rows(4):
        assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "all"
        assert dispatch.moe_path(8, 2, 8, jnp.bfloat16) == "all"
        assert dispatch.moe_path(1, 2, 16, None) == "gathered"
        assert dispatch.moe_path(1, 2, 48, jnp.bfloat16) == "all"
        assert dispatch.moe_path(1, 2, 49, jnp.bfloat16) == "gathered"
    assert dispatch.moe_path(8, 2, 8, jnp.bfloat16) == "all_or_used"
    with pytest.raises(ValueError, match="mapped_rows"):
        with dispatch.mapped_rows(0):
            pass


def test_moe_path_skips_no_experts_at_run_time_on_a_gpu(monkeypatch):
    """Outside RUNTIME_SKIP_BACKENDS (XLA:GPU reads every cond's predicate back to the host) the serving copy's few
    rows take 'all', decode and verify alike (one rounding for a row whichever pass computes it); a packed or
    unserved model keeps 'gathered' for few routed slots; many rows keep 'grouped'."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "all"
    assert dispatch.moe_path(8, 2, 8, jnp.bfloat16) == "all"
    assert dispatch.moe_path(8, 2, 8, jnp.float32) == "all"
    assert dispatch.moe_path(1, 2, 8, None) == "gathered"
    assert dispatch.moe_path(1, 2, 64, jnp.bfloat16) == "all"
    assert dispatch.moe_path(32, 1, 64, jnp.bfloat16) == "gathered"  # many rows, few slots: not every expert
    assert dispatch.moe_path(64, 2, 8, jnp.bfloat16) == "grouped"
    with dispatch.mapped_rows(1):  # the CPU's bf16 rule for mapped rows is the CPU's
        assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "gathered"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert dispatch.moe_path(1, 2, 8, jnp.bfloat16) == "used"
    assert dispatch.moe_path(8, 2, 8, jnp.bfloat16) == "all_or_used"


def test_moe_path_for_many_rows_on_the_cpu():
    """Many rows on XLA:CPU: 'blocked' without a serving copy (the packed or fp32 experts, as training runs them);
    on the serving copy 'all' while its T*E rows are at most MOE_ALL_OVER_BLOCKED x the blocked path's T*X + E*block
    (a 128-token prefill of 8 experts, top-2), else 'blocked' (over the copy's own layout: kimi.layers)."""
    B, k = dispatch.MOE_BLOCK_ROWS, dispatch.MOE_ALL_OVER_BLOCKED
    assert dispatch.moe_path(128, 2, 8, None) == "blocked"
    assert dispatch.moe_path(128, 2, 8, jnp.bfloat16) == "all"
    assert dispatch.moe_path(128, 2, 32, jnp.bfloat16) == "all"
    assert dispatch.moe_path(512, 2, 8, jnp.bfloat16) == "blocked"
    assert dispatch.moe_path(4096, 2, 8, jnp.float32) == "blocked"
    assert dispatch.moe_path(128, 2, 64, jnp.bfloat16) == "all"  # blocked would pad 64 groups to 64 rows
    assert dispatch.moe_path(256, 2, 64, jnp.bfloat16) == "blocked"
    for T, E in ((17, 8), (100, 16), (256, 8), (300, 8)):  # the rule itself, at its edge
        want = "all" if T * E <= k * (T * 2 + E * B) else "blocked"
        assert dispatch.moe_path(T, 2, E, jnp.bfloat16) == want


def test_sampling_form_follows_the_backend_unless_set_while_tracing(monkeypatch):
    """Sampling sorts where run-time skips do not pay (a GPU) and bisects on the CPU; ``sampling_form_as`` sets
    either for what is traced inside it (nested: the innermost), and names the forms when given another."""
    assert dispatch.sampling_form() == "bisect"
    with dispatch.sampling_form_as("sort"):
        assert dispatch.sampling_form() == "sort"
        with dispatch.sampling_form_as("bisect"):
            assert dispatch.sampling_form() == "bisect"
        assert dispatch.sampling_form() == "sort"
    assert dispatch.sampling_form() == "bisect"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.sampling_form() == "sort"
    with pytest.raises(ValueError, match="bisect"):
        with dispatch.sampling_form_as("argsort"):
            pass


def test_kda_verify_form_scans_a_batch_1_block_on_the_cpu(monkeypatch):
    """On a CPU a verify of at most KDA_VERIFY_SCAN_MAX_ROWS token rows (mapped rows counted) scans its tokens, which
    rounds as decoding does; more rows take the closed-form block up to KDA_BLOCK_MAX_TOKENS, then the scan again.
    Elsewhere the block up to that length. ``kda_verify_form_as`` sets either form while tracing."""
    n, long_T = dispatch.KDA_VERIFY_SCAN_MAX_ROWS, dispatch.KDA_BLOCK_MAX_TOKENS + 1
    assert dispatch.kda_verify_form(8) == "recurrent" and n >= 8  # generate's whole block at batch 1
    assert dispatch.kda_verify_form(n + 1) == "block"
    assert dispatch.kda_verify_form(8, 2) == "block"
    with dispatch.mapped_rows(1):
        assert dispatch.kda_verify_form(8) == "recurrent"  # the engine's one slot
    with dispatch.mapped_rows(16):
        assert dispatch.kda_verify_form(8) == "block"  # 16 slots x 8 tokens
        assert dispatch.kda_verify_form(long_T) == "recurrent"
    with dispatch.kda_verify_form_as("block"):
        assert dispatch.kda_verify_form(8) == "block"
    with pytest.raises(ValueError, match="kda_verify_form_as: expected one of"):
        with dispatch.kda_verify_form_as("chunked"):
            pass
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.kda_verify_form(8) == "block" and dispatch.kda_verify_form(long_T) == "recurrent"


def test_bf16_rows_pad_a_lone_row_but_not_mapped_rows():
    """A single bf16 row is padded to BF16_ROWS_MIN; rows mapped with vmap are one matmul to XLA, so each mapped call
    pads only to its share: 16 mapped rows of one multiply 16 rows (they multiplied 32 before the forty-ninth
    session), one mapped row still 2."""
    assert dispatch.bf16_rows(1) == dispatch.BF16_ROWS_MIN == 2
    assert dispatch.bf16_rows(8) == 8
    with dispatch.mapped_rows(1):
        assert dispatch.bf16_rows(1) == 2
    for n in (2, 16):
        with dispatch.mapped_rows(n):
            assert dispatch.bf16_rows(1) == 1
    w = jax.random.normal(jax.random.key(1), (64, 48)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (16, 1, 64))

    def mapped(x):
        with dispatch.mapped_rows(16):
            return jax.vmap(lambda r: linear.matmul(r, w))(x)

    hlo = jax.jit(mapped).lower(x).compile().as_text()
    assert re.search(r"f32\[16,48\]\S* dot\(", hlo) and not re.search(r"f32\[32,48\]\S* dot\(", hlo), hlo
    np.testing.assert_array_equal(jax.jit(mapped)(x), jax.vmap(lambda r: linear.matmul(r, w))(x))
