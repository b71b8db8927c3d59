"""The server under load and its operators' tools, on a real uvicorn (loopback port), model scripted
(serve_helpers): metrics consistent with what was served and a bounded soak with disconnects and bad requests
mixed in; scripts/bench_serve.py's cells, summary and prompt sources; the engine's mailbox; the server's flags
reaching the slots."""

import concurrent.futures as cf
import re

import httpx
import numpy as np
import pytest

from kimi.tokenizer import ByteTokenizer
from tests.jdspark.serve_helpers import (
    LiveServer,
    metric,
    wait_idle,
)


@pytest.fixture(scope="module")
def soak_srv():
    s = LiveServer(num_slots=4, max_waiting=32)  # room for 16 concurrent clients: no 429 here
    yield s
    s.close()


def test_metrics_match_what_was_served_and_a_soak(soak_srv):
    srv = soak_srv
    m0 = wait_idle(srv)
    n_good, n_tokens = 0, 0

    def one(i):
        if i % 10 == 3:  # bad request mixed in
            return "bad", httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "top_p": 2}).status_code
        if i % 10 == 7:  # a client that goes away mid-stream
            with httpx.stream("POST", srv.url + "/v1/completions",
                              json={"prompt": "d", "max_tokens": 500, "stream": True}) as r:
                next(r.iter_lines())
            return "gone", 0
        n = 5 + i % 17
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "k", "max_tokens": n, "seed": i}, timeout=60)
        return "good", (r.status_code, r.json()["usage"]["completion_tokens"], n)

    with cf.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(200)))
    for kind, res in results:
        if kind == "good":
            status, got, want = res
            assert status == 200 and got == want
            n_good += 1
            n_tokens += got
        elif kind == "bad":
            assert res == 400
    assert httpx.get(srv.url + "/health").status_code == 200
    m1 = wait_idle(srv)
    d = {k: metric(m1, k) - metric(m0, k) for k in
         ("vllm:generation_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
          "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
          "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    length = metric(m1, "vllm:request_success_total", finished_reason="length") - \
        metric(m0, "vllm:request_success_total", finished_reason="length")
    assert length == n_good
    # the disconnected streams generated some tokens too: generation_tokens >= the good requests' own
    assert d["vllm:generation_tokens_total"] >= n_tokens
    assert 0 < d["vllm:spec_decode_num_accepted_tokens_total"] <= d["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = sum(metric(m1, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(8))
    assert per_pos == metric(m1, "vllm:spec_decode_num_accepted_tokens_total")
    assert re.search(r"vllm:time_to_first_token_seconds_count\{[^}]*\} [1-9]", m1)
    # every prefill looked its prompt up; the scripted backend found half of each ("k", "d": BOS + 1 byte)
    queries, hits = d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"]
    assert queries == d["vllm:prompt_tokens_total"] == 2 * hits > 0
    # the per-request histograms (vLLM's dashboards): every request ended, so their sums are the counters' deltas
    # and their counts the finished requests; nothing preempted; the scripted backend has no cache to fill
    dh = {k: metric(m1, k) - metric(m0, k) for k in
          ("vllm:request_generation_tokens_sum", "vllm:request_prompt_tokens_sum",
           "vllm:request_params_max_tokens_count", "vllm:request_inference_time_seconds_count",
           "vllm:request_success_total")}
    assert dh["vllm:request_generation_tokens_sum"] == d["vllm:generation_tokens_total"]
    assert dh["vllm:request_prompt_tokens_sum"] == d["vllm:prompt_tokens_total"]
    assert dh["vllm:request_params_max_tokens_count"] == dh["vllm:request_success_total"] >= n_good
    assert dh["vllm:request_inference_time_seconds_count"] >= n_good
    assert metric(m1, "vllm:num_preemptions_total") == 0 and "vllm:kv_cache_usage_perc{" in m1


def test_bench_serve_cells_and_chart_against_a_live_server(soak_srv, tmp_path):
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve
    import serve_clients

    prompts = [[256, 97 + i] for i in range(4)]
    # over HTTP, and the same engine driven in-process (--in-process): the same figures from the same metrics
    clients = (serve_clients.HttpClient(soak_srv.url), serve_clients.EngineClient(soak_srv.engine, soak_srv.metrics))
    cells = [bench_serve.run_cell(client, prompts, mode, c, 0.0, 9, 4) for client in clients
             for mode in ("off", "fixed") for c in (1, 4)]
    for cell in cells:
        assert cell["output_tok_s"] > 0 and cell["per_user_tok_s"] > 0 and cell["requests"] == 4
        assert cell["finish_reasons"] == {"length": 4} and cell["completion_tokens"] == 4 * 9
        assert cell["ttft_ms"]["p50"] is not None and cell["tpot_ms"]["p99"] >= cell["tpot_ms"]["p50"]
        assert cell["accept_len"] == pytest.approx(1 + 2 / 1)  # the scripted backend: 2 of 4 accepted per step
        assert cell["verified_per_slot_step"] == pytest.approx(5.0)
        want = {str(w): 1e3 * soak_srv.backend.costs[(b, w)] for (b, w) in soak_srv.backend.costs
                if b == (1 if cell["concurrency"] == 1 else soak_srv.backend.num_slots)}
        assert cell["step_cost_ms"] == pytest.approx(want) and len(want) == 2
    # conversations (--turns 3): each turn's prompt is the last one + its answer (9 ASCII bytes from the scripted
    # backend, encoded again) + a message (ASCII throughout); the scripted backend says half of each prompt was cached
    enc = ByteTokenizer().encode
    for client in clients:
        cell = bench_serve.run_cell(client, prompts, "fixed", 2, 0.0, 9, 2, messages=[[65, 66], [67]],
                                    encode=lambda text: enc(text, bos=False))
        assert cell["turns"] == 3 and len(cell["ttft_ms_p50_by_turn"]) == 3 and cell["requests"] == 2
        assert cell["cached_share"] == pytest.approx((1 + 6 + 11) / (2 + 13 + 23))  # prompts of 2, 13, 23 tokens
    # request fields (a --prompt-file line's, --request-fields): sent with the cell's own settings, a chat line to
    # /v1/chat/completions; the in-process client refuses them rather than dropping them
    before = len(soak_srv.backend.requests)
    fields = [{"messages": [{"role": "user", "content": "hi there"}], "top_k": 5}, {"top_k": 7}, {}, {}]
    cell = bench_serve.run_cell(clients[0], prompts, "fixed", 2, 1.0, 9, 4, fields=fields)
    assert cell["completion_tokens"] == 4 * 9 and cell["ttft_ms"]["p50"] is not None
    assert cell["finish_reasons"] == {"length": 4}
    sent = sorted(soak_srv.backend.requests[before:], key=lambda r: r.seed)
    assert [r.top_k for r in sent] == [5, 7, 0, 0] and [r.temperature for r in sent] == [1.0] * 4
    assert b"hi there" in bytes(t for t in sent[0].prompt_ids if t < 256) and sent[1].prompt_ids == tuple(prompts[1])
    with pytest.raises(ValueError, match=r"--in-process sends token ids only; request fields \['top_k'\]"):
        clients[1].request(prompts[0], 9, 0.0, 0, "fixed", {"top_k": 7})
    # greedy agreement: every greedy request of a prompt streamed the same text in every mode and concurrency
    assert all(sorted(i for i, _ in c["outputs"]) == [0, 1, 2, 3] for c in cells)
    got = bench_serve.greedy_agreement(cells)
    assert {m: (r["differing"], r["batch_differing"], r["batch_compared"]) for m, r in got.items()} == {
        "off": (0, 0, 8), "fixed": (0, 0, 8)}  # c = 4 against c = 1: 2 clients x 4 requests
    assert all(c["greedy_differing"] == 0 for c in cells)
    med = bench_serve.median_cell([dict(cells[0], output_tok_s=v, tag=i) for i, v in enumerate((3.0, 1.0, 2.0, 9.0))])
    assert med["tag"] == 2 and med["rounds"] == 4 and med["output_tok_s_rounds"] == [3.0, 1.0, 2.0, 9.0]
    bench_serve.plot(cells, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    for mode in ("sometimes", "adaptive"):  # not a mode; not offered by a server started with --spec fixed
        r = httpx.post(soak_srv.url + "/v1/completions", json={"prompt": "x", "spec_mode": mode})
        assert r.status_code == 400 and r.json()["error"]["param"] == "spec_mode"


def test_bench_serve_loads_any_openai_compatible_server(soak_srv, capsys):
    """--openai-compatible: prompts as text, OpenAI's fields only (no ignore_eos / speculative / spec_mode), the
    model named by the server's /v1/models, one mode ('server'); accept_len from /metrics where the server has
    vLLM's counters, null where it has no /metrics."""
    import contextlib
    import io
    import json
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    before = len(soak_srv.backend.requests)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_serve.main(["--url", soak_srv.url, "--openai-compatible", "--prompts", "2", "--prompt-len", "16",
                                 "--concurrency", "1,2", "--temperatures", "0", "--rounds", "1", "--requests", "2",
                                 "--max-tokens", "4", "--json"]) == 0
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert [(c["mode"], c["concurrency"]) for c in r["cells"]] == [("server", 1), ("server", 2)]
    for c in r["cells"]:
        assert c["completion_tokens"] == 2 * 4 and c["accept_len"] is not None and c["output_tok_s"] > 0
    assert set(r["summary"][0]) == {"temperature", "best_c2_over_best_c1"}
    sent = soak_srv.backend.requests[before:]
    assert len(sent) >= 4 and all(q.speculative and q.spec_mode is None for q in sent)  # the server's defaults
    assert all(t < 256 or t == soak_srv.tok.bos_id for q in sent for t in q.prompt_ids)  # text, byte-tokenised
    bodies = []  # the body itself, as sent

    def answer(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text='data: {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}\n\n'
                                         "data: [DONE]\n\n")

    import serve_clients

    client = serve_clients.HttpClient("http://server", decode=lambda ids: "text of " + str(list(ids)), model="m")
    client.http = httpx.Client(transport=httpx.MockTransport(answer))
    client.request([5, 6], 3, 0.0, 7, "server")
    client.request([5, 6], 3, 0.0, 7, "server", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2})
    assert bodies[0] == {"model": "m", "prompt": "text of [5, 6]", "max_tokens": 3, "temperature": 0.0, "top_p": 1.0,
                         "seed": 7, "stream": True, "stream_options": {"include_usage": True}}
    assert "prompt" not in bodies[1] and bodies[1]["top_k"] == 2 and "ignore_eos" not in bodies[1]

    class NoMetrics:  # a server without /metrics: no acceptance to report
        def request(self, *a, **k):
            return {"chunks": [0.01, 0.02], "e2e": 0.03, "tokens": 2, "text": "ab", "cached": 0, "finish": "length"}

        def metrics_text(self):
            return ""

    assert bench_serve.run_cell(NoMetrics(), [[1, 2]], "server", 1, 0.0, 2, 2)["accept_len"] is None
    for flags, message in ((["--launch", "--openai-compatible"], "only with --url"),
                           (["--url", soak_srv.url, "--openai-compatible", "--modes", "off"], "--modes: not with"),
                           (["--url", soak_srv.url, "--model", "m"], "--model: only with --openai-compatible")):
        with pytest.raises(SystemExit):
            bench_serve.main(flags)
        assert message in capsys.readouterr().err


def test_bench_serve_summary_pairs_rounds():
    """Ratios between modes are medians of per-round ratios: a machine that slows by half from one round to the
    next moves both modes' cells, and the paired ratio sees none of it where a ratio of medians would."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    def cell(mode, c, rounds):
        return {"mode": mode, "concurrency": c, "temperature": 0.0, "output_tok_s": float(np.median(rounds)),
                "output_tok_s_rounds": list(rounds)}

    speed = [100.0, 50.0, 100.0, 50.0, 50.0]  # the machine, round by round
    cells = [cell("off", 1, [s * 1.0 for s in speed]), cell("fixed", 1, [s * 2.0 for s in speed]),
             cell("adaptive", 1, [s * 2.2 for s in speed[1:]] + [100.0 * 2.2]),  # shifted a round: unpaired
             cell("off", 4, [s * 3.0 for s in speed]), cell("fixed", 4, [s * 5.0 for s in speed]),
             cell("adaptive", 4, [s * 4.9 for s in speed])]
    row, = bench_serve.summarize(cells)
    assert row["fixed_over_off_c1"] == pytest.approx(2.0)
    assert row["adaptive_over_best_of_off_fixed"]["4"] == pytest.approx(0.98)
    assert row["best_c4_over_best_c1"] == pytest.approx(5.0 / 2.2)  # medians: 250 / 110
    # unequal round counts fall back to the ratio of medians
    lone = dict(cells[2], output_tok_s_rounds=[110.0])
    assert bench_serve.paired_ratio(lone, cells[1]) == pytest.approx(110.0 / 100.0)


def test_bench_serve_counts_greedy_outputs_that_depend_on_how_they_were_served():
    """A prompt's plain reference is its text in the plain cells of the lowest concurrency (their majority), its
    batch reference its text in the same mode there; a greedy request streaming other text counts against its mode,
    in the round and in the median cell; sampled cells are not counted."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    def cell(mode, c, texts, temperature=0.0):
        return {"mode": mode, "concurrency": c, "temperature": temperature, "outputs": list(enumerate(texts))}

    rounds = [cell("off", 1, ["a", "b", "c"]), cell("off", 1, ["a", "b", "c"]), cell("off", 4, ["a", "b", "x"]),
              cell("fixed", 1, ["a", "y", "c"]), cell("fixed", 4, ["a", "y", "x"]),
              cell("adaptive", 4, ["a", "b", "c"]), cell("adaptive", 4, ["z", "b", "c"], temperature=1.0)]
    median = dict(rounds[4])
    got = bench_serve.greedy_agreement(rounds, [median])
    assert got == {
        "off": {"requests": 9, "differing": 1, "prompts": [2], "batch_compared": 3, "batch_differing": 1,
                "batch_prompts": [2]},
        "fixed": {"requests": 6, "differing": 3, "prompts": [1, 2], "batch_compared": 3, "batch_differing": 1,
                  "batch_prompts": [2]},
        "adaptive": {"requests": 3, "differing": 0, "prompts": [], "batch_compared": 0, "batch_differing": 0,
                     "batch_prompts": []}}
    assert [c.get("greedy_differing") for c in rounds] == [0, 0, 1, 1, 2, 0, None]
    assert [c.get("greedy_batch_differing") for c in rounds] == [0, 0, 1, 0, 1, None, None]
    assert median["greedy_differing"] == 2 and median["greedy_batch_differing"] == 1
    # no plain cell: the most common text of the prompt is its plain reference
    got = bench_serve.greedy_agreement([cell("fixed", 2, ["p", "q"]), cell("fixed", 2, ["p", "r"]),
                                        cell("adaptive", 2, ["p", "q"])])
    assert got["fixed"]["differing"] == 1 and got["adaptive"]["differing"] == 0
    assert bench_serve.greedy_agreement([cell("off", 1, ["a"], temperature=1.0)]) == {}


def test_bench_serve_sizes_a_launched_server_by_its_traffic():
    """--launch starts the server with one prompt bucket holding the prompts and slot caches of prompt +
    completion + a verify block (rounded up to 64)."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve

    assert bench_serve.launch_args(128, 128) == ["--prompt-buckets", "128", "--max-len", "320"]
    assert bench_serve.launch_args(100, 50) == ["--prompt-buckets", "128", "--max-len", "256"]
    # conversations of 4 turns: the first prompt, a turn's message, its new tokens (answer + message + slack), the
    # last prompt
    assert bench_serve.launch_args(128, 128, 4, 48) == ["--prompt-buckets", "64,128,192,704", "--max-len", "896"]
    # a shared 384-token beginning before 127 tokens of each prompt's own: the beginning, the rest, the whole
    assert bench_serve.launch_args(511, 128, shared=384) == ["--prompt-buckets", "128,384,512", "--max-len", "704"]


def test_bench_serve_prompt_sources(tmp_path, capsys):
    """The load test's prompts: held-out code by default (the very prompts it always sent), another workload's or a
    corpus's cut as scripts/bench.py cuts them, or an operator's own JSON Lines file, each source named in the JSON;
    a bad file stops the run with the line it names."""
    import sys

    sys.path.insert(0, "scripts")
    import bench_serve
    import generate as gen

    import kimi
    from jdspark import data as jdata
    from jdspark import workloads

    ck = "checkpoints/default"
    tok = gen.load_tokenizer(ck, kimi.KimiConfig.from_hf_config(ck + "/target"))
    code, src, none = bench_serve.load_prompts(ck, 3, 48)
    assert code == [p.tolist() for p in jdata.heldout_prompts(3, 48, tokenizer=tok)]
    assert src == {"workload": "code", "prompts": 3, "prompt_len": 48} and none == [{}, {}, {}]
    prose, src, _ = bench_serve.load_prompts(ck, 2, 40, workload="prose")
    assert [p.tolist() for p in jdata.prompts_from_documents(workloads.documents("prose"), 2, 40,
                                                               tokenizer=tok)] == prose != code[:2]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(200)))
    cut, src, _ = bench_serve.load_prompts(ck, 2, 16, corpus=str(tmp_path / "docs"))
    assert src["corpus"] == str(tmp_path / "docs") and all(len(p) == 16 for p in cut)
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": [7, 8, 9, 10]}\n')
    mine, src, fields = bench_serve.load_prompts(ck, 16, 128, prompt_file=str(f))
    assert mine == [tok.encode("def f(x):", bos=True), [7, 8, 9, 10]] and fields == [{}, {}]
    assert src == {"prompt_file": str(f), "prompts": 2, "prompt_len_max": max(map(len, mine)), "chat": 0}
    f.write_text('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"}\n'
                 '{"prompt": "x", "response_format": {"type": "json_object"}, "ignore_eos": false}\n')
    mine, src, fields = bench_serve.load_prompts(ck, 16, 128, prompt_file=str(f))
    assert src["chat"] == 1 and fields[1] == {"response_format": {"type": "json_object"}, "ignore_eos": False}
    assert "hi" in tok.decode(mine[0]) and fields[0]["tool_choice"] == "none"
    for bad, say in (('{"prompt": "x", "temperature": 0.5}', "line 1: 'temperature' is set by the benchmark"),
                     ('{"prompt": "x", "stream": false}', "line 1: 'stream' is set by the benchmark")):
        f.write_text(bad + "\n")
        with pytest.raises(SystemExit):
            bench_serve.main(["--in-process", "--prompt-file", str(f), "--concurrency", "1"])
        assert say in capsys.readouterr().err
    for flag, say in (('{"seed": 1}', "--request-fields: 'seed' is set by the benchmark itself"),
                      ("[1]", "--request-fields: expected a JSON object"), ("{x", "--request-fields: not JSON"),
                      ('{"top_k": 4}', "request fields (--request-fields, a --prompt-file line's fields) are sent "
                                       "over HTTP")):
        with pytest.raises(SystemExit):  # each before any engine is built
            bench_serve.main(["--in-process", "--request-fields", flag, "--prompts", "2", "--prompt-len", "16"])
        assert say in capsys.readouterr().err
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(SystemExit):  # before any engine is built
        bench_serve.main(["--in-process", "--prompt-file", str(f), "--concurrency", "1"])
    assert "mine.jsonl, line 2: expected an object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_serve.main(["--in-process", "--workload", "poetry"])
    assert "workload: expected one of ('code', 'structured', 'prose'), got 'poetry'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source at a time
        bench_serve.main(["--in-process", "--workload", "prose", "--corpus", str(tmp_path)])
    assert "not allowed with argument" in capsys.readouterr().err
    for args, say in ((["--concurrency", "1,0"], "--concurrency: expected ints >= 1"),
                      (["--temperatures", "-1"], "--temperatures: numbers >= 0"),
                      (["--concurrency", "1,x"], "expected comma-separated numbers"),
                      (["--requests", "0"], "expected ints >= 1, got 16, 128, 16, 0"),
                      (["--url", "http://127.0.0.1:1"], "--url http://127.0.0.1:1: no server answers there"),
                      (["--url", "localhost"], "--url localhost: expected a server's base URL")):
        with pytest.raises(SystemExit):  # before a server is started or a prompt cut
            bench_serve.main(args if args[0] == "--url" else ["--launch", *args])
        assert say in capsys.readouterr().err


def test_mailbox_wakes_the_loop_once_per_batch_and_keeps_order():
    """Events posted from the engine's thread while a flush is pending share one wake-up of the event loop, and
    every request's queue gets its events in the order they were posted."""
    import asyncio
    import threading

    from jdspark.engine import Event
    from jdspark.serve_stream import Mailbox

    loop = asyncio.new_event_loop()
    try:
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a: (wakeups.append(cb), real(cb, *a))[1]
        box = Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]

        def engine_thread(first, n):  # the loop is not running: nothing can flush while these are posted
            for i in range(first, first + n):
                box.post(queues[i % 3], Event(str(i), [i]))

        t = threading.Thread(target=engine_thread, args=(0, 30))
        t.start()
        t.join()
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))  # the one flush runs
        got = [[queues[q].get_nowait().token_ids[0] for _ in range(queues[q].qsize())] for q in range(3)]
        assert got == [list(range(q, 30, 3)) for q in range(3)]
        engine_thread(30, 3)  # after a flush, the next batch schedules its own
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert [queues[q].get_nowait().token_ids[0] for q in range(3)] == [30, 31, 32]
    finally:
        loop.close()


def test_server_flags_reach_the_slots(capsys):
    """--multi-step-max-batch sets the largest batch bucket launched several steps at a time (default: the
    platform's plan, 4 on a CPU, every bucket on a GPU; 0: every bucket), is checked, and make_engine hands it to
    the slots, as it does prefix caching and --guided-states (on by default); --compile-cache's default and "none";
    --pin-threads on by default;
    bench_serve passes --server-args only to a server it starts."""
    import os
    import sys

    from jdspark import serve
    from jdspark.slots import multi_step_plan

    a = serve.parse_args([])
    assert (a.multi_step, a.multi_step_max_batch, a.multi_step_plain_max_batch) == multi_step_plan("cpu") == (4, 4, 16)
    assert multi_step_plan("gpu") == (8, 0, 0)
    assert serve.parse_args(["--multi-step", "2"]).multi_step == 2
    with pytest.raises(SystemExit):
        serve.parse_args(["--multi-step-max-batch", "-1"])
    a_flags = ["--checkpoint", "checkpoints/default", "--slots", "2", "--max-len", "256", "--prompt-buckets", "64"]
    a = serve.parse_args([*a_flags, "--multi-step", "3", "--multi-step-max-batch", "1"])
    _, backend, *_ = serve.make_engine(a)
    assert (backend.steps_for(1), backend.steps_for(2)) == (3, 3)  # plain launches: every bucket (by default)
    assert (backend.steps_at(1, backend.G + 1), backend.steps_at(2, backend.G + 1), backend.steps_at(2, 1)) == (3, 1, 3)
    assert backend.prefix.capacity == 32  # prefix caching is on by default; --prefix-pool 0 turns it off
    # the default pool stays within its budget where a row is large: 1 row at least, 32 at most
    from jdspark.prefix import PREFIX_POOL_BUDGET_BYTES, default_pool_rows

    assert [default_pool_rows(b) for b in (1 << 20, PREFIX_POOL_BUDGET_BYTES // 5, 2 * PREFIX_POOL_BUDGET_BYTES)] == [
        32, 5, 1]
    assert backend.prefix_answers  # answers are kept while idle by default
    assert backend.guided_states == 1024  # constrained decoding compiled in by default; --guided-states 0: out
    assert serve.make_engine(serve.parse_args([*a_flags, "--guided-states", "0"]))[1].guided_states == 0
    # compiled programs kept between start-ups: $JAX_COMPILATION_CACHE_DIR or ~/.cache/jdspark/xla; "none": off
    from jdspark.graphs import COMPILE_CACHE_DIR, use_compile_cache

    env = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        assert serve.parse_args([]).compile_cache == COMPILE_CACHE_DIR
        os.environ["JAX_COMPILATION_CACHE_DIR"] = "/x/y"
        assert serve.parse_args([]).compile_cache == "/x/y"
    finally:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        if env is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = env
    import jax

    kept = jax.config.jax_compilation_cache_dir
    assert use_compile_cache("none") is None and use_compile_cache(None) is None
    assert jax.config.jax_compilation_cache_dir == kept
    # XLA:CPU's worker threads pinned one to a core once warm, by default; off for a server sharing its cores
    assert serve.parse_args([]).pin_threads == "on" and serve.parse_args(["--pin-threads", "off"]).pin_threads == "off"
    be = serve.make_engine(serve.parse_args([*a_flags, "--prefix-pool", "3", "--no-prefix-answers"]))[1]
    assert be.prefix.capacity == 3 and not be.prefix_answers
    from jdspark.engine import SamplingRequest

    for b, pending in ((backend, True), (be, False)):
        b.keep_answer(SamplingRequest(tuple(range(40)), 4), [5, 6, 7])
        assert b.idle_pending() == pending
    assert serve.make_engine(serve.parse_args([*a_flags, "--prefix-pool", "0"]))[1].prefix is None
    with pytest.raises(SystemExit):
        serve.parse_args(["--prefix-pool", "-1"])
    with pytest.raises(SystemExit):  # every request passes through the queue: 0 would answer each with a 429
        serve.parse_args(["--max-waiting", "0"])
    # buckets 1, 2, 4, 8: steps_for is the most a launch runs; steps_at(8, width) what one of that width runs
    for flag, want, at8 in ((["--multi-step-max-batch", "0"], [4] * 5, (4, 4)), ([], [4] * 5, (4, 1)),
                            (["--multi-step-plain-max-batch", "4"], [4, 4, 4, 4, 1], (1, 1))):
        _, backend, *_ = serve.make_engine(serve.parse_args(["--slots", "8", "--max-len", "256", "--prompt-buckets",
                                                             "64", *flag]))
        assert [backend.steps_for(n) for n in (1, 2, 3, 4, 5)] == want
        assert (backend.steps_at(8, 1), backend.steps_at(8, backend.G + 1)) == at8
    with pytest.raises(SystemExit):
        serve.parse_args(["--multi-step-plain-max-batch", "-1"])
    # requests admitted together prefill up to --insert-batch at a time (default: the platform's plan, 4)
    assert serve.parse_args([]).insert_batch == 4 and backend.insert_batch == 4
    assert serve.make_engine(serve.parse_args(["--slots", "2", "--max-len", "256", "--prompt-buckets", "64",
                                               "--insert-batch", "1"]))[1].insert_batch == 1
    with pytest.raises(SystemExit):
        serve.parse_args(["--insert-batch", "0"])
    # a prompt longer than --prefill-slice (default: the largest bucket up to 512) prefills that many at a time
    assert serve.parse_args([]).prefill_slice == 512 and backend.slice_tokens == 64
    assert serve.parse_args(["--prompt-buckets", "128,1024"]).prefill_slice == 128
    assert serve.parse_args(["--prefix-pool", "0"]).prefill_slice == 0
    assert serve.make_engine(serve.parse_args(["--slots", "2", "--max-len", "256", "--prompt-buckets", "64",
                                               "--prefill-slice", "0"]))[1].slice_tokens == 0
    for bad in (["--prefill-slice", "100"], ["--prefix-pool", "0", "--prefill-slice", "512"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)
    # --num-speculative-tokens N (vLLM's): the widest step verifies N drafts, fixed rows at it, adaptive up to it
    for flag, widths in ((["--spec", "fixed"], (1, 4)), ([], (1, 2, 4)), (["--num-speculative-tokens", "7"], None)):
        flags = ["--num-speculative-tokens", "3", *flag] if widths else flag
        _, backend, *_ = serve.make_engine(serve.parse_args(["--slots", "2", "--max-len", "256", "--prompt-buckets",
                                                             "64", *flags]))
        assert backend.widths == (widths or (1, 2, 4, backend.G + 1))
    with pytest.raises(ValueError, match="num_speculative_tokens: expected an int in 1..7"):
        serve.make_engine(serve.parse_args(["--num-speculative-tokens", "8"]))
    for bad in (["--num-speculative-tokens", "0"], ["--spec", "off", "--num-speculative-tokens", "2"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)
    for bad in (["--slots", "0"], ["--max-len", "0"], ["--max-waiting", "-1"], ["--port", "70000"],
                ["--prompt-buckets", "64,x"], ["--prompt-buckets", "0"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)
    assert serve.main(["--checkpoint", "/nonexistent/ckpt", "--compile-cache", "none"]) == 2  # no traceback
    assert "expected a folder with target/config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # plain launches multi-step wherever wide ones do: a lower one given is refused
        serve.parse_args(["--multi-step-max-batch", "8", "--multi-step-plain-max-batch", "4"])
    a = serve.parse_args(["--slots", "32", "--multi-step-max-batch", "0"])  # the default 16 follows the flag given
    assert a.multi_step_plain_max_batch == 0
    from jdspark.slots import SlotBackend

    with pytest.raises(ValueError, match="multi_step_plain_max_batch: expected >= multi_step_max_batch"):
        SlotBackend(None, None, multi_step_max_batch=8, multi_step_plain_max_batch=4)
    sys.path.insert(0, "scripts")
    import bench_serve

    with pytest.raises(SystemExit):
        bench_serve.main(["--url", "http://127.0.0.1:1", "--server-args", "--multi-step 8"])
