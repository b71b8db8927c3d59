"""Prometheus metrics under vLLM's names, so dashboards built for vLLM read a jdspark server unchanged.

Counters (exposed with the ``_total`` suffix, as vLLM's are): ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``,
``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based), ``vllm:prompt_tokens``,
``vllm:generation_tokens``, ``vllm:request_success`` (label ``finished_reason``), ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (prompt tokens looked up / found kept: ``jdspark.prefix``; hit rate = hits / queries),
``vllm:num_preemptions`` (always 0: a request keeps its slot from admission to its end). Gauges:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (the slots' cache
positions in use, a fraction: prompt + output tokens of the running requests over slots x max_len; each slot's
cache is allocated whole, so this says how full the allocation is, not what it costs). Histograms:
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds`` (admission to first token),
``vllm:request_decode_time_seconds`` (first token to last), ``vllm:request_inference_time_seconds`` (admission to
last), ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``, ``vllm:request_params_max_tokens``
(per request), and ``jdspark:verified_tokens_per_step``
(tokens the target verified per slot per step: the adaptive scheduler's choice). Counter
``jdspark:prefill_slices``: long prompts' slices prefilled between the running streams' steps (``--prefill-slice``,
``jdspark.engine.Engine._slice``). Gauge ``jdspark:step_cost_seconds``
(labels ``batch``, ``width``): the cost table the adaptive scheduler reads, as measured by warm-up and then by the
steps served (what a step of that many slots at that verify width costs this server).

Acceptance of your own traffic: accepted / draft_tokens from the counters' deltas, and accept_len =
1 + accepted / drafts (tokens per target step).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServeMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
_TOKENS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 buckets
_TPOT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServeMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str, max_positions: int = 16):
        self.registry = CollectorRegistry()
        r, lab = self.registry, {"labelnames": ["model_name"]}
        self.model = model_name
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative steps (one draft block each).",
                                  registry=r, **lab)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens sent to verification.",
                                        registry=r, **lab)
        self.num_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r,
                                    **lab)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the block (0-based).",
                                        labelnames=["model_name", "position"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens (those found in the prefix cache too).",
                                     registry=r, **lab)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r, **lab)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "prefilled).", registry=r, **lab)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated (completion tokens).",
                                         registry=r, **lab)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               labelnames=["model_name", "finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in slots.", registry=r, **lab)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", registry=r, **lab)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY,
                              registry=r, **lab)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between token deliveries, per token.",
                             buckets=_TPOT, registry=r, **lab)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "A request's decode time over its output tokens after the first.", buckets=_TPOT,
                              registry=r, **lab)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY,
                             registry=r, **lab)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to admission into a slot.",
                               buckets=_LATENCY, registry=r, **lab)
        self.verified = Histogram("jdspark:verified_tokens_per_step", "Tokens verified per slot per step.",
                                  buckets=tuple(range(1, max_positions + 2)), registry=r, **lab)
        self.step_cost = Gauge("jdspark:step_cost_seconds", "The adaptive scheduler's step cost per (batch, width).",
                               labelnames=["model_name", "batch", "width"], registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Admission to first token.",
                                      buckets=_LATENCY, registry=r, **lab)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last.", buckets=_LATENCY,
                                     registry=r, **lab)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "Admission to last token.",
                                        buckets=_LATENCY, registry=r, **lab)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", buckets=_TOKENS,
                                    registry=r, **lab)
        self.req_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                        buckets=_TOKENS, registry=r, **lab)
        self.req_max_tokens = Histogram("vllm:request_params_max_tokens", "max_tokens per request.",
                                        buckets=_TOKENS, registry=r, **lab)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (never: a slot is held to the end).",
                                   registry=r, **lab)
        self.slices = Counter("jdspark:prefill_slices", "Long prompts' slices prefilled between the running "
                              "streams' steps (--prefill-slice).", registry=r, **lab)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Slot cache positions in use (fraction, 1 = full).",
                              registry=r, **lab)
        self._m(self.preemptions)
        self._m(self.slices)
        self._costs_seen = None
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name=model_name, finished_reason=reason)

    def _m(self, metric):
        return metric.labels(model_name=self.model)

    def prefill_slice(self) -> None:
        self._m(self.slices).inc()

    def queue_time(self, seconds: float) -> None:
        self._m(self.queue).observe(seconds)

    def step(self, req, outs, taken, now: float, prefill: bool) -> None:
        """One slot's commit of a launch's steps ``outs`` (StepOutputs, in order; the prefill's first token is one):
        tokens counted, acceptance recorded per speculative step, latencies observed."""
        if prefill:
            self._m(self.prompt_tokens).inc(len(req.sampling.prompt_ids))
            self._m(self.prefix_queries).inc(len(req.sampling.prompt_ids))
            self._m(self.prefix_hits).inc(req.cached_tokens)
        self._m(self.generation_tokens).inc(len(taken))
        for out in outs if not prefill else ():
            self._m(self.verified).observe(out.verified)
            if out.drafted:
                self._m(self.num_drafts).inc()
                self._m(self.num_draft_tokens).inc(out.drafted)
                self._m(self.num_accepted).inc(out.accepted)
                for pos in range(out.accepted):
                    self.accepted_per_pos.labels(model_name=self.model, position=str(pos)).inc()
        if req.first_token_at is None:
            self._m(self.ttft).observe(now - req.arrival)
        elif taken:
            gap = (now - req.last_token_at) / len(taken)
            for _ in taken:
                self._m(self.itl).observe(gap)

    def finished(self, req, reason: str, now: float) -> None:
        self.success.labels(model_name=self.model, finished_reason=reason).inc()
        self._m(self.e2e).observe(now - req.arrival)
        n = len(req.output_ids)
        if n > 1 and req.first_token_at is not None:
            self._m(self.tpot).observe((now - req.first_token_at) / (n - 1))
        self._m(self.req_prompt).observe(len(req.sampling.prompt_ids))
        self._m(self.req_generation).observe(n)
        self._m(self.req_max_tokens).observe(req.sampling.max_tokens)
        if req.admitted_at is not None and req.first_token_at is not None:
            self._m(self.prefill_time).observe(req.first_token_at - req.admitted_at)
            self._m(self.decode_time).observe(now - req.first_token_at)
            self._m(self.inference_time).observe(now - req.admitted_at)

    def gauges(self, running: int, waiting: int, kv_usage: float = 0.0) -> None:
        self._m(self.running).set(running)
        self._m(self.waiting).set(waiting)
        self._m(self.kv_usage).set(kv_usage)

    def step_costs(self, table) -> None:
        """Expose the scheduler's cost table {(batch, width): seconds} (a table already exposed is skipped)."""
        if table is self._costs_seen:
            return
        self._costs_seen = table
        for (b, w), seconds in table.items():
            self.step_cost.labels(model_name=self.model, batch=str(b), width=str(w)).set(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
