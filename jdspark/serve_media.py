"""Images in chat requests (issue 19): OpenAI-style ``image_url`` content parts with ``data:`` URIs, turned into
the prompt's expanded placeholder tokens and the preprocessed images the serving engine prefills with.

A message's content parts are joined in order; each image part leaves ``IMAGE_MARK`` (a private-use character)
where it stood, so the chat template renders the text around it unchanged. The rendered prompt is split at the
marks, each piece encoded, and one placeholder token (``VisionConfig.media_placeholder_token_id``) put between
pieces; ``kimi.image.expand_placeholders`` then repeats each one by its image's merged patch count. Images come
only inline (``data:image/...;base64,...``): the server fetches nothing from the network.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Optional

import numpy as np

IMAGE_MARK = "\U000f0000"  # plane-15 private use: never produced by a tokenizer's own text


class MediaError(ValueError):
    """Bad image input; ``param`` names the request field (the server answers 400)."""

    def __init__(self, message: str, param: str = "messages", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def decode_data_uri(url, where: str) -> np.ndarray:
    """[H, W, 3] uint8 RGB of an ``image_url`` part's ``data:image/<type>;base64,<payload>`` URI."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str):
        raise MediaError(f"{where}.image_url.url must be a string")
    if not url.startswith("data:"):
        raise MediaError(f"{where}.image_url.url: only inline data: URIs (data:image/png;base64,...) are accepted; "
                         "this server fetches nothing from the network", code="unsupported_content")
    header, sep, payload = url[5:].partition(",")
    mime = header.split(";")[0]
    if not sep or ";base64" not in header or (mime and not mime.startswith("image/")):
        raise MediaError(f"{where}.image_url.url: expected data:image/<type>;base64,<payload>, got a URI starting "
                         f"{url[:40]!r}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{where}.image_url.url: the base64 payload does not decode ({e})") from None
    try:
        with Image.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError) as e:
        raise MediaError(f"{where}.image_url.url: not a readable image ({e})") from None


def message_text(content, i: int, vision) -> tuple:
    """(text, [images]) of one message's content: a string, or content parts (``text`` parts joined in order,
    each ``image_url`` part an ``IMAGE_MARK`` in the text and an image in the list). ``vision``: the checkpoint's
    VisionConfig, or None for a text-only checkpoint (an image part is then an error naming that)."""
    if not isinstance(content, list):
        if isinstance(content, str) and IMAGE_MARK in content:
            raise MediaError(f"messages[{i}].content holds the reserved character U+F0000")
        return content, []
    out, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            if IMAGE_MARK in part["text"]:
                raise MediaError(f"{where}.text holds the reserved character U+F0000")
            out.append(part["text"])
        elif kind == "image_url":
            if vision is None:
                raise MediaError(f"{where}: this checkpoint is text-only (its config has no vision_config), so it "
                                 "takes no image input", code="unsupported_content")
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            images.append(decode_data_uri(url, where))
            out.append(IMAGE_MARK)
        elif kind in ("input_image", "image"):
            raise MediaError(f"{where}: images come as {{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}",
                             code="unsupported_content")
        else:
            raise MediaError(f"{where} must be {{'type': 'text', 'text': str}} or an image_url part")
    return "".join(out), images


def encode_with_images(tokenizer, rendered: str, images: list, vision) -> tuple:
    """(prompt ids with every image's placeholder expanded, ``kimi.image.VisionInput`` or None) of a rendered
    chat prompt holding one ``IMAGE_MARK`` per image, in order."""
    pieces = rendered.split(IMAGE_MARK)
    if len(pieces) - 1 != len(images):  # a template that drops or repeats message content
        raise MediaError(f"the chat template rendered {len(pieces) - 1} image positions for {len(images)} images")
    ids: list[int] = []
    for j, piece in enumerate(pieces):
        if j:
            ids.append(vision.media_placeholder_token_id)
        ids.extend(tokenizer.encode(piece, allow_special=True) if piece else [])
    if not images:
        return ids, None
    from kimi import image as image_lib

    try:
        vin = image_lib.preprocess(images, vision)
        return image_lib.expand_placeholders(ids, vin.grid_thw, vision), vin
    except ValueError as e:  # an image too small for a patch; the prompt's own text holding a placeholder token
        raise MediaError(f"image input: {e}") from None
