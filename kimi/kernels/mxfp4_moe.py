"""MXFP4 routed experts as Pallas kernels: the weights stay packed and are dequantised tile by tile in the kernel.

Weights are the checkpoint's compressed-tensors layout (``kimi.mxfp4``): codes uint8 ``[E, N, K/2]`` (low nibble
= even input column) and E8M0 scales uint8 ``[E, N, K/32]``; ``y = x W^T`` per expert, accumulated in fp32.

Dequantisation inside the kernel (no table gather: Triton has none). For a nibble ``c``, the 16-bit pattern
``(c & 8) << 12 | (c & 7) << 9`` read as float16 is exactly ``E2M1(c) * 2**-14`` (code 1 lands on a float16
subnormal, which the f16 -> f32 conversion keeps exact); the block scale ``2**(s - 127)`` is built from its bits;
the ``2**14`` is put back on the fp32 accumulator once at the end (a power of two: exact). The low and high
nibbles of byte j are input columns 2j and 2j+1, so instead of interleaving the nibbles the activations are taken
as even and odd columns and ``x W^T = x_even W_lo^T + x_odd W_hi^T`` (the decode kernel reads them with strided
loads; the grouped kernels get them split outside, ``x[:, 0::2]``, ``x[:, 1::2]``). K tiles are multiples of 32, so
a tile holds whole scale blocks.

Two ways to dequantise, in both kernels (``dequant=``; ``DEFAULT_DEQUANT`` holds the default):

* ``"bits"``: the float16 placement above in plain jnp ops (portable; ~18 element ops per packed byte and matrix
  in the lowered Triton IR, addressing aside, ~14 of them integer ops, which run at half the FP32 rate on Hopper:
  an ALU ceiling near 40 % of H200 copy bandwidth by that count; measured on an H200: 36-37 %);
* ``"ptx"``: inline PTX (:data:`E2M1X4_PTX`) that turns 4 packed bytes into 4 bf16 values (low or high nibbles)
  with two ``prmt`` byte spreads, shifts and masks into bf16 bit positions and one ``fma.rn.bf16x2`` by
  ``2**126`` per pair (that multiply normalises the subnormal code 1 exactly): 3.5 ops per value, then a
  bf16 -> fp32 widening; ~12 element ops per packed byte and matrix in all, ~8 of them integer ops. On CPU
  (interpret mode) the same per-byte function runs as jnp; measured on an H200: 43 % of copy bandwidth in decode,
  the default since; ``tests/kimi/test_kernels_pallas.py`` runs the PTX
  text itself through a small interpreter on every byte value.

Two kernels, both ``pl.pallas_call`` over a grid, with the expert read from a routing array *inside* the body
(``w_ref[e, pl.ds(n0, tn), pl.ds(k0, tk/2)]``): Triton has no scalar prefetch, and a dynamic load is the same
thing on a GPU; only the routed experts' bytes are ever touched.

* decode (:func:`moe_decode`): a few rows routed to top-k experts. Grid ``(A, N/tn)`` over the A = T*X
  (token, slot) assignments; program (a, n) reads expert ``idx[a]``'s rows ``[n tn, (n+1) tn)`` once, K in a
  ``fori_loop`` of ``tk`` columns, as a multiply-reduce (a GEMV: M = 1 makes the tensor cores useless).
  Gate and up share the loop and the SiTU / SwiGLU epilogue; the down kernel multiplies by the routing weight;
  the X slots of a token are summed outside (``[T, X, D]`` fp32, small).
* grouped (:func:`grouped_matmul`, :func:`grouped_glu`, :func:`moe_grouped`): many rows sorted by expert (prefill,
  verify). Every group is padded to a multiple of the row tile ``tm`` (vLLM's ``moe_align_block_size`` idea), so
  each row tile belongs to one expert and no output block is shared by two programs (Triton runs grid steps in
  parallel). Grid ``(n_tiles, N/tn)`` with the static bound ``n_tiles = A // tm + min(E, A)``; ``tile_expert[i]``
  (-1 for the unused tail) picks the expert; ``jnp.dot`` on (tm, tk/2) x (tk/2, tn) tiles (tensor cores for bf16
  activations; fp32 activations use IEEE fp32). Empty groups own no tile; the tail tiles write zeros.

``interpret=None`` interprets on CPU; on a GPU the kernels lower through Triton (``kimi.kernels.common``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi import dispatch, mxfp4
from kimi.kernels.common import compiler_params, pick_block
from kimi.ops import moe as moe_ops
from kimi.ops.activations import glu

_F32 = jnp.float32
_BLK = mxfp4.BLOCK_SIZE  # 32 elements per scale
_UNSCALE = 16384.0  # 2**14: undoes the float16 placement of the E2M1 codes


# ----------------------------------------------------------------------------------------------------------------
# in-kernel dequantisation
def _e2m1_f32(nib_i32):
    """int32 nibbles (0..15) -> fp32 ``E2M1(code) * 2**-14`` (float16 bit placement, exact)."""
    bits = ((nib_i32 & 8) << 12) | ((nib_i32 & 7) << 9)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(_F32)


def _e8m0_f32(s_u8):
    """E8M0 bytes -> fp32 ``2**(s - 127)`` from the bits (as ``mxfp4.e8m0_to_float32``: 0 -> 2**-127, 0xFF NaN)."""
    s = s_u8.astype(jnp.int32)
    bits = jnp.where(s == 0, 0x00400000, jnp.where(s == 255, 0x7FC00000, s << 23))
    return lax.bitcast_convert_type(bits, _F32)


# Inline PTX: one 32-bit register holding 4 packed bytes ($2) -> the 4 bytes' low-nibble values (or high-nibble
# values) as 4 bf16 in two registers ($0: bytes 0, 1; $1: bytes 2, 3; byte 0 in the low half). Each byte is spread
# to a 16-bit lane (prmt); the nibble 0bSEEM goes to bf16 bits S -> 15, EEM -> 8..6 (exponent field EE, mantissa
# top bit M), which reads as E2M1(code) * 2**-126 (code 1 as a bf16 subnormal); fma by 2**126 (0x7E80) plus -0.0
# makes it exactly E2M1(code), signs and -0.0 included (bf16 arithmetic keeps subnormals). 14 instructions for 4
# values. (One block with both nibbles' results would share the prmt, but this JAX's Triton lowering of a
# multi-result inline asm is broken, and interleaving the results afterwards costs more than the spread.)
def _e2m1x4_ptx(mag_shift: int, sign_shift: int) -> str:
    lines = ["{", ".reg .b32 zero, magm, sgnm, bias, x, t, u;", "mov.b32 zero, 0;", "mov.b32 magm, 0x01C001C0;",
             "mov.b32 sgnm, 0x80008000;", "mov.b32 bias, 0x7E807E80;"]
    for out, sel in (("$0", "0x4140"), ("$1", "0x4342")):  # bytes 0, 1 / bytes 2, 3 into the two 16-bit lanes
        lines += [f"prmt.b32 x, $2, zero, {sel};", f"shl.b32 t, x, {mag_shift};", "and.b32 t, t, magm;",
                  f"shl.b32 u, x, {sign_shift};", "and.b32 u, u, sgnm;", "or.b32 t, t, u;",
                  f"fma.rn.bf16x2 {out}, t, bias, sgnm;"]
    return "\n".join(lines + ["}"])


E2M1X4_PTX = {"lo": _e2m1x4_ptx(6, 12), "hi": _e2m1x4_ptx(2, 8)}  # nibble bits 0-3 / 4-7 of each byte
E2M1X4_PTX_CONSTRAINTS = "=r,=r,r"  # 4 bf16 = 2 result registers, then 4 uint8 = 1 input register


def e2m1_pair_bf16(codes_u8, interpret: bool):
    """uint8 codes (any shape) -> (E2M1(low nibble), E2M1(high nibble)) as exact bf16 values, same shape.

    Compiled for a GPU these are the :data:`E2M1X4_PTX` blocks (``elementwise_inline_asm``, 4 bytes per
    instance); in interpret mode the same per-byte function in jnp."""
    if interpret:
        c = codes_u8.astype(jnp.int32)
        return tuple((_e2m1_f32(n) * _UNSCALE).astype(jnp.bfloat16) for n in (c & 15, c >> 4))
    out = jax.ShapeDtypeStruct(codes_u8.shape, jnp.bfloat16)
    return tuple(pltriton.elementwise_inline_asm(E2M1X4_PTX[half], args=[codes_u8],
                                                 constraints=E2M1X4_PTX_CONSTRAINTS, pack=4,
                                                 result_shape_dtypes=[out])[0] for half in ("lo", "hi"))


def _load_tile(w_ref, s_ref, e, n0, k_step, tn, kh, dequant, interpret):
    """Expert e, output rows [n0, n0 + tn), packed columns [k_step kh, (k_step + 1) kh): the low/high nibble
    values [tn, kh] (fp32 times 2**-14 for ``"bits"``, exact bf16 for ``"ptx"``: see :func:`_unscale`) and the
    fp32 scales [tn, kh / 16]."""
    G = kh // (_BLK // 2)
    k0 = pl.multiple_of(k_step * kh, kh)
    g0 = pl.multiple_of(k_step * G, G)
    codes = w_ref[e, pl.ds(n0, tn), pl.ds(k0, kh)]
    scale = _e8m0_f32(s_ref[e, pl.ds(n0, tn), pl.ds(g0, G)])
    if dequant == "ptx":
        lo, hi = e2m1_pair_bf16(codes, interpret)
        return lo, hi, scale
    codes = codes.astype(jnp.int32)
    return _e2m1_f32(codes & 15), _e2m1_f32(codes >> 4), scale


def _unscale(dequant):
    """What the accumulators are multiplied by at the end: 2**14 after the float16 placement, 1 after the PTX."""
    return _UNSCALE if dequant == "bits" else 1.0


def _scaled(v, scale, tn, kh):
    """[tn, kh] values times their block scale ([tn, kh/16]: 16 packed columns = 32 elements per scale)."""
    G = scale.shape[-1]
    return (v.reshape(tn, G, kh // G) * scale[:, :, None]).reshape(tn, kh)


def _epilogue(accs, mode, act):
    if mode == "glu":
        return glu(accs[0], accs[1], *act)
    return accs[0]


# ----------------------------------------------------------------------------------------------------------------
# decode: one program per (assignment, output tile)
def _decode_kernel(idx_ref, x_ref, *refs, X, nw, nk, kh, tn, mode, act, dequant, interpret):
    o_ref = refs[-1]
    w_refs = refs[: 2 * nw]
    a = pl.program_id(0)
    n0 = pl.multiple_of(pl.program_id(1) * tn, tn)
    e = idx_ref[a]
    t = a // X

    def body(k_step, accs):
        c0 = pl.multiple_of(k_step * 2 * kh, 2 * kh)  # input columns [c0, c0 + 2 kh): even ones meet the low
        xe = x_ref[t, pl.ds(c0, kh, stride=2)].astype(_F32)  # nibbles, odd ones the high nibbles (strided loads:
        xo = x_ref[t, pl.ds(c0 + 1, kh, stride=2)].astype(_F32)  # no even/odd split kernels around the call)
        out = []
        for i, acc in enumerate(accs):
            lo, hi, scale = _load_tile(w_refs[2 * i], w_refs[2 * i + 1], e, n0, k_step, tn, kh, dequant,
                                       interpret)
            p = lo.astype(_F32) * xe[None, :] + hi.astype(_F32) * xo[None, :]  # [tn, kh]
            G = scale.shape[-1]
            p = jnp.sum(p.reshape(tn, G, kh // G), axis=-1)  # per scale block
            out.append(acc + jnp.sum(p * scale, axis=-1))
        return tuple(out)

    accs = lax.fori_loop(0, nk, body, tuple(jnp.zeros((tn,), _F32) for _ in range(nw)))
    y = _epilogue([acc * _unscale(dequant) for acc in accs], mode, act)
    if mode == "down":
        y = y * refs[2 * nw][a]
    o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("X", "mode", "act", "tn", "tk", "out_dtype", "interpret", "num_warps",
                                             "dequant"))
def _decode_call(idx_A, x_TK, weights, rw_A, *, X, mode, act, tn, tk, out_dtype, interpret, num_warps, dequant):
    A = idx_A.shape[0]
    N = weights[0].shape[1]
    kh = tk // 2
    nk = x_TK.shape[1] // tk
    nw = len(weights) // 2
    kernel = functools.partial(_decode_kernel, X=X, nw=nw, nk=nk, kh=kh, tn=tn, mode=mode, act=act,
                               dequant=dequant, interpret=interpret)
    full = pl.BlockSpec()
    args = [idx_A, x_TK, *weights] + ([rw_A] if mode == "down" else [])
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((A, N), out_dtype), grid=(A, N // tn),
        in_specs=[full] * len(args), out_specs=pl.BlockSpec((None, tn), lambda a, n: (a, n)),
        interpret=interpret, name=f"mxfp4_moe_decode_{mode}",
        compiler_params=compiler_params(interpret, num_warps=num_warps, num_stages=2),
    )(*args)


# ----------------------------------------------------------------------------------------------------------------
# grouped: one program per (row tile of one expert, output tile)
def _grouped_kernel(te_ref, xe_ref, xo_ref, *refs, nw, nk, kh, tm, tn, mode, act, cdt, precision, dequant,
                    interpret):
    o_ref = refs[-1]
    w_refs = refs[: 2 * nw]
    n0 = pl.multiple_of(pl.program_id(1) * tn, tn)
    e = te_ref[pl.program_id(0)]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros((tm, tn), o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        def body(k_step, accs):
            k0 = pl.multiple_of(k_step * kh, kh)
            xe = xe_ref[:, pl.ds(k0, kh)].astype(cdt)
            xo = xo_ref[:, pl.ds(k0, kh)].astype(cdt)
            out = []
            for i, acc in enumerate(accs):
                lo, hi, scale = _load_tile(w_refs[2 * i], w_refs[2 * i + 1], e, n0, k_step, tn, kh, dequant,
                                           interpret)
                # "ptx": exact bf16 E2M1 times a power of 2 is exact in bf16, so it goes to a bf16 dot unwidened
                scale = scale.astype(lo.dtype)
                lo = _scaled(lo, scale, tn, kh).astype(cdt)
                hi = _scaled(hi, scale, tn, kh).astype(cdt)
                dims = (((1,), (1,)), ((), ()))
                acc = acc + lax.dot_general(xe, lo, dims, precision=precision, preferred_element_type=_F32)
                acc = acc + lax.dot_general(xo, hi, dims, precision=precision, preferred_element_type=_F32)
                out.append(acc)
            return tuple(out)

        accs = lax.fori_loop(0, nk, body, tuple(jnp.zeros((tm, tn), _F32) for _ in range(nw)))
        y = _epilogue([acc * _unscale(dequant) for acc in accs], mode, act)
        if mode == "down":
            y = y * refs[2 * nw][...][:, None]
        o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("mode", "act", "tm", "tn", "tk", "out_dtype", "interpret",
                                             "num_warps", "dequant"))
def _grouped_call(tile_e, xe_RH, xo_RH, weights, rw_R, *, mode, act, tm, tn, tk, out_dtype, interpret, num_warps,
                  dequant):
    Rp, Kh = xe_RH.shape
    N = weights[0].shape[1]
    kh = tk // 2
    nw = len(weights) // 2
    cdt = _F32 if xe_RH.dtype == _F32 else xe_RH.dtype
    precision = lax.Precision.HIGHEST if cdt == _F32 else None
    kernel = functools.partial(_grouped_kernel, nw=nw, nk=Kh // kh, kh=kh, tm=tm, tn=tn, mode=mode, act=act,
                               cdt=cdt, precision=precision, dequant=dequant, interpret=interpret)
    full = pl.BlockSpec()
    rows = pl.BlockSpec((tm, Kh), lambda i, n: (i, 0))
    in_specs = [full, rows, rows] + [full] * len(weights)
    args = [tile_e, xe_RH, xo_RH, *weights]
    if mode == "down":
        in_specs.append(pl.BlockSpec((tm,), lambda i, n: (i,)))
        args.append(rw_R)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((Rp, N), out_dtype), grid=(Rp // tm, N // tn),
        in_specs=in_specs, out_specs=pl.BlockSpec((tm, tn), lambda i, n: (i, n)),
        interpret=interpret, name=f"mxfp4_moe_grouped_{mode}",
        compiler_params=compiler_params(interpret, num_warps=num_warps, num_stages=2),
    )(*args)


# ----------------------------------------------------------------------------------------------------------------
# wrappers
def _check_weights(pairs, K_in: Optional[int] = None, N: Optional[int] = None, E: Optional[int] = None):
    """pairs: ((packed, scale), ...) -> (E, N, K_in) shared by all; checked against the given K_in, N, E."""
    E0 = N0 = K0 = None
    for packed, scale in pairs:
        if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8 or packed.ndim != 3:
            raise ValueError(f"MXFP4 weights must be uint8 [E, N, K/2] codes and [E, N, K/32] scales, got "
                             f"{packed.dtype}{tuple(packed.shape)} and {scale.dtype}{tuple(scale.shape)}")
        E, n, kh = packed.shape
        if tuple(scale.shape) != (E, n, 2 * kh // _BLK) or (2 * kh) % _BLK:
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match codes {tuple(packed.shape)}")
        if E0 is None:
            E0, N0, K0 = E, n, 2 * kh
        elif (E, n, 2 * kh) != (E0, N0, K0):
            raise ValueError(f"fused weights differ in shape: {(E, n, 2 * kh)} vs {(E0, N0, K0)}")
    if K_in is not None and K0 != K_in:
        raise ValueError(f"activations have {K_in} features, the MXFP4 weights take {K0}")
    if (N is not None and N0 != N) or (E is not None and E0 != E):
        raise ValueError(f"MXFP4 weights [{E0}, {N0}, {K0}] do not match E={E}, N={N}")
    return E0, N0, K0


def _blocks(N, K, tn, tk, interpret, tn_gpu, tk_gpu):
    tn = tn or pick_block(N, 512 if interpret else tn_gpu, 16)
    tk = tk or pick_block(K, 512 if interpret else tk_gpu, _BLK)
    if N % tn or K % tk or tk % _BLK:
        raise ValueError(f"blocks tn={tn}, tk={tk} must divide N={N}, K={K}, and tk be a multiple of {_BLK}")
    return tn, tk


def _even_odd(x):
    return x[..., 0::2], x[..., 1::2]


def _act(act, beta, linear_beta):
    return (act, None if beta is None else float(beta), None if linear_beta is None else float(linear_beta))


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """The decode kernel's launch choices on a GPU (interpret mode takes whole dims up to 512 instead).

    tn: output rows per program; tk: input columns per loop step (a multiple of 32); num_warps: Triton warps per
    program. ``scripts/bench_kernels.py`` times a sweep of these on a GPU and reports the fastest; this default is
    the one place to change after such a run. Set from the first H200 run (2026-12-04, jax 0.11.2, K3 shapes: 16
    routed experts of 3 x 3072 x 3584): tn=32, tk=512, 4 warps with the "ptx" dequantisation was the fastest of
    ten variants, 169 us, 43% of the measured copy bandwidth, 4.1x the XLA reference (docs/performance.md)."""
    tn: int = 32
    tk: int = 512
    num_warps: int = 4


DECODE_TUNING = DecodeTuning()
DEQUANT_MODES = ("bits", "ptx")
DEFAULT_DEQUANT = "ptx"
"""Both kernels' dequantisation unless a call says otherwise (module docstring). "ptx" since the first H200 run
timed it: decode 169 us against "bits"' 198 us at the same tiles, an 8-token verify through the grouped kernels
737 against 992 us (docs/performance.md)."""


def _dequant(dequant: Optional[str]) -> str:
    dequant = dequant or DEFAULT_DEQUANT
    if dequant not in DEQUANT_MODES:
        raise ValueError(f"dequant must be one of {DEQUANT_MODES}, got {dequant!r}")
    return dequant


@functools.partial(jax.jit, static_argnames=("act", "beta", "linear_beta", "tn", "tk", "interpret", "num_warps",
                                             "dequant"))
def moe_decode(x_TD, w_TX, idx_TX, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, act: str,
               beta=None, linear_beta=None, *, tn: Optional[int] = None, tk: Optional[int] = None,
               interpret: Optional[bool] = None, num_warps: Optional[int] = None, dequant: Optional[str] = None):
    """Routed experts for a few rows: ``y[t] = sum_x w[t,x] W2_e act(W1_e x_t, W3_e x_t)``, e = idx[t, x].

    Same result as ``moe_ops.experts_gathered`` on the gathered, dequantised experts; reads only the T*X routed
    experts' packed bytes. ``tn`` / ``tk``: output / input tile (default: whole dims up to 512 when interpreting,
    :data:`DECODE_TUNING` on a GPU); ``num_warps``: default from :data:`DECODE_TUNING`; ``dequant``:
    :data:`DEFAULT_DEQUANT`."""
    interpret = dispatch.pallas_interpret(interpret)
    dequant = _dequant(dequant)
    num_warps = num_warps or DECODE_TUNING.num_warps
    T, D = x_TD.shape
    X = idx_TX.shape[1]
    E, F, _ = _check_weights([(w1_packed, w1_scale), (w3_packed, w3_scale)], K_in=D)
    _check_weights([(w2_packed, w2_scale)], K_in=F, N=D, E=E)
    a = _act(act, beta, linear_beta)
    idx_A = idx_TX.reshape(-1).astype(jnp.int32)
    tn1, tk1 = _blocks(F, D, tn, tk, interpret, DECODE_TUNING.tn, DECODE_TUNING.tk)
    tn2, tk2 = _blocks(D, F, tn, tk, interpret, DECODE_TUNING.tn, DECODE_TUNING.tk)
    kw = dict(interpret=interpret, num_warps=num_warps, dequant=dequant)
    h_AF = _decode_call(idx_A, x_TD, (w1_packed, w1_scale, w3_packed, w3_scale), None, X=X, mode="glu", act=a,
                        tn=tn1, tk=tk1, out_dtype=x_TD.dtype, **kw)
    # the down kernel runs with X=1: assignment a reads row a of h
    y_AD = _decode_call(idx_A, h_AF, (w2_packed, w2_scale), w_TX.reshape(-1).astype(_F32), X=1, mode="down",
                        act=a, tn=tn2, tk=tk2, out_dtype=_F32, **kw)
    return y_AD.reshape(T, X, D).sum(axis=1).astype(x_TD.dtype)


def _layout(expert_A, n_groups: int, tm: int):
    """Lay out A assignments (group ids in [0, n_groups)) by group, every group padded to a multiple of tm.

    Returns (pos_A: the padded row of each assignment, tile_e [n_tiles]: the group of each row tile, -1 past the
    used rows, n_tiles: the static bound A // tm + min(n_groups, A)); empty groups own no tile."""
    A = expert_A.shape[0]
    order = jnp.argsort(expert_A, stable=True)
    sizes = jnp.bincount(expert_A, length=n_groups)
    padded = (sizes + tm - 1) // tm * tm
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    start = jnp.cumsum(sizes) - sizes
    e_sorted = expert_A[order]
    pos_sorted = pstart[e_sorted] + jnp.arange(A) - start[e_sorted]
    pos_A = jnp.zeros((A,), jnp.int32).at[order].set(pos_sorted.astype(jnp.int32))
    n_tiles = A // tm + min(n_groups, A)
    tile_start = jnp.arange(n_tiles) * tm
    tile_e = jnp.searchsorted(pend, tile_start, side="right")
    tile_e = jnp.where(tile_start < pend[-1], tile_e, -1).astype(jnp.int32)
    return pos_A, tile_e, n_tiles


def _grouped_blocks(R, N, K, tm, tn, tk, interpret):
    tm = tm or (16 if interpret or R <= 1024 else 64)
    tn, tk = _blocks(N, K, tn, tk, interpret, 64, 128)
    return tm, tn, tk


def _rows_of_groups(group_sizes_E, R):
    """Group of each of R sorted rows (E for rows past sum(group_sizes), which get zeros like ragged_dot)."""
    ends = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(R), side="right").astype(jnp.int32)


def _group_tiles(x_RK, group_sizes_E, E: int, tm: int):
    """Rows sorted by group laid out in row tiles of ``tm``, every group padded to whole tiles: (the tile position
    of each row [R], each tile's group [n_tiles] (-1: padding), the tiles' even / odd columns of x)."""
    R = x_RK.shape[0]
    g_R = _rows_of_groups(group_sizes_E, R)
    pos_R, tile_e, n_tiles = _layout(g_R, E + 1, tm)
    tile_e = jnp.where(tile_e >= E, -1, tile_e)
    src = jnp.zeros((n_tiles * tm,), jnp.int32).at[pos_R].set(jnp.arange(R, dtype=jnp.int32))
    xe, xo = _even_odd(x_RK[src])
    return pos_R, tile_e, xe, xo


@functools.partial(jax.jit, static_argnames=("tm", "tn", "tk", "interpret", "dequant"))
def grouped_matmul(x_RK, packed_ENH, scale_ENG, group_sizes_E, *, tm: Optional[int] = None,
                   tn: Optional[int] = None, tk: Optional[int] = None, interpret: Optional[bool] = None,
                   dequant: Optional[str] = None):
    """``jax.lax.ragged_dot(x, dequantize(packed, scale).swapaxes(1, 2), group_sizes)`` with the weights packed:
    rows sorted by group, ``group_sizes`` [E] (empty groups allowed; rows past their sum give zeros). fp32 out."""
    interpret = dispatch.pallas_interpret(interpret)
    R, K = x_RK.shape
    E, N, _ = _check_weights([(packed_ENH, scale_ENG)], K_in=K)
    tm, tn, tk = _grouped_blocks(R, N, K, tm, tn, tk, interpret)
    pos_R, tile_e, xe, xo = _group_tiles(x_RK, group_sizes_E, E, tm)
    y = _grouped_call(tile_e, xe, xo, (packed_ENH, scale_ENG), None, mode="plain", act=None, tm=tm, tn=tn, tk=tk,
                      out_dtype=_F32, interpret=interpret, num_warps=4, dequant=_dequant(dequant))
    return y[pos_R]


@functools.partial(jax.jit, static_argnames=("act", "beta", "linear_beta", "tm", "tn", "tk", "interpret", "dequant"))
def grouped_glu(x_RK, w1_packed, w1_scale, w3_packed, w3_scale, group_sizes_E, act: str, beta=None,
                linear_beta=None, *, tm: Optional[int] = None, tn: Optional[int] = None, tk: Optional[int] = None,
                interpret: Optional[bool] = None, dequant: Optional[str] = None):
    """Gate and up fused: ``act(x W1_g^T, x W3_g^T)`` per row of group g (SiTU or SwiGLU epilogue in the kernel),
    rows sorted by group. Output in x's dtype."""
    interpret = dispatch.pallas_interpret(interpret)
    R, K = x_RK.shape
    E, F, _ = _check_weights([(w1_packed, w1_scale), (w3_packed, w3_scale)], K_in=K)
    tm, tn, tk = _grouped_blocks(R, F, K, tm, tn, tk, interpret)
    pos_R, tile_e, xe, xo = _group_tiles(x_RK, group_sizes_E, E, tm)
    h = _grouped_call(tile_e, xe, xo, (w1_packed, w1_scale, w3_packed, w3_scale), None, mode="glu",
                      act=_act(act, beta, linear_beta), tm=tm, tn=tn, tk=tk, out_dtype=x_RK.dtype,
                      interpret=interpret, num_warps=4, dequant=_dequant(dequant))
    return h[pos_R]


@functools.partial(jax.jit, static_argnames=("act", "beta", "linear_beta", "tm", "tn", "tk", "interpret", "dequant"))
def moe_grouped(x_TD, w_TX, idx_TX, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, act: str,
                beta=None, linear_beta=None, *, tm: Optional[int] = None, tn: Optional[int] = None,
                tk: Optional[int] = None, interpret: Optional[bool] = None, dequant: Optional[str] = None):
    """Routed experts for many rows (prefill, verify): the same result as ``moe_ops.experts_grouped`` with the
    dequantised weights. Assignments are laid out by expert with every group padded to the row tile; gate+up and
    down are two grouped kernels on that layout; the X slots of a token are gathered back and summed."""
    interpret = dispatch.pallas_interpret(interpret)
    T, D = x_TD.shape
    X = idx_TX.shape[1]
    A = T * X
    E, F, _ = _check_weights([(w1_packed, w1_scale), (w3_packed, w3_scale)], K_in=D)
    _check_weights([(w2_packed, w2_scale)], K_in=F, N=D, E=E)
    tm, tn1, tk1 = _grouped_blocks(A, F, D, tm, tn, tk, interpret)
    _, tn2, tk2 = _grouped_blocks(A, D, F, tm, tn, tk, interpret)
    pos_A, tile_e, n_tiles = _layout(idx_TX.reshape(-1).astype(jnp.int32), E, tm)
    Rp = n_tiles * tm
    tok = jnp.zeros((Rp,), jnp.int32).at[pos_A].set(jnp.arange(A, dtype=jnp.int32) // X)
    rw = jnp.zeros((Rp,), _F32).at[pos_A].set(w_TX.reshape(-1).astype(_F32))
    xe, xo = _even_odd(x_TD)
    a = _act(act, beta, linear_beta)
    kw = dict(interpret=interpret, num_warps=4, dequant=_dequant(dequant))
    h = _grouped_call(tile_e, xe[tok], xo[tok], (w1_packed, w1_scale, w3_packed, w3_scale), None, mode="glu",
                      act=a, tm=tm, tn=tn1, tk=tk1, out_dtype=x_TD.dtype, **kw)
    he, ho = _even_odd(h)
    y = _grouped_call(tile_e, he, ho, (w2_packed, w2_scale), rw, mode="down", act=a, tm=tm, tn=tn2, tk=tk2,
                      out_dtype=_F32, **kw)
    return y[pos_A].reshape(T, X, D).sum(axis=1).astype(x_TD.dtype)


# ----------------------------------------------------------------------------------------------------------------
# jnp references (dequantise, then the kimi.ops.moe paths)
@functools.partial(jax.jit, static_argnames=("act", "beta", "linear_beta"))
def moe_decode_reference(x_TD, w_TX, idx_TX, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                         act: str, beta=None, linear_beta=None):
    dt = x_TD.dtype
    deq = lambda p, s: mxfp4.dequantize(p[idx_TX], s[idx_TX], dtype=dt)
    return moe_ops.experts_gathered(x_TD, w_TX, deq(w1_packed, w1_scale), deq(w3_packed, w3_scale),
                                    deq(w2_packed, w2_scale), act, beta, linear_beta)


@functools.partial(jax.jit, static_argnames=("act", "beta", "linear_beta"))
def moe_grouped_reference(x_TD, w_TX, idx_TX, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                          act: str, beta=None, linear_beta=None):
    dt = x_TD.dtype
    deq = lambda p, s: mxfp4.dequantize(p, s, dtype=dt)
    return moe_ops.experts_grouped(x_TD, w_TX, idx_TX, deq(w1_packed, w1_scale), deq(w3_packed, w3_scale),
                                   deq(w2_packed, w2_scale), act, beta, linear_beta)


def routed_experts(experts, z_TD, w_TX, idx_TX, decode: bool, interpret: Optional[bool] = None):
    """``RoutedExperts`` (MXFP4) through the kernels: :func:`moe_decode` when ``decode``, else :func:`moe_grouped`."""
    c = experts.cfg
    ws = []
    for name in ("w1", "w3", "w2"):
        ws += [getattr(experts, f"{name}_packed")[...], getattr(experts, f"{name}_scale")[...]]
    fn = moe_decode if decode else moe_grouped
    return fn(z_TD, w_TX, idx_TX, *ws, c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta,
              interpret=interpret)


__all__ = ["moe_decode", "moe_grouped", "grouped_matmul", "grouped_glu", "DecodeTuning", "DECODE_TUNING",
           "DEFAULT_DEQUANT", "DEQUANT_MODES", "E2M1X4_PTX", "e2m1_pair_bf16", "moe_decode_reference",
           "moe_grouped_reference", "routed_experts"]
