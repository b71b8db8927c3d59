"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn), with vLLM's Prometheus metric names.

    python -m jdspark.serve --checkpoint checkpoints/default --slots 16 --port 8000     # also `make serve`

Endpoints: ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions`` (the checkpoint's
chat template, or ``kimi.tokenizer.PLAIN_CHAT_TEMPLATE``; ``image_url`` parts with ``data:`` URIs when the
checkpoint has a vision tower, see ``jdspark.serve_media``), ``POST /v1/responses`` (OpenAI's Responses API over the
chat path: ``jdspark.serve_responses``), ``GET /v1/models``, ``POST /tokenize`` / ``/detokenize`` (vLLM's: a prompt
or chat's ids as this server prefills them, and back), ``GET /health`` (503 until every program is compiled; vLLM's
``/ping`` the same), ``GET /metrics``, ``GET /v1/models/{model}``, ``GET /version``. Streaming is SSE (``data:
{...}`` chunks, then ``data: [DONE]``), text decoded incrementally. ``usage`` carries the completion's own
acceptance (``drafted``, ``accepted``, ``accept_len``) and, as OpenAI's does,
``prompt_tokens_details.cached_tokens``: the prompt tokens prefix caching took from a kept earlier prompt
(``--prefix-pool``, ``jdspark.prefix``) instead of prefilling them. Bad input gets ``{"error": {"message", "type",
"param", "code"}}`` with status 400 (404 for an unknown model, 429 when the waiting queue is full, 503 before the
engine is ready; the bodies are read in ``jdspark.serve_request``); a request field this server does not implement
(``suffix``, ``response_format``: ``UNSUPPORTED_FIELDS``) is a 400 naming it unless it has the value that asks for
nothing. A client that disconnects frees its slot.

Tools (chat): ``tools`` with ``tool_choice`` "auto" (or "none") are rendered by the checkpoint's chat template, and
the answer's calls are read in ``--tool-call-parser``'s format (Kimi K2's; ``jdspark.tool_calls``) into the
message's ``tool_calls`` with ``finish_reason`` "tool_calls"; earlier turns' ``tool_calls`` and ``tool`` results are
passed to the template. Forcing a call ("required", a named function) is constrained decoding
(``--guided-states``): the answer is the format's section of calls, arguments valid under each tool's parameters.
With ``--reasoning-parser think`` a chat answer's ``<think>...</think>`` is its ``reasoning_content``
(``jdspark.reasoning``).

Constrained decoding (``--guided-states Q``): vLLM's ``guided_choice`` / ``guided_regex`` / ``guided_json`` /
``structured_outputs`` and OpenAI's ``response_format`` (json_object, json_schema), the answer one of the strings, a
text the pattern matches whole or a JSON document the schema validates, then EOS (``jdspark.serve_guided``,
``jdspark.json_schema``, ``jdspark.grammar``; masked at every verified position: lossless).

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
import gc
import importlib.metadata
import json
import os
import sys
import threading
import time
from typing import Optional, Sequence

import jax
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

import kimi
from jdspark import reasoning, tool_calls
from jdspark import serve_responses as responses_api
from jdspark.drafter import apply_context_window, load_drafter
from jdspark.engine import Engine, QueueFull, combined_usage
from jdspark.engine import Request as EngineRequest
from jdspark.graphs import pin_cpu_workers, use_compile_cache
from jdspark.logprobs import prompt_logprobs_object
from jdspark.prefix import tree_bytes
from jdspark.serve_args import MAX_REQUEST_BYTES, parse_args
from jdspark.serve_auth import ApiKeys
from jdspark.serve_guided import guided_constraint
from jdspark.serve_media import MediaError
from jdspark.serve_metrics import ServeMetrics
from jdspark.serve_request import ApiError, check_body, get_field, parse_completion, prompt_ids, split_prompts
from jdspark.serve_stream import Mailbox, collect, logprobs_object, sse
from jdspark.slots import SlotBackend

__all__ = ["build_app", "main", "SERVER_VERSION"]


def _version() -> str:
    """pyproject.toml's version as installed (``make install``); "unknown" for a tree run without installing it."""
    try:
        return importlib.metadata.version("jdspark")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


SERVER_VERSION = _version()  # ``GET /version``, as vLLM's


def build_app(engine: Engine, tokenizer, *, model_name: str, vocab_size: int, max_context: int, metrics,
              is_ready=lambda: True, max_prompt: Optional[int] = None,
              spec_modes: tuple = ("fixed", "adaptive"), vision=None, max_logprobs: Optional[int] = None,
              max_n: int = 1, tool_parser: Optional[str] = None,
              reasoning_parser: Optional[str] = None, penalties: bool = False, guided_states: int = 0,
              guided_classes: Optional[int] = None, token_healing: bool = False,
              api_keys: Sequence[str] = (), allowed_origins: Sequence[str] = (),
              max_request_bytes: int = MAX_REQUEST_BYTES, priority_scheduling: bool = False) -> FastAPI:
    app = FastAPI(title="jdspark", docs_url=None, redoc_url=None)
    if api_keys:  # every route but the probes and /metrics needs one of them (``jdspark.serve_auth``)
        app.add_middleware(ApiKeys, keys=list(api_keys))
    if allowed_origins:  # outermost: a preflight is answered, and a 401 carries the headers a browser reads it by
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
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

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the same

    @app.get("/version")
    async def version():
        return {"version": SERVER_VERSION}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "jdspark", "root": model_name,
                  "parent": None, "max_model_len": max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        """OpenAI's retrieve-a-model (``client.models.retrieve``); 404 for any other name."""
        if name != model_name:
            return err(ApiError(404, f"The model '{name}' does not exist (this server serves '{model_name}')",
                                "model", code="model_not_found"))
        return model_card

    async def json_body(request: Request):
        """The request's JSON body, read up to ``max_request_bytes`` (a 413 past it, before the rest is read: a
        runaway client's body is neither held whole nor parsed); one past 64 KiB (a long prompt, an image) parsed
        off the event loop, where it would stall every stream's next chunk."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise ApiError(413, f"the request body of {int(declared)} bytes exceeds this server's limit of "
                                f"{max_request_bytes} (--max-request-bytes)", code="request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_request_bytes:
                raise ApiError(413, f"the request body exceeds this server's limit of {max_request_bytes} bytes "
                                    "(--max-request-bytes)", code="request_too_large")
        try:
            return json.loads(raw) if len(raw) <= 65536 else await asyncio.to_thread(json.loads, bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"invalid JSON: {e}") from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a completion's ``prompt`` or a chat's ``messages`` (``add_generation_prompt``, default true;
        ``continue_final_message``, ``chat_template_kwargs``, ``tools``) as this server would prefill them:
        {"count", "max_model_len", "tokens"}."""
        try:
            body = await json_body(request)
            check_body(body, model_name)
            ids = prompt_ids(body, tokenizer, vocab_size, "messages" in body, vision, tool_parser, None)[0]
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
            check_body(body, model_name)
            ids = get_field(body, "tokens", (list,), None, lambda v: all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v),
                f"a list of token ids in [0, {vocab_size})")
            if ids is None:
                raise ApiError(400, "'tokens' is required", "tokens")
        except ApiError as e:
            return err(e)
        return {"prompt": tokenizer.decode(ids)}

    def engine_requests(qs: list, events: asyncio.Queue) -> list:
        """The engine requests of parsed bodies (``Parsed``), posting (their index, each Event) to ``events``:
        prompt k's completions are [k * best_of, (k + 1) * best_of) (vLLM's choice order), completion j sampled
        with seed + j."""
        loop = asyncio.get_running_loop()
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, Mailbox(loop))
        q = qs[0]
        keep = ((markers if q.tools else frozenset()) | (think if q.reasoning is not None else frozenset())
                | (frozenset() if q.skip_special else frozenset(tokenizer.special_ids)))
        reqs = []
        for x in qs:
            # best_of > n: every completion's own log-probabilities rank them (asked or not)
            ranked = x.sampling if x.best_of == x.n or x.sampling.logprobs is not None else dataclasses.replace(
                x.sampling, logprobs=0)
            for j in range(x.best_of):
                i = len(reqs)
                reqs.append(EngineRequest(
                    ranked if j == 0 else dataclasses.replace(ranked, seed=(ranked.seed + j) % 2 ** 63),
                    lambda ev, i=i: mailbox.post(events, (i, ev)), stop=x.stop, ignore_eos=x.ignore_eos,
                    include_stop_str=x.include_stop_str, keep_special=keep, healed=x.healed,
                    priority=x.priority))
        return reqs

    def submit(reqs: list):
        """Queue ``reqs`` together: None, or the error response (429 full queue, 503 engine stopped)."""
        try:
            engine.submit_all(reqs)
        except QueueFull as e:
            return err(ApiError(429, str(e), type_="rate_limit_error", code="queue_full"))
        except RuntimeError as e:
            return err(ApiError(503, str(e), type_="server_error"))
        return None

    def parse(body, chat: bool, **kw):  # run off the event loop: a new constraint's automaton takes seconds
        return parse_completion(
            body, tokenizer=tokenizer, vocab_size=vocab_size, max_context=max_context, model_name=model_name,
            chat=chat, max_prompt=max_prompt, spec_modes=spec_modes, vision=vision, max_logprobs=max_logprobs,
            max_n=max_n, tool_parser=tool_parser, reasoning_parser=reasoning_parser, penalties=penalties,
            guided_states=guided_states, guided_classes=guided_classes, token_healing=token_healing,
            priority_scheduling=priority_scheduling, **kw)

    async def serve(request: Request, chat: bool):
        if not is_ready():
            return err(ApiError(503, "warming up: compiling", type_="server_error"))
        try:
            body = await json_body(request)
            qs = await asyncio.to_thread(lambda: [parse(b, chat) for b in ([body] if chat else split_prompts(body))])
        except ApiError as e:
            return err(e)
        q = qs[0]  # the prompts' bodies differ only in the prompt
        if len(qs) * q.best_of > engine.max_waiting:
            name = "best_of" if q.best_of > q.n else ("n" if len(qs) == 1 else "prompt")
            return err(ApiError(400, f"{len(qs)} prompt(s) x {q.best_of} completions can never be queued together "
                                     f"(the queue holds {engine.max_waiting})", name))
        events: asyncio.Queue = asyncio.Queue()  # (choice index, Event)
        reqs = engine_requests(qs, events)
        firsts = reqs[::q.best_of]  # each prompt's first completion: its prompt counted once in usage
        echoes = [x.echo for x in qs for _ in range(x.best_of)]
        refused = submit(reqs)
        if refused is not None:
            return refused
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if q.stream:
            return StreamingResponse(sse(request, engine, reqs, events, chat, created, model_name, q.include_usage,
                                         tokenizer, echoes, q.tools, q.reasoning, firsts, q.continuous_usage),
                                     media_type="text/event-stream")
        got = await collect(request, engine, reqs, events, echoes)
        if got is None:
            return Response(status_code=499)
        failed = next((c.last.error for c in got if c.last.error is not None), None)
        if failed is not None:
            return err(ApiError(400, failed, "prompt"))
        choices = []
        for k, x in enumerate(qs):
            group = got[k * x.best_of:(k + 1) * x.best_of]
            if x.best_of > x.n:  # the n with the highest mean log-probability per token (OpenAI's "best"), in order
                group = sorted(group, key=lambda c: -c.mean_logprob)[:x.n]
            choices += [_choice(x, c, len(choices) + i, chat) for i, c in enumerate(group)]
        out = {"id": reqs[0].id, "object": obj, "created": created, "model": model_name, "choices": choices,
               "usage": combined_usage(reqs, firsts)}
        if chat and q.prompt_logprobs is not None:  # vLLM's place for a chat's: the response's, once
            out["prompt_logprobs"] = prompt_logprobs_object(tokenizer, reqs[0].sampling.prompt_ids, got[0].prompt,
                                                            q.prompt_logprobs)
        return out

    def _choice(q, c, index: int, chat: bool) -> dict:
        """One choice of a non-streamed response: completion ``c`` of the request ``q`` (a ``Parsed``)."""
        choice = {"index": index, "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason,
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
            if q.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_object(tokenizer, q.sampling.prompt_ids, c.prompt,
                                                                   q.prompt_logprobs)
        return choice

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API over the chat path (``jdspark.serve_responses``)."""
        if not is_ready():
            return err(ApiError(503, "warming up: compiling", type_="server_error"))
        try:
            chat, meta = responses_api.chat_body(await json_body(request))
            q = await asyncio.to_thread(parse, chat, True, default_max_tokens=None)
        except ApiError as e:
            return err(e)
        events: asyncio.Queue = asyncio.Queue()
        reqs = engine_requests([q], events)
        refused = submit(reqs)
        if refused is not None:
            return refused
        rid, created = responses_api.new_id("resp"), int(time.time())
        if q.stream:
            return StreamingResponse(responses_api.stream_events(request, engine, reqs[0], events, rid, created,
                                                                 model_name, meta, tokenizer, q.reasoning, q.tools),
                                     media_type="text/event-stream")
        got = await collect(request, engine, reqs, events)
        if got is None:
            return Response(status_code=499)
        if got[0].last.error is not None:
            return err(ApiError(400, got[0].last.error, "input"))
        output, thought = responses_api.output_items("".join(got[0].text), q.reasoning, q.tools)
        return responses_api.response_object(rid, created, model_name, meta, output,
                                             responses_api.status_of(got[0].last.finish_reason),
                                             responses_api.usage(reqs, tokenizer, thought))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def make_engine(a: argparse.Namespace):
    """Load the pair and build the slots, metrics and engine a server of these arguments serves with (not yet
    warmed up or started). Returns (engine, backend, target, tokenizer, metrics, model name)."""
    tdir, ddir = os.path.join(a.checkpoint, "target"), os.path.join(a.checkpoint, "drafter")
    if not os.path.isfile(os.path.join(tdir, "config.json")):
        raise ValueError(f"--checkpoint {a.checkpoint}: expected a folder with target/config.json (and drafter/), "
                         f"found no {os.path.join(tdir, 'config.json')}")
    target = kimi.load_checkpoint(tdir, config_overrides={"serving_dtype": a.serving_dtype})
    drafter = load_drafter(ddir, target=target) if a.spec != "off" and os.path.isdir(ddir) else None
    drafter = apply_context_window(drafter, a.drafter_window)
    tok = kimi.load_tokenizer(tdir, vocab_size=target.config.vocab_size)
    name = a.model_name or os.path.basename(os.path.normpath(a.checkpoint))
    backend = SlotBackend(target, drafter, num_slots=a.slots, max_len=a.max_len,
                          prompt_buckets=a.prompt_buckets, prefill_chunk=a.prefill_chunk,
                          insert_batch=a.insert_batch, slice_tokens=a.prefill_slice,
                          multi_step=a.multi_step, multi_step_max_batch=a.multi_step_max_batch or a.slots,
                          multi_step_plain_max_batch=a.multi_step_plain_max_batch or a.slots,
                          prefix_pool=a.prefix_pool, prefix_answers=a.prefix_answers, prefix_split=a.prefix_split,
                          max_logprobs=a.max_logprobs if a.logprobs else None, penalties=a.penalties,
                          guided_states=a.guided_states, guided_classes=a.guided_classes,
                          num_speculative_tokens=a.num_speculative_tokens,
                          adaptive=a.spec == "adaptive" and drafter is not None and drafter.confidence_head is not None)
    metrics = ServeMetrics(name, max_positions=backend.G + 1)
    engine = Engine(backend, tok, eos_token_id=target.config.eos_token_id, max_waiting=a.max_waiting,
                    metrics=metrics)
    return engine, backend, target, tok, metrics, name


def main(argv=None) -> int:
    """``python -m jdspark.serve --checkpoint DIR --slots S --port P``: load the pair, compile every program,
    then serve (``/health`` answers 503 until the compiles are done)."""
    a = parse_args(argv)
    use_compile_cache(a.compile_cache)
    try:
        engine, backend, target, tok, metrics, name = make_engine(a)
    except (ValueError, OSError) as e:  # a checkpoint or flag the pair cannot serve: say what, without a traceback
        print(f"python -m jdspark.serve: error: {e}", file=sys.stderr)
        return 2
    ready = threading.Event()

    def warm():
        t0 = time.perf_counter()
        n = len(backend.programs()) + len(backend.group_programs())
        print(f"[serve] compiling {n} programs, several at a time", file=sys.stderr, flush=True)
        if backend.prefix is not None:
            mib = tree_bytes(backend.pool) / 2**20
            answers = "answers kept while idle" if backend.prefix_answers else "answers not kept"
            split = "shared beginnings kept" if backend.prefix_split else "shared beginnings not kept"
            print(f"[serve] prefix cache: up to {backend.prefix.capacity} prompts kept ({mib:.0f} MiB; {answers}; "
                  f"{split})",
                  file=sys.stderr, flush=True)
        try:
            backend.warm_up()
        except Exception as e:  # a server that can never be ready exits saying why (not 503 for ever)
            print(f"[serve] start-up failed: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        if backend.guided_states:  # the commonest constraint, built and kept before the first request asks
            guided_constraint({"response_format": {"type": "json_object"}}, tok, target.config.vocab_size,
                              backend.guided_states, False, (), guided_classes=backend.guided_classes)
        tok.heal_index()  # token healing's index (any request may ask for it), not built in the first one's thread
        # Start-up leaves ~1.7M objects the collector tracks (the programs' Python side): a full pass over them took
        # ~1 s, holding the GIL, whenever a request's allocations triggered one. They live as long as the server:
        # frozen, the collector's passes skip them.
        gc.collect()
        gc.freeze()
        if a.pin_threads == "on" and jax.default_backend() == "cpu":
            pinned = pin_cpu_workers()
            print(f"[serve] XLA:CPU worker threads pinned to cores {sorted({c for _, c in pinned})}" if pinned else
                  "[serve] XLA:CPU worker threads not pinned (none found, or one core)", file=sys.stderr, flush=True)
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
                    penalties=backend.penalties, guided_states=backend.guided_states,
                    guided_classes=backend.guided_classes, token_healing=a.token_healing, api_keys=a.api_key,
                    allowed_origins=a.allowed_origins, max_request_bytes=a.max_request_bytes,
                    priority_scheduling=a.scheduling_policy == "priority")
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
