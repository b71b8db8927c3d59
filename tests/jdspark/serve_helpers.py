"""A real uvicorn server on a loopback port over the real Engine and HTTP app, with a scripted backend (the model
is replaced, nothing else): the backend's token for slot s after token t is (t + 1) % 256, the first one the
prompt's last byte + 1 + the request's seed (so choices of ``n`` differ), so a request's text is known in advance;
``gate`` pauses steps (to fill the queue), ``drafts`` fakes acceptance per step; every insert says half its prompt
came from the prefix cache; a request that asks for log-probabilities gets ``scripted_logprob``'s (known in
advance too)."""

import json
import socket
import threading
import time

import httpx
import uvicorn

from jdspark.engine import Engine, StepOutput
from jdspark.serve import build_app
from jdspark.serve_metrics import ServeMetrics
from kimi.tokenizer import ByteTokenizer


def scripted_logprob(t: int, top: int) -> tuple:
    """The scripted backend's log-probability entry of token t: (logprob, [(id, logprob)] * top), t the likeliest."""
    lp = -0.05 - (t % 7) / 10
    return lp, [((t + j) % 256, lp - j) for j in range(top)]


def scripted_rank(t: int) -> int:
    """The scripted backend's rank of prompt token t (vLLM's prompt_logprobs carry one)."""
    return 2 + t % 3


class ScriptedBackend:
    def __init__(self, num_slots, tokens_per_step=3, eos=None, reply=None):
        self.num_slots, self.k, self.eos = num_slots, tokens_per_step, eos
        # ``reply``: {marker bytes: ids}: a prompt holding the marker is answered those ids, then EOS (a list of
        # ids alone: the marker b"[reply]")
        self.replies = reply if isinstance(reply, dict) else ({} if reply is None else {b"[reply]": reply})
        self.queued = {}
        self.last, self.top = {}, {}
        self.gate = threading.Event()
        self.gate.set()
        self.inserted, self.freed = [], []
        self.requests = []  # every SamplingRequest inserted, in order
        # a cost table as an adaptive SlotBackend keeps one (the engine exposes it as jdspark:step_cost_seconds)
        self.costs = {(b, w): 0.001 * b + 0.0005 * w for b in (1, num_slots) for w in (1, tokens_per_step + 2)}

    def insert(self, slot, req):
        assert slot not in self.last, f"slot {slot} inserted while busy"
        if req.prompt_ids[-1] == ord("~"):  # a prompt the device side refuses (as SlotBackend a too-long one)
            raise ValueError("prompt refused by the backend")
        self.inserted.append(slot)
        self.requests.append(req)
        self.last[slot] = (req.prompt_ids[-1] + 1 + req.seed) % 256
        said = bytes(t for t in req.prompt_ids if t < 256)
        for marker, ids in self.replies.items():
            if marker in said:
                self.queued[slot] = list(ids) + [self.eos]
                self.last[slot] = self.queued[slot].pop(0)
                break
        if req.first_token_ids:  # token healing: the first id the first token may be (the healed token itself)
            self.last[slot] = req.first_token_ids[0]
        self.top[slot] = req.logprobs
        ptop = req.prompt_logprobs
        prompt = None if ptop is None else [None] + [scripted_logprob(t, ptop) + (scripted_rank(t),)
                                                      for t in req.prompt_ids[1:]]
        return StepOutput([self.last[slot]], cached=len(req.prompt_ids) // 2,  # as if half were kept
                          logprobs=self._logprobs(slot, [self.last[slot]]), prompt_logprobs=prompt)

    def _logprobs(self, slot, toks):
        top = self.top[slot]
        return None if top is None else [scripted_logprob(t, top) for t in toks]

    def step(self, slots):
        self.gate.wait()
        time.sleep(0.002)
        out = {}
        for s in slots:
            toks = []
            for _ in range(self.k):
                q = self.queued.get(s)
                self.last[s] = q.pop(0) if q else (self.last[s] + 1) % 256
                toks.append(self.last[s])
            out[s] = StepOutput(toks, drafted=self.k + 1, accepted=self.k - 1, verified=self.k + 2,
                                logprobs=self._logprobs(s, toks))
        return out

    def free(self, slot):
        self.freed.append(slot)
        del self.last[slot]
        self.queued.pop(slot, None)


class LiveServer:
    def __init__(self, num_slots=4, max_waiting=8, tokens_per_step=3, max_context=4096, chat_template=None,
                 reply=None, reasoning_parser=None, guided_states=32, api_keys=(), allowed_origins=(),
                 max_request_bytes=32 * 2**20, priority_scheduling=False):
        self.tok = ByteTokenizer(chat_template=chat_template)
        self.backend = ScriptedBackend(num_slots, tokens_per_step, eos=self.tok.eos_id, reply=reply)
        self.metrics = ServeMetrics("scripted")
        self.engine = Engine(self.backend, self.tok, eos_token_id=self.tok.eos_id, max_waiting=max_waiting,
                             metrics=self.metrics).start()
        app = build_app(self.engine, self.tok, model_name="scripted", vocab_size=self.tok.vocab_size,
                        max_context=max_context, metrics=self.metrics,
                        spec_modes=("fixed",), max_logprobs=5, max_n=4,  # as a server started with --spec fixed
                        tool_parser="kimi_k2", reasoning_parser=reasoning_parser, penalties=True,
                        guided_states=guided_states, api_keys=api_keys, allowed_origins=allowed_origins,
                        max_request_bytes=max_request_bytes, priority_scheduling=priority_scheduling)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.backend.gate.set()
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def expected_text(prompt: str, n: int, seed: int = 0) -> str:
    """The scripted backend's completion: bytes counting up from the prompt's last byte + 1 + seed."""
    b = prompt.encode()[-1] + seed
    return bytes((b + 1 + i) % 256 for i in range(n)).decode("latin-1")


# ------------------------------------------------------------------ reading a live server
def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics").text


def wait_idle(srv, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(srv)
        if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("requests did not drain")


def sse_chunks(srv, path, body):
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}) as r:
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]


def wait_for(srv, name, value, timeout=10):
    deadline = time.time() + timeout
    while metric(metrics(srv), name) != value:
        assert time.time() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)
