"""Image preprocessing for the MoonViT tower (NumPy): the arithmetic of transformers' ``Kimi_K25ImageProcessor``,
and the prompt's placeholder expansion.

Per image (RGB, uint8, H x W):
  1. size (navit): n_h = max(1, H // p), n_w = max(1, W // p);
       s = min(1, sqrt(max_patches / (n_h n_w)), max_side p / H, max_side p / W)      never upscale
       h' = min(max(1, int(H s)), max_side p),  w' likewise
     then pad h', w' up to multiples of merge * p (zeros, bottom and right).
  2. resize to h' x w': separable antialiased bicubic (Keys a = -0.5, support 2 x max(1, in/out)), the columns
     first, then the rows, each pass on uint8 with int16 fixed-point weights (what torch's CPU uint8 resize, and
     so the image processor, computes):
       w_j   = k((j + xmin - c + 1/2) / max(1, in/out)) / sum,   c = (i + 1/2) in/out
       q     = largest q < 22 with round(max_w 2^(q+1)) < 2^15;   w16_j = round(w_j 2^q)
       out_i = clip((2^(q-1) + sum_j w16_j x[xmin + j]) >> q, 0, 255)
  3. pixel = (x - 127.5) / 127.5 in fp32 (mean = std = 0.5, rescale 1/255, fused as the processor does).
  4. patchify: [n_h n_w, C, p, p] in row-major patch order; grid (1, n_h, n_w).
Frames of a video clip are resized alike and stacked: grid (t, n_h, n_w), patches frame after frame.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from kimi.vision_config import VisionConfig

__all__ = ["VisionInput", "preprocess", "preprocess_video", "navit_size", "resize_bicubic_uint8",
           "expand_placeholders", "image_array"]

MAX_PATCHES = 16384
MAX_SIDE = 512  # patches per side


@dataclasses.dataclass(frozen=True)
class VisionInput:
    pixel_values: np.ndarray  # [N, C, p, p] float32
    grid_thw: np.ndarray  # [n, 3] int64


def navit_size(H: int, W: int, patch: int, merge: int, max_patches: int = MAX_PATCHES,
               max_side: int = MAX_SIDE) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) of an H x W image; see step 1 of the module docstring."""
    n = max(1.0, H // patch) * max(1.0, W // patch)
    s = min(1.0, math.sqrt(max_patches / n), (max_side * patch) / H, (max_side * patch) / W)
    h = min(max(1, int(H * s)), max_side * patch)
    w = min(max(1, int(W * s)), max_side * patch)
    f = merge * patch
    return (h, w), (-(-h // f) * f, -(-w // f) * f)


def _keys_cubic(x):
    """Keys' cubic convolution kernel with a = -0.5 at |x|."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _aa_weights(n_in: int, n_out: int):
    """(xmin [n_out], w16 [n_out, taps] int64, q): the int16 fixed-point weights of one antialiased pass."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(n_out, dtype=np.float64) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xsize = np.clip(np.minimum((center + support + 0.5).astype(np.int64), n_in) - xmin, 0, taps)
    j = np.arange(taps)
    w = np.where(j[None, :] < xsize[:, None], _keys_cubic((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * inv),
                 0.0)
    total = w.sum(1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, 1.0), 0.0)
    wmax = w.max()
    q = 0
    while q < 22 and int(0.5 + wmax * (1 << (q + 1))) < (1 << 15):
        q += 1
    v = w * (1 << q)
    w16 = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v)).astype(np.int64)
    return xmin, w16, q


def _resize_axis(x_uint8: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """One antialiased bicubic pass along ``axis`` of a uint8 array (step 2 of the module docstring)."""
    n_in = x_uint8.shape[axis]
    xmin, w16, q = _aa_weights(n_in, n_out)
    idx = np.clip(xmin[:, None] + np.arange(w16.shape[1])[None, :], 0, n_in - 1)  # [n_out, taps]
    x = np.moveaxis(x_uint8, axis, -1).astype(np.int64)
    acc = (x[..., idx] * w16).sum(-1) + (1 << (q - 1))
    return np.moveaxis(np.clip(acc >> q, 0, 255).astype(np.uint8), -1, axis)


def resize_bicubic_uint8(img_CHW: np.ndarray, h: int, w: int) -> np.ndarray:
    """[C, h, w] uint8: antialiased bicubic resize, the width pass first, a pass skipped when its size is kept."""
    out = img_CHW
    if w != img_CHW.shape[2]:
        out = _resize_axis(out, w, 2)
    if h != img_CHW.shape[1]:
        out = _resize_axis(out, h, 1)
    return out


def image_array(image, channels: int = 3) -> np.ndarray:
    """[C, H, W] uint8 from a PIL image (converted to RGB) or an HWC uint8 array; ValueError otherwise."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image.Image
        image = np.asarray(image.convert("RGB"))
    a = np.asarray(image)
    if a.ndim != 3:
        raise ValueError(f"image: expected an H x W x C array (or a PIL image), got shape {a.shape}")
    if a.shape[2] != channels:
        raise ValueError(f"image: {a.shape[2]} channels, the vision tower takes {channels} (RGB); convert it first")
    if a.dtype != np.uint8:
        raise ValueError(f"image: expected uint8 pixels, got {a.dtype}")
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def _prepare(frames_CHW: Sequence[np.ndarray], vcfg: VisionConfig, max_patches: int, max_side: int):
    """[t, C, h, w] uint8 of resized + padded frames (all of one size)."""
    p, merge = vcfg.patch_size, vcfg.merge_kernel_size[0]
    C, H, W = frames_CHW[0].shape
    if H < p or W < p:
        raise ValueError(f"image: {H} x {W} pixels is smaller than one {p} x {p} patch")
    (h, w), (ph, pw) = navit_size(H, W, p, merge, max_patches, max_side)
    out = np.zeros((len(frames_CHW), C, ph, pw), np.uint8)
    for i, f in enumerate(frames_CHW):
        if f.shape != (C, H, W):
            raise ValueError(f"video: frame {i} is {f.shape[1:]} pixels, frame 0 is {(H, W)}")
        out[i, :, :h, :w] = resize_bicubic_uint8(f, h, w)
    return out


def _patchify(frames_tCHW: np.ndarray, p: int) -> np.ndarray:
    """[t * n_h * n_w, C, p, p] fp32 normalised patches, frame by frame, row-major inside a frame."""
    t, C, H, W = frames_tCHW.shape
    x = (frames_tCHW.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    x = x.reshape(t, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(t * (H // p) * (W // p), C, p, p))


def preprocess(images, vcfg: VisionConfig, max_patches: int = MAX_PATCHES, max_side: int = MAX_SIDE) -> VisionInput:
    """Images (PIL or HWC uint8; one or a list) -> VisionInput with one (1, h, w) grid row per image."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ValueError("images: expected at least one image")
    pixels, grids = [], []
    for im in images:
        frames = _prepare([image_array(im, vcfg.in_channels)], vcfg, max_patches, max_side)
        pixels.append(_patchify(frames, vcfg.patch_size))
        grids.append((1, frames.shape[2] // vcfg.patch_size, frames.shape[3] // vcfg.patch_size))
    return VisionInput(np.concatenate(pixels), np.asarray(grids, np.int64))


def preprocess_video(frames, vcfg: VisionConfig, max_patches: int = 4096, max_side: int = MAX_SIDE,
                     temporal_patch_size: Optional[int] = None) -> VisionInput:
    """A video (a sequence of PIL or HWC uint8 frames, all one size) -> VisionInput with one clip per chunk of
    ``temporal_patch_size`` consecutive frames (default ``pos_emb_time``; the last chunk may be shorter), each
    grid (t, h, w), as ``Kimi_K25VideoProcessor`` chunks a video (its frames resized and padded as an image's)."""
    tps = vcfg.pos_emb_time if temporal_patch_size is None else int(temporal_patch_size)
    if not 1 <= tps <= vcfg.pos_emb_time:
        raise ValueError(f"temporal_patch_size: {tps}; a clip holds 1..pos_emb_time={vcfg.pos_emb_time} frames")
    if not len(frames):
        raise ValueError("video: no frames")
    arr = _prepare([image_array(f, vcfg.in_channels) for f in frames], vcfg, max_patches, max_side)
    p = vcfg.patch_size
    chunks = [arr[i:i + tps] for i in range(0, len(arr), tps)]
    return VisionInput(np.concatenate([_patchify(c, p) for c in chunks]),
                       np.asarray([(len(c), arr.shape[2] // p, arr.shape[3] // p) for c in chunks], np.int64))


def expand_placeholders(ids: Sequence[int], grid_thw, vcfg: VisionConfig) -> list[int]:
    """The prompt with its k-th placeholder token repeated (h / kh)(w / kw) times for clip k's grid (t, h, w).
    ValueError unless the prompt holds one placeholder per clip."""
    tok = vcfg.media_placeholder_token_id
    grid = np.asarray(grid_thw).reshape(-1, 3)
    ids = [int(i) for i in ids]
    n = sum(i == tok for i in ids)
    if n != len(grid):
        raise ValueError(f"prompt: {n} placeholder tokens (id {tok}) for {len(grid)} images")
    kh, kw = vcfg.merge_kernel_size
    counts = iter(int(h) // kh * (int(w) // kw) for _, h, w in grid)
    out: list[int] = []
    for i in ids:
        out.extend([tok] * next(counts) if i == tok else [i])
    return out
