"""What a served request can ask beyond text, on a real uvicorn (loopback port), model scripted (serve_helpers):
log-probabilities (completions, chat, echo, prompt_logprobs), n choices and lists of prompts, best_of, constrained
decoding's automata reaching the backend, 429 on a full queue, a disconnect mid-stream freeing its slot, token
healing, and the waiting queue ordered by priority."""

import concurrent.futures as cf
import json
import time

import httpx
import numpy as np
import pytest

from jdspark.grammar import choice_fsm, regex_fsm
from jdspark.json_schema import schema_regex
from jdspark.serve_request import ApiError, parse_completion
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.serve_helpers import (
    LiveServer,
    expected_text,
    metric,
    metrics,
    scripted_logprob,
    scripted_rank,
    sse_chunks,
    wait_for,
    wait_idle,
)


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
    chunks = sse_chunks(srv, "/v1/completions", body)
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
    streamed = [e for ch in sse_chunks(srv, "/v1/chat/completions", chat) if ch["choices"]
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
    chunks = sse_chunks(srv, "/v1/completions", body)
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


def test_token_healing_leaves_the_healed_text_out(srv):
    """``"token_healing": true`` (an extension field): the backend gets the prompt without its last token and the
    ids its first token may be (the scripted backend draws the first of them, the healed byte itself), and the
    answer's text leaves that byte out (its client sent it), streamed and not, echoed after the whole prompt; a stop
    string equal to the healed text is matched in the answer's own text only; usage counts the ids prefilled. A chat
    that continues its final message ends in that text too, and is healed as a completion; any other chat prompt
    ends on its template's tokens: refused there by name."""
    body = {"prompt": "abc", "max_tokens": 5, "token_healing": True, "stop": ["c"]}
    r = httpx.post(srv.url + "/v1/completions", json=body).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("defg", "length")
    sp = srv.backend.requests[-1]
    assert sp.prompt_ids == (256, 97, 98) and sp.first_token_ids == (99,)  # BOS "ab"; "c" may begin the answer
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (3, 5)
    assert "".join(c["choices"][0]["text"] for c in sse_chunks(srv, "/v1/completions", body)) == "defg"
    echoed = httpx.post(srv.url + "/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "abcdefg"
    plain = httpx.post(srv.url + "/v1/completions", json={**body, "token_healing": False}).json()["choices"][0]
    assert plain["text"] == "defgh" and srv.backend.requests[-1].first_token_ids == ()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abc"}]
    cont = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
            "token_healing": True}
    r = httpx.post(srv.url + "/v1/chat/completions", json=cont).json()
    assert r["choices"][0]["message"]["content"] == "de" and srv.backend.requests[-1].first_token_ids == (99,)
    assert srv.backend.requests[-1].prompt_ids[-1] == ord("b")
    r = httpx.post(srv.url + "/v1/chat/completions", json={**cont, "token_healing": False}).json()
    assert r["choices"][0]["message"]["content"] == "def"
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs[:1], "token_healing": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing"


def test_a_server_healing_by_default_yields_to_what_healing_is_not_served_with():
    """``--token-healing`` (``parse_completion(token_healing=True)``): a completions prompt is healed unless it says
    ``"token_healing": false``, or asks for what healing is not served with (log-probabilities, a constraint):
    then it is served unhealed, not refused; a chat prompt only where it continues its final message."""
    tok = ByteTokenizer()
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=256, model_name="m", max_logprobs=2,
              guided_states=64, token_healing=True)
    healed = parse_completion({"prompt": "ab"}, **kw)
    assert healed.sampling.prompt_ids == (256, 97) and healed.sampling.first_token_ids == (98,)
    assert healed.healed == "b"
    for body in ({"prompt": "ab", "token_healing": False}, {"prompt": "ab", "logprobs": 1},
                 {"prompt": "ab", "guided_regex": "x"}):
        p = parse_completion(body, **kw)
        assert p.sampling.prompt_ids == (256, 97, 98) and p.sampling.first_token_ids == () and p.healed == ""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    chat = parse_completion({"messages": msgs[:1]}, chat=True, **kw)
    assert chat.sampling.first_token_ids == () and chat.healed == ""
    cont = parse_completion({"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
                            chat=True, **kw)
    assert cont.healed == "b" and cont.sampling.first_token_ids == (98,)
    assert parse_completion({"prompt": [256]}, **kw).healed == ""  # nothing before the last token: not healed


def test_a_server_without_logprobs_refuses_them():
    tok = ByteTokenizer()
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=1024, model_name="m", max_logprobs=None)
    for body, chat in [({"prompt": "x", "logprobs": 0}, False),
                       ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, True)]:
        with pytest.raises(ApiError, match="log-probabilities") as e:
            parse_completion(body, chat=chat, **kw)
        assert e.value.status == 400 and e.value.param == "logprobs"
    assert parse_completion({"prompt": "x", "logprobs": None}, **kw)[0].logprobs is None



def test_full_queue_answers_429_then_drains(srv):
    srv.backend.gate.clear()  # the engine's next step stalls: 1 request in a slot, then 8 waiting, then 429
    post = lambda: httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 4}, timeout=30)
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(post)]
            wait_for(srv, "vllm:num_requests_running", 1)
            futs += [ex.submit(post) for _ in range(8)]
            wait_for(srv, "vllm:num_requests_waiting", 8)
            r = post()
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.json()["error"]["type"] == "rate_limit_error"
            # n choices are queued together or not at all; more than the queue could ever hold is a 400
            many = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "n": 2})
            assert many.status_code == 429 and "2 more do not fit" in many.json()["error"]["message"]
            assert metric(metrics(srv), "vllm:num_requests_waiting") == 8
            srv.backend.gate.set()
            assert [f.result().status_code for f in futs] == [200] * 9
    finally:
        srv.backend.gate.set()
    wait_idle(srv)


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
    streamed = sse_chunks(srv, "/v1/chat/completions", chat)
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
    streamed = sse_chunks(srv, "/v1/completions", {**body, "stream": True})
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
        # (the first builds the schema's automaton over the vocabulary: seconds on a loaded 2-core machine, past
        # httpx's default 5 s timeout when another test process shares the cores)
        r = httpx.post(srv.url + path, json={"max_tokens": 4, **body}, timeout=120)
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
    before = metric(metrics(srv), "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={"prompt": "z", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # closing the stream drops the connection
    m = wait_idle(srv)
    assert metric(m, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert sorted(srv.backend.last) == []  # every slot freed on the device side too
    with httpx.stream("POST", srv.url + "/v1/completions",  # n choices: every one of them
                      json={"prompt": "z", "max_tokens": 3000, "stream": True, "ignore_eos": True, "n": 3}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    m = wait_idle(srv)
    assert metric(m, "vllm:request_success_total", finished_reason="abort") == before + 4
    assert sorted(srv.backend.last) == []


def test_priority_reaches_the_engine_where_the_server_schedules_by_it():
    """``--scheduling-policy priority``: a request's ``priority`` (any integer; default 0) is its engine request's;
    under first come, first served only 0 is taken (the 400 is test_serve's)."""
    tok = ByteTokenizer()
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=64, model_name="m")
    assert parse_completion({"prompt": "ab", "priority": -3}, priority_scheduling=True, **kw).priority == -3
    assert parse_completion({"prompt": "ab"}, priority_scheduling=True, **kw).priority == 0
    assert parse_completion({"prompt": "ab", "priority": 0}, **kw).priority == 0
    from jdspark.serve_responses import chat_body  # the Responses API passes it on

    chat, _ = chat_body({"input": "q", "priority": 4, "max_output_tokens": 2})
    assert parse_completion(chat, chat=True, priority_scheduling=True, **{**kw, "max_context": 256}).priority == 4


def test_a_priority_server_queues_requests_by_their_priority():
    """Over HTTP: with the one slot busy, later requests wait in the engine's queue in order of their priority."""
    s = LiveServer(num_slots=1, priority_scheduling=True)
    s.backend.gate.clear()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            futs = []
            for i, prio in enumerate((9, 5, -2, 0)):
                futs.append(pool.submit(httpx.post, s.url + "/v1/completions", json={
                    "prompt": "ab", "max_tokens": 2, "priority": prio}, timeout=60))
                deadline = time.time() + 20
                while len(s.backend.requests) + len(s.engine.waiting) < i + 1:  # arrived, in this order
                    assert time.time() < deadline
                    time.sleep(0.01)
            assert [r.priority for r in s.engine.waiting] == [-2, 0, 5]
            s.backend.gate.set()
            assert all(f.result().status_code == 200 for f in futs)
    finally:
        s.close()
