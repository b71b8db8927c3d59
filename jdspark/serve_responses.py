"""OpenAI's Responses API (``POST /v1/responses``, what newer agent clients speak) over the chat path.

A Responses body is translated into a chat completions body (``chat_body``) and served as one (the same
validation, template, tools, reasoning parser, sampling and engine), then its answer is shaped as a ``response``
object (``response_object``) or streamed as the API's typed events (``stream_events``):

    input                 a string (one user message) or a list of items: messages ({"role", "content"}, content a
                          string or parts of type input_text / output_text / input_image), ``function_call``
                          items (an assistant turn's calls: consecutive ones are one turn) and
                          ``function_call_output`` items (a tool result, by ``call_id``)
    instructions          a system message first ("developer" messages are system messages too)
    tools                 function tools ({"type": "function", "name", "description", "parameters"}; others: 400)
    tool_choice           "auto", "none", "required" or {"type": "function", "name"} (forced: --guided-states)
    max_output_tokens     max_tokens (default: the rest of the context)
    reasoning.effort      the template's ``reasoning_effort`` variable (``chat_template_kwargs``)
    truncation "auto"     the prompt's last tokens the server takes (``truncate_prompt_tokens`` -1)
    text.format           "text", or JSON ("json_object"; "json_schema" with its "schema"): chat's response_format,
                          constrained decoding (``jdspark.serve_guided``; a server started with --guided-states)
    previous_response_id, background, conversation, prompt: responses are not stored here: 400 (the response says
                          ``store: false``)

The output items are a ``reasoning`` item (with ``--reasoning-parser``: the answer's think block), a ``message``
(its ``output_text``) and a ``function_call`` per tool call (``call_id`` the model's call id, the one a later
``function_call_output`` names). ``status`` is "completed", or "incomplete" with ``incomplete_details.reason``
"max_output_tokens" when the answer was cut by the token limit. ``usage`` is {input_tokens, input_tokens_details:
{cached_tokens}, output_tokens, output_tokens_details: {reasoning_tokens}, total_tokens} plus this server's
acceptance (drafted, accepted, accept_len); reasoning_tokens counts the reasoning text re-encoded (the engine counts
tokens, the parser splits text). Streamed: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its deltas (``response.reasoning_text.delta``, ``response.content_part.added`` +
``response.output_text.delta``, ``response.function_call_arguments.delta``) and ``.done`` events, and
``response.completed`` (or ``response.incomplete``, ``response.failed``) with the whole response; each event
``event: TYPE`` + ``data: {"type", "sequence_number", ...}``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Optional

from jdspark import reasoning, tool_calls
from jdspark.engine import combined_usage
from jdspark.serve_request import ApiError, reject_unsupported

__all__ = ["chat_body", "response_object", "output_items", "stream_events", "new_id", "usage", "status_of"]

# fields asking for what is not kept here (stored responses, background runs, stored prompts), allowed only at the
# values that ask for nothing
_UNSUPPORTED = {"previous_response_id": (), "background": (False,), "conversation": (), "prompt": (),
                "include": ([],), "top_logprobs": (0,)}

# vLLM's extra sampling fields, passed to the chat body as they are (validated there)
_PASSED = ("model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "ignore_eos", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
           "allowed_token_ids", "skip_special_tokens", "speculative", "spec_mode", "tool_choice", "priority")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content, where: str, role: str) -> object:
    """A message's content as the chat body takes it: a string, or chat parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and role == "user" and isinstance(p.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            raise ApiError(400, f"{where}.content[{j}]: expected {{\"type\": \"input_text\" | \"output_text\", "
                                "\"text\"}} or a user's {\"type\": \"input_image\", \"image_url\"}", "input")
    return parts


def _messages(body: dict) -> list:
    """The chat messages of ``instructions`` and ``input`` (module doc)."""
    msgs = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise ApiError(400, f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               "input")
            role = "system" if role == "developer" else role
            msgs.append({"role": role, "content": _text_of(it.get("content"), where, role)})
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"{where}: a function_call needs string call_id, name and arguments", "input")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            if not isinstance(it.get("call_id"), str) or not isinstance(out, str):
                raise ApiError(400, f"{where}: a function_call_output needs string call_id and output", "input")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": out})
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not taken here (message, function_call, "
                                "function_call_output)", "input", code="unsupported")
    return msgs


def _tools(tools) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ApiError(400, f"tools[{i}]: only function tools are served here ({{\"type\": \"function\", "
                                "\"name\", \"parameters\"}})", "tools", code="unsupported")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ApiError(400, f"tools[{i}].name must be a non-empty string", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_body(body) -> tuple:
    """(the chat completions body of a Responses body, the request's settings its response object repeats)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    reject_unsupported(body, _UNSUPPORTED)
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise ApiError(400, "'text' must be an object", "text")
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'text.format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       "text")
    chat = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _messages(body)
    if fmt["type"] != "text":  # chat's response_format (constrained decoding: --guided-states)
        chat["response_format"] = ({"type": "json_object"} if fmt["type"] == "json_object" else
                                   {"type": "json_schema", "json_schema": {
                                       k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}})
    tools = _tools(body.get("tools"))
    forced = body.get("tool_choice")
    if isinstance(forced, dict) and forced.get("type") == "function" and "function" not in forced:
        chat["tool_choice"] = {"type": "function", "function": {"name": forced.get("name")}}  # the Responses form
    if tools:
        chat["tools"] = tools
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
        if isinstance(body["max_output_tokens"], bool) or not isinstance(body["max_output_tokens"], int):
            raise ApiError(400, "'max_output_tokens' must be an integer >= 1", "max_output_tokens")
    kwargs = body.get("chat_template_kwargs")  # not an object: passed on, for the chat body's check to refuse
    kwargs = dict(kwargs or {}) if kwargs is None or isinstance(kwargs, dict) else kwargs
    effort = body.get("reasoning")
    if effort is not None:
        if not isinstance(effort, dict):
            raise ApiError(400, "'reasoning' must be an object ({\"effort\": ...})", "reasoning")
        if effort.get("effort") is not None and isinstance(kwargs, dict):
            kwargs.setdefault("reasoning_effort", effort["effort"])
    if kwargs != {}:
        chat["chat_template_kwargs"] = kwargs
    truncation = body.get("truncation", "disabled")
    if truncation not in (None, "disabled", "auto"):
        raise ApiError(400, "'truncation' must be \"disabled\" or \"auto\"", "truncation")
    if truncation == "auto":
        chat["truncate_prompt_tokens"] = -1
    meta = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "metadata": body.get("metadata") or {},
            "reasoning": body.get("reasoning"), "truncation": truncation or "disabled",
            "text": {"format": fmt}, "user": body.get("user")}
    return chat, meta


def usage(reqs, tokenizer, thought: str) -> dict:
    u = combined_usage(reqs)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens":
                                                                         u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": len(tokenizer.encode(thought)) if thought else 0},
            "total_tokens": u["total_tokens"], "drafted": u["drafted"], "accepted": u["accepted"],
            "accept_len": u["accept_len"]}


def _reasoning_item(rid: str, text: str) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(fid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(text: str, started: Optional[bool], tools: bool) -> tuple:
    """(the output items of a whole answer's text, its reasoning text): ``started`` as ``reasoning.split``'s (None:
    no reasoning parser), ``tools`` whether its tool calls are read."""
    thought, content = (None, text) if started is None else reasoning.split(text, started)
    content, calls = tool_calls.parse(content) if tools else (content, [])
    items = [_reasoning_item(new_id("rs"), thought)] if thought else []
    if content or not calls:
        items.append(_message_item(new_id("msg"), content or ""))
    items += [_call_item(new_id("fc"), c.id, c.name, c.arguments) for c in calls]
    return items, thought or ""


def response_object(rid: str, created: int, model: str, meta: dict, output: list, status: str,
                    usage: Optional[dict], error: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "previous_response_id": None, "store": False, "usage": usage,
            **meta}


def status_of(finish_reason: Optional[str]) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def stream_events(request, engine, req, events: asyncio.Queue, rid: str, created: int, model: str, meta: dict,
                        tokenizer, started: Optional[bool], tools: bool):
    """The typed SSE events of one streamed response (module doc); a client that goes away cancels it."""
    seq = 0
    output: list = []  # finished items
    thinker = None if started is None else reasoning.Splitter(started)
    splitter = tool_calls.Splitter() if tools else None
    open_item: dict = {}  # the item being streamed: {"kind", "id", "text" / "args", "call"}
    thought_all: list = []

    def event(kind: str, **fields) -> str:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def close(out: list) -> None:
        if not open_item:
            return
        k, i = open_item["kind"], len(output)
        if k == "reasoning":
            item = _reasoning_item(open_item["id"], open_item["text"])
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=open_item["text"]))
        elif k == "message":
            item = _message_item(open_item["id"], open_item["text"])
            part = item["content"][0]
            out.append(event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=open_item["text"], logprobs=[]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part))
        else:
            item = _call_item(open_item["id"], open_item["call_id"], open_item["name"], open_item["text"])
            out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=open_item["text"]))
        out.append(event("response.output_item.done", output_index=i, item=item))
        output.append(item)
        open_item.clear()

    def begin(kind: str, out: list, **call) -> None:
        close(out)
        open_item.update(kind=kind, id=new_id({"reasoning": "rs", "message": "msg"}.get(kind, "fc")), text="",
                         **call)
        i = len(output)
        if kind == "reasoning":
            item = {**_reasoning_item(open_item["id"], ""), "status": "in_progress"}
            out.append(event("response.output_item.added", output_index=i, item=item))
        elif kind == "message":
            item = _message_item(open_item["id"], "", "in_progress")
            item["content"] = []
            out.append(event("response.output_item.added", output_index=i, item=item))
            out.append(event("response.content_part.added", item_id=open_item["id"], output_index=i,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []}))
        else:
            item = _call_item(open_item["id"], call["call_id"], call["name"], "", "in_progress")
            out.append(event("response.output_item.added", output_index=i, item=item))

    def pieces(thought: str, text: str, deltas: list, out: list) -> None:
        if thought:
            thought_all.append(thought)
            if open_item.get("kind") != "reasoning":
                begin("reasoning", out)
            open_item["text"] += thought
            out.append(event("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(output),
                             content_index=0, delta=thought))
        if text:
            if open_item.get("kind") != "message":
                begin("message", out)
            open_item["text"] += text
            out.append(event("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                             content_index=0, delta=text, logprobs=[]))
        for d in deltas:
            if "id" in d:  # a new call
                begin("function_call", out, call_id=d["id"], name=d["function"]["name"])
            args = d["function"].get("arguments", "")
            if args and open_item.get("kind") == "function_call":
                open_item["text"] += args
                out.append(event("response.function_call_arguments.delta", item_id=open_item["id"],
                                 output_index=len(output), delta=args))

    def feed(text: str, out: list) -> None:
        thought, text = ("", text) if thinker is None else thinker.feed(text)
        text, deltas = (text, []) if splitter is None else splitter.feed(text)
        pieces(thought, text, deltas, out)

    def finish(ev, out: list) -> None:
        if thinker is not None:
            thought, rest = thinker.finish()
            rest, deltas = (rest, []) if splitter is None else splitter.feed(rest)
            pieces(thought, rest, deltas, out)
        if splitter is not None:
            rest, deltas, _ = splitter.finish()
            pieces("", rest, deltas, out)
        if not output and not open_item:
            begin("message", out)  # an empty answer is still one message
        close(out)
        if ev.error is not None:
            error = {"code": "invalid_request", "message": ev.error}
            out.append(event("response.failed", response=response_object(rid, created, model, meta, output,
                                                                          "failed", None, error)))
            return
        status = status_of(ev.finish_reason)
        resp = response_object(rid, created, model, meta, output, status, usage([req], tokenizer,
                                                                                 "".join(thought_all)))
        out.append(event(f"response.{status}", response=resp))

    done = False
    try:
        first = response_object(rid, created, model, meta, [], "in_progress", None)
        yield event("response.created", response=first) + event("response.in_progress", response=first)
        while not done:
            try:
                _, ev = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            out: list = []
            while True:
                feed(ev.text, out)
                if ev.finish_reason is not None or ev.error is not None:
                    finish(ev, out)
                    done = True
                    break
                if events.empty():
                    break
                _, ev = events.get_nowait()
            yield "".join(out)
    finally:
        if not done:
            engine.cancel(req)
