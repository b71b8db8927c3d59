"""Reasoning split from the answer (``jdspark.reasoning``): whole texts and streamed pieces agree for every way a
think block may open (by the model, by the prompt, not at all) and end (or not, cut off), and through a real
uvicorn server (scripted backend): ``reasoning_content`` and ``content``, streamed and not, a thought followed by
tool calls, and a prompt that opens the block."""

import json

import httpx
import pytest

from jdspark import reasoning as rs
from jdspark.serve_request import parse_completion
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.serve_helpers import LiveServer
from tests.jdspark.test_tool_calls import ANSWER, CALLS, TEMPLATE, TOOLS

CASES = [  # (text, the prompt opened the block, reasoning, answer)
    ("<think>Paris is in France.</think>It is sunny.", False, "Paris is in France.", "It is sunny."),
    ("\n<think>a</think>\n\nb", False, "a", "\n\nb"),
    ("It is sunny.", False, None, "It is sunny."),
    ("  <thin", False, None, "  <thin"),  # looked like a marker, was not
    ("<think>still thinking", False, "still thinking", ""),  # cut off (max_tokens) while thinking
    ("I know this.</think>Yes.", True, "I know this.", "Yes."),
    ("no end", True, "no end", ""),
    ("x</thi", True, "x</thi", ""),
    ("</think>", True, "", ""),
]


@pytest.mark.parametrize("text,started,thought,answer", CASES)
def test_split_and_streamed_pieces_agree(text, started, thought, answer):
    assert rs.split(text, started) == (thought, answer)
    for piece in (1, 2, 5, 1000):
        sp = rs.Splitter(started)
        got = [sp.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [sp.finish()]
        assert "".join(r for r, _ in got) == (thought or "")
        assert "".join(a for _, a in got) == answer


def test_a_prompt_that_opens_the_block():
    tok = ByteTokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n")
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=4096, model_name="m", chat=True)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_completion(body, reasoning_parser="think", **kw).reasoning is True
    assert parse_completion(body, **kw).reasoning is None  # no parser: nothing is told apart
    assert parse_completion(body, reasoning_parser="think", **{**kw, "tokenizer": ByteTokenizer()}).reasoning is False


def test_constrained_output_comes_after_the_reasoning():
    """A template that opened a think block: the constraint (here a JSON schema) holds from the block's
    ``</think>`` on, the reasoning free before it (vLLM's order); with no reasoning parser, or a template that
    opens no block, it holds from the first token. Walked on the table the request carries."""
    tok = ByteTokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    kw = dict(vocab_size=tok.vocab_size, max_context=4096, model_name="m", chat=True, guided_states=64)

    def takes(fsm, text):
        q = 0
        for t in tok.encode(text):
            q = int(fsm.next_QV[q, t])
            if q < 0:
                return False
        return int(fsm.next_QV[q, tok.eos_id]) == q

    thinking = parse_completion(body, tokenizer=tok, reasoning_parser="think", **kw).sampling.grammar
    plain = parse_completion(body, tokenizer=tok, **kw).sampling.grammar
    other = parse_completion(body, tokenizer=ByteTokenizer(), reasoning_parser="think", **kw).sampling.grammar
    answer = '{"ok": true}'
    for text, want in ((answer, (False, True, True)), ("x < /think> </thin</think>" + answer, (True, False, False)),
                       ("</think>" + answer, (True, False, False)), ("why</think> " + answer, (False,) * 3),
                       ("a</think>" + answer + "</think>", (False,) * 3), ("a</think>{\"ok\": 1}", (False,) * 3)):
        assert (takes(thinking, text), takes(plain, text), takes(other, text)) == want, text
    assert thinking.num_states == plain.num_states + len("</think>")


@pytest.fixture(scope="module")
def srv():
    enc = ByteTokenizer().encode
    s = LiveServer(num_slots=2, chat_template=TEMPLATE, reasoning_parser="think",
                   reply={b"[think]": enc("<think>Paris is in France.</think>It is sunny."),
                          b"[reply]": enc("<think>Need the weather tool.</think>" + ANSWER)})
    yield s
    s.close()


def _stream(srv, body):
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]


def test_served_reasoning_streamed_and_not(srv):
    body = {"messages": [{"role": "user", "content": "[think] weather?"}], "max_tokens": 100}
    m = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert m["reasoning_content"] == "Paris is in France." and m["content"] == "It is sunny."
    deltas = [c["choices"][0]["delta"] for c in _stream(srv, body)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is in France."
    assert "".join(d.get("content", "") for d in deltas) == "It is sunny."
    first_answer = next(k for k, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_answer:])  # the thought comes first
    # a thought, then tool calls: the calls read from the answer after it
    tools = {"messages": [{"role": "user", "content": "[reply] weather?"}], "tools": TOOLS, "max_tokens": 400}
    c = httpx.post(srv.url + "/v1/chat/completions", json=tools).json()["choices"][0]
    assert c["message"]["reasoning_content"] == "Need the weather tool."
    assert c["message"]["content"] == "Let me check." and c["message"]["tool_calls"] == CALLS
    assert c["finish_reason"] == "tool_calls"
    deltas = [ch["choices"][0]["delta"] for ch in _stream(srv, tools)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather tool."
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    assert [t["id"] for d in deltas for t in d.get("tool_calls", []) if "id" in t] == [x["id"] for x in CALLS]
    # completions are not split
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "[think]", "max_tokens": 100}).json()
    assert r["choices"][0]["text"] == "<think>Paris is in France.</think>It is sunny."
