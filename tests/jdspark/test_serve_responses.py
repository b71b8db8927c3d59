"""OpenAI's Responses API (``POST /v1/responses``, ``jdspark.serve_responses``) through a real uvicorn server with
the scripted backend (serve_helpers): the chat body a Responses body becomes (the prompt the backend is handed is
the chat completion's of the same conversation), the output items (reasoning, message, function calls), status and
usage, the typed streamed events (whose deltas join to the non-streamed items), and the requests refused by name."""

import json
import time

import httpx
import pytest

from jdspark.serve_responses import chat_body
from tests.jdspark.serve_helpers import expected_text
from tests.jdspark.test_reasoning import srv  # noqa: F401  (a server whose answers think, and call tools)
from tests.jdspark.test_tool_calls import CALLS

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]


def _post(srv, body):  # noqa: F811
    return httpx.post(srv.url + "/v1/responses", json=body)


def _events(srv, body) -> list:  # noqa: F811
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    kinds = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    events = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert [e["type"] for e in events] == kinds  # each event: its type line, then its data
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_input_and_instructions_as_a_chat_conversation(srv):  # noqa: F811
    """A string input with instructions is the chat [system, user]: the backend gets that prompt; the answer is one
    message; cut by max_output_tokens the response is incomplete; usage in the API's names plus acceptance."""
    body = {"input": "count", "instructions": "be brief", "max_output_tokens": 6, "ignore_eos": True,
            "metadata": {"run": "1"}}
    r = _post(srv, body)
    assert r.status_code == 200, r.text
    resp = r.json()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    prompt = srv.tok.apply_chat_template(msgs)
    want = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert srv.backend.requests[-1].prompt_ids == tuple(want)
    assert resp["object"] == "response" and resp["id"].startswith("resp_") and resp["model"] == "scripted"
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = resp["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["text"] == expected_text(prompt, 6)
    u = resp["usage"]
    assert u["input_tokens"] == len(srv.backend.requests[-1].prompt_ids) and u["output_tokens"] == 6
    assert u["total_tokens"] == u["input_tokens"] + 6 and u["output_tokens_details"]["reasoning_tokens"] == 0
    assert u["drafted"] >= u["accepted"] > 0
    assert (resp["instructions"], resp["max_output_tokens"], resp["metadata"], resp["store"]) == \
           ("be brief", 6, {"run": "1"}, False)


def test_default_length_is_the_rest_of_the_context_and_reasoning_is_an_item(srv):  # noqa: F811
    """Without max_output_tokens the answer runs to its end (here the scripted reply's EOS): completed; with the
    reasoning parser the think block is a reasoning item before the message."""
    resp = _post(srv, {"input": "[think] weather?"}).json()
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    assert srv.backend.requests[-1].max_tokens == 4096 - len(srv.backend.requests[-1].prompt_ids)
    reasoning, message = resp["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Paris is in France."
    assert message["content"][0]["text"] == "It is sunny."
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Paris is in France.")  # bytes


def test_function_calls_streamed_and_not_and_their_results_rendered_back(srv):  # noqa: F811
    """The answer's tool calls are function_call items (call_id the model's id); streamed, their arguments come as
    deltas that join to the same; a next turn's function_call / function_call_output items render as the chat's
    assistant tool_calls and tool messages."""
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "[reply] weather in Paris?"}]}],
            "tools": TOOLS, "max_output_tokens": 400}
    resp = _post(srv, body).json()
    kinds = [it["type"] for it in resp["output"]]
    assert kinds == ["reasoning", "message", "function_call", "function_call"], kinds
    assert resp["output"][1]["content"][0]["text"] == "Let me check."
    calls = [(it["call_id"], it["name"], it["arguments"]) for it in resp["output"][2:]]
    assert calls == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
    events = _events(srv, body)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    done = events[-1]["response"]
    assert [it["type"] for it in done["output"]] == kinds
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == kinds and types.count("response.output_item.done") == 4
    for k, it in enumerate(done["output"]):
        if it["type"] == "function_call":
            args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                           and e["output_index"] == k)
            assert args == it["arguments"] == resp["output"][k]["arguments"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert (thought, text) == ("Need the weather tool.", "Let me check.")
    nxt = {"input": [{"role": "user", "content": "weather in Paris?"},
                     *[{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"]} for c in CALLS],
                     {"type": "function_call_output", "call_id": CALLS[0]["id"], "output": "sunny"}],
           "tools": TOOLS, "max_output_tokens": 3}
    assert _post(srv, nxt).status_code == 200
    chat_msgs = [{"role": "user", "content": "weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": CALLS},
                 {"role": "tool", "tool_call_id": CALLS[0]["id"], "content": "sunny"}]
    want = httpx.post(srv.url + "/tokenize", json={"messages": chat_msgs, "tools": [
        {"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS]})
    assert srv.backend.requests[-1].prompt_ids == tuple(want.json()["tokens"])


def test_streamed_text_equals_the_whole_response(srv):  # noqa: F811
    body = {"input": "hello", "max_output_tokens": 9, "ignore_eos": True}
    events = _events(srv, body)
    whole = _post(srv, body).json()
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * (len(types) - 8) + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"] and len(types) > 9
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] == events[-1]["response"]["output"][0]["content"][0][
        "text"]
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["usage"]["output_tokens"] == 9


@pytest.mark.parametrize("body,message,param", [
    ({}, "'input' must be a string or a non-empty list", "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "'previous_response_id' = \"resp_1\" is not supported",
     "previous_response_id"),
    ({"input": "x", "background": True}, "'background' = true is not supported", "background"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "'text.format' must be {\"type\": \"text\"", "text"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "the schema makes an automaton of",
     "response_format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools are served here", "tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning' is not taken here", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be user, assistant, system or developer", "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs string call_id, name and arguments", "input"),
    ({"input": "x", "max_output_tokens": "5"}, "'max_output_tokens' must be an integer >= 1", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "'max_tokens' must be an integer >= 1", "max_tokens"),
    ({"input": "x", "instructions": 3}, "'instructions' must be a string", "instructions"),
    ({"input": "x", "truncation": "middle"}, "'truncation' must be", "truncation"),
    ({"input": "x", "tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {}}}]}, "this server takes at most 32 (--guided-states)", "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
     "forces a call to 'nope', which is not among the tools", "tool_choice"),
    ({"input": "x", "model": "gpt-9"}, "does not exist", "model"),
])
def test_bad_requests_are_refused_by_name(srv, body, message, param):  # noqa: F811
    r = _post(srv, body)
    assert r.status_code in (400, 404) and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param


def test_the_chat_body_of_settings():
    """reasoning.effort reaches the template as reasoning_effort (beside the request's own template kwargs),
    truncation "auto" is truncate_prompt_tokens -1, developer messages are system messages, vLLM's sampling
    extras pass through; a template kwargs value that is not an object is passed on for the chat check to refuse."""
    chat, meta = chat_body({"input": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
                            "reasoning": {"effort": "low"}, "chat_template_kwargs": {"thinking": True},
                            "truncation": "auto", "top_k": 5, "seed": 3, "user": "me"})
    assert chat["chat_template_kwargs"] == {"thinking": True, "reasoning_effort": "low"}
    assert chat["truncate_prompt_tokens"] == -1 and (chat["top_k"], chat["seed"]) == (5, 3)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] and "user" not in chat
    assert (meta["truncation"], meta["user"], meta["reasoning"]) == ("auto", "me", {"effort": "low"})
    assert chat_body({"input": "x", "chat_template_kwargs": [1]})[0]["chat_template_kwargs"] == [1]
    assert "chat_template_kwargs" not in chat_body({"input": "x"})[0]


def test_a_client_that_goes_away_mid_stream_frees_its_slot(srv):  # noqa: F811
    """A streamed response whose client disconnects is cancelled (an "abort", not a 3000-token answer run to its
    end): its slot is freed and nothing stays running."""
    before = _aborts(srv)
    with httpx.stream("POST", srv.url + "/v1/responses",
                      json={"input": "z", "max_output_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 12:
                break  # closing the stream drops the connection
    deadline = time.time() + 10
    while srv.backend.last or srv.engine.num_running or srv.engine.num_waiting:
        assert time.time() < deadline, "the response was not cancelled"
        time.sleep(0.05)
    assert _aborts(srv) == before + 1
    assert _post(srv, {"input": "after", "max_output_tokens": 2}).status_code == 200  # still serving


def _aborts(srv) -> float:  # noqa: F811
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in ln)
