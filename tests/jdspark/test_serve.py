"""The HTTP server and the engine's host loop on a real uvicorn (loopback port), model scripted (serve_helpers):
every endpoint, streaming and not, and every bad input (an OpenAI error body, and the server keeps serving).
Log-probabilities, n choices, constrained decoding, 429 and disconnects: test_serve_outputs.py; metrics against
what was served, the soak, the load test's client and the server's flags: test_serve_load.py."""

import importlib.metadata
import json
import os
import sys

import httpx
import pytest

from jdspark.serve_request import ApiError, prompt_ids
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.serve_helpers import expected_text, sse_chunks


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
            chunks = sse_chunks(srv, "/v1/completions", body)
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
    chunks = sse_chunks(srv, "/v1/completions", {**body, "include_stop_str_in_output": True})
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
    chunks = sse_chunks(srv, "/v1/completions", body)
    final = chunks[-1]["usage"]
    seen = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert seen == sorted(seen) and seen[-1] == final["completion_tokens"] == 14
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] == 4 for c in chunks[:-1])
    texts = ["".join(c["choices"][0]["text"] for c in chunks[:k + 1] if c["choices"]) for k in range(len(chunks) - 1)]
    assert all(len(t) <= u for t, u in zip(texts, seen))  # (one byte a token here: text never ahead of the count)
    plain = sse_chunks(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
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
    ({"prompt": "x", "stop": ""}, "'stop' must be a non-empty string or a list of non-empty strings", "stop", 400),
    ({"prompt": "x", "stop": ["a", ""]}, "'stop' must be a non-empty string", "stop", 400),
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
    ({"prompt": "xy", "token_healing": "yes"}, "'token_healing' must be a boolean", "token_healing", 400),
    ({"prompt": "x", "priority": 1}, "'priority' = 1: this server schedules first come, first served", "priority",
     400),
    ({"prompt": "x", "priority": "high"}, "'priority' must be an integer", "priority", 400),
    ({"prompt": "xy", "token_healing": True, "logprobs": 1}, "'token_healing' is not served with 'logprobs'",
     "token_healing", 400),
    ({"prompt": "xy", "token_healing": True, "guided_regex": "a+"}, "not served with 'guided_regex'",
     "token_healing", 400),
    ({"prompt": "xy", "token_healing": True, "allowed_token_ids": [97]}, "not served with 'allowed_token_ids'",
     "token_healing", 400),
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


def test_api_keys_guard_every_route_but_the_probes(monkeypatch):
    """``--api-key`` (repeatable; ``$JDSPARK_API_KEY``): a request without ``Authorization: Bearer <one of them>``
    is a 401 in OpenAI's error body, on /v1 and /tokenize alike; /health, /ping, /version and /metrics stay open (a
    load balancer's probes, Prometheus), and a keyed request streams as any other."""
    from jdspark.serve import parse_args
    from tests.jdspark.serve_helpers import LiveServer

    s = LiveServer(num_slots=2, api_keys=("k1", "second key"))
    try:
        body = {"prompt": "abc", "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "Basic k1"}, {"Authorization": "k1"},
                        {"Authorization": "Bearer  k1x"}):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        for path in ("/v1/models", "/v1/models/scripted"):
            assert httpx.get(s.url + path).status_code == 401
        assert httpx.post(s.url + "/tokenize", json={"prompt": "ab"}).status_code == 401
        for key in ("k1", "second key"):
            r = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": f"bearer {key}"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("abc", 3)
        ok = {"Authorization": "Bearer k1"}
        assert httpx.post(s.url + "/tokenize", json={"prompt": "ab"}, headers=ok).status_code == 200
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, headers=ok) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert httpx.get(s.url + path).status_code == 200, path
        assert httpx.options(s.url + "/v1/completions").status_code != 401  # CORS preflight carries no key
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
        import serve_clients  # the load test's client sends the key


        assert serve_clients.HttpClient(s.url, api_key="k1").request([256, 97], 3, 0.0, 0, "fixed")["tokens"] == 3
        with pytest.raises(RuntimeError, match="HTTP 401"):
            serve_clients.HttpClient(s.url).request([256, 97], 3, 0.0, 0, "fixed")
    finally:
        s.close()
    monkeypatch.setenv("JDSPARK_API_KEY", "from-env")
    assert parse_args([]).api_key == ["from-env"] and parse_args(["--api-key", "a", "--api-key", "b"]).api_key == [
        "a", "b"]
    monkeypatch.delenv("JDSPARK_API_KEY")
    assert parse_args([]).api_key == []
    with pytest.raises(SystemExit):
        parse_args(["--api-key", " "])


def test_allowed_origins_answer_a_browser_s_preflight_and_mark_the_answers():
    """``--allowed-origins``: a listed origin's CORS preflight is answered and every answer to it (a 401 for a
    missing API key too, so the page can read why) carries Access-Control-Allow-Origin; another origin's gets none,
    nor does any origin on a server started without the flag (vLLM allows every origin by default)."""
    from jdspark.serve import parse_args
    from tests.jdspark.serve_helpers import LiveServer

    page, other = "http://localhost:3000", "http://evil.example"
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"prompt": "abc", "max_tokens": 2}
    s = LiveServer(num_slots=1, api_keys=("k",), allowed_origins=(page,))
    try:
        r = httpx.options(s.url + "/v1/completions", headers={"Origin": page, **pre})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Origin": page, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Origin": page})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == page
        assert httpx.options(s.url + "/v1/completions", headers={"Origin": other, **pre}).status_code == 400
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Origin": other, "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        s.close()
    s = LiveServer(num_slots=1)
    try:
        r = httpx.post(s.url + "/v1/completions", json=body, headers={"Origin": page})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        s.close()
    assert parse_args(["--allowed-origins", "http://a:1,https://b.example/"]).allowed_origins == (
        "http://a:1", "https://b.example")
    assert parse_args(["--allowed-origins", '["*"]']).allowed_origins == ("*",)
    for bad in ("ftp://x", "localhost:3000", ""):
        with pytest.raises(SystemExit):
            parse_args(["--allowed-origins", bad])


def test_a_body_past_the_limit_is_a_413_unread():
    """``--max-request-bytes``: a body declared or streamed past the limit is a 413 in OpenAI's error body on every
    route that reads one (the server keeps serving); a body within it that is past 64 KiB is parsed off the event
    loop and served as any other."""
    from jdspark.serve import parse_args
    from tests.jdspark.serve_helpers import LiveServer

    s = LiveServer(num_slots=1, max_request_bytes=200_000)
    try:
        big = {"prompt": "ab", "max_tokens": 2, "user": "x" * 300_000}
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
            r = httpx.post(s.url + path, json=big)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", path

        def chunks():  # no Content-Length: the limit is found while reading
            yield b'{"prompt": "ab", "user": "'
            for _ in range(30):
                yield b"x" * 10_000
            yield b'"}'

        r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "exceeds this server's limit of 200000 bytes" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={**big, "user": "x" * 150_000})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("ab", 2)
    finally:
        s.close()
    assert parse_args(["--max-request-bytes", "1000"]).max_request_bytes == 1000
    with pytest.raises(SystemExit):
        parse_args(["--max-request-bytes", "0"])
