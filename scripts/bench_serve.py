"""Load test of the OpenAI-compatible server: concurrency 1 .. 16 x speculative mode (off, fixed, adaptive).

  python scripts/bench_serve.py --launch --json                  # starts `python -m jdspark.serve` on 127.0.0.1
  python scripts/bench_serve.py --url http://127.0.0.1:8000 --json --plot serve.png
  python scripts/bench_serve.py --in-process --json --concurrency 1,16   # the same engine, no HTTP: HTTP's cost
  python scripts/bench_serve.py --launch --json --workload prose         # or --corpus DIR, as scripts/bench.py
  python scripts/bench_serve.py --launch --json --prompt-file mine.jsonl # your own traffic: {"prompt": ...} lines
  python scripts/bench_serve.py --launch --json --request-fields '{"response_format": {"type": "json_object"},
      "ignore_eos": false}'                                             # constrained output's acceptance under load
  python scripts/bench_serve.py --launch --json --turns 4                # conversations (prefix caching's traffic)
  python scripts/bench_serve.py --launch --json --shared-prefix 384      # one system prompt, many users' messages
  python scripts/bench_serve.py --url http://127.0.0.1:8000 --openai-compatible --json   # another OpenAI server

Each cell runs ``--requests`` streamed completions of the prompts (held-out code by default; ``load_prompts``; the
JSON's ``prompts`` says which) as token ids (``ignore_eos``, a fixed ``--max-tokens``, fixed seeds) from
``concurrency`` clients at once and reports: aggregate output tok/s (completion
tokens over the cell's wall time), per-user tok/s (each request's completion tokens over its own latency,
averaged), TTFT / TPOT / ITL (mean, p50, p99, in ms; tokens counted from ``usage``, not from chunks), accept_len
(1 + accepted / drafts from the server's ``/metrics`` deltas: the acceptance this traffic got) and the mean verified
tokens per slot per step (``jdspark:verified_tokens_per_step``), and the adaptive scheduler's step cost per verify
width at the cell's batch bucket after the cell (``step_cost_ms``, from ``jdspark:step_cost_seconds``). The mode
is sent per request (``speculative`` false for off; ``spec_mode`` fixed or adaptive). Greedy and sampled
(``--temperatures 0,1``) cells. Each cell runs ``--rounds`` times, the modes of one concurrency alternating round
by round (in order, then in reverse: a drift of the machine's speed within a round favours no mode), and reports
its median round (all rounds' tok/s in ``output_tok_s_rounds``); the summary's ratios between modes are medians
of per-round ratios (``paired_ratio``). On a shared 2-core machine
one run of a cell moves by a fifth (two rounds of identical steps, adaptive choosing the whole block every time as
fixed does, came out 10% apart either way), hence 5 rounds and at least 8 requests a cell by default. Only
loopback or the given ``--url`` is contacted; every loop is bounded. ``--in-process`` builds the engine ``--launch``
would serve (``jdspark.serve.make_engine`` on the same arguments) in this process and submits the same requests
to it directly: its cells against ``--launch``'s are what the HTTP layer (and its clients on the same cores) cost.
``--turns N``: each request becomes a conversation of N turns (``conversation``: turn t's prompt is turn t - 1's +
its answer + a ``--message-len`` excerpt of held-out code, sent ``--think-ms`` after the answer), as chat clients
and coding agents send them; cells add ``ttft_ms_p50_by_turn`` and ``cached_share`` (prompt tokens the server's
prefix cache served, from ``usage``).
``--shared-prefix N``: every prompt begins with the same N-token held-out excerpt (a system prompt and tools, a
few-shot context) before its own; cells add ``ttft_ms`` as ever and ``cached_share`` (run it again with
``--server-args "--no-prefix-split"`` to see what keeping the shared beginning buys: ``jdspark.slot_slices``).
Request fields: a ``--prompt-file`` line may carry any request field beside its prompt (``response_format``,
``stop``, ``top_k``, ...) or be a chat (``{"messages": [...], "tools": [...], ...}``, streamed from
``/v1/chat/completions``; its TTFT and ITL time every chunk that carries output: text, reasoning or a tool call), and
``--request-fields JSON`` adds fields to every request; the fields a cell sets itself (``RESERVED_FIELDS``) are
refused. A line's ``ignore_eos`` and ``top_p`` win over the cell's (constrained output ends with EOS, so it needs
``"ignore_eos": false``; its completions then vary in length: tokens are counted from ``usage``, and a cell reports
its ``completion_tokens``). Every distinct request body is sent once before the first cell, so a body the server
refuses stops the run there, naming it.
Greedy cells also say whether their outputs depend on how they were served (``greedy_agreement``): each request's
text against its prompt's text from plain decoding at the lowest concurrency and from its own mode there (batch-1
``jdspark.generate`` of that mode), per cell (``greedy_differing``, ``greedy_batch_differing``) and per mode in the
JSON's ``greedy_agreement``: lossless speculation and batch-independent rows keep every count at 0; bf16 rounding
at near-ties does not (docs/serving.md, "Greedy outputs under batching").
``--openai-compatible`` (with ``--url``): the same load against any OpenAI-compatible server (``transformers
serve``, vLLM, ...), to compare servers on one machine: prompts sent as text, OpenAI's fields only (its completions
end at its EOS, counted from ``usage``), the cells' mode ``server``, accept_len from its ``/metrics`` where it has
vLLM's counters (else null).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shlex
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from serve_clients import EngineClient, HttpClient, launch, scrape, scrape_costs, server_problem  # noqa: E402

MODES = ("off", "fixed", "adaptive")
CONCURRENCY = (1, 2, 4, 8, 16)


def _stats_ms(xs) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def paired_ratio(a: dict, b: dict) -> float:
    """Cell ``a``'s aggregate tok/s over cell ``b``'s: the median over rounds of the per-round ratios when both ran
    the same rounds side by side (``output_tok_s_rounds``, in round order), else the ratio of their medians. A
    round's two cells ran minutes apart at most, so the machine's slow drift (other tenants) cancels in each
    ratio; a ratio of two medians taken from different rounds keeps it."""
    ra, rb = a.get("output_tok_s_rounds"), b.get("output_tok_s_rounds")
    if ra and rb and len(ra) == len(rb):
        return float(np.median(np.asarray(ra) / np.asarray(rb)))
    return a["output_tok_s"] / b["output_tok_s"]


def summarize(cells) -> list:
    """Per temperature, the ratios the issue's acceptance asks for (aggregate tok/s): the best mode at the highest
    concurrency over the best at the lowest (medians: those cells do not run side by side); fixed and adaptive over
    off at the lowest concurrency, and adaptive over the better of off and fixed (the better by median tok/s) at
    every concurrency, each the median of its per-round ratios (``paired_ratio``)."""
    out = []
    for temp in sorted({c["temperature"] for c in cells}):
        by = {(c["mode"], c["concurrency"]): c for c in cells if c["temperature"] == temp}
        conc = sorted({k[1] for k in by})
        lo, hi = conc[0], conc[-1]

        def best(c):
            return max((v for (m, cc), v in by.items() if cc == c), key=lambda v: v["output_tok_s"])

        row = {"temperature": temp,
               f"best_c{hi}_over_best_c{lo}": best(hi)["output_tok_s"] / best(lo)["output_tok_s"]}
        for m in ("fixed", "adaptive"):
            if (m, lo) in by and ("off", lo) in by:
                row[f"{m}_over_off_c{lo}"] = paired_ratio(by[(m, lo)], by[("off", lo)])
        if all(("adaptive", c) in by and ("off", c) in by and ("fixed", c) in by for c in conc):
            row["adaptive_over_best_of_off_fixed"] = {
                str(c): paired_ratio(by[("adaptive", c)], max(by[("off", c)], by[("fixed", c)],
                                                             key=lambda v: v["output_tok_s"])) for c in conc}
        out.append(row)
    return out


def conversation(client, prompt, messages, encode, max_tokens: int, temperature: float, seed: int,
                 mode: str, think_s: float = 0.0) -> list:
    """One client's conversation (``--turns``): turn t's prompt is turn t - 1's + its answer (the streamed text,
    encoded again) + ``messages[t - 1]``, as a chat client or a coding agent sends it, ``think_s`` seconds after
    the answer (a user reading it, an agent running its tool). One result per turn, each with its ``turn`` and
    ``prompt_tokens``."""
    out = []
    for t in range(len(messages) + 1):
        r = client.request(prompt, max_tokens, temperature, seed + 7919 * t, mode)
        out.append({**r, "turn": t, "prompt_tokens": len(prompt)})
        if t < len(messages):
            prompt = list(prompt) + list(encode(r["text"])) + list(messages[t])
            time.sleep(think_s)
    return out


def run_cell(client, prompts, mode: str, concurrency: int, temperature: float, max_tokens: int,
             requests: int, messages=None, encode=None, think_s: float = 0.0, fields=None) -> dict:
    """One cell through ``client`` (``HttpClient`` or ``EngineClient``). With ``messages`` (a list of turns' new
    messages, token ids) each of the ``requests`` is a conversation of len(messages) + 1 turns (``conversation``;
    ``encode``: text -> token ids, no BOS) and the cell adds each turn's TTFT p50 and the share of prompt tokens the
    server's prefix cache served (``usage.prompt_tokens_details.cached_tokens``). ``fields``: per prompt, the request
    fields sent with it (``load_prompts``)."""
    before = scrape(client.metrics_text())
    t0 = time.perf_counter()

    def one(i):
        if messages is None:
            prompt = prompts[i % len(prompts)]
            r = client.request(prompt, max_tokens, temperature, 1000 + i, mode, fields[i % len(prompts)] if fields
                               else None)
            return [{**r, "prompt_tokens": len(prompt)}]
        return conversation(client, prompts[i % len(prompts)], messages, encode, max_tokens, temperature,
                            1000 + i, mode, think_s)

    with cf.ThreadPoolExecutor(concurrency) as ex:
        res = [r for rs in ex.map(one, range(requests)) for r in rs]
    wall = time.perf_counter() - t0
    metrics_after = client.metrics_text()
    after = scrape(metrics_after)
    d = {k: after[k] - before[k] for k in after}
    tokens = sum(r["tokens"] for r in res)
    reasons = [str(r["finish"]) for r in res]  # "length" under ignore_eos; "stop" where EOS ended a constrained one
    ttft = [r["chunks"][0] for r in res if r["chunks"]]
    tpot = [(r["e2e"] - r["chunks"][0]) / (r["tokens"] - 1) for r in res if r["chunks"] and r["tokens"] > 1]
    itl = []
    for r in res:  # a chunk carries several tokens under speculation: its gap is spread over them
        n_chunks = len(r["chunks"])
        per = (r["tokens"] - 1) / max(n_chunks - 1, 1)
        itl += [g / per for g in np.diff(r["chunks"])] if n_chunks > 1 and per > 0 else []
    drafts = d["vllm:spec_decode_num_drafts_total"]
    counted = "vllm:generation_tokens_total" in metrics_after  # a server with vLLM's counters (else no /metrics)
    vcount = d["jdspark:verified_tokens_per_step_count"]
    turns = {"cached_share": sum(r["cached"] for r in res) / sum(r["prompt_tokens"] for r in res)}
    if messages is not None:
        n = len(messages) + 1
        turns = {"turns": n, "ttft_ms_p50_by_turn": [_stats_ms([r["chunks"][0] for r in res
                                                                 if r["turn"] == t and r["chunks"]])["p50"]
                                                      for t in range(n)],
                 "cached_share": sum(r["cached"] for r in res) / sum(r["prompt_tokens"] for r in res)}
    return {"mode": mode, "concurrency": concurrency, "temperature": temperature, "requests": requests,
            **turns, "max_tokens": max_tokens, "completion_tokens": tokens,
            "finish_reasons": {f: reasons.count(f) for f in sorted(set(reasons))},
            "output_tok_s": tokens / wall,
            "per_user_tok_s": float(np.mean([r["tokens"] / r["e2e"] for r in res])),
            "ttft_ms": _stats_ms(ttft), "tpot_ms": _stats_ms(tpot), "itl_ms": _stats_ms(itl),
            "accept_len": (1.0 + d["vllm:spec_decode_num_accepted_tokens_total"] / drafts if drafts else 1.0)
            if counted else None,
            "verified_per_slot_step": d["jdspark:verified_tokens_per_step_sum"] / vcount if vcount else None,
            "step_cost_ms": scrape_costs(metrics_after, concurrency), "wall_s": wall,
            **({"outputs": [[i % len(prompts), r["text"]] for i, r in enumerate(res)]} if messages is None else {})}


def greedy_agreement(cells, medians=()) -> dict:
    """Whether greedy outputs depend on how they were served: lossless speculation and rows independent of their
    batch make every greedy request of a prompt stream the same text in every mode, at every concurrency and in
    every round. Two references per prompt: its text in the lowest concurrency's plain (``off``) cells (one stream
    decoded token by token, as batch-1 ``jdspark.generate`` without a drafter does; else its most common text), and
    its text in the same mode at the lowest concurrency (batch-1 ``generate`` of that mode: what batching alone
    changes). Sets ``greedy_differing`` (requests whose text differs from the first) and ``greedy_batch_differing``
    (from the second; None where no request of that prompt ran there) on each greedy cell (``cells``: every round's,
    before ``median_cell``; and the ``medians`` made of them) and returns, per mode, the requests served, those
    that differ from each reference (``differing``, ``batch_differing``, out of ``batch_compared``) and the prompts
    concerned. On bf16 weights a near-tie between two tokens can round either way in a verify block or a wider
    batch: this counts how often the served pair meets one."""
    greedy = [c for c in cells if c["temperature"] == 0 and "outputs" in c]
    if not greedy:
        return {}
    lo = min(c["concurrency"] for c in greedy)

    def majority(texts):
        return max(set(texts), key=texts.count) if texts else None

    prompts = sorted({i for c in greedy for i, _ in c["outputs"]})
    at_lo = {m: {i: majority([t for c in greedy if c["mode"] == m and c["concurrency"] == lo
                              for j, t in c["outputs"] if j == i]) for i in prompts}
             for m in sorted({c["mode"] for c in greedy})}
    off = at_lo.get("off", {})
    plain = {i: off[i] if off.get(i) is not None else majority([t for c in greedy for j, t in c["outputs"] if j == i])
             for i in prompts}  # (an empty text is a text: a constrained request may end at once)

    def mark(c):
        mine = at_lo[c["mode"]]
        c["greedy_differing"] = sum(t != plain[i] for i, t in c["outputs"])
        compared = [(i, t) for i, t in c["outputs"] if mine[i] is not None]
        c["greedy_batch_differing"] = sum(t != mine[i] for i, t in compared) if compared else None
        return compared

    out = {}
    for c in greedy:
        compared = mark(c)
        row = out.setdefault(c["mode"], {"requests": 0, "differing": 0, "batch_compared": 0, "batch_differing": 0,
                                         "prompts": set(), "batch_prompts": set()})
        row["requests"] += len(c["outputs"])
        row["differing"] += c["greedy_differing"]
        row["prompts"].update(i for i, t in c["outputs"] if t != plain[i])
        if c["concurrency"] != lo:
            row["batch_compared"] += len(compared)
            row["batch_differing"] += c["greedy_batch_differing"] or 0
            row["batch_prompts"].update(i for i, t in compared if t != at_lo[c["mode"]][i])
    for c in medians:
        if c["temperature"] == 0 and "outputs" in c:
            mark(c)
    return {m: {**r, "prompts": sorted(r["prompts"]), "batch_prompts": sorted(r["batch_prompts"])}
            for m, r in out.items()}


def median_cell(rounds: list) -> dict:
    """The round whose aggregate tok/s is the median (the lower middle of an even count), with every round's tok/s
    beside it (``output_tok_s_rounds``): one slow or fast round on a shared machine does not decide a ratio."""
    order = sorted(rounds, key=lambda c: c["output_tok_s"])
    return {**order[(len(order) - 1) // 2], "rounds": len(rounds),
            "output_tok_s_rounds": [c["output_tok_s"] for c in rounds]}


def plot(cells, path: str) -> None:
    """Aggregate throughput against per-user tok/s, one line per (mode, temperature) across concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    keys = sorted({(c["mode"], c["temperature"]) for c in cells})
    for i, (mode, temp) in enumerate(keys):
        cs = sorted((c for c in cells if c["mode"] == mode and c["temperature"] == temp),
                    key=lambda c: c["concurrency"])
        ax.plot([c["per_user_tok_s"] for c in cs], [c["output_tok_s"] for c in cs], "o-" if temp == 0 else "s--",
                color=f"C{MODES.index(mode) if mode in MODES else i}", label=f"{mode}, T={temp:g}")
        for c in cs:
            ax.annotate(str(c["concurrency"]), (c["per_user_tok_s"], c["output_tok_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="per-user tok/s (interactivity)", ylabel="aggregate output tok/s",
           title="throughput at matched interactivity (labels: concurrent users)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


RESERVED_FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
                   "stream_options", "speculative", "spec_mode", "n", "best_of", "echo")  # what a cell sets itself


def request_fields(text: str) -> dict:
    """``--request-fields``: a JSON object of request fields sent with every request (as a ``--prompt-file`` line's
    own fields are), or a ValueError naming what is wrong."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--request-fields: not JSON ({e.msg}); expected an object such as "
                         "'{\"response_format\": {\"type\": \"json_object\"}, \"ignore_eos\": false}'") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--request-fields: expected a JSON object of request fields, got {text[:80]!r}")
    taken = sorted(set(fields) & set(RESERVED_FIELDS))
    if taken:
        raise ValueError(f"--request-fields: {taken[0]!r} is set by the benchmark itself (its flags and prompts); "
                         f"not one of {list(RESERVED_FIELDS)}")
    return fields


def load_prompts(checkpoint: str, n: int, prompt_len: int, workload: str = "code", corpus=None,
                 prompt_file=None) -> tuple:
    """The cells' prompts (token ids) and where they came from: ``n`` prompts of ``prompt_len`` tokens cut at line
    starts from a workload's documents (code: the held-out split, never trained on; structured, prose: text
    installed on the machine; ``jdspark.workloads``) or from every text file under ``corpus``, exactly as
    ``scripts/bench.py`` cuts them; or every request of an operator's ``prompt_file``
    (``workloads.read_request_file``: JSON Lines of ``{"prompt": ...}`` or ``{"messages": [...]}`` with any other
    request fields), as long as each is. Returns (prompts, source, fields: per prompt the fields sent with it)."""
    import generate as gen

    import kimi
    from jdspark import data as jdata
    from jdspark import workloads

    cfg = kimi.KimiConfig.from_hf_config(os.path.join(checkpoint, "target"))
    tok = gen.load_tokenizer(checkpoint, cfg)
    if prompt_file is not None:
        reqs = workloads.read_request_file(prompt_file, tok, cfg.vocab_size,
                                           reserved=[f for f in RESERVED_FIELDS if f not in ("prompt", "messages")])
        prompts = [r.ids for r in reqs]
        return prompts, {"prompt_file": prompt_file, "prompts": len(prompts),
                         "prompt_len_max": max(map(len, prompts)),
                         "chat": sum("messages" in r.fields for r in reqs)}, [r.fields for r in reqs]
    docs = workloads.documents_from_dir(corpus) if corpus is not None else workloads.documents(workload)
    prompts = [p.tolist() for p in jdata.prompts_from_documents(docs, n, prompt_len, tokenizer=tok)]
    return prompts, {("corpus" if corpus is not None else "workload"): corpus or workload, "prompts": len(prompts),
                     "prompt_len": prompt_len}, [{} for _ in prompts]


def load_tokenizer(checkpoint: str):
    """The checkpoint's tokenizer (``kimi.tokenizer``), as the server loads it."""
    import generate as gen

    import kimi

    return gen.load_tokenizer(checkpoint, kimi.KimiConfig.from_hf_config(os.path.join(checkpoint, "target")))


def load_encoder(checkpoint: str):
    """text -> token ids (no BOS) by the checkpoint's tokenizer: a conversation's answer, sent back in its next
    turn's prompt."""
    tok = load_tokenizer(checkpoint)
    return lambda text: tok.encode(text, bos=False)


def first_model(url: str, api_key=None) -> str:
    """The first model id a server's ``GET /v1/models`` lists (the name an OpenAI request must carry)."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=30,
                  headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    models = (r.json().get("data") or []) if r.status_code == 200 else []
    if not models:
        raise SystemExit(f"bench_serve: {url}/v1/models lists no model ({r.status_code}): pass --model NAME")
    return models[0]["id"]


def launch_args(prompt_len: int, max_tokens: int, turns: int = 1, message_len: int = 0, shared: int = 0) -> list:
    """The server flags a launched run sizes by its traffic, as an operator would: one prompt bucket that holds
    the prompts, and slot caches of the prompt + completion + a verify block (16 covers the drafter's), rounded
    up to 64 positions (a slot's state is copied on every step it runs, so an oversized cache costs time). With
    ``turns`` > 1 (conversations): buckets for the first prompt, for a turn's message (what a hit on a kept answer
    prefills), for its new tokens (an answer, encoded again, + a message: what a hit on the kept prompt prefills;
    16 tokens of slack for the encoding) and for the last turn's whole prompt (what a server without the cache
    prefills), and caches that hold the last turn's answer. With ``shared`` (``--shared-prefix``; ``prompt_len`` the
    whole prompt's): buckets for the shared beginning alone, for the rest after it, and for the whole prompt."""
    def up(n):
        return -(-int(n) // 64) * 64

    if shared:
        buckets = sorted({up(shared), up(int(prompt_len) - int(shared)), up(prompt_len)})
        return ["--prompt-buckets", ",".join(map(str, buckets)), "--max-len",
                str(up(buckets[-1] + int(max_tokens) + 16))]
    if turns <= 1:
        bucket = up(prompt_len)
        return ["--prompt-buckets", str(bucket), "--max-len", str(up(bucket + int(max_tokens) + 16))]
    step = int(max_tokens) + int(message_len) + 16
    last = up(int(prompt_len) + (turns - 1) * step)
    buckets = sorted({up(prompt_len), up(int(message_len) + 16), up(step), last})
    return ["--prompt-buckets", ",".join(map(str, buckets)), "--max-len", str(up(last + int(max_tokens) + 16))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", action="store_true", help="start the server on 127.0.0.1 for the run")
    where.add_argument("--url", help="a running server (loopback or your own host)")
    where.add_argument("--in-process", action="store_true",
                       help="the engine --launch would serve, in this process without HTTP (what HTTP costs)")
    ap.add_argument("--openai-compatible", action="store_true",
                    help="with --url: any OpenAI-compatible server (transformers serve, vLLM, ...): prompts sent as "
                         "text (the --checkpoint's tokenizer decodes them), OpenAI's fields only (no ignore_eos, "
                         "no speculation fields), one mode, 'server' (the server decides how it decodes)")
    ap.add_argument("--model", default=None, help="the model name a --openai-compatible request carries (default: "
                                                  "the first of the server's /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("JDSPARK_API_KEY") or None,
                    help="sent as 'Authorization: Bearer KEY' (a server started with --api-key; default: "
                         "$JDSPARK_API_KEY, which a --launch server reads too)")
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"))
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {MODES}")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--requests", type=int, default=None, help="per cell (default: 2 x concurrency, at least 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16, help="prompts cut from the workload's or corpus's documents")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--workload", default="code", help="where the prompts are cut from: code (held out, the "
                     "default), structured or prose, as in scripts/bench.py (jdspark.workloads.WORKLOADS)")
    src.add_argument("--corpus", metavar="DIR", help="cut the prompts from every text file under DIR instead")
    src.add_argument("--prompt-file", metavar="PATH", help="your own traffic: JSON Lines, one {\"prompt\": "
                     "\"text\" or [token ids]} per line, every line sent (--prompts and --prompt-len unused)")
    ap.add_argument("--request-fields", metavar="JSON", default=None,
                    help="request fields sent with every request, as a JSON object (a --prompt-file line's own win), "
                         "e.g. '{\"response_format\": {\"type\": \"json_object\"}, \"ignore_eos\": false}': "
                         "constrained output's acceptance under load")
    ap.add_argument("--turns", type=int, default=1,
                    help="conversations: each request becomes N turns, turn t's prompt turn t - 1's + its answer + "
                         "a --message-len message (held-out code), as chat clients and coding agents send them; "
                         "cells add each turn's TTFT and the share of prompt tokens the prefix cache served (compare "
                         "--server-args \"--prefix-pool 0\")")
    ap.add_argument("--message-len", type=int, default=48, help="tokens of each turn's new message (--turns > 1)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt begins with the same N-token held-out excerpt before its own (a system prompt "
                         "shared by many users); 0: none")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="a conversation's pause between an answer and its next turn (--turns > 1; the server keeps "
                         "the answer while idle, jdspark.prefix); the cell's wall time includes it")
    ap.add_argument("--rounds", type=int, default=5,
                    help="runs of each cell; the modes of a concurrency alternate round by round, the median counts")
    ap.add_argument("--server-args", default="", help="more `python -m jdspark.serve` flags for --launch and "
                    "--in-process, as one string (e.g. \"--multi-step 8 --multi-step-max-batch 0\")")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {a.rounds}")
    if a.turns < 1 or a.message_len < 1:
        ap.error(f"--turns, --message-len: expected >= 1, got {a.turns}, {a.message_len}")
    if not 0 <= a.think_ms < 1e6:
        ap.error(f"--think-ms: expected 0 <= ms < 1e6, got {a.think_ms}")
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: each of {MODES}")
    if a.openai_compatible:
        if a.url is None:
            ap.error("--openai-compatible: only with --url (--launch and --in-process serve this project's server)")
        if a.modes != ",".join(MODES):
            ap.error("--modes: not with --openai-compatible (the server decides how it decodes: one mode, 'server')")
        modes = ["server"]
    elif a.model is not None:
        ap.error("--model: only with --openai-compatible")
    try:
        conc = [int(c) for c in a.concurrency.split(",")]
        temps = [float(t) for t in a.temperatures.split(",")]
    except ValueError:
        ap.error(f"--concurrency, --temperatures: expected comma-separated numbers (like 1,4,16 and 0,1), got "
                 f"{a.concurrency!r}, {a.temperatures!r}")
    if min(conc) < 1 or not all(0 <= t < float("inf") for t in temps):
        ap.error(f"--concurrency: expected ints >= 1, --temperatures: numbers >= 0; got {conc}, {temps}")
    if min(a.slots, a.max_tokens, a.prompts, 1 if a.requests is None else a.requests) < 1:
        ap.error(f"--slots, --max-tokens, --prompts, --requests: expected ints >= 1, got {a.slots}, {a.max_tokens}, "
                 f"{a.prompts}, {a.requests}")
    server_args = shlex.split(a.server_args)
    if server_args and not (a.launch or a.in_process):
        ap.error("--server-args: only with --launch or --in-process (a running server has its flags)")
    if a.url is not None:  # said before the prompts are cut and the run begins
        problem = server_problem(a.url)
        if problem:
            ap.error(f"--url {a.url}: {problem}")
    try:
        common = request_fields(a.request_fields) if a.request_fields is not None else {}
        prompts, source, fields = load_prompts(a.checkpoint, a.prompts, a.prompt_len, a.workload, a.corpus,
                                               a.prompt_file)
    except ValueError as e:
        ap.error(str(e))
    fields = [{**common, **f} for f in fields]
    if any(fields) and a.in_process:
        ap.error("request fields (--request-fields, a --prompt-file line's fields) are sent over HTTP: use --launch "
                 "or --url, not --in-process")
    if any(fields) and a.turns > 1:
        ap.error("--turns > 1 continues token-id prompts: not with request fields (--request-fields, a "
                 "--prompt-file line's fields)")
    if a.shared_prefix:
        if a.shared_prefix < 1 or a.turns > 1 or a.prompt_file is not None:
            ap.error(f"--shared-prefix: expected N >= 1 tokens, without --turns or --prompt-file; got "
                     f"{a.shared_prefix}")
        shared, _, _ = load_prompts(a.checkpoint, a.prompts + 1, a.shared_prefix + a.prompt_len, "code")
        shared = shared[-1][:a.shared_prefix]  # from a document after the prompts' (cut round-robin)
        prompts = [shared + p[1:] for p in prompts]  # each prompt's own BOS dropped: one at the start
        source["shared_prefix"] = a.shared_prefix
    if common:
        source["request_fields"] = common
    messages = encode = None
    if a.turns > 1:
        msgs, _ = load_prompts(a.checkpoint, a.turns - 1, a.message_len + 1, "code")
        messages = [m[1:] for m in msgs]  # no BOS inside a conversation
        encode = load_encoder(a.checkpoint)
    sized = launch_args(max(map(len, prompts)), a.max_tokens, a.turns, a.message_len, a.shared_prefix)
    proc = None
    if a.launch:
        proc, url = launch(a.checkpoint, a.port, a.slots, extra=sized + server_args)
        client = HttpClient(url, api_key=a.api_key)
    elif a.in_process:
        client = EngineClient.from_server_args(["--checkpoint", a.checkpoint, "--slots", str(a.slots), *sized,
                                                *server_args])
    elif a.openai_compatible:
        tok = load_tokenizer(a.checkpoint)
        client = HttpClient(a.url, api_key=a.api_key, decode=lambda ids: tok.decode(ids, skip_special=True),
                            model=a.model or first_model(a.url, a.api_key))
    else:
        client = HttpClient(a.url, api_key=a.api_key)
    cells, greedy_rounds = [], []
    try:
        seen = set()
        for i, f in enumerate(fields):  # warm the path end to end, then every distinct body once: a request the
            key = json.dumps(f, sort_keys=True)  # server refuses fails here, not in the middle of a run
            if key not in seen:
                seen.add(key)
                try:
                    client.request(prompts[i], 8 if i == 0 else 2, 0.0, 0, modes[0], f)
                except RuntimeError as e:
                    raise SystemExit(f"bench_serve: the server refused request {i + 1} of {len(prompts)} "
                                     f"({key[:120]}): {e}") from None
        for temp in temps:
            for c in conc:
                rounds = {m: [] for m in modes}
                for r in range(a.rounds):  # the modes of one concurrency side by side, round after round,
                    for mode in (modes if r % 2 == 0 else modes[::-1]):  # in turn forward and backward (ABBA)
                        cell = run_cell(client, prompts, mode, c, temp, a.max_tokens, a.requests or max(8, 2 * c),
                                        messages, encode, a.think_ms / 1e3, fields)
                        rounds[mode].append(cell)
                        print(f"[bench_serve] {mode:8s} T={temp:g} c={c:2d} round {r}: {cell['output_tok_s']:7.1f} "
                              f"tok/s total, {cell['per_user_tok_s']:6.1f} per user, accept_len "
                              f"{cell['accept_len']}, verified/slot/step {cell['verified_per_slot_step']}, "
                              f"step ms by width {cell['step_cost_ms']}"
                              + (f", TTFT p50 by turn {cell['ttft_ms_p50_by_turn']}, cached share "
                                 f"{cell['cached_share']:.2f}" if messages is not None else ""),
                              file=sys.stderr, flush=True)
                if temp == 0:
                    greedy_rounds += [c for m in modes for c in rounds[m]]
                cells += [median_cell(rounds[m]) for m in modes]
    finally:
        client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    agreement = greedy_agreement(greedy_rounds, cells)  # before the texts are dropped: every round's, not the medians'
    for c in cells:
        c.pop("outputs", None)
    if agreement:
        print("[bench_serve] greedy requests whose text differs from plain batch-1 decoding's: "
              + ", ".join(f"{m} {r['differing']} of {r['requests']}" for m, r in agreement.items())
              + "; from their own mode's at the lowest concurrency: "
              + ", ".join(f"{m} {r['batch_differing']} of {r['batch_compared']}" for m, r in agreement.items()),
              file=sys.stderr)
    if a.plot:
        plot(cells, a.plot)
    if a.json:
        print(json.dumps({"cells": cells, "summary": summarize(cells), "greedy_agreement": agreement,
                          "server_args": server_args, "prompts": source}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
