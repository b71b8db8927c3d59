"""Request bodies mutated at random (fixed seeds): the server's parsing answers each with a request the engine takes
or an OpenAI error (``ApiError``, a 4xx), never another exception (which the server would answer with a 500).

What "the engine takes" means here: the parsed stop strings build their automaton (``jdspark.stop_strings``), which
is where ``"stop": ""`` used to fail after parsing had let it through."""

import json
import random

import pytest

from jdspark import serve_responses
from jdspark.serve_request import ApiError, parse_completion
from jdspark.stop_strings import stop_fsm
from kimi.tokenizer import ByteTokenizer
from tests.jdspark.test_tool_calls import TEMPLATE

TOK = ByteTokenizer(chat_template=TEMPLATE)

VALUES = [None, True, False, 0, 1, -1, 2, 0.5, -0.5, 1.5, 1e308, float("nan"), float("inf"), "", "x", "0", [], [1],
          [""], ["a", ""], {}, {"a": 1}, [[1, 2]], [0, 5000], 2 ** 70, -2 ** 70, [{"role": "user"}],
          [{"role": "user", "content": 5}], {"type": "json_object"}, {"type": "json_schema"},
          {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "auto", "none", "required",
          {"type": "function"}, {"type": "function", "function": {"name": "zz"}}, [{"type": "text"}],
          [{"type": "image_url"}], [{"type": "text", "text": 3}], {"include_usage": "y"},
          {"continuous_usage_stats": True}, [1.5], ["x", 3], [[]], [None], {"1": 1}, {"99999": 5}, {"a": "b"}]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "best_of", "logprobs",
          "top_logprobs", "echo", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "response_format", "tools", "tool_choice", "guided_json", "guided_regex", "guided_choice",
          "speculative", "spec_mode", "model", "truncate_prompt_tokens", "prompt_logprobs", "skip_special_tokens",
          "include_stop_str_in_output", "allowed_token_ids", "chat_template_kwargs", "add_generation_prompt",
          "continue_final_message", "suffix", "bad_words", "documents"]
# values a field takes (half the mutations draw from here, so that many bodies parse and reach the later checks)
PLAUSIBLE = {"temperature": [0, 0.7], "top_p": [0.5, 1], "top_k": [0, 5, -1], "min_p": [0.1], "seed": [3],
             "stop": ["\n", ["a", "bc"], "\u00e9", ""], "stop_token_ids": [[5]], "ignore_eos": [True], "stream": [True],
             "n": [2], "best_of": [3], "logprobs": [1, True], "top_logprobs": [2], "echo": [True],
             "speculative": [False], "spec_mode": ["fixed"], "response_format": [{"type": "json_object"}],
             "guided_regex": ["[ab]+"], "guided_choice": [["yes", "no"]], "truncate_prompt_tokens": [2],
             "include_stop_str_in_output": [True], "allowed_token_ids": [[97, 98]], "skip_special_tokens": [False],
             "max_tokens": [1, 8], "model": ["m"], "add_generation_prompt": [False], "prompt": [[97, 98], "abc"]}
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "type", "text", "image_url", "function",
                "arguments", "id", "call_id", "output"]
RESPONSES_FIELDS = ["instructions", "tools", "tool_choice", "text", "reasoning", "previous_response_id", "include",
                    "temperature", "max_output_tokens", "truncation"]


def _nested(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.5:
        return rng.choice(VALUES + ["user", "assistant", "tool", "function_call", "message", "{\"a\": 1}"])
    if r < 0.75:
        return {rng.choice(MESSAGE_KEYS): _nested(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [_nested(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _body(rng) -> tuple:
    """(endpoint, body): a valid completions / chat / Responses body with one to four fields set at random."""
    kind = rng.choice(["completions", "chat", "responses"])
    if kind == "responses":
        body = {"input": rng.choice(["hi", [_nested(rng) for _ in range(rng.randint(1, 3))]]), "max_output_tokens": 4}
        for _ in range(rng.randint(0, 3)):
            body[rng.choice(RESPONSES_FIELDS)] = _nested(rng)
        return kind, body
    body = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "def f("}
    body["max_tokens"] = 4
    if kind == "chat" and rng.random() < 0.3:
        body["messages"].append({rng.choice(MESSAGE_KEYS): _nested(rng) for _ in range(rng.randint(1, 3))})
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(FIELDS)
        body[name] = rng.choice(PLAUSIBLE[name] if name in PLAUSIBLE and rng.random() < 0.5 else VALUES)
    return kind, body


def _served(kind: str, body: dict):
    """What the server does with the body before the engine: a Parsed, or ApiError."""
    if kind == "responses":
        body = serve_responses.chat_body(body)[0]
    q = parse_completion(body, tokenizer=TOK, vocab_size=TOK.vocab_size, max_context=512, model_name="m",
                         chat=kind != "completions", max_prompt=256, max_logprobs=5, max_n=4,
                         tool_parser="kimi_k2", guided_states=64)
    if q.stop:
        stop_fsm(tuple(q.stop), TOK)
    return q


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_bodies_parse_or_get_an_openai_error(seed):
    rng = random.Random(seed)
    outcomes = {"parsed": 0, "error": 0}
    for _ in range(1000):
        kind, body = _body(rng)
        try:
            _served(kind, body)
            outcomes["parsed"] += 1
        except ApiError as e:
            assert 400 <= e.status < 500 and e.message, (kind, body)
            outcomes["error"] += 1
        except Exception as e:  # what the server would answer with a 500
            pytest.fail(f"{kind} body {json.dumps(body, default=str)[:300]} raised {e!r}")
    # both outcomes are exercised (a generator whose bodies all fail early would test nothing)
    assert outcomes["parsed"] >= 100 and outcomes["error"] >= 100, outcomes


def test_an_empty_stop_string_is_an_openai_error():
    for stop in ("", ["a", ""]):
        with pytest.raises(ApiError, match="'stop' must be a non-empty string"):
            _served("completions", {"prompt": "x", "stop": stop})
