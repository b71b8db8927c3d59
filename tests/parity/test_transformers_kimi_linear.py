"""kimi vs transformers' native KimiLinearForCausalLM (fp32, CPU) on a tiny random checkpoint written by
``save_pretrained``: prefill logits and every layer's input, step decode with transformers' cache, 32 greedy
tokens; the other name forms transformers produces; transformers loading what ``kimi.save_checkpoint`` writes;
and ``scripts/parity.py --self-test --json`` end to end."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch  # noqa: E402  (a missing parity dependency fails the run: tests/conftest.py)
import transformers  # noqa: E402, F401

import kimi  # noqa: E402
from tests.kimi.test_checkpoint import state_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "parity.py")
TOL = 1e-4


def _parity_module():
    spec = importlib.util.spec_from_file_location("_parity_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


parity = _parity_module()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """q LoRA on here (the self-test script runs q_lora_rank None), so both MLA query paths are compared."""
    d = parity.build_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", seed=1, q_lora_rank=16)
    hf, ours = parity.load_pair(d)
    return d, hf, ours


def test_config_read_from_transformers(pair):
    _, hf, ours = pair
    c = ours.config
    assert c.layer_kinds == ("kda", "kda", "mla", "kda") and c.ffn_kinds == ("dense", "moe", "moe", "moe")
    assert c.q_lora_rank == 16 and c.mla_lora_norm_eps == hf.model.layers[2].self_attn.q_a_layernorm.variance_epsilon
    assert c.mla_lora_norm_eps == 1e-6 and c.rms_norm_eps == hf.config.rms_norm_eps
    assert (c.hidden_act, c.attn_res_block_size, c.routed_expert_hidden_size, c.kda_gate_lower_bound) == \
        ("silu", None, None, None)
    assert not c.kda_use_full_rank_gate and not c.mla_use_output_gate and c.mla_use_nope
    assert c.routed_scaling_factor == hf.config.routed_scaling_factor and c.num_experts_per_token == 2


def test_prefill_decode_and_greedy_match(pair):
    _, hf, ours = pair
    prompt = np.random.default_rng(5).integers(0, ours.config.vocab_size, size=(1, 21)).astype(np.int32)
    r = parity.compare_models(hf, ours, prompt, decode_steps=3, greedy_tokens=32, seed=5)
    assert r["logits_max_abs_diff"] <= TOL, r
    assert max(r["per_layer_hidden_max_abs_diff"]) <= TOL, r
    assert r["decode_logits_max_abs_diff"] <= TOL, r
    assert r["greedy_match"], r


def test_generate_equals_transformers_generate(pair):
    """jdspark.generate's greedy tokens, plain and DSpark (the oracle drafter built from transformers' own tokens,
    so every accepted length 0..G occurs), equal transformers' generate on the same checkpoint."""
    from tests.oracle_drafter import assert_histogram, oracle_drafter

    _, hf, ours = pair
    n, G = 24, 4
    prompt = np.random.default_rng(9).integers(0, ours.config.vocab_size, size=(1, 13)).astype(np.int32)
    import jdspark

    # transformers stops at the checkpoint's EOS (its generation_config), as generate does by default
    stopped = np.asarray(parity.hf_greedy(hf, prompt, n))
    got = jdspark.generate(ours, None, prompt[0], max_new_tokens=n)
    np.testing.assert_array_equal(got.tokens, stopped)
    eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
    try:
        want = np.asarray(parity.hf_greedy(hf, prompt, n + G + 1))
    finally:
        hf.generation_config.eos_token_id = eos
    assert len(want) == n + G + 1
    plain = jdspark.generate(ours, None, prompt[0], max_new_tokens=n, eos_token_id=-1)
    np.testing.assert_array_equal(plain.tokens, want[:n])
    drafter, expected = oracle_drafter(ours, prompt[0], want, n, block_size=G, seed=9)
    spec = jdspark.generate(ours, drafter, prompt[0], max_new_tokens=n, eos_token_id=-1)
    np.testing.assert_array_equal(spec.tokens, want[:n])
    assert_histogram(spec.stats, expected, "transformers' tokens")


def test_transformers_state_dict_names(pair, tmp_path):
    """transformers' in-memory names (forget_gate.*, fused conv1d [3P,1,K], mlp.* with fused experts
    gate_up_proj [E,2I,D] / down_proj [E,D,I], A_log [1,1,H,1]) load to the same bits as save_pretrained's."""
    from safetensors.torch import save_file

    d, hf, ours = pair
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd and "model.layers.0.self_attn.conv1d.weight" in sd
    os.makedirs(tmp_path / "native")
    save_file(sd, str(tmp_path / "native" / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f, open(tmp_path / "native" / "config.json", "w") as g:
        g.write(f.read())
    assert state_bytes(kimi.load_checkpoint(tmp_path / "native")) == state_bytes(ours)


def test_transformers_loads_what_we_save(pair, tmp_path):
    """Our writer's official layout (A_log [1,1,H,1] for Kimi-Linear) loads in transformers with no missing,
    unexpected or mis-shaped keys, to the same logits; and loads back here bitwise."""
    from transformers import KimiLinearForCausalLM

    _, hf, ours = pair
    kimi.save_checkpoint(ours, tmp_path / "ours", max_shard_bytes=32 * 1024)
    back, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                       attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, hf(ids).logits)
    assert state_bytes(kimi.load_checkpoint(tmp_path / "ours")) == state_bytes(ours)


def test_parity_script_self_test(capsys):
    """The acceptance line, ``python scripts/parity.py --self-test --json``, through the script's own ``main`` (in
    this process: it shares the module's compiled programs instead of a cold interpreter's)."""
    assert parity.main(["--self-test", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert r["logits_max_abs_diff"] <= 1e-4 and r["decode_logits_max_abs_diff"] <= 1e-4, r
    assert r["greedy_match"] is True and r["greedy_tokens"] == 32, r
    assert r["kda_vs_fla_max_abs_diff"] <= 1e-5 and r["mxfp4_max_abs_diff"] == 0, r
    assert len(r["per_layer_hidden_max_abs_diff"]) == 5 and max(r["per_layer_hidden_max_abs_diff"]) <= 1e-4, r
