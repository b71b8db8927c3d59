"""Replay adaptive verification's scheduler on recorded blocks: tok/s per policy against a cost table (JSON).

  python scripts/replay_adaptive.py --json
  python scripts/replay_adaptive.py --cost-ms 1:5.5,2:11,4:12,8:13 --cost-ms 1:14.3,2:25.4,4:35.7,8:47.3 --json

Records, on the shipped pair at batch 1 and greedy, every whole-block step of ``--prompts`` held-out code prompts
(``--max-tokens`` each): the confidence head's survival curve and the drafts accepted. Then replays policies over
those steps against each cost table (ms per step by verify width; by default the table ``warm_up`` measures here
at batch 1, and the ones given with ``--cost-ms``): ``plain`` (W = 1), ``fixed`` (the whole block), ``oracle``
(the best width for each step knowing its outcome: an upper bound), ``adaptive`` (``jdspark.adaptive``'s tracker
and ``next_width`` as the server runs them: the width from the previous block's calibrated curve, and the
cheapest drafting width after a run of ``adaptive.probe_interval`` plain steps), ``adaptive_no_refresh``,
``fixed:W`` (every step at width W: the server's ``--num-speculative-tokens W - 1``) and ``early_stop:t`` (DSpark's
within-block rule: the smallest compiled width holding the drafts whose own block's survival stays >= t; lossless,
slot k's confidence reads tokens < k only; priced at the table's width W although it needs the whole block's
confidences first, which a narrow step does not draft: an upper bound on what building it would give). A step
verified at width W commits 1 + min(accepted, W - 1) tokens (exact under greedy for that block); the replay keeps
the recorded block boundaries (a narrower step would move the next block's start: an approximation). What it is
for: choosing the tracker's settings from this pair's real acceptance without a load test per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

WIDTHS = (1, 2, 4, 8)


def record(target, drafter, prompts, max_tokens: int) -> tuple:
    """[(accepted, survival [G])] per prompt, every step a whole block; and warm_up's b = 1 table {W: ms}."""
    import jax

    from jdspark.engine import SamplingRequest
    from jdspark.slots import SlotBackend

    P = -(-max(len(p) for p in prompts) // 64) * 64
    be = SlotBackend(target, drafter, num_slots=1, max_len=P + max_tokens + 2 * drafter.config.block_size + 2,
                     prompt_buckets=(P,), batch_buckets=(1,), adaptive=True)
    table = {w: s * 1e3 for (b, w), s in be.warm_up().items()}
    G = be.G
    runs = []
    for p in prompts:
        be.insert(0, SamplingRequest(tuple(p), max_tokens, spec_mode="adaptive"))
        seq, n = [], 1
        while n < max_tokens:
            out = be.launch([0], width=G + 1)["out"]
            acc, surv = jax.device_get((out.accepted, out.survival))
            acc = int(np.asarray(acc).reshape(-1)[0])
            seq.append((acc, np.asarray(surv, np.float64).reshape(-1, G)[0]))
            n += acc + 1
        runs.append(seq)
    return runs, table


def replay(runs, table_ms: dict, policy: str, G: int, refresh_budget: float = None) -> float:
    """Committed tokens per second of ``policy`` over the recorded steps against ``table_ms`` {W: ms}."""
    from jdspark.adaptive import SurvivalTracker, monotone_costs, next_width

    widths = tuple(sorted(table_ms))
    costs = monotone_costs({(1, w): table_ms[w] for w in widths})
    kw = {} if refresh_budget is None else {"refresh_budget": refresh_budget}
    tr = SurvivalTracker(1, G, **kw)
    tokens = ms = 0.0
    for seq in runs:
        tr.reset(0)
        for acc, surv in seq:
            if policy == "plain":
                W = 1
            elif policy == "fixed":
                W = widths[-1]
            elif policy == "oracle":
                W = max(widths, key=lambda w: (1 + min(acc, w - 1)) / costs[(1, w)])
            elif policy.startswith("fixed:"):
                W = int(policy[6:])
            elif policy.startswith("early_stop:"):
                n = int(np.cumprod(np.asarray(surv) >= float(policy[11:])).sum())
                W = min(w for w in widths if w >= min(n + 1, widths[-1]))
            else:
                W = next_width(tr, [0], np.array([G]), 1, widths, costs)
            tokens += 1 + min(acc, W - 1)
            ms += costs[(1, W)]
            if W > 1:
                tr.observe(0, surv, W - 1, min(acc, W - 1))
            else:
                tr.stepped_plain(0)
    return tokens / ms * 1e3


def parse_table(text: str) -> dict:
    try:
        table = {int(w): float(ms) for w, ms in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected W:ms pairs, e.g. 1:5.5,2:11,4:12,8:13") from None
    if any(ms <= 0 for ms in table.values()) or 1 not in table:
        raise argparse.ArgumentTypeError(f"{text!r}: every ms must be > 0, and width 1 must be given")
    return table


def main(argv=None) -> int:
    import generate as gen

    from jdspark import data as jdata

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=gen.DEFAULT_DIR)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cost-ms", type=parse_table, action="append", default=[],
                    help="a table W:ms,... (repeatable); its widths must be the drafter's compiled ones")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    target, drafter, note = gen.load_pair(a.checkpoint)
    if drafter is None or drafter.confidence_head is None:
        ap.error("the checkpoint needs a drafter with a confidence head")
    G = drafter.config.block_size
    for t in a.cost_ms:
        if sorted(t) != sorted({1, 2, 4, G + 1}):
            ap.error(f"--cost-ms: widths {sorted(t)}; the slots compile {sorted({1, 2, 4, G + 1})}")
    tok = gen.load_tokenizer(a.checkpoint, target.config)
    prompts = [p.tolist() for p in jdata.heldout_prompts(a.prompts, a.prompt_len, tokenizer=tok)]
    runs, measured = record(target, drafter, prompts, a.max_tokens)
    steps = sum(len(r) for r in runs)
    accept_len = float(np.mean([acc + 1 for r in runs for acc, _ in r]))
    rows = []
    for name, table in [("warm_up", measured)] + [(f"given_{i}", t) for i, t in enumerate(a.cost_ms)]:
        res = {p: replay(runs, table, p, G) for p in ("plain", "fixed", "oracle", "adaptive", "fixed:2", "fixed:4",
                                                       "early_stop:0.3", "early_stop:0.4", "early_stop:0.5")}
        res["adaptive_no_refresh"] = replay(runs, table, "adaptive", G, refresh_budget=0.0)
        best = max(res["plain"], res["fixed"])
        rows.append({"table": name, "cost_ms": {str(w): ms for w, ms in sorted(table.items())}, "tok_s": res,
                     "adaptive_over_best_of_plain_fixed": res["adaptive"] / best,
                     "no_refresh_over_best_of_plain_fixed": res["adaptive_no_refresh"] / best})
        print(f"[replay_adaptive] {name} {rows[-1]['cost_ms']}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in res.items()), file=sys.stderr)
    if a.json:
        print(json.dumps({"steps": steps, "accept_len": accept_len, "prompts": a.prompts, "rows": rows},
                         separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
