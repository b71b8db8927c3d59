"""The vision path inside kimi: K3's MoonViT3d variant against a reference written here from the published
description, images merged at their placeholders in prefill and through jdspark.generate (lossless with a
drafter), checkpoints by name, kimi.info, and the errors for bad input."""
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

import jdspark
import kimi
from kimi import image as image_lib
from kimi.vision import MoonViT, Projector, encode
from kimi.vision_config import VisionConfig
from tests.oracle_drafter import assert_histogram, oracle_drafter

# K3-shaped and tiny: RMSNorm, qkv width 24 != hidden 16 (2 heads of 12), no patch-embed bias, bilinear table
K3_TINY = VisionConfig.k3(patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          qkv_hidden_size=24, intermediate_size=32, pos_emb_height=6, pos_emb_width=6)
PLACEHOLDER = 500


def _randomise(module, seed: int):
    """Every parameter drawn N(0, 0.3^2) (norm gains around 1), so no weight sits at its neutral init."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        v = var.get_value()
        x = 0.3 * rng.standard_normal(v.shape)
        var.set_value(np.asarray(x + (1.0 if "norm" in str(path[-2]) and path[-1] == "weight" else 0.0), v.dtype))


# ------------------------------------------------------------------ the K3 variant vs a reference from the description
def _reference_k3(tower, projector, images_CHW, vcfg: VisionConfig):
    """MoonViT3d from its description, one image at a time (no packing), in torch: Conv2d patch embedding
    without bias; the 2D table resized with F.interpolate(bilinear); blocks x += wo(attn(rms(x))),
    x += fc1(gelu_tanh(fc0(rms(x)))) with 2D RoPE as complex rotations of adjacent channel pairs (x-, y-frequency
    pairs interleaved, theta 10000); final RMSNorm; 2x2 groups concatenated; Linear -> GELU -> Linear ->
    RMSNorm(text)."""
    st = {".".join(map(str, p)): torch.from_numpy(np.asarray(v.get_value())) for p, v in
          nnx.to_flat_state(nnx.state(tower))}
    pj = {".".join(map(str, p)): torch.from_numpy(np.asarray(v.get_value())) for p, v in
          nnx.to_flat_state(nnx.state(projector))}
    p, D, H = vcfg.patch_size, vcfg.hidden_size, vcfg.num_attention_heads
    hd = vcfg.qkv_dim // H

    def rms(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    outs = []
    for img in images_CHW:
        x = torch.from_numpy(img)[None]
        conv_w = st["patch_embed.proj.kernel"].T.reshape(D, 3, p, p)
        x = F.conv2d(x, conv_w, stride=p)[0]  # [D, h, w]
        h, w = x.shape[1:]
        table = st["patch_embed.pos_emb.weight"].permute(2, 0, 1)[None]  # [1, D, H, W]
        pos = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)[0]
        x = (x + pos).permute(1, 2, 0).reshape(h * w, D)
        freqs = 1.0 / (vcfg.rope_theta ** (torch.arange(0, hd, 4)[: hd // 4].float() / hd))
        ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        ang = torch.stack([torch.outer(xs.reshape(-1), freqs), torch.outer(ys.reshape(-1), freqs)], -1)
        cis = torch.polar(torch.ones_like(ang), ang).reshape(h * w, hd // 2)  # [N, hd/2] complex

        def rope(t):
            c = torch.view_as_complex(t.reshape(h * w, H, hd // 2, 2).contiguous())
            return torch.view_as_real(c * cis[:, None, :]).reshape(h * w, H, hd)

        for i in range(vcfg.num_hidden_layers):
            b = f"encoder.blocks.{i}."
            y = rms(x, st[b + "norm0.weight"], vcfg.norm_eps)
            qkv = y @ st[b + "wqkv.kernel"] + st[b + "wqkv.bias"]
            q, k, v = (t.reshape(h * w, H, hd) for t in qkv.split(vcfg.qkv_dim, -1))
            q, k = rope(q), rope(k)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            x = x + a.transpose(0, 1).reshape(h * w, -1) @ st[b + "wo.kernel"] + st[b + "wo.bias"]
            y = rms(x, st[b + "norm1.weight"], vcfg.norm_eps)
            y = F.gelu(y @ st[b + "mlp.fc0.kernel"] + st[b + "mlp.fc0.bias"], approximate="tanh")
            x = x + y @ st[b + "mlp.fc1.kernel"] + st[b + "mlp.fc1.bias"]
        x = rms(x, st["encoder.final_layernorm.weight"], vcfg.norm_eps)
        groups = x.reshape(h // 2, 2, w // 2, 2, D).permute(0, 2, 1, 3, 4).reshape(-1, 4 * D)
        y = F.gelu(groups @ pj["proj0.kernel"]) @ pj["proj2.kernel"]
        outs.append(rms(y, pj["post_norm.weight"], vcfg.projector_eps))
    return torch.cat(outs).numpy()


def test_clip_attention_equals_the_packed_masked_reference():
    """The tower attends clip by clip; the packed form (all patches, -inf across clips) is the reference. Three
    clips of different sizes, one a 2-frame video: a wrong offset or a clip attending past its end changes rows."""
    import jax

    from kimi.vision import clip_attention, segment_attention, segment_ids_N
    grid = ((1, 2, 3), (2, 2, 2), (1, 4, 1))
    N = sum(t * h * w for t, h, w in grid)
    q, k, v = (jax.random.normal(jax.random.key(i), (N, 2, 8)) for i in range(3))
    want = np.asarray(segment_attention(q, k, v, jax.numpy.asarray(segment_ids_N(grid))))
    got = np.asarray(clip_attention(q, k, v, grid))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    merged = np.asarray(clip_attention(q, k, v, ((1, 2, 3), (1, 4, 3))))  # clips 2 and 3 as one: differs
    assert np.abs(merged[6:] - want[6:]).max() > 1e-3


def test_k3_variant_matches_a_reference_from_the_description():
    vcfg = K3_TINY
    tower, projector = MoonViT(vcfg, rngs=nnx.Rngs(0)), Projector(vcfg, 20, rngs=nnx.Rngs(1))
    _randomise(tower, 0)
    _randomise(projector, 1)
    assert tower.patch_embed.proj.bias is None and not hasattr(projector, "pre_norm")
    assert projector.proj0.bias is None and projector.proj2.bias is None
    rng = np.random.default_rng(0)
    imgs = [rng.standard_normal((3, 16, 24)).astype(np.float32), rng.standard_normal((3, 32, 8)).astype(np.float32)]
    grid = [(1, 4, 6), (1, 8, 2)]
    patches = np.concatenate([im.reshape(3, h, 4, w, 4).transpose(1, 3, 0, 2, 4).reshape(h * w, 48)
                              for im, (_, h, w) in zip(imgs, grid)])
    got = np.asarray(encode(tower, projector, patches, grid))
    want = _reference_k3(tower, projector, imgs, vcfg)
    err = np.abs(got - want).max()
    print(f"K3 MoonViT3d vs reference: max abs {err:.2e}")
    assert got.shape == (6 + 4, 20) and err <= 1e-4


def test_k3_switches_coincide_with_the_k25_path():
    """Where the K3 variant and the K2.5 path (checked against transformers in tests/parity) compute the same
    function they give the same numbers: a K3 tower (no patch-embed bias, bilinear position table) with the norm
    and q|k|v width set to K2.5's equals the K2.5 tower with a zero patch bias on grids of the table's own size
    (no interpolation, so bilinear = bicubic), one of them a 2-frame clip. On an interpolated grid the two
    tables differ, which the comparison sees. RMSNorm, the wider q|k|v and PatchMergerMLPV2, where the variants
    differ, are checked by the reference from the description above."""
    import dataclasses

    import jax.numpy as jnp
    k25 = VisionConfig(patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, pos_emb_height=6, pos_emb_width=6)
    k3ish = dataclasses.replace(K3_TINY, norm="layernorm", qkv_hidden_size=None)
    assert not k3ish.patch_embed_bias and k3ish.pos_emb_interpolation == "bilinear"
    a, b = MoonViT(k25, rngs=nnx.Rngs(0)), MoonViT(k3ish, rngs=nnx.Rngs(1))
    _randomise(a, 5)
    a.patch_embed.proj.bias.set_value(jnp.zeros_like(a.patch_embed.proj.bias.get_value()))
    src = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(a, nnx.Param))}
    for p, v in nnx.to_flat_state(nnx.state(b, nnx.Param)):
        v.set_value(src[p])
    rng = np.random.default_rng(5)
    for grid, same in ((((1, 6, 6), (2, 6, 6)), True), (((1, 4, 6),), False)):
        patches = rng.standard_normal((sum(t * h * w for t, h, w in grid), 48)).astype(np.float32)
        ya, yb = (np.asarray(m.hidden_states(jnp.asarray(patches), grid)) for m in (a, b))
        err = np.abs(ya - yb).max()
        assert (err <= 1e-5) if same else (err > 1e-3), (grid, err)


def test_k3_preset_shapes():
    v = kimi.KimiConfig.k3().vision
    assert (v.hidden_size, v.num_attention_heads, v.qkv_dim, v.head_dim, v.intermediate_size) == (1024, 12, 1536,
                                                                                                   128, 4096)
    assert (v.norm, v.projector, v.patch_embed_bias, v.pos_emb_interpolation, v.merged_dim) == \
        ("rmsnorm", "patchmerger_v2", False, "bilinear", 4096)
    assert v.media_placeholder_token_id == 163605 and kimi.KimiConfig.tiny().vision is None


def test_info_reports_vision_params(capsys):
    """``python -m kimi.info --preset k3 --json``, through its ``main`` in this process."""
    import kimi.info

    assert kimi.info.main(["--preset", "k3", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(out)
    per_block = (1024 * 4608 + 4608) + (1536 * 1024 + 1024) + (1024 * 4096 + 4096) + (4096 * 1024 + 1024) + 2 * 1024
    want = 27 * per_block + 588 * 1024 + 64 * 64 * 1024 + 1024 + 4096 * 4096 + 4096 * 7168 + 7168
    assert d["vision_params"] == want == d["by_part"]["vision"]
    assert d["total_params"] == d["text_params"] + d["vision_params"]


# ------------------------------------------------------------------ the merge into the target
@pytest.fixture(scope="module")
def vlm():
    vcfg = VisionConfig(patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, pos_emb_height=6, pos_emb_width=6, media_placeholder_token_id=PLACEHOLDER)
    cfg = kimi.KimiConfig.tiny(vision=vcfg)
    model = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0))
    _randomise(model.vision_tower, 2)
    _randomise(model.mm_projector, 3)
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 256, (16, 20, 3), dtype=np.uint8), rng.integers(0, 256, (9, 17, 3), dtype=np.uint8)]
    vin = image_lib.preprocess(images, vcfg)
    prompt = image_lib.expand_placeholders([1, 7, PLACEHOLDER, 9, 11, PLACEHOLDER, 13], vin.grid_thw, vcfg)
    return model, vin, np.asarray(prompt, np.int32)


def test_prefill_merges_features_at_placeholders(vlm):
    model, vin, prompt = vlm
    assert vin.grid_thw.tolist() == [[1, 4, 6], [1, 4, 6]]  # 16 x 20 pads to 16 x 24; 9 x 17 to 16 x 24
    T = len(prompt)
    first = int(np.argmax(prompt == PLACEHOLDER))
    with_img = model.prefill(prompt[None], model.init_cache(1, 64), images=vin).logits
    other = image_lib.VisionInput(vin.pixel_values[::-1].copy(), vin.grid_thw)
    with_other = model.prefill(prompt[None], model.init_cache(1, 64), images=other).logits
    plain = model.prefill(prompt[None], model.init_cache(1, 64)).logits
    d_other = np.abs(np.asarray(with_img) - np.asarray(with_other)).max(-1)[0]
    assert np.all(d_other[:first] == 0) and np.all(d_other[first:] > 1e-6), d_other  # causal, and the image counts
    assert np.abs(np.asarray(with_img) - np.asarray(plain)).max() > 1e-4
    feats = np.asarray(model.image_features(prompt, vin))
    x = np.array(model.model.embed_tokens(prompt))
    x[prompt == PLACEHOLDER] = feats
    assert feats.shape == (12, model.config.hidden_size) and T == 5 + 12
    merged = kimi.vision.merge_media(np.asarray(model.model.embed_tokens(prompt))[None], prompt[None], feats,
                                     PLACEHOLDER)
    assert np.array_equal(np.asarray(merged)[0], x)


def test_generate_with_image_is_lossless_with_a_drafter(vlm):
    model, vin, prompt = vlm
    N, G = 20, 4
    plain = jdspark.generate(model, None, prompt, max_new_tokens=N + G + 1, eos_token_id=-1, images=vin)
    drafter, want = oracle_drafter(model, prompt, plain.tokens, N, block_size=G, seed=0)
    out = jdspark.generate(model, drafter, prompt, max_new_tokens=N, eos_token_id=-1, images=vin)
    assert out.tokens.tolist() == plain.tokens[:N].tolist()
    assert_histogram(out.stats, want)  # every accepted length 0..G occurred, exactly as scheduled


def test_checkpoint_round_trip_by_official_names(vlm, tmp_path):
    model, vin, prompt = vlm
    d = kimi.save_checkpoint(model, tmp_path / "vlm")
    names = kimi.checkpoint.checkpoint_names(model.config)
    assert names["vision_tower.patch_embed.proj.weight"][0] == (16, 3, 4, 4)
    assert names["vision_tower.encoder.blocks.0.wqkv.weight"][0] == (48, 16)
    assert {"mm_projector.proj.0.weight", "mm_projector.proj.2.bias", "mm_projector.pre_norm.weight",
            "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.final_layernorm.bias"} <= set(names)
    back = kimi.load_checkpoint(d)
    assert back.config.vision == model.config.vision
    a = np.asarray(encode(model.vision_tower, model.mm_projector, vin.pixel_values, vin.grid_thw))
    b = np.asarray(encode(back.vision_tower, back.mm_projector, vin.pixel_values, vin.grid_thw))
    assert np.array_equal(a, b)


# ------------------------------------------------------------------ bad input
def test_bad_input_is_a_clear_error(vlm):
    model, vin, prompt = vlm
    vcfg = model.config.vision
    with pytest.raises(ValueError, match="smaller than one 4 x 4 patch"):
        image_lib.preprocess(np.zeros((3, 30, 3), np.uint8), vcfg)
    with pytest.raises(ValueError, match="4 channels, the vision tower takes 3"):
        image_lib.preprocess(np.zeros((16, 16, 4), np.uint8), vcfg)
    with pytest.raises(ValueError, match="1 channels, the vision tower takes 3"):
        encode(model.vision_tower, model.mm_projector, np.zeros((24, 1, 4, 4), np.float32), [[1, 4, 6]])
    with pytest.raises(ValueError, match="holds 13 placeholder tokens .* give 12 features"):
        model.prefill(np.append(prompt, PLACEHOLDER)[None], model.init_cache(1, 64), images=vin)
    with pytest.raises(ValueError, match="1 placeholder tokens .* for 2 images"):
        image_lib.expand_placeholders([1, PLACEHOLDER, 2], vin.grid_thw, vcfg)
    with pytest.raises(ValueError, match="describes 48"):
        encode(model.vision_tower, model.mm_projector, vin.pixel_values[:40], vin.grid_thw)
    text_only = kimi.KimiForCausalLM(kimi.KimiConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="text-only"):
        text_only.prefill(prompt[None], text_only.init_cache(1, 64), images=vin)
    with pytest.raises(ValueError, match="text-only"):
        jdspark.generate(text_only, None, prompt, max_new_tokens=2, images=vin)


def test_generate_script_image_prompt(vlm, tmp_path):
    """scripts/generate.py --image: PNG files read, one placeholder per image after BOS expanded to the image's
    merged patches (the count prefill checks); a text-only checkpoint is refused by name."""
    import os

    from PIL import Image

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    import generate as gen

    model, vin, _ = vlm
    rng = np.random.default_rng(4)
    paths = []
    for i, shape in enumerate([(16, 20, 3), (9, 17, 3)]):
        paths.append(str(tmp_path / f"im{i}.png"))
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(paths[-1])
    ids, got = gen.with_images(np.array([1, 7, 9]), paths, model.config, "vlm")
    np.testing.assert_array_equal(got.pixel_values, vin.pixel_values)  # PNG is lossless: the fixture's images
    ph = model.config.vision.media_placeholder_token_id
    assert ids[0] == 1 and list(ids[-2:]) == [7, 9] and (ids == ph).sum() == 12
    model.image_features(ids, got)  # the placeholder count matches the features
    with pytest.raises(SystemExit, match="text-only"):
        gen.with_images(np.array([1, 7]), paths, kimi.KimiConfig.tiny(), "ck")
