"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn), with vLLM's Prometheus metric names.

    python -m jdspark.serve --checkpoint checkpoints/default --slots 16 --port 8000     # also `make serve`

Endpoints: ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions`` (the checkpoint's
chat template, or ``kimi.tokenizer.PLAIN_CHAT_TEMPLATE``; ``image_url`` parts with ``data:`` URIs when the checkpoint
has a vision tower, see ``jdspark.serve_media``), ``GET /v1/models``, ``POST /tokenize`` / ``/detokenize``
(vLLM's: a prompt or chat's ids as this server prefills them, and back), ``GET /health`` (503 until every
program is compiled), ``GET /metrics``. Streaming is SSE (``data: {...}`` chunks, then ``data: [DONE]``), text
decoded incrementally. ``usage`` carries the completion's own acceptance (``drafted``, ``accepted``,
``accept_len``) and, as OpenAI's does, ``prompt_tokens_details.cached_tokens``: the prompt tokens prefix caching
took from a kept earlier prompt (``--prefix-pool``, ``jdspark.prefix``) instead of prefilling them. Bad input gets
``{"error": {"message", "type", "param", "code"}}`` with status 400 (404 for an unknown model, 429 when the waiting
queue is full, 503 before the engine is ready); a request field this server does not implement (``suffix``,
``response_format``: ``UNSUPPORTED_FIELDS``) is a 400 naming it unless it has the value that asks for nothing. A
client that disconnects frees its slot.

Tools (chat): ``tools`` with ``tool_choice`` "auto" (or "none") are rendered by the checkpoint's chat template, and
the answer's calls are read in ``--tool-call-parser``'s format (Kimi K2's; ``jdspark.tool_calls``) into the
message's ``tool_calls`` with ``finish_reason`` "tool_calls"; earlier turns' ``tool_calls`` and ``tool`` results are
passed to the template. Forcing a call ("required", a named function) needs constrained decoding: a 400.
With ``--reasoning-parser think`` a chat answer's ``<think>...</think>`` is its ``reasoning_content``
(``jdspark.reasoning``).

Penalties and logit controls (``--penalties``): ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``
(vLLM's semantics, ``jdspark.sampling.Penalties``), ``logit_bias`` (OpenAI's: {"token id": -100..100}) and
``min_tokens`` (vLLM's: EOS not drawn, unless ``ignore_eos``, and stop strings not matched before that many tokens;
``jdspark.sampling.LogitControls``), applied to the target's law at every verified position: lossless.

``n`` (at most ``--max-n``): n choices of one prompt, each its own engine request, choice i sampled with seed
``seed + i`` (token for token what a request with that seed alone gets where the verify widths are the same, e.g.
``spec_mode`` fixed; under adaptive verification the widths, and so the keys drawn, follow the load: the same
law); queued together or not at all (429), and a client that goes away frees every choice's slot
(``jdspark.serve_stream``). ``usage`` counts the prompt once. ``best_of`` (completions, >= n, not streamed):
that many completions, the n with the highest mean log-probability per token returned (``usage`` counts them all).

Log-probabilities (``jdspark.logprobs``): ``logprobs: N`` on ``/v1/completions`` (the API's legacy object: tokens,
token_logprobs, top_logprobs, text_offset), ``logprobs: true`` and ``top_logprobs: N`` on chat (``content``
entries with token, logprob, bytes, top_logprobs), N at most ``--max-logprobs`` (default 20). They are the target's
own distribution at each generated position, before temperature / top-k / top-p (vLLM's default), and the same
whether a token was an accepted draft or the target's own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import threading
import time
from typing import Any, NamedTuple, Optional

import jax
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import kimi
from jdspark import reasoning, tool_calls
from jdspark.drafter import CHECKPOINT_WINDOW, apply_context_window, load_drafter, parse_context_window
from jdspark.engine import Engine, QueueFull, SamplingRequest, combined_usage
from jdspark.engine import Request as EngineRequest
from jdspark.logprobs import MAX_LOGPROBS
from jdspark.prefix import tree_bytes
from jdspark.serve_media import MediaError, encode_with_images, message_text
from jdspark.serve_metrics import ServeMetrics
from jdspark.serve_stream import Mailbox, collect, logprobs_object, sse
from jdspark.slots import SlotBackend, multi_step_plan

__all__ = ["ApiError", "Parsed", "build_app", "parse_completion"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, type_: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _get(body: dict, name: str, kinds, default, check=None, what: str = ""):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be {what or kinds[0].__name__}, got a boolean", name)
    if not isinstance(v, kinds):
        raise ApiError(400, f"'{name}' must be {what or kinds[0].__name__}, got {type(v).__name__}", name)
    if check is not None and not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {v!r}", name)
    return v


# OpenAI / vLLM request fields this server does not implement, with the values that ask for nothing (clients send
# them as defaults). Any other value is a 400 naming the field (code "unsupported"): never silently ignored.
UNSUPPORTED_FIELDS = {
    "suffix": ("",), "prompt_logprobs": (0,), "functions": ([],), "response_format": ({"type": "text"},),
}


def _reject_unsupported(body: dict) -> None:
    for name, ok in UNSUPPORTED_FIELDS.items():
        v = body.get(name)
        if v is None or any(v == o and type(v) is type(o) for o in ok):
            continue
        shown = ", ".join(json.dumps(o) for o in ok)
        raise ApiError(400, f"'{name}' = {json.dumps(v)[:60]} is not supported by this server (it accepts null or "
                            f"{shown}, which ask for nothing)", name, code="unsupported")


class Parsed(NamedTuple):
    """A request body, validated: what the engine serves and how the response is shaped."""
    sampling: SamplingRequest
    stop: tuple
    ignore_eos: bool
    stream: bool
    include_usage: bool
    echo: Optional[str]  # the prompt's text a completions response begins with (``"echo": true``), else None
    n: int = 1  # choices
    best_of: int = 1  # completions generated, the n likeliest returned (completions' ``best_of``; >= n)
    tools: bool = False  # the tools were rendered: the answer's tool calls are parsed (``jdspark.tool_calls``)
    reasoning: Optional[bool] = None  # chat with a reasoning parser: whether the prompt opened the think block
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output


def parse_completion(body: Any, *, tokenizer, vocab_size: int, max_context: int, model_name: str,
                     chat: bool = False, max_prompt: Optional[int] = None,
                     spec_modes: tuple = ("fixed", "adaptive"), vision=None,
                     max_logprobs: Optional[int] = None, max_n: int = 1,
                     tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                     penalties: bool = True) -> Parsed:
    """A request body's ``Parsed`` form, or ApiError. ``max_n``: the most choices a request may ask (``n``);
    ``tool_parser``: the tool-call format answers are read in (``jdspark.tool_calls.PARSERS``; None: no tools);
    ``reasoning_parser``: how a chat answer's reasoning is told from the rest (``jdspark.reasoning``; None: not);
    ``penalties``: whether the server applies repetition / frequency / presence penalties, logit_bias and
    min_tokens (``--penalties``).
    ``vision``: the checkpoint's VisionConfig (chat ``image_url`` parts are then taken, ``jdspark.serve_media``),
    or None (text-only: an image part is a 400 naming that). ``max_logprobs``: the most top log-probabilities a
    request may ask (None: the server computes none)."""
    try:
        return _parse(body, tokenizer, vocab_size, max_context, model_name, chat, max_prompt, spec_modes, vision,
                      max_logprobs, max_n, tool_parser, reasoning_parser, penalties)
    except MediaError as e:
        raise ApiError(400, e.message, e.param, code=e.code) from None


def _logit_bias(body: dict, vocab_size: int) -> tuple:
    """OpenAI's ``logit_bias``: {"token id": value in [-100, 100]} -> ((id, value), ...) sorted by id."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for k, v in raw.items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not 0 <= t < vocab_size or str(t) != str(k).strip():
            raise ApiError(400, f"'logit_bias': key {k!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias': the value for token {t} must be a number in [-100, 100], got "
                                f"{json.dumps(v)[:40]}", "logit_bias")
        out[t] = float(v)
    return tuple(sorted(out.items()))


def _logprobs(body: dict, chat: bool, max_logprobs: Optional[int]) -> Optional[int]:
    """The top log-probabilities a request asks per token (None: none): chat's ``logprobs`` (a boolean) and
    ``top_logprobs``, completions' ``logprobs`` (an integer)."""
    limit = -1 if max_logprobs is None else max_logprobs
    what = f"an integer in 0..{limit}" if limit >= 0 else "null (this server computes no log-probabilities)"
    if chat:
        on = _get(body, "logprobs", (bool,), False, what="a boolean")
        top = _get(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= limit, what)
        if top is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        asked = (top or 0) if on else None
    else:
        asked = _get(body, "logprobs", (int,), None, lambda v: 0 <= v <= limit, what)
    if asked is not None and max_logprobs is None:
        raise ApiError(400, "log-probabilities are off on this server (started with --no-logprobs)", "logprobs",
                       code="unsupported")
    return asked


def _tools(body: dict, chat: bool, tokenizer, tool_parser: Optional[str]) -> Optional[list]:
    """The tools to render (None: none), from chat's ``tools`` and ``tool_choice`` ("auto" or "none"; forcing a
    call, "required" or a named function, needs constrained decoding, which is not built)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise ApiError(400, f"'{name}' is only taken on /v1/chat/completions", name, code="unsupported")
        return None
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools)):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                            "\"parameters\": ...}}", "tools")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"'tool_choice' = {json.dumps(choice)[:60]} is not supported (it accepts \"auto\" or "
                            "\"none\": forcing a call needs constrained decoding, which this server does not do)",
                       "tool_choice", code="unsupported")
    if not tools or choice == "none":
        return None
    if tool_parser is None:
        raise ApiError(400, "'tools': this server reads no tool calls (started with --tool-call-parser none)",
                       "tools", code="unsupported")
    if "tools" not in (tokenizer.chat_template or ""):
        raise ApiError(400, "'tools': this checkpoint's chat template renders no tools", "tools",
                       code="unsupported")
    return tools


def _message(m: dict, i: int, vision) -> tuple:
    """(the message as the chat template reads it, its images): role, content (text), and an assistant turn's
    ``tool_calls`` / a tool result's ``tool_call_id`` and ``name``, passed through."""
    content = m.get("content")
    calls = m.get("tool_calls")
    if calls is not None:
        if not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                for c in calls)):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                                "\"function\": {\"name\", \"arguments\"}} (arguments a JSON string)", "messages")
        if content is None:
            content = ""  # an assistant turn that only called tools
    text, imgs = message_text(content, i, vision)
    out = {"role": m.get("role"), "content": text}
    for k in ("tool_calls", "tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    return out, imgs


def _check_body(body, model_name: str) -> None:
    """A request body is a JSON object naming this server's model, or none."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves '{model_name}')", "model",
                       code="model_not_found")


def _prompt(body: dict, tokenizer, vocab_size: int, chat: bool, vision, tool_parser, reasoning_parser,
            add_generation_prompt: bool = True) -> tuple:
    """A request's prompt ids: chat ``messages`` rendered by the chat template (with ``tools``, images expanded to
    their placeholders), or a completion's ``prompt`` (text or token ids). Returns (ids, the prompt's text for an
    echo, the images' VisionInput or None, the tools or None, whether the rendered prompt opened a think block)."""
    echo_text = None
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        msgs, images, vin = list(msgs), [], None
        for i, m in enumerate(msgs):
            if isinstance(m, dict):
                msgs[i], imgs = _message(m, i, vision)
                images += imgs
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
        tools = _tools(body, chat, tokenizer, tool_parser)
        rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                 **({} if tools is None else {"tools": tools}))
        started = None if reasoning_parser is None else reasoning.started_by(rendered)
        if images:
            ids, vin = encode_with_images(tokenizer, rendered, images, vision)
        else:
            ids = tokenizer.encode(rendered, allow_special=True)
        if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
            ids = [tokenizer.bos_id] + ids
    else:
        vin, tools = None, _tools(body, chat, tokenizer, tool_parser)  # images come only as chat content parts
        started = None  # reasoning is told apart in chat answers only
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, bos=tokenizer.bos_id is not None)
            echo_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ApiError(400, f"token ids {bad[:8]} outside the vocabulary [0, {vocab_size})", "prompt")
            ids = list(prompt)
            echo_text = tokenizer.decode(ids)
        else:
            raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids", "prompt")
    return ids, echo_text, vin, tools, started


def _parse(body, tokenizer, vocab_size, max_context, model_name, chat, max_prompt, spec_modes, vision,
           max_logprobs, max_n, tool_parser, reasoning_parser, penalties_served=True):
    _check_body(body, model_name)
    _reject_unsupported(body)
    if chat and body.get("echo") not in (None, False):
        raise ApiError(400, "'echo' is not supported on /v1/chat/completions (only on /v1/completions)", "echo",
                       code="unsupported")
    echo = False if chat else _get(body, "echo", (bool,), False, what="a boolean")
    ids, echo_text, vin, tools, started = _prompt(body, tokenizer, vocab_size, chat, vision, tool_parser,
                                                  reasoning_parser)
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    if max_prompt is not None and len(ids) > max_prompt:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {max_prompt} (its largest "
                            "prompt bucket)", "prompt")
    max_tokens = _get(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                      (int,), 16, lambda v: v >= (0 if echo else 1),
                      "an integer >= 0 (0: the prompt's echo alone)" if echo else "an integer >= 1")
    if len(ids) + max_tokens > max_context:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the context of "
                            f"{max_context} tokens", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0, lambda v: math.isfinite(v) and v >= 0,
                             "a number >= 0"))
    top_p = float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"))
    top_k = _get(body, "top_k", (int,), 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)")
    seed = _get(body, "seed", (int,), 0, lambda v: 0 <= v < 2 ** 63, "a non-negative integer")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", "stop")
    ignore_eos = _get(body, "ignore_eos", (bool,), False, what="a boolean")
    include_stop_str = _get(body, "include_stop_str_in_output", (bool,), False, what="a boolean")
    stream = _get(body, "stream", (bool,), False, what="a boolean")
    speculative = _get(body, "speculative", (bool,), True, what="a boolean")
    spec_mode = _get(body, "spec_mode", (str,), None, lambda v: v in ("fixed", "adaptive"), "'fixed' or 'adaptive'")
    if spec_mode is not None and spec_mode not in spec_modes:
        raise ApiError(400, f"spec_mode {spec_mode!r} is not served here (this server offers {list(spec_modes)}; "
                       "start it with --spec adaptive for both)", "spec_mode", code="unsupported")
    opts = _get(body, "stream_options", (dict,), {}, what="an object")
    include_usage = bool(opts.get("include_usage", False))
    logprobs = _logprobs(body, chat, max_logprobs)
    penalties = {name: float(_get(body, name, (int, float), off, ok, what)) for name, off, ok, what in (
        ("repetition_penalty", 1.0, lambda v: math.isfinite(v) and v > 0, "a number > 0 (1: off)"),
        ("frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
        ("presence_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"))}
    logit_bias = _logit_bias(body, vocab_size)
    stop_ids = _get(body, "stop_token_ids", (list,), [], lambda v: all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v),
        f"a list of token ids in [0, {vocab_size})")
    min_tokens = _get(body, "min_tokens", (int,), 0, lambda v: 0 <= v <= max_tokens,
                      f"an integer in 0..max_tokens ({max_tokens})")
    asked = [k for k, v in penalties.items() if v != (1.0 if k == "repetition_penalty" else 0.0)]
    asked += ["logit_bias"] * bool(logit_bias) + ["min_tokens"] * bool(min_tokens)
    if asked and not penalties_served:
        raise ApiError(400, f"'{asked[0]}': penalties and logit controls are off on this server (start it with "
                            "--penalties)", asked[0], code="unsupported")
    n = _get(body, "n", (int,), 1, lambda v: 1 <= v <= max_n, f"an integer in 1..{max_n}")
    if chat and body.get("best_of") not in (None, 1, n):
        raise ApiError(400, "'best_of' is not supported on /v1/chat/completions (only on /v1/completions)",
                       "best_of", code="unsupported")
    best_of = _get(body, "best_of", (int,), n, lambda v: n <= v <= max_n, f"an integer in {n}..{max_n} (>= n)")
    if best_of > n and stream:
        raise ApiError(400, "'best_of' > 'n' cannot be streamed (the likeliest are known only when all have ended)",
                       "best_of")
    sp = SamplingRequest(tuple(int(t) for t in ids), int(max_tokens), temperature, top_p, max(int(top_k), 0),
                         int(seed), bool(speculative), spec_mode, images=vin, logprobs=logprobs,
                         prompt_logprobs=logprobs if echo else None, logit_bias=logit_bias,
                         min_tokens=int(min_tokens), stop_token_ids=tuple(dict.fromkeys(stop_ids)), **penalties)
    return Parsed(sp, stop, bool(ignore_eos), bool(stream), include_usage, echo_text if echo else None, int(n),
                  int(best_of), tools is not None, started, bool(include_stop_str))


def build_app(engine: Engine, tokenizer, *, model_name: str, vocab_size: int, max_context: int, metrics,
              is_ready=lambda: True, max_prompt: Optional[int] = None,
              spec_modes: tuple = ("fixed", "adaptive"), vision=None, max_logprobs: Optional[int] = None,
              max_n: int = 1, tool_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, penalties: bool = False) -> FastAPI:
    app = FastAPI(title="jdspark", docs_url=None, redoc_url=None)
    markers = tool_calls.marker_ids(tokenizer)  # the tool-call markers a request with tools decodes
    think = reasoning.marker_ids(tokenizer)  # and <think> / </think>, where they are special tokens
    mailboxes: dict = {}  # one per running event loop (a test may serve the same app from more than one)

    def err(e: ApiError):
        return e.response()

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return err(ApiError(503, f"the engine stopped: {engine.error!r}", type_="server_error"))
        if not is_ready():
            return err(ApiError(503, "warming up: compiling", type_="server_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jdspark",
                                            "max_model_len": max_context}]}

    async def json_body(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"invalid JSON: {e}") from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a completion's ``prompt`` or a chat's ``messages`` (``add_generation_prompt``, default true;
        ``tools``) as this server would prefill them: {"count", "max_model_len", "tokens"}."""
        try:
            body = await json_body(request)
            _check_body(body, model_name)
            add = _get(body, "add_generation_prompt", (bool,), True, what="a boolean")
            ids = _prompt(body, tokenizer, vocab_size, "messages" in body, vision, tool_parser, None, add)[0]
        except MediaError as e:
            return err(ApiError(400, e.message, e.param, code=e.code))
        except ApiError as e:
            return err(e)
        return {"count": len(ids), "max_model_len": max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: ``tokens`` (ids in the vocabulary) -> {"prompt": their text} (special tokens dropped)."""
        try:
            body = await json_body(request)
            _check_body(body, model_name)
            ids = _get(body, "tokens", (list,), None, lambda v: all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v),
                f"a list of token ids in [0, {vocab_size})")
            if ids is None:
                raise ApiError(400, "'tokens' is required", "tokens")
        except ApiError as e:
            return err(e)
        return {"prompt": tokenizer.decode(ids)}

    async def serve(request: Request, chat: bool):
        if not is_ready():
            return err(ApiError(503, "warming up: compiling", type_="server_error"))
        try:
            body = await json_body(request)
            q = parse_completion(
                body, tokenizer=tokenizer, vocab_size=vocab_size, max_context=max_context, model_name=model_name,
                chat=chat, max_prompt=max_prompt, spec_modes=spec_modes, vision=vision, max_logprobs=max_logprobs,
                max_n=max_n, tool_parser=tool_parser, reasoning_parser=reasoning_parser, penalties=penalties)
        except ApiError as e:
            return err(e)
        if q.best_of > engine.max_waiting:
            name = "best_of" if q.best_of > q.n else "n"
            return err(ApiError(400, f"'{name}' = {q.best_of} completions can never be queued together (the queue "
                                     f"holds {engine.max_waiting})", name))
        # best_of > n: every completion's own log-probabilities rank them (asked or not)
        ranked = q.sampling if q.best_of == q.n or q.sampling.logprobs is not None else dataclasses.replace(
            q.sampling, logprobs=0)
        if not q.ignore_eos and engine.eos is not None and engine.eos not in ranked.stop_token_ids:
            ranked = dataclasses.replace(ranked, stop_token_ids=ranked.stop_token_ids + (engine.eos,))  # min_tokens
        loop = asyncio.get_running_loop()
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, Mailbox(loop))
        events: asyncio.Queue = asyncio.Queue()  # (choice index, Event)
        reqs = [EngineRequest(ranked if i == 0 else dataclasses.replace(ranked, seed=(ranked.seed + i) % 2 ** 63),
                              lambda ev, i=i: mailbox.post(events, (i, ev)), stop=q.stop, ignore_eos=q.ignore_eos,
                              include_stop_str=q.include_stop_str,
                              keep_special=(markers if q.tools else frozenset())
                              | (think if q.reasoning is not None else frozenset()))
                for i in range(q.best_of)]
        try:
            engine.submit_all(reqs)
        except QueueFull as e:
            return err(ApiError(429, str(e), type_="rate_limit_error", code="queue_full"))
        except RuntimeError as e:
            return err(ApiError(503, str(e), type_="server_error"))
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if q.stream:
            return StreamingResponse(sse(request, engine, reqs, events, chat, created, model_name, q.include_usage,
                                         tokenizer, q.echo, q.tools, q.reasoning), media_type="text/event-stream")
        got = await collect(request, engine, reqs, events)
        if got is None:
            return Response(status_code=499)
        failed = next((c.last.error for c in got if c.last.error is not None), None)
        if failed is not None:
            return err(ApiError(400, failed, "prompt"))
        if q.best_of > q.n:  # the n with the highest mean log-probability per token (OpenAI's "best"), in order
            got = sorted(got, key=lambda c: -c.mean_logprob)[:q.n]
        choices = []
        for i, c in enumerate(got):
            choice = {"index": i, "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason,
                      "logprobs": logprobs_object(tokenizer, chat, q.sampling.logprobs, c.ids, c.entries, 0)}
            if chat:
                thought, content = (None, "".join(c.text)) if q.reasoning is None else reasoning.split(
                    "".join(c.text), q.reasoning)
                content, calls = tool_calls.parse(content) if q.tools else (content, [])
                choice["message"] = {"role": "assistant", "content": content}
                if q.reasoning is not None:
                    choice["message"]["reasoning_content"] = thought
                if calls:  # as vLLM: whatever ended the text, its calls are the answer
                    choice["message"]["tool_calls"] = [call.as_api() for call in calls]
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = (q.echo or "") + "".join(c.text)
            choices.append(choice)
        return {"id": reqs[0].id, "object": obj, "created": created, "model": model_name, "choices": choices,
                "usage": combined_usage(reqs)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def parse_args(argv=None) -> argparse.Namespace:
    """The server's command line (``python -m jdspark.serve --help``)."""
    ap = argparse.ArgumentParser(prog="python -m jdspark.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/default", help="folder with target/ (and drafter/)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-len", type=int, default=1024, help="cache positions per slot (prompt + completion)")
    ap.add_argument("--prompt-buckets", default="64,128,256,512")
    ap.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429")
    ap.add_argument("--spec", choices=("off", "fixed", "adaptive"), default="adaptive",
                    help="off: plain decoding for every request; fixed: verify the drafter's whole block; adaptive: "
                         "the default request mode picks each step's verify width (requests may ask 'fixed')")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill prompts longer than N tokens in chunks of N (0: one pass; default: kimi.dispatch "
                         "decides: chunks of 1024 above 4096 tokens)")
    ap.add_argument("--multi-step", type=int, default=None,
                    help="steps per device launch (at batch buckets <= --multi-step-max-batch) while no request "
                         "waits (1: one per launch); default: jdspark.slots.multi_step_plan for the platform (4 on "
                         "a CPU, 8 on a GPU)")
    ap.add_argument("--multi-step-max-batch", type=int, default=None,
                    help="the largest batch bucket launched --multi-step steps at a time (0: every bucket); above it "
                         "one step a launch, where adaptive verification re-plans every step (docs/serving.md); "
                         "default: multi_step_plan's (4 on a CPU, every bucket on a GPU)")
    ap.add_argument("--drafter-window", type=parse_context_window, default=CHECKPOINT_WINDOW, metavar="N|none",
                    help="the drafter reads only the last N context positions of each stream, from a ring buffer "
                         "(its memory and draft cost stop growing with the context; lossless either way); none: all "
                         "of them; default: the checkpoint's (the shipped drafter's: 64, from which it accepts "
                         "more than from a longer context, docs/performance.md)")
    ap.add_argument("--prefix-pool", type=int, default=None,
                    help="prefix caching: keep the caches after up to N prompts (~1.4 MiB each for the shipped pair "
                         "at --max-len 1024); a prompt that begins with a kept one prefills only the rest, and may "
                         "then be longer than the largest prompt bucket (jdspark.prefix); 0: off; default: 32, fewer "
                         "where they would take more than 512 MiB (jdspark.prefix.default_pool_rows)")
    ap.add_argument("--no-prefix-answers", dest="prefix_answers", action="store_false",
                    help="with prefix caching, do not keep finished answers while idle (by default the engine, when "
                         "no request runs or waits, prefills each answer on its kept prompt, so a conversation's next "
                         "turn prefills only its new message)")
    ap.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                    help="the most top log-probabilities a request may ask per token (chat's top_logprobs, "
                         "completions' logprobs)")
    ap.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                    help="compile the programs without log-probabilities (a request asking for them is a 400)")
    ap.add_argument("--penalties", action="store_true",
                    help="compile repetition / frequency / presence penalties, logit_bias and min_tokens into the "
                         "programs (without it a request asking for them is a 400: compiled in, steps of requests "
                         "without them cost 3-4%% more at the whole block's width, docs/serving.md)")
    ap.add_argument("--max-n", type=int, default=16,
                    help="the most choices a request may ask ('n'): each is a request of its own in the engine")
    ap.add_argument("--tool-call-parser", choices=(*tool_calls.PARSERS, "none"), default="kimi_k2",
                    help="the format chat answers' tool calls are read in, when a request has 'tools' (rendered by "
                         "the checkpoint's chat template; none: requests with tools are refused)")
    ap.add_argument("--reasoning-parser", choices=(*reasoning.PARSERS, "none"), default="none",
                    help="think: a chat answer's <think>...</think> reasoning goes to message.reasoning_content "
                         "(delta.reasoning_content when streamed), the rest to content (a thinking model's "
                         "checkpoint); none: the whole text is content")
    ap.add_argument("--model-name", default=None)
    a = ap.parse_args(argv)
    plan = multi_step_plan(jax.default_backend())
    a.multi_step = plan[0] if a.multi_step is None else a.multi_step
    a.multi_step_max_batch = plan[1] if a.multi_step_max_batch is None else a.multi_step_max_batch
    if a.multi_step < 1:
        ap.error(f"--multi-step: expected an int >= 1, got {a.multi_step}")
    if a.multi_step_max_batch < 0:
        ap.error(f"--multi-step-max-batch: expected an int >= 0 (0: every batch bucket), got {a.multi_step_max_batch}")
    if a.prefix_pool is not None and a.prefix_pool < 0:
        ap.error(f"--prefix-pool: expected an int >= 0 (0: off), got {a.prefix_pool}")
    if a.max_n < 1:
        ap.error(f"--max-n: expected an int >= 1, got {a.max_n}")
    if a.max_logprobs < 0:
        ap.error(f"--max-logprobs: expected an int >= 0, got {a.max_logprobs}")
    if a.prefill_chunk is not None and a.prefill_chunk < 0:
        ap.error(f"--prefill-chunk: expected an int >= 0, got {a.prefill_chunk}")
    return a


def make_engine(a: argparse.Namespace):
    """Load the pair and build the slots, metrics and engine a server of these arguments serves with (not yet
    warmed up or started). Returns (engine, backend, target, tokenizer, metrics, model name)."""
    tdir, ddir = os.path.join(a.checkpoint, "target"), os.path.join(a.checkpoint, "drafter")
    target = kimi.load_checkpoint(tdir, config_overrides={"serving_dtype": a.serving_dtype})
    drafter = load_drafter(ddir, target=target) if a.spec != "off" and os.path.isdir(ddir) else None
    drafter = apply_context_window(drafter, a.drafter_window)
    tok = kimi.load_tokenizer(tdir, vocab_size=target.config.vocab_size)
    name = a.model_name or os.path.basename(os.path.normpath(a.checkpoint))
    backend = SlotBackend(target, drafter, num_slots=a.slots, max_len=a.max_len,
                          prompt_buckets=[int(x) for x in a.prompt_buckets.split(",")], prefill_chunk=a.prefill_chunk,
                          multi_step=a.multi_step, multi_step_max_batch=a.multi_step_max_batch or a.slots,
                          prefix_pool=a.prefix_pool, prefix_answers=a.prefix_answers,
                          max_logprobs=a.max_logprobs if a.logprobs else None, penalties=a.penalties,
                          adaptive=a.spec == "adaptive" and drafter is not None and drafter.confidence_head is not None)
    metrics = ServeMetrics(name, max_positions=backend.G + 1)
    engine = Engine(backend, tok, eos_token_id=target.config.eos_token_id, max_waiting=a.max_waiting,
                    metrics=metrics)
    return engine, backend, target, tok, metrics, name


def main(argv=None) -> int:
    """``python -m jdspark.serve --checkpoint DIR --slots S --port P``: load the pair, compile every program,
    then serve (``/health`` answers 503 until the compiles are done)."""
    a = parse_args(argv)
    engine, backend, target, tok, metrics, name = make_engine(a)
    ready = threading.Event()

    def warm():
        t0 = time.perf_counter()
        print(f"[serve] compiling {len(backend.programs())} programs, several at a time", file=sys.stderr, flush=True)
        if backend.prefix is not None:
            mib = tree_bytes(backend.pool) / 2**20
            answers = "answers kept while idle" if backend.prefix_answers else "answers not kept"
            print(f"[serve] prefix cache: up to {backend.prefix.capacity} prompts kept ({mib:.0f} MiB; {answers})",
                  file=sys.stderr, flush=True)
        try:
            backend.warm_up()
        except Exception as e:  # a server that can never be ready exits saying why (not 503 for ever)
            print(f"[serve] start-up failed: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        engine.start()
        ready.set()
        print(f"[serve] ready after {time.perf_counter() - t0:.0f} s of compiles and timings", file=sys.stderr,
              flush=True)

    threading.Thread(target=warm, name="jdspark-warm-up", daemon=True).start()
    app = build_app(engine, tok, model_name=name, vocab_size=target.config.vocab_size,
                    max_context=a.max_len - backend.G - 1, metrics=metrics, is_ready=ready.is_set,
                    # with prefix caching a longer prompt is served when it begins with a kept one (else the
                    # insert refuses it, saying so)
                    max_prompt=None if backend.prefix is not None else backend.prompt_buckets[-1],
                    spec_modes=("fixed", "adaptive") if backend.adaptive else ("fixed",), vision=target.config.vision,
                    max_logprobs=backend.max_logprobs, max_n=a.max_n,
                    tool_parser=None if a.tool_call_parser == "none" else a.tool_call_parser,
                    reasoning_parser=None if a.reasoning_parser == "none" else a.reasoning_parser,
                    penalties=backend.penalties)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
