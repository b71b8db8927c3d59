"""The HTTP server and the engine's host loop on a real uvicorn (loopback port), model scripted (serve_helpers):
every endpoint, streaming and not, every bad input, 429 on a full queue, a disconnect mid-stream freeing its
slot, metrics consistent with what was served, and a bounded soak."""

import concurrent.futures as cf
import importlib.metadata
import json
import re
import time

import httpx
import numpy as np
import pytest

from jdspark.grammar import choice_fsm, regex_fsm
from jdspark.json_schema import schema_regex
from jdspark.serve_request import ApiError, parse_completion, prompt_ids
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.serve_helpers import LiveServer, expected_text, scripted_logprob, scripted_rank


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(num_slots=4, max_waiting=8)
    yield s
    s.close()


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics").text


def _wait_idle(srv, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = _metrics(srv)
        if _metric(m, "vllm:num_requests_running") == 0 and _metric(m, "vllm:num_requests_waiting") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("requests did not drain")


def test_ping_version_and_model_retrieval(srv):
    """vLLM's /ping (GET and POST, as /health) and /version (the installed package's), OpenAI's retrieve-a-model
    (404 naming any other model)."""
    assert httpx.get(srv.url + "/ping").status_code == 200 and httpx.post(srv.url + "/ping").status_code == 200
    assert httpx.get(srv.url + "/version").json() == {"version": importlib.metadata.version("jdspark")}
    card = httpx.get(srv.url + "/v1/models/scripted").json()
    assert card == httpx.get(srv.url + "/v1/models").json()["data"][0] and card["id"] == "scripted"
    r = httpx.get(srv.url + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_models_and_a_completion(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["data"][0]["id"] == "scripted"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == expected_text("abc", 10)
    u = body["usage"]
    assert u["completion_tokens"] == 10 and u["prompt_tokens"] == 4  # BOS + 3 bytes
    assert u["prompt_tokens_details"] == {"cached_tokens": 2}  # the scripted backend's prefix-cache hit
    assert u["drafted"] == 4 * 3 and u["accepted"] == 2 * 3  # 1 + 3 + 3 + 3 tokens: 3 steps of 4 drafted


def test_token_id_prompt_stop_string_and_model_name(srv):
    # fields this server does not implement, at the values that ask for nothing (OpenAI clients send them)
    defaults = {"n": 1, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False,
                "logit_bias": {}, "user": "u1", "min_tokens": 0}
    r = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": [256, 97], "max_tokens": 20,
                                                      "stop": ["fgh"], **defaults}).json()
    assert r["choices"][0]["text"] == "bcde" and r["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_holds_stop_strings_back(srv):
    """vLLM's min_tokens: a stop string is matched only once the output has that many tokens (the scripted answer
    to [256, 97] is b, c, d, ...: "fgh" ends at its 7th token)."""
    body = {"prompt": [256, 97], "max_tokens": 20, "stop": ["fgh"]}
    r = httpx.post(srv.url + "/v1/completions", json={**body, "min_tokens": 7}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == ("bcde", "stop")
    r = httpx.post(srv.url + "/v1/completions", json={**body, "min_tokens": 8}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == ("bcdefghijklmnopqrstu", "length")
    assert srv.backend.requests[-1].stop_token_ids == (srv.tok.eos_id,)  # what the device holds back: EOS
    httpx.post(srv.url + "/v1/completions", json={**body, "min_tokens": 8, "ignore_eos": True})
    assert srv.backend.requests[-1].stop_token_ids == ()  # an EOS that ends nothing is not held back (vLLM)


def test_min_p_reaches_the_backend(srv):
    """vLLM's min_p: validated, and handed to the backend with the request (0 when absent or null)."""
    for body, want in (({"min_p": 0.05}, 0.05), ({"min_p": 1}, 1.0), ({}, 0.0), ({"min_p": None}, 0.0)):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 1.0,
                                                          **body})
        assert r.status_code == 200, r.text
        assert srv.backend.requests[-1].min_p == want


def test_stop_token_ids_end_a_request_as_eos_does(srv):
    """vLLM's stop_token_ids: the answer ends at the first of them ("stop"), the id counted and its text not shown."""
    for stream in (False, True):
        body = {"prompt": [256, 97], "max_tokens": 20, "stop_token_ids": [ord("e"), 300], "stream": stream,
                "stream_options": {"include_usage": True}}
        if stream:
            chunks = _sse_chunks(srv, "/v1/completions", body)
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            last = [c["choices"][0] for c in chunks if c["choices"]][-1]
            reason, why, usage = last["finish_reason"], last["stop_reason"], chunks[-1]["usage"]
        else:
            r = httpx.post(srv.url + "/v1/completions", json=body).json()
            text, reason, usage = r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]
            why = r["choices"][0]["stop_reason"]
        assert (text, reason, why, usage["completion_tokens"]) == ("bcd", "stop", ord("e"), 4), stream


def test_stop_reason_and_include_stop_str_in_output(srv):
    """vLLM's stop_reason (the stop string; None at max_tokens) and include_stop_str_in_output (the text keeps it)."""
    body = {"prompt": [256, 97], "max_tokens": 20, "stop": ["xyz", "fgh"]}
    c = httpx.post(srv.url + "/v1/completions", json=body).json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("bcde", "stop", "fgh")
    c = httpx.post(srv.url + "/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert (c["choices"][0]["text"], c["choices"][0]["stop_reason"]) == ("bcdefgh", "fgh")
    chunks = _sse_chunks(srv, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "bcdefgh"
    assert [ch["choices"][0].get("stop_reason", "-") for ch in chunks][-1] == "fgh"
    c = httpx.post(srv.url + "/v1/completions", json={"prompt": "A", "max_tokens": 3}).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)


def test_continuous_usage_stats_in_every_chunk(srv):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk's usage counts the tokens the
    stream has carried so far (n choices together), growing to the final usage chunk's; without it chunks carry none;
    a stream option that is not a boolean is a 400."""
    body = {"prompt": "abc", "max_tokens": 7, "ignore_eos": True, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse_chunks(srv, "/v1/completions", body)
    final = chunks[-1]["usage"]
    seen = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert seen == sorted(seen) and seen[-1] == final["completion_tokens"] == 14
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] == 4 for c in chunks[:-1])
    texts = ["".join(c["choices"][0]["text"] for c in chunks[:k + 1] if c["choices"]) for k in range(len(chunks) - 1)]
    assert all(len(t) <= u for t, u in zip(texts, seen))  # (one byte a token here: text never ahead of the count)
    plain = _sse_chunks(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 14
    bad = httpx.post(srv.url + "/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continuous_usage_stats"


def test_tokenize_and_detokenize(srv):
    """vLLM's /tokenize gives the ids the server prefills (their count is a completion's usage.prompt_tokens, for a
    prompt and for chat messages through the template); /detokenize gives the text back; bad bodies are 400 / 404."""
    msgs = [{"role": "user", "content": "héllo"}]
    for body in ({"prompt": "héllo wörld"}, {"messages": msgs}):
        t = httpx.post(srv.url + "/tokenize", json=body).json()
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        used = httpx.post(srv.url + path, json={**body, "max_tokens": 2}).json()["usage"]["prompt_tokens"]
        assert t["count"] == len(t["tokens"]) == used and t["max_model_len"] == 4096
    bare = httpx.post(srv.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["count"] < t["count"] and t["tokens"][:bare["count"]] == bare["tokens"]
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "héllo wörld"}).json()["tokens"]
    assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "héllo wörld"}
    for path, body, status, param in (("/detokenize", {"tokens": [1, 384]}, 400, "tokens"),
                                      ("/detokenize", {}, 400, "tokens"),
                                      ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
                                      ("/tokenize", {"messages": []}, 400, "messages")):
        r = httpx.post(srv.url + path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    assert httpx.post(srv.url + "/tokenize", content="{").status_code == 400


def test_vllm_prompt_and_output_extras(srv):
    """vLLM's truncate_prompt_tokens (the prompt's last k tokens; -1: the longest this server takes),
    continue_final_message (the final message left open: the prompt ends at its text), skip_special_tokens (false:
    special tokens' names in the text), allowed_token_ids (handed to the backend, sorted and unique)."""
    post = lambda path, body: httpx.post(srv.url + path, json=body)  # noqa: E731
    full = post("/tokenize", {"prompt": "abcdefgh"}).json()["tokens"]
    r = post("/v1/completions", {"prompt": "abcdefgh", "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    assert srv.backend.requests[-1].prompt_ids == tuple(full[-3:])
    r = post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "truncate_prompt_tokens": -1, "echo": True})
    assert srv.backend.requests[-1].prompt_ids == tuple(full[:4]) and r.json()["choices"][0]["text"][:3] == "abc"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}]
    cont = post("/tokenize", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert srv.tok.decode(cont.json()["tokens"]).endswith("<|im_middle|>def f(x):")
    closed = post("/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    assert srv.tok.decode(closed).endswith("def f(x):<|im_end|>")
    r = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "add_generation_prompt": False,
                                      "continue_final_message": True})
    assert r.status_code == 200 and srv.backend.requests[-1].prompt_ids == tuple(cont.json()["tokens"])
    srv.backend.replies[b"[special]"] = [ord("h"), srv.tok.special_tokens["<mask>"], ord("i")]
    try:
        for skip, want in ((None, "hi"), (True, "hi"), (False, "h<mask>i")):
            body = {"prompt": "[special]", "max_tokens": 8, **({} if skip is None else {"skip_special_tokens": skip})}
            assert post("/v1/completions", body).json()["choices"][0]["text"] == want, skip
    finally:
        del srv.backend.replies[b"[special]"]
    r = post("/v1/completions", {"prompt": "x", "max_tokens": 2, "allowed_token_ids": [7, 3, 7]})
    assert r.status_code == 200 and srv.backend.requests[-1].allowed_token_ids == (3, 7)
    assert srv.backend.requests[-1].has_controls
    user = [{"role": "user", "content": "x"}]
    for body, message, param in (
            ({"continue_final_message": True}, "'continue_final_message' and 'add_generation_prompt' cannot both be "
             "true", "continue_final_message"),
            ({"messages": [{"role": "user", "content": " "}], "continue_final_message": True,
              "add_generation_prompt": False}, "the final message's text must be non-empty", "messages"),
            ({"chat_template_kwargs": {"messages": []}}, "'chat_template_kwargs': 'messages' is set by the request",
             "chat_template_kwargs"),
            ({"chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object", "chat_template_kwargs")):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = post(path, {"messages": user, **body})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (path, body, r.text)
            assert r.json()["error"]["param"] == param


def test_chat_template_kwargs_reach_the_template_and_its_refusals_are_400():
    """chat_template_kwargs are variables of the template (a thinking switch, as reasoning models' templates take);
    a template's own raise_exception is a 400 carrying its message, not a server error."""
    template = ("{% if strict %}{{ raise_exception('strict mode refused') }}{% endif %}{% for m in messages %}"
                "{{ m['content'] }}|{% endfor %}{% if thinking %}<think>{% else %}<nothink>{% endif %}")
    tok = ByteTokenizer(chat_template=template)
    msgs = [{"role": "user", "content": "q"}]

    def rendered(**body):
        return tok.decode(prompt_ids({"messages": msgs, **body}, tok, tok.vocab_size, True, None, None, None)[0])

    assert rendered().endswith("q|<nothink>")
    assert rendered(chat_template_kwargs={"thinking": True}).endswith("q|<think>")
    with pytest.raises(ApiError, match="the chat template refused the request: strict mode refused"):
        rendered(chat_template_kwargs={"strict": True})


def test_streaming_sse_with_usage(srv):
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={"prompt": "A", "max_tokens": 12, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == expected_text("A", 12)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) >= 4  # several deltas


def test_chat_completion_streamed_and_not(srv):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5}).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    prompt = srv.tok.apply_chat_template(msgs)
    assert r["choices"][0]["message"]["content"] == expected_text(prompt, 5)
    with httpx.stream("POST", srv.url + "/v1/chat/completions",
                      json={"messages": msgs, "max_tokens": 5, "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln and ln != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected_text(prompt, 5)
    # OpenAI content parts: text parts joined; an image part for this text-only checkpoint is refused by name
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    r2 = httpx.post(srv.url + "/v1/chat/completions", json={"messages": parts, "max_tokens": 5}).json()
    assert r2["choices"][0]["message"]["content"] == expected_text(prompt, 5)
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    r3 = httpx.post(srv.url + "/v1/chat/completions", json={"messages": img, "max_tokens": 5})
    assert r3.status_code == 400 and "text-only" in r3.json()["error"]["message"]
    assert r3.json()["error"]["code"] == "unsupported_content"


BAD = [
    ("not json", "invalid JSON", None, 400),
    ({"max_tokens": 3}, "'prompt' is required", "prompt", 400),
    ({"prompt": 5}, "'prompt' must be", "prompt", 400),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer >= 1", "max_tokens", 400),
    ({"prompt": "x", "max_tokens": "3"}, "'max_tokens' must be", "max_tokens", 400),
    ({"prompt": "x", "max_tokens": 5000}, "exceed the context", "max_tokens", 400),
    ({"prompt": "x", "temperature": -0.5}, "'temperature' must be a number >= 0", "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "'top_p' must be a number in (0, 1]", "top_p", 400),
    ({"prompt": "x", "top_p": 1.5}, "'top_p' must be a number in (0, 1]", "top_p", 400),
    ({"prompt": "x", "min_p": 1.5}, "'min_p' must be a number in [0, 1] (0: off)", "min_p", 400),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "'truncate_prompt_tokens' must be an integer >= 1, or -1",
     "truncate_prompt_tokens", 400),
    ({"prompt": "x", "allowed_token_ids": [1, 384]}, "'allowed_token_ids' must be a list of token ids in [0, 384)",
     "allowed_token_ids", 400),
    ({"prompt": "x", "skip_special_tokens": 0}, "'skip_special_tokens' must be a boolean", "skip_special_tokens",
     400),
    ({"prompt": "x", "guided_grammar": "root ::= x"}, "'guided_grammar' = \"root ::= x\" is not supported",
     "guided_grammar", 400),
    ({"prompt": "x", "use_beam_search": True}, "'use_beam_search' = true is not supported", "use_beam_search", 400),
    ({"prompt": "x", "guided_whitespace_pattern": "[ ]*"}, "'guided_whitespace_pattern' = \"[ ]*\" is not supported",
     "guided_whitespace_pattern", 400),
    ({"prompt": "x", "bad_words": ["foo"]}, "'bad_words' = [\"foo\"] is not supported", "bad_words", 400),

    ({"prompt": "x", "min_p": "0.1"}, "'min_p' must be a number in [0, 1]", "min_p", 400),
    ({"prompt": [1, 999]}, "outside the vocabulary", "prompt", 400),
    ({"prompt": "x", "stream": "yes"}, "'stream' must be a boolean", "stream", 400),
    ({"prompt": "x", "stop": [1]}, "'stop' must be", "stop", 400),
    ({"prompt": "x", "model": "gpt-9"}, "does not exist", "model", 404),
    ({"prompt": "x", "n": 5}, "'n' must be an integer in 1..4, got 5", "n", 400),
    ({"prompt": "x", "n": 0}, "'n' must be an integer in 1..4, got 0", "n", 400),
    ({"prompt": "x", "n": 2, "best_of": 1}, "'best_of' must be an integer in 2..4 (>= n), got 1", "best_of", 400),
    ({"prompt": "x", "best_of": 3, "stream": True}, "cannot be streamed", "best_of", 400),
    ({"prompt": "x", "echo": "yes"}, "'echo' must be a boolean", "echo", 400),
    ({"prompt": "x", "echo": True, "max_tokens": -1}, "'max_tokens' must be an integer >= 0", "max_tokens", 400),
    ({"prompt": "x", "suffix": "y"}, "'suffix' = \"y\" is not supported", "suffix", 400),
    ({"prompt": "x", "logprobs": 6}, "'logprobs' must be an integer in 0..5, got 6", "logprobs", 400),
    ({"prompt": "x", "logprobs": True}, "'logprobs' must be an integer in 0..5, got a boolean", "logprobs", 400),
    ({"prompt": "x", "presence_penalty": 2.5}, "'presence_penalty' must be a number in [-2, 2]", "presence_penalty",
     400),
    ({"prompt": "x", "repetition_penalty": 0}, "'repetition_penalty' must be a number > 0", "repetition_penalty",
     400),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "'min_tokens' must be an integer in 0..max_tokens (2)",
     "min_tokens", 400),
    ({"prompt": "x", "stop_token_ids": [5, 384]}, "'stop_token_ids' must be a list of token ids in [0, 384)",
     "stop_token_ids", 400),
    ({"prompt": "x", "logit_bias": [5, 10]}, "'logit_bias' must be an object", "logit_bias", 400),
    ({"prompt": "x", "logit_bias": {"five": 10}}, "key 'five' is not a token id in [0, 384)", "logit_bias", 400),
    ({"prompt": "x", "logit_bias": {"384": 1}}, "key '384' is not a token id", "logit_bias", 400),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "must be a number in [-100, 100], got 101", "logit_bias", 400),
]


@pytest.mark.parametrize("body,message,param,status", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(srv, body, message, param, status):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(srv.url + "/v1/completions", **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param and set(err) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_request_the_backend_refuses_ends_alone(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x~", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt refused by the backend"
    with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "x~", "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert "prompt refused" in lines[0] and lines[-1] == "data: [DONE]"
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    assert ok.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200


def test_bad_chat_messages(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param, message in [({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
                                  ({"logprobs": 1}, "logprobs", "must be a boolean"),
                                  ({"logprobs": True, "top_logprobs": 9}, "top_logprobs", "integer in 0..5")]:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def _sse_chunks(srv, path, body):
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}) as r:
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]


def test_logprobs_of_completions_and_chat_streamed_and_not(srv):
    """Each generated token's entry as the backend gave it, in the API's two shapes; streamed chunks carry the
    entries of their own tokens, which join to the whole answer's; a stop string's cut keeps one entry a token."""
    body = {"prompt": "abc", "max_tokens": 7, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(srv.url + "/v1/completions", json=body).json()
    lp, text = r["choices"][0]["logprobs"], r["choices"][0]["text"]
    ids = [ord("d") + i for i in range(7)]
    assert lp["tokens"] == list(text) and len(text) == 7
    assert lp["token_logprobs"] == [scripted_logprob(t, 2)[0] for t in ids]
    assert lp["top_logprobs"] == [{chr(j): v for j, v in scripted_logprob(t, 2)[1]} for t in ids]
    assert lp["text_offset"] == list(range(7))
    chunks = _sse_chunks(srv, "/v1/completions", body)
    joined = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for c in chunks:
        if c["choices"] and c["choices"][0]["logprobs"]:
            for k in joined:
                joined[k] += c["choices"][0]["logprobs"][k]
    assert joined == lp and sum(bool(c["choices"] and c["choices"][0]["logprobs"]) for c in chunks) >= 3
    # logprobs 0: each token's own log-probability, no alternatives; no logprobs asked: null
    r0 = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert r0["top_logprobs"] is None and r0["token_logprobs"] == lp["token_logprobs"]
    assert httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": None}).json()["choices"][0][
        "logprobs"] is None
    cut = httpx.post(srv.url + "/v1/completions", json={**body, "stop": "fg"}).json()
    assert cut["choices"][0]["text"] == "de" and cut["usage"]["completion_tokens"] == 4
    assert cut["choices"][0]["logprobs"]["tokens"] == ["d", "e", "f", "g"]  # the tokens served, the cut included

    msgs = [{"role": "user", "content": "hi"}]
    chat = {"messages": msgs, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}
    c = httpx.post(srv.url + "/v1/chat/completions", json=chat).json()["choices"][0]
    first = ord(srv.tok.apply_chat_template(msgs)[-1]) + 1
    want = []
    for t in range(first, first + 5):
        v, tops = scripted_logprob(t, 3)
        want.append({"token": chr(t), "logprob": v, "bytes": [t],
                     "top_logprobs": [{"token": chr(j), "logprob": w, "bytes": [j]} for j, w in tops]})
    assert c["logprobs"] == {"content": want}
    streamed = [e for ch in _sse_chunks(srv, "/v1/chat/completions", chat) if ch["choices"]
                and ch["choices"][0]["logprobs"] for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == want
    plain = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_echo_returns_the_prompt_and_its_log_probabilities(srv):
    """``echo``: the text begins with the prompt, the logprobs object with the prompt's tokens (the first null:
    nothing before it), as lm-eval's loglikelihood reads them; max_tokens 0: the prompt alone; streamed alike."""
    body = {"prompt": "abc", "max_tokens": 3, "ignore_eos": True, "echo": True, "logprobs": 1}
    r = httpx.post(srv.url + "/v1/completions", json=body).json()
    c, prompt_ids = r["choices"][0], [srv.tok.bos_id, ord("a"), ord("b"), ord("c")]
    assert c["text"] == "abc" + expected_text("abc", 3) and r["usage"]["completion_tokens"] == 3
    ids = prompt_ids + [ord("d"), ord("e"), ord("f")]
    lp = c["logprobs"]
    assert lp["tokens"] == [srv.tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert lp["token_logprobs"] == [None] + [scripted_logprob(t, 1)[0] for t in ids[1:]]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"a": scripted_logprob(ord("a"), 1)[0]}
    chunks = _sse_chunks(srv, "/v1/completions", body)
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == c["text"]
    streamed = [x for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                for x in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    alone = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == "abc" and alone["choices"][0]["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0 and len(alone["choices"][0]["logprobs"]["tokens"]) == 4
    plain = httpx.post(srv.url + "/v1/completions", json={"prompt": [256, 97], "max_tokens": 2, "echo": True}).json()
    assert plain["choices"][0]["text"] == srv.tok.decode([256, 97]) + "bc"
    assert plain["choices"][0]["logprobs"] is None
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_a_server_without_logprobs_refuses_them():
    tok = ByteTokenizer()
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=1024, model_name="m", max_logprobs=None)
    for body, chat in [({"prompt": "x", "logprobs": 0}, False),
                       ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, True)]:
        with pytest.raises(ApiError, match="log-probabilities") as e:
            parse_completion(body, chat=chat, **kw)
        assert e.value.status == 400 and e.value.param == "logprobs"
    assert parse_completion({"prompt": "x", "logprobs": None}, **kw)[0].logprobs is None


def _wait_for(srv, name, value, timeout=10):
    deadline = time.time() + timeout
    while _metric(_metrics(srv), name) != value:
        assert time.time() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_full_queue_answers_429_then_drains(srv):
    srv.backend.gate.clear()  # the engine's next step stalls: 1 request in a slot, then 8 waiting, then 429
    post = lambda: httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 4}, timeout=30)
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(post)]
            _wait_for(srv, "vllm:num_requests_running", 1)
            futs += [ex.submit(post) for _ in range(8)]
            _wait_for(srv, "vllm:num_requests_waiting", 8)
            r = post()
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.json()["error"]["type"] == "rate_limit_error"
            # n choices are queued together or not at all; more than the queue could ever hold is a 400
            many = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "n": 2})
            assert many.status_code == 429 and "2 more do not fit" in many.json()["error"]["message"]
            assert _metric(_metrics(srv), "vllm:num_requests_waiting") == 8
            srv.backend.gate.set()
            assert [f.result().status_code for f in futs] == [200] * 9
    finally:
        srv.backend.gate.set()
    _wait_idle(srv)


def test_n_choices_streamed_and_not(srv):
    """``n``: choice i sampled with seed + i (the scripted backend's text shows the seed), each with its own
    logprobs and finish; usage counts the prompt once and every choice's tokens and drafts; streamed, the choices'
    chunks interleave by index, each ends with its own finish chunk, usage and [DONE] come once, after the last."""
    body = {"prompt": "abc", "max_tokens": 6, "ignore_eos": True, "n": 3, "seed": 5, "logprobs": 1}
    r = httpx.post(srv.url + "/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [expected_text("abc", 6, 5 + i) for i in range(3)]
    assert all(c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == 6 for c in r["choices"])
    one = httpx.post(srv.url + "/v1/completions", json={**body, "n": 1, "seed": 7}).json()
    assert one["choices"][0]["text"] == r["choices"][2]["text"]  # choice 2 of seed 5: the request of seed 7
    u = r["usage"]
    assert u["prompt_tokens"] == 4 and u["completion_tokens"] == 18 and u["total_tokens"] == 22
    assert u["drafted"] == 3 * one["usage"]["drafted"] and u["accepted"] == 3 * one["usage"]["accepted"]
    assert u["accept_len"] == pytest.approx(one["usage"]["accept_len"])
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == u
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and len({c["id"] for c in chunks}) == 1
    for i in range(3):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == r["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == list(r["choices"][i]["text"])
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"messages": msgs, "max_tokens": 4, "n": 2, "seed": 1}
    c = httpx.post(srv.url + "/v1/chat/completions", json=chat).json()
    prompt = srv.tok.apply_chat_template(msgs)
    assert [x["message"]["content"] for x in c["choices"]] == [expected_text(prompt, 4, 1 + i) for i in range(2)]
    streamed = _sse_chunks(srv, "/v1/chat/completions", chat)
    assert [ch["choices"][0]["delta"] for ch in streamed[:2]] == [{"role": "assistant", "content": ""}] * 2
    for i in range(2):
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in streamed
                       if ch["choices"][0]["index"] == i) == c["choices"][i]["message"]["content"]
    echo = httpx.post(srv.url + "/v1/completions", json={**body, "echo": True, "n": 2}).json()
    assert [x["text"] for x in echo["choices"]] == ["abc" + t for t in (r["choices"][0]["text"],
                                                                       r["choices"][1]["text"])]
    assert all(x["logprobs"]["token_logprobs"][0] is None and len(x["logprobs"]["tokens"]) == 10
               for x in echo["choices"])


def test_a_list_of_prompts_gets_each_its_choices(srv):
    """OpenAI's ``prompt`` as a list (strings, or lists of token ids; lm-eval sends its batches so): prompt k's
    choice j is choice k * n + j (vLLM's order), with its own echo; usage counts each prompt once; streamed
    alike; a mixed list is a 400 naming the prompt, as is more completions than the queue can ever hold."""
    body = {"prompt": ["abc", "pq"], "max_tokens": 5, "ignore_eos": True, "n": 2, "seed": 1}
    r = httpx.post(srv.url + "/v1/completions", json=body).json()
    want = [expected_text(p, 5, 1 + j) for p in ("abc", "pq") for j in range(2)]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and [c["text"] for c in r["choices"]] == want
    assert r["usage"]["prompt_tokens"] == 4 + 3 and r["usage"]["completion_tokens"] == 20
    ids = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": [[256, 97, 98, 99], [256, 112, 113]],
                                                         "echo": True}).json()
    assert [c["text"] for c in ids["choices"]] == ["abc" + want[0], "abc" + want[1], "pq" + want[2], "pq" + want[3]]
    streamed = _sse_chunks(srv, "/v1/completions", {**body, "stream": True})
    for i in range(4):
        assert "".join(ch["choices"][0]["text"] for ch in streamed if ch["choices"][0]["index"] == i) == want[i]
    for prompt in (["abc", [97]], [[97], []]):
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": prompt})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
    many = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": ["a"] * 5})  # 10 > the queue's 8
    assert many.status_code == 400 and "can never be queued together" in many.json()["error"]["message"]


def test_prompt_logprobs_in_vllms_form(srv):
    """vLLM's prompt_logprobs: per prompt token null (the first) or {id: {logprob, rank, decoded_token}} for the token
    and the k likeliest (ranks 1..k; the token's own rank where it is not among them), per completions choice and
    once per chat response; independent of the generated tokens' logprobs and of echo's (each its own k);
    streaming and more than --max-logprobs are 400s."""
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "abc"}).json()["tokens"]

    def want(t, k):
        lp, tops = scripted_logprob(t, k)
        d = {str(j): {"logprob": v, "rank": r + 1, "decoded_token": chr(j)} for r, (j, v) in enumerate(tops)}
        return d | ({} if str(t) in d else {str(t): {"logprob": lp, "rank": scripted_rank(t), "decoded_token": chr(t)}})

    c = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "prompt_logprobs": 0}).json()
    c = c["choices"][0]
    assert c["logprobs"] is None and c["prompt_logprobs"] == [None] + [want(t, 0) for t in ids[1:]]
    assert c["prompt_logprobs"][1][str(ids[1])]["rank"] == scripted_rank(ids[1])  # the token's own rank
    both = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "prompt_logprobs": 2,
                                                         "echo": True, "logprobs": 1}).json()["choices"][0]
    assert both["prompt_logprobs"] == [None] + [want(t, 2) for t in ids[1:]]
    assert all(len(x) == 1 for x in both["logprobs"]["top_logprobs"][1:])  # echo's own k
    assert len(both["logprobs"]["tokens"]) == len(ids) + 3
    plain = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}).json()["choices"][0]
    assert "prompt_logprobs" not in plain and srv.backend.requests[-1].prompt_logprobs is None
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                              "prompt_logprobs": 1}).json()
    cids = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert chat["prompt_logprobs"] == [None] + [want(t, 1) for t in cids[1:]]
    for body, message in (({"stream": True}, "not served with \"stream\": true"),
                          ({"prompt_logprobs": 6}, "must be an integer in 0..5")):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "prompt_logprobs": 1, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt_logprobs"


def test_guided_choice_reaches_the_backend_as_its_automaton(srv):
    """vLLM's guided_choice / guided_regex and structured_outputs.choice / .regex: the backend is handed the
    automaton's table over the vocabulary (EOS and the request's stop ids its stops); the refusals name their field
    (a pattern not taken says what and where)."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 4,
                                                      "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    want = choice_fsm(["yes", "no"], srv.tok, srv.tok.vocab_size, (srv.tok.eos_id,)).next_QV
    np.testing.assert_array_equal(srv.backend.requests[-1].grammar.next_QV, want)
    msgs = [{"role": "user", "content": "q"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "stop_token_ids": [7],
                                                           "structured_outputs": {"choice": ["a b", "c"]}})
    assert r.status_code == 200, r.text
    want = choice_fsm(["a b", "c"], srv.tok, srv.tok.vocab_size, (srv.tok.eos_id, 7)).next_QV
    np.testing.assert_array_equal(srv.backend.requests[-1].grammar.next_QV, want)
    for body in ({"guided_regex": r"\d{2}-[a-c]+"}, {"structured_outputs": {"regex": r"\d{2}-[a-c]+"}}):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 4, **body})
        assert r.status_code == 200, r.text
        want = regex_fsm(r"\d{2}-[a-c]+", srv.tok, srv.tok.vocab_size, (srv.tok.eos_id,)).next_QV
        np.testing.assert_array_equal(srv.backend.requests[-1].grammar.next_QV, want)
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "q"}).status_code == 200
    assert srv.backend.requests[-1].grammar is None
    for body, message, param in (
            ({"guided_choice": []}, "must be a non-empty list of non-empty strings", "guided_choice"),
            ({"guided_choice": ["x", ""]}, "must be a non-empty list of non-empty strings", "guided_choice"),
            ({"structured_outputs": {"grammar": "x"}}, "['grammar'] is not supported", "structured_outputs"),
            ({"guided_choice": ["x"], "structured_outputs": {"choice": ["y"]}}, "give one of", "structured_outputs"),
            ({"guided_choice": ["x"], "ignore_eos": True}, "not with ignore_eos", "guided_choice"),
            ({"guided_choice": ["a" * 40]}, "automaton of 41 states; this server takes at most 32", "guided_choice"),
            ({"guided_regex": "a(b"}, "'guided_regex': regex 'a(b': missing ')' at position 3", "guided_regex"),
            ({"guided_regex": "[a-z]{40}"}, "the pattern makes an automaton of 41 states", "guided_regex"),
            ({"structured_outputs": {"regex": 5}}, "must be a non-empty regular expression", "structured_outputs"),
            ({"guided_json": {"type": "integer", "multipleOf": 3}}, "['multipleOf'] not taken", "guided_json"),
            ({"guided_json": "{not json"}, "'guided_json': the schema is not valid JSON", "guided_json"),
            ({"guided_json": 5}, "must be a JSON Schema (an object)", "guided_json"),
            ({"response_format": {"type": "json_object"}}, "the schema makes an automaton of", "response_format"),
            ({"response_format": {"type": "yaml"}}, "'response_format' must be {\"type\": \"text\"",
             "response_format"),
            ({"structured_outputs": {"json_object": 1}}, "'structured_outputs.json_object' must be true",
             "structured_outputs"),
            ({"guided_choice": ["x"], "response_format": {"type": "json_object"}}, "give one of",
             "response_format")):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] == param
    with pytest.raises(ApiError, match="start it with --guided-states"):
        parse_completion({"prompt": "q", "guided_choice": ["x"]}, tokenizer=srv.tok, vocab_size=srv.tok.vocab_size,
                         max_context=64, model_name="m")


def test_json_output_reaches_the_backend_as_its_automaton(srv):
    """JSON output asked every way a client does (vLLM's guided_json as an object or its text,
    structured_outputs.json, OpenAI's response_format json_schema, the Responses API's text.format) hands the
    backend the same table: the schema's automaton over the vocabulary; response_format text asks for nothing."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    want = regex_fsm(schema_regex(schema), srv.tok, srv.tok.vocab_size, (srv.tok.eos_id,)).next_QV
    assert want.shape[0] <= 32
    msgs = [{"role": "user", "content": "q"}]
    for path, body in (("/v1/completions", {"prompt": "q", "guided_json": schema}),
                       ("/v1/completions", {"prompt": "q", "guided_json": json.dumps(schema)}),
                       ("/v1/completions", {"prompt": "q", "structured_outputs": {"json": schema}}),
                       ("/v1/chat/completions", {"messages": msgs, "response_format": {
                           "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}),
                       ("/v1/responses", {"input": "q", "text": {"format": {"type": "json_schema", "name": "a",
                                                                            "schema": schema}}})):
        r = httpx.post(srv.url + path, json={"max_tokens": 4, **body})
        assert r.status_code == 200, (body, r.text)
        np.testing.assert_array_equal(srv.backend.requests[-1].grammar.next_QV, want)
    r = httpx.post(srv.url + "/v1/responses", json={"input": "q", "text": {"format": {"type": "json_schema",
                                                                                      "schema": schema}}})
    assert r.json()["text"] == {"format": {"type": "json_schema", "schema": schema}}
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "response_format": {"type": "text"}})
    assert r.status_code == 200 and srv.backend.requests[-1].grammar is None


def test_best_of_returns_the_likeliest_completions(srv):
    """``best_of`` 4, n 2: four completions (seeds 3..6), the two with the highest mean log-probability per token
    returned in that order; without logprobs asked they rank all the same and the choices show none; usage counts
    all four; chat refuses it by name."""
    body = {"prompt": "abc", "max_tokens": 5, "ignore_eos": True, "n": 2, "best_of": 4, "seed": 3}
    cands = []
    for i in range(4):
        text = expected_text("abc", 5, 3 + i)
        cands.append((-np.mean([scripted_logprob(ord(ch), 0)[0] for ch in text]), i, text))
    assert len({c[0] for c in cands}) == 4  # no ties: the order is the ranking's
    want = [text for _, _, text in sorted(cands)[:2]]
    assert want != [c[2] for c in cands[:2]]  # not merely the first two
    for asked in (None, 1):
        r = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": asked}).json()
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert [c["text"] for c in r["choices"]] == want
        assert r["usage"]["completion_tokens"] == 20
        assert all((c["logprobs"] is None) == (asked is None) for c in r["choices"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 1, "best_of": 2}
    bad = httpx.post(srv.url + "/v1/chat/completions", json=chat)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"


def test_disconnect_mid_stream_frees_the_slot(srv):
    before = _metric(_metrics(srv), "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={"prompt": "z", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # closing the stream drops the connection
    m = _wait_idle(srv)
    assert _metric(m, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert sorted(srv.backend.last) == []  # every slot freed on the device side too
    with httpx.stream("POST", srv.url + "/v1/completions",  # n choices: every one of them
                      json={"prompt": "z", "max_tokens": 3000, "stream": True, "ignore_eos": True, "n": 3}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    m = _wait_idle(srv)
    assert _metric(m, "vllm:request_success_total", finished_reason="abort") == before + 4
    assert sorted(srv.backend.last) == []


@pytest.fixture(scope="module")
def soak_srv():
    s = LiveServer(num_slots=4, max_waiting=32)  # room for 16 concurrent clients: no 429 here
    yield s
    s.close()


def test_metrics_match_what_was_served_and_a_soak(soak_srv):
    srv = soak_srv
    m0 = _wait_idle(srv)
    n_good, n_tokens = 0, 0

    def one(i):
        if i % 10 == 3:  # bad request mixed in
            return "bad", httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "top_p": 2}).status_code
        if i % 10 == 7:  # a client that goes away mid-stream
            with httpx.stream("POST", srv.url + "/v1/completions",
                              json={"prompt": "d", "max_tokens": 500, "stream": True}) as r:
                next(r.iter_lines())
            return "gone", 0
        n = 5 + i % 17
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "k", "max_tokens": n, "seed": i}, timeout=60)
        return "good", (r.status_code, r.json()["usage"]["completion_tokens"], n)

    with cf.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(200)))
    for kind, res in results:
        if kind == "good":
            status, got, want = res
            assert status == 200 and got == want
            n_good += 1
            n_tokens += got
        elif kind == "bad":
            assert res == 400
    assert httpx.get(srv.url + "/health").status_code == 200
    m1 = _wait_idle(srv)
    d = {k: _metric(m1, k) - _metric(m0, k) for k in
         ("vllm:generation_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
          "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
          "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    length = _metric(m1, "vllm:request_success_total", finished_reason="length") - \
        _metric(m0, "vllm:request_success_total", finished_reason="length")
    assert length == n_good
    # the disconnected streams generated some tokens too: generation_tokens >= the good requests' own
    assert d["vllm:generation_tokens_total"] >= n_tokens
    assert 0 < d["vllm:spec_decode_num_accepted_tokens_total"] <= d["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = sum(_metric(m1, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(8))
    assert per_pos == _metric(m1, "vllm:spec_decode_num_accepted_tokens_total")
    assert re.search(r"vllm:time_to_first_token_seconds_count\{[^}]*\} [1-9]", m1)
    # every prefill looked its prompt up; the scripted backend found half of each ("k", "d": BOS + 1 byte)
    queries, hits = d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"]
    assert queries == d["vllm:prompt_tokens_total"] == 2 * hits > 0
    # the per-request histograms (vLLM's dashboards): every request ended, so their sums are the counters' deltas
    # and their counts the finished requests; nothing preempted; the scripted backend has no cache to fill
    dh = {k: _metric(m1, k) - _metric(m0, k) for k in
          ("vllm:request_generation_tokens_sum", "vllm:request_prompt_tokens_sum",
           "vllm:request_params_max_tokens_count", "vllm:request_inference_time_seconds_count",
           "vllm:request_success_total")}
    assert dh["vllm:request_generation_tokens_sum"] == d["vllm:generation_tokens_total"]
    assert dh["vllm:request_prompt_tokens_sum"] == d["vllm:prompt_tokens_total"]
    assert dh["vllm:request_params_max_tokens_count"] == dh["vllm:request_success_total"] >= n_good
    assert dh["vllm:request_inference_time_seconds_count"] >= n_good
    assert _metric(m1, "vllm:num_preemptions_total") == 0 and "vllm:kv_cache_usage_perc{" in m1


def test_bench_serve_cells_and_chart_against_a_live_server(soak_srv, tmp_path):
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    prompts = [[256, 97 + i] for i in range(4)]
    # over HTTP, and the same engine driven in-process (--in-process): the same figures from the same metrics
    clients = (bench_serve.HttpClient(soak_srv.url), bench_serve.EngineClient(soak_srv.engine, soak_srv.metrics))
    cells = [bench_serve.run_cell(client, prompts, mode, c, 0.0, 9, 4) for client in clients
             for mode in ("off", "fixed") for c in (1, 4)]
    for cell in cells:
        assert cell["output_tok_s"] > 0 and cell["per_user_tok_s"] > 0 and cell["requests"] == 4
        assert cell["finish_reasons"] == {"length": 4} and cell["completion_tokens"] == 4 * 9
        assert cell["ttft_ms"]["p50"] is not None and cell["tpot_ms"]["p99"] >= cell["tpot_ms"]["p50"]
        assert cell["accept_len"] == pytest.approx(1 + 2 / 1)  # the scripted backend: 2 of 4 accepted per step
        assert cell["verified_per_slot_step"] == pytest.approx(5.0)
        want = {str(w): 1e3 * soak_srv.backend.costs[(b, w)] for (b, w) in soak_srv.backend.costs
                if b == (1 if cell["concurrency"] == 1 else soak_srv.backend.num_slots)}
        assert cell["step_cost_ms"] == pytest.approx(want) and len(want) == 2
    # conversations (--turns 3): each turn's prompt is the last one + its answer (9 ASCII bytes from the scripted
    # backend, encoded again) + a message (ASCII throughout); the scripted backend says half of each prompt was cached
    enc = ByteTokenizer().encode
    for client in clients:
        cell = bench_serve.run_cell(client, prompts, "fixed", 2, 0.0, 9, 2, messages=[[65, 66], [67]],
                                    encode=lambda text: enc(text, bos=False))
        assert cell["turns"] == 3 and len(cell["ttft_ms_p50_by_turn"]) == 3 and cell["requests"] == 2
        assert cell["cached_share"] == pytest.approx((1 + 6 + 11) / (2 + 13 + 23))  # prompts of 2, 13, 23 tokens
    # request fields (a --prompt-file line's, --request-fields): sent with the cell's own settings, a chat line to
    # /v1/chat/completions; the in-process client refuses them rather than dropping them
    before = len(soak_srv.backend.requests)
    fields = [{"messages": [{"role": "user", "content": "hi there"}], "top_k": 5}, {"top_k": 7}, {}, {}]
    cell = bench_serve.run_cell(clients[0], prompts, "fixed", 2, 1.0, 9, 4, fields=fields)
    assert cell["completion_tokens"] == 4 * 9 and cell["ttft_ms"]["p50"] is not None
    assert cell["finish_reasons"] == {"length": 4}
    sent = sorted(soak_srv.backend.requests[before:], key=lambda r: r.seed)
    assert [r.top_k for r in sent] == [5, 7, 0, 0] and [r.temperature for r in sent] == [1.0] * 4
    assert b"hi there" in bytes(t for t in sent[0].prompt_ids if t < 256) and sent[1].prompt_ids == tuple(prompts[1])
    with pytest.raises(ValueError, match=r"--in-process sends token ids only; request fields \['top_k'\]"):
        clients[1].request(prompts[0], 9, 0.0, 0, "fixed", {"top_k": 7})
    med = bench_serve.median_cell([dict(cells[0], output_tok_s=v, tag=i) for i, v in enumerate((3.0, 1.0, 2.0, 9.0))])
    assert med["tag"] == 2 and med["rounds"] == 4 and med["output_tok_s_rounds"] == [3.0, 1.0, 2.0, 9.0]
    bench_serve.plot(cells, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    for mode in ("sometimes", "adaptive"):  # not a mode; not offered by a server started with --spec fixed
        r = httpx.post(soak_srv.url + "/v1/completions", json={"prompt": "x", "spec_mode": mode})
        assert r.status_code == 400 and r.json()["error"]["param"] == "spec_mode"


def test_bench_serve_summary_pairs_rounds():
    """Ratios between modes are medians of per-round ratios: a machine that slows by half from one round to the
    next moves both modes' cells, and the paired ratio sees none of it where a ratio of medians would."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    def cell(mode, c, rounds):
        return {"mode": mode, "concurrency": c, "temperature": 0.0, "output_tok_s": float(np.median(rounds)),
                "output_tok_s_rounds": list(rounds)}

    speed = [100.0, 50.0, 100.0, 50.0, 50.0]  # the machine, round by round
    cells = [cell("off", 1, [s * 1.0 for s in speed]), cell("fixed", 1, [s * 2.0 for s in speed]),
             cell("adaptive", 1, [s * 2.2 for s in speed[1:]] + [100.0 * 2.2]),  # shifted a round: unpaired
             cell("off", 4, [s * 3.0 for s in speed]), cell("fixed", 4, [s * 5.0 for s in speed]),
             cell("adaptive", 4, [s * 4.9 for s in speed])]
    row, = bench_serve.summarize(cells)
    assert row["fixed_over_off_c1"] == pytest.approx(2.0)
    assert row["adaptive_over_best_of_off_fixed"]["4"] == pytest.approx(0.98)
    assert row["best_c4_over_best_c1"] == pytest.approx(5.0 / 2.2)  # medians: 250 / 110
    # unequal round counts fall back to the ratio of medians
    lone = dict(cells[2], output_tok_s_rounds=[110.0])
    assert bench_serve.paired_ratio(lone, cells[1]) == pytest.approx(110.0 / 100.0)


def test_bench_serve_sizes_a_launched_server_by_its_traffic():
    """--launch starts the server with one prompt bucket holding the prompts and slot caches of prompt +
    completion + a verify block (rounded up to 64)."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    assert bench_serve.launch_args(128, 128) == ["--prompt-buckets", "128", "--max-len", "320"]
    assert bench_serve.launch_args(100, 50) == ["--prompt-buckets", "128", "--max-len", "256"]
    # conversations of 4 turns: the first prompt, a turn's message, its new tokens (answer + message + slack), the
    # last prompt
    assert bench_serve.launch_args(128, 128, 4, 48) == ["--prompt-buckets", "64,128,192,704", "--max-len", "896"]


def test_bench_serve_prompt_sources(tmp_path, capsys):
    """The load test's prompts: held-out code by default (the very prompts it always sent), another workload's or a
    corpus's cut as scripts/bench.py cuts them, or an operator's own JSON Lines file, each source named in the JSON;
    a bad file stops the run with the line it names."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve
    import generate as gen

    import kimi
    from jdspark import data as jdata
    from jdspark import workloads

    ck = "checkpoints/default"
    tok = gen.load_tokenizer(ck, kimi.KimiConfig.from_hf_config(ck + "/target"))
    code, src, none = bench_serve.load_prompts(ck, 3, 48)
    assert code == [p.tolist() for p in jdata.heldout_prompts(3, 48, tokenizer=tok)]
    assert src == {"workload": "code", "prompts": 3, "prompt_len": 48} and none == [{}, {}, {}]
    prose, src, _ = bench_serve.load_prompts(ck, 2, 40, workload="prose")
    assert [p.tolist() for p in jdata.prompts_from_documents(workloads.documents("prose"), 2, 40,
                                                               tokenizer=tok)] == prose != code[:2]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(200)))
    cut, src, _ = bench_serve.load_prompts(ck, 2, 16, corpus=str(tmp_path / "docs"))
    assert src["corpus"] == str(tmp_path / "docs") and all(len(p) == 16 for p in cut)
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": [7, 8, 9, 10]}\n')
    mine, src, fields = bench_serve.load_prompts(ck, 16, 128, prompt_file=str(f))
    assert mine == [tok.encode("def f(x):", bos=True), [7, 8, 9, 10]] and fields == [{}, {}]
    assert src == {"prompt_file": str(f), "prompts": 2, "prompt_len_max": max(map(len, mine)), "chat": 0}
    f.write_text('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"}\n'
                 '{"prompt": "x", "response_format": {"type": "json_object"}, "ignore_eos": false}\n')
    mine, src, fields = bench_serve.load_prompts(ck, 16, 128, prompt_file=str(f))
    assert src["chat"] == 1 and fields[1] == {"response_format": {"type": "json_object"}, "ignore_eos": False}
    assert "hi" in tok.decode(mine[0]) and fields[0]["tool_choice"] == "none"
    for bad, say in (('{"prompt": "x", "temperature": 0.5}', "line 1: 'temperature' is set by the benchmark"),
                     ('{"prompt": "x", "stream": false}', "line 1: 'stream' is set by the benchmark")):
        f.write_text(bad + "\n")
        with pytest.raises(SystemExit):
            bench_serve.main(["--in-process", "--prompt-file", str(f), "--concurrency", "1"])
        assert say in capsys.readouterr().err
    for flag, say in (('{"seed": 1}', "--request-fields: 'seed' is set by the benchmark itself"),
                      ("[1]", "--request-fields: expected a JSON object"), ("{x", "--request-fields: not JSON"),
                      ('{"top_k": 4}', "request fields (--request-fields, a --prompt-file line's fields) are sent "
                                       "over HTTP")):
        with pytest.raises(SystemExit):  # each before any engine is built
            bench_serve.main(["--in-process", "--request-fields", flag, "--prompts", "2", "--prompt-len", "16"])
        assert say in capsys.readouterr().err
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(SystemExit):  # before any engine is built
        bench_serve.main(["--in-process", "--prompt-file", str(f), "--concurrency", "1"])
    assert "mine.jsonl, line 2: expected an object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_serve.main(["--in-process", "--workload", "poetry"])
    assert "workload: expected one of ('code', 'structured', 'prose'), got 'poetry'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source at a time
        bench_serve.main(["--in-process", "--workload", "prose", "--corpus", str(tmp_path)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_mailbox_wakes_the_loop_once_per_batch_and_keeps_order():
    """Events posted from the engine's thread while a flush is pending share one wake-up of the event loop, and
    every request's queue gets its events in the order they were posted."""
    import asyncio
    import threading

    from jdspark.engine import Event
    from jdspark.serve_stream import Mailbox

    loop = asyncio.new_event_loop()
    try:
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a: (wakeups.append(cb), real(cb, *a))[1]
        box = Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]

        def engine_thread(first, n):  # the loop is not running: nothing can flush while these are posted
            for i in range(first, first + n):
                box.post(queues[i % 3], Event(str(i), [i]))

        t = threading.Thread(target=engine_thread, args=(0, 30))
        t.start()
        t.join()
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))  # the one flush runs
        got = [[queues[q].get_nowait().token_ids[0] for _ in range(queues[q].qsize())] for q in range(3)]
        assert got == [list(range(q, 30, 3)) for q in range(3)]
        engine_thread(30, 3)  # after a flush, the next batch schedules its own
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert [queues[q].get_nowait().token_ids[0] for q in range(3)] == [30, 31, 32]
    finally:
        loop.close()


def test_server_flags_reach_the_slots():
    """--multi-step-max-batch sets the largest batch bucket launched several steps at a time (default: the
    platform's plan, 4 on a CPU, every bucket on a GPU; 0: every bucket), is checked, and make_engine hands it to
    the slots, as it does prefix caching and --guided-states (on by default); --compile-cache's default and "none";
    --pin-threads on by default;
    bench_serve passes --server-args only to a server it starts."""
    import os
    import sys

    from jdspark import serve
    from jdspark.slots import multi_step_plan

    a = serve.parse_args([])
    assert (a.multi_step, a.multi_step_max_batch, a.multi_step_plain_max_batch) == multi_step_plan("cpu") == (4, 4, 16)
    assert multi_step_plan("gpu") == (8, 0, 0)
    assert serve.parse_args(["--multi-step", "2"]).multi_step == 2
    with pytest.raises(SystemExit):
        serve.parse_args(["--multi-step-max-batch", "-1"])
    a_flags = ["--checkpoint", "checkpoints/default", "--slots", "2", "--max-len", "256", "--prompt-buckets", "64"]
    a = serve.parse_args([*a_flags, "--multi-step", "3", "--multi-step-max-batch", "1"])
    _, backend, *_ = serve.make_engine(a)
    assert (backend.steps_for(1), backend.steps_for(2)) == (3, 3)  # plain launches: every bucket (by default)
    assert (backend.steps_at(1, backend.G + 1), backend.steps_at(2, backend.G + 1), backend.steps_at(2, 1)) == (3, 1, 3)
    assert backend.prefix.capacity == 32  # prefix caching is on by default; --prefix-pool 0 turns it off
    # the default pool stays within its budget where a row is large: 1 row at least, 32 at most
    from jdspark.prefix import PREFIX_POOL_BUDGET_BYTES, default_pool_rows

    assert [default_pool_rows(b) for b in (1 << 20, PREFIX_POOL_BUDGET_BYTES // 5, 2 * PREFIX_POOL_BUDGET_BYTES)] == [
        32, 5, 1]
    assert backend.prefix_answers  # answers are kept while idle by default
    assert backend.guided_states == 1024  # constrained decoding compiled in by default; --guided-states 0: out
    assert serve.make_engine(serve.parse_args([*a_flags, "--guided-states", "0"]))[1].guided_states == 0
    # compiled programs kept between start-ups: $JAX_COMPILATION_CACHE_DIR or ~/.cache/jdspark/xla; "none": off
    from jdspark.graphs import COMPILE_CACHE_DIR, use_compile_cache

    env = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        assert serve.parse_args([]).compile_cache == COMPILE_CACHE_DIR
        os.environ["JAX_COMPILATION_CACHE_DIR"] = "/x/y"
        assert serve.parse_args([]).compile_cache == "/x/y"
    finally:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        if env is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = env
    import jax

    kept = jax.config.jax_compilation_cache_dir
    assert use_compile_cache("none") is None and use_compile_cache(None) is None
    assert jax.config.jax_compilation_cache_dir == kept
    # XLA:CPU's worker threads pinned one to a core once warm, by default; off for a server sharing its cores
    assert serve.parse_args([]).pin_threads == "on" and serve.parse_args(["--pin-threads", "off"]).pin_threads == "off"
    be = serve.make_engine(serve.parse_args([*a_flags, "--prefix-pool", "3", "--no-prefix-answers"]))[1]
    assert be.prefix.capacity == 3 and not be.prefix_answers
    from jdspark.engine import SamplingRequest

    for b, pending in ((backend, True), (be, False)):
        b.keep_answer(SamplingRequest(tuple(range(40)), 4), [5, 6, 7])
        assert b.idle_pending() == pending
    assert serve.make_engine(serve.parse_args([*a_flags, "--prefix-pool", "0"]))[1].prefix is None
    with pytest.raises(SystemExit):
        serve.parse_args(["--prefix-pool", "-1"])
    # buckets 1, 2, 4, 8: steps_for is the most a launch runs; steps_at(8, width) what one of that width runs
    for flag, want, at8 in ((["--multi-step-max-batch", "0"], [4] * 5, (4, 4)), ([], [4] * 5, (4, 1)),
                            (["--multi-step-plain-max-batch", "4"], [4, 4, 4, 4, 1], (1, 1))):
        _, backend, *_ = serve.make_engine(serve.parse_args(["--slots", "8", "--max-len", "256", "--prompt-buckets",
                                                             "64", *flag]))
        assert [backend.steps_for(n) for n in (1, 2, 3, 4, 5)] == want
        assert (backend.steps_at(8, 1), backend.steps_at(8, backend.G + 1)) == at8
    with pytest.raises(SystemExit):
        serve.parse_args(["--multi-step-plain-max-batch", "-1"])
    with pytest.raises(SystemExit):  # plain launches multi-step wherever wide ones do: a lower one given is refused
        serve.parse_args(["--multi-step-max-batch", "8", "--multi-step-plain-max-batch", "4"])
    a = serve.parse_args(["--slots", "32", "--multi-step-max-batch", "0"])  # the default 16 follows the flag given
    assert a.multi_step_plain_max_batch == 0
    from jdspark.slots import SlotBackend

    with pytest.raises(ValueError, match="multi_step_plain_max_batch: expected >= multi_step_max_batch"):
        SlotBackend(None, None, multi_step_max_batch=8, multi_step_plain_max_batch=4)
    sys.path.insert(0, "scripts")
    import bench_serve

    with pytest.raises(SystemExit):
        bench_serve.main(["--url", "http://127.0.0.1:1", "--server-args", "--multi-step 8"])
