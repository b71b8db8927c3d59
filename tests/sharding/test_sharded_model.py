"""prefill / decode / verify and the DSpark generate loop on 16 simulated devices equal their single-device results
(fp32, <= 1e-5), under both presets; the cache keeps its rule layout from step to step."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jdspark
import sharding
from tests.oracle_drafter import assert_histogram, oracle_drafter
from tests.sharding.common import PRESETS, random_model, sharded_tiny_config, sharded_tiny_drafter_config

B, T_PROMPT, T_VERIFY, S = 16, 5, 3, 16  # B = 16 rows, so dp16-ep16 splits the batch one row per device
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def single():
    """The tiny sharded-shape model and its single-device prefill -> decode -> verify results."""
    cfg = sharded_tiny_config()
    model = random_model(cfg)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, (B, T_PROMPT + 1 + T_VERIFY)).astype(np.int32)
    pre = jax.device_get(model.prefill(tok[:, :T_PROMPT], model.init_cache(B, S)))  # (host copies: caches are
    dec = jax.device_get(model.decode(tok[:, T_PROMPT], jax.device_put(pre.cache)))  # donated to the next step)
    ver = jax.device_get(model.verify(tok[:, T_PROMPT + 1:], jax.device_put(dec.cache)))
    host = (pre.logits, pre.cache, dec.logits, dec.cache, ver.logits, ver.cache, ver.kda_rollback)
    return cfg, model, tok, host


def _assert_cache(got, want):
    for f in dataclasses.fields(want):
        np.testing.assert_allclose(np.asarray(getattr(got, f.name)), np.asarray(getattr(want, f.name)), **TOL,
                                   err_msg=f.name)


def _assert_layout(cache, mesh):
    want = sharding.cache_specs(cache, mesh)
    for f in dataclasses.fields(cache):
        x, spec = getattr(cache, f.name), getattr(want, f.name)
        assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), x.ndim), \
            f"{f.name}: {x.sharding} != {spec}"


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_decode_verify_equal_single_device(single, preset):
    cfg, model, tok, (pre_l, pre_c, dec_l, dec_c, ver_l, ver_c, ver_states) = single
    mesh = sharding.make_mesh(preset)
    m = nnx.clone(model)
    sharding.shard_model(m, mesh)
    pre = m.prefill(tok[:, :T_PROMPT], m.init_cache(B, S))
    assert m.model.layers[1].block_sparse_moe.experts.partition.sharded
    np.testing.assert_allclose(np.asarray(pre.logits), pre_l, **TOL)
    _assert_cache(pre.cache, pre_c)
    _assert_layout(pre.cache, mesh)
    dec = m.decode(tok[:, T_PROMPT], pre.cache)
    np.testing.assert_allclose(np.asarray(dec.logits), dec_l, **TOL)
    _assert_cache(dec.cache, dec_c)
    _assert_layout(dec.cache, mesh)
    ver = m.verify(tok[:, T_PROMPT + 1:], dec.cache)
    np.testing.assert_allclose(np.asarray(ver.logits), ver_l, **TOL)
    for got, want in zip(jax.tree.leaves(ver.kda_rollback), jax.tree.leaves(ver_states), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, **TOL)
    _assert_cache(ver.cache, ver_c)
    # the parameters really are split: a KDA projection over "tensor" (tp16) or the experts over "data"
    q = m.model.layers[0].self_attn.q_proj.kernel[...]
    packed = m.model.layers[1].block_sparse_moe.experts.w1_packed[...]
    if preset == "tp16":
        assert q.sharding.shard_shape(q.shape) == (q.shape[0], q.shape[1] // 16)
        assert packed.sharding.shard_shape(packed.shape)[1] == packed.shape[1] // 16
    else:
        assert packed.sharding.shard_shape(packed.shape)[0] == packed.shape[0] // 16


@pytest.fixture(scope="module")
def generated(single):
    """The oracle drafter (tests/oracle_drafter.py): every accepted length 0..G occurs, so the sharded verify's
    rows 1..G and the rollback are exercised, not only the bonus path."""
    cfg, model, _, _ = single
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (7,)).astype(np.int32)
    n = 16
    ref = jdspark.generate(model, None, prompt, max_new_tokens=n + 4 + 1, eos_token_id=-1, prompt_bucket=8).tokens
    drafter, want = oracle_drafter(model, prompt, ref, n, config=sharded_tiny_drafter_config(cfg, block_size=4),
                                   seed=1)
    out = jdspark.generate(model, drafter, prompt, max_new_tokens=n, eos_token_id=-1, prompt_bucket=8)
    np.testing.assert_array_equal(out.tokens, ref[:n])
    assert_histogram(out.stats, want, "single device")
    return model, drafter, prompt, out, want, n


@pytest.mark.parametrize("preset", PRESETS)
def test_dspark_generate_equal_single_device(generated, preset):
    model, drafter, prompt, want_out, want, n = generated
    mesh = sharding.make_mesh(preset)
    m, d = nnx.clone(model), nnx.clone(drafter)
    sharding.shard_model(m, mesh)
    sharding.shard_model(d, mesh)
    got = jdspark.generate(m, d, prompt, max_new_tokens=n, eos_token_id=-1, prompt_bucket=8)
    np.testing.assert_array_equal(got.tokens, want_out.tokens)
    assert got.stats.as_dict() == want_out.stats.as_dict()
    assert_histogram(got.stats, want, preset)
    assert d.partition.mesh == mesh and m.partition.mesh == mesh


def test_unshard_restores_single_device_model(single):
    cfg, model, tok, (pre_l, *_) = single
    m = sharding.shard_model(nnx.clone(model), sharding.make_mesh("tp16"))
    sharding.unshard_model(m)
    assert not m.partition.sharded
    assert len(m.model.layers[0].self_attn.q_proj.kernel[...].sharding.device_set) == 1
