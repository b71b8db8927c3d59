"""Expert-parallel MoE under jax.shard_map on 16 devices == kimi.ops.moe on one (packed MXFP4 and dense experts)."""
import jax
import numpy as np
import pytest

import sharding
from kimi import mxfp4
from kimi.ops import moe as moe_ops

ACT = ("situ", 4.0, 25.0)


def _problem(E, F, Din, T, X, seed=0, packed=True):
    """Host-side data (NumPy: no per-op compiles): inputs, top-k routing, expert weights (packed + dequantised)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((T, Din), np.float32)
    idx = np.argsort(-rng.standard_normal((T, E)), axis=1)[:, :X].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, X)).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    dense = {"w1": rng.standard_normal((E, F, Din), np.float32) * 0.1,
             "w3": rng.standard_normal((E, F, Din), np.float32) * 0.1,
             "w2": rng.standard_normal((E, Din, F), np.float32) * 0.1}
    if not packed:
        return z, w, idx, dense, dense
    weights, deq = {}, {}
    for name, arr in dense.items():
        p, s = mxfp4.quantize(arr)
        weights[f"{name}_packed"], weights[f"{name}_scale"] = p, s
        deq[name] = mxfp4.dequantize(p, s)
    return z, w, idx, weights, deq


_experts_all = jax.jit(moe_ops.experts_all, static_argnums=(6, 7, 8))


def _reference(z, w, idx, deq):
    return _experts_all(z, w, idx, deq["w1"], deq["w3"], deq["w2"], *ACT)


CASES = {
    # name: (mesh, E, F, Din, T, top_k, expert_axes, hidden_axes, token_axes, feature_axes)
    "ep16_grouped": ("dp16-ep16", 32, 64, 32, 6, 2, "data", (), (), ()),  # 12 assignments >= 2 local experts
    "ep16_gathered": ("dp16-ep16", 64, 64, 32, 1, 2, "data", (), (), ()),  # 2 assignments < 4 local experts
    "dp16_ep16_rows_sharded": ("dp16-ep16", 16, 64, 32, 32, 2, "data", (), "data", ()),
    "tp16_hidden_gathered": ("tp16", 16, 512, 64, 1, 2, (), "tensor", (), "tensor"),
    "tp16_hidden_grouped": ("tp16", 16, 512, 64, 8, 4, (), "tensor", (), "tensor"),
    "dp2_tp8_2d": ({"data": 2, "tensor": 8}, 8, 256, 32, 8, 2, "data", "tensor", "data", ()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_ep_matches_reference(case):
    mesh_spec, E, F, Din, T, X, ex, hid, tok, feat = CASES[case]
    mesh = sharding.make_mesh(mesh_spec)
    z, w, idx, weights, deq = _problem(E, F, Din, T, X, seed=len(case))
    fn = jax.jit(lambda z, w, i, ws: sharding.moe_ep(z, w, i, ws, mesh=mesh, act=ACT[0], beta=ACT[1],
                                                     linear_beta=ACT[2], expert_axes=ex, hidden_axes=hid,
                                                     token_axes=tok, feature_axes=feat))
    got = fn(z, w, idx, weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(z, w, idx, deq)), rtol=1e-5, atol=1e-5)


def test_moe_ep_dense_experts_and_skewed_routing():
    """Dense (unpacked) experts, and every token routed to experts that live on one device."""
    mesh = sharding.make_mesh("dp16-ep16")
    z, _, _, weights, deq = _problem(32, 32, 16, 5, 2, seed=3, packed=False)
    idx = np.tile(np.array([[4, 5]], np.int32), (5, 1))  # experts 4 and 5: both on device 2
    w = np.full((5, 2), 0.5, np.float32)
    got = jax.jit(lambda z, w, i, ws: sharding.moe_ep(z, w, i, ws, mesh=mesh, expert_axes="data"))(z, w, idx, weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(z, w, idx, deq)), rtol=1e-5, atol=1e-5)


def test_moe_ep_rejects_indivisible_experts():
    mesh = sharding.make_mesh("dp16-ep16")
    z, w, idx, weights, _ = _problem(8, 32, 16, 2, 2, packed=False)
    with pytest.raises(ValueError, match="do not split"):
        sharding.moe_ep(z, w, idx, weights, mesh=mesh, expert_axes="data")
