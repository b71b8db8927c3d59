"""kimi.ops.kda: chunked == recurrent == token steps, the short conv against torch, norms against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi.ops import kda

B, H, K, V = 2, 3, 16, 16
W = 3  # conv window (kernel 4)
C_CONV = 6  # conv channels

# Jitted once per module (which is also the jittability check): on CPU, eager dispatch compiles every small op
# separately and costs more than one compile of the whole function.
rec = jax.jit(kda.kda_recurrent, static_argnames=("return_all_states",))
chunked = jax.jit(kda.kda_chunked, static_argnames=("chunk_size",))
step = jax.jit(kda.kda_step)
block = jax.jit(kda.kda_block)
block_state = jax.jit(kda.kda_block_state)
conv = jax.jit(kda.causal_conv, static_argnames=("return_all_states",))
conv_step = jax.jit(kda.causal_conv_step)
l2norm = jax.jit(kda.l2norm)
gated_rms_norm = jax.jit(kda.gated_rms_norm)
gate_softplus = jax.jit(kda.kda_gate_softplus)
gate_lower_bound = jax.jit(kda.kda_gate_lower_bound, static_argnames=("lower_bound",))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _inputs(seed, T, gate="lower", Kd=K, Vd=V):
    """Random KDA inputs as the layer produces them: l2-normalised q/k, sigmoided beta, fp32 gate, a non-zero state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = kda.l2norm(jax.random.normal(ks[0], (B, T, H, Kd)))
    k = kda.l2norm(jax.random.normal(ks[1], (B, T, H, Kd)))
    v = jax.random.normal(ks[2], (B, T, H, Vd))
    a = jax.random.normal(ks[3], (B, T, H, Kd))
    A_log = 0.5 * jax.random.normal(ks[4], (H,))
    dt_bias = 0.5 * jax.random.normal(ks[5], (H, Kd))
    if gate == "lower":
        g = kda.kda_gate_lower_bound(a, A_log, dt_bias, -5.0)
    else:
        g = kda.kda_gate_softplus(a, A_log, dt_bias)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    S0 = 0.5 * jax.random.normal(ks[7], (B, H, Kd, Vd))
    return q, k, v, g, beta, S0


def _maxdiff(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


# ---------------------------------------------------------------------------------------------------- delta rule


@pytest.mark.parametrize("gate", ["lower", "softplus"])
@pytest.mark.parametrize("T,chunk", [(37, 16), (32, 16)])
def test_chunked_matches_recurrent(gate, T, chunk):
    q, k, v, g, beta, S0 = _inputs(0, T, gate)
    o_r, S_r = rec(q, k, v, g, beta, S0)
    o_c, S_c = chunked(q, k, v, g, beta, S0, chunk_size=chunk)
    assert o_c.shape == (B, T, H, V) and S_c.shape == (B, H, K, V)
    assert o_c.dtype == jnp.float32 and S_c.dtype == jnp.float32
    assert _maxdiff(o_c, o_r) <= 1e-5
    assert _maxdiff(S_c, S_r) <= 1e-5


@pytest.mark.parametrize("gate", ["lower", "softplus"])
@pytest.mark.parametrize("T", [1, 2, 5, 8, 16])
def test_block_matches_recurrent_and_every_prefix_state(gate, T):
    q, k, v, g, beta, S0 = _inputs(1, T, gate)
    o_r, S_r, states = rec(q, k, v, g, beta, S0, return_all_states=True)
    o_b, trace = block(q, k, v, g, beta, S0)
    assert o_b.shape == (B, T, H, V) and o_b.dtype == jnp.float32
    assert _maxdiff(o_b, o_r) <= 1e-5
    for n in range(1, T + 1):
        assert _maxdiff(block_state(trace, np.full((B,), n, np.int32)), states[:, n - 1]) <= 1e-5
    n_B = np.array([1, T], np.int32)  # per row
    np.testing.assert_allclose(block_state(trace, n_B), np.stack([states[0, 0], states[1, T - 1]]), atol=1e-5)


def test_block_strong_decay_no_overflow():
    """g near -5 per token and softplus gates far below: only differences are exponentiated."""
    q, k, v, _, beta, S0 = _inputs(2, 16, "lower")
    for g in (jnp.full((B, 16, H, K), -5.0), jnp.full((B, 16, H, K), -60.0)):
        o_r, _, states = rec(q, k, v, g, beta, S0, return_all_states=True)
        o_b, trace = block(q, k, v, g, beta, S0)
        assert bool(jnp.all(jnp.isfinite(o_b)))
        assert _maxdiff(o_b, o_r) <= 1e-5
        assert _maxdiff(block_state(trace, np.full((B,), 16, np.int32)), states[:, -1]) <= 1e-5


def test_chunked_strong_decay_chunk64_no_overflow():
    """Gates pinned near -5 for a whole 64-token chunk: the in-chunk cumsum reaches about -320."""
    T = 100  # one full chunk of 64 and a padded one
    q, k, v, _, beta, S0 = _inputs(1, T)
    a = 30.0 + jax.random.normal(jax.random.PRNGKey(11), (B, T, H, K))  # sigmoid(...) ~ 1 -> g ~ -5
    g = gate_lower_bound(a, jnp.zeros((H,)), jnp.zeros((H, K)), -5.0)
    # a weaker stretch after the first chunk, so the state is non-trivial at the end
    g = g.at[:, 64:].multiply(0.02)
    assert float(jnp.min(jnp.cumsum(g[:, :64], axis=1))) < -300.0
    o_r, S_r = rec(q, k, v, g, beta, S0)
    o_c, S_c = chunked(q, k, v, g, beta, S0, chunk_size=64)
    assert bool(jnp.all(jnp.isfinite(o_c))) and bool(jnp.all(jnp.isfinite(S_c)))
    assert _maxdiff(o_c, o_r) <= 1e-5
    assert _maxdiff(S_c, S_r) <= 1e-5


def test_chunked_k_ne_v_and_default_state():
    """K != V catches a transposed state; state=None means zeros."""
    q, k, v, g, beta, _ = _inputs(2, 21, Kd=8, Vd=12)
    o_r, S_r = rec(q, k, v, g, beta, jnp.zeros((B, H, 8, 12)))
    o_c, S_c = chunked(q, k, v, g, beta, None, chunk_size=8)
    assert S_c.shape == (B, H, 8, 12)
    assert _maxdiff(o_c, o_r) <= 1e-5 and _maxdiff(S_c, S_r) <= 1e-5


def test_step_matches_recurrent_and_all_states():
    T = 7
    q, k, v, g, beta, S0 = _inputs(3, T)
    scale = 0.3
    o_r, S_r, states = rec(q, k, v, g, beta, S0, scale=scale, return_all_states=True)
    assert states.shape == (B, T, H, K, V)
    S = S0
    for t in range(T):
        o_t, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, scale)
        # bit for bit: the scan's body is the step, so a verify in the scan form (dispatch.kda_verify_form on a
        # CPU) rounds every position as decoding does
        assert _maxdiff(o_t, o_r[:, t]) == 0.0
        assert _maxdiff(S, states[:, t]) == 0.0
    assert _maxdiff(S, S_r) == 0.0
    assert _maxdiff(states[:, -1], S_r) == 0.0
    # states[t] is the final state of the prefix of t + 1 tokens
    for t in (0, 3):
        _, S_prefix = rec(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1],
                                        S0, scale=scale)
        assert _maxdiff(states[:, t], S_prefix) <= 1e-6


def test_recurrent_equation_by_hand():
    """One token from a known state, written out in numpy: S' = a*S; S = S' + b k (v - S'^T k)^T; o = S^T q s."""
    q, k, v, g, beta, S0 = (np.asarray(x) for x in _inputs(4, 1))
    o, S = rec(q, k, v, g, beta, S0)
    Sp = S0 * np.exp(g[:, 0])[..., None]
    err = v[:, 0] - np.einsum("bhk,bhkv->bhv", k[:, 0], Sp)
    S_ref = Sp + beta[:, 0, :, None, None] * k[:, 0, :, :, None] * err[:, :, None, :]
    o_ref = np.einsum("bhk,bhkv->bhv", q[:, 0] * K**-0.5, S_ref)
    assert _maxdiff(S, S_ref) <= 1e-6 and _maxdiff(o[:, 0], o_ref) <= 1e-6


# ---------------------------------------------------------------------------------------------------- short conv


@functools.partial(jax.jit, static_argnums=(0, 1))
def _conv_inputs(seed, T):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (B, T, C_CONV))
    w = jax.random.normal(ks[1], (C_CONV, W + 1))
    state = jax.random.normal(ks[2], (B, W, C_CONV))
    return x, w, state


def test_causal_conv_matches_steps_and_states():
    T = 9
    x, w, state = _conv_inputs(5, T)
    y, new_state, states = conv(x, w, state, return_all_states=True)
    assert y.shape == (B, T, C_CONV) and new_state.shape == (B, W, C_CONV) and states.shape == (B, T, W, C_CONV)
    s = state
    for t in range(T):
        y_t, s = conv_step(x[:, t], w, s)
        assert _maxdiff(y_t, y[:, t]) == 0.0  # the same sum in the same order: a decode rounds as a verify does
        assert _maxdiff(s, states[:, t]) == 0.0
    assert _maxdiff(s, new_state) == 0.0
    xx = np.concatenate([np.asarray(state), np.asarray(x)], axis=1)
    np.testing.assert_array_equal(np.asarray(new_state), xx[:, -W:])


def test_causal_conv_split_and_short_input():
    """Running in two pieces with the carried state == one call; T < W keeps the older state entries."""
    x, w, state = _conv_inputs(6, 8)
    y, s = conv(x, w, state)
    y1, s1 = conv(x[:, :2], w, state)  # T = 2 < W = 3
    np.testing.assert_array_equal(np.asarray(s1[:, 0]), np.asarray(state[:, 2]))
    y2, s2 = conv(x[:, 2:], w, s1)
    assert _maxdiff(jnp.concatenate([y1, y2], axis=1), y) <= 1e-6
    assert _maxdiff(s2, s) == 0.0


def test_causal_conv_matches_torch_conv1d():
    import torch  # a test dependency (requirements/test.txt): missing, this fails
    T = 11
    x, w, _ = _conv_inputs(7, T)
    y, _ = conv(x, w, jnp.zeros((B, W, C_CONV)))
    xt = torch.from_numpy(np.array(x)).transpose(1, 2)  # [B, C, T]
    wt = torch.from_numpy(np.array(w))[:, None, :]  # [C, 1, K], the checkpoint layout
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(xt, wt, padding=W, groups=C_CONV)[..., :T])
    assert _maxdiff(y, ref.transpose(1, 2).numpy()) <= 1e-6
    # the last tap multiplies the current token: a one-hot last tap is silu(identity)
    w_last = jnp.zeros_like(w).at[:, W].set(1.0)
    y_id, _ = conv(x, w_last, None)
    assert _maxdiff(y_id, jax.nn.silu(x)) <= 1e-6


# ---------------------------------------------------------------------------------------------------- norms, gates


def test_l2norm_numpy():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(8), (2, 5, 3, 16)))
    ref = x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    assert _maxdiff(l2norm(x), ref) <= 1e-6
    assert _maxdiff(l2norm(np.zeros((4,), np.float32)), np.zeros(4)) == 0.0  # eps keeps zeros finite


def test_gated_rms_norm_numpy():
    ks = jax.random.split(jax.random.PRNGKey(9), 3)
    o = np.asarray(jax.random.normal(ks[0], (2, 5, 3, 16)))
    gate = np.asarray(jax.random.normal(ks[1], (2, 5, 3, 16)))
    weight = np.asarray(1.0 + 0.1 * jax.random.normal(ks[2], (16,)))
    ref = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * weight * (1.0 / (1.0 + np.exp(-gate)))
    y = gated_rms_norm(jnp.asarray(o, jnp.bfloat16), gate, weight)
    assert y.dtype == jnp.float32
    assert _maxdiff(gated_rms_norm(o, gate, weight), ref) <= 1e-5


def test_gates_numpy():
    ks = jax.random.split(jax.random.PRNGKey(10), 3)
    a = np.asarray(jax.random.normal(ks[0], (2, 4, H, K)))
    A_log = np.asarray(jax.random.normal(ks[1], (H,)))
    dt = np.asarray(jax.random.normal(ks[2], (H, K)))
    x = a + dt
    ref_sp = -np.exp(A_log)[:, None] * np.log1p(np.exp(x))
    ref_lb = -5.0 / (1.0 + np.exp(-np.exp(A_log)[:, None] * x))
    assert _maxdiff(gate_softplus(a, A_log, dt), ref_sp) <= 1e-5
    assert _maxdiff(gate_lower_bound(a, A_log, dt, -5.0), ref_lb) <= 1e-5
    lb = gate_lower_bound(a, A_log, dt.reshape(-1), -5.0)  # FLA's flat [H*K] dt_bias is accepted too
    assert bool(jnp.all((lb < 0) & (lb > -5.0)))
    assert _maxdiff(gate_softplus(a[0, 0], A_log.reshape(1, 1, H, 1), dt), ref_sp[0, 0]) <= 1e-5


# ---------------------------------------------------------------------------------------------------- jit


def test_jit_matches_eager():
    """The tests above run everything under jax.jit (chunk_size static); jit == eager for the chunked form."""
    q, k, v, g, beta, S0 = _inputs(12, 6)
    o_j, S_j = chunked(q, k, v, g, beta, S0, chunk_size=4)
    o_e, S_e = kda.kda_chunked(q, k, v, g, beta, S0, chunk_size=4)
    assert _maxdiff(o_j, o_e) <= 1e-6 and _maxdiff(S_j, S_e) <= 1e-6


def test_unit_lower_inverse_and_its_gradient():
    from kimi.ops.kda import unit_lower_inverse

    C = 6
    L = jnp.tril(jax.random.normal(jax.random.key(0), (3, C, C)) * 0.3, -1) + jnp.eye(C)
    inv = unit_lower_inverse(L)
    np.testing.assert_allclose(jnp.matmul(inv, L), np.broadcast_to(np.eye(C), (3, C, C)), atol=1e-5)
    w = jax.random.normal(jax.random.key(1), (3, C, C))
    f_ref = lambda a: (jnp.linalg.inv(jnp.tril(a, -1) + jnp.eye(C)) * w).sum()  # noqa: E731
    f = lambda a: (unit_lower_inverse(jnp.tril(a, -1) + jnp.eye(C)) * w).sum()  # noqa: E731
    np.testing.assert_allclose(jax.grad(f)(L), jax.grad(f_ref)(L), atol=1e-4)

