"""Pallas kernels (interpret mode on CPU) against their jnp references; Triton lowering for NVIDIA GPUs; the tiny
model with kernels="pallas" against kernels="xla". Grids are kept small: interpret mode costs per grid step."""
import dataclasses
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import kimi
from jdspark import generation
from kimi import dispatch, mxfp4
from kimi.kernels import kda_decode as kd
from kimi.kernels import mxfp4_moe as mm
from kimi.layers import shape_only_init
from kimi.ops.activations import glu
from tests.jdspark.test_speculative import scaled_target
from tests.oracle_drafter import assert_histogram, oracle_drafter

TOL = dict(atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- KDA decode
def _kda_args(B, T, H, K, W, seed=0):
    """Inputs of kda_fused_step (numpy random: no per-shape compiles)."""
    rng = np.random.default_rng(seed)
    C = 3 * H * K

    def r(shape, s=1.0):
        return jnp.asarray(s * rng.standard_normal(shape), jnp.float32)

    return (r((B, T, C)), r((C, W + 1), 0.5), r((B, W, C)), r((B, T, H, K)), r((H,), 0.5), r((H, K), 0.1),
            r((B, T, H)), r((B, T, H, K)), 1.0 + r((K,), 0.1), r((B, H, K, K), 0.3))


@pytest.mark.parametrize("B,T,H,K,W,lb,all_states", [
    (2, 1, 3, 16, 3, -5.0, False),  # decode, K3 gate
    (1, 3, 2, 32, 2, None, True),  # verify, 3 positions, Kimi-Linear softplus gate, another conv window
    (2, 8, 2, 16, 3, -5.0, True),  # verify, 8 positions
])
def test_kda_pallas_step_matches_reference(B, T, H, K, W, lb, all_states):
    args = _kda_args(B, T, H, K, W, seed=T + K)
    kw = dict(lower_bound=lb, eps_rms=1e-5, return_all_states=all_states)
    ref = kd.kda_fused_step_reference(*args, **kw)
    out = kd.kda_fused_step(*args, **kw)
    assert len(out) == len(ref) == (5 if all_states else 3)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_allclose(o, r, **TOL)
    if all_states:  # the last per-position state is the final state (XLA may fuse the two stores differently)
        np.testing.assert_allclose(out[3][:, -1], out[1], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(out[4][:, -1], out[2])


# ---------------------------------------------------------------------------------------------------- MXFP4 MoE
def _mx_weights(E, F, D, seed=0):
    """w1, w3 [E, F, D] and w2 [E, D, F] as MXFP4 (codes, scales) pairs, flattened."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((E, F, D), (E, F, D), (E, D, F)):
        out += mxfp4.quantize(0.2 * rng.standard_normal(shape).astype(np.float32))  # numpy in, numpy out
    return [jnp.asarray(a) for a in out]


def _route(T, X, E, seed):
    """X distinct experts per token and positive routing weights."""
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.uniform(size=(T, E)), axis=1)[:, :X].astype(np.int32)
    return jnp.asarray(rng.uniform(size=(T, X)), jnp.float32), jnp.asarray(idx)


@pytest.mark.parametrize("T,X,act", [(3, 2, "situ"), (1, 4, "silu")])
def test_mxfp4_pallas_moe_decode_matches_reference(T, X, act):
    E, F, D = 6, 64, 96
    ws = _mx_weights(E, F, D)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((T, D)), jnp.float32)
    w, idx = _route(T, X, E, seed=T)
    ref = mm.moe_decode_reference(x, w, idx, *ws, act, 4.0, 25.0)
    out = mm.moe_decode(x, w, idx, *ws, act, 4.0, 25.0, tn=16, tk=32)  # several N tiles, a K loop of 3 and 2
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(out, ref, **TOL)


def test_mxfp4_pallas_moe_grouped_matches_reference():
    E, F, D = 6, 64, 96
    ws = _mx_weights(E, F, D, seed=1)
    T, X = 13, 2  # 26 assignments: not a multiple of the 16-row tile; the routing leaves some experts empty
    x = jnp.asarray(np.random.default_rng(6).standard_normal((T, D)), jnp.float32)
    w, idx = _route(T, X, E - 1, seed=3)
    idx = jnp.where(idx == 4, 5, idx)  # experts {0, 1, 2, 3, 5}: expert 4 gets no row
    ref = mm.moe_grouped_reference(x, w, idx, *ws, "situ", 4.0, 25.0)
    out = mm.moe_grouped(x, w, idx, *ws, "situ", 4.0, 25.0, tm=16, tn=32, tk=32)
    np.testing.assert_allclose(out, ref, **TOL)


def test_mxfp4_pallas_moe_bf16_activations():
    """bf16 activations (the GPU path: bf16 tiles into the dot, fp32 accumulation) against the fp32 reference on
    the same bf16 inputs, to bf16 output precision."""
    E, F, D = 6, 64, 96
    ws = _mx_weights(E, F, D, seed=4)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((5, D)), jnp.bfloat16)
    w, idx = _route(5, 2, E, seed=8)
    for fn, ref_fn in ((mm.moe_grouped, mm.moe_grouped_reference), (mm.moe_decode, mm.moe_decode_reference)):
        out = fn(x, w, idx, *ws, "situ", 4.0, 25.0)
        ref = ref_fn(x.astype(jnp.float32), w, idx, *ws, "situ", 4.0, 25.0)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2 * float(jnp.max(jnp.abs(ref))), rtol=0)


@pytest.mark.parametrize("sizes,tm", [((5, 0, 11, 0, 3, 2), 8), ((0, 19, 0, 0, 0, 0), 16)])
def test_mxfp4_pallas_grouped_matmul_ragged(sizes, tm):
    E, F, D = 6, 32, 64
    ws = _mx_weights(E, F, D, seed=2)
    sizes = jnp.array(sizes, jnp.int32)
    R = 21  # first case: sum(sizes) == R; second: 2 rows past the last group (zeros, as ragged_dot)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((R, D)), jnp.float32)
    w1 = jnp.swapaxes(mxfp4.dequantize(ws[0], ws[1]), 1, 2)
    w3 = jnp.swapaxes(mxfp4.dequantize(ws[2], ws[3]), 1, 2)
    ref = jax.lax.ragged_dot(x, w1, sizes, precision=jax.lax.Precision.HIGHEST)
    out = mm.grouped_matmul(x, ws[0], ws[1], sizes, tm=tm, tn=16, tk=32)
    np.testing.assert_allclose(out, ref, **TOL)
    if int(sizes.sum()) < R:
        np.testing.assert_array_equal(out[int(sizes.sum()):], 0.0)
    h = mm.grouped_glu(x, *ws[:4], sizes, "silu", tm=tm, tn=32, tk=64)
    g_ref = glu(ref, jax.lax.ragged_dot(x, w3, sizes, precision=jax.lax.Precision.HIGHEST), "silu")
    np.testing.assert_allclose(h, g_ref, **TOL)


@pytest.mark.parametrize("dequant", mm.DEQUANT_MODES)
def test_mxfp4_pallas_kernel_dequantises_every_code_exactly(dequant):
    """x = identity: each output row is one column of the dequantised weight, so every one of the 256 byte values
    (both nibbles, signs, -0.0) and a spread of block scales must come out exactly as kimi.mxfp4.dequantize (for
    "ptx" the scaling happens in bf16, exact for an E2M1 value times a power of 2)."""
    N, K = 16, 64
    packed = jnp.asarray(np.arange(N * K // 2).reshape(1, N, K // 2) % 256, jnp.uint8)
    scale = jnp.asarray(np.random.default_rng(0).integers(90, 160, (1, N, K // 32)), jnp.uint8)
    out = mm.grouped_matmul(jnp.eye(K), packed, scale, jnp.array([K], jnp.int32), tm=16, tn=16, tk=32,
                            dequant=dequant)
    np.testing.assert_array_equal(out, mxfp4.dequantize(packed, scale)[0].T)


# ---------------------------------------------------------------------------------------------------- the PTX dequant
def _run_ptx(asm, operands):
    """Run a straight-line PTX block on numpy uint32 arrays: operands ``$0..$n`` (outputs are written into the
    list), ``.reg`` names local to the block. Only the instructions E2M1X4_PTX uses, each with its PTX ISA
    semantics: mov/shl/and/or.b32, prmt.b32 (default mode: selector nibble bits 0-2 pick one of the 8 bytes of
    {b, a}, bit 3 replicates that byte's sign bit), fma.rn.bf16x2 (per 16-bit half, exact product and sum rounded
    once to bf16, nearest-even; subnormals kept)."""
    regs = {}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return operands[int(tok[1:])]
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    def put(tok, v):
        v = np.asarray(v, np.uint32)
        if tok.startswith("$"):
            operands[int(tok[1:])] = v
        else:
            regs[tok] = v

    def bf16x2(w):
        w = np.asarray(w, np.uint32)
        halves = [(w & 0xFFFF).astype(np.uint16), (w >> 16).astype(np.uint16)]
        return [h.view(ml_dtypes.bfloat16).astype(np.float64) for h in halves]

    def pack_bf16x2(lo, hi):
        lo16, hi16 = (np.asarray(v).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32) for v in (lo, hi))
        return lo16 | (hi16 << 16)

    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}"
    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            put(a[0], val(a[1]))
        elif op == "shl.b32":
            put(a[0], (np.asarray(val(a[1]), np.uint64) << np.uint64(int(a[2], 0))) & 0xFFFFFFFF)
        elif op == "and.b32":
            put(a[0], val(a[1]) & val(a[2]))
        elif op == "or.b32":
            put(a[0], val(a[1]) | val(a[2]))
        elif op == "prmt.b32":
            src = np.asarray(val(a[1]), np.uint64) | (np.asarray(val(a[2]), np.uint64) << np.uint64(32))
            sel = int(a[3], 0)
            out = np.zeros(np.broadcast(src).shape, np.uint64)
            for i in range(4):
                nib = (sel >> (4 * i)) & 15
                byte = (src >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)
                if nib & 8:
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                out |= byte << np.uint64(8 * i)
            put(a[0], out)
        elif op == "fma.rn.bf16x2":
            (al, ah), (bl, bh), (cl, ch) = (bf16x2(val(t)) for t in a[1:4])
            put(a[0], pack_bf16x2(al * bl + cl, ah * bh + ch))  # float64: bf16 x bf16 + bf16 is exact there
        else:
            raise NotImplementedError(op)
    return operands


def test_ptx_dequant_is_exact_e2m1_for_every_byte_in_every_lane():
    """The inline PTX shipped for the GPU (mm.E2M1X4_PTX, run here by _run_ptx) turns each byte of a 32-bit word
    into E2M1(its low nibble) ("lo") or E2M1(its high nibble) ("hi"), bit for bit (signs and -0.0 included),
    whatever the other 3 bytes hold; and the interpret-mode stand-in (mm.e2m1_pair_bf16) is the same function."""
    rng = np.random.default_rng(0)
    b = np.arange(256, dtype=np.uint32)
    want = {"lo": mxfp4.E2M1_VALUES[b & 15], "hi": mxfp4.E2M1_VALUES[b >> 4]}
    want_bits = {k: w.astype(ml_dtypes.bfloat16).view(np.uint16) for k, w in want.items()}
    assert mm.E2M1X4_PTX_CONSTRAINTS.count("=r") == 2
    for half, asm in mm.E2M1X4_PTX.items():
        assert "$3" not in asm
        for lane in range(4):
            others = rng.integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32) & ~np.uint32(0xFF << (8 * lane))
            out = _run_ptx(asm, [None, None, others | (b << (8 * lane))])
            reg = out[lane // 2]  # $0 holds bytes 0, 1; $1 bytes 2, 3
            got = ((reg >> (16 * (lane % 2))) & 0xFFFF).astype(np.uint16)
            np.testing.assert_array_equal(got, want_bits[half], err_msg=f"{half} nibble, byte lane {lane}")
    lo, hi = mm.e2m1_pair_bf16(jnp.asarray(b.astype(np.uint8)), interpret=True)
    for got, half in ((lo, "lo"), (hi, "hi")):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want_bits[half])


@pytest.mark.parametrize("dequant", mm.DEQUANT_MODES)
def test_mxfp4_pallas_moe_decode_dequant_modes_agree(dequant):
    """Both dequantisations, in the decode and the grouped kernels, give the reference (bf16 activations as
    served; the kernel's widening to fp32 is exact, so both modes agree with each other to fp32 rounding)."""
    E, F, D = 6, 256, 256  # tiles of 32 x 128 packed bytes (GPU-sized: >= 4 bytes per thread for the PTX), 2 K steps
    ws = _mx_weights(E, F, D, seed=9)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, D)), jnp.bfloat16)
    w, idx = _route(2, 3, E, seed=9)
    ref = mm.moe_decode_reference(x.astype(jnp.float32), w, idx, *ws, "situ", 4.0, 25.0)
    out = mm.moe_decode(x.astype(jnp.float32), w, idx, *ws, "situ", 4.0, 25.0, tn=32, tk=128, dequant=dequant)
    np.testing.assert_allclose(out, ref, **TOL)
    out = mm.moe_grouped(x.astype(jnp.float32), w, idx, *ws, "situ", 4.0, 25.0, tm=16, tn=32, tk=128,
                         dequant=dequant)
    np.testing.assert_allclose(out, ref, **TOL)
    with pytest.raises(ValueError, match="dequant must be one of"):
        mm.moe_decode(x, w, idx, *ws, "situ", 4.0, 25.0, dequant="lut")


# ---------------------------------------------------------------------------------------------------- GPU lowering
def test_kernels_lower_to_triton_for_gpu():
    """Cross-lower every kernel for an NVIDIA GPU (no GPU needed): the Pallas Triton lowering accepts the block
    shapes and ops (power-of-2 loads, no scalar prefetch), and the KDA state is aliased in place."""
    E, F, D = 4, 128, 256
    ws = [jnp.zeros((E, F, D // 2), jnp.uint8), jnp.zeros((E, F, D // 32), jnp.uint8)] * 2
    ws += [jnp.zeros((E, D, F // 2), jnp.uint8), jnp.zeros((E, D, F // 32), jnp.uint8)]
    x, w, idx = jnp.zeros((2, D), jnp.bfloat16), jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32)

    def lower(f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for fn, kw in [(f, dict(dequant=d)) for f in (mm.moe_decode, mm.moe_grouped) for d in mm.DEQUANT_MODES]:
        txt = lower(lambda x, w, idx, *ws: fn(x, w, idx, *ws, "situ", 4.0, 25.0, interpret=False, **kw),
                    x, w, idx, *ws)
        assert txt.count("xla.gpu.triton") == 2
        assert ("fma.rn.bf16x2" in txt) == (kw.get("dequant") == "ptx")  # the inline asm travels in the IR
        if fn is mm.moe_decode:  # the even/odd columns are strided loads in the kernel, not slice kernels around it
            assert not re.search(r"stablehlo\.(slice|gather|transpose|concatenate)", txt)
    for T in (1, 4):
        args = _kda_args(1, T, 2, 128, 3)
        txt = lower(lambda *a: kd.kda_fused_step(*a, lower_bound=-5.0, eps_rms=1e-5, return_all_states=T > 1,
                                                 interpret=False), *args)
        assert txt.count("xla.gpu.triton") == 1
        assert "output_operand_alias" in txt
        # one launch per step: nothing around the kernel but views (a transpose or broadcast is a GPU kernel)
        assert not re.search(r"stablehlo\.(transpose|broadcast_in_dim|convert|concatenate|pad)", txt), txt[:2000]


# ---------------------------------------------------------------------------------------------------- the model
def _abstract_model(cfg):
    with shape_only_init():
        return nnx.eval_shape(lambda: kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0)))


def _random_state(state, rng):
    """Plausible weights for an abstract model's state: norms near 1, decays A_log in log[1, 16], MXFP4 codes
    uniform with scales near 2**-6, everything else small normals."""
    def fill(path, leaf):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        shape, dt = leaf.shape, np.dtype(leaf.dtype)
        if dt == np.uint8:
            lo, hi = (118, 124) if name.endswith("_scale") else (0, 256)
            return jnp.asarray(rng.integers(lo, hi, shape), jnp.uint8)
        if "A_log" in name:
            return jnp.asarray(np.log(rng.uniform(1.0, 16.0, shape)), dt)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(shape), dt)
        std = 0.3 if "conv1d" in name else 0.05
        return jnp.asarray(std * rng.standard_normal(shape), dt)

    return jax.tree_util.tree_map_with_path(fill, state)


def test_model_pallas_kernels_match_xla():
    """The tiny K3-shaped model (MXFP4 experts) with kernels="pallas" gives the XLA path's decode and verify
    logits and states: KDA decode/verify through the fused step, MoE through the decode / grouped kernels."""
    # tiny() cut to 2 layers (compile time): a KDA and an MLA layer, both with the LatentMoE, under AttnRes
    kw = dict(expert_format="mxfp4", routed_expert_hidden_size=64, num_hidden_layers=2, kda_layers=(1,),
              full_attn_layers=(2,), first_k_dense_replace=0)
    rng = np.random.default_rng(3)
    m_x, m_p = (_abstract_model(kimi.KimiConfig.tiny(kernels=k, **kw)) for k in ("xla", "pallas"))
    weights = _random_state(nnx.state(m_x), rng)  # numpy weights: no per-shape init compiles
    nnx.update(m_x, weights)
    nnx.update(m_p, weights)
    B = 2
    c = m_x.init_cache(B, 16)
    rand = lambda a, s=1.0: jnp.asarray(s * rng.standard_normal(a.shape), a.dtype)
    cache = dataclasses.replace(  # a cache in the middle of a sequence: nonzero states, ragged lengths
        c, kda_state=rand(c.kda_state, 0.3), conv_state=rand(c.conv_state), mla_ckv=rand(c.mla_ckv),
        mla_kpe=rand(c.mla_kpe), length=jnp.array([4, 6], jnp.int32))
    tok = rng.integers(0, m_x.config.vocab_size, (B, 3)).astype(np.int32)
    fresh = lambda: jax.tree.map(jnp.copy, cache)  # decode / verify donate their cache
    dx, dp = m_x.decode(tok[:, 0], fresh()), m_p.decode(tok[:, 0], fresh())
    np.testing.assert_allclose(dp.logits, dx.logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(dp.cache.kda_state, dx.cache.kda_state, atol=1e-5)
    np.testing.assert_allclose(dp.cache.conv_state, dx.cache.conv_state, atol=1e-6)
    vx, vp = m_x.verify(tok, fresh()), m_p.verify(tok, fresh())
    np.testing.assert_allclose(vp.logits, vx.logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(vp.conv_states, vx.conv_states, atol=1e-6)
    for k in (1, 2, 3):  # the kernel keeps every state, the XLA verify a closed-form trace: both roll back alike
        n_keep = np.full((B,), k, np.int32)
        rp = kimi.KimiForCausalLM.rollback(vp, cache.length, n_keep)
        rx = kimi.KimiForCausalLM.rollback(vx, cache.length, n_keep)
        np.testing.assert_allclose(rp.kda_state, rx.kda_state, atol=1e-5)
    np.testing.assert_allclose(vp.logits[:, 0], dp.logits, atol=1e-4, rtol=0)  # verify's first = decode


# ---------------------------------------------------------------------------------------------------- the GPU bench
def test_bench_kernels_speed_path_runs_every_variant():
    """scripts/bench_kernels.py's GPU path (the sweep a device session runs once) on small shapes in interpret
    mode: every variant runs, agrees with the XLA reference, and the report names the default and the fastest."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    res = bk.main(["--speed", "--small", "--iters", "1", "--repeats", "1"])
    assert {"mxfp4_moe", "kda_decode", "kda_verify8", "mxfp4_moe_verify8", "copy_bw_GBps"} <= set(res)
    for name in ("mxfp4_moe", "mxfp4_moe_verify8"):
        moe = res[name]
        assert {r["dequant"] for r in moe["variants"]} == set(mm.DEQUANT_MODES)
        assert moe["dequant"] == mm.DEFAULT_DEQUANT and moe["best"] in moe["variants"]
    assert res["mxfp4_moe_verify8"]["shape"]["T"] == 8
    for name in ("mxfp4_moe", "kda_decode", "kda_verify8", "mxfp4_moe_verify8"):
        # the bench's own accuracy bars: MoE (bf16 out) a few bf16 ulps of its largest output, KDA 1e-3
        tol = 2e-2 * res[name]["max_abs_ref"] if "moe" in name else 1e-3
        assert "moe" not in name or res[name]["max_abs_ref"] > 0.1  # a real output, not zeros
        for row in res[name]["variants"]:
            assert "error" not in row, row
            assert row["max_abs_err"] <= tol, (name, row)
            # the report's derived figures are consistent with its measurements (their values are not tested)
            t = row["time_us"]
            assert row["bw_GBps"] == pytest.approx(row["bytes_per_call"] / (t * 1e3), rel=2e-2, abs=0.1), row
            assert row["speedup_vs_xla"] == pytest.approx(row["xla_time_us"] / t, rel=2e-2, abs=0.01), row
    assert [r["num_warps"] for r in res["kda_decode"]["variants"]] == list(bk.KDA_WARPS)


# ---------------------------------------------------------------------------------------------------- generation
def test_generate_with_pallas_kernels_is_lossless_and_matches_xla():
    """jdspark.generate on a kernels="pallas" MXFP4 target runs the kernels inside its one program (the packed
    experts are kept: no serving copy), with oracle drafts accepted to every length 0..4 (KDA rollback from the kernel's
    per-position states): the greedy tokens equal plain decoding's and those of the same weights on the XLA path."""
    # tiny() cut to 3 layers (compile time): two KDA layers (rollback of a stack of kernel states) and an MLA layer,
    # each with the LatentMoE (the decode / grouped kernels), under AttnRes with a partial last block
    kw = dict(expert_format="mxfp4", routed_expert_hidden_size=64, num_hidden_layers=3, kda_layers=(1, 2),
              full_attn_layers=(3,), first_k_dense_replace=0)
    cfg_p, cfg_x = kimi.KimiConfig.tiny(kernels="pallas", **kw), kimi.KimiConfig.tiny(kernels="xla", **kw)
    target_p, target_x = scaled_target(cfg_p, 0.05, seed=1), _abstract_model(cfg_x)
    nnx.update(target_x, nnx.state(target_p))  # the same weights, built once
    assert not dispatch.serving_copy(cfg_p, sharded=False) and dispatch.serving_copy(cfg_x, sharded=False)
    p = np.arange(3, 12)
    ar = generation.generate(target_p, None, p, max_new_tokens=24 + 4 + 1, eos_token_id=-1)
    drafter, want = oracle_drafter(target_p, p, ar.tokens, 24, block_size=4, seed=1)
    sp = generation.generate(target_p, drafter, p, max_new_tokens=24, eos_token_id=-1)
    xla = generation.generate(target_x, None, p, max_new_tokens=24 + 4 + 1, eos_token_id=-1)
    np.testing.assert_array_equal(sp.tokens, ar.tokens[:24])
    np.testing.assert_array_equal(ar.tokens, xla.tokens)
    assert_histogram(sp.stats, want, "pallas")  # every accepted length 0..4: every rollback case ran
