"""Meshes and the rules table: presets, explicit dims, axis types, divisibility checks, full-size K3 specs, and
the simulate.py acceptance figures for K3 on tp16."""
import importlib.util
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import kimi
import sharding
from sharding.rules import canonical_key, logical_to_spec, param_axes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("spec,dims,rules", [
    ("tp16", {"data": 1, "tensor": 16}, "tp"),
    ("dp16-ep16", {"data": 16, "tensor": 1}, "dp-ep"),
    ({"data": 2, "tensor": 8}, {"data": 2, "tensor": 8}, "dp-tp-ep"),
    ({"tensor": 16}, {"data": 1, "tensor": 16}, "tp"),
])
def test_make_mesh(spec, dims, rules):
    mesh = sharding.make_mesh(spec)
    assert dict(mesh.shape) == dims and mesh.axis_names == sharding.AXES
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == 16 and set(mesh.devices.flat) == set(jax.devices())
    assert sharding.rules_for(mesh).name == rules


@pytest.mark.parametrize("spec,match", [
    ("tp8", "needs 8 devices"), ("dp4-ep8", "dp must equal ep"), ("pp16", "expected 'tpN'"),
    ({"pipe": 16}, "unknown axes"), ({"data": 0, "tensor": 16}, ">= 1"),
])
def test_make_mesh_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(spec)


def test_logical_to_spec_checks():
    tp = sharding.RULES["tp"]
    mesh = {"data": 1, "tensor": 16}
    assert logical_to_spec((None, "kda_heads"), (64, 128), mesh, tp) == P(None, "tensor")
    with pytest.raises(ValueError, match=r"q_proj.*dim 1 \(size 40, logical 'kda_heads'\) is not divisible"):
        logical_to_spec((None, "kda_heads"), (64, 40), mesh, tp, where="q_proj")
    # batch rows that don't divide are replicated (a batch-1 stream on a data-parallel mesh)
    dp = sharding.RULES["dp-ep"]
    assert logical_to_spec(("batch", None), (1, 8), {"data": 16, "tensor": 1}, dp) == P(None, None)
    assert logical_to_spec(("batch", None), (32, 8), {"data": 16, "tensor": 1}, dp) == P("data", None)
    # mesh axes of size 1 are dropped
    assert logical_to_spec(("batch", "experts"), (4, 4), {"data": 1, "tensor": 16}, dp) == P(None, None)
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_to_spec(("heads",), (16,), mesh, tp)
    with pytest.raises(ValueError, match="used by two dims"):
        logical_to_spec(("kda_heads", "vocab"), (16, 16), mesh, tp)


def test_every_parameter_needs_a_rule():
    assert canonical_key(("model", "layers", 3, "self_attn", "q_proj", "kernel"), ("kda",) * 3 + ("mla",)) \
        == "mla.q_proj.kernel"
    assert canonical_key("layers.2.self_attn.q_proj.kernel", drafter=True) == "drafter.layers.self_attn.q_proj.kernel"
    assert param_axes("layer.mlp_res_proj.kernel", 2) == (None, None)  # AttnRes pseudo-query: replicated pattern
    with pytest.raises(ValueError, match="no sharding rule for parameter 'kda.new_proj.kernel'"):
        param_axes("kda.new_proj.kernel", 2)
    with pytest.raises(ValueError, match="names 2 dims"):
        param_axes("kda.q_proj.kernel", 3)


def test_full_size_k3_shards_cleanly_under_both_presets():
    from kimi.info import abstract_model

    cfg = kimi.KimiConfig.k3()
    model = abstract_model(cfg)
    tp = sharding.param_specs(model, {"data": 1, "tensor": 16})
    dp = sharding.param_specs(model, {"data": 16, "tensor": 1})
    experts = [k for k in tp if ".experts.w" in k]
    assert len(experts) == 92 * 6
    for k in experts:
        want_tp = P(None, None, "tensor") if ".w2_" in k else P(None, "tensor", None)
        assert tp[k] == want_tp and dp[k] == P("data", None, None), k
    assert tp["lm_head.kernel"] == P(None, "tensor") and dp["lm_head.kernel"] == P(None, None)
    assert tp["model.layers.3.self_attn.kv_b_proj.kernel"] == P(None, "tensor")  # layer 3 is MLA (1-based 4)
    # the 1M-token cache splits too
    cache = kimi.KimiCache.abstract(cfg, 1, 1 << 20)
    specs = sharding.cache_specs(cache, {"data": 1, "tensor": 16})
    assert specs.kda_state == P(None, None, "tensor", None, None) and specs.mla_ckv == P(None, None, None, None)


def test_checkpoint_shardings_callable():
    cfg = kimi.KimiConfig.tiny(kda_num_heads=16, num_attention_heads=16)
    mesh = sharding.make_mesh("tp16")
    fn = sharding.checkpoint_shardings(mesh, cfg)
    sh = fn("model.layers.0.self_attn.q_proj.kernel", (cfg.hidden_size, cfg.kda_proj_dim), np.float32)
    assert sh.mesh == mesh and sh.spec == P(None, "tensor")
    assert fn("model.norm.weight", (cfg.hidden_size,), np.float32).spec == P(None)


def test_simulate_k3_tp16_meets_the_acceptance_figures(capsys):
    spec = importlib.util.spec_from_file_location("simulate", os.path.join(ROOT, "scripts", "simulate.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    assert sim.main(["--preset", "k3", "--mesh", "tp16", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert abs(out["total_params"] - 2.8e12) <= 0.02 * 2.8e12
    assert out["per_device_param_bytes"] <= 2.88e11
    assert out["fits"] is True and out["per_device_total_bytes"] <= out["hbm_bytes"]
    assert out["roofline"]["plain"]["tokens_per_s"] >= 118
    assert out["roofline"]["dspark"]["tokens_per_s"] > out["roofline"]["plain"]["tokens_per_s"]
    for kind in ("kda", "mla", "moe"):
        aot = out["aot_decode_step"][kind]
        assert aot["memory"]["argument_size_in_bytes"] > 0 and aot["collectives"]["count"] >= 1
    # the vision tower: replicated (every device holds all of it), its own part; the largest image's activations
    from kimi.image import MAX_PATCHES
    vis, v = out["vision"], kimi.KimiConfig.k3().vision
    assert vis["per_device_param_bytes"] == vis["param_bytes_total"] == out["per_device_param_bytes_by_part"]["vision"]
    assert 0.3e9 <= vis["param_bytes_total"] / 2 <= 0.5e9  # ~0.4B parameters in bf16
    assert vis["image_patches"] == MAX_PATCHES and vis["merged_tokens"] == MAX_PATCHES // 4
    assert vis["encoder_activation_bytes"]["attention_scores_fp32"] == v.num_attention_heads * MAX_PATCHES ** 2 * 4
