"""kimi.vision / kimi.image vs transformers' Kimi K2.5 vision path (fp32, CPU, tiny random config).

* The tower + projector: ``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection`` with random weights, written by
  ``save_pretrained`` and loaded here by name (``kimi.vision_checkpoint.load_vision``); two images of different
  grids packed in one sequence, and a 4-frame video clip.
* Preprocessing and placeholder expansion: ``Kimi_K25ImageProcessor`` and ``Kimi_K25Processor`` run in a
  subprocess, and ``Kimi_K25VideoProcessor`` on a 10-frame video. They are written against torchvision, whose PyPI
  wheel does not load beside the CPU torch wheel (requirements/test.txt), so the subprocess puts a stand-in
  ``torchvision`` first on its path with the five functions they call, each doing what torchvision 0.28's does on
  the CPU for these inputs (``grayscale_to_rgb`` leaves a 3-channel frame as it is): ``resize`` of a
  uint8 image with BICUBIC is ``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` on the uint8
  tensor itself (torchvision's native-uint8 CPU path), ``pad`` is a constant pad, ``normalize`` is sub_/div_,
  ``pil_to_tensor`` is the HWC -> CHW array. The resampling arithmetic is torch's, the rest is transformers'.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch  # noqa: E402  (a missing parity dependency fails the run: tests/conftest.py)
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

from kimi import image as image_lib  # noqa: E402
from kimi.vision import encode  # noqa: E402
from kimi.vision_checkpoint import load_vision  # noqa: E402
from kimi.vision_config import VisionConfig  # noqa: E402

TOL = 1e-4
VISION = dict(patch_size=4, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=16, intermediate_size=24,
              rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
TEXT = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
            num_experts_per_tok=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=16)
    hf = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the init leaves norms at 1 / 0 and biases at 0: perturb every vision weight
        for name, p in hf.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("k25") / "ckpt"
    hf.save_pretrained(d)
    tower, projector = load_vision(d)
    return hf, tower, projector, d


def _reference(hf, pixels, grid):
    with torch.no_grad():
        out = hf.model.vision_tower(torch.from_numpy(pixels), grid_thw=torch.tensor(grid))
        feats = hf.model.mm_projector(out.pooler_output).squeeze(1)
    return out.last_hidden_state.numpy(), feats.numpy()


@pytest.mark.parametrize("grid", [[[1, 4, 6], [1, 8, 4]], [[4, 4, 4]]], ids=["two_images", "video_4_frames"])
def test_tower_and_projector_match_transformers(pair, grid):
    """Positions interpolate from the 6 x 6 table down (4) and up (8); the video adds the time rows and pools
    its 4 frames; the packed images must not attend across each other (segment ids)."""
    hf, tower, projector, _ = pair
    N = sum(t * h * w for t, h, w in grid)
    pixels = np.random.default_rng(1).standard_normal((N, 3, 4, 4)).astype(np.float32)
    want_hidden, want = _reference(hf, pixels, grid)
    hidden = np.asarray(tower.hidden_states(pixels.reshape(N, -1), tuple(map(tuple, grid))))
    got = np.asarray(encode(tower, projector, pixels, grid))
    err_h, err = np.abs(hidden - want_hidden).max(), np.abs(got - want).max()
    print(f"grid {grid}: tower max abs {err_h:.2e}, projector max abs {err:.2e}")
    assert got.shape == want.shape == (sum(h * w // 4 for _, h, w in grid), 32)
    assert err_h <= TOL and err <= TOL


def test_packing_keeps_images_apart(pair):
    """Each image's features are those it gets alone: attention never crosses the segment boundary."""
    _, tower, projector, _ = pair
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((24, 48)).astype(np.float32), rng.standard_normal((32, 48)).astype(np.float32)
    both = np.asarray(encode(tower, projector, np.concatenate([a, b]), [[1, 4, 6], [1, 8, 4]]))
    alone = np.concatenate([np.asarray(encode(tower, projector, a, [[1, 4, 6]])),
                            np.asarray(encode(tower, projector, b, [[1, 8, 4]]))])
    assert np.abs(both - alone).max() <= 1e-5


# ------------------------------------------------------------------ preprocessing and the processor
_STAND_IN = {
    "torchvision/__init__.py": '__version__ = "0.28.0"\nfrom torchvision import io, transforms  # noqa\n',
    "torchvision/io.py": "class ImageReadMode:\n    RGB = 'RGB'\n\n\ndef decode_image(*a, **k):\n"
                         "    raise NotImplementedError('not needed by these tests')\n",
    "torchvision/transforms/__init__.py": "from torchvision.transforms._mode import InterpolationMode  # noqa\n"
                                          "from torchvision.transforms import functional, v2  # noqa\n",
    "torchvision/transforms/_mode.py": textwrap.dedent("""\
        import enum
        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            NEAREST_EXACT = "nearest-exact"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"
            BOX = "box"
            HAMMING = "hamming"
            LANCZOS = "lanczos"
        """),
    "torchvision/transforms/functional.py": textwrap.dedent("""\
        import numpy as np
        import torch
        from torchvision.transforms._mode import InterpolationMode  # noqa
        def pil_to_tensor(pic):
            a = np.asarray(pic)
            a = a[:, :, None] if a.ndim == 2 else a
            return torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous()
        """),
    "torchvision/transforms/v2/__init__.py": "from torchvision.transforms.v2 import functional  # noqa\n",
    "torchvision/transforms/v2/functional.py": textwrap.dedent("""\
        import torch
        from torchvision.transforms._mode import InterpolationMode  # noqa
        from torchvision.transforms.functional import pil_to_tensor  # noqa
        def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
            if interpolation != InterpolationMode.BICUBIC or image.dtype != torch.uint8:
                raise NotImplementedError((interpolation, image.dtype))  # only what the Kimi processor asks
            if tuple(size) == tuple(image.shape[-2:]):
                return image
            x = image.reshape(-1, *image.shape[-3:])
            x = torch.nn.functional.interpolate(x, size=list(size), mode="bicubic", align_corners=False,
                                                antialias=antialias)
            return x.reshape(*image.shape[:-2], *x.shape[-2:])
        def pad(image, padding, fill=0, padding_mode="constant"):
            left, top, right, bottom = padding
            return torch.nn.functional.pad(image, (left, right, top, bottom), mode=padding_mode, value=fill)
        def grayscale_to_rgb(image):
            return image if image.shape[-3] >= 3 else torch.cat([image] * 3, dim=-3)
        def normalize(tensor, mean, std, inplace=False):
            t = tensor if inplace else tensor.clone()
            return t.sub_(torch.as_tensor(mean, dtype=t.dtype).view(-1, 1, 1)).div_(
                torch.as_tensor(std, dtype=t.dtype).view(-1, 1, 1))
        """),
}

SIZES = [(37, 53), (90, 61), (120, 200), (28, 28), (15, 300)]
PROMPT = "a <|media_pad|> b c <|media_pad|> d <|media_pad|> e <|media_pad|> <|media_pad|>"
VOCAB = ["[UNK]", "a", "b", "c", "d", "e", "<|media_pad|>", "<|kimi_k25_video_placeholder|>"]
PROC_KW = dict(patch_size=4, merge_size=2, max_patches=256, size={"max_height": 20, "max_width": 20})

_RUNNER = textwrap.dedent("""\
    import json, sys
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor
    args = json.loads(sys.argv[1])
    imgs = [Image.fromarray(np.load(f)) for f in args["images"]]
    ip = Kimi_K25ImageProcessor(**args["kw"])
    out = ip(imgs, return_tensors="np")
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(args["vocab"])}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<|media_pad|>", "<|kimi_k25_video_placeholder|>"]})
    proc = Kimi_K25Processor(image_processor=ip, tokenizer=tok, video_processor=Kimi_K25VideoProcessor())
    ids = proc(text=[args["prompt"]], images=imgs, return_tensors="np")["input_ids"][0]
    vp = Kimi_K25VideoProcessor(**args["video_kw"])
    vo = vp(videos=[np.load(args["video"])], do_sample_frames=False, return_tensors="np")
    np.savez(args["out"], pixel_values=out["pixel_values"], grid=out["image_grid_thw"], ids=ids,
             plain=np.asarray(tok(args["prompt"])["input_ids"]), video_pixels=vo["pixel_values_videos"],
             video_grid=vo["video_grid_thw"], video_chunks=np.asarray(vo["num_chunks_per_video"]))
    """)
VIDEO_KW = dict(patch_size=4, merge_size=2, max_patches=64, temporal_patch_size=4,
                size={"max_height": 20, "max_width": 20})
VIDEO_SHAPE = (10, 45, 70, 3)  # 10 frames: chunks of 4, 4 and 2; downscaled by the 64-patch budget


@pytest.fixture(scope="module")
def processor_outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    for rel, text in _STAND_IN.items():
        os.makedirs(os.path.dirname(d / rel), exist_ok=True)
        (d / rel).write_text(text)
    rng = np.random.default_rng(3)
    images = []
    for i, (H, W) in enumerate(SIZES):
        yy, xx = np.mgrid[0:H, 0:W]
        smooth = (127 + 100 * np.sin(xx / 5.0 + i)[..., None] * np.cos(yy / 7.0)[..., None]).astype(np.int64)
        img = np.clip(smooth + rng.integers(-20, 21, (H, W, 3)), 0, 255).astype(np.uint8)
        images.append(img)
        np.save(d / f"img{i}.npy", img)
    video = rng.integers(0, 256, VIDEO_SHAPE, dtype=np.uint8)
    np.save(d / "video.npy", video)
    out = d / "out.npz"
    args = dict(images=[str(d / f"img{i}.npy") for i in range(len(SIZES))], kw=PROC_KW, prompt=PROMPT, vocab=VOCAB,
                out=str(out), video=str(d / "video.npy"), video_kw=VIDEO_KW)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d)] + sys.path))
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return images, dict(np.load(out), video=video)


def test_preprocessing_equals_the_image_processor(processor_outputs):
    """Same grid and bit-identical pixel values: downscaled (navit budget), kept, padded, long and thin."""
    images, ref = processor_outputs
    vcfg = VisionConfig(patch_size=4)
    vin = image_lib.preprocess(images, vcfg, max_patches=PROC_KW["max_patches"], max_side=20)
    assert vin.grid_thw.tolist() == ref["grid"].tolist()
    assert vin.pixel_values.dtype == ref["pixel_values"].dtype == np.float32
    assert np.array_equal(vin.pixel_values, ref["pixel_values"])


def test_placeholder_expansion_equals_the_processor(processor_outputs):
    images, ref = processor_outputs
    vcfg = VisionConfig(patch_size=4, media_placeholder_token_id=VOCAB.index("<|media_pad|>"))
    vin = image_lib.preprocess(images, vcfg, max_patches=PROC_KW["max_patches"], max_side=20)
    ours = image_lib.expand_placeholders(ref["plain"].tolist(), vin.grid_thw, vcfg)
    assert ours == ref["ids"].tolist()
    assert ours.count(vcfg.media_placeholder_token_id) == sum(h * w // 4 for _, h, w in vin.grid_thw.tolist())


def test_video_preprocessing_equals_the_video_processor(processor_outputs):
    """Kimi_K25VideoProcessor (frame sampling off): the video cut into clips of temporal_patch_size frames, every
    frame resized and padded as an image, patches clip by clip; same grids, bit-identical pixel values."""
    _, ref = processor_outputs
    vcfg = VisionConfig(patch_size=4)
    vin = image_lib.preprocess_video(list(ref["video"]), vcfg, max_patches=VIDEO_KW["max_patches"], max_side=20,
                                     temporal_patch_size=VIDEO_KW["temporal_patch_size"])
    assert ref["video_chunks"].tolist() == [3] and [t for t, _, _ in vin.grid_thw.tolist()] == [4, 4, 2]
    assert vin.grid_thw.tolist() == ref["video_grid"].tolist()
    assert np.array_equal(vin.pixel_values, ref["video_pixels"].reshape(vin.pixel_values.shape))
