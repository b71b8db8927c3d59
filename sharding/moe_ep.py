"""Expert-parallel routed experts under ``jax.shard_map`` (packed MXFP4 or dense experts).

Each device holds E_loc = E / |expert axes| experts (a contiguous block, first expert e0 = index * E_loc) and, with
``expert_hidden`` sharded, the F / |hidden axes| slice of each one's hidden. Per device:

  1. tokens: rows sharded over axes the experts also use are all-gathered (data-parallel attention + expert
     parallel MoE on the same devices), so every device sees every row that may route to its experts;
  2. route: the router ran outside (``LatentMoE.route``); an assignment (t, x) is local when
     e0 <= idx[t, x] < e0 + E_loc;
  3. few assignments (T * top_k < E_loc; decode): gather only the routed local experts' packed weights, dequantise
     them, and contract (non-local assignments get weight 0);
     many (prefill, verify blocks): sort the assignments by local expert (non-local ones last, behind a sentinel),
     dequantise the local experts, grouped matmul with ``jax.lax.ragged_dot`` (group sizes from ``bincount``),
     and combine the rows back onto their tokens with the routing weights in fp32;
  4. reduce: ``psum_scatter`` over the gathered axes (each device gets its own rows back, summed over the expert
     shards) and ``psum`` over the remaining expert / hidden axes.

``moe_ep`` is the function (tested against ``kimi.ops.moe``); ``ExpertParallel`` runs it on a ``RoutedExperts``
module for the sharding plan (``ShardingPlan.routed_experts``, the hook every ``RoutedExperts`` declares), so the
model's own jitted forward runs it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kimi import mxfp4
from kimi.ops.activations import glu


def _axes(a) -> tuple:
    if a is None:
        return ()
    return (a,) if isinstance(a, str) else tuple(a)


def _spec_axis(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _dequant(ws: Mapping[str, jax.Array], name: str, idx, dtype):
    """Expert weight ``name`` for the local experts in ``idx`` (None: all local experts) as ``dtype``."""
    if f"{name}_packed" in ws:
        packed, scale = ws[f"{name}_packed"], ws[f"{name}_scale"]
        if idx is not None:
            packed, scale = packed[idx], scale[idx]
        return mxfp4.dequantize(packed, scale, dtype=dtype)
    w = ws[name]
    return (w if idx is None else w[idx]).astype(dtype)


def _local_experts(z_TD, w_TX, idx_TX, ws, e0, act):
    """Partial output [T, Din] fp32 of this device's experts (and hidden slice) for every row."""
    T, X = idx_TX.shape
    dt = z_TD.dtype
    lead = ws["w1_packed"] if "w1_packed" in ws else ws["w1"]
    E_loc = lead.shape[0]
    local_TX = idx_TX - e0
    mine_TX = (local_TX >= 0) & (local_TX < E_loc)
    w_TX = jnp.where(mine_TX, w_TX.astype(jnp.float32), 0.0)
    if T * X < E_loc:  # decode: read only the routed experts
        li = jnp.clip(local_TX, 0, E_loc - 1)
        g = jnp.einsum("td,txfd->txf", z_TD, _dequant(ws, "w1", li, dt))
        u = jnp.einsum("td,txfd->txf", z_TD, _dequant(ws, "w3", li, dt))
        y_TXD = jnp.einsum("txf,txdf->txd", glu(g, u, *act), _dequant(ws, "w2", li, dt))
        return jnp.einsum("txd,tx->td", y_TXD.astype(jnp.float32), w_TX)
    key_R = jnp.where(mine_TX, local_TX, E_loc).reshape(-1)  # sentinel E_loc sorts after every local expert
    order = jnp.argsort(key_R, stable=True)
    tok_R = order // X
    xs_RD = z_TD[tok_R]
    sizes = jnp.bincount(key_R, length=E_loc + 1)[:E_loc].astype(jnp.int32)
    w1 = jnp.swapaxes(_dequant(ws, "w1", None, dt), 1, 2)  # [E_loc, Din, F]
    w3 = jnp.swapaxes(_dequant(ws, "w3", None, dt), 1, 2)
    w2 = jnp.swapaxes(_dequant(ws, "w2", None, dt), 1, 2)  # [E_loc, F, Din]
    h = glu(jax.lax.ragged_dot(xs_RD, w1, sizes), jax.lax.ragged_dot(xs_RD, w3, sizes), *act)
    y_RD = jax.lax.ragged_dot(h, w2, sizes).astype(jnp.float32)
    valid_R = key_R[order] < E_loc
    # rows past the last group are not local: zero them explicitly (a GPU ragged_dot may leave them unwritten)
    y_RD = jnp.where(valid_R[:, None], y_RD, 0.0) * jnp.where(valid_R, w_TX.reshape(-1)[order], 0.0)[:, None]
    return jnp.zeros((T, y_RD.shape[-1]), jnp.float32).at[tok_R].add(y_RD)


def moe_ep(z_TD, w_TX, idx_TX, weights: Mapping[str, jax.Array], *, mesh, act: str = "situ",
           beta: Optional[float] = 4.0, linear_beta: Optional[float] = 25.0, expert_axes=(), hidden_axes=(),
           token_axes=(), feature_axes=()) -> jax.Array:
    """Routed experts of a (Latent)MoE, expert- and/or hidden-parallel on ``mesh``.

    z_TD [T, Din] expert inputs, w_TX / idx_TX routing weights and expert ids [T, top_k];
    weights: {"w1", "w3", "w2"} dense [E, F, Din] / [E, Din, F], or {"w1_packed", "w1_scale", ...} MXFP4;
    expert_axes: mesh axes the expert dim E is split over; hidden_axes: axes F is split over;
    token_axes: axes the rows T are split over (the arrays' shardings need not match: shard_map reshards);
    feature_axes: axes z's features arrive split over (a column-parallel latent projection): gathered inside.
    Returns y_TD = sum_x w[t, x] expert_{idx[t, x]}(z[t]) in z's dtype."""
    ex, hid, tok, feat = _axes(expert_axes), _axes(hidden_axes), _axes(token_axes), _axes(feature_axes)
    ms = dict(mesh.shape)
    n_ex = math.prod(ms[a] for a in ex)
    lead = weights["w1_packed"] if "w1_packed" in weights else weights["w1"]
    if lead.shape[0] % n_ex:
        raise ValueError(f"moe_ep: {lead.shape[0]} experts do not split over expert axes {ex} ({n_ex} devices)")
    if z_TD.shape[0] % math.prod(ms[a] for a in tok):
        raise ValueError(f"moe_ep: {z_TD.shape[0]} rows do not split over token axes {tok}")
    gather = tuple(a for a in tok if a in ex + hid)
    rest = tuple(a for a in dict.fromkeys(ex + hid) if a not in gather)
    names = sorted(weights)
    row_spec = P(_spec_axis(tok), None)
    z_spec = P(_spec_axis(tok), _spec_axis(feat))

    def w_spec(name):
        if name.startswith("w2"):
            return P(_spec_axis(ex), None, _spec_axis(hid))
        return P(_spec_axis(ex), _spec_axis(hid), None)

    def body(z, w, idx, *ws):
        if feat:
            z = jax.lax.all_gather(z, feat, axis=1, tiled=True)
        if gather:
            z, w, idx = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (z, w, idx))
        e0 = jax.lax.axis_index(ex) * (lead.shape[0] // n_ex) if ex else 0
        out = _local_experts(z, w, idx, dict(zip(names, ws)), e0, (act, beta, linear_beta))
        if gather:
            out = jax.lax.psum_scatter(out, gather, scatter_dimension=0, tiled=True)
        if rest:
            out = jax.lax.psum(out, rest)
        return out.astype(z.dtype)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(z_spec, row_spec, row_spec) + tuple(w_spec(n) for n in names),
                       out_specs=row_spec)
    return fn(z_TD, w_TX, idx_TX, *(weights[n] for n in names))


def expert_weights(experts) -> dict:
    """The arrays of a ``kimi.layers.RoutedExperts`` module by name (packed codes + scales, or dense)."""
    if experts.cfg.expert_format == "mxfp4":
        return {f"{w}_{k}": getattr(experts, f"{w}_{k}")[...] for w in ("w1", "w2", "w3") for k in ("packed", "scale")}
    return {w: getattr(experts, w)[...] for w in ("w1", "w2", "w3")}


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Runs a ``RoutedExperts`` module's experts with ``moe_ep`` on ``mesh`` under ``rules`` (experts over
    ``rules.experts``, hidden over ``rules.expert_hidden``, rows over ``rules.batch`` when they divide)."""

    mesh: jax.sharding.Mesh
    rules: object  # sharding.rules.ShardingRules

    def axes(self, logical: str) -> tuple:
        ms = dict(self.mesh.shape)
        return tuple(a for a in self.rules.mesh_axes(logical) if ms[a] > 1)

    def __call__(self, experts, z_TD, w_TX, idx_TX):
        c = experts.cfg
        ms = dict(self.mesh.shape)
        tok = self.axes("batch")
        if z_TD.shape[0] % math.prod(ms[a] for a in tok):
            tok = ()
        # z from the column-parallel latent down projection arrives split over moe_latent: gather it inside
        # (otherwise GSPMD gathers the 7168 x 3584 projection weight to hand shard_map a replicated z)
        feat = self.axes("moe_latent") if c.routed_expert_hidden_size is not None else ()
        if z_TD.shape[1] % math.prod(ms[a] for a in feat) or set(feat) & set(tok):
            feat = ()
        return moe_ep(z_TD, w_TX, idx_TX, expert_weights(experts), mesh=self.mesh, act=c.hidden_act,
                      beta=c.activation_situ_beta, linear_beta=c.activation_situ_linear_beta,
                      expert_axes=self.axes("experts"), hidden_axes=self.axes("expert_hidden"), token_axes=tok,
                      feature_axes=feat)


def expert_load(num_experts: int, top_k: int, expert_shards: int, tokens: int = 1, trials: int = 4000,
                seed: int = 0) -> dict:
    """Monte Carlo routing load under uniform, independent routing (a model, stated as such): for ``tokens``
    tokens each picking ``top_k`` distinct experts, the distinct experts touched overall and, on the busiest of
    ``expert_shards`` contiguous expert blocks, their mean. Used by the roofline in scripts/simulate.py."""
    rng = np.random.default_rng(seed)
    per = num_experts // expert_shards
    distinct, busiest = 0.0, 0.0
    for _ in range(trials):
        touched = np.zeros(num_experts, bool)
        for _ in range(tokens):
            touched[rng.choice(num_experts, top_k, replace=False)] = True
        distinct += touched.sum()
        busiest += touched.reshape(expert_shards, per).sum(1).max()
    return {"distinct_experts": distinct / trials, "busiest_shard_experts": busiest / trials}
