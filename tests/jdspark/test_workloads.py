"""``jdspark.workloads.read_request_file`` / ``read_prompt_file``: an operator's own traffic for the benchmarks, each
prompt encoded as the server encodes it (a text prompt, a chat rendered by its template), the request fields kept
beside it, every malformed line refused by its number."""

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
                                      json.dumps({"prompt": "é"})])
    got = workloads.read_prompt_file(f, tok, tok.vocab_size)
    # text: BOS, then the text's ids (what /v1/completions sends the engine for a text prompt); ids: as given
    assert got == [tok.encode("def f(x):", bos=True), [5, 6, 7], [tok.bos_id, 0xC3, 0xA9]]
    assert got[0][0] == tok.bos_id and got[0][1:] == list(b"def f(x):")


@pytest.mark.parametrize("line, match", [
    ("{not json", "line 2: not JSON"),
    (json.dumps({"text": "x"}), "line 2: expected an object with one of \"prompt\""),
    (json.dumps({"prompt": "x", "messages": []}), "line 2: expected an object with one of \"prompt\""),
    (json.dumps({"prompt": "x", "max_tokens": 9}), "line 2: 'max_tokens' is a request field, which this benchmark "
                                                   "does not send"),
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


def test_a_request_file_keeps_each_line_s_fields_and_renders_chats_as_the_server_does(tmp_path):
    from jdspark import serve_request

    tok = ByteTokenizer()
    chat = {"messages": [{"role": "user", "content": "list two primes"}], "response_format": {"type": "json_object"}}
    f = _write(tmp_path / "r.jsonl", [json.dumps({"prompt": "x = ", "stop": ["\n"], "ignore_eos": False}),
                                      json.dumps(chat)])
    got = workloads.read_request_file(f, tok, tok.vocab_size, reserved=("max_tokens", "seed"))
    assert [r.line for r in got] == [1, 2]
    assert got[0].ids == tok.encode("x = ", bos=True) and got[0].fields == {"stop": ["\n"], "ignore_eos": False}
    assert got[1].fields == chat  # sent as written: the messages with the other fields
    want, *_ = serve_request.prompt_ids(chat, tok, tok.vocab_size, True, None, None, None)
    assert got[1].ids == list(want) and "list two primes" in tok.decode(want)
    with pytest.raises(ValueError, match="line 2: 'seed' is set by the benchmark itself"):
        workloads.read_request_file(_write(tmp_path / "s.jsonl", [json.dumps({"prompt": "a"}),
                                                                  json.dumps({"prompt": "b", "seed": 3})]),
                                    tok, tok.vocab_size, reserved=("max_tokens", "seed"))
    with pytest.raises(ValueError, match="line 1: 'messages' must be a non-empty list"):
        workloads.read_request_file(_write(tmp_path / "m.jsonl", [json.dumps({"messages": []})]), tok,
                                    tok.vocab_size)
