"""Images through serving (issue 19): chat ``image_url`` parts parsed into expanded placeholders and preprocessed
images, and the slots engine prefilling an image prompt beside a text one, each row token for token equal to
``jdspark.generate`` of its own prompt, with drafts both accepted and rejected."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

import jdspark
from jdspark.engine import SamplingRequest
from jdspark.serve_request import ApiError, parse_completion
from jdspark.slots import SlotBackend
from kimi import image as image_lib
from kimi.tokenizer import ByteTokenizer
from tests.kimi.test_vision import PLACEHOLDER, vlm  # noqa: F401 (the fixture)
from tests.oracle_drafter import oracle_drafter


def _png_uri(img: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(parts):
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4, "temperature": 0}


def _parse(body, vision):
    return parse_completion(body, tokenizer=ByteTokenizer(), vocab_size=384, max_context=4096, model_name="m",
                            chat=True, vision=vision)


def test_chat_image_parts_become_expanded_placeholders(vlm):  # noqa: F811
    model, _, _ = vlm
    vcfg = model.config.vision
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8), rng.integers(0, 256, (9, 17, 3), dtype=np.uint8)
    req = _parse(_chat([{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": _png_uri(a)}},
                        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": _png_uri(b)}},
                        {"type": "text", "text": "?"}]), vcfg)[0]
    want = image_lib.preprocess([a, b], vcfg)
    np.testing.assert_array_equal(req.images.pixel_values, want.pixel_values)  # PNG is lossless
    assert req.images.grid_thw.tolist() == want.grid_thw.tolist()
    ids = np.asarray(req.prompt_ids)
    runs = np.flatnonzero(np.diff(np.r_[0, (ids == PLACEHOLDER).astype(int), 0]))  # [start, end) of each run
    assert (runs[1::2] - runs[::2]).tolist() == [6, 6]  # one run per image, (4/2) x (6/2) merged patches each
    tok = ByteTokenizer()
    assert tok.decode(ids[runs[1]:runs[2]].tolist()) == " and "  # the text between the images, in place
    assert tok.decode(ids[:runs[0]].tolist()).endswith("see ") and tok.decode(ids[runs[3]:].tolist()).startswith("?")


@pytest.mark.parametrize("url, vision, match", [
    ("data:image/png;base64,AA==", False, "text-only"),
    ("https://example.com/cat.png", True, "fetches nothing from the network"),
    ("data:image/png;base64,@@@", True, "does not decode"),
    ("data:image/png;base64,AAAA", True, "not a readable image"),
    ("data:text/plain;base64,AAAA", True, "expected data:image"),
    ("tiny", True, "smaller than one 4 x 4 patch"),
], ids=["text_only_checkpoint", "network_url", "bad_base64", "not_an_image", "not_image_mime", "too_small"])
def test_bad_image_parts_are_a_clear_400(vlm, url, vision, match):  # noqa: F811
    model, _, _ = vlm
    if url == "tiny":
        url = _png_uri(np.zeros((3, 30, 3), np.uint8))
    with pytest.raises(ApiError, match=match) as e:
        _parse(_chat([{"type": "image_url", "image_url": {"url": url}}]), model.config.vision if vision else None)
    assert e.value.status == 400 and e.value.param == "messages"


def test_slots_serve_an_image_prompt_beside_a_text_prompt(vlm):  # noqa: F811
    """Slot 1 prefills the image prompt (its features padded to the bucket), slot 0 the same ids as plain text;
    both step together in one batch. Each equals generate of its own prompt; the oracle drafter (scheduled on the
    image row's greedy output) makes the image row accept and reject drafts."""
    model, vin, prompt = vlm
    N, G = 12, 4
    plain_img = jdspark.generate(model, None, prompt, max_new_tokens=N + G + 1, eos_token_id=-1, images=vin)
    plain_txt = jdspark.generate(model, None, prompt, max_new_tokens=N, eos_token_id=-1)
    assert plain_img.tokens[:N].tolist() != plain_txt.tokens.tolist()  # the image changes the continuation
    drafter, _ = oracle_drafter(model, prompt, plain_img.tokens, N, block_size=G, seed=0)
    backend = SlotBackend(model, drafter, num_slots=2, max_len=64, prompt_buckets=(32,))
    assert backend.target is not model  # the serving copy steps; the loaded model encodes the images
    got = {0: backend.insert(0, SamplingRequest(tuple(prompt), N)).tokens,
           1: backend.insert(1, SamplingRequest(tuple(prompt), N, images=vin)).tokens}
    accepted = []
    while min(len(t) for t in got.values()) < N:
        for s, o in backend.step([0, 1]).items():
            got[s] += o.tokens
            if s == 1:
                accepted.append((o.drafted, o.accepted))
    assert got[1][:N] == plain_img.tokens[:N].tolist()
    assert got[0][:N] == plain_txt.tokens.tolist()
    assert any(0 < a < d for d, a in accepted[:-1]) and any(a == d for d, a in accepted[:-1]), accepted
