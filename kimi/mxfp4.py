"""MXFP4 (OCP Microscaling Formats v1.0, element type E2M1, block 32, E8M0 scale) for NumPy and JAX.

Format
------
* Element, E2M1 (4 bits, ``0bSEEM``): bit 3 is the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa.
  Exponent 0 is subnormal (``0.5 * M``); otherwise the value is ``2**(E-1) * (1 + M/2)``::

      code  0    1    2    3    4    5    6    7       8..15: the same magnitudes, negative
      value 0.0  0.5  1.0  1.5  2.0  3.0  4.0  6.0     (code 8 is -0.0)

  There is no Inf or NaN; the largest magnitude is 6.
* Scale, E8M0 (one unsigned byte ``s``): the value ``2**(s - 127)``; ``s = 0xFF`` is NaN; zero and Inf
  cannot be represented. ``s = 0`` is ``2**-127``, a float32 subnormal.
* One scale per block of 32 consecutive elements along the input (contraction) axis;
  element value = ``2**(s - 127) * E2M1(code)``.

Layouts
-------
Shape letters used in names (they extend the glossary in ``kimi/__init__.py``): ``O`` output rows,
``I`` input columns (the contraction axis), ``H = I/2`` packed bytes, ``G = I/32`` blocks, ``Q = 16`` bytes
per block (gpt-oss), ``N`` a generic element count. Any number of leading dims (experts ``E``, ...) may come
first; names leave them out.

* Kimi K3 compressed-tensors: ``weight_packed`` uint8 ``[..., O, I/2]``, two codes per byte with the
  **low nibble holding the even column** (byte ``0x21`` is ``[code 1, code 2] = [0.5, 1.0]``), and
  ``weight_scale`` uint8 ``[..., O, I/32]``.
* gpt-oss / Hugging Face: ``*_blocks`` uint8 ``[E, O, I/32, 16]`` and ``*_scales`` uint8 ``[E, O, I/32]``.
  Same bytes in the same order: the two layouts differ by a reshape of the last axes only
  (:func:`gpt_oss_to_compressed`, :func:`compressed_to_gpt_oss`). Note transformers'
  ``convert_moe_packed_tensors`` returns the dequantised weight transposed, ``[E, I, O]``; our
  :func:`dequantize_gpt_oss` returns ``[E, O, I]``.

Backends
--------
Every function accepts NumPy arrays (returns NumPy) or JAX arrays / tracers (returns JAX; jittable, any
leading dims). Both paths run the same code through an array namespace and give identical bytes and
values, with one caveat: XLA on CPU and GPU flushes subnormal float32 results to zero, so on the JAX path
dequantised values of magnitude below ``2**-126`` (only possible with scale bytes 0..2) become 0, and
subnormal inputs to :func:`quantize` count as 0. :func:`e8m0_to_float32` itself is exact on both paths
(it builds the float32 bits directly).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 32
"""Elements that share one E8M0 scale (along the input axis)."""
E2M1_EMAX = 2
"""Exponent of E2M1's largest power of two (4 = 2**2); OCP's scale is 2**(floor(log2(amax)) - E2M1_EMAX)."""
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
"""The 16-entry decoding table: ``E2M1_VALUES[code]`` for codes 0..15."""

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "unpack_nibbles",
    "unpack_e2m1",
    "pack_e2m1",
    "e8m0_to_float32",
    "quantize",
    "dequantize",
    "quantize_dequantize",
    "gpt_oss_to_compressed",
    "compressed_to_gpt_oss",
    "dequantize_gpt_oss",
]


# ----------------------------------------------------------------------------------------------------------
# helpers


def _is_jax(*arrays) -> bool:
    return any(isinstance(a, jax.Array) for a in arrays)


def _xp(*arrays):
    return jnp if _is_jax(*arrays) else np


def _as_array(x, xp):
    return x if xp is jnp else np.asarray(x)


def _bitcast(x, dtype, xp):
    """Reinterpret the bits of ``x`` as ``dtype`` (same item size)."""
    if xp is jnp:
        return jax.lax.bitcast_convert_type(x, dtype)
    return x.view(dtype)


def _check_uint8(x, name: str):
    if np.dtype(x.dtype) != np.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {x.dtype}")


def _gather_lut(codes_N, xp):
    """``E2M1_VALUES[codes]`` as float32 (codes are 0..15 by construction)."""
    if xp is jnp:
        return jnp.asarray(E2M1_VALUES).at[codes_N].get(mode="promise_in_bounds")
    return E2M1_VALUES[codes_N]


def _check_packed_scale(packed_OH, scale_OG, packed_name: str, scale_name: str):
    _check_uint8(packed_OH, packed_name)
    _check_uint8(scale_OG, scale_name)
    if packed_OH.ndim < 1:
        raise ValueError(f"{packed_name} must have at least one axis, got shape {tuple(packed_OH.shape)}")
    n_in = 2 * packed_OH.shape[-1]
    if n_in % BLOCK_SIZE:
        raise ValueError(
            f"{packed_name}: the input axis (2 * {packed_OH.shape[-1]} = {n_in} elements) is not a multiple of "
            f"{BLOCK_SIZE}; shape {tuple(packed_OH.shape)}"
        )
    want = tuple(packed_OH.shape[:-1]) + (n_in // BLOCK_SIZE,)
    if tuple(scale_OG.shape) != want:
        raise ValueError(
            f"{scale_name} has shape {tuple(scale_OG.shape)}, expected {want} for {packed_name} of shape "
            f"{tuple(packed_OH.shape)} (one scale per {BLOCK_SIZE} elements)"
        )


# ----------------------------------------------------------------------------------------------------------
# elements and scales


def unpack_nibbles(packed_H):
    """uint8 ``[..., N/2]`` -> uint8 codes ``[..., N]``, low nibble first (``0x21`` -> ``[1, 2]``)."""
    xp = _xp(packed_H)
    packed_H = _as_array(packed_H, xp)
    _check_uint8(packed_H, "packed")
    lo_H = packed_H & np.uint8(0x0F)
    hi_H = packed_H >> np.uint8(4)
    codes_H2 = xp.stack([lo_H, hi_H], axis=-1)
    return codes_H2.reshape(tuple(packed_H.shape[:-1]) + (2 * packed_H.shape[-1],))


def unpack_e2m1(packed_H):
    """Decode packed E2M1 codes: uint8 ``[..., N/2]`` -> float32 ``[..., N]`` (16-entry table, low nibble first).

    ``unpack_e2m1(np.array([0x21], np.uint8))`` is ``[0.5, 1.0]``. No scale is applied.
    """
    xp = _xp(packed_H)
    return _gather_lut(unpack_nibbles(packed_H), xp)


def pack_e2m1(codes_N):
    """Pack E2M1 codes (uint8 ``[..., N]``, values 0..15, ``N`` even) into uint8 ``[..., N/2]``.

    Column ``2j`` goes to the low nibble of byte ``j`` and column ``2j + 1`` to the high nibble.
    NumPy inputs with a code above 15 raise ValueError; on the JAX path codes are masked to 4 bits.
    """
    xp = _xp(codes_N)
    codes_N = _as_array(codes_N, xp)
    _check_uint8(codes_N, "codes")
    if codes_N.ndim < 1 or codes_N.shape[-1] % 2:
        raise ValueError(f"codes: the last axis must have even length, got shape {tuple(codes_N.shape)}")
    if xp is np and codes_N.size and int(codes_N.max()) > 15:
        raise ValueError(f"codes must be 4-bit values 0..15, got a maximum of {int(codes_N.max())}")
    codes_H2 = codes_N.reshape(tuple(codes_N.shape[:-1]) + (codes_N.shape[-1] // 2, 2)) & np.uint8(0x0F)
    return (codes_H2[..., 0] | (codes_H2[..., 1] << np.uint8(4))).astype(np.uint8)


def e8m0_to_float32(scale_u8):
    """E8M0 bytes -> float32 ``2**(s - 127)``, exactly (``s = 0`` gives the subnormal ``2**-127``; 0xFF is NaN).

    Built from the float32 bit pattern, so it is exact on XLA too (no arithmetic, no flush to zero).
    """
    xp = _xp(scale_u8)
    scale_u8 = _as_array(scale_u8, xp)
    _check_uint8(scale_u8, "scale")
    s = scale_u8.astype(np.uint32)
    bits = xp.where(
        s == 0,
        np.uint32(0x00400000),  # 2**-127: subnormal, mantissa bit 22
        xp.where(s == E8M0_NAN, np.uint32(0x7FC00000), s << np.uint32(23)),
    ).astype(np.uint32)
    return _bitcast(bits, np.float32, xp)


def _exp2_float32(e_int, xp):
    """``2.0 ** e`` for integer ``e`` in the float32 normal range [-126, 127], from the bits."""
    return _bitcast(((e_int + 127).astype(np.uint32) << np.uint32(23)).astype(np.uint32), np.float32, xp)


# ----------------------------------------------------------------------------------------------------------
# quantize / dequantize (compressed-tensors layout)


def _round_to_e2m1_codes(v_N, xp):
    """float32 values (already divided by the block scale) -> E2M1 codes, round to nearest, ties to even
    mantissa, saturating at +-6. Returns uint8 codes with the sign in bit 3 (``-0.0`` and small negatives -> 8)."""
    a = xp.abs(v_N)
    # [0, 2): grid step 0.5 -> code k = rne(2a) in 0..4 (code parity == mantissa bit, so half-even == even mantissa)
    c_lo = xp.round(a * 2.0)
    # [2, 4): step 1 -> values 2, 3, 4 = codes 4, 5, 6
    c_mid = xp.round(a) + 2.0
    # [4, inf): step 2 -> values 4, 6 = codes 6, 7; everything above 6 saturates
    c_hi = xp.minimum(xp.round(a * 0.5), 3.0) + 4.0
    mag = xp.where(a < 2.0, c_lo, xp.where(a < 4.0, c_mid, c_hi)).astype(np.uint8)
    sign = xp.signbit(v_N).astype(np.uint8) << np.uint8(3)
    return (mag | sign).astype(np.uint8)


def quantize(w_OI):
    """Quantise ``w[..., O, I]`` (``I`` a multiple of 32) to MXFP4, OCP MX v1.0 style.

    Returns ``(packed uint8 [..., O, I/2], scale uint8 [..., O, I/32])`` in the compressed-tensors layout.

    Per block of 32 along ``I``:

    * scale exponent ``X = floor(log2(amax)) - 2`` (2 is E2M1's emax), clamped to E8M0's range, so the scale
      byte is ``X + 127``. ``floor(log2(amax))`` is read from amax's float32 exponent field, which is exact.
    * An **all-zero block** (and any block with ``amax < 2**-124``) gets scale byte 0 (``2**-127``), the value
      the clamp gives as amax -> 0; its codes are all 0 (or 8 for ``-0.0``).
    * A block holding NaN or +-Inf gets scale byte 0xFF (NaN) and codes 0: it dequantises to NaN.
    * Elements ``w / 2**X`` round to the nearest E2M1 value, ties to even mantissa (2.5 -> 2, 3.5 -> 4,
      0.25 -> 0, 0.75 -> 1, 5 -> 4), and saturate to +-6 (values in (6, 8) can occur: OCP's scale choice
      clips the top of each block). The sign is kept, also for values that round to zero.

    Computation is in float32 (bf16 / fp16 inputs convert exactly; float64 inputs are rounded to float32 first).
    """
    xp = _xp(w_OI)
    w_OI = _as_array(w_OI, xp)
    if not jnp.issubdtype(w_OI.dtype, jnp.floating):
        raise ValueError(f"w must be a floating-point array, got dtype {w_OI.dtype}")
    if w_OI.ndim < 1 or w_OI.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"w: the input (last) axis must be a multiple of {BLOCK_SIZE}, got shape {tuple(w_OI.shape)}"
        )
    if xp is jnp:
        return _quantize_jit(w_OI)
    return _quantize_body(w_OI, np)


def _quantize_body(w_OI, xp):
    lead = tuple(w_OI.shape[:-1])
    n_in = w_OI.shape[-1]
    w_OGB = w_OI.astype(np.float32).reshape(lead + (n_in // BLOCK_SIZE, BLOCK_SIZE))

    amax_OG = xp.max(xp.abs(w_OGB), axis=-1)
    field_OG = (_bitcast(amax_OG, np.uint32, xp) >> np.uint32(23)).astype(np.int32)  # biased exponent, 0..255
    finite_OG = field_OG != 255
    # byte = X + 127 = floor(log2 amax) - 2 + 127 = field - 2 for normal amax; clamp at 0 (X = -127)
    byte_OG = xp.clip(field_OG - E2M1_EMAX, 0, 254)
    x_OG = byte_OG - E8M0_BIAS  # in [-127, 125] for float32 inputs
    inv_scale_OG = _exp2_float32(-x_OG, xp)  # 2**-X, a normal float32 (never the subnormal 2**-127)

    w_OGB = xp.where(finite_OG[..., None], w_OGB, np.float32(0.0))  # NaN / Inf blocks: codes 0
    v_OGB = w_OGB * inv_scale_OG[..., None]
    codes_OGB = _round_to_e2m1_codes(v_OGB, xp)
    scale_OG = xp.where(finite_OG, byte_OG, E8M0_NAN).astype(np.uint8)
    packed_OH = pack_e2m1(codes_OGB.reshape(lead + (n_in,)))
    return packed_OH, scale_OG


_quantize_jit = jax.jit(lambda w_OI: _quantize_body(w_OI, jnp))


def dequantize(packed_OH, scale_OG, dtype=jnp.float32):
    """MXFP4 -> ``dtype [..., O, I]`` from ``packed uint8 [..., O, I/2]`` and ``scale uint8 [..., O, I/32]``.

    ``out[..., o, i] = E2M1(code[o, i]) * 2**(scale[o, i // 32] - 127)``, computed in float32 (exact:
    a 2-significant-bit value times a power of two) and cast to ``dtype`` once (exact for float32 and
    bfloat16, which share float32's exponent range). One 16-entry table gather on the nibbles and one
    broadcast multiply per block of 32; under ``jit`` XLA fuses it into a single elementwise pass, so it is
    meant to run on gathered experts inside a MoE (``dequantize(packed[idx], scale[idx])``).
    On the JAX path, results below ``2**-126`` in magnitude flush to zero (see module docstring).
    """
    xp = _xp(packed_OH, scale_OG)
    packed_OH = _as_array(packed_OH, xp)
    scale_OG = _as_array(scale_OG, xp)
    _check_packed_scale(packed_OH, scale_OG, "packed", "scale")
    if xp is jnp:
        return _dequantize_jit(packed_OH, scale_OG, np.dtype(dtype))
    return _dequantize_body(packed_OH, scale_OG, np.dtype(dtype))


def _dequantize_body(packed_OH, scale_OG, dtype):
    lead = tuple(packed_OH.shape[:-1])
    n_in = 2 * packed_OH.shape[-1]
    vals_OGB = unpack_e2m1(packed_OH).reshape(lead + (n_in // BLOCK_SIZE, BLOCK_SIZE))
    out_OGB = vals_OGB * e8m0_to_float32(scale_OG)[..., None]
    return out_OGB.reshape(lead + (n_in,)).astype(dtype)


# Eager JAX callers get one compiled program instead of op-by-op dispatch; inside an outer jit this nests
# (and is inlined by XLA).
_dequantize_jit = jax.jit(_dequantize_body, static_argnums=2)


def quantize_dequantize(w_OI, dtype=None):
    """``dequantize(*quantize(w))``: the MXFP4-rounded copy of ``w`` (dtype defaults to ``w.dtype``)."""
    packed_OH, scale_OG = quantize(w_OI)
    return dequantize(packed_OH, scale_OG, dtype=w_OI.dtype if dtype is None else dtype)


# ----------------------------------------------------------------------------------------------------------
# gpt-oss / Hugging Face layout


def _check_gpt_oss(blocks_OGQ, scales_OG):
    _check_uint8(blocks_OGQ, "blocks")
    _check_uint8(scales_OG, "scales")
    if blocks_OGQ.ndim < 2 or blocks_OGQ.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(
            f"blocks must have shape [..., O, I/32, {BLOCK_SIZE // 2}], got {tuple(blocks_OGQ.shape)}"
        )
    if tuple(scales_OG.shape) != tuple(blocks_OGQ.shape[:-1]):
        raise ValueError(
            f"scales has shape {tuple(scales_OG.shape)}, expected {tuple(blocks_OGQ.shape[:-1])} "
            f"(blocks.shape[:-1]) for blocks of shape {tuple(blocks_OGQ.shape)}"
        )


def gpt_oss_to_compressed(blocks_OGQ, scales_OG):
    """gpt-oss ``(blocks [..., O, I/32, 16], scales [..., O, I/32])`` -> compressed-tensors
    ``(packed [..., O, I/2], scale [..., O, I/32])``. A reshape: the bytes are identical."""
    xp = _xp(blocks_OGQ, scales_OG)
    blocks_OGQ = _as_array(blocks_OGQ, xp)
    scales_OG = _as_array(scales_OG, xp)
    _check_gpt_oss(blocks_OGQ, scales_OG)
    lead = tuple(blocks_OGQ.shape[:-2])
    packed_OH = blocks_OGQ.reshape(lead + (blocks_OGQ.shape[-2] * blocks_OGQ.shape[-1],))
    return packed_OH, scales_OG


def compressed_to_gpt_oss(packed_OH, scale_OG):
    """compressed-tensors ``(packed [..., O, I/2], scale [..., O, I/32])`` -> gpt-oss
    ``(blocks [..., O, I/32, 16], scales [..., O, I/32])``. A reshape: the bytes are identical."""
    xp = _xp(packed_OH, scale_OG)
    packed_OH = _as_array(packed_OH, xp)
    scale_OG = _as_array(scale_OG, xp)
    _check_packed_scale(packed_OH, scale_OG, "packed", "scale")
    lead = tuple(packed_OH.shape[:-1])
    blocks_OGQ = packed_OH.reshape(lead + (packed_OH.shape[-1] // (BLOCK_SIZE // 2), BLOCK_SIZE // 2))
    return blocks_OGQ, scale_OG


def dequantize_gpt_oss(blocks_OGQ, scales_OG, dtype=jnp.float32):
    """Dequantise gpt-oss ``blocks uint8 [E, O, I/32, 16]`` and ``scales uint8 [E, O, I/32]`` to ``[E, O, I]``.

    Any leading dims are allowed. transformers' ``convert_moe_packed_tensors`` gives the same values
    transposed to ``[E, I, O]``: compare with ``dequantize_gpt_oss(b, s).swapaxes(-1, -2)``.
    """
    packed_OH, scale_OG = gpt_oss_to_compressed(blocks_OGQ, scales_OG)
    return dequantize(packed_OH, scale_OG, dtype=dtype)
