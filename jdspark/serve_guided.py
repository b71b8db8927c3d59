"""A request's output constraint (constrained decoding, ``--guided-states Q``), from whichever way the client asks:

    vLLM        guided_choice [..] | guided_regex ".." | guided_json {schema} or its JSON text
                structured_outputs {"choice": [..]} | {"regex": ".."} | {"json": {schema}} | {"json_object": true}
    OpenAI      response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ..}}
                ({"type": "text"}: none); the Responses API's text.format arrives here as response_format;
                chat's tool_choice "required" / {"type": "function", "function": {"name"}} (a forced tool call)

A choice list becomes a trie, the rest a regular expression (JSON through ``jdspark.json_schema``) and its minimal
byte automaton (``jdspark.grammar``), lifted to the vocabulary with EOS and the request's stop ids allowed where a
text may end; a forced tool call is the K2 section of calls whose arguments each tool's ``parameters`` schema
validates (``tool_call_regex``; its markers walked as text where they are special tokens). A chat whose template
opened a think block (``--reasoning-parser``) reasons freely up to its ``</think>`` first, as vLLM orders them
(``grammar.after_marker``). Lifted tables are kept (least recently used, ``_CACHED``): clients repeat a schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional

from jdspark import reasoning, tool_calls
from jdspark.grammar import TokenFSM, after_marker, choice_automaton, regex_automaton, vocab_fsm
from jdspark.json_schema import any_object_regex, literal, schema_regex
from jdspark.serve_errors import ApiError

__all__ = ["GUIDED_FIELDS", "forced_tool", "guided_constraint", "guided_request", "tool_call_regex"]

GUIDED_FIELDS = ("guided_choice", "guided_regex", "guided_json", "structured_outputs", "response_format")
_STRUCTURED = {"choice", "regex", "json", "json_object"}
_CACHED: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (tokenizer, TokenFSM, its token classes)
_CACHE_SIZE = 16
_LOCK = threading.Lock()


def guided_request(body: dict) -> Optional[tuple]:
    """(the field asked through, "choice" | "regex" | "json", its value: the choices, a pattern or a schema
    (``True``: any object)), or None when the body asks for no constraint; a 400 for a malformed one."""
    asked = {k: body[k] for k in GUIDED_FIELDS if body.get(k) is not None}
    if asked.get("response_format") == {"type": "text"}:
        del asked["response_format"]
    forced = forced_tool(body.get("tool_choice")) if body.get("tools") else None
    if forced is not None:
        asked["tool_choice"] = body["tool_choice"]
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"give one of {sorted(asked)}", sorted(asked)[-1])
    (name, value), = asked.items()
    if name == "tool_choice":
        try:
            return name, "regex", tool_call_regex(body["tools"], None if forced is True else forced)
        except ValueError as e:
            raise ApiError(400, f"'tool_choice': {e}", name) from None
    if name == "response_format":
        kind, value = _response_format(value)
    elif name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1 or not set(value) <= _STRUCTURED:
            other = sorted(set(value) - _STRUCTURED) if isinstance(value, dict) else []
            raise ApiError(400, f"'structured_outputs' {other or 'form'} is not supported (it takes one of "
                                f"{sorted(_STRUCTURED)}: grammars and structural tags are not built)", name,
                           code="unsupported")
        (kind, value), = value.items()
        if kind == "json_object":
            if value is not True:
                raise ApiError(400, "'structured_outputs.json_object' must be true", name)
            kind = "json"
    else:
        kind = name.removeprefix("guided_")
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise ApiError(400, f"'{name}' must be a non-empty list of non-empty strings", name)
    if kind == "regex" and (not isinstance(value, str) or not value):
        raise ApiError(400, f"'{name}' must be a non-empty regular expression", name)
    if kind == "json" and isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, f"'{name}': the schema is not valid JSON", name) from None
    if kind == "json" and not isinstance(value, (dict, bool)):
        raise ApiError(400, f"'{name}' must be a JSON Schema (an object)", name)
    return name, kind, value


def forced_tool(choice):
    """What a chat's ``tool_choice`` forces: True ("required": one call or more, to any of the tools), a function's
    name (exactly one call, to it), or None (nothing: "auto", "none", absent or malformed)."""
    if choice == "required":
        return True
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str) and choice["function"]["name"]:
        return choice["function"]["name"]
    return None


def tool_call_regex(tools: list, only: Optional[str] = None) -> str:
    """The text of forced tool calls in Kimi K2's format (``jdspark.tool_calls``): the section's markers around one
    call or more (``only``: exactly one, to that function), each ``functions.NAME:IDX`` then arguments that
    NAME's ``parameters`` schema validates (``jdspark.json_schema``; no parameters: any object)."""
    calls = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters")
        try:
            args = any_object_regex() if params is None else schema_regex(params)
        except ValueError as e:
            raise ValueError(f"tool {fn['name']!r}: {e}") from None
        calls.append(literal(f"functions.{fn['name']}:") + "[0-9]{1,3}" + literal(tool_calls.ARGUMENT_BEGIN)
                     + args)
    call = literal(tool_calls.CALL_BEGIN) + "(?:" + "|".join(calls) + ")" + literal(tool_calls.CALL_END)
    return (literal(tool_calls.SECTION_BEGIN) + call + ("" if only is not None else f"(?:{call})*")
            + literal(tool_calls.SECTION_END))


def _response_format(fmt) -> tuple:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       "response_format")
    if fmt["type"] == "json_object":
        return "json", True
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ApiError(400, "'response_format' json_schema: expected {\"json_schema\": {\"name\": ..., \"schema\": "
                            "{...}}}", "response_format")
    return "json", spec.get("schema", True)


def guided_constraint(body: dict, tokenizer, vocab_size: int, guided_states: int, ignore_eos: bool,
                      stop_ids, reasoning_first: bool = False,
                      guided_classes: Optional[int] = None) -> Optional[TokenFSM]:
    """The request's constraint over the vocabulary (None: none asked; module doc), or a 400 naming the field: a
    form not taken, a server started without ``--guided-states``, or an automaton of more states than it takes.
    ``reasoning_first``: the chat template opened a think block; the reasoning is free up to its ``</think>``
    (vLLM's order: structured output after the reasoning), and the constraint holds from there.
    ``guided_classes``: the most token classes a slot's table holds (``grammar.token_classes``; None: any)."""
    asked = guided_request(body)
    if asked is None:
        return None
    name, kind, value = asked
    if not guided_states:
        raise ApiError(400, f"'{name}': constrained decoding is off on this server (start it with --guided-states Q)",
                       name, code="unsupported")
    if ignore_eos or tokenizer.eos_id is None:
        raise ApiError(400, f"'{name}' ends the answer with EOS: not with ignore_eos (or a tokenizer without one)",
                       name)
    stops = (tokenizer.eos_id, *stop_ids)
    key = (id(tokenizer), vocab_size, kind, json.dumps(value, sort_keys=True), stops, reasoning_first)
    with _LOCK:  # requests are parsed on worker threads
        hit = _CACHED.get(key)
        if hit is not None and hit[0] is tokenizer:  # (the id of a tokenizer since freed is not a hit)
            _CACHED.move_to_end(key)
    if hit is not None and hit[0] is tokenizer:
        fsm, classes = hit[1], hit[2]
        if fsm.num_states > guided_states:
            raise ApiError(400, f"'{name}': an automaton of {fsm.num_states} states; this server takes at most "
                                f"{guided_states} (--guided-states)", name)
    else:
        try:
            if kind == "choice":
                automaton = choice_automaton([c.encode("utf-8") for c in value])
            else:
                pattern = value if kind == "regex" else any_object_regex() if value is True else schema_regex(value)
                automaton = regex_automaton(pattern)
        except ValueError as e:  # a pattern or schema not taken (what, where), or too large
            raise ApiError(400, f"'{name}': {e}", name) from None
        if reasoning_first:
            automaton = after_marker(automaton, reasoning.THINK_END.encode("utf-8"))
        states = automaton[0].shape[0]
        if states > guided_states:  # before lifting it to the vocabulary (Q x V)
            what = {"choice": "the choices make", "regex": "the pattern makes", "json": "the schema makes"}[kind]
            raise ApiError(400, f"'{name}': {what} an automaton of {states} states; this server takes at most "
                                f"{guided_states} (--guided-states)", name)
        as_text = (reasoning.marker_ids(tokenizer) if reasoning_first else frozenset()) | (
            tool_calls.marker_ids(tokenizer) if name == "tool_choice" else frozenset())
        fsm = vocab_fsm(automaton, tokenizer, vocab_size, stops, specials_as_text=as_text)
        classes = fsm.classes[0].shape[1]  # (kept with the table: the slots insert it by classes)
        with _LOCK:
            _CACHED[key] = (tokenizer, fsm, classes)
            while len(_CACHED) > _CACHE_SIZE:
                _CACHED.popitem(last=False)
    if guided_classes is not None and classes > guided_classes:
        raise ApiError(400, f"'{name}': the automaton tells {classes} token classes apart; this server takes at most "
                            f"{guided_classes} (--guided-classes)", name)
    return fsm
