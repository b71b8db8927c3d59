"""Mixture-of-experts math: the sigmoid + bias router and the ways to run the routed experts.

Router (DeepSeek-V3 ``noaux_tc``, as K3 and Kimi-Linear use it), all fp32:
  s = sigmoid(x W_gate^T);  selection by s + b  (b = e_score_correction_bias);
  group routing: each of n_group groups is scored by the sum of its top-2 of (s + b); the best topk_group groups
  are kept, the rest masked to -inf;  idx = top_k(s + b)  (ties: the lower expert index wins);
  w = s[idx] (without the bias), renormalised w / (sum w + 1e-20) when top_k > 1, times routed_scaling_factor.

Experts (torch layout, [out, in]): e_k(z) = W2_k act(W1_k z, W3_k z).
  gathered: for a few tokens, gather only the routed experts' weights ([T, X, F, D]) and contract; the path for
            decode and verify, which touches nothing but the top-k experts.
  grouped:  sort the T*X assignments by expert and run a grouped matmul (ragged_dot) over the sorted rows; the
            path for prefill and training.
  all:      every row through every expert, combined with the routing weights; for a few rows that touch most
            experts anyway (a verify block on a small model). Two matmuls on a fused layout of the weights
            (fuse_experts_for_all), which serving builds once per generation.
  used:     only the experts some row picked, each on every row, the others skipped at run time (experts_used);
            serving's verify takes it over 'all' when the rows pick few experts (experts_all_or_used), as a block
            of similar tokens does, and its bf16 decode takes it too.
  blocked:  sorted by expert, each expert's rows padded to a multiple of a block, one batched matmul per block
            (dropless; about T*X + E*block rows of work): many rows on a backend whose ragged_dot is dense (CPU);
            on the serving copy over its bf16 per-expert layout (experts_blocked_fused).
kimi.dispatch.moe_path picks one from static shapes (and whether a serving copy exists).
"""

import jax
import jax.numpy as jnp

from kimi import dispatch
from kimi.ops.activations import glu
from kimi.ops.linear import matmul


def route(logits_TE, bias_E, top_k: int, n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
          scaling: float = 1.0):
    """Returns (weights_TX fp32, idx_TX int32)."""
    s_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    sel_TE = s_TE + bias_E.astype(jnp.float32)
    if n_group > 1:
        T, E = sel_TE.shape
        grouped = sel_TE.reshape(T, n_group, E // n_group)
        group_score_TG = jax.lax.top_k(grouped, min(2, E // n_group))[0].sum(-1)
        _, keep_TK = jax.lax.top_k(group_score_TG, topk_group)
        keep_TG = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], keep_TK].set(True)
        sel_TE = jnp.where(jnp.repeat(keep_TG, E // n_group, axis=1), sel_TE, -jnp.inf)
    _, idx_TX = jax.lax.top_k(sel_TE, top_k)
    w_TX = jnp.take_along_axis(s_TE, idx_TX, axis=1)
    if renormalize and top_k > 1:
        w_TX = w_TX / (w_TX.sum(-1, keepdims=True) + 1e-20)
    return w_TX * scaling, idx_TX.astype(jnp.int32)


def experts_gathered(x_TD, w_TX, w1_TXFD, w3_TXFD, w2_TXDF, act: str, beta=None, linear_beta=None):
    """y[t] = sum_x w[t,x] W2[t,x] act(W1[t,x] x[t], W3[t,x] x[t]) with the routed weights already gathered."""
    dt = x_TD.dtype
    g_TXF = jnp.einsum("td,txfd->txf", x_TD, w1_TXFD.astype(dt))
    u_TXF = jnp.einsum("td,txfd->txf", x_TD, w3_TXFD.astype(dt))
    h_TXF = glu(g_TXF, u_TXF, act, beta, linear_beta)
    y_TXD = jnp.einsum("txf,txdf->txd", h_TXF, w2_TXDF.astype(dt))
    return jnp.einsum("txd,tx->td", y_TXD.astype(jnp.float32), w_TX).astype(dt)


def experts_grouped(x_TD, w_TX, idx_TX, w1_EFD, w3_EFD, w2_EDF, act: str, beta=None, linear_beta=None):
    """Sort-by-expert grouped matmul: each assignment row meets only its expert's weights."""
    T, X = idx_TX.shape
    E = w1_EFD.shape[0]
    dt = x_TD.dtype
    flat_idx = idx_TX.reshape(-1)
    order = jnp.argsort(flat_idx, stable=True)
    tok = order // X
    xs_RD = x_TD[tok]
    sizes_E = jnp.bincount(flat_idx, length=E).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs_RD, jnp.swapaxes(w1_EFD, 1, 2).astype(dt), sizes_E)
    u = jax.lax.ragged_dot(xs_RD, jnp.swapaxes(w3_EFD, 1, 2).astype(dt), sizes_E)
    h = glu(g, u, act, beta, linear_beta)
    y_RD = jax.lax.ragged_dot(h, jnp.swapaxes(w2_EDF, 1, 2).astype(dt), sizes_E)
    w_R = w_TX.reshape(-1)[order]
    out = jnp.zeros((T, y_RD.shape[-1]), jnp.float32).at[tok].add(y_RD.astype(jnp.float32) * w_R[:, None])
    return out.astype(dt)


def _block_plan(w_TX, idx_TX, num_experts: int, block: int):
    """The assignments of ``experts_blocked*``: the T*X (row, slot) pairs sorted by expert, each expert's group
    padded to a multiple of ``block``. Returns (src_P: the source row of each padded row, T for padding (an all-zero
    row); wt_P: its routing weight, fp32, 0 for padding; be_N: each block's expert), P = nb * block with the static
    bound nb = ceil(T*X / block) + E (sum_e ceil(n_e / block) <= R / block + E)."""
    T, X = idx_TX.shape
    E, R = num_experts, T * X
    nb = -(-R // block) + E
    flat = idx_TX.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    e_sorted = flat[order]
    sizes_E = jnp.bincount(flat, length=E).astype(jnp.int32)
    padded_E = (sizes_E + block - 1) // block * block
    pend_E = jnp.cumsum(padded_E)
    pstart_E = pend_E - padded_E
    start_E = jnp.cumsum(sizes_E) - sizes_E
    dest_R = pstart_E[e_sorted] + jnp.arange(R, dtype=jnp.int32) - start_E[e_sorted]
    P = nb * block
    src_P = jnp.full((P,), T, jnp.int32).at[dest_R].set((order // X).astype(jnp.int32))
    wt_P = jnp.zeros((P,), jnp.float32).at[dest_R].set(w_TX.reshape(-1)[order].astype(jnp.float32))
    be_N = jnp.minimum(jnp.searchsorted(pend_E, jnp.arange(nb, dtype=jnp.int32) * block, side="right"), E - 1)
    return src_P, wt_P, be_N


def _blocks(x_TD, src_P, block: int, dtype):
    """x's rows in block order [nb, block, D] (padding rows zero), in ``dtype``."""
    x_pad = jnp.concatenate([x_TD.astype(dtype), jnp.zeros((1, x_TD.shape[1]), dtype)], axis=0)
    return x_pad[src_P].reshape(-1, block, x_TD.shape[1])


def _combine(y_PD, src_P, T: int, dtype, wt_P=None):
    """out[t] = sum of (wt_P) y_PD over the padded rows of source row t (fp32 sums; padding adds to row T, dropped)."""
    y_PD = y_PD.astype(jnp.float32) * (1.0 if wt_P is None else wt_P[:, None])
    return jnp.zeros((T + 1, y_PD.shape[-1]), jnp.float32).at[src_P].add(y_PD)[:T].astype(dtype)


def experts_blocked(x_TD, w_TX, idx_TX, w1_EFD, w3_EFD, w2_EDF, act: str, beta=None, linear_beta=None,
                    block: int = dispatch.MOE_BLOCK_ROWS):
    """Exact, dropless routed experts for many rows: the T*X assignments sorted by expert, each expert's group
    padded to a multiple of ``block`` rows, and one batched matmul per block against its expert's weights
    (gathered per block). Same result as experts_grouped (up to fp32 rounding); on XLA:CPU it
    costs about (T*X + E*block) rows of work instead of ragged_dot's T*X*E."""
    T = x_TD.shape[0]
    dt = x_TD.dtype
    src_P, wt_P, be_N = _block_plan(w_TX, idx_TX, w1_EFD.shape[0], block)
    xs_NBD = _blocks(x_TD, src_P, block, dt)
    g = jnp.einsum("nbd,nfd->nbf", xs_NBD, w1_EFD[be_N].astype(dt))
    u = jnp.einsum("nbd,nfd->nbf", xs_NBD, w3_EFD[be_N].astype(dt))
    h = glu(g, u, act, beta, linear_beta)
    y_PD = jnp.einsum("nbf,ndf->nbd", h, w2_EDF[be_N].astype(dt)).reshape(src_P.shape[0], -1)
    return _combine(y_PD, src_P, T, dt, wt_P)


def experts_blocked_fused(x_TD, w_TX, idx_TX, w13_ED2F, w2_EFD, act: str, beta=None, linear_beta=None,
                          block: int = dispatch.MOE_BLOCK_ROWS):
    """:func:`experts_blocked` on the serving copy's per-expert layout (:func:`fuse_experts_per_expert`: ``w13``
    [E, D, 2F], ``w2`` [E, F, D], stacked or as sequences of E arrays, stacked here: XLA fuses the stack into the
    per-block gather), rounded where :func:`experts_used` and :func:`experts_all_fused` round (x and c * h in
    the weights' dtype, fp32 sums, as ``kimi.ops.linear.matmul`` serves bf16 weights):

        [g | u] = x_b [W1_e^T | W3_e^T];    y_b = (c_b act(g, u)) W2_e^T;    y[t] = sum of y_b over t's rows

    Many rows on the serving copy multiply its bf16 experts as they are, where :func:`experts_blocked` multiplied
    its dense fp32 experts in fp32 and contracted their last axis (docs/performance.md: ~2x faster at 512 rows)."""
    T, dt = x_TD.shape[0], x_TD.dtype
    w13, w2 = jnp.stack(w13_ED2F), jnp.stack(w2_EFD)
    F, wdt = w2.shape[1], w13.dtype
    src_P, wt_P, be_N = _block_plan(w_TX, idx_TX, w13.shape[0], block)
    xs_NBD = _blocks(x_TD, src_P, block, wdt)
    gu = jnp.einsum("nbd,nde->nbe", xs_NBD, w13[be_N], preferred_element_type=jnp.float32)
    h = glu(gu[..., :F], gu[..., F:], act, beta, linear_beta) * wt_P.reshape(gu.shape[0], block, 1)
    y = jnp.einsum("nbf,nfd->nbd", h.astype(wdt), w2[be_N], preferred_element_type=jnp.float32)
    return _combine(y.reshape(src_P.shape[0], -1), src_P, T, dt)


def experts_picked_E(idx_TX, num_experts: int):
    """[E] bool: whether any row routes to expert e."""
    return jnp.zeros((num_experts,), jnp.bool_).at[idx_TX.reshape(-1)].set(True)


def routing_weights_TE(w_TX, idx_TX, num_experts: int):
    """c [T, E]: row t's routing weight for expert e (the sum over its slots that picked e; 0 when unrouted)."""
    T = idx_TX.shape[0]
    return jnp.zeros((T, num_experts), jnp.float32).at[jnp.arange(T)[:, None], idx_TX].add(w_TX.astype(jnp.float32))


def fuse_experts_for_all(w1_EFD, w3_EFD, w2_EDF):
    """The dense experts laid out for :func:`experts_all_fused`: ``w13 [D, 2*E*F]`` (every expert's W1^T, then
    every expert's W3^T, expert-major columns) and ``w2 [E*F, D]`` (the W2^T stacked). A copy of every expert
    weight: serving makes it once per generation (``kimi.model.with_serving_layout``), not once per step."""
    E, F, D = w1_EFD.shape
    cols = lambda w: jnp.transpose(w, (2, 0, 1)).reshape(D, E * F)  # [E, F, D] -> [D, E*F]
    return jnp.concatenate([cols(w1_EFD), cols(w3_EFD)], axis=1), jnp.swapaxes(w2_EDF, 1, 2).reshape(E * F, D)


def experts_all_fused(x_TD, w_TX, idx_TX, w13_D2EF, w2_EFD, num_experts: int, act: str, beta=None,
                      linear_beta=None):
    """Every row through every expert in two matmuls, the routing weights folded in between:

        [g | u] = x [W1^T | W3^T]   ([T, 2EF]);    h[t, e, :] = c[t, e] act(g, u)[t, e, :];
        y = h W2^T   ([T, EF] @ [EF, D])

    with c[t, e] the routing weight of expert e for row t (0 when unrouted). Reads each expert once, no sort; the
    fastest form on CPU for a few rows that touch most experts (a verify block on a small model), because the
    weights are right operands already in the layout a matmul wants: nothing is transposed per call."""
    T, E = x_TD.shape[0], num_experts
    EF = w2_EFD.shape[0]
    gu_T2EF = matmul(x_TD, w13_D2EF)
    h_TEF = glu(gu_T2EF[:, :EF], gu_T2EF[:, EF:], act, beta, linear_beta).reshape(T, E, EF // E)
    c_TE = routing_weights_TE(w_TX, idx_TX, E)
    h_TEF = (h_TEF.astype(jnp.float32) * c_TE[:, :, None]).astype(x_TD.dtype)
    return matmul(h_TEF.reshape(T, EF), w2_EFD)


def fuse_experts_per_expert(w1_EFD, w3_EFD, w2_EDF):
    """The dense experts laid out for :func:`experts_used`: ``w13 [E, D, 2F]`` (expert e's [W1_e^T | W3_e^T]) and
    ``w2 [E, F, D]`` (W2_e^T): each expert's weights one contiguous block, right operands of a row-major matmul."""
    return (jnp.concatenate([jnp.swapaxes(w1_EFD, 1, 2), jnp.swapaxes(w3_EFD, 1, 2)], axis=2),
            jnp.swapaxes(w2_EDF, 1, 2))


def experts_used(x_TD, w_TX, idx_TX, w13_ED2F, w2_EFD, act: str, beta=None, linear_beta=None):
    """Only the experts some row routes to, one after another in ascending order, each on every row:

        y = sum over e in U of  (c[:, e] * act(x W1_e^T, x W3_e^T)) W2_e^T,    U = {idx[t, j]} (the distinct experts)

    the experts outside U skipped at run time (a ``lax.cond`` per expert up to
    ``dispatch.USED_UNROLL_MAX_EXPERTS``, else a ``fori_loop`` whose trip count |U| is read from the routing), so
    their weights are never read. The same sum as :func:`experts_all_fused` (rows not routed to e get c = 0), expert
    by expert. For a few rows whose routing
    concentrates (a verify block on a model whose router sends a block's tokens to a few experts), its cost is |U|
    experts' weights instead of E.

    ``w13_ED2F`` / ``w2_EFD``: stacked ([E, D, 2F] / [E, F, D], :func:`fuse_experts_per_expert`), or sequences of E
    per-expert arrays, as the serving copy keeps them: XLA:CPU materialises a static slice of a stacked array (a
    copy, through fp32 for bf16) for every expert's cond, picked or not, which costs more than the experts skipped."""
    T, E = x_TD.shape[0], len(w13_ED2F)
    F = w2_EFD[0].shape[0]
    dt = x_TD.dtype
    c_TE = routing_weights_TE(w_TX, idx_TX, E)
    used_E = experts_picked_E(idx_TX, E)

    def add_expert(y_TD, w13_D2F, w2_FD, c_T):
        gu_T2F = matmul(x_TD, w13_D2F)
        h_TF = (glu(gu_T2F[:, :F], gu_T2F[:, F:], act, beta, linear_beta).astype(jnp.float32)
                * c_T[:, None]).astype(dt)
        return y_TD + matmul(h_TF, w2_FD).astype(jnp.float32)

    y_TD = jnp.zeros((T, w2_EFD[0].shape[-1]), jnp.float32)
    if E <= dispatch.USED_UNROLL_MAX_EXPERTS:
        for e in range(E):
            y_TD = jax.lax.cond(used_E[e], add_expert, lambda y, *_: y, y_TD, w13_ED2F[e], w2_EFD[e], c_TE[:, e])
    else:
        w13_ED2F, w2_EFD = jnp.asarray(w13_ED2F), jnp.asarray(w2_EFD)
        order_E = jnp.argsort(~used_E, stable=True)  # the used experts first, ascending
        y_TD = jax.lax.fori_loop(0, used_E.sum(), lambda i, y: add_expert(y, w13_ED2F[order_E[i]],
                                                                          w2_EFD[order_E[i]], c_TE[:, order_E[i]]),
                                 y_TD)
    return y_TD.astype(dt)


def experts_all_or_used(x_TD, w_TX, idx_TX, w13_D2EF, w2_EFD, w13_ED2F, w2_per_EFD, act: str, beta=None,
                        linear_beta=None):
    """The verify path of a small model: :func:`experts_used` when the rows pick at most
    ``dispatch.USED_LOOP_MAX_FRACTION`` of the experts, else :func:`experts_all_fused` (a branch taken at run time
    on the routing). The same weights in the two layouts: ``w13 [D, 2EF]`` and ``w2 [EF, D]`` for the fused pair,
    ``w13_ED2F`` and ``w2_per_EFD`` per expert (stacked or sequences, as :func:`experts_used` takes them)."""
    E = len(w13_ED2F)
    n_used = experts_picked_E(idx_TX, E).sum()
    return jax.lax.cond(
        n_used <= int(E * dispatch.USED_LOOP_MAX_FRACTION),
        lambda: experts_used(x_TD, w_TX, idx_TX, w13_ED2F, w2_per_EFD, act, beta, linear_beta),
        lambda: experts_all_fused(x_TD, w_TX, idx_TX, w13_D2EF, w2_EFD, E, act, beta, linear_beta))


def experts_all(x_TD, w_TX, idx_TX, w1_EFD, w3_EFD, w2_EDF, act: str, beta=None, linear_beta=None):
    """:func:`experts_all_fused` on the checkpoint layout (rearranged on every call): the reference the other
    paths are tested against."""
    return experts_all_fused(x_TD, w_TX, idx_TX, *fuse_experts_for_all(w1_EFD, w3_EFD, w2_EDF), w1_EFD.shape[0],
                             act, beta, linear_beta)
