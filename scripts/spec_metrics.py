"""What acceptance a running server's own traffic gets, and what speed it buys: read from its /metrics (vLLM's
counter names, so a vLLM server's counters read too), over a window or since the server started.

  python scripts/spec_metrics.py --url http://127.0.0.1:8000 --window 60 --json    # the next 60 s of traffic
  python scripts/spec_metrics.py --url http://127.0.0.1:8000 --window 0            # everything since start-up

From the deltas of the counters over the window:

    accept_len          = 1 + accepted / drafts            tokens a speculative step commits per slot
    acceptance_rate     = accepted / draft_tokens          a verified draft's chance to be kept
    per_position_accept = accepted_at_k / drafts           draft k kept (vLLM's per-position figure; a step
                                                           whose verify width left draft k out counts as not
                                                           keeping it)
    per_position_accept_when_verified = accepted_at_k / steps that verified draft k (a jdspark server: from its
                                                           jdspark:verified_tokens_per_step histogram, the slot-steps
                                                           of width >= k + 2)
    verified_per_slot_step = the mean of jdspark:verified_tokens_per_step (1: plain decoding)

and from a jdspark server's cost table (``jdspark:step_cost_seconds``: what a step of b slots verifying W tokens
costs this server, measured at start-up and by the steps it serves), per batch bucket b and verify width W:

    break_even  = T(b, W) / T(b, 1)                         tokens a step of width W must commit to pay
    expected(W) = 1 + sum_{k < W - 1} a_k                   what this traffic's steps commit at width W, a_k the
                                                            acceptance of draft k when verified
    speedup(W)  = expected(W) / break_even                  against plain decoding at the same batch (the cost
                                                            model of ``jdspark.costmodel`` with this server's own
                                                            figures; > 1: speculation pays there)
    best_width  = the W of the highest speedup(W) > 1, else 1 (plain): a fixed-width server's
                  ``--num-speculative-tokens`` (best_width - 1) for traffic at that batch

At a fixed verify width (``--spec fixed``) every step verifies every draft and both per-position figures are the
same. Under adaptive verification the scheduler verifies a late draft only when its confidence is high, so a_k of
the late drafts reads higher than a step that verified them always would keep, and vLLM's figure lower: expected(W)
of a width the scheduler seldom ran is optimistic (``verified_steps`` says how many steps each a_k rests on).

Prints one JSON object on one line with ``--json`` (else a short table on stderr too)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

__all__ = ["scrape", "report"]


def scrape(text: str) -> dict:
    """{(metric sample name, frozenset of its labels but model_name): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + float(s.value)
    return out


def _total(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def report(before: Optional[str], after: str, seconds: Optional[float]) -> dict:
    """The figures of the module docstring from two /metrics texts (``before`` None: since the server started)
    taken ``seconds`` apart (None: rates not given)."""
    a, b = scrape(after), scrape(before) if before is not None else {}

    def delta(name, **labels):
        return _total(a, name, **labels) - _total(b, name, **labels)

    if delta("vllm:generation_tokens_total") < 0 or delta("vllm:spec_decode_num_drafts_total") < 0:
        raise ValueError("the counters went down between the two reads: the server restarted during the window")
    drafts, draft_tokens = delta("vllm:spec_decode_num_drafts_total"), delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    positions = sorted({int(dict(lab)["position"]) for n, lab in a
                        if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"})
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) / drafts
               if drafts else 0.0 for k in range(max(positions, default=-1) + 1)]
    count = delta("jdspark:verified_tokens_per_step_count")
    verified = [count - _bucket(a, b, "jdspark:verified_tokens_per_step_bucket", k + 1)
                for k in range(len(per_pos))]  # slot-steps that verified draft k: width >= k + 2
    when_verified = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) / n if n else None
                     for k, n in enumerate(verified)]
    gen = delta("vllm:generation_tokens_total")
    finished = {dict(lab)["finished_reason"]: v - _total(b, n, **dict(lab)) for (n, lab), v in a.items()
                if n == "vllm:request_success_total"}

    def mean(hist):
        c = delta(hist + "_count")
        return delta(hist + "_sum") / c if c else None

    out = {"window_s": seconds, "requests_finished": {k: int(v) for k, v in sorted(finished.items())},
           "generation_tokens": int(gen), "generation_tok_s": gen / seconds if seconds else None,
           "drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
           "accept_len": 1 + accepted / drafts if drafts else None,
           "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
           "per_position_accept": per_pos, "per_position_accept_when_verified": when_verified,
           "verified_steps": [int(n) for n in verified],
           "verified_per_slot_step": mean("jdspark:verified_tokens_per_step"),
           "ttft_ms_mean": _ms(mean("vllm:time_to_first_token_seconds")),
           "itl_ms_mean": _ms(mean("vllm:inter_token_latency_seconds")),
           "e2e_ms_mean": _ms(mean("vllm:e2e_request_latency_seconds")),
           "running": int(_total(a, "vllm:num_requests_running")),
           "waiting": int(_total(a, "vllm:num_requests_waiting"))}
    rates = [w if w is not None else p for w, p in zip(when_verified, per_pos)]  # (no histogram: vLLM's)
    out["what_it_buys"] = _buys(a, rates)
    return out


def _bucket(after: dict, before: dict, name: str, le: float) -> float:
    """A histogram's cumulative count at upper bound ``le``, after minus before (0 where it has no such bucket)."""
    def at(m):
        return sum(v for (n, lab), v in m.items() if n == name and dict(lab).get("le") not in (None, "+Inf")
                   and float(dict(lab)["le"]) == le)
    return at(after) - at(before)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def _buys(m: dict, rates: list) -> list:
    """Per batch bucket of the cost table: each width's step time, break-even and this traffic's speedup there
    (``rates``: each draft position's acceptance when verified)."""
    table = {(int(dict(lab)["batch"]), int(dict(lab)["width"])): v for (n, lab), v in m.items()
             if n == "jdspark:step_cost_seconds"}
    rows = []
    for batch in sorted({b for b, _ in table}):
        plain = table.get((batch, 1))
        if not plain:
            continue
        widths = {}
        for w in sorted(x for bb, x in table if bb == batch and x > 1):
            even = table[(batch, w)] / plain
            expected = 1 + sum(rates[:w - 1])
            widths[str(w)] = {"ms": table[(batch, w)] * 1e3, "break_even": even, "expected": expected,
                              "speedup": expected / even}
        best = max(widths, key=lambda w: widths[w]["speedup"], default=None)
        rows.append({"batch": batch, "plain_ms": plain * 1e3, "widths": widths,
                     "best_width": int(best) if best is not None and widths[best]["speedup"] > 1 else 1})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="a running server (its /metrics is read; it needs no API key)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of traffic to measure (0: everything "
                    "since the server started)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on one line")
    a = ap.parse_args(argv)
    if a.window < 0:
        ap.error(f"--window: expected seconds >= 0, got {a.window}")
    import httpx

    url = a.url.rstrip("/") + "/metrics"

    def read() -> str:
        try:
            r = httpx.get(url, timeout=30)
        except httpx.HTTPError as e:
            raise SystemExit(f"spec_metrics: {url}: {e}")
        if r.status_code != 200:
            raise SystemExit(f"spec_metrics: {url} answered HTTP {r.status_code}, expected a Prometheus text")
        return r.text

    before, t0 = (read(), time.monotonic()) if a.window else (None, None)
    if a.window:
        time.sleep(a.window)
    after = read()
    try:
        res = {"url": a.url, **report(before, after, time.monotonic() - t0 if a.window else None)}
    except ValueError as e:
        raise SystemExit(f"spec_metrics: {e}")
    al = res["accept_len"]
    print(f"[spec_metrics] {sum(res['requests_finished'].values())} requests finished, {res['generation_tokens']} "
          f"tokens; accept_len {'-' if al is None else f'{al:.2f}'} over {res['drafts']} speculative slot-steps, "
          f"{res['verified_per_slot_step'] or 0:.2f} tokens verified a slot-step", file=sys.stderr)
    for row in res["what_it_buys"]:
        pays = ", ".join(f"W={w}: {x['speedup']:.2f}x (break-even {x['break_even']:.2f})"
                         for w, x in row["widths"].items())
        w = row["best_width"]
        best = "plain decoding" if w == 1 else f"W={w} (--num-speculative-tokens {w - 1})"
        print(f"[spec_metrics] batch {row['batch']:2d}: plain step {row['plain_ms']:.2f} ms; {pays}; best {best}",
              file=sys.stderr)
    if a.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
