"""scripts/train_target.py on the tiny preset: exact resume, gradients, the training fast paths, MXFP4 export."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi import mxfp4
from kimi.ops import moe as moe_ops

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("train_target", os.path.join(_ROOT, "scripts", "train_target.py"))
tt = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("train_target", tt)
_spec.loader.exec_module(tt)

ARGS = ["--preset", "tiny", "--batch", "2", "--seq-len", "32", "--lr", "3e-3", "--val-batches", "1",
        "--val-every", "0", "--log-every", "100", "--seed", "1"]


def _run(out, *extra):
    return tt.main(ARGS + ["--out", str(out), *extra])


def test_resume_continues_exactly(tmp_path):
    N, k = 5, 2
    full = _run(tmp_path / "a", "--steps", str(N), "--ckpt-every", "0")
    first = _run(tmp_path / "b", "--steps", str(N), "--stop-at", str(k))
    assert first["steps"] == k and len(first["losses"]) == k
    second = _run(tmp_path / "b", "--steps", str(N), "--resume")
    assert second["start_step"] == k and second["steps"] == N
    losses = first["losses"] + second["losses"]
    assert len(losses) == N
    np.testing.assert_allclose(losses, full["losses"], rtol=0, atol=1e-6)
    assert full["losses"][-1] < full["losses"][0]  # it learns
    for a, b in zip(jax.tree.leaves(full["_params"]), jax.tree.leaves(second["_params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert second["tokens_seen"] == N * 2 * 32
    # a resumed run with a different data stream is refused
    with pytest.raises(ValueError, match="batch"):
        tt.main(ARGS[:2] + ["--batch", "3"] + ARGS[4:] + ["--out", str(tmp_path / "b"), "--steps", "6", "--resume"])


def _tiny_batch(seed=0, B=2, T=33):
    tok = np.random.default_rng(seed).integers(0, 256, (B, T)).astype(np.int32)
    tok[:, 0] = 256
    doc = np.zeros_like(tok)
    tok[1, 10], doc[1, 11:] = 257, 1  # a document boundary in row 1
    tok[1, 11] = 256
    return jnp.asarray(tok), jnp.asarray(doc)


@pytest.fixture(scope="module")
def tiny_loss_and_grads():
    """The tiny preset's loss_fn on _tiny_batch: ((loss, (n_scored, n_correct)), grads), one jitted program (op by
    op eager autodiff of the whole model took ~90 s on CPU)."""
    cfg = tt.model_config("tiny")
    graphdef, params, frozen = tt.split_model(tt.build_model(cfg))
    tok, doc = _tiny_batch()
    out = jax.jit(jax.value_and_grad(lambda p: tt.loss_fn(p, frozen, tok, doc, graphdef=graphdef), has_aux=True))(
        params)
    return cfg, params, frozen, out


def test_gradients_reach_experts_and_router_bias_is_frozen(tiny_loss_and_grads):
    cfg, params, frozen, (_, g) = tiny_loss_and_grads
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    frozen_names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(frozen)[0]]
    assert not any("e_score_correction_bias" in n for n in names)
    assert frozen_names and all("e_score_correction_bias" in n for n in frozen_names)
    flat = dict(zip(names, jax.tree.leaves(g)))
    experts = [n for n in flat if "experts']['w" in n]
    gates = [n for n in flat if "gate']['weight" in n]
    moe_layers = sum(k == "moe" for k in cfg.ffn_kinds)
    assert moe_layers > 0 and len(gates) == moe_layers, gates  # the filters match what they are meant to
    assert len(experts) >= 2 * moe_layers, experts
    for n in experts + gates:
        assert float(jnp.abs(flat[n]).max()) > 0, n


def test_loss_skips_document_boundaries(tiny_loss_and_grads):
    (_, (n, _)), _ = tiny_loss_and_grads[3]
    assert int(n) == 2 * 32 - 1  # the EOS -> BOS transition is not scored


@pytest.mark.parametrize("T,E,block", [(37, 8, 4), (5, 16, 8), (200, 16, 64)])
def test_experts_blocked_matches_grouped(T, E, block):
    D, F, X = 24, 16, 2
    k = jax.random.split(jax.random.key(T), 5)
    x = jax.random.normal(k[0], (T, D))
    w1, w3 = (jax.random.normal(kk, (E, F, D)) * 0.2 for kk in k[1:3])
    w2 = jax.random.normal(k[3], (E, D, F)) * 0.2
    w, idx = moe_ops.route(jax.random.normal(k[4], (T, E)) * 3, jnp.zeros(E), X)
    act = ("situ", 4.0, 25.0)

    def f(fn, **kw):
        return lambda *a: (fn(a[0], w, idx, *a[1:], *act, **kw) ** 2).sum()

    # jitted (as in training): op-by-op eager dispatch cost more than compiling each program once
    blocked = jax.jit(lambda *a: moe_ops.experts_blocked(*a, *act, block=block))
    grouped = jax.jit(lambda *a: moe_ops.experts_grouped(*a, *act))
    np.testing.assert_allclose(blocked(x, w, idx, w1, w3, w2), grouped(x, w, idx, w1, w3, w2), rtol=1e-5, atol=1e-5)
    ga = jax.jit(jax.grad(f(moe_ops.experts_grouped), argnums=(0, 1, 2, 3)))(x, w1, w3, w2)
    gb = jax.jit(jax.grad(f(moe_ops.experts_blocked, block=block), argnums=(0, 1, 2, 3)))(x, w1, w3, w2)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_to_mxfp4_and_export(tmp_path):
    cfg = tt.model_config("tiny", routed_expert_hidden_size=64)  # MXFP4 needs widths that are multiples of 32
    model = tt.build_model(cfg)
    q = tt.to_mxfp4(model)
    assert q.config.expert_format == "mxfp4" and model.config.expert_format == "dense"
    if hasattr(cfg, "kda_prefill"):  # the training-only choice is not exported
        assert q.config.kda_prefill == type(cfg)().kda_prefill
    for i, layer in enumerate(model.model.layers):
        if cfg.ffn_kinds[i] != "moe":
            continue
        src, dst = layer.block_sparse_moe.experts, q.model.layers[i].block_sparse_moe.experts
        for name in ("w1", "w2", "w3"):
            packed, scale = mxfp4.quantize(np.asarray(getattr(src, name)[...], np.float32))
            np.testing.assert_array_equal(np.asarray(getattr(dst, f"{name}_packed")[...]), packed)
            np.testing.assert_array_equal(np.asarray(getattr(dst, f"{name}_scale")[...]), scale)
    np.testing.assert_array_equal(np.asarray(q.model.embed_tokens.embedding[...]),
                                  np.asarray(model.model.embed_tokens.embedding[...]))
    try:
        import kimi.checkpoint  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="save_checkpoint"):
            tt.export_mxfp4(model, tmp_path / "exp")
        return
    import kimi

    tt.export_mxfp4(model, tmp_path / "exp")
    back = kimi.load_checkpoint(str(tmp_path / "exp"))
    assert back.config.expert_format == "mxfp4"
    tok = np.random.default_rng(0).integers(0, 256, (1, 12)).astype(np.int32)
    a = q.prefill(tok, q.init_cache(1, 16)).logits
    b = back.prefill(tok, back.init_cache(1, 16)).logits
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
