"""Fused KDA decode / verify step as one Pallas kernel per (batch row, head).

Per program (b, h), for each position in turn (a ``fori_loop``; T = 1: decode, T = 2..8: verify), all in fp32:

    conv    : xx = [conv_state (W rows), pre_0 .. pre_t]; c = silu(sum_j w[:, j] * xx[t + j]) for q, k and v of head h
    l2 norm : q = l2norm(c_q) * K**-0.5,  k = l2norm(c_k),  v = c_v
    gate    : g = lb * sigmoid(exp(A_log[h]) * (a + dt_bias))   (K3)   or  -exp(A_log[h]) * softplus(a + dt_bias)
    beta    : sigmoid(b)
    delta   : S = Diag(exp g) S;  S += beta k (v - S^T k)^T;  o = S^T q
    out     : y = o * rsqrt(mean(o^2) + eps) * o_norm_weight * sigmoid(gate_t)

The fp32 state [B, H, K, V] and the conv state [B, W, 3P] are updated in place (``input_output_aliases``); the
verify variant also writes the state and the conv state after every position (for rollback by selection).

Layout. The wrapper only reshapes (views, no copies): pre [B, T, 3P] -> [B, T, 3, H, K], conv [B, W, 3P] ->
[B, W, 3, H, K], the conv weight [3P, W+1] -> [3, H, K, W+1] (a tap is a strided (K,) load), A_log [H] -> [H, 1];
so on a GPU one step is one kernel launch (at K3 decode shapes the step moves ~13 MB, a few microseconds of HBM
time, so an extra XLA transpose or broadcast launch around it would cost as much as the kernel). Grid ``(B, H)``;
blocks: state (K, V), pre (T, 3, K), conv (W, 3, K), gate and a (T, K); every load/store inside the body is a (K,)
or (K, V) array, so with K = V = 128 it lowers to Triton. One program moves 2 K V 4 bytes of state (128 KiB for
K3) with no reuse: the kernel is bound by memory traffic.

The jnp reference, :func:`kda_fused_step_reference`, is the composition of ``kimi.ops.kda`` functions that
``KimiDeltaAttention`` runs on the XLA path.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kimi import dispatch
from kimi.kernels.common import compiler_params
from kimi.ops import kda as kda_ops

_F32 = jnp.float32
NUM_WARPS = 4
"""Triton warps per (batch row, head) program by default; ``scripts/bench_kernels.py`` sweeps others on a GPU. 4
since the first H200 run (K3 shapes, 96 heads of 128 x 128): an 8-token verify 55-57 us against 8 warps' 120-147;
decode 10-17 us at 4, 8 or 16 warps, within its run-to-run noise (docs/performance.md)."""


def _sigmoid(x):
    return jax.nn.sigmoid(x)


def _softplus(x):  # = jnp.logaddexp(x, 0), written out (stable) for the Triton lowering
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _kda_kernel(pre_ref, cw_ref, conv_ref, a_ref, alog_ref, dtb_ref, b_ref, gate_ref, nw_ref, s_ref,
                y_ref, s_out_ref, conv_out_ref, *all_refs, T, W, lower_bound, scale, eps_l2, eps_rms):
    conv_dt = conv_out_ref.dtype
    # the conv window, oldest first: W rows of (q, k, v) channel vectors of head h, carried through the loop
    window = tuple(conv_ref[j, c, :].astype(_F32) for j in range(W) for c in range(3))
    taps = [[cw_ref[c, :, j].astype(_F32) for j in range(W + 1)] for c in range(3)]  # (K,) each, stride W+1
    A = jnp.exp(alog_ref[...].astype(_F32))  # exp(A_log[h]): (1,) per head or (K,) per channel
    dtb = dtb_ref[...].astype(_F32)
    nw = nw_ref[...].astype(_F32)

    def step(t, carry):
        S, window = carry  # S [K, V]
        new = tuple(pre_ref[t, c, :].astype(_F32) for c in range(3))
        rows = [window[3 * j: 3 * j + 3] for j in range(W)] + [new]  # rows[j][c], j = 0..W (W = newest)
        qkv = []
        for c in range(3):
            acc = rows[0][c] * taps[c][0]
            for j in range(1, W + 1):
                acc = acc + rows[j][c] * taps[c][j]
            qkv.append(acc * _sigmoid(acc))  # silu
        q, k, v = qkv
        q = q * lax.rsqrt(jnp.sum(q * q) + eps_l2) * scale
        k = k * lax.rsqrt(jnp.sum(k * k) + eps_l2)
        x = a_ref[t, :].astype(_F32) + dtb
        if lower_bound is None:
            g = -A * _softplus(x)
        else:
            g = lower_bound * _sigmoid(A * x)
        beta = _sigmoid(b_ref[t].astype(_F32))
        S = S * jnp.exp(g)[:, None]
        err = v - jnp.sum(k[:, None] * S, axis=0)
        S = S + (beta * k)[:, None] * err[None, :]
        o = jnp.sum(q[:, None] * S, axis=0)
        y = o * lax.rsqrt(jnp.mean(o * o) + eps_rms) * nw
        y_ref[t, :] = (y * _sigmoid(gate_ref[t, :].astype(_F32))).astype(y_ref.dtype)
        window = tuple(v_ for row in rows[1:] for v_ in row)
        if all_refs:
            states_ref, convs_ref = all_refs
            states_ref[t] = S
            for j in range(W):
                for c in range(3):
                    convs_ref[t, j, c, :] = window[3 * j + c].astype(conv_dt)
        return S, window

    S, window = lax.fori_loop(0, T, step, (s_ref[...].astype(_F32), window))
    s_out_ref[...] = S
    for j in range(W):
        for c in range(3):
            conv_out_ref[j, c, :] = window[3 * j + c].astype(conv_dt)


def _per_head(v, H, K, name):
    """None / [H] / [H, K] / [H*K] -> fp32 [H, 1] or [H, K] (reshapes only: broadcasting it here would be one
    more GPU kernel launch per step; the kernel broadcasts in registers)."""
    if v is None:
        return jnp.zeros((H, 1), _F32)
    v = jnp.asarray(v, _F32)
    if v.size == H:
        return v.reshape(H, 1)
    if v.size == H * K:
        return v.reshape(H, K)
    raise ValueError(f"{name}: expected {H} or {H * K} elements, got shape {v.shape}")


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps_rms", "eps_l2", "scale", "return_all_states",
                                             "interpret", "num_warps"))
def _kda_call(pre_BTC, w_CK, conv_BWC, a_BTHK, A_log_H, dt_bias_HK, b_BTH, gate_BTHV, norm_w_V, state_BHKV, *,
              lower_bound, eps_rms, eps_l2, scale, return_all_states, interpret, num_warps):
    B, T, H, K = a_BTHK.shape
    V = gate_BTHV.shape[-1]
    C = pre_BTC.shape[-1]
    W = conv_BWC.shape[1]
    if C != 3 * H * K or V != K:
        raise ValueError(f"kda_fused_step: pre has {C} channels, expected 3 * H * K = {3 * H * K} (and V == K)")
    if w_CK.shape != (C, W + 1):
        raise ValueError(f"kda_fused_step: conv weight {w_CK.shape}, expected {(C, W + 1)}")
    if state_BHKV.shape != (B, H, K, V):
        raise ValueError(f"kda_fused_step: state {state_BHKV.shape}, expected {(B, H, K, V)}")
    pre = pre_BTC.reshape(B, T, 3, H, K)
    conv = conv_BWC.reshape(B, W, 3, H, K)
    cw = jnp.asarray(w_CK, _F32).reshape(3, H, K, W + 1)  # channel c = (q|k|v, head, k): a view, no copy
    alog = _per_head(A_log_H, H, K, "A_log")
    dtb = _per_head(dt_bias_HK, H, K, "dt_bias")
    state = state_BHKV.astype(_F32)
    scale = K**-0.5 if scale is None else float(scale)

    in_specs = [
        pl.BlockSpec((None, T, 3, None, K), lambda b, h: (b, 0, 0, h, 0)),  # pre
        pl.BlockSpec((3, None, K, W + 1), lambda b, h: (0, h, 0, 0)),  # conv taps
        pl.BlockSpec((None, W, 3, None, K), lambda b, h: (b, 0, 0, h, 0)),  # conv state
        pl.BlockSpec((None, T, None, K), lambda b, h: (b, 0, h, 0)),  # a
        pl.BlockSpec((None, alog.shape[1]), lambda b, h: (h, 0)),  # A_log
        pl.BlockSpec((None, dtb.shape[1]), lambda b, h: (h, 0)),  # dt_bias
        pl.BlockSpec((None, T, None), lambda b, h: (b, 0, h)),  # beta logits
        pl.BlockSpec((None, T, None, V), lambda b, h: (b, 0, h, 0)),  # output gate
        pl.BlockSpec((V,), lambda b, h: (0,)),  # o_norm weight
        pl.BlockSpec((None, None, K, V), lambda b, h: (b, h, 0, 0)),  # state
    ]
    out_shape = [
        jax.ShapeDtypeStruct((B, T, H, V), _F32),
        jax.ShapeDtypeStruct((B, H, K, V), _F32),
        jax.ShapeDtypeStruct(conv.shape, conv.dtype),
    ]
    out_specs = [
        pl.BlockSpec((None, T, None, V), lambda b, h: (b, 0, h, 0)),
        in_specs[9],
        in_specs[2],
    ]
    if return_all_states:
        out_shape += [jax.ShapeDtypeStruct((B, T, H, K, V), _F32), jax.ShapeDtypeStruct((B, T, W, 3, H, K),
                                                                                         conv.dtype)]
        out_specs += [pl.BlockSpec((None, T, None, K, V), lambda b, h: (b, 0, h, 0, 0)),
                      pl.BlockSpec((None, T, W, 3, None, K), lambda b, h: (b, 0, 0, 0, h, 0))]
    kernel = functools.partial(_kda_kernel, T=T, W=W, lower_bound=lower_bound, scale=scale, eps_l2=eps_l2,
                               eps_rms=eps_rms)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases={9: 1, 2: 2}, interpret=interpret, name="kda_fused_step",
        compiler_params=compiler_params(interpret, num_warps=num_warps, num_stages=1),
    )(pre, cw, conv, a_BTHK, alog, dtb, b_BTH, gate_BTHV, norm_w_V, state)
    y, S, conv_new = outs[:3]
    res = (y, S, conv_new.reshape(B, W, C))
    if return_all_states:
        res += (outs[3], outs[4].reshape(B, T, W, C))
    return res


def kda_fused_step(pre_BTC, w_CK, conv_BWC, a_BTHK, A_log_H, dt_bias_HK, b_BTH, gate_BTHV, norm_w_V, state_BHKV,
                   *, lower_bound: Optional[float], eps_rms: float, eps_l2: float = 1e-6, scale=None,
                   return_all_states: bool = False, interpret: Optional[bool] = None,
                   num_warps: int = NUM_WARPS):
    """Fused KDA decode (T = 1) / verify (T > 1) step; the Pallas kernel described in the module docstring.

    Args: pre_BTC: the q/k/v projections before the conv, [B, T, 3P] (P = H K); w_CK: conv taps [3P, W+1];
    conv_BWC: conv state [B, W, 3P]; a_BTHK: decay-gate input (f_b_proj(f_a_proj(x))); A_log_H [H] (None: 0);
    dt_bias_HK [H, K] or [H K] (None: 0); b_BTH: beta logits (b_proj(x), before the sigmoid); gate_BTHV: output
    gate logits; norm_w_V: o_norm weight; state_BHKV: fp32 recurrent state. ``lower_bound`` None selects the
    softplus gate (Kimi-Linear), a number the K3 sigmoid gate.

    Returns ``(y_BTHV fp32, state_BHKV, conv_BWC)``, plus ``(states_BTHKV, convs_BTWC)`` (the states after every
    position) with ``return_all_states``. The state and the conv state are updated in place when donated.
    """
    return _kda_call(pre_BTC, w_CK, conv_BWC, a_BTHK, A_log_H, dt_bias_HK, b_BTH, gate_BTHV, norm_w_V, state_BHKV,
                     lower_bound=None if lower_bound is None else float(lower_bound), eps_rms=float(eps_rms),
                     eps_l2=float(eps_l2), scale=scale, return_all_states=bool(return_all_states),
                     interpret=dispatch.pallas_interpret(interpret), num_warps=int(num_warps))


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps_rms", "eps_l2", "scale",
                                             "return_all_states"))
def kda_fused_step_reference(pre_BTC, w_CK, conv_BWC, a_BTHK, A_log_H, dt_bias_HK, b_BTH, gate_BTHV, norm_w_V,
                             state_BHKV, *, lower_bound: Optional[float], eps_rms: float, eps_l2: float = 1e-6,
                             scale=None, return_all_states: bool = False):
    """The same step as :func:`kda_fused_step` from the ``kimi.ops.kda`` functions (the XLA path)."""
    B, T, H, K = a_BTHK.shape
    if return_all_states:
        c_BTC, conv_new, convs = kda_ops.causal_conv(pre_BTC, w_CK, conv_BWC, return_all_states=True)
    else:
        c_BTC, conv_new = kda_ops.causal_conv(pre_BTC, w_CK, conv_BWC)
    q, k, v = jnp.split(c_BTC, 3, axis=-1)
    q = kda_ops.l2norm(q.reshape(B, T, H, K), eps_l2)
    k = kda_ops.l2norm(k.reshape(B, T, H, K), eps_l2)
    v = v.reshape(B, T, H, K)
    A = None if A_log_H is None else jnp.asarray(A_log_H)
    if lower_bound is None:
        g = kda_ops.kda_gate_softplus(a_BTHK, A if A is not None else jnp.zeros((H,)), dt_bias_HK)
    else:
        g = kda_ops.kda_gate_lower_bound(a_BTHK, A, dt_bias_HK, lower_bound)
    beta = jax.nn.sigmoid(jnp.asarray(b_BTH, _F32))
    if T == 1 and not return_all_states:
        o, S = kda_ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_BHKV, scale)
        o = o[:, None]
        states = None
    else:
        o, S, states = kda_ops.kda_recurrent(q, k, v, g, beta, state_BHKV, scale, return_all_states=True)
    y = kda_ops.gated_rms_norm(o, gate_BTHV, norm_w_V, eps_rms)
    conv_new = conv_new.astype(conv_BWC.dtype)
    if return_all_states:
        return y, S, conv_new, states, convs.astype(conv_BWC.dtype)
    return y, S, conv_new


def kda_layer_step(attn, x_BTD, state_BHKV, conv_BWC, verify: bool, interpret: Optional[bool] = None):
    """``KimiDeltaAttention`` decode / verify through the fused kernel: the projections run in XLA around it.

    Returns ``(y_BTD, state_BHKV, conv_BWC, states_BTHKV | None, convs_BTWC | None)`` (the fields of KDAOut)."""
    cfg = attn.cfg
    B, T, _ = x_BTD.shape
    H, K, P = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim
    pre_BTC = jnp.concatenate([attn.q_proj(x_BTD), attn.k_proj(x_BTD), attn.v_proj(x_BTD)], axis=-1)
    a_BTHK = attn.f_b_proj(attn.f_a_proj(x_BTD)).reshape(B, T, H, K)
    b_BTH = attn.b_proj(x_BTD)
    gate = attn.g_proj(x_BTD) if cfg.kda_use_full_rank_gate else attn.g_b_proj(attn.g_a_proj(x_BTD))
    outs = kda_fused_step(pre_BTC, attn.conv_weight_CK(), conv_BWC, a_BTHK, attn.A_log[...][:H],
                          attn.dt_bias[...].reshape(H, K), b_BTH, gate.reshape(B, T, H, K), attn.o_norm.weight[...],
                          state_BHKV, lower_bound=cfg.kda_gate_lower_bound, eps_rms=cfg.rms_norm_eps,
                          return_all_states=verify, interpret=interpret)
    y_BTD = attn.o_proj(outs[0].reshape(B, T, P).astype(x_BTD.dtype))
    if verify:
        return y_BTD, outs[1], outs[2], outs[3], outs[4]
    return y_BTD, outs[1], outs[2], None, None


__all__ = ["kda_fused_step", "kda_fused_step_reference", "kda_layer_step"]
