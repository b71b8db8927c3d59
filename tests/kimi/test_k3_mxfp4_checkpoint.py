"""A tiny K3-style checkpoint with MXFP4 experts in the compressed-tensors layout (``weight_packed`` U8
[out, in/2], ``weight_scale`` U8 [out, in/32], ``quantization_config``): bitwise round trip, the logits equal
those of the model built from the dequantised (dense) experts, explicit dense <-> MXFP4 conversion at load, and
K3's ``language_model.`` layout (vision tensors skipped, ``A_log`` zero-padded)."""
import json
import os

import numpy as np
import pytest

import kimi
from kimi import mxfp4
from tests.kimi.test_checkpoint import read_all, state_bytes, write_random_checkpoint

CFG = kimi.KimiConfig.tiny(expert_format="mxfp4", routed_expert_hidden_size=64)
E, F, DIN = CFG.num_experts, CFG.moe_intermediate_size, CFG.expert_in_dim
EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.{s}"


@pytest.fixture(scope="module")
def packed_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3") / "mxfp4"
    tensors = write_random_checkpoint(d, CFG, seed=3)
    return d, tensors


def test_compressed_tensors_layout_round_trips_bitwise(packed_ckpt, tmp_path):
    d, tensors = packed_ckpt
    m = kimi.load_checkpoint(d)
    assert m.config.expert_format == "mxfp4"
    ex = m.model.layers[1].block_sparse_moe.experts
    assert ex.w1_packed[...].dtype == np.uint8 and ex.w1_packed[...].shape == (E, F, DIN // 2)  # kept packed
    assert ex.w2_scale[...].shape == (E, DIN, F // 32)
    kimi.save_checkpoint(m, tmp_path / "out")
    saved = read_all(tmp_path / "out")
    assert set(saved) == set(tensors)
    for w, (o, i) in {"w1": (F, DIN), "w3": (F, DIN), "w2": (DIN, F)}.items():
        assert saved[EXPERT.format(i=2, e=E - 1, w=w, s="weight_packed")][:2] == ("U8", (o, i // 2))
        assert saved[EXPERT.format(i=2, e=E - 1, w=w, s="weight_scale")][:2] == ("U8", (o, i // 32))
    for k, a in tensors.items():
        assert saved[k][2] == a.tobytes(), k
    with open(tmp_path / "out" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
    assert state_bytes(kimi.load_checkpoint(tmp_path / "out")) == state_bytes(m)


def test_logits_equal_the_dequantised_model(packed_ckpt, tmp_path):
    d, tensors = packed_ckpt
    packed = kimi.load_checkpoint(d)
    dense = kimi.load_checkpoint(d, config_overrides={"expert_format": "dense"})  # dequantised at load
    assert dense.config.expert_format == "dense"
    w3 = np.asarray(dense.model.layers[2].block_sparse_moe.experts.w3[...])
    for e in range(E):
        want = mxfp4.dequantize(tensors[EXPERT.format(i=2, e=e, w="w3", s="weight_packed")],
                                tensors[EXPERT.format(i=2, e=e, w="w3", s="weight_scale")])
        np.testing.assert_array_equal(w3[e], want)
    tok = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(1, 12)).astype(np.int32)
    a = packed.prefill(tok, packed.init_cache(1, 16))
    b = dense.prefill(tok, dense.init_cache(1, 16))
    assert np.isfinite(np.asarray(a.logits)).all()
    assert np.max(np.abs(np.asarray(a.logits) - np.asarray(b.logits))) <= 1e-6

    # and back: a dense checkpoint loaded as MXFP4 is quantised at load; MXFP4 values re-quantise to the same bits
    kimi.save_checkpoint(dense, tmp_path / "dense")
    assert "quantization_config" not in json.load(open(tmp_path / "dense" / "config.json"))
    assert EXPERT.format(i=1, e=0, w="w1", s="weight") in read_all(tmp_path / "dense")
    requant = kimi.load_checkpoint(tmp_path / "dense", config_overrides={"expert_format": "mxfp4"})
    assert state_bytes(requant) == state_bytes(packed)


def test_k3_language_model_layout(packed_ckpt, tmp_path):
    """K3 stores the text model under ``language_model.``, next to the vision tower, and A_log zero-padded
    (to 128 in K3; here to 2H): all accepted, the vision tensors skipped."""
    d, tensors = packed_ckpt
    H = CFG.kda_num_heads
    k3 = {}
    for k, a in tensors.items():
        if k.endswith("self_attn.A_log"):
            a = np.concatenate([a, np.zeros(H, np.float32)])
        k3["language_model." + k] = a
    k3["vision_tower.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    k3["mm_projector.proj.0.weight"] = np.ones((2, 2), np.float32)
    write_random_checkpoint(tmp_path / "k3", CFG, tensors=k3)
    text = CFG.to_hf_config()  # K3's config.json: the text model nested, quantization_config at the top
    top = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
           "quantization_config": text.pop("quantization_config"), "text_config": text, "vision_config": {}}
    with open(tmp_path / "k3" / "config.json", "w") as f:
        json.dump(top, f)
    k3_model = kimi.load_checkpoint(tmp_path / "k3")
    assert k3_model.config == CFG
    assert state_bytes(k3_model) == state_bytes(kimi.load_checkpoint(d))

    # half the experts of one weight missing: every missing name is listed, in the checkpoint's format
    del k3["language_model." + EXPERT.format(i=1, e=2, w="w2", s="weight_scale")]
    k3["language_model." + EXPERT.format(i=1, e=5, w="w2", s="weight_packed")] = np.zeros((DIN, F // 2 + 1), np.uint8)
    write_random_checkpoint(tmp_path / "k3bad", CFG, tensors=k3)
    with pytest.raises(ValueError) as ei:
        kimi.load_checkpoint(tmp_path / "k3bad")
    msg = str(ei.value)
    assert f"missing: {EXPERT.format(i=1, e=2, w='w2', s='weight_scale')}: expected [{DIN},{F // 32}] U8" in msg
    assert (f"mis-shaped: {EXPERT.format(i=1, e=5, w='w2', s='weight_packed')}: expected [{DIN},{F // 2}], "
            f"found [{DIN},{F // 2 + 1}]") in msg
    assert os.path.basename(str(tmp_path / "k3bad")) in msg
