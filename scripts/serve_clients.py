"""What ``scripts/bench_serve.py`` talks to: a running server over HTTP (``HttpClient``), or the server's engine in
this process (``EngineClient``, ``--in-process``); reading its ``/metrics`` (``scrape``, ``scrape_costs``);
starting one on loopback (``launch``) and checking one is ready (``server_problem``). Split from bench_serve.py by
concern: the load test's cells and summaries stay there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scrape(text: str) -> dict:
    """The counters and histogram sums this script reads from a ``/metrics`` text, summed over label sets."""
    want = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_draft_tokens_total", "jdspark:verified_tokens_per_step_sum",
            "jdspark:verified_tokens_per_step_count", "vllm:generation_tokens_total")
    out = dict.fromkeys(want, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def scrape_costs(text: str, concurrency: int) -> dict:
    """The adaptive scheduler's step cost table (``jdspark:step_cost_seconds``, from a ``/metrics`` text) at the
    batch bucket a cell of ``concurrency`` users runs in: {width: ms}; empty for a server without adaptive
    verification."""
    import re

    table = {}
    for line in text.splitlines():
        if line.startswith("jdspark:step_cost_seconds{"):
            b, w = (int(re.search(f'{k}="(\\d+)"', line).group(1)) for k in ("batch", "width"))
            table[(b, w)] = float(line.rsplit(" ", 1)[1]) * 1e3
    buckets = sorted({b for b, _ in table if b >= concurrency})
    return {str(w): ms for (b, w), ms in sorted(table.items()) if buckets and b == buckets[0]}


def _output_of(choice: dict, chat: bool):
    """The output a streamed chunk's choice carries (its text; a chat delta's content, reasoning or tool-call
    arguments), or None for a chunk with none (a role, a finish reason): what TTFT and ITL time."""
    if not chat:
        return choice.get("text") or None
    d = choice.get("delta") or {}
    calls = "".join((f.get("name") or "") + (f.get("arguments") or "")
                    for f in ((t.get("function") or {}) for t in d.get("tool_calls") or []))
    return d.get("content") or d.get("reasoning_content") or calls or None


class HttpClient:
    """A running server: streamed completions over HTTP, ``/metrics`` over HTTP, through one pool of kept-alive
    connections shared by the cell's client threads, as the ``openai`` client and vLLM's load test hold theirs (a
    new ``httpx`` client per request built an SSL context each time: ~22 ms of this CPU's time added to every
    request's TTFT, on the cores the server runs on)."""

    def __init__(self, url: str, max_connections: int = 64, api_key: Optional[str] = None, decode=None,
                 model: Optional[str] = None):
        """``decode`` (token ids -> text; None: this project's server): the server speaks only OpenAI's API (any
        OpenAI-compatible one: ``transformers serve``, vLLM, ...), so a request carries its prompt as text, names
        ``model`` and sends none of vLLM's or this server's own fields (``ignore_eos``, ``speculative``,
        ``spec_mode``): completions end at the server's EOS, and are counted from ``usage``."""
        import httpx

        self.url, self.decode, self.model = url, decode, model
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=max_connections,
                                                                   max_keepalive_connections=max_connections),
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    def request(self, prompt_ids, max_tokens: int, temperature: float, seed: int, mode: str,
                fields: Optional[dict] = None) -> dict:
        """A streamed completion of ``prompt_ids`` (or, when ``fields`` carries ``messages``, a streamed chat
        completion of them) with ``fields`` sent beside the cell's own settings (a line of ``--prompt-file``,
        ``--request-fields``; theirs win for ``top_p`` and ``ignore_eos``): arrival-relative times of every chunk
        that carries output (text, reasoning or a tool call's arguments) and the usage."""
        fields = dict(fields or {})
        chat = "messages" in fields
        body = {**({} if chat else {"prompt": list(map(int, prompt_ids))}), "max_tokens": max_tokens,
                "temperature": temperature, "top_p": 1.0, "seed": seed, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "speculative": mode != "off", **fields}
        if mode != "off":
            body["spec_mode"] = mode
        if self.decode is not None:  # OpenAI's fields only (the constructor's docstring)
            for k in ("ignore_eos", "speculative", "spec_mode"):
                if k not in fields:
                    body.pop(k, None)
            if not chat:
                body["prompt"] = self.decode(prompt_ids)
            if self.model is not None:
                body.setdefault("model", self.model)
        t0 = time.perf_counter()
        chunks, usage, text, finish = [], None, [], None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with self.http.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                c = json.loads(line[6:])
                if c.get("usage"):
                    usage = c["usage"]
                choice = c["choices"][0] if c.get("choices") else {}
                piece = _output_of(choice, chat)
                finish = choice.get("finish_reason") or finish
                if piece is not None:
                    chunks.append(time.perf_counter() - t0)
                    text.append(piece)
        e2e = time.perf_counter() - t0
        if usage is None:
            raise RuntimeError("the stream ended without usage")
        return {"chunks": chunks, "e2e": e2e, "tokens": usage["completion_tokens"], "text": "".join(text),
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "finish": finish}

    def metrics_text(self) -> str:
        """The server's ``/metrics`` text; "" where it has none (a server that is not this project's or vLLM)."""
        r = self.http.get(self.url + "/metrics", timeout=30)
        return r.text if r.status_code == 200 else ""

    def close(self) -> None:
        self.http.close()  # (the server's lifetime is its launcher's)


class EngineClient:
    """The server's engine in this process, no HTTP (``--in-process``): the same requests submitted to
    ``jdspark.engine.Engine`` directly, the same metrics read from its ``ServeMetrics``; what a cell measures here
    against the HTTP cell is what the HTTP layer costs."""

    def __init__(self, engine, metrics):
        self.engine, self.metrics = engine, metrics

    @classmethod
    def from_server_args(cls, argv) -> "EngineClient":
        """Build, warm up and start the engine a ``python -m jdspark.serve`` of these arguments would serve."""
        from jdspark import serve

        engine, backend, *_, metrics, _ = serve.make_engine(serve.parse_args(argv))
        backend.warm_up()
        return cls(engine.start(), metrics)

    def request(self, prompt_ids, max_tokens: int, temperature: float, seed: int, mode: str,
                fields: Optional[dict] = None) -> dict:
        import threading

        from jdspark.engine import Request, SamplingRequest

        if fields:
            raise ValueError(f"--in-process sends token ids only; request fields {sorted(fields)} need the server "
                             "(--launch or --url)")
        done, chunks, usage, text = threading.Event(), [], {}, []
        t0 = time.perf_counter()

        def on_event(ev):
            if ev.text:
                chunks.append(time.perf_counter() - t0)
                text.append(ev.text)
            if ev.finish_reason is not None:
                usage.update(ev.usage or {}, error=ev.error, finish=ev.finish_reason)
                done.set()

        sp = SamplingRequest(tuple(map(int, prompt_ids)), int(max_tokens), float(temperature), 1.0, 0, int(seed),
                             mode != "off", None if mode == "off" else mode)
        self.engine.submit(Request(sp, on_event, stop=(), ignore_eos=True))
        if not done.wait(600):
            raise RuntimeError("an in-process request did not finish within 600 s")
        if usage.get("error") or "completion_tokens" not in usage:
            raise RuntimeError(f"an in-process request failed: {usage}")
        return {"chunks": chunks, "e2e": time.perf_counter() - t0, "tokens": usage["completion_tokens"],
                "text": "".join(text), "cached": usage["prompt_tokens_details"]["cached_tokens"],
                "finish": usage["finish"]}

    def metrics_text(self) -> str:
        return self.metrics.exposition().decode()

    def close(self) -> None:
        self.engine.shutdown()


def launch(checkpoint: str, port: int, slots: int, timeout: float = 900.0, extra=()):
    """Start the server on 127.0.0.1:port and wait (bounded) until /health says ready."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "jdspark.serve", "--checkpoint", checkpoint, "--slots",
                             str(slots), "--port", str(port), "--host", "127.0.0.1", *extra], cwd=ROOT)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.terminate()
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def server_problem(url: str) -> Optional[str]:
    """Why ``url`` is not a ready server (its ``/health`` not answering 200), or None when it is."""
    import httpx

    try:
        status = httpx.get(url.rstrip("/") + "/health", timeout=5).status_code
    except httpx.UnsupportedProtocol:
        return "expected a server's base URL, like http://127.0.0.1:8000"
    except httpx.HTTPError as e:
        return f"no server answers there ({type(e).__name__}: {e})"
    return None if status == 200 else f"/health answers {status} (a server still compiling says 503: wait for 200)"
