"""DSparkDrafter without PyTorch: checkpoint round trip and load errors, the decode cache against the training
forward, config JSON, and jit stability of draft_logits."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.config import DSparkConfig
from jdspark.drafter import (
    DrafterCache,
    DSparkDrafter,
    load_drafter,
    save_drafter,
    select_anchors,
    state_dict,
    training_loss,
)

D, V, NTAP = 64, 128, 3

# the abridged config.json of speculators' tiny DSpark model (reference/dspark.md, appendix §1)
FIXTURE = json.loads("""
{"architectures":["DSparkDraftModel"],"auto_map":{"":"config.DSparkSpeculatorConfig"},
 "aux_hidden_state_layer_ids":[1,3,5],"block_size":4,"confidence_head_with_markov":true,
 "draft_vocab_size":128,"enable_confidence_head":true,"markov_head_type":"vanilla","markov_rank":16,
 "mask_token_id":127,"sample_from_anchor":true,"sliding_window_non_causal":false,
 "speculators_config":{"algorithm":"dspark","default_proposal_method":"greedy",
   "proposal_methods":[{"proposal_type":"greedy","speculative_tokens":4,"accept_tolerance":0.0,"verifier_accept_k":1}],
   "verifier":{"architectures":["Qwen3ForCausalLM"],"name_or_path":null}},
 "speculators_model_type":"dspark","speculators_version":"0.9.0","target_hidden_size":null,
 "transformer_layer_config":{"model_type":"qwen3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
   "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"rms_norm_eps":1e-06,"attention_bias":false,
   "hidden_act":"silu","layer_types":["full_attention","full_attention"],"sliding_window":null,
   "rope_parameters":{"rope_theta":10000.0,"rope_type":"default"},"vocab_size":128,"tie_word_embeddings":false}}
""")


def _drafter(cfg, seed=0):
    """A drafter whose every weight is O(1)-effective (norm scales around 1), so masks and heads matter."""
    d = DSparkDrafter(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(d)
    flat = list(nnx.to_flat_state(state))
    for path, var in flat:
        shape = var.get_value().shape
        if path[-1] == "scale":
            val = rng.uniform(0.5, 1.5, shape)
        elif len(shape) == 2:
            val = rng.normal(0, 1.0 if path[-2] == "markov_w1" else 1.0 / np.sqrt(shape[0]), shape)
        else:
            val = rng.uniform(-0.5, 0.5, shape)
        var.set_value(jnp.asarray(val, jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _shared(seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (V, D)), 0.3 * jax.random.normal(k2, (D, V))


# ---------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_exact(tmp_path):
    cfg = DSparkConfig.tiny(markov_head_type="rnn", attention_bias=True)
    d = _drafter(cfg)
    out = tmp_path / "drafter"
    save_drafter(d, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["drafter"]  # no temp dirs left behind
    d2 = load_drafter(out)
    assert d2.config == cfg
    a, b = state_dict(d), state_dict(d2)
    assert a.keys() == b.keys()
    assert not any(k.startswith(("embed_tokens", "lm_head", "verifier")) for k in a)
    assert a["fc.weight"].shape == (D, NTAP * D)  # torch [out, in] layout on disk
    assert a["markov_head.markov_w1.weight"].shape == (V, 16) and a["markov_head.markov_w2.weight"].shape == (V, 16)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    # saving over an existing checkpoint replaces it atomically
    d3 = _drafter(cfg, seed=5)
    save_drafter(d3, out)
    np.testing.assert_array_equal(np.asarray(state_dict(load_drafter(out))["fc.weight"]),
                                  np.asarray(state_dict(d3)["fc.weight"]))
    assert os.listdir(tmp_path) == ["drafter"]


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    from kimi import safetensors_io

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors_io, "write_safetensors", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_drafter(_drafter(DSparkConfig.tiny()), tmp_path / "d")
    assert os.listdir(tmp_path) == []


def test_load_reports_missing_unexpected_misshaped_at_once(tmp_path):
    from safetensors.flax import load_file, save_file

    save_drafter(_drafter(DSparkConfig.tiny()), tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    t = load_file(str(f))
    del t["layers.1.mlp.up_proj.weight"]
    t["bogus.extra.weight"] = jnp.zeros((3,))
    t["fc.weight"] = jnp.zeros((D, 2 * D))
    t["embed_tokens.weight"] = jnp.zeros((V, D))  # the target's: ignored, not "unexpected"
    save_file(t, str(f))
    with pytest.raises(ValueError) as e:
        load_drafter(tmp_path / "d")
    msg = str(e.value)
    assert "missing tensors: layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors: bogus.extra.weight" in msg
    assert "fc.weight: expected [64, 192], got [64, 128]" in msg
    assert "embed_tokens" not in msg


def test_target_size_checks():
    class Tgt:
        class config:  # noqa: N801
            hidden_size, vocab_size, num_hidden_layers = 32, 100, 4

    with pytest.raises(ValueError) as e:
        DSparkDrafter(DSparkConfig.tiny(), target=Tgt, rngs=nnx.Rngs(0))
    assert "hidden_size" in str(e.value) and "vocab_size" in str(e.value)
    assert "aux_hidden_state_layer_ids" in str(e.value)
    cfg = DSparkConfig.for_target(Tgt.config)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.mask_token_id) == (32, 100, 99)
    assert max(cfg.aux_hidden_state_layer_ids) <= 4
    DSparkDrafter(cfg, target=Tgt, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------- config
def test_config_json_round_trip_and_fixture(tmp_path):
    cfg = DSparkConfig.from_speculators_config(FIXTURE)
    assert cfg == DSparkConfig.tiny(verifier_architectures=("Qwen3ForCausalLM",))
    for c in (cfg, DSparkConfig.tiny(markov_head_type="gated", layer_types=("sliding_attention", "full_attention"),
                                     sliding_window=8, sliding_window_non_causal=True, sample_from_anchor=False,
                                     enable_confidence_head=False, param_dtype="bfloat16"), DSparkConfig.k3()):
        raw = c.to_speculators_config()
        p = tmp_path / "config.json"
        p.write_text(json.dumps(raw))
        assert DSparkConfig.from_speculators_config(p) == c
        assert DSparkConfig.from_speculators_config(tmp_path) == c
    raw = cfg.to_speculators_config()
    for k, v in FIXTURE.items():  # every fixture field is written, with the same value
        if k != "transformer_layer_config":
            assert raw[k] == v, k
    for k, v in FIXTURE["transformer_layer_config"].items():
        assert raw["transformer_layer_config"][k] == v, k
    (tmp_path / "config.json").write_text('{"block_size": 7,')  # a broken file is named
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(Expecting property name"):
        DSparkConfig.from_speculators_config(tmp_path)


@pytest.mark.parametrize("kw, field", [
    (dict(draft_vocab_size=64), "draft_vocab_size"),
    (dict(markov_head_type="lstm"), "markov_head_type"),
    (dict(markov_rank=0), "confidence_head_with_markov"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(mask_token_id=128), "mask_token_id"),
    (dict(layer_types=("full_attention",)), "layer_types"),
    (dict(attention="mha"), "attention"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"DSparkConfig.{field}"):
        DSparkConfig.tiny(**kw)
    if field == "draft_vocab_size":
        with pytest.raises(ValueError, match="not supported"):
            DSparkConfig.tiny(**kw)


def test_k3_preset_and_mla_not_implemented():
    cfg = DSparkConfig.k3()
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.markov_rank, cfg.aux_hidden_state_layer_ids) == \
        (5, 7, 256, (2, 23, 47, 71, 89))
    with pytest.raises(NotImplementedError, match="mla"):
        DSparkDrafter(DSparkConfig.tiny(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                        v_head_dim=8), rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------- the decode cache
@pytest.mark.parametrize("layer_types, window", [(None, None), (("sliding_attention", "full_attention"), 3)])
def test_incremental_cache_matches_training_forward(layer_types, window):
    cfg = DSparkConfig.tiny(markov_head_type="rnn", layer_types=layer_types, sliding_window=window)
    d = _drafter(cfg)
    embed, lm_head = _shared()
    T, a = 14, 9  # anchor at position 9: context = taps[0:9]
    key = jax.random.PRNGKey(7)
    taps = jax.random.normal(key, (1, T, NTAP * D))
    ids = jax.random.randint(jax.random.PRNGKey(8), (1, T), 0, V - 1)
    graphdef, params = nnx.split(d)

    @jax.jit
    def both(params, taps, ids):
        dr = nnx.merge(graphdef, params)
        ref = dr.training_outputs(taps, ids, jnp.array([a, 2]), embed, lm_head)
        N = cfg.block_size + 1
        cache = dr.init_cache(1, 24)
        chunk1 = taps[:, 0:N]  # 5 rows, all valid
        chunk2 = jnp.concatenate([taps[:, N:a], 50.0 * jnp.ones((1, N - (a - N), NTAP * D))], axis=1)  # 4 + junk
        cache = dr.append_context(cache, chunk1, N)
        cache = dr.append_context(cache, chunk2, a - N)
        base, hid = dr.draft_logits(cache, ids[:, a], None, embed, lm_head)
        toks, corr, conf = dr.greedy_block(base, hid, ids[:, a])
        return ref, cache.length, base, hid, corr, conf, toks

    ref, length, base, hid, corr, conf, toks = both(params, taps, ids)
    assert int(length) == a
    np.testing.assert_allclose(base[0], ref["base_logits"][0], atol=1e-5)
    np.testing.assert_allclose(hid[0], ref["hidden"][0], atol=1e-5)
    # greedy_block slot 0 conditions on the anchor, like the teacher-forced training slot 0
    np.testing.assert_allclose(corr[0, 0], ref["logits"][0, 0], atol=1e-5)
    np.testing.assert_allclose(conf[0, 0], ref["confidence_logits"][0, 0], atol=1e-5)
    assert toks.shape == (1, cfg.block_size)


def test_draft_logits_jit_does_not_recompile():
    cfg = DSparkConfig.tiny()
    d = _drafter(cfg)
    embed, lm_head = _shared()
    graphdef, params = nnx.split(d)
    traces = []

    @jax.jit
    def step(params, cache, taps, n_valid, anchor):
        traces.append(1)
        dr = nnx.merge(graphdef, params)
        cache = dr.append_context(cache, taps, n_valid)
        return dr.draft_logits(cache, anchor, None, embed, lm_head), cache

    cache = d.init_cache(2, 32)
    assert isinstance(cache, DrafterCache)
    k = jax.random.PRNGKey(0)
    taps = jax.random.normal(k, (2, cfg.block_size + 1, NTAP * D))
    (l1, _), cache = step(params, cache, taps, 3, jnp.array([1, 2]))
    (l2, _), cache = step(params, cache, 2.0 * taps, 5, jnp.array([7, 9]))
    assert len(traces) == 1
    assert int(cache.length) == 8
    assert not np.allclose(l1, l2)


def test_serving_layout_drafts_the_same():
    """The serving copy (fused projections) appends the same context and gives the same block logits."""
    from jdspark.drafter import with_serving_layout

    cfg = DSparkConfig.tiny()
    d = _drafter(cfg)
    served = with_serving_layout(d)
    assert hasattr(served.layers[0].mlp, "fused_gate_proj__up_proj")
    embed, lm_head = _shared()
    taps = jax.random.normal(jax.random.PRNGKey(3), (1, cfg.block_size + 1, NTAP * D))
    outs = []
    for m in (d, served):
        cache = jax.jit(lambda c, t, m=m: m.append_context(c, t, 4))(m.init_cache(1, 16), taps)
        outs.append((cache, jax.jit(lambda c, m=m: m.draft_logits(c, jnp.array([2]), None, embed, lm_head))(cache)))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_append_context_checks_capacity():
    d = _drafter(DSparkConfig.tiny())
    cache = d.init_cache(1, 6)
    with pytest.raises(ValueError, match="max_len"):
        d.append_context(cache, jnp.zeros((1, 7, NTAP * D)), 7)
    with pytest.raises(ValueError, match="n_valid"):
        d.append_context(cache, jnp.zeros((1, 3, NTAP * D)), 4)


# ---------------------------------------------------------------------- training helpers
def test_select_anchors():
    mask = jnp.array([[0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    anchors, valid = select_anchors(jax.random.PRNGKey(0), mask, 10, 4)
    a = np.asarray(anchors)[np.asarray(valid)]
    assert sorted(a.tolist()) == [1, 2, 4, 5, 6, 7]  # every valid one, excluding the last block_size positions
    assert np.asarray(anchors)[~np.asarray(valid)].tolist() == [0] * 4
    anchors, valid = select_anchors(jax.random.PRNGKey(1), mask, 3, 4)
    a = np.asarray(anchors)
    assert bool(valid.all()) and np.all(np.diff(a) > 0) and set(a.tolist()) <= {1, 2, 4, 5, 6, 7}


def test_training_loss_gradient_is_finite():
    cfg = DSparkConfig.tiny(markov_rank=4)
    d = _drafter(cfg)
    embed, lm_head = _shared()
    T = 12
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    taps = jax.random.normal(k[0], (1, T, NTAP * D))
    ids = jax.random.randint(k[1], (1, T), 0, V - 1)
    vlh = jax.random.normal(k[2], (1, T, D))

    @nnx.jit
    def grad_step(d):
        return nnx.value_and_grad(training_loss, has_aux=True)(
            d, taps, ids, jnp.ones((1, T)), jnp.array([1, 5]), jnp.array([True, True]), vlh, jnp.ones((D,)), embed,
            lm_head)

    (loss, metrics), grads = grad_step(d)
    assert np.isfinite(float(loss)) and float(metrics["accept_len_sum"]) > 0
    g = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(grads)}
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g.values())
    assert float(jnp.abs(g["fc/kernel"]).max()) > 0 and float(jnp.abs(g["markov_head/markov_w1/embedding"]).max()) > 0


def _loss_grads(m, n_taps: int, embed, lm_head) -> dict:
    """The training loss's gradient of drafter ``m`` on 12 random positions of ``n_taps`` taps, by parameter path."""
    T = 12
    ids = jax.random.randint(jax.random.PRNGKey(4), (1, T), 0, V - 1)
    taps_T = jax.random.normal(jax.random.PRNGKey(5), (1, T, n_taps * D))
    vlh = jax.random.normal(jax.random.PRNGKey(6), (1, T, D))

    @nnx.jit
    def grad_step(m):
        return nnx.value_and_grad(training_loss, has_aux=True)(
            m, taps_T, ids, jnp.ones((1, T)), jnp.array([1, 5]), jnp.array([True, True]), vlh, jnp.ones((D,)),
            embed, lm_head)

    _, grads = grad_step(m)
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")])
def test_deepened_drafter_drafts_the_same_and_trains(tmp_path, layer_types):
    """``with_layers``: a drafter deepened from 2 to 3 layers appends the same context and gives the same block
    logits (its new layer's residual outputs start at zero), its config says 3 layers (the last layer type
    repeated), it saves and loads as a 3-layer drafter, and its loss has a non-zero gradient on the new layer's
    output projection (training can move it). Cutting layers is an error."""
    from jdspark.drafter import with_layers

    cfg = DSparkConfig.tiny(layer_types=layer_types, sliding_window=3 if layer_types else None)
    d = _drafter(cfg)
    deep = with_layers(d, 3)
    assert deep.config.num_hidden_layers == 3 and len(deep.layers) == 3
    assert deep.config.resolved_layer_types == tuple(cfg.resolved_layer_types) + (cfg.resolved_layer_types[-1],)
    embed, lm_head = _shared()
    taps = jax.random.normal(jax.random.PRNGKey(3), (1, cfg.block_size + 1, NTAP * D))
    outs = []
    for m in (d, deep):
        @nnx.jit
        def block(m):
            cache = m.append_context(m.init_cache(1, 16), taps, 4)
            return m.draft_logits(cache, jnp.array([2]), None, embed, lm_head)

        outs.append(block(m))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(np.asarray(deep.layers[2].self_attn.q_proj.kernel[...]), 0.0)
    save_drafter(deep, tmp_path / "deep")
    assert load_drafter(tmp_path / "deep").config.num_hidden_layers == 3

    g = _loss_grads(deep, NTAP, embed, lm_head)
    assert float(jnp.abs(g["layers/2/self_attn/o_proj/kernel"]).max()) > 0
    with pytest.raises(ValueError, match="num_layers"):
        with_layers(deep, 2)


def test_drafter_with_added_taps_drafts_the_same_and_trains(tmp_path):
    """``with_taps``: a drafter reading taps (1, 3, 5) given (6, 1, 3, 5) appends the same context and gives the
    same block logits when the old taps' features are where the new order puts them (the new tap's rows of fc start
    at zero, whatever its features), saves and loads with the new tap ids, and its loss has a non-zero gradient on
    the new tap's rows (training can move them). Dropping a tap is an error."""
    from jdspark.drafter import with_taps

    cfg = DSparkConfig.tiny()
    d = _drafter(cfg)
    wide = with_taps(d, (6, 1, 3, 5))
    assert wide.config.aux_hidden_state_layer_ids == (6, 1, 3, 5) and wide.fc.kernel.shape == (4 * D, D)
    embed, lm_head = _shared()
    taps_old = jax.random.normal(jax.random.PRNGKey(3), (1, cfg.block_size + 1, NTAP * D))
    taps_new = jnp.concatenate([5.0 * jax.random.normal(jax.random.PRNGKey(9), (1, cfg.block_size + 1, D)),
                                taps_old], -1)  # the new tap first: the old taps' rows moved by D
    outs = []
    for m, taps in ((d, taps_old), (wide, taps_new)):
        @nnx.jit
        def block(m, taps):
            cache = m.append_context(m.init_cache(1, 16), taps, 4)
            return m.draft_logits(cache, jnp.array([2]), None, embed, lm_head)

        outs.append(block(m, taps))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    save_drafter(wide, tmp_path / "wide")
    assert load_drafter(tmp_path / "wide").config.aux_hidden_state_layer_ids == (6, 1, 3, 5)

    g = _loss_grads(wide, 4, embed, lm_head)
    assert float(jnp.abs(g["fc/kernel"][:D]).max()) > 0
    with pytest.raises(ValueError, match="lacks \\[1\\]"):
        with_taps(wide, (3, 5, 6))
