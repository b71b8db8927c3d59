"""Where one generation's device time goes, by phase of the step (JSON): an XLA profile of ``jdspark.generate``.

  python scripts/bench_profile.py --json                      # DSpark, greedy, a held-out code prompt
  python scripts/bench_profile.py --temperature 1 --json      # sampled (top-p 0.95)
  python scripts/bench_profile.py --plain --json              # plain decoding
  python scripts/bench_profile.py --slots 1 --plain --json    # the server's step instead (jdspark.slots, batch 1)

The generation is compiled and run once, then run again under ``jax.profiler``. Every op the device ran is read from
the trace with its own time (its duration less that of the ops nested in it: a while loop's body, a cond's branch) and
attributed to the phase named in its HLO metadata: ``jdspark.speculative.spec_step`` and ``plain_step`` name their
phases with ``jax.named_scope`` (draft, verify, accept, commit, append_context; ``plain_step``: decode, accept); the
rest (the prefill, the loop itself) is ``other``; a worker thread's waits for the others are ``wait``. Within the
target's passes (verify, decode) ``part_ms_per_step`` splits the time by the model's own scopes (``kimi.model``
names them: kda, mla, moe, dense, attn_res, lm_head; ``rest``: embedding, cache stacking). The op names
come from the compiled program's HLO, dumped for this run (``--xla_dump_to``; set before JAX starts). Per-step figures
divide by the generation's target steps. ``--slots B`` profiles the serving engine's step instead
(``jdspark.slots.SlotBackend``: B rows of one request each, ``--steps-per-launch`` steps a launch, ``--launches``
launches, at the drafter's whole block or, with ``--plain``, rows that never draft): the same phases, and
``other`` is then what the slots add around them (the rows' gather and scatter, the batch's flags, the scan).
The trace includes the threads' waits, so read the phases' shares; and on a shared machine compare the phases of
one run, not runs. On a GPU the ops are read from the device's "XLA Ops" line
(``trace_lines``), and ``wall_ms`` against ``busy_ms`` (the time any op ran) says how much of a step the device
waits on the host.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

PHASES = ("draft", "verify", "accept", "commit", "append_context", "decode")  # the steps' named scopes
PARTS = ("kda", "mla", "moe", "dense", "attn_res", "lm_head")  # kimi.model's scopes inside a target pass
_OP = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{[^}\n]*op_name="([^"]*)"', re.M)


def op_names(hlo_text: str) -> dict:
    """HLO instruction name -> its ``op_name`` metadata (the jaxpr path, named scopes included)."""
    return {m.group(1): m.group(2) for m in _OP.finditer(hlo_text)}


def _innermost(op_name: str, scopes: tuple, default: str) -> str:
    """The innermost of ``scopes`` in an op's scope path (a whole path part, not a substring; ``vmap(decode)``, a
    scope traced under ``jax.vmap`` as the serving slots trace theirs, is ``decode``), else ``default``."""
    parts = (p[5:-1] if p.startswith("vmap(") and p.endswith(")") else p for p in reversed(op_name.split("/")))
    return next((p for p in parts if p in scopes), default)


def phase_of(op_name: str) -> str:
    """The step's phase an op ran in (``.../while/body/draft/...`` -> draft), else other."""
    return _innermost(op_name, PHASES, "other")


def part_of(op_name: str) -> str:
    """The target pass's part an op belongs to (``.../verify/moe/...`` -> moe), else ``rest``."""
    return _innermost(op_name, PARTS, "rest")


def self_times(events) -> list:
    """[(name, self ns)] of one trace line's events [(start ns, duration ns, name)]: each event's duration less the
    durations of the events directly nested in it (events nest, as a loop's body ops inside the loop)."""
    evs = sorted(events, key=lambda e: (e[0], -e[1]))
    out, stack = [], []  # stack: (end, index into out)
    for start, dur, name in evs:
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            out[stack[-1][1]][1] -= dur
        out.append([name, dur])
        stack.append((start + dur, len(out) - 1))
    return [(n, t) for n, t in out]


def by_phase(lines, names: dict) -> tuple:
    """Self time per phase and per op (ns) over the trace's device-thread lines, each a list of events; a thread
    pool's waits (``...Await``) are their own phase, ``wait``."""
    phase, per_op, per_part = collections.Counter(), collections.Counter(), collections.Counter()
    for events in lines:
        for name, t in self_times(events):
            if name.startswith("ThunkExecutor"):
                continue
            ph = "wait" if "Await" in name else phase_of(names.get(name, ""))
            phase[ph] += t
            per_op[(ph, name, names.get(name, "?"))] += t
            per_part[(ph, part_of(names.get(name, "")))] += t
    return phase, per_op, per_part


def trace_lines(prof) -> tuple:
    """The trace lines whose events are the program's ops, and their names ("plane / line"): XLA:CPU's worker
    threads (``tf_XLAEigen...``), else a GPU's device planes' "XLA Ops" lines (one event per HLO op the device
    ran), else every line of those planes but the module and step summaries."""
    cpu = [(p.name, ln) for p in prof.planes for ln in p.lines if ln.name.startswith("tf_XLAEigen")]
    dev = [(p.name, ln) for p in prof.planes if p.name.startswith("/device:") and "CPU" not in p.name
           for ln in p.lines]
    chosen = cpu or [x for x in dev if x[1].name == "XLA Ops"] or [
        x for x in dev if x[1].name not in ("XLA Modules", "Steps", "XLA TraceMe")]
    return ([[(ev.start_ns, ev.duration_ns, ev.name) for ev in ln.events] for _, ln in chosen],
            [f"{p} / {ln.name}" for p, ln in chosen])


def busy_ns(lines) -> int:
    """The time at least one of the lines' events was running (the union of their intervals), in ns."""
    spans = sorted((s, s + d) for events in lines for s, d, _ in events)
    total, end = 0, None
    for s, e in spans:
        if end is None or s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def _slot_runner(target, drafter, prompt, a):
    """A callable that runs ``a.launches`` launches of the serving slots' step (``SlotBackend``, ``a.slots`` rows of
    ``prompt``, inserted afresh each call so every call runs the same steps) and returns (steps a row ran, tokens
    committed per row, tokens per step)."""
    import jax

    from jdspark.engine import SamplingRequest
    from jdspark.slots import SlotBackend

    K, G = a.steps_per_launch, drafter.config.block_size
    W = 1 if a.plain else G + 1
    steps = a.launches * K
    need = len(prompt) + (steps + 1) * W + G + 2
    be = SlotBackend(target, drafter, num_slots=16, max_len=-(-need // 64) * 64, prompt_buckets=(len(prompt),),
                     multi_step=K, multi_step_max_batch=16)
    rows = list(range(a.slots))
    top_p = a.top_p if a.temperature > 0 else 1.0

    def run():
        for s in rows:
            be.insert(s, SamplingRequest(tuple(int(t) for t in prompt), steps * W + 1, temperature=a.temperature,
                                         top_p=top_p, seed=a.prompt + s, speculative=not a.plain))
        committed = 0
        for _ in range(a.launches):
            outs = be.collect(be.launch(rows, W, steps=K))
            committed += sum(len(o.tokens) for o in outs[rows[0]])
        jax.block_until_ready(be.state)
        return steps, committed, committed / steps

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"))
    ap.add_argument("--plain", action="store_true", help="plain decoding (no drafter)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=0.95, help="with --temperature > 0")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=0, help="which held-out code prompt (seed 0's order)")
    ap.add_argument("--top-ops", type=int, default=12, help="ops listed, by self time")
    ap.add_argument("--slots", type=int, default=None, metavar="B",
                    help="profile the serving slots' step at batch B instead of batch-1 generate")
    ap.add_argument("--steps-per-launch", type=int, default=4, help="with --slots")
    ap.add_argument("--launches", type=int, default=8, help="with --slots: launches traced")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.max_new_tokens < 2 or a.prompt < 0:
        ap.error("--temperature >= 0, --top-p in (0, 1], --max-new-tokens >= 2 and --prompt >= 0 expected")
    if a.slots is not None and not (1 <= a.slots <= 16 and a.steps_per_launch >= 1 and a.launches >= 1):
        ap.error("--slots in 1..16, --steps-per-launch >= 1 and --launches >= 1 expected")
    program = "step_rows" if a.slots is not None else "generate_program"
    dump = tempfile.mkdtemp(prefix="jdspark_hlo_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               f" --xla_dump_hlo_module_re=.*{program}.*")
    import generate as gen  # after XLA_FLAGS: JAX reads them when its backend starts
    import jax
    import numpy as np

    import jdspark
    from jdspark import data as jdata
    from jdspark import workloads

    target, drafter, _ = gen.load_pair(a.checkpoint)
    tok = gen.load_tokenizer(a.checkpoint, target.config)
    prompts = jdata.prompts_from_documents(workloads.documents("code"), a.prompt + 1, a.prompt_len, seed=0,
                                           tokenizer=tok)
    d = None if a.plain else drafter
    kw = dict(max_new_tokens=a.max_new_tokens, eos_token_id=-1, temperature=a.temperature,
              top_p=a.top_p if a.temperature > 0 else 1.0, seed=a.prompt)
    prompt = np.asarray(prompts[a.prompt])
    if a.slots is not None:
        run = _slot_runner(target, drafter, prompt, a)
    else:
        def run():
            out = jdspark.generate(target, d, prompt, **kw)
            jax.block_until_ready(out.tokens)
            steps = int(out.stats.target_steps)
            return steps, int(out.num_tokens), (int(out.stats.accepted) + steps) / steps
    run()  # compile + warm
    trace = tempfile.mkdtemp(prefix="jdspark_trace_")
    jax.profiler.start_trace(trace)
    t0 = time.perf_counter()
    steps, new_tokens, accept_len = run()
    wall_ns = (time.perf_counter() - t0) * 1e9
    jax.profiler.stop_trace()
    hlo = sorted(glob.glob(os.path.join(dump, f"*{program}*after_optimizations.txt")), key=os.path.getmtime)
    if not hlo:
        raise SystemExit(f"bench_profile: no optimized HLO of the {program} program was dumped to {dump}")
    names = op_names(open(hlo[-1]).read())
    pb = glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)
    prof = jax.profiler.ProfileData.from_file(pb[0])
    lines, line_names = trace_lines(prof)
    if not any(lines):
        raise SystemExit(f"bench_profile: no op events in the trace's lines {line_names}")
    phase, per_op, per_part = by_phase(lines, names)
    shutil.rmtree(dump, ignore_errors=True)
    shutil.rmtree(trace, ignore_errors=True)
    total_ms = sum(e[1] for line in lines for e in line) / 1e6
    result = {"mode": "plain" if a.plain else "dspark", "temperature": a.temperature,
              "top_p": a.top_p if a.temperature > 0 else 1.0, "new_tokens": new_tokens,
              "program": program, **({"slots": a.slots, "steps_per_launch": a.steps_per_launch,
                                      "launches": a.launches} if a.slots is not None else {}),
              "target_steps": steps, "accept_len": accept_len,
              "phase_ms_per_step": {k: round(v / 1e6 / steps, 4) for k, v in phase.most_common()},
              "phase_share": {k: round(v / sum(phase.values()), 4) for k, v in phase.most_common()},
              "traced_thread_ms": round(total_ms, 2), "backend": jax.default_backend(), "trace_lines": line_names,
              # the generation's wall time against the time some traced line was busy: on a GPU, what is left is
              # the host's (launches, loop predicates read back) and idle gaps between kernels
              "wall_ms": round(wall_ns / 1e6, 2), "busy_ms": round(busy_ns(lines) / 1e6, 2),
              "part_ms_per_step": {ph: {pt: round(per_part[(ph, pt)] / 1e6 / steps, 4) for pt in PARTS + ("rest",)
                                        if per_part[(ph, pt)]} for ph in ("verify", "decode") if phase[ph]},
              "top_ops": [{"phase": ph, "op": n, "op_name": op[-100:], "ms_per_step": round(t / 1e6 / steps, 4)}
                          for (ph, n, op), t in per_op.most_common(a.top_ops)]}
    for k, v in result["phase_ms_per_step"].items():
        print(f"[bench_profile] {k:15s} {v:7.3f} ms/step ({100 * result['phase_share'][k]:.0f}%)", file=sys.stderr)
    if a.json:
        print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
