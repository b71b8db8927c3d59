"""The engine's device backend: S slots, each one stream of ``jdspark.speculative`` (the same prefill and the same
draft / verify / accept / commit step as batch-1 ``generate``), mapped over the active slots with ``jax.vmap``.

State: a ``speculative.Stream`` whose every leaf has a leading slot axis [S, ...] (target cache, drafter cache,
anchor, RNG key), plus per-slot sampling parameters and draft caps on the host. One step:

    active slots -> padded to a compiled batch bucket b (1, 2, 4, ... S) -> gather their rows
    vmap(spec_step) over the b rows at a compiled verify width W (or plain_step for a step with no drafting)
    scatter the rows back; each row committed its own number of tokens (KDA / conv state selected per row,
    MLA and drafter lengths per row: batch 1 inside the map)

``insert`` prefills one prompt at batch 1 (its length bucketed) and writes the row into its slot (slot index
traced, state donated); ``insert_many`` prefills requests admitted together up to ``insert_batch`` at a time
(``jdspark.slot_insert``). Every (bucket, width) program is compiled by ``warm_up()`` (``jdspark.slot_startup``)
before the server says ready.

Multi-step scheduling (vLLM's ``num_scheduler_steps``): at batch buckets <= ``multi_step_max_batch`` one launch may
run ``multi_step`` steps (a ``lax.while_loop`` of the same step, one width), when the engine has no request waiting for
a slot; the engine commits them in order. A plain launch (width 1) may do so up to ``multi_step_plain_max_batch``:
it has no drafts whose width would be planned from stale curves. Where one row's step is a few ms, the host's round
trip per launch (dispatch, read-back, commit) is a large share of it. A launch stops once all its rows have ended
(``slot_programs.step_rows``): at one of a request's stop ids (EOS among them) or stop strings
(``jdspark.stop_strings``: an automaton of up to ``stop_states`` states a slot, set by ``insert`` from
``SamplingRequest.stop_fsm``); a row whose request ends otherwise (``max_tokens``, a stop string too large for the
slot) runs the rest of its launch.
Per-request ``speculative: false`` caps that row's drafts at 0 (its step is a plain decode inside the block, or the
drafter-free plain program when no row of the step drafts). Its insert still prefills the drafter's context (one
insert program per prompt bucket; the drafter's share of a prefill is small), which it never reads.

Verify width per step: ``fixed`` verifies the drafter's whole block (W = G + 1; with ``num_speculative_tokens`` n,
vLLM's setting, its first n drafts: W = n + 1, the widest compiled); ``adaptive`` (``jdspark.adaptive``)
picks W from the compiled widths (default 1, 2, 4, n + 1) by the confidence head's survival curves of each row's
previous block and the step costs ``warm_up()`` measured; a step at width W decodes only the W - 1 drafts it
verifies (``speculative.draft_block``: the drafter's layers run the whole block, its vocabulary projection and
sequential head only those slots), which is what makes a narrow width cheaper than a whole block. A step holding
any ``fixed`` row runs at the widest; a step whose rows all speculate 0 drafts is a plain decode (W = 1), run without
the drafter when none of its rows ever drafts (their requests' caps are 0), and extending the drafter's context
otherwise (adaptive's plain steps).
"""

from __future__ import annotations

import collections
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.adaptive import CostTable, SurvivalTracker, expected_by_width, next_width, probe_interval, retime_extra
from jdspark.engine import SamplingRequest, StepOutput
from jdspark.graphs import split_module
from jdspark.logprobs import host_entries
from jdspark.prefix import PREFIX_MIN_TOKENS, PrefixPool, default_pool_rows, pool_like, snapshot, tree_bytes
from jdspark.sampling import Penalties, SamplingParams
from jdspark.serving_copy import serving_pair
from jdspark.slot_insert import Inserts
from jdspark.slot_programs import STOP_IDS, buckets_up_to, step_rows
from jdspark.slot_startup import StartUp
from jdspark.speculative import prefill_stream, verify_width
from jdspark.stop_strings import STOP_CLASSES, STOP_STATES
from kimi import dispatch
from kimi.prefill import chunked_positions

__all__ = ["SlotBackend", "buckets_up_to", "insert_batch_plan", "multi_step_plan", "prefill_slice_plan"]

# Adaptive verification re-times a width the scheduler has not picked at a batch bucket for this many of its steps
# (two steps at that width: only the second is timed, see SlotBackend.collect), or more where the re-timings of
# the widths not picked would together cost more than adaptive.PROBE_BUDGET of the steps (SlotBackend._stale,
# priced by adaptive.retime_extra): the cost table only learns from steps it runs, and warm_up's timing of a
# width can be off (this machine's load varies), which would otherwise keep that width out for good.
EXPLORE_EVERY = 64

# Multi-step launches (``multi_step`` > 1) at batch buckets up to this: at 4 rows a one-step launch cost 8.7 ms a
# token against 5.5 in 4-step launches on the shipped pair; at 16 adaptive verification lost with them (it plans
# once a launch), so larger buckets take one step a launch (docs/serving.md, "Multi-step scheduling").
MULTI_STEP_MAX_BATCH = 4
# ... and plain launches (width 1: ``--spec off``, adaptive's plain steps: no drafts to plan) at buckets up to this.
# In process, plain traffic served 1.22x at c = 8 and 1.11x at c = 16 in 4-step launches against one-step ones
# (docs/serving.md, "Plain steps of many rows").
MULTI_STEP_PLAIN_MAX_BATCH = 16

# ``prefill_slice_plan``: the server prefills a longer prompt at most this many tokens at a time, stepping the other
# streams between slices (vLLM's chunked prefill; its ``long_prefill_token_threshold``). On this CPU, 1800-token
# prompts arriving among 3 running streams: the streams' longest wait ~400 ms in one insert, ~150 in slices of 512,
# ~90 in slices of 256 (docs/serving.md, "Long prompts in slices"). 512 leaves the default buckets' prompts whole.
PREFILL_SLICE_TOKENS = 512

# token classes a slot's automaton may tell apart (``grammar.token_classes``; the shipped pair's json_object: 99,
# a 3-property schema 147; at most the vocabulary): the table a slot holds is guided_states x this + V int32
GUIDED_CLASSES = 512
# the server's automaton states a slot holds (``--guided-states``; SlotBackend's own default stays 0, off): the
# shipped pair's json_object 260, two free-form forced tools 393, a 3-property schema 57. Compiled in, a step costs
# what it did without (``scripts/bench_logprobs.py --feature guided --guided-states 1024``: 0.97-1.06x)
GUIDED_STATES = 1024


def multi_step_plan(platform: str) -> tuple:
    """The server's default (steps per launch, largest batch bucket launched so; 0: every bucket) on ``platform``
    (``jax.default_backend()``), and the largest bucket a plain launch (width 1) runs so (0: every bucket). The CPU: (4,
    MULTI_STEP_MAX_BATCH, MULTI_STEP_PLAIN_MAX_BATCH), from in-process A B B A runs (above). Elsewhere
    (a GPU): (8, every bucket). On the H200 a launch cost the host 1.2-1.5 ms whatever its size (XLA:GPU enqueues
    the program's kernels and reads each loop's predicate back from the caller's thread), so one-step launches were
    host-bound at every batch: 8-step launches measured 2.02 -> 0.61 ms a step at 1 row x width 1, 2.06 -> 0.85 at
    16 x 1 and 2.96 -> 1.59 at 16 x 8 (docs/h200/run4; docs/performance.md, "Where a served step's time goes on
    the H200")."""
    return (4, MULTI_STEP_MAX_BATCH, MULTI_STEP_PLAIN_MAX_BATCH) if platform == "cpu" else (8, 0, 0)


def prefill_slice_plan(prompt_buckets: Sequence[int], min_tokens: int = PREFIX_MIN_TOKENS) -> int:
    """The server's default ``slice_tokens``: the largest prompt bucket of ``min_tokens`` (the prefix cache's
    minimum) up to PREFILL_SLICE_TOKENS, else the smallest above them, else 0 (off). A prompt longer than it is
    prefilled that many tokens at a time between the other streams' steps, and a prompt longer than the largest
    bucket is served at all (docs/serving.md, "Long prompts in slices")."""
    ok = [b for b in sorted(prompt_buckets) if b >= min_tokens]
    fit = [b for b in ok if b <= PREFILL_SLICE_TOKENS]
    return fit[-1] if fit else (ok[0] if ok else 0)


def insert_batch_plan(platform: str) -> int:
    """The server's default ``insert_batch`` (requests admitted together whose prompts share a bucket prefill up to
    this many at a time, ``jdspark.slot_insert``) on ``platform``: 4. On this CPU, the shipped pair's inserts of 8
    held-out code prompts (bucket 128) cost 13.5 / 11.5 / 10.3 / 11.4 ms a prompt (median of 6 rounds) one / two /
    four / eight at a time (docs/serving.md, "Batched inserts"). Not measured off the CPU. Where the memory maps
    would not hold the group inserts' programs (a CPU server with 4 prompt buckets), start-up leaves them out
    (``SlotBackend.compile_all``)."""
    return 4


class SlotBackend(StartUp, Inserts):
    """``Backend`` of ``jdspark.engine`` over a target (and optional DSpark drafter)."""

    def __init__(self, target, drafter=None, *, num_slots: int = 4, max_len: int = 1024,
                 prompt_buckets: Sequence[int] = (64, 128, 256, 512), batch_buckets: Optional[Sequence[int]] = None,
                 seed: int = 0, adaptive: bool = False, widths: Optional[Sequence[int]] = None,
                 num_speculative_tokens: Optional[int] = None,
                 prefill_chunk: Optional[int] = None, multi_step: int = 1,
                 multi_step_max_batch: int = MULTI_STEP_MAX_BATCH,
                 multi_step_plain_max_batch: Optional[int] = None, prefix_pool: Optional[int] = 0,
                 prefix_min_tokens: int = PREFIX_MIN_TOKENS, prefix_answers: bool = True, prefix_split: bool = True,
                 max_logprobs: Optional[int] = None, penalties: bool = False, guided_states: int = 0,
                 guided_classes: int = GUIDED_CLASSES, stop_states: int = STOP_STATES,
                 stop_classes: int = STOP_CLASSES, insert_batch: int = 1, slice_tokens: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        if multi_step < 1 or multi_step_max_batch < 1:
            raise ValueError(f"multi_step, multi_step_max_batch: expected >= 1, got {multi_step}, "
                             f"{multi_step_max_batch}")
        # multi-step scheduling: up to ``multi_step`` steps per launch at batch buckets <= multi_step_max_batch
        # (where the host's round trip per step costs most), when the engine has no request waiting; plain launches
        # up to multi_step_plain_max_batch (default: the same)
        self.multi_step, self.multi_step_max_batch = int(multi_step), int(multi_step_max_batch)
        plain = multi_step_max_batch if multi_step_plain_max_batch is None else int(multi_step_plain_max_batch)
        if plain < self.multi_step_max_batch:  # a bucket whose wide launches run several steps runs its plain ones so
            raise ValueError(f"multi_step_plain_max_batch: expected >= multi_step_max_batch "
                             f"({self.multi_step_max_batch}), got {plain}")
        self.multi_step_plain_max_batch = plain
        self.target, self.drafter = serving_pair(target, drafter)
        self.source, self.cfg = target, target.config  # source: the loaded target (its vision tower encodes images)
        self.num_slots, self.max_len = int(num_slots), int(max_len)
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.G = drafter.config.block_size if drafter is not None else 0
        if self.prompt_buckets[-1] + self.G + 2 > self.max_len:
            raise ValueError(f"prompt_buckets: the largest ({self.prompt_buckets[-1]}) + a token + a block must fit "
                             f"max_len ({self.max_len})")
        self.batch_buckets = tuple(batch_buckets or buckets_up_to(self.num_slots))
        self.prefill_chunk = prefill_chunk  # issue 18: long prompt buckets prefill in chunks (kimi.dispatch)
        # requests admitted together: up to this many of one prompt bucket prefill as one batch (``insert_many``;
        # 1: each alone). The server's default: ``insert_batch_plan``
        if isinstance(insert_batch, bool) or not isinstance(insert_batch, int) or insert_batch < 1:
            raise ValueError(f"insert_batch: expected an int >= 1 (1: each prompt alone), got {insert_batch!r}")
        self.insert_batch = insert_batch
        self.insert_groups: collections.Counter = collections.Counter()  # prompts prefilled together -> groups
        for P in self.prompt_buckets:
            c = dispatch.prefill_chunk(P, prefill_chunk)
            if c is not None and chunked_positions(P, c) + self.G + 1 > self.max_len:
                raise ValueError(f"prefill_chunk: bucket {P} in chunks of {c} writes {chunked_positions(P, c)} "
                                 f"positions; with a block they exceed max_len ({self.max_len})")
        self.t_graph, self.t_state = split_module(self.target)
        self.d_graph, self.d_state = split_module(self.drafter) if self.drafter is not None else (None, None)
        # repetition penalties (``sampling.Penalties``) and the logit controls (logit_bias, min_tokens:
        # ``sampling.LogitControls``): False (the default), not compiled in (the rows carry no counts): compiled
        # in, a step whose rows do not penalise still paid 3-4% at W = G + 1 (b = 1 and 16,
        # docs/bench_penalties_default_pair.json), so a server offers them only when started with --penalties
        self.penalties = bool(penalties)
        # constrained decoding (``jdspark.grammar``): 0 (the default), not compiled in; Q, every slot carries an
        # automaton state and a table of up to Q states over up to C token classes (``grammar.token_classes``:
        # Q x C + V int32, C at most the vocabulary)
        if guided_states < 0 or guided_classes < 1:
            raise ValueError(f"guided_states, guided_classes: expected >= 0 (0: off) and >= 1, got {guided_states}, "
                             f"{guided_classes}")
        self.guided_states = int(guided_states)
        self.guided_classes = min(int(guided_classes), self.cfg.vocab_size)
        row, _ = jax.eval_shape(lambda: prefill_stream(
            self.target, self.drafter, jnp.zeros((1, self.prompt_buckets[0]), jnp.int32), jnp.int32(1),
            jax.random.key(0), SamplingParams(), self.max_len, penalties=Penalties() if self.penalties else None,
            controls=self._controls(), grammar=self._grammar()))
        # stop strings (``jdspark.stop_strings``): every slot carries an automaton state and a table of up to
        # stop_states states over stop_classes token classes (0: none), so a launch stops early at a stop string
        if stop_states < 0 or stop_classes < 2:
            raise ValueError(f"stop_states, stop_classes: expected >= 0 (0: off) and >= 2, got {stop_states}, "
                             f"{stop_classes}")
        self.stop_states, self.stop_classes = int(stop_states), int(stop_classes)
        if self.stop_states:
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
            row.stop_q, row.stop_next = i32(), i32(self.stop_states, self.stop_classes)
            row.stop_class = i32(self.cfg.vocab_size)
        self.state = jax.tree.map(lambda a: jnp.zeros((self.num_slots,) + a.shape, a.dtype), row)
        self.state.key = jax.random.split(jax.random.key(seed), self.num_slots)
        if self.stop_states:
            self.state.stop_q = jnp.full((self.num_slots,), -1, jnp.int32)
        self.stops_on_device = collections.Counter()  # requests with stop strings: "set" on the device, "too_large"
        # prefix caching (``jdspark.prefix``): the state after up to ``prefix_pool`` prompts, kept on the device
        # (None: as many as ``prefix.default_pool_rows`` allows for rows of this state's size; 0: off)
        if prefix_pool is None:
            prefix_pool = default_pool_rows(tree_bytes(self.state) // self.num_slots)
        self.prefix = PrefixPool(prefix_pool, prefix_min_tokens) if prefix_pool else None
        self.pool = pool_like(self.state, prefix_pool) if prefix_pool else None
        self.prefix_answers = bool(prefix_answers)  # keep finished answers while idle (``keep_answer``)
        # keep the beginning a prompt shares with a kept one on its own, where they part (``Inserts._split``)
        self.prefix_split = bool(prefix_split)
        self.splits = 0  # shared beginnings so kept
        # kept prompt + its next token -> (top, entries of its tokens and that one): the prompt log-probabilities a
        # request asking for them finds with a kept prompt (``Inserts._keep_entries``)
        self.kept_entries: dict = {}
        # long prompts in slices (``slot_slices.Slices.prefill_slice``): a prompt whose insert would prefill more
        # than this many tokens is prefilled this many at a time, into the prefix cache, the engine stepping the
        # other slots between slices (0: off; a prompt bucket; needs the prefix cache). The server's default:
        # ``prefill_slice_plan``
        slice_tokens = int(slice_tokens)
        if slice_tokens and (self.prefix is None or slice_tokens not in self.prompt_buckets
                             or slice_tokens < self.prefix.min_tokens):
            raise ValueError(f"slice_tokens: expected 0 (off) or one of the prompt buckets {self.prompt_buckets} "
                             f"of at least the prefix cache's minimum, with the prefix cache on (prefix_pool); got "
                             f"{slice_tokens} with " + ("no prefix cache" if self.prefix is None else
                                                        f"a minimum of {self.prefix.min_tokens}"))
        self.slice_tokens = slice_tokens
        # slot -> its ``slot_slices._Sliced`` record (what was kept before, its last slice, its prompt entries)
        self.sliced: dict = {}
        self.slices = 0  # slices prefilled (``prefill_slice``)
        self.answers_kept = 0  # answers prefilled while idle and kept (``idle_step``)
        # log-probabilities (``jdspark.logprobs``): None, not compiled in; N, up to N top entries a token
        if max_logprobs is not None and not 0 <= int(max_logprobs) <= self.cfg.vocab_size:
            raise ValueError(f"max_logprobs: expected None or 0..{self.cfg.vocab_size}, got {max_logprobs}")
        self.max_logprobs = None if max_logprobs is None else int(max_logprobs)
        # per slot: temperature, top_k, top_p, draft cap, top log-probabilities asked (-1: none), repetition,
        # frequency and presence penalties, whether it has logit controls, min_p, and up to STOP_IDS ids it ends at
        # (-1: none; its stop_token_ids, EOS among them unless it ignores EOS, where no min_tokens holds them back:
        # a multi-step launch stops once all its rows have committed one, ``slot_programs.step_rows``)
        self.params = np.zeros((self.num_slots, 10 + STOP_IDS), np.float64)
        self.free_all_params()
        # verify widths: adaptive needs the drafter's confidence head (its survival curves)
        self.adaptive = bool(adaptive) and self.drafter is not None and self.drafter.confidence_head is not None
        if adaptive and not self.adaptive:
            raise ValueError("adaptive verification needs a drafter with a confidence head")
        full = verify_width(self.drafter, num_speculative_tokens) or 1  # the widest step: a fixed row's
        if widths is None:
            widths = sorted({1, full} | ({w for w in (2, 4) if w < full} if self.adaptive else set()))
        self.widths = tuple(sorted(int(w) for w in widths))
        if self.drafter is not None and (self.widths[0] < 1 or self.widths[-1] != full):
            raise ValueError(f"widths: expected values in 1..{full} including {full}, got {self.widths}")
        self.modes = ["fixed"] * self.num_slots  # per slot: "fixed" | "adaptive"
        self.tracker = SurvivalTracker(self.num_slots, max(self.G, 1))
        self.costs: dict = {}  # (batch bucket, width) -> seconds per step, what the scheduler reads (monotone)
        self.inserts = [0] * self.num_slots  # prefills per slot: a step launched before one is stale for it
        self._last_done, self._last_key = 0.0, None  # the last collected step: when it ended, its (b, W)
        self._adaptive_steps: dict = {}  # batch bucket -> adaptive steps scheduled; (b, W) -> the step W last ran
        self._last_run: dict = {}
        self._explore: dict = {}  # batch bucket -> a width to run once more (a re-timing's second step)
        self.timings = CostTable()  # warm_up's times, then the steps served; ``costs`` is its table (a table set
        # from outside, without warm_up, stays as it was set)
        self.width_counts: collections.Counter = collections.Counter()  # steps served per verify width
        self.launch_steps: collections.Counter = collections.Counter()  # launches per steps-per-launch

    # ------------------------------------------------------------------ Backend
    def choose_width(self, slots: Sequence[int]) -> int:
        """The verify width of the next step of ``slots`` (see the module docstring)."""
        caps = self.params[list(slots), 3].astype(np.int64)
        if self.drafter is None or caps.max() == 0:
            return 1
        if not self.adaptive or any(self.modes[s] == "fixed" and c > 0 for s, c in zip(slots, caps)):
            return self.widths[-1]
        if not self.costs:
            raise RuntimeError("adaptive verification needs the step costs: call warm_up() first")
        b = self._bucket(len(slots))
        if self.timings:  # a width not run at this bucket for EXPLORE_EVERY steps is run twice, to re-time it
            self._adaptive_steps[b] = self._adaptive_steps.get(b, 0) + 1
            again = self._explore.pop(b, None)  # (the second step is the one timed: collect's steady state)
            if again is not None:
                return again
            stale = self._stale(b, slots, caps)
            if stale:
                self._explore[b] = stale[0]
                return stale[0]
        return next_width(self.tracker, slots, caps, b, self.widths, self.costs)

    def _stale(self, b: int, slots: Sequence[int], caps: np.ndarray) -> list:
        """The widths due a re-timing at bucket b: those not run for EXPLORE_EVERY of its steps, or longer for a
        width whose two steps cost more (``adaptive.retime_extra`` against what the scheduler would run for these
        slots now, the budget ``adaptive.PROBE_BUDGET`` shared by the widths re-timed: ``probe_interval``). A
        narrow width in place of a whole block costs the drafts it does not verify, which a price in time alone
        missed: under a flat table every narrower width was re-timed every EXPLORE_EVERY steps, 2.9% of the tokens
        in ``test_adaptive_re_times_a_width_it_has_not_run``, now within the budget."""
        idle = {w: self._adaptive_steps[b] - self._last_run.get((b, w), 0) for w in self.widths}
        due = [w for w in self.widths if idle[w] > EXPLORE_EVERY]
        if not due:  # the usual step: nothing to price
            return []
        curves = self.tracker.curve_SG[list(slots)]
        expected = expected_by_width(curves, caps, self.widths)
        costs = {w: self.costs[(b, w)] for w in self.widths}
        share = len(self.widths) - 1
        return [w for w in due if idle[w] > probe_interval(2 * share * retime_extra(expected, costs, w))]

    def ran(self, b: int, W: int) -> None:
        """Bookkeeping of a step launched at batch bucket b and width W (for ``EXPLORE_EVERY``)."""
        self._last_run[(b, W)] = self._adaptive_steps.get(b, 0)

    def _bucket(self, n: int) -> int:
        return next(x for x in self.batch_buckets if x >= n)

    def step(self, slots: Sequence[int], width: Optional[int] = None) -> dict:
        """One step of ``slots``, waited for: {slot: StepOutput}."""
        return {s: outs[0] for s, outs in self.collect(self.launch(slots, width)).items()}

    def steps_for(self, n: int) -> int:
        """The most steps a launch for ``n`` active slots runs (multi-step scheduling): ``multi_step`` at buckets up
        to ``multi_step_plain_max_batch``, else 1. ``launch`` runs one where its width is not multi-stepped there
        (``steps_at``); its handle says how many it runs."""
        return self.multi_step if self._bucket(n) <= self.multi_step_plain_max_batch else 1

    def steps_at(self, b: int, width: int) -> int:
        """Steps a launch of batch bucket ``b`` at verify width ``width`` runs when several are asked for: wide
        launches multi-step up to ``multi_step_max_batch``, plain ones (width 1) up to
        ``multi_step_plain_max_batch``."""
        top = self.multi_step_plain_max_batch if width == 1 else self.multi_step_max_batch
        return self.multi_step if b <= top else 1

    def launch(self, slots: Sequence[int], width: Optional[int] = None, steps: int = 1) -> dict:
        """Dispatch ``steps`` steps of ``slots`` without waiting for them (JAX runs them asynchronously): the engine
        commits the previous launch's tokens on the host while this one computes. Returns the handle ``collect``
        reads. ``steps`` > 1: the steps of one launch share one width (chosen from the curves known now, so still
        before any of their drafts are drawn); a width not multi-stepped at this bucket runs one step
        (``steps_at``), which the handle's ``steps`` says."""
        slots = list(slots)
        b = self._bucket(len(slots))
        steps = int(steps)
        if steps != 1 and (steps != self.multi_step or b > self.multi_step_plain_max_batch):
            raise ValueError(f"steps: {steps} per launch is compiled only as multi_step ({self.multi_step}) at "
                             f"batch buckets <= {self.multi_step_plain_max_batch}; got batch bucket {b}")
        # the largest bucket steps every slot in slot order (free slots too: their rows are reset on insert)
        all_slots = b == self.num_slots
        rows = np.arange(b, dtype=np.int32) if all_slots else np.array(slots + [slots[0]] * (b - len(slots)),
                                                                            np.int32)
        W = self.choose_width(slots) if width is None else (1 if self.drafter is None else int(width))
        steps = min(steps, self.steps_at(b, W))
        launched = time.perf_counter()
        args, kw = self._step_args(rows, W, steps)
        extend, tops = kw["extend_context"], [int(self.params[s, 4]) for s in slots]
        self.state, out = step_rows(*args, **kw)
        self.width_counts[W] += steps
        self.launch_steps[steps] += 1
        self.ran(b, W)
        return {"out": out, "slots": slots, "b": b, "W": W, "all_slots": all_slots, "launched": launched,
                "steps": steps, "extend": extend,
                # the cost table is of steps that keep the drafter's context (adaptive schedules drafting rows)
                # and compute no log-probabilities
                "timed": width is None and extend and max(tops) < 0, "tops": tops,
                "inserts": [self.inserts[s] for s in slots], "prefills": sum(self.inserts)}

    def _step_args(self, rows: np.ndarray, W: int, steps: int, caps: Optional[np.ndarray] = None) -> tuple:
        """``step_rows``' arguments for the rows ``rows`` (slot indices, a whole batch bucket) at width W (draft caps
        ``caps``, default the rows' own): the one place a launch and the ahead-of-time compile of ``warm_up`` build
        them, so both name the same program."""
        caps = self.params[rows, 3] if caps is None else caps
        # rows that never draft (cap 0: ``speculative: false``, free slots) need no drafter context: a plain step of
        # only such rows runs without the drafter (``--spec off`` traffic pays no drafter work)
        extend = self.drafter is not None and (W > 1 or bool(caps.max() > 0))
        host_bC = np.column_stack([rows, self.params[rows, 1], self.params[rows, 0], self.params[rows, 2],
                                   caps, self.params[rows, 4] >= 0, self.params[rows, 5:]]).astype(np.float32)
        # (slot_programs.HOST_COLUMNS)
        return ((self.t_graph, self.d_graph, self.t_state, self.d_state, self.state, host_bC),
                dict(width=W, confidence=self.adaptive and W > 1, all_slots=len(rows) == self.num_slots,
                     steps=int(steps), extend_context=extend, logprobs=self.max_logprobs,
                     penalties=self.penalties))

    def collect(self, h: dict) -> dict:
        """Wait for a launch and return {slot: [StepOutput per step, in order]}. A slot prefilled again since the
        launch (its request ended and another took it) still gets its rows, which the engine drops; the scheduler
        ignores them. A launch whose rows had all ended (at EOS or a stop id) stopped early (``step_rows``): the
        steps it did not run (n_new 0) are in no slot's list."""
        out = h["out"]
        new, n_new, drafted, accepted, surv = jax.device_get((out.new_K, out.n_new, out.drafted, out.accepted,
                                                               out.survival))
        done = time.perf_counter()
        b, W, k_steps = h["b"], h["W"], h["steps"]
        n_new = np.asarray(n_new).reshape(k_steps, -1)
        ran = int((n_new > 0).any(axis=1).sum())  # steps run: every run step commits >= 1 token a row
        key, last = (b, W), (b, W, h["extend"])
        # serving: the table warm_up measured follows the steps served, in steady state only. Pipelined, a step's
        # time (from the previous one's end to its own) also holds the host's commit of the previous step's tokens,
        # so it is timed only after a step of the same (b, W) (a plain step after a whole block would carry the
        # block's commit), and not when it shared the device with a prefill (an insert between launch and now)
        if (h["timed"] and key in self.timings and h["prefills"] == sum(self.inserts)
                and self._last_key == last and ran == k_steps):
            self.timings.observe(key, (done - max(h["launched"], self._last_done)) / k_steps, served=True)
            self.costs = self.timings.table
        self._last_done, self._last_key = done, last
        new = np.asarray(new).reshape(k_steps, b, -1)
        drafted, accepted = (np.asarray(x).reshape(k_steps, -1) for x in (drafted, accepted))
        surv = None if surv is None else np.asarray(surv).reshape(k_steps, b, -1)
        lp = None
        if max(h["tops"]) >= 0:  # some row asked: its tokens' log-probabilities (``jdspark.logprobs``)
            lp = [np.asarray(x).reshape(k_steps, b, *x.shape[2:]) for x in jax.device_get(
                (out.logprobs.chosen_K, out.logprobs.top_ids_KL, out.logprobs.top_KL))]
        res = {}
        for j, (s, ins, top) in enumerate(zip(h["slots"], h["inserts"], h["tops"])):
            i = s if h["all_slots"] else j
            res[s] = []
            for t in range(ran):
                k = int(n_new[t, i])
                entries = None if top < 0 else host_entries(*(x[t, i] for x in lp), k, top)
                res[s].append(StepOutput(new[t, i, :k].tolist(), drafted=int(drafted[t, i]),
                                         accepted=int(accepted[t, i]), verified=W, logprobs=entries))
                if self.params[s, 3] > 0 and ins == self.inserts[s]:
                    if surv is not None:
                        self.tracker.observe(s, surv[t, i], int(drafted[t, i]), int(accepted[t, i]))
                    else:
                        self.tracker.stepped_plain(s)
        return res

    def program_caps(self, width: int) -> tuple:
        """A draft cap for each compiled program of ``width``: width 1 has two with a drafter, rows that never draft
        (cap 0: no drafter work) and rows that draft on other steps (cap G: the drafter's context extended);
        wider ones one (cap G)."""
        if width > 1:
            return (self.G,)
        return (0, self.G) if self.drafter is not None else (0,)

    def free(self, slot: int) -> None:
        self.params[slot] = (0.0, 0, 1.0, 0, -1, 1.0, 0.0, 0.0, 0.0, 0.0, *[-1] * STOP_IDS)
        self._unslice(slot)  # a request cancelled between its prompt's slices

    def free_all_params(self) -> None:
        """Every slot's per-row parameters as a free slot's (greedy, no drafts, no log-probabilities or penalties)."""
        for s in range(self.num_slots):
            self.free(s)

    # ------------------------------------------------------------------ answers kept while idle (``jdspark.prefix``)
    def keep_answer(self, req: SamplingRequest, answer_ids: Sequence[int]) -> None:
        """A finished request's answer (the ids its client saw): its prompt + answer is kept when the engine is
        idle (``idle_step``), for the conversation's next turn."""
        if self.prefix is not None and self.prefix_answers and req.images is None and len(answer_ids):
            self.prefix.remember(tuple(req.prompt_ids) + tuple(answer_ids))

    def idle_pending(self) -> bool:
        return self.prefix is not None and bool(self.prefix.pending)

    def idle_step(self) -> None:
        """One remembered answer (or a chunk of one) prefilled on its kept prompt into slot 0 and kept in the pool.
        The engine calls it only while every slot is free; it runs the extension and copy programs warm-up
        compiled (the first token is drawn greedily and dropped) and returns when they are done."""
        plan = self.prefix.next_pending(self._idle_chunk)
        if plan is None:
            return
        row, kept, ids = plan
        n = len(ids) - kept
        self._extend(0, row, self._padded(ids[kept:]), n, 0)
        new = self.prefix.store(ids, answer=True)
        if new is not None:
            self.pool = snapshot(self.pool, self.state, np.int32(0), np.int32(new))
            self.answers_kept += 1
        jax.block_until_ready((self.state, self.pool))  # one unit at a time: a request arriving waits for it alone

    def _idle_chunk(self, kept: int, total: int) -> Optional[int]:
        """Tokens one extension takes of the total - kept after a kept prompt: all where a bucket holds them and
        fits the cache after the kept ones, else as many as the largest such bucket (None: none fits)."""
        fit = [b for b in self.prompt_buckets if kept + b <= self.max_len]
        return min(total - kept, fit[-1]) if fit else None
