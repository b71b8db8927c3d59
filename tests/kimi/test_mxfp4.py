"""kimi.mxfp4: E2M1 / E8M0 decoding against ml_dtypes, OCP quantisation rules, NumPy == JAX, jit, errors."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kimi import mxfp4


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _random_on_grid(rng, lead, n_out, n_in, scale_lo, scale_hi):
    """Random codes and scale bytes where every block holds a magnitude-4 or -6 code, so the OCP scale of the
    dequantised block is exactly the original scale byte (the round trip is then the identity)."""
    codes_OI = rng.integers(0, 16, size=lead + (n_out, n_in), dtype=np.uint8)
    blocks = codes_OI.reshape(lead + (n_out, n_in // 32, 32))
    blocks[..., 0] = rng.choice(np.array([6, 7, 14, 15], np.uint8), size=blocks.shape[:-1])
    scale_OG = rng.integers(scale_lo, scale_hi + 1, size=lead + (n_out, n_in // 32), dtype=np.uint8)
    return mxfp4.pack_e2m1(codes_OI), scale_OG


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_unpack_every_byte_matches_ml_dtypes(backend):
    packed = np.arange(256, dtype=np.uint8)
    got = np.asarray(mxfp4.unpack_e2m1(backend(packed)))
    lo = (packed & 0x0F).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    hi = (packed >> 4).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    want = np.stack([lo, hi], axis=-1).reshape(512)
    assert got.dtype == np.float32 and got.shape == (512,)
    np.testing.assert_array_equal(_bits(got), _bits(want))  # bit-exact, -0.0 included


def test_low_nibble_first_and_bitcast_order():
    np.testing.assert_array_equal(mxfp4.unpack_e2m1(np.array([0x21], np.uint8)), [0.5, 1.0])
    np.testing.assert_array_equal(mxfp4.unpack_nibbles(np.array([[0x21, 0xF8]], np.uint8)), [[1, 2, 8, 15]])
    # XLA's bitcast to float4 uses the same order (pinned here since kernels may rely on it)
    packed = jnp.arange(256, dtype=jnp.uint8)
    via_bitcast = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).astype(jnp.float32).reshape(512)
    np.testing.assert_array_equal(_bits(via_bitcast), _bits(mxfp4.unpack_e2m1(np.asarray(packed))))


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_pack_unpack_roundtrip(backend):
    codes = np.random.default_rng(0).integers(0, 16, size=(2, 3, 64), dtype=np.uint8)
    packed = mxfp4.pack_e2m1(backend(codes))
    assert packed.shape == (2, 3, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(mxfp4.unpack_nibbles(packed), codes)
    assert int(np.asarray(mxfp4.pack_e2m1(backend(np.array([1, 2], np.uint8))))[0]) == 0x21


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_e8m0_every_byte_matches_ml_dtypes(backend):
    s = np.arange(255, dtype=np.uint8)
    got = np.asarray(mxfp4.e8m0_to_float32(backend(s)))
    want = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(got, np.ldexp(1.0, s.astype(np.int32) - 127).astype(np.float32))
    assert np.isnan(np.asarray(mxfp4.e8m0_to_float32(backend(np.array([255], np.uint8))))).all()


# ---------------------------------------------------------------- quantize


@pytest.mark.parametrize(
    "backend,lo,hi",
    # NumPy keeps subnormals: every byte whose values stay finite in float32. XLA flushes subnormal results.
    [(np.asarray, 0, 252), (jnp.asarray, 3, 252)],
)
def test_roundtrip_on_grid_is_identity(backend, lo, hi):
    packed, scale = _random_on_grid(np.random.default_rng(1), (3,), 4, 96, lo, hi)
    w = mxfp4.dequantize(backend(packed), backend(scale))
    assert np.isfinite(np.asarray(w)).all()
    packed2, scale2 = mxfp4.quantize(w)
    np.testing.assert_array_equal(np.asarray(scale2), scale)
    np.testing.assert_array_equal(np.asarray(packed2), packed)


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_ties_to_even_saturation_and_sign(backend):
    # amax 7.5 -> floor(log2) = 2 -> X = 0 -> scale 1 (byte 127)
    x = [7.5, 2.5, 3.5, 0.25, 0.75, 1.25, 1.75, 5.0, -2.5, -0.25, 6.9, 5.01, -0.1, 0.0, 4.99, -7.0]
    want = [6.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -2.0, -0.0, 6.0, 6.0, -0.0, 0.0, 4.0, -6.0]
    w = np.zeros((1, 32), np.float32)
    w[0, : len(x)] = x
    packed, scale = mxfp4.quantize(backend(w))
    assert int(np.asarray(scale)[0, 0]) == 127
    got = np.asarray(mxfp4.dequantize(packed, scale))[0, : len(x)]
    np.testing.assert_array_equal(_bits(got), _bits(np.array(want, np.float32)))


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_scale_choice_zero_and_nan_blocks(backend):
    w = np.zeros((4, 32), np.float32)
    w[0, 3] = 1.0  # amax 1 -> X = -2 -> byte 125
    w[1, 0] = -0.75  # amax 0.75 -> floor(log2) = -1 -> X = -3 -> byte 124
    # row 2: all zero -> byte 0 (2**-127), codes 0
    w[3, 5] = np.nan
    packed, scale = mxfp4.quantize(backend(w))
    np.testing.assert_array_equal(np.asarray(scale)[:, 0], [125, 124, 0, 255])
    np.testing.assert_array_equal(np.asarray(packed)[2], 0)
    deq = np.asarray(mxfp4.dequantize(packed, scale))
    np.testing.assert_array_equal(deq[:3], w[:3])
    assert np.isnan(deq[3]).all()


@pytest.mark.parametrize("backend", [np.asarray, jnp.asarray])
def test_error_bound_random_normal(backend):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((2, 16, 128)) * np.exp(rng.uniform(-8, 8, size=(2, 16, 1)))).astype(np.float32)
    packed, scale = mxfp4.quantize(backend(w))
    deq = np.asarray(mxfp4.dequantize(packed, scale))
    s = np.repeat(np.asarray(mxfp4.e8m0_to_float32(np.asarray(scale))), 32, axis=-1)
    v = np.abs(w) / s  # element in units of its block scale, < 8 by OCP's choice of scale
    assert v.max() < 8
    half_step = np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))
    err = np.abs(deq - w) / s
    inside = v <= 6
    assert (err[inside] <= half_step[inside]).all()
    np.testing.assert_array_equal(deq[~inside], np.sign(w[~inside]) * 6 * s[~inside])  # saturation
    assert np.array_equal(np.signbit(deq), np.signbit(w))


# ---------------------------------------------------------------- NumPy == JAX, jit


def test_numpy_and_jax_paths_identical():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 3, 8, 64)).astype(np.float32)
    p_np, s_np = mxfp4.quantize(w)
    p_jx, s_jx = jax.jit(mxfp4.quantize)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(p_jx), p_np)
    np.testing.assert_array_equal(np.asarray(s_jx), s_np)
    d_np = mxfp4.dequantize(p_np, s_np)
    d_jx = jax.jit(mxfp4.dequantize)(p_jx, s_jx)
    np.testing.assert_array_equal(_bits(d_jx), _bits(d_np))
    np.testing.assert_array_equal(mxfp4.quantize_dequantize(w), d_np)


def test_jit_gathered_experts_and_bf16():
    packed, scale = _random_on_grid(np.random.default_rng(4), (5,), 8, 64, 110, 140)
    ref = mxfp4.dequantize(packed, scale)  # numpy [5, 8, 64]

    @jax.jit
    def gathered(packed_EOH, scale_EOG, idx_X):
        return mxfp4.dequantize(packed_EOH[idx_X], scale_EOG[idx_X], dtype=jnp.bfloat16)

    idx = jnp.array([4, 0, 2])
    got = gathered(jnp.asarray(packed), jnp.asarray(scale), idx)
    assert got.shape == (3, 8, 64) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), ref[np.asarray(idx)])  # bf16 is exact here


def test_gpt_oss_layout_is_a_reshape():
    packed, scale = _random_on_grid(np.random.default_rng(5), (2,), 3, 64, 120, 135)
    blocks, scales = mxfp4.compressed_to_gpt_oss(packed, scale)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    np.testing.assert_array_equal(blocks.reshape(2, 3, 32), packed)
    back_p, back_s = mxfp4.gpt_oss_to_compressed(blocks, scales)
    np.testing.assert_array_equal(back_p, packed)
    np.testing.assert_array_equal(back_s, scale)
    np.testing.assert_array_equal(mxfp4.dequantize_gpt_oss(blocks, scales), mxfp4.dequantize(packed, scale))
    got_jx = jax.jit(mxfp4.dequantize_gpt_oss)(jnp.asarray(blocks), jnp.asarray(scales))
    np.testing.assert_array_equal(np.asarray(got_jx), mxfp4.dequantize(packed, scale))


# ---------------------------------------------------------------- errors


def test_bad_inputs_name_the_argument():
    u8 = np.zeros((4, 16), np.uint8)
    s8 = np.zeros((4, 1), np.uint8)
    with pytest.raises(ValueError, match=r"^w: .*multiple of 32"):
        mxfp4.quantize(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match=r"^w must be a floating"):
        mxfp4.quantize(np.zeros((4, 32), np.int32))
    with pytest.raises(ValueError, match=r"^packed must have dtype uint8"):
        mxfp4.dequantize(u8.astype(np.int8), s8)
    with pytest.raises(ValueError, match=r"^scale must have dtype uint8"):
        mxfp4.dequantize(u8, s8.astype(np.float32))
    with pytest.raises(ValueError, match=r"^scale has shape \(4, 2\), expected \(4, 1\)"):
        mxfp4.dequantize(u8, np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match=r"^packed: .*not a multiple of 32"):
        mxfp4.dequantize(np.zeros((4, 8), np.uint8), s8)
    with pytest.raises(ValueError, match=r"^scale has shape"):
        jax.jit(mxfp4.dequantize)(jnp.zeros((2, 4, 16), jnp.uint8), jnp.zeros((2, 1, 1), jnp.uint8))
    with pytest.raises(ValueError, match=r"^blocks must have shape"):
        mxfp4.dequantize_gpt_oss(np.zeros((1, 4, 2, 8), np.uint8), np.zeros((1, 4, 2), np.uint8))
    with pytest.raises(ValueError, match=r"^scales has shape"):
        mxfp4.dequantize_gpt_oss(np.zeros((1, 4, 2, 16), np.uint8), np.zeros((1, 4, 1), np.uint8))
    with pytest.raises(ValueError, match=r"^codes must be 4-bit"):
        mxfp4.pack_e2m1(np.array([1, 16], np.uint8))
    with pytest.raises(ValueError, match=r"^codes: .*even length"):
        mxfp4.pack_e2m1(np.array([1, 2, 3], np.uint8))
    with pytest.raises(ValueError, match=r"^scale must have dtype uint8"):
        mxfp4.e8m0_to_float32(np.array([127], np.int32))
