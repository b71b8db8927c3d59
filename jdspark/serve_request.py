"""Request bodies of the OpenAI-compatible server (``jdspark.serve``), validated: ``parse_completion`` turns a
completions or chat body into what the engine serves (``Parsed``) or an ``ApiError`` naming the field and what was
expected (OpenAI's error body, the status to answer). ``prompt_ids`` is the one place a prompt (text, token ids,
or chat messages through the checkpoint's template, with tools and images) becomes ids: the completions and
``/tokenize`` both read it.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, Optional

from jinja2 import TemplateError

from jdspark import reasoning
from jdspark.engine import SamplingRequest
from jdspark.serve_errors import ApiError, get_field
from jdspark.serve_guided import forced_tool, guided_constraint, guided_request
from jdspark.serve_media import MediaError, encode_with_images, message_text
from kimi.tokenizer import PLAIN_CHAT_TEMPLATE

__all__ = ["ApiError", "Parsed", "UNSUPPORTED_FIELDS", "check_body", "get_field", "parse_completion", "prompt_ids",
           "reject_unsupported", "split_prompts"]


# OpenAI / vLLM request fields this server does not implement, with the values that ask for nothing (clients send
# them as defaults). Any other value is a 400 naming the field (code "unsupported"): never silently ignored.
UNSUPPORTED_FIELDS = {
    "suffix": ("",), "functions": ([],),
    # vLLM's extra fields: beam search, grammars (EBNF / Lark: constrained decoding takes regular languages only),
    # multi-token bans, custom logits processors, embeddings as prompts, token ids spelled as strings
    "use_beam_search": (False,), "length_penalty": (1.0, 1), "guided_grammar": (), "bad_words": ([],),
    "guided_whitespace_pattern": (),  # JSON's layout here is json.dumps' (jdspark.json_schema)
    "logits_processors": ([],), "prompt_embeds": (), "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,), "documents": ([],),
}


def reject_unsupported(body: dict, fields: dict = UNSUPPORTED_FIELDS) -> None:
    """A 400 naming the first of ``fields`` ({name: the values that ask for nothing}) the body sets otherwise."""
    for name, ok in fields.items():
        v = body.get(name)
        if v is None or any(v == o and type(v) is type(o) for o in ok):
            continue
        shown = "".join(f" or {json.dumps(o)}" for o in ok)
        raise ApiError(400, f"'{name}' = {json.dumps(v)[:60]} is not supported by this server (it accepts null"
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
    skip_special: bool = True  # vLLM's skip_special_tokens: special tokens' names left out of the text
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage): every
    # streamed chunk carries the usage so far
    prompt_logprobs: Optional[int] = None  # vLLM's: the prompt tokens' log-probabilities and ranks, this many top
    healed: str = ""  # token healing: the prompt's last token's text, taken off its ids (``engine.Request.healed``)
    priority: int = 0  # vLLM's: lower is admitted first (``engine.Request.priority``; --scheduling-policy priority)


def parse_completion(body: Any, *, tokenizer, vocab_size: int, max_context: int, model_name: str,
                     chat: bool = False, max_prompt: Optional[int] = None,
                     spec_modes: tuple = ("fixed", "adaptive"), vision=None,
                     max_logprobs: Optional[int] = None, max_n: int = 1,
                     tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                     penalties: bool = True, default_max_tokens: Optional[int] = 16,
                     guided_states: int = 0, guided_classes: Optional[int] = None,
                     token_healing: bool = False, priority_scheduling: bool = False) -> Parsed:
    """A request body's ``Parsed`` form, or ApiError. ``default_max_tokens``: a request's ``max_tokens`` when it
    names none (None: the rest of the context after its prompt, as the Responses API's ``max_output_tokens``);
    ``max_n``: the most choices a request may ask (``n``);
    ``tool_parser``: the tool-call format answers are read in (``jdspark.tool_calls.PARSERS``; None: no tools);
    ``reasoning_parser``: how a chat answer's reasoning is told from the rest (``jdspark.reasoning``; None: not);
    ``penalties``: whether the server applies repetition / frequency / presence penalties, logit_bias and
    min_tokens (``--penalties``); ``guided_states``: the most automaton states a constrained request may take
    (``--guided-states``; 0: none is served), ``guided_classes`` the most token classes (``--guided-classes``;
    None: any); ``token_healing``: heal a prompt that ends in text (completions, a chat continuing its final
    message) unless it says ``"token_healing": false`` (``--token-healing``; ``_healing``);
    ``priority_scheduling``: a request's ``priority`` orders the waiting queue (``--scheduling-policy priority``;
    else a non-zero one is a 400, as vLLM's).
    ``vision``: the checkpoint's VisionConfig (chat ``image_url`` parts are then taken, ``jdspark.serve_media``),
    or None (text-only: an image part is a 400 naming that). ``max_logprobs``: the most top log-probabilities a
    request may ask (None: the server computes none)."""
    try:
        return _parse(body, tokenizer, vocab_size, max_context, model_name, chat, max_prompt, spec_modes, vision,
                      max_logprobs, max_n, tool_parser, reasoning_parser, penalties, default_max_tokens,
                      guided_states, guided_classes, token_healing, priority_scheduling)
    except MediaError as e:
        raise ApiError(400, e.message, e.param, code=e.code) from None


def _healing(body: dict, tokenizer, ids, chat: bool, default: bool, clashes: dict):
    """Token healing of a prompt that ends in text (``kimi.tokenizer.Tokenizer.heal``; an extension field,
    ``"token_healing"``, default ``default``): a completions prompt, or a chat that continues its final message
    (``continue_final_message``: an assistant's answer begun by the client). The prompt's last token is taken off
    and the first generated token must begin with its text, which the answer's text then leaves out (the client
    sent it). A code prompt ending in a newline otherwise ends on a token the model seldom saw there (BPE merges a
    newline with the next line's indentation) and the answer dedents. ``clashes`` ({field: asked}): what it is not
    served with, a 400 when the request asks for both (log-probabilities: the first token's text begins in the
    prompt; a grammar or allowed_token_ids: their masks and healing's may leave no token), else the server's
    default yields. None: not healed (not asked, or a prompt that ends on a special token or has nothing before its
    last token)."""
    asked = get_field(body, "token_healing", (bool,), None, what="a boolean")
    clash = next((name for name, on in clashes.items() if on), None)
    in_text = not chat or body.get("continue_final_message") is True  # (else it ends on the template's tokens)
    if asked and not in_text:
        raise ApiError(400, "'token_healing' is taken on /v1/completions and on a chat that continues its final "
                            "message (\"continue_final_message\": true); this chat prompt ends on its template's "
                            "tokens", "token_healing", code="unsupported")
    if asked and clash is not None:
        raise ApiError(400, f"'token_healing' is not served with '{clash}' (the first token's text begins in the "
                            "prompt; a constraint's mask and healing's may leave no token)", "token_healing",
                       code="unsupported")
    heal = asked if asked is not None else default and in_text and clash is None
    return tokenizer.heal(ids) if heal else None


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
        on = get_field(body, "logprobs", (bool,), False, what="a boolean")
        top = get_field(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= limit, what)
        if top is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        asked = (top or 0) if on else None
    else:
        asked = get_field(body, "logprobs", (int,), None, lambda v: 0 <= v <= limit, what)
    if asked is not None and max_logprobs is None:
        raise ApiError(400, "log-probabilities are off on this server (started with --no-logprobs)", "logprobs",
                       code="unsupported")
    return asked


def _prompt_logprobs(body: dict, max_logprobs: Optional[int], stream: bool) -> Optional[int]:
    """vLLM's ``prompt_logprobs`` (None: none): each prompt token's log-probability and rank, and this many top
    entries (0: the token's own alone); not streamed (as vLLM)."""
    limit = -1 if max_logprobs is None else max_logprobs
    what = f"an integer in 0..{limit}" if limit >= 0 else "null (this server computes no log-probabilities)"
    asked = get_field(body, "prompt_logprobs", (int,), None, lambda v: 0 <= v <= limit, what)
    if asked is not None and max_logprobs is None:
        raise ApiError(400, "log-probabilities are off on this server (started with --no-logprobs)",
                       "prompt_logprobs", code="unsupported")
    if asked is not None and stream:
        raise ApiError(400, "'prompt_logprobs' is not served with \"stream\": true (they come whole, in the "
                            "response)", "prompt_logprobs")
    return asked


def _tools(body: dict, chat: bool, tokenizer, tool_parser: Optional[str]) -> Optional[list]:
    """The tools to render (None: none), from chat's ``tools`` and ``tool_choice`` ("auto", "none", or forcing a
    call: "required" or {"type": "function", "function": {"name": ...}}, a constraint ``serve_guided`` builds)."""
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
    forced = forced_tool(choice)
    if choice not in (None, "auto", "none", "required") and forced is None:
        raise ApiError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", "tool_choice")
    if forced and (not tools or (forced is not True and forced not in [t["function"]["name"] for t in tools])):
        raise ApiError(400, "'tool_choice' forces a call " + ("but no tools are given" if not tools else
                                                               f"to {forced!r}, which is not among the tools"),
                       "tool_choice")
    if not tools or choice == "none":
        return None
    if tool_parser is None:
        raise ApiError(400, "'tools': this server reads no tool calls (started with --tool-call-parser none)",
                       "tools", code="unsupported")
    if "tools" not in (tokenizer.chat_template or PLAIN_CHAT_TEMPLATE):  # (the fallback a checkpoint without one gets)
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


def split_prompts(body) -> list:
    """A completions body per prompt: OpenAI's ``prompt`` may be a list of prompts (strings, or lists of token ids),
    each answered with its own choices; any other body is itself (``parse_completion`` checks it)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return [{**body, "prompt": p} for p in prompt]
    return [body]


def check_body(body, model_name: str) -> None:
    """A request body is a JSON object naming this server's model, or none."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves '{model_name}')", "model",
                       code="model_not_found")


def _render_options(body: dict) -> tuple:
    """A chat body's rendering options (vLLM's): ``add_generation_prompt`` (default true),
    ``continue_final_message`` (default false: the final message left open, for the model to continue it; not with
    a generation prompt), ``chat_template_kwargs`` (more variables for the template, such as a thinking switch).
    Returns (add_generation_prompt, continue_final_message, the kwargs)."""
    add = get_field(body, "add_generation_prompt", (bool,), True, what="a boolean")
    cont = get_field(body, "continue_final_message", (bool,), False, what="a boolean")
    if add and cont:
        raise ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true (send "
                            "\"add_generation_prompt\": false to continue the final message)", "continue_final_message")
    kw = get_field(body, "chat_template_kwargs", (dict,), {}, what="an object")
    taken = sorted(set(kw) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"})
    if taken:
        raise ApiError(400, f"'chat_template_kwargs': {taken[0]!r} is set by the request itself, not a template "
                            "keyword", "chat_template_kwargs")
    return add, cont, kw


def _continue_final(rendered: str, final: str) -> str:
    """The rendered chat cut right after the final message's text, so the model continues that message (what
    transformers' ``continue_final_message`` does): where the template kept the message's trailing whitespace, after
    it, else after its stripped text."""
    core = final.strip()
    if not core or core not in rendered:
        raise ApiError(400, "'continue_final_message': the final message's text must be non-empty and appear in the "
                            "rendered chat (this template drops it)", "messages")
    at = rendered.rindex(core)
    start = at - (len(final) - len(final.lstrip()))  # where the unstripped message would begin
    if start >= 0 and rendered[start:start + len(final)] == final:
        return rendered[:start + len(final)]
    return rendered[:at + len(core)]


def prompt_ids(body: dict, tokenizer, vocab_size: int, chat: bool, vision, tool_parser, reasoning_parser) -> tuple:
    """A request's prompt ids: chat ``messages`` rendered by the chat template (with ``tools``, images expanded to
    their placeholders, ``_render_options``), or a completion's ``prompt`` (text or token ids). Returns (ids, the
    prompt's text for an echo, the images' VisionInput or None, the tools or None, whether the rendered prompt
    opened a think block)."""
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
        add, cont, template_kw = _render_options(body)
        try:
            rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=add, **template_kw,
                                                     **({} if tools is None else {"tools": tools}))
        except TemplateError as e:  # the template's own raise_exception: what it refuses, said by it
            raise ApiError(400, f"the chat template refused the request: {e}", "messages") from None
        if cont:
            rendered = _continue_final(rendered, msgs[-1]["content"])
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
            raise ApiError(400, "'prompt' must be a string, a non-empty list of token ids, or a non-empty list of "
                                "either (one per prompt)", "prompt")
    return ids, echo_text, vin, tools, started


def _parse(body, tokenizer, vocab_size, max_context, model_name, chat, max_prompt, spec_modes, vision,
           max_logprobs, max_n, tool_parser, reasoning_parser, penalties_served=True, default_max_tokens=16,
           guided_states=0, guided_classes=None, token_healing=False, priority_scheduling=False):
    check_body(body, model_name)
    reject_unsupported(body)
    if chat and body.get("echo") not in (None, False):
        raise ApiError(400, "'echo' is not supported on /v1/chat/completions (only on /v1/completions)", "echo",
                       code="unsupported")
    echo = False if chat else get_field(body, "echo", (bool,), False, what="a boolean")
    ids, echo_text, vin, tools, started = prompt_ids(body, tokenizer, vocab_size, chat, vision, tool_parser,
                                                     reasoning_parser)
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    keep = get_field(body, "truncate_prompt_tokens", (int,), None, lambda v: v >= 1 or v == -1,
                     "an integer >= 1, or -1 (the longest prompt this server takes)")
    if keep is not None:  # vLLM's: the prompt's last ``keep`` tokens
        keep = (max_prompt or max_context) if keep == -1 else keep
        if len(ids) > keep:
            if vin is not None:
                raise ApiError(400, "'truncate_prompt_tokens' would cut a prompt with images (their placeholders "
                                    "must stay whole)", "truncate_prompt_tokens", code="unsupported")
            ids = ids[-keep:]
            echo_text = tokenizer.decode(ids) if echo else echo_text
    if max_prompt is not None and len(ids) > max_prompt:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {max_prompt} (its largest "
                            "prompt bucket)", "prompt")
    max_tokens = get_field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                           (int,), max(1, max_context - len(ids)) if default_max_tokens is None else default_max_tokens,
                           lambda v: v >= (0 if echo else 1),
                           "an integer >= 0 (0: the prompt's echo alone)" if echo else "an integer >= 1")
    if len(ids) + max_tokens > max_context:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceed the context of "
                            f"{max_context} tokens", "max_tokens")
    temperature = float(get_field(body, "temperature", (int, float), 1.0, lambda v: math.isfinite(v) and v >= 0,
                                  "a number >= 0"))
    top_p = float(get_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"))
    top_k = get_field(body, "top_k", (int,), 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)")
    min_p = float(get_field(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)"))
    seed = get_field(body, "seed", (int,), 0, lambda v: 0 <= v < 2 ** 63, "a non-negative integer")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str) and stop:
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:  # "" as vLLM: "stop cannot contain an empty string" (every text holds it: the answer would end at once)
        raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    ignore_eos = get_field(body, "ignore_eos", (bool,), False, what="a boolean")
    include_stop_str = get_field(body, "include_stop_str_in_output", (bool,), False, what="a boolean")
    stream = get_field(body, "stream", (bool,), False, what="a boolean")
    speculative = get_field(body, "speculative", (bool,), True, what="a boolean")
    spec_mode = get_field(body, "spec_mode", (str,), None, lambda v: v in ("fixed", "adaptive"),
                          "'fixed' or 'adaptive'")
    if spec_mode is not None and spec_mode not in spec_modes:
        raise ApiError(400, f"spec_mode {spec_mode!r} is not served here (this server offers {list(spec_modes)}; "
                       "start it with --spec adaptive for both)", "spec_mode", code="unsupported")
    opts = get_field(body, "stream_options", (dict,), {}, what="an object")
    include_usage, continuous = (get_field(opts, k, (bool,), False, what="a boolean")
                                 for k in ("include_usage", "continuous_usage_stats"))
    logprobs = _logprobs(body, chat, max_logprobs)
    plp = _prompt_logprobs(body, max_logprobs, stream)
    prefilled = max((x for x in (logprobs if echo else None, plp) if x is not None), default=None)
    penalties = {name: float(get_field(body, name, (int, float), off, ok, what)) for name, off, ok, what in (
        ("repetition_penalty", 1.0, lambda v: math.isfinite(v) and v > 0, "a number > 0 (1: off)"),
        ("frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
        ("presence_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"))}
    logit_bias = _logit_bias(body, vocab_size)
    allowed = get_field(body, "allowed_token_ids", (list,), [], lambda v: all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v),
        f"a list of token ids in [0, {vocab_size})")
    stop_ids = get_field(body, "stop_token_ids", (list,), [], lambda v: all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v),
        f"a list of token ids in [0, {vocab_size})")
    min_tokens = get_field(body, "min_tokens", (int,), 0, lambda v: 0 <= v <= max_tokens,
                           f"an integer in 0..max_tokens ({max_tokens})")
    asked = [k for k, v in penalties.items() if v != (1.0 if k == "repetition_penalty" else 0.0)]
    asked += (["logit_bias"] * bool(logit_bias) + ["min_tokens"] * bool(min_tokens)
              + ["allowed_token_ids"] * bool(allowed))
    if asked and not penalties_served:
        raise ApiError(400, f"'{asked[0]}': penalties and logit controls are off on this server (start it with "
                            "--penalties)", asked[0], code="unsupported")
    grammar = guided_constraint(body, tokenizer, vocab_size, guided_states, ignore_eos, stop_ids, bool(started),
                                guided_classes)
    n = get_field(body, "n", (int,), 1, lambda v: 1 <= v <= max_n, f"an integer in 1..{max_n}")
    if chat and body.get("best_of") not in (None, 1, n):
        raise ApiError(400, "'best_of' is not supported on /v1/chat/completions (only on /v1/completions)",
                       "best_of", code="unsupported")
    best_of = get_field(body, "best_of", (int,), n, lambda v: n <= v <= max_n, f"an integer in {n}..{max_n} (>= n)")
    if best_of > n and stream:
        raise ApiError(400, "'best_of' > 'n' cannot be streamed (the likeliest are known only when all have ended)",
                       "best_of")
    healed = _healing(body, tokenizer, ids, chat, token_healing, {
        "logprobs": logprobs is not None, "prompt_logprobs": plp is not None, "allowed_token_ids": bool(allowed),
        guided_request(body)[0] if grammar is not None else "guided_regex": grammar is not None})
    if healed is not None:
        ids = healed.ids
    sp = SamplingRequest(tuple(int(t) for t in ids), int(max_tokens), temperature, top_p, max(int(top_k), 0),
                         int(seed), bool(speculative), spec_mode, images=vin, logprobs=logprobs,
                         prompt_logprobs=prefilled, logit_bias=logit_bias,
                         min_tokens=int(min_tokens), stop_token_ids=tuple(dict.fromkeys(stop_ids)), min_p=min_p,
                         allowed_token_ids=tuple(sorted(set(allowed))), grammar=grammar,
                         first_token_ids=() if healed is None else tuple(healed.first_ids), **penalties)
    skip_special = get_field(body, "skip_special_tokens", (bool,), True, what="a boolean")
    priority = get_field(body, "priority", (int,), 0, lambda v: abs(v) < 2 ** 63, "an integer")
    if priority and not priority_scheduling:
        raise ApiError(400, f"'priority' = {priority}: this server schedules first come, first served (start it with "
                            "--scheduling-policy priority)", "priority", code="unsupported")
    return Parsed(sp, stop, bool(ignore_eos), bool(stream), include_usage, echo_text if echo else None, int(n),
                  int(best_of), tools is not None, started, bool(include_stop_str), bool(skip_special),
                  bool(include_usage and continuous), plp, "" if healed is None else healed.text, int(priority))
