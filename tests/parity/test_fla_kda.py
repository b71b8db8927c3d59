"""kimi.ops.kda against FLA's pure-torch references (fla-core 0.6.0, loaded without triton; see
scripts/fla_ref.py)."""

import os
import sys

import jax
import numpy as np
import pytest
import torch  # noqa: E402  (a missing parity dependency fails the run: tests/conftest.py)

from kimi.ops import kda  # noqa: E402
from tests.kimi.test_kda_ops import _inputs as kda_inputs  # noqa: E402  (same B, H)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
from fla_ref import load_fla_gate, load_fla_naive  # noqa: E402

B, H = 2, 3
TOL = 1e-5
rec = jax.jit(kda.kda_recurrent)
chunked = jax.jit(kda.kda_chunked, static_argnames=("chunk_size",))


def _inputs(seed, T, Kd, Vd, gate="lower"):
    return kda_inputs(seed, T, gate, Kd, Vd)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """FLA's naive kernels are hundreds of tiny ops: one intra-op thread is much faster next to XLA's threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _t(x):
    return torch.from_numpy(np.array(x, dtype=np.float32))


def _maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("gate,scale", [("lower", None), ("softplus", 0.3)])
def test_recurrent_vs_fla_naive_recurrent(gate, scale):
    """K != V, so a transposed state layout would fail; FLA's state is [B, HV, K, V] like ours."""
    fla = load_fla_naive()
    q, k, v, g, beta, S0 = _inputs(0, 19, Kd=16, Vd=8, gate=gate)
    o_ref, S_ref = fla.naive_recurrent_kda(*map(_t, (q, k, v, g, beta)), scale=scale, initial_state=_t(S0),
                                           output_final_state=True)
    o, S = rec(q, k, v, g, beta, S0, scale=scale)
    assert _maxdiff(o, o_ref.numpy()) <= TOL
    assert _maxdiff(S, S_ref.numpy()) <= TOL


@pytest.mark.parametrize("gate", ["lower", "softplus"])
def test_chunked_vs_fla_naive_chunk(gate):
    """Two 64-token chunks (FLA's naive chunk form needs T % 64 == 0) carrying a non-zero initial state."""
    fla = load_fla_naive()
    q, k, v, g, beta, S0 = _inputs(1, 128, Kd=16, Vd=16, gate=gate)
    o_ref, S_ref = fla.naive_chunk_kda(*map(_t, (q, k, v, g, beta)), initial_state=_t(S0), output_final_state=True,
                                       chunk_size=64)
    o_c, S_c = chunked(q, k, v, g, beta, S0, chunk_size=64)
    assert _maxdiff(o_c, o_ref.numpy()) <= TOL
    assert _maxdiff(S_c, S_ref.numpy()) <= TOL
    o_r, S_r = rec(q, k, v, g, beta, S0)
    assert _maxdiff(o_r, o_ref.numpy()) <= TOL
    assert _maxdiff(S_r, S_ref.numpy()) <= TOL


def test_gates_vs_fla():
    gate = load_fla_gate()  # an ImportError here fails: the independent reference must run
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    Kd = 16
    a = jax.random.normal(ks[0], (B, 5, H, Kd))
    A_log = jax.random.normal(ks[1], (H,))
    dt_bias = jax.random.normal(ks[2], (H, Kd))
    # FLA takes dt_bias flat as [H * K]
    ref_sp = gate.naive_kda_gate(_t(a), _t(A_log), _t(dt_bias).reshape(-1))
    ref_lb = gate.naive_kda_lowerbound_gate(_t(a), _t(A_log), _t(dt_bias).reshape(-1), lower_bound=-5.0)
    assert ref_sp.dtype == torch.float32 and ref_lb.dtype == torch.float32
    # |g| reaches ~15 here, where one fp32 ulp is ~1e-6: compare relatively (torch and jax softplus differ by an ulp)
    np.testing.assert_allclose(kda.kda_gate_softplus(a, A_log, dt_bias), ref_sp.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kda.kda_gate_lower_bound(a, A_log, dt_bias, -5.0), ref_lb.numpy(), rtol=1e-6, atol=1e-6)
