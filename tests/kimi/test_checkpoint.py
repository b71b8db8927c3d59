"""kimi.checkpoint: official names, bitwise round trips, sharded files, mesh placement, errors, atomic saves.

Checkpoints here are written straight from NumPy (``write_random_checkpoint``), so no test pays for a random
JAX init of the model; nothing here runs a forward pass.
"""
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

import kimi
from kimi import checkpoint as ckpt_mod
from kimi import mxfp4
from kimi.checkpoint import checkpoint_names


def write_random_checkpoint(path, cfg, seed=0, tensors=None) -> dict:
    """config.json + model.safetensors with random fp32 tensors under the official names of ``cfg`` (MXFP4 experts
    quantised from random normal weights). ``tensors`` replaces the generated dict. Returns the tensors."""
    if tensors is None:
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, (shape, dt) in checkpoint_names(cfg).items():
            if name.endswith(".weight_packed"):
                w = (0.1 * rng.standard_normal((shape[0], 2 * shape[1]))).astype(np.float32)
                tensors[name], tensors[name[:-len("packed")] + "scale"] = mxfp4.quantize(w)
            elif name.endswith(".weight_scale"):
                continue
            else:
                a = (0.1 * rng.standard_normal(shape)).astype(np.float32)
                tensors[name] = a + 1.0 if name.endswith(("norm.weight", "layernorm.weight")) else a
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return tensors


def read_all(path) -> dict:
    """{name: (dtype name, shape, raw bytes)} over every safetensors file in ``path``."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            header = _header(os.path.join(path, f))
            with open(os.path.join(path, f), "rb") as fh:
                data = fh.read()
            start = 8 + int.from_bytes(data[:8], "little")
            for k, v in header.items():
                b, e = v["data_offsets"]
                out[k] = (v["dtype"], tuple(v["shape"]), data[start + b:start + e])
    return out


def _header(fname) -> dict:
    with open(fname, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return h


def state_bytes(model) -> dict:
    return {".".join(map(str, p)): (np.asarray(v.get_value()).dtype, np.asarray(v.get_value()).tobytes())
            for p, v in nnx.to_flat_state(nnx.state(model))}


CFG = kimi.KimiConfig.tiny()  # K3-shaped: AttnRes, LatentMoE, full-rank gate, q LoRA, dense experts


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "tiny"
    tensors = write_random_checkpoint(d, CFG)
    return d, tensors


def test_official_names_shapes_and_layout(random_ckpt, tmp_path):
    d, tensors = random_ckpt
    m = kimi.load_checkpoint(d)
    assert m.config == CFG
    P, K, H, D = CFG.kda_proj_dim, CFG.short_conv_kernel_size, CFG.kda_num_heads, CFG.hidden_size
    # transforms: Linear [in, out] <-> weight [out, in]; conv [P, K] <-> [P, 1, K]; experts stacked [E, out, in]
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(m.model.layers[0].self_attn.q_proj.kernel[...]), q.T)
    conv = tensors["model.layers.0.self_attn.k_conv1d.weight"]
    assert conv.shape == (P, 1, K)
    np.testing.assert_array_equal(np.asarray(m.model.layers[0].self_attn.k_conv1d[...]), conv[:, 0])
    assert tensors["model.layers.0.self_attention_res_proj.weight"].shape == (1, D)
    assert tensors["model.layers.0.self_attn.A_log"].shape == (H,)
    w2 = np.asarray(m.model.layers[1].block_sparse_moe.experts.w2[...])
    for e in range(CFG.num_experts):
        np.testing.assert_array_equal(w2[e], tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"])
    # save writes exactly the official names, shapes and bytes that were loaded
    kimi.save_checkpoint(m, tmp_path / "out")
    saved = read_all(tmp_path / "out")
    assert set(saved) == set(tensors)
    for k, a in tensors.items():
        assert saved[k] == ("F32", a.shape, a.tobytes()), k
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    with open(tmp_path / "out" / "config.json") as f:
        assert kimi.KimiConfig.from_hf_config(json.load(f)) == CFG


def test_bf16_round_trip_is_bitwise(random_ckpt, tmp_path):
    """bfloat16 parameters: written as BF16 (read back through a memory map), the fp32-only tensors stay F32."""
    d, _ = random_ckpt
    m = kimi.load_checkpoint(d, dtype="bfloat16")
    assert m.config.param_dtype == "bfloat16"
    assert m.model.layers[0].self_attn.q_proj.kernel[...].dtype == jax.numpy.bfloat16
    kimi.save_checkpoint(m, tmp_path / "bf")
    header = _header(tmp_path / "bf" / "model.safetensors")
    assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "BF16"
    assert header["model.layers.0.self_attn.q_conv1d.weight"]["dtype"] == "F32"
    m2 = kimi.load_checkpoint(tmp_path / "bf")
    assert state_bytes(m2) == state_bytes(m)
    q = read_all(tmp_path / "bf")["model.layers.0.self_attn.q_proj.weight"][2]
    np.testing.assert_array_equal(np.frombuffer(q, ml_dtypes.bfloat16).reshape(CFG.kda_proj_dim, -1).T,
                                  np.asarray(m.model.layers[0].self_attn.q_proj.kernel[...]))


def test_sharded_save_and_index_load_the_same(random_ckpt, tmp_path):
    d, tensors = random_ckpt
    m = kimi.load_checkpoint(d)
    kimi.save_checkpoint(m, tmp_path / "sh", max_shard_bytes=64 * 1024)
    files = sorted(os.listdir(tmp_path / "sh"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    with open(tmp_path / "sh" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    for s in shards:  # every shard within the limit unless it holds one bigger tensor
        hdr = _header(tmp_path / "sh" / s)
        size = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in hdr.values())
        assert size <= 64 * 1024 or len(hdr) == 1
    assert state_bytes(kimi.load_checkpoint(tmp_path / "sh")) == state_bytes(m)


def test_load_onto_mesh(random_ckpt):
    d, _ = random_ckpt
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    ref = state_bytes(kimi.load_checkpoint(d))
    m = kimi.load_checkpoint(d, mesh=mesh)
    for _, v in nnx.to_flat_state(nnx.state(m)):
        sh = v.get_value().sharding
        assert isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == mesh and sh.spec == P()
        assert len(v.get_value().devices()) == 2
    assert state_bytes(m) == ref
    # the sharding hook: a callable (path, shape, dtype) -> Sharding | None; None means replicated
    row = jax.sharding.NamedSharding(mesh, P("x", None))
    emb_path = "model.embed_tokens.embedding"
    m = kimi.load_checkpoint(d, mesh=mesh, shardings=lambda p, s, dt: row if p == emb_path else None)
    emb = m.model.embed_tokens.embedding[...]
    assert emb.sharding.spec == row.spec
    assert emb.addressable_shards[0].data.shape == (CFG.vocab_size // 2, CFG.hidden_size)
    # or a dict {path: Sharding}
    m = kimi.load_checkpoint(d, mesh=mesh, shardings={emb_path: row})
    assert m.model.embed_tokens.embedding[...].sharding.spec == row.spec
    assert state_bytes(m) == ref


def test_one_error_lists_every_problem(random_ckpt, tmp_path):
    _, tensors = random_ckpt
    bad = dict(tensors)
    del bad["model.norm.weight"]  # missing
    bad["model.layers.0.self_attn.q_projection.weight"] = bad.pop("model.layers.0.self_attn.q_proj.weight")  # renamed
    gate = "model.layers.1.block_sparse_moe.gate.weight"
    bad[gate] = np.zeros((CFG.num_experts, CFG.hidden_size + 1), np.float32)  # wrong shape
    bad["model.layers.0.self_attn.dt_bias"] = bad["model.layers.0.self_attn.dt_bias"].astype(np.int32)  # wrong type
    write_random_checkpoint(tmp_path / "bad", CFG, tensors=bad)
    with pytest.raises(ValueError) as ei:
        kimi.load_checkpoint(tmp_path / "bad")
    msg = str(ei.value)
    assert "5 problem(s): 2 missing, 1 unexpected, 1 mis-shaped, 1 mis-typed" in msg
    assert "missing: model.norm.weight: expected [64] F16|BF16|F32|F64" in msg
    assert "missing: model.layers.0.self_attn.q_proj.weight: expected [64,64]" in msg
    assert "unexpected: model.layers.0.self_attn.q_projection.weight: [64,64] F32" in msg
    assert f"mis-shaped: {gate}: expected [8,64], found [8,65]" in msg
    assert "mis-typed: model.layers.0.self_attn.dt_bias: expected F16|BF16|F32|F64, found I32" in msg
    assert len(msg.splitlines()) == 6  # the summary line + one line per problem


def test_truncated_or_corrupt_file_is_named(random_ckpt, tmp_path):
    d, tensors = random_ckpt
    with open(d / "model.safetensors", "rb") as f:
        data = f.read()
    for name, blob in [("trunc", data[:-100]), ("garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!...")]:
        write_random_checkpoint(tmp_path / name, CFG, tensors={"x": np.zeros(1, np.float32)})
        with open(tmp_path / name / "model.safetensors", "wb") as f:
            f.write(blob)
        with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
            kimi.load_checkpoint(tmp_path / name)
    # a shard named by the index but missing on disk
    m = kimi.load_checkpoint(d)
    kimi.save_checkpoint(m, tmp_path / "sh", max_shard_bytes=64 * 1024)
    os.remove(tmp_path / "sh" / "model-00002-of-{:05d}.safetensors".format(
        len([f for f in os.listdir(tmp_path / "sh") if f.endswith(".safetensors")])))
    with pytest.raises(ValueError, match=r"model-00002-of-\d+\.safetensors"):
        kimi.load_checkpoint(tmp_path / "sh")
    with pytest.raises(ValueError, match="config.json not found"):
        kimi.load_checkpoint(tmp_path / "sh" / "..")


@pytest.mark.parametrize("broken,said", [(b'{"vocab_size": ', "not valid JSON (Expecting value at line 1, column 16)"),
                                         (b"[1, 2]", "expected a JSON object, found an array"),
                                         (b"\xff{}", "not UTF-8 text")])
def test_a_broken_json_file_is_named(random_ckpt, tmp_path, broken, said):
    """config.json, tokenizer.json and tokenizer_config.json: ValueError naming the file and what is wrong."""
    import shutil

    d, _ = random_ckpt
    shipped = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "default", "target")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        case = tmp_path / name
        shutil.copytree(d, case)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(shipped, f), case / f)
        (case / name).write_bytes(broken)
        load = kimi.load_checkpoint if name == "config.json" else kimi.load_tokenizer
        with pytest.raises(ValueError) as e:
            load(case)
        assert str(e.value).startswith(f"{case / name}: ") and said in str(e.value)


def test_save_replaces_atomically(random_ckpt, tmp_path, monkeypatch):
    d, _ = random_ckpt
    m = kimi.load_checkpoint(d)
    out = tmp_path / "out"
    kimi.save_checkpoint(m, out, max_shard_bytes=64 * 1024)
    (out / "tokenizer.json").write_text("{}")
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod.st, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        kimi.save_checkpoint(m, out)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # untouched
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left behind
    monkeypatch.undo()
    kimi.save_checkpoint(m, out)  # single file now: stale shards and index go, the tokenizer stays
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert state_bytes(kimi.load_checkpoint(out)) == state_bytes(m)


def test_config_overrides_and_bad_arguments(random_ckpt, tmp_path):
    d, _ = random_ckpt
    m = kimi.load_checkpoint(d, config_overrides={"kda_chunk_size": 4})
    assert m.config.kda_chunk_size == 4 and m.config.hidden_size == CFG.hidden_size
    with pytest.raises(ValueError, match="not a directory"):
        kimi.load_checkpoint(d / "model.safetensors")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        kimi.save_checkpoint(m, tmp_path / "x", max_shard_bytes=0)
    with safe_open(d / "model.safetensors", "np") as f:  # what we wrote is readable by safetensors itself
        assert f.metadata() == {"format": "pt"}
