"""Start-up of the serving slots: every program ``SlotBackend`` serves, compiled ahead of time before the server says
ready, and the cost table adaptive verification starts from, each step program timed as serving launches it.

A mixin of ``jdspark.slots.SlotBackend`` (split from it by concern: what runs once at start-up, not per request);
it reads the backend's buckets, widths and argument builders (``_insert_args``, ``_extend_args``, ``_step_args``),
the one place a launch and its ahead-of-time compile name the same program.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jdspark.adaptive import CostTable
from jdspark.engine import SamplingRequest
from jdspark.graphs import compile_programs
from jdspark.prefix import extend, snapshot
from jdspark.slot_programs import SAMPLING_OFF, insert_row, insert_rows, step_rows
from jdspark.stop_strings import set_stops
from kimi import dispatch

__all__ = ["StartUp"]


class StartUp:
    """``programs``, ``compile_all`` and ``warm_up`` of ``SlotBackend``."""

    def programs(self) -> list:
        """Every program serving needs, as (jitted function, args, static kwargs): each text prompt bucket's insert
        and each (batch bucket, width, draft cap program, steps per launch) step (the optional group inserts:
        ``group_programs``). (An image prompt's insert, whose features come from the vision tower,
        compiles in ``warm_up``'s runs.)"""
        out = []
        for P in self.prompt_buckets:
            padded = np.full((1, P), self.cfg.bos_token_id, np.int32)
            out.append((insert_row, *self._insert_args(0, padded, P, 0, SAMPLING_OFF, None,
                                                    dispatch.prefill_chunk(P, self.prefill_chunk))))
            if self.prefix is not None:  # a prefix-cache hit's extension of this bucket
                out.append((extend, self._extend_args(0, 0, padded, P, 0), self._extend_kw()))
        if self.prefix is not None:
            out.append((snapshot, (self.pool, self.state, np.int32(0), np.int32(0)), {}))
        if self.stop_states:  # a request's stop strings, after its insert
            out.append((set_stops, (self.state, np.int32(0), np.zeros((self.stop_states, self.stop_classes), np.int32),
                                    np.zeros((self.cfg.vocab_size,), np.int32)), {}))
        for b in self.batch_buckets:
            rows = np.arange(b, dtype=np.int32)
            for w in self.widths:
                for cap in self.program_caps(w):
                    for k in sorted({1, self.steps_at(b, w)}):
                        out.append((step_rows, *self._step_args(rows, w, k, caps=np.full(b, float(cap)))))
        return out

    def group_programs(self) -> list:
        """The group inserts ``programs()`` leaves out, as it lists them: each (one-pass prompt bucket, group size in
        ``group_sizes``). Optional at start-up: where the memory maps would not hold them beside the rest,
        ``compile_all`` leaves them out and the backend inserts one prompt at a time."""
        return [(insert_rows, *self._group_args(P, k)) for P in self.prompt_buckets
                if dispatch.prefill_chunk(P, self.prefill_chunk) is None for k in self.group_sizes()]

    def _group_args(self, P: int, k: int) -> tuple:
        """``insert_rows``' arguments for k prompts of bucket P (BOS only), the prefix cache not asked (its
        counters are the traffic's)."""
        kept, self.prefix = self.prefix, None
        try:
            preps = [self._prepare(s, SamplingRequest(tuple([self.cfg.bos_token_id] * P), 1)) for s in range(k)]
        finally:
            self.prefix = kept
        return self._rows_args(preps)

    def compile_all(self, threads: Optional[int] = None) -> int:
        """Compile ``programs()`` and the group inserts (``group_programs``) ahead of time, ``threads`` at a time
        under the memory-map guard (``graphs.compile_programs``); a jitted call of the same arguments afterwards
        reuses the executable (it traces, no compile: ``tests/jdspark/test_slots.py``). Where the memory maps
        would not hold the group inserts too (the default server's 4 prompt buckets on a CPU: 62 programs, ~67k
        maps against Linux's default limit of 65530), they are left out and ``insert_batch`` falls to 1, said on
        stderr. Returns the number of programs compiled."""
        groups = self.group_programs()
        n = compile_programs(self.programs(), threads, optional=groups)
        if groups and n < len(self.programs()) + len(groups):
            print(f"[slots] batched inserts off: their {len(groups)} programs would not fit this system's memory "
                  f"maps beside the other {n} (vm.max_map_count; fewer --prompt-buckets or a higher limit keeps them)",
                  file=sys.stderr, flush=True)
            self.insert_batch = 1
        return n

    def warm_up(self, reps: int = 5) -> dict:
        """Compile every prompt bucket's insert and every (batch bucket, width) step before serving; with adaptive
        verification also time each step program (``reps`` runs after its compile; their median) into the cost
        table the scheduler reads, per step of a launch as serving launches them (``steps_at``: at small buckets
        several steps a launch, whose host round trip a single step's timing would charge to one step: a 1 x 8
        step timed alone at 12.5 ms was served at ~7.5, which kept the whole block out until served steps
        re-timed it). The timings go in rounds, each timing every width once: a load that comes and goes during
        warm-up then moves every width's samples alike. Timing each width's ``reps`` in turn, one start-up priced
        b = 16 W = 1 at 15.8 ms and W = 2 at 15.9 (served ~11 and ~17); one engine timed both ways four times
        (``docs/warm_up_order_b1_b16.jsonl``) priced b = 16 W = 4 at 25.8-36.0 ms in turn, 24.7-26.2 in rounds.
        Returns the table {(batch, width): seconds}. The programs are compiled ahead of time first, several at
        once (``compile_all``); the runs below then find them compiled."""
        self.compile_all()
        bos = self.cfg.bos_token_id
        kept, self.prefix = self.prefix, None  # each bucket's own insert runs (a longer all-BOS prompt would hit)
        for P in self.prompt_buckets:
            self.insert(0, SamplingRequest(tuple([bos] * P), 1))
            for k in self.group_sizes():  # each group size's insert (compiled above where the bucket is one pass)
                list(self.insert_many([(s, SamplingRequest(tuple([bos] * P), 1)) for s in range(k)]))
            if self.cfg.vision is not None:  # the image prompts' program of this bucket (features as zeros)
                self._prefill(0, np.full((1, P), bos, np.int32), P, 0, SAMPLING_OFF,
                              jnp.zeros((P, self.cfg.hidden_size), jnp.float32), None)
        self.prefix = kept
        if kept is not None:  # the copy into the pool and each bucket's extension, on a kept 1-token prompt
            self.insert(0, SamplingRequest((bos,), 1))
            self.pool = snapshot(self.pool, self.state, np.int32(0), np.int32(0))
            for P in self.prompt_buckets:
                self._extend(0, 0, np.full((1, P), bos, np.int32), 1, 0)
        timings = CostTable()
        for b in self.batch_buckets:
            for w in self.widths:
                for cap in self.program_caps(w):  # the last: the program adaptive schedules (timed below)
                    self.params[:b, 3] = cap
                    self.step(list(range(b)), width=w)  # a first run (compile_all compiled it)
                    if self.steps_at(b, w) > 1:
                        self.collect(self.launch(list(range(b)), width=w, steps=self.steps_at(b, w)))
            if self.adaptive:  # timed as served: a launch of steps_at(b, w) steps, per step; in rounds over widths
                for _ in range(max(1, reps)):
                    for w in self.widths:
                        k = self.steps_at(b, w)
                        self.params[:b, 3] = self.program_caps(w)[-1]
                        t0 = time.perf_counter()
                        self.collect(self.launch(list(range(b)), width=w, steps=k))
                        timings.observe((b, w), (time.perf_counter() - t0) / k)
        if self.prefix is not None:  # warm-up's prompts are no one's
            self.prefix.clear()
        for s in range(self.num_slots):
            self.free(s)
            self.tracker.reset(s)
        self.tracker.prior[:] = 1.0
        self.width_counts.clear()
        self.launch_steps.clear()
        self.timings = timings
        self.costs = dict(timings.table)
        return dict(self.costs)
