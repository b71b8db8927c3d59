"""Tool calls (``jdspark.tool_calls``): Kimi K2's format parsed whole and streamed, the markers decoded where the
vocabulary has them as special tokens, and through a real uvicorn server (scripted backend, serve_helpers) whose
answer holds calls: the API's ``tool_calls`` (streamed and not), ``finish_reason`` "tool_calls", the tools and the
conversation's earlier calls rendered by the checkpoint's template, and the requests it refuses by name."""

import json

import httpx
import pytest

from jdspark import tool_calls as tc
from jdspark.serve_guided import guided_constraint
from jdspark.serve_request import ApiError, parse_completion
from kimi.tokenizer import ByteTokenizer, Tokenizer
from tests.jdspark.serve_helpers import LiveServer
from tests.kimi.test_tokenizer import hf_dir  # noqa: F401  (a tokenizer.json and its config)

B, E, CB, AB, CE = tc.SECTION_BEGIN, tc.SECTION_END, tc.CALL_BEGIN, tc.ARGUMENT_BEGIN, tc.CALL_END
ANSWER = (f"Let me check.{B}{CB}functions.get_weather:0{AB}{{\"city\": \"Paris\", \"days\": [1, 2]}}{CE}"
          f"{CB}functions.get_time:1{AB} {{\"tz\": \"CET\"}}\n{CE}{E}")
CALLS = [{"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": [1, 2]}"}},
         {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time",
                                                                         "arguments": "{\"tz\": \"CET\"}"}}]
# a Kimi-like template: tools declared in a system turn, earlier calls written back in Kimi's format
TEMPLATE = ("{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}"
            "<|im_end|>{% endif %}"
            "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
            "{% if 'tool_calls' in m %}" + B + "{% for c in m['tool_calls'] %}" + CB + "{{ c['id'] }}" + AB
            + "{{ c['function']['arguments'] }}" + CE + "{% endfor %}" + E + "{% endif %}"
            "{% if 'tool_call_id' in m %}[result of {{ m['tool_call_id'] }}]{% endif %}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_parse_finds_the_calls_and_the_content_before_them():
    content, calls = tc.parse(ANSWER)
    assert content == "Let me check." and [c.as_api() for c in calls] == CALLS
    assert tc.parse("no calls here") == ("no calls here", [])
    assert tc.parse(f"  {B}{CB}lookup:0{AB}{{}}{CE}")[0] is None  # blank content; a name without functions.
    assert tc.parse(f"{B}{CB}lookup:0{AB}{{}}{CE}")[1][0].name == "lookup"
    broken = f"text {B}{CB}functions.f:0{AB}{{\"a\": 1"  # cut off (max_tokens) before its call ended
    assert tc.parse(broken) == (broken, [])
    # only the first section's calls; what follows its end is not a call
    _, calls = tc.parse(f"{B}{CB}functions.a:0{AB}1{CE}{E} then {CB}functions.b:1{AB}2{CE}")
    assert [c.name for c in calls] == ["a"]


def merged(deltas) -> list:
    """Streamed tool-call deltas joined per index as a client does: the first names the call, the rest append
    to its arguments."""
    calls = []
    for d in deltas:
        if d["index"] == len(calls):
            calls.append({k: v for k, v in d.items() if k != "index"})
            calls[-1]["function"] = dict(d["function"])
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_splitter_streams_the_content_and_the_calls_as_they_come(piece):
    sp = tc.Splitter()
    sent, deltas, before_end = "", [], 0
    for i in range(0, len(ANSWER), piece):
        text, got = sp.feed(ANSWER[i:i + piece])
        sent, deltas = sent + text, deltas + got
        if CE not in ANSWER[:i + piece]:  # the first call's arguments before its end marker came
            before_end = sum("arguments" in d["function"] and d["function"]["arguments"] != "" for d in deltas)
    rest, last, called = sp.finish()
    assert sent + rest == "Let me check." and B not in sent and called
    assert merged(deltas + last) == CALLS  # the pieces join to parse's calls
    assert before_end >= (2 if piece == 1 else 0)  # fed a character at a time, arguments streamed in pieces
    # a call cut off before its end (max_tokens) has streamed what it had; not complete: not "tool_calls"
    sp = tc.Splitter()
    cut = ANSWER[:ANSWER.index("[1, 2]")]
    content, deltas = sp.feed(cut)
    rest, last, called = sp.finish()
    assert content == "Let me check." and not called
    assert merged(deltas + last)[0]["function"]["arguments"] == '{"city": "Paris", "days":'
    # text that only looked like a marker's start is content after all
    sp = tc.Splitter()
    sent = sp.feed("a <|tool")[0] + sp.feed("_x|> b <|tool_calls_sec")[0]
    assert sent == "a <|tool_x|> b "
    assert sp.finish() == ("<|tool_calls_sec", [], False)
    # a section that never begins a call is content too
    sp = tc.Splitter()
    assert sp.feed(f"x{B}y")[0] == "x" and sp.finish() == (f"{B}y", [], False)


def test_markers_decode_where_they_are_special_tokens():
    names = {"<bos>": 256, "<eos>": 257, B: 258, E: 259, CB: 260, AB: 261, CE: 262}

    class Tok(Tokenizer):
        def _encode_ordinary(self, text):
            return list(text.encode())

    tok = Tok([bytes([b]) for b in range(256)], names)
    ids = tok.encode(ANSWER, allow_special=True) + [257]
    assert len(ids) < len(ANSWER) and tc.marker_ids(tok) == frozenset(range(258, 263))
    plain = ANSWER
    for m in tc.MARKERS:
        plain = plain.replace(m, "")
    assert tok.decode(ids) == plain  # the default drops every special token
    dec = tok.incremental_decoder(keep_special=tc.marker_ids(tok))
    assert "".join(dec.add([i]) for i in ids) + dec.flush() == ANSWER  # the markers kept, EOS still dropped
    assert tc.marker_ids(ByteTokenizer()) == frozenset()


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(num_slots=2, chat_template=TEMPLATE, reply=ByteTokenizer().encode(ANSWER))
    yield s
    s.close()


def _chat(srv, body, stream=False):
    if not stream:
        return httpx.post(srv.url + "/v1/chat/completions", json=body)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]


def test_served_tool_calls_streamed_and_not(srv):
    body = {"messages": [{"role": "user", "content": "[reply] weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 400}
    r = _chat(srv, body).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
    assert c["message"]["tool_calls"] == CALLS
    chunks = _chat(srv, body, stream=True)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."  # no marker leaked into content
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert merged(streamed) == CALLS and len(streamed) > len(CALLS)  # the arguments came in pieces
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == ["tool_calls"]
    # without tools (or with tool_choice "none") the same answer is text
    for extra in ({"tools": None}, {"tool_choice": "none"}):
        plain = _chat(srv, {**body, **extra}).json()["choices"][0]
        assert plain["finish_reason"] == "stop" and plain["message"]["content"] == ANSWER
        assert "tool_calls" not in plain["message"]


def test_tools_and_earlier_calls_are_rendered_by_the_template():
    tok = ByteTokenizer(chat_template=TEMPLATE)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    q = parse_completion({"messages": msgs, "tools": TOOLS}, tokenizer=tok, vocab_size=tok.vocab_size,
                         max_context=4096, model_name="m", chat=True, tool_parser="kimi_k2")
    assert q.tools
    want = tok.apply_chat_template([msgs[0], {**msgs[1], "content": ""}, msgs[2]], tools=TOOLS)
    assert tok.decode(q.sampling.prompt_ids) == want
    assert json.dumps(TOOLS, separators=(",", ":")) in want and "[result of" in want
    assert f"{CB}functions.get_weather:0{AB}" in want


BAD = [
    ({"tools": [{"type": "function"}]}, "'tools' must be a list", "tools"),
    ({"tool_choice": "required"}, "'tool_choice' forces a call but no tools are given", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "forces a call to 'get_date', which is not among the tools", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "'tool_choice' must be \"auto\", \"none\", \"required\"", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
      "tool_choice": "required"}, "this server takes at most 32 (--guided-states)", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "x"}, "give one of", "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     "tool_calls must be a list", "messages"),
]


@pytest.mark.parametrize("extra,message,param", BAD)
def test_bad_tool_requests_are_refused_by_name(srv, extra, message, param):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    r = _chat(srv, body)
    assert r.status_code == 400 and message in r.json()["error"]["message"] and r.json()["error"]["param"] == param


def test_forced_tool_calls_are_constrained_to_the_tools_format():
    """tool_choice "required": the answer is the K2 section of one call or more, to any of the tools, arguments
    valid under each tool's parameters; a named function: exactly one call, to it. Walked on the request's table
    (the markers as text here, and as special tokens through a vocabulary that has them)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}},
        "required": ["city"]}}}, {"type": "function", "function": {"name": "get_time"}}]
    weather = f'{CB}functions.get_weather:0{AB}{{"city": "Paris", "days": 3}}{CE}'
    time_ = f'{CB}functions.get_time:1{AB}{{"tz": "CET"}}{CE}'
    texts = {"one": B + weather + E, "two": B + weather + time_ + E, "time": B + time_ + E,
             "content first": "Sure." + B + weather + E, "bad arguments": B + weather.replace("3", "9") + E,
             "no section end": B + weather, "unknown tool": B + weather.replace("get_weather", "get_w") + E,
             "no call": B + E}
    want = {"required": {"one", "two", "time"}, "get_time": {"time"}, "get_weather": {"one"}}
    tok = ByteTokenizer(chat_template=TEMPLATE)

    class Tok(Tokenizer):  # the markers as special tokens, as K2 / K3 ship them
        def _encode_ordinary(self, text):
            return list(text.encode())

    special = Tok([bytes([b]) for b in range(256)], {"<bos>": 256, "<eos>": 257, B: 258, E: 259, CB: 260, AB: 261,
                                                     CE: 262})

    def ends(table, ids, eos):
        state = 0
        for t in ids:
            state = int(table[state, t]) if state >= 0 else -1
        return state >= 0 and int(table[state, eos]) == state

    for choice, taken in want.items():
        tc_ = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
        body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": tc_}
        q = parse_completion(body, tokenizer=tok, vocab_size=tok.vocab_size, max_context=4096, model_name="m",
                             chat=True, tool_parser="kimi_k2", guided_states=4096)
        assert q.tools
        table = guided_constraint(body, special, special.vocab_size, 4096, False, ()).next_QV
        for name, text in texts.items():
            assert ends(q.sampling.grammar.next_QV, tok.encode(text), tok.eos_id) == (name in taken), (choice, name)
            ids = special.encode(text, allow_special=True)
            assert ends(table, ids, 257) == (name in taken), (choice, name)


def test_tools_where_they_cannot_be_served():
    tok = ByteTokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")  # renders no tools
    kw = dict(tokenizer=tok, vocab_size=tok.vocab_size, max_context=4096, model_name="m")
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for body, chat_, parser, message in [(chat, True, "kimi_k2", "renders no tools"),
                                         (chat, True, None, "--tool-call-parser none"),
                                         ({"prompt": "x", "tools": TOOLS}, False, "kimi_k2", "only taken on")]:
        with pytest.raises(ApiError, match=message) as e:
            parse_completion(body, chat=chat_, tool_parser=parser, **kw)
        assert e.value.status == 400 and e.value.param == "tools"
    assert not parse_completion({**chat, "tool_choice": "none"}, chat=True, tool_parser=None, **kw).tools


def test_tools_render_as_transformers_renders_them(hf_dir):  # noqa: F811
    """Our chat template rendering with ``tools`` and tool-call turns equals transformers' apply_chat_template of
    the same template (the independent renderer checkpoints are written for)."""
    from transformers import PreTrainedTokenizerFast

    from kimi.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    tok.chat_template = TEMPLATE
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), chat_template=TEMPLATE)
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"}]
    for tools in (TOOLS, None):
        assert tok.apply_chat_template(msgs, tools=tools) == ref.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    # what else transformers' environment offers templates: loop controls, generation blocks, tojson's options
    extra = ("{% for m in messages %}{% if m['role'] == 'tool' %}{% break %}{% endif %}{% generation %}"
             "{{ m['content'] }}{% endgeneration %}|{% endfor %}{{ tools | tojson(indent=1, sort_keys=True) }}")
    tok.chat_template = ref.chat_template = extra
    assert tok.apply_chat_template(msgs, tools=TOOLS) == ref.apply_chat_template(
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_the_plain_template_renders_tools_in_kimi_s_layout(hf_dir):  # noqa: F811
    """``PLAIN_CHAT_TEMPLATE`` (the fallback, and the shipped pair's template): a conversation without tools renders
    as the layout did before tools were added to it; with tools, calls and results, as transformers renders the same
    template, in the layout ``tool_calls`` parses; and the shipped pair serves a forced call with it."""
    from transformers import PreTrainedTokenizerFast

    from kimi.tokenizer import PLAIN_CHAT_TEMPLATE, load_tokenizer

    before = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
              "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    new, old = ByteTokenizer(chat_template=PLAIN_CHAT_TEMPLATE), ByteTokenizer(chat_template=before)
    for add in (True, False):
        assert new.apply_chat_template(plain, add_generation_prompt=add) == old.apply_chat_template(
            plain, add_generation_prompt=add)
    tok = load_tokenizer(hf_dir)
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), chat_template=PLAIN_CHAT_TEMPLATE)
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me check.",
                                                      "tool_calls": CALLS[:1]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS)
    assert text == ref.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, separators=(",", ":")))
    assistant = text[text.index("<|im_assistant|>assistant<|im_middle|>") + 38:]
    content, calls = tc.parse(assistant[:assistant.index("<|im_end|>")])
    assert content == "Let me check." and [c.as_api() for c in calls] == CALLS[:1]
    assert "<|im_tool|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in text
    # the shipped pair's tokenizer carries this template, and takes a forced call (the markers walked as text)
    shipped = load_tokenizer("checkpoints/default/target")
    assert shipped.chat_template == PLAIN_CHAT_TEMPLATE
    parsed = parse_completion({"messages": msgs[:1], "tools": TOOLS, "tool_choice": "required"}, tokenizer=shipped,
                              vocab_size=4096, max_context=4096, model_name="m", chat=True, tool_parser="kimi_k2",
                              guided_states=1024)
    assert parsed.tools and parsed.sampling.grammar is not None
    assert "<|im_system|>tool_declare<|im_middle|>[" in shipped.decode(parsed.sampling.prompt_ids, skip_special=False)
