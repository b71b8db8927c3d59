"""The server's command line (``python -m jdspark.serve --help``): every flag, its default and its check, each a
usage error naming the flag and what was expected (argparse's exit 2) before anything loads. ``jdspark.serve``
builds the engine and the app from what ``parse_args`` returns."""

from __future__ import annotations

import argparse
import json
import os
import re

import jax

from jdspark import reasoning, tool_calls
from jdspark.drafter import CHECKPOINT_WINDOW, parse_context_window
from jdspark.graphs import COMPILE_CACHE_DIR
from jdspark.logprobs import MAX_LOGPROBS
from jdspark.slots import GUIDED_CLASSES, GUIDED_STATES, insert_batch_plan, multi_step_plan, prefill_slice_plan

__all__ = ["MAX_REQUEST_BYTES", "parse_args"]

# The largest request body read (``--max-request-bytes``; a 413 past it): a 1024-token prompt is a few KiB, a chat
# with a few inline base64 images a few MiB (TGI's payload limit is 2 MB; vLLM has none)
MAX_REQUEST_BYTES = 32 * 2**20


def _positive_ints(text: str) -> tuple:
    """``--prompt-buckets``' value: comma-separated positive ints."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints (e.g. 64,128,256), got {text!r}")
    return out


def _origins(text: str) -> tuple:
    """``--allowed-origins``' value: comma-separated origins (scheme://host[:port]) or '*', as vLLM's JSON list
    too ('["http://a", "http://b"]')."""
    raw = text.strip()
    items = json.loads(raw) if raw.startswith("[") else raw.split(",")
    out = tuple(str(x).strip().rstrip("/") for x in items if str(x).strip())
    bad = [o for o in out if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o)]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated origins like http://localhost:3000 (or '*'), "
                                         f"got {bad[0] if bad else text}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The server's command line (``python -m jdspark.serve --help``)."""
    ap = argparse.ArgumentParser(prog="python -m jdspark.serve", description="OpenAI-compatible HTTP server over "
                                 "the engine (FastAPI + uvicorn), with vLLM's Prometheus metric names.")
    ap.add_argument("--checkpoint", default="checkpoints/default", help="folder with target/ (and drafter/)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-len", type=int, default=1024, help="cache positions per slot (prompt + completion)")
    ap.add_argument("--prompt-buckets", type=_positive_ints, default=(64, 128, 256, 512), metavar="P,P,...",
                    help="prompt lengths the prefill is compiled for (a prompt takes the smallest that fits)")
    ap.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429 (>= 1: a request waits "
                    "there until a slot frees, so 0 would refuse every request)")
    ap.add_argument("--spec", choices=("off", "fixed", "adaptive"), default="adaptive",
                    help="off: plain decoding for every request; fixed: verify the drafter's whole block (or "
                         "--num-speculative-tokens of it); adaptive: "
                         "the default request mode picks each step's verify width (requests may ask 'fixed')")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                    help="drafts a step verifies at most (vLLM's setting): fixed verifies the block's first N, "
                         "adaptive picks up to N (default: the drafter's whole block; on a CPU, where each verified "
                         "position costs compute, fewer can pay: docs/performance.md)")
    ap.add_argument("--serving-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the serving copy's matmul weights (activations stay fp32): bfloat16 is faster; with "
                         "float32, greedy output stayed the same with and without speculation and under load in "
                         "every measurement here, where the bf16 copy sometimes splits a near-tie between two "
                         "tokens the other way (docs/serving.md, \"Greedy outputs under batching\")")
    ap.add_argument("--compile-cache", default=os.environ.get("JAX_COMPILATION_CACHE_DIR") or COMPILE_CACHE_DIR,
                    metavar="DIR",
                    help="keep the compiled serving programs in DIR and load them at the next start-up instead of "
                         "compiling them again (the same executables; keyed by program, XLA flags and versions); "
                         "none: off (default: $JAX_COMPILATION_CACHE_DIR or %(default)s)")
    ap.add_argument("--pin-threads", choices=("on", "off"), default="on",
                    help="on a CPU backend, pin each of XLA's worker threads to its own core once warm (a prefill "
                         "after a pause otherwise ran at one core's speed: jdspark.graphs.pin_cpu_workers); off where "
                         "the server shares its cores with other busy processes")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill prompts longer than N tokens in chunks of N (0: one pass; default: kimi.dispatch "
                         "decides: on a CPU chunks of 256 above 1664 tokens, elsewhere of 1024 above 4096)")
    ap.add_argument("--multi-step", type=int, default=None,
                    help="steps per device launch (at batch buckets <= --multi-step-max-batch) while no request "
                         "waits (1: one per launch); default: jdspark.slots.multi_step_plan for the platform (4 on "
                         "a CPU, 8 on a GPU)")
    ap.add_argument("--multi-step-max-batch", type=int, default=None,
                    help="the largest batch bucket launched --multi-step steps at a time (0: every bucket); above it "
                         "one step a launch, where adaptive verification re-plans every step (docs/serving.md); "
                         "default: multi_step_plan's (4 on a CPU, every bucket on a GPU)")
    ap.add_argument("--multi-step-plain-max-batch", type=int, default=None,
                    help="the largest batch bucket a plain launch (width 1: --spec off, adaptive's plain steps; no "
                         "drafts to plan) runs --multi-step steps (0: every bucket); at least --multi-step-max-batch; "
                         "default: multi_step_plan's (every bucket)")
    ap.add_argument("--insert-batch", type=int, default=None, metavar="K",
                    help="requests admitted together prefill up to K at a time where their prompts share a bucket "
                         "(one pass, no prefix-cache hit, images or prompt log-probabilities; jdspark.slot_insert); 1: "
                         "each alone; default: jdspark.slots.insert_batch_plan (4)")
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
    ap.add_argument("--prefill-slice", type=int, default=None, metavar="TOKENS",
                    help="with prefix caching, a prompt whose prefill would take more than TOKENS (one of the prompt "
                         "buckets) is prefilled TOKENS at a time, the other streams stepping between slices (vLLM's "
                         "chunked prefill), and a prompt longer than the largest bucket is served up to --max-len; "
                         "0: off; default: the largest bucket up to 512 (jdspark.slots.prefill_slice_plan)")
    ap.add_argument("--no-prefix-answers", dest="prefix_answers", action="store_false",
                    help="with prefix caching, do not keep finished answers while idle (by default the engine, when "
                         "no request runs or waits, prefills each answer on its kept prompt, so a conversation's next "
                         "turn prefills only its new message)")
    ap.add_argument("--no-prefix-split", dest="prefix_split", action="store_false",
                    help="with prefix caching, do not keep the beginning two prompts share on its own where they part "
                         "(by default a prompt sharing 32 or more leading tokens with a kept one beyond what it finds "
                         "kept, such as a system prompt and tools before each user's message, prefills that "
                         "beginning first and keeps it, so the prompts after it prefill only their own part)")
    ap.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                    help="the most top log-probabilities a request may ask per token (chat's top_logprobs, "
                         "completions' logprobs)")
    ap.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                    help="compile the programs without log-probabilities (a request asking for them is a 400)")
    ap.add_argument("--penalties", action="store_true",
                    help="compile repetition / frequency / presence penalties, logit_bias and min_tokens into the "
                         "programs (without it a request asking for them is a 400: compiled in, steps of requests "
                         "without them cost 3-4%% more at the whole block's width, docs/serving.md)")
    ap.add_argument("--guided-states", type=int, default=GUIDED_STATES, metavar="Q",
                    help="constrained decoding (vLLM's guided_choice / guided_regex / guided_json / "
                         "structured_outputs, OpenAI's response_format json_object / json_schema, forced tool "
                         "calls): each slot carries an automaton of up to Q states (Q x --guided-classes + "
                         "vocabulary int32: 2 MiB a slot at the defaults); 0: not compiled in, a request asking "
                         "for it is a 400 (default: %(default)s)")
    ap.add_argument("--guided-classes", type=int, default=GUIDED_CLASSES, metavar="C",
                    help="the most token classes a constrained request's automaton may tell apart (tokens it treats "
                         "alike share a column of the slot's table; jdspark.grammar.token_classes)")
    ap.add_argument("--max-n", type=int, default=16,
                    help="the most choices a request may ask ('n'): each is a request of its own in the engine")
    ap.add_argument("--tool-call-parser", choices=(*tool_calls.PARSERS, "none"), default="kimi_k2",
                    help="the format chat answers' tool calls are read in, when a request has 'tools' (rendered by "
                         "the checkpoint's chat template; none: requests with tools are refused)")
    ap.add_argument("--reasoning-parser", choices=(*reasoning.PARSERS, "none"), default="none",
                    help="think: a chat answer's <think>...</think> reasoning goes to message.reasoning_content "
                         "(delta.reasoning_content when streamed), the rest to content (a thinking model's "
                         "checkpoint); none: the whole text is content")
    ap.add_argument("--token-healing", action="store_true",
                    help="heal prompts that end in text by default (/v1/completions, a chat continuing its final "
                         "message): the last token taken off, the first new one beginning with its text (a code "
                         "prompt ending in a newline gets its indentation); a request's \"token_healing\": false "
                         "keeps its prompt; without this flag a request asks with \"token_healing\": true")
    ap.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="answer only requests with 'Authorization: Bearer KEY' (repeatable: any of them; default: "
                         "$JDSPARK_API_KEY, else none); /health, /ping, /version and /metrics stay open")
    ap.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGIN,...",
                    help="web pages of these origins may call the server from a browser (CORS; '*': any; vLLM's "
                         "flag, whose default is any: here none)")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="N",
                    help="a request body past N bytes is a 413, unread (default %(default)s: a chat of several "
                         "images inline)")
    ap.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                    help="priority: a request's 'priority' (vLLM's field; lower first, FIFO among equals) orders the "
                         "waiting queue (a running request keeps its slot); fcfs: arrival order, a non-zero "
                         "priority a 400")
    ap.add_argument("--model-name", default=None)
    a = ap.parse_args(argv)
    if a.max_request_bytes < 1:
        ap.error(f"--max-request-bytes: expected >= 1, got {a.max_request_bytes}")
    if a.api_key is None:
        a.api_key = [os.environ["JDSPARK_API_KEY"]] if os.environ.get("JDSPARK_API_KEY") else []
    if any(not k.strip() for k in a.api_key):
        ap.error("--api-key: expected a non-empty key")
    plan = multi_step_plan(jax.default_backend())
    a.multi_step = plan[0] if a.multi_step is None else a.multi_step
    a.multi_step_max_batch = plan[1] if a.multi_step_max_batch is None else a.multi_step_max_batch
    plain_given = a.multi_step_plain_max_batch is not None
    if not plain_given:
        a.multi_step_plain_max_batch = plan[2]
    if a.multi_step < 1:
        ap.error(f"--multi-step: expected an int >= 1, got {a.multi_step}")
    if a.multi_step_max_batch < 0:
        ap.error(f"--multi-step-max-batch: expected an int >= 0 (0: every batch bucket), got {a.multi_step_max_batch}")
    if a.multi_step_plain_max_batch < 0:
        ap.error(f"--multi-step-plain-max-batch: expected an int >= 0 (0: every batch bucket), got "
                 f"{a.multi_step_plain_max_batch}")
    wide_top, plain_top = (n or a.slots for n in (a.multi_step_max_batch, a.multi_step_plain_max_batch))  # 0: all
    if plain_top < wide_top:
        if plain_given:
            ap.error(f"--multi-step-plain-max-batch: expected at least --multi-step-max-batch ({wide_top}), got "
                     f"{a.multi_step_plain_max_batch}")
        a.multi_step_plain_max_batch = a.multi_step_max_batch  # the platform's default, below the flag given
    for flag, value, low in (("--slots", a.slots, 1), ("--max-len", a.max_len, 1), ("--max-waiting", a.max_waiting, 1)):
        if value < low:
            ap.error(f"{flag}: expected an int >= {low}, got {value}")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port: expected 0..65535, got {a.port}")
    a.insert_batch = insert_batch_plan(jax.default_backend()) if a.insert_batch is None else a.insert_batch
    if a.insert_batch < 1:
        ap.error(f"--insert-batch: expected an int >= 1 (1: each prompt alone), got {a.insert_batch}")
    if a.prefix_pool is not None and a.prefix_pool < 0:
        ap.error(f"--prefix-pool: expected an int >= 0 (0: off), got {a.prefix_pool}")
    if a.prefill_slice is None:
        a.prefill_slice = 0 if a.prefix_pool == 0 else prefill_slice_plan(a.prompt_buckets)
    elif a.prefill_slice and (a.prefill_slice not in a.prompt_buckets or a.prefix_pool == 0):
        ap.error(f"--prefill-slice: expected 0 (off) or one of --prompt-buckets {','.join(map(str, a.prompt_buckets))}"
                 f", with prefix caching on (not --prefix-pool 0); got {a.prefill_slice}")
    if a.max_n < 1:
        ap.error(f"--max-n: expected an int >= 1, got {a.max_n}")
    if a.max_logprobs < 0:
        ap.error(f"--max-logprobs: expected an int >= 0, got {a.max_logprobs}")
    if a.prefill_chunk is not None and a.prefill_chunk < 0:
        ap.error(f"--prefill-chunk: expected an int >= 0, got {a.prefill_chunk}")
    if a.num_speculative_tokens is not None and (a.num_speculative_tokens < 1 or a.spec == "off"):
        ap.error(f"--num-speculative-tokens: expected an int >= 1 (the drafter's block size at most), and none with "
                 f"--spec off; got {a.num_speculative_tokens}")
    return a
