"""``jdspark.workloads.read_prompt_file``: an operator's own prompts for the benchmarks, encoded as the server encodes
a text prompt, with every malformed line refused by its number."""

import json

import pytest

from jdspark import workloads
from kimi.tokenizer import ByteTokenizer


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_text_and_token_id_prompts_are_read_in_order(tmp_path):
    tok = ByteTokenizer()
    f = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "def f(x):"}), "", json.dumps({"prompt": [5, 6, 7]}),
                                      json.dumps({"prompt": "é", "max_tokens": 9})])
    got = workloads.read_prompt_file(f, tok, tok.vocab_size)
    # text: BOS, then the text's ids (what /v1/completions sends the engine for a text prompt); ids: as given
    assert got == [tok.encode("def f(x):", bos=True), [5, 6, 7], [tok.bos_id, 0xC3, 0xA9]]
    assert got[0][0] == tok.bos_id and got[0][1:] == list(b"def f(x):")


@pytest.mark.parametrize("line, match", [
    ("{not json", "line 2: not JSON"),
    (json.dumps({"text": "x"}), "line 2: expected an object with \"prompt\""),
    (json.dumps({"prompt": ""}), "line 2: expected an object"),
    (json.dumps({"prompt": [1, True]}), "line 2: expected an object"),
    (json.dumps(["x"]), "line 2: expected an object"),
    (json.dumps({"prompt": [1, 99999]}), r"line 2: token ids outside the vocabulary \[0, 384\): \[99999\]"),
])
def test_a_malformed_line_is_refused_by_its_number(tmp_path, line, match):
    tok = ByteTokenizer()
    f = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok"}), line])
    with pytest.raises(ValueError, match=match):
        workloads.read_prompt_file(f, tok, tok.vocab_size)


def test_an_empty_or_unreadable_file_is_refused(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="no prompts"):
        workloads.read_prompt_file(_write(tmp_path / "e.jsonl", ["", "  "]), tok, tok.vocab_size)
    with pytest.raises(ValueError, match="readable UTF-8"):
        workloads.read_prompt_file(str(tmp_path / "missing.jsonl"), tok, tok.vocab_size)
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="readable UTF-8"):
        workloads.read_prompt_file(str(tmp_path / "b.jsonl"), tok, tok.vocab_size)
