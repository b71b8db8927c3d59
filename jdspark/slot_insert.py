"""The serving slots' inserts: a request's prompt prefilled into a free slot (``SlotBackend.insert``), several
admitted together prefilled as one batch (``insert_many``); what runs in the prefix cache before an insert (a long
prompt's slices, a shared beginning kept, kept prompt log-probabilities) is ``jdspark.slot_slices``.

A mixin of ``jdspark.slots.SlotBackend`` (split from it by concern: what a request's admission runs, not its steps).
An insert is three parts: ``_prepare`` (every check and the slot's host bookkeeping; a bad request raises
ValueError before the slot changes), the device program (``slot_programs.insert_row``, a prefix-cache hit's
``prefix.extend``, or ``slot_programs.insert_rows`` for a group), and ``_finish_insert`` (the request's stop strings,
the prefix cache's copy of the prompt, the first token's log-probabilities).

Batched inserts: requests admitted at once whose inserts are one pass of the same prompt bucket (no prefix-cache
hit, no images, no prompt log-probabilities, no chunks) prefill ``insert_batch`` at a time: their matmuls read the
weights once for the group (the shipped pair on this CPU, 128-token prompts: 13.5 ms a prompt alone, 11.5 two at
a time, 10.3 four at a time; docs/serving.md, "Batched inserts"). The server's default: ``slots.insert_batch_plan``.
A row prefilled in a group equals its prefill alone up to float rounding, not bit for bit (XLA:CPU compiles the two
programs' sums differently), as a row stepped among others does (docs/serving.md, "Greedy outputs under batching").

"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.engine import SamplingRequest, StepOutput
from jdspark.logprobs import host_entries
from jdspark.prefix import extend, snapshot
from jdspark.slot_inputs import controls_input, first_token_input, grammar_input
from jdspark.slot_programs import SAMPLING_OFF, STOP_IDS, buckets_up_to, insert_row, insert_rows
from jdspark.slot_slices import Slices, _prompt_entries
from jdspark.stop_strings import set_stops
from kimi import dispatch

__all__ = ["Inserts"]


def _scalars(samp) -> tuple:
    """(temperature, top_k, top_p, min_p) as the NumPy scalars the insert programs take (converted by the call
    itself: a ``jnp`` scalar is a device dispatch of its own)."""
    t, k, p, m = samp
    return np.float32(t), np.int32(k), np.float32(p), np.float32(m)


@dataclasses.dataclass
class _Insert:
    """A request checked and its slot's host bookkeeping done (``Inserts._prepare``): what its device program takes."""
    slot: int
    req: SamplingRequest
    n: int  # prompt tokens
    cached: int  # of them kept by the prefix cache (a hit), not prefilled
    hit: Optional[tuple]  # (pool row, kept tokens) or None
    P: int  # the prompt bucket of the tokens prefilled
    padded: np.ndarray  # int32 [1, P]
    media: Optional[jax.Array]
    chunk: Optional[int]
    top: int  # the first token's top log-probabilities asked (-1: none)
    ptop: int  # the prompt's (-1: none)
    keep: bool  # the prefix cache keeps this prompt after its insert
    samp: tuple
    pen: tuple
    controls: object
    grammar: object
    first_V: np.ndarray
    mode: str  # "fixed" | "adaptive"
    cap: int  # drafts a step (0: it never drafts)

    @property
    def batchable(self) -> bool:
        """One pass of a text prompt with nothing per row that ``insert_rows`` does not take."""
        return self.hit is None and self.media is None and self.chunk is None and self.ptop < 0


class Inserts(Slices):
    """``insert``, ``insert_many`` and their helpers of ``SlotBackend``."""

    def prompt_bucket(self, n: int) -> int:
        for b in self.prompt_buckets:
            if n <= b:
                return b
        raise ValueError(f"prompt of {n} tokens exceeds the largest prompt bucket ({self.prompt_buckets[-1]})")

    def extension_bucket(self, kept: int, n: int) -> Optional[int]:
        """The prompt bucket that prefills tokens kept .. n - 1 on a kept prompt of ``kept`` tokens (its padded
        chunk must fit the cache after them), or None."""
        E = next((b for b in self.prompt_buckets if b >= n - kept), None)
        return E if E is not None and kept + E <= self.max_len else None

    def _padded(self, ids) -> np.ndarray:
        """``ids`` right-padded into their prompt bucket: int32 [1, P] (what the insert and extension programs
        take)."""
        padded = np.full((1, self.prompt_bucket(len(ids))), self.cfg.pad_token_id, np.int32)
        padded[0, :len(ids)] = ids
        return padded

    def insert(self, slot: int, req: SamplingRequest) -> StepOutput:
        try:
            self._split(slot, req)
            prep = self._prepare(slot, req)
        except ValueError:
            self._unslice(slot)
            raise
        self._book(prep)
        return self._finish_insert(prep, *self._run_one(prep))

    def insert_many(self, pairs: Sequence[tuple]):
        """Insert each (slot, request) of ``pairs`` (distinct free slots), yielding (its index in ``pairs``, its
        ``StepOutput`` or the ValueError that refused it: that request alone, its slot left as it was) as each is
        done, so the engine sends a first token as soon as it has it. Inserts a batch can take
        (``_Insert.batchable``) wait for partners of their prompt bucket and prefill ``insert_batch`` at a time
        (what is left of a bucket at the end in the compiled ``group_sizes``); the rest run at once. A request
        whose prompt shares the prefix cache's minimum with a waiting one lets that one run first, so it finds that
        prompt kept, as one at a time."""
        waiting: dict = {}  # prompt bucket -> [(index, _Insert)] waiting for partners

        def run(group):
            while group:  # in compiled group sizes, the largest first (3 of at most 4: 2, then 1 alone)
                k = max([1] + [g for g in self.group_sizes() if g <= len(group)])
                part, group = group[:k], group[k:]
                if k == 1:
                    i, prep = part[0]
                    yield i, self._finish_insert(prep, *self._run_one(prep))
                    continue
                firsts, lps = self._run_rows([p for _, p in part])
                for j, (i, prep) in enumerate(part):
                    yield i, self._finish_insert(prep, firsts[j], None if lps is None else lps[j], None)

        for i, (slot, req) in enumerate(pairs):
            if self.prefix is not None and any(self._shares_prefix(req, p.req) for g in waiting.values() for _, p in g):
                for P in list(waiting):
                    yield from run(waiting.pop(P))
            try:
                self._split(slot, req)
                prep = self._prepare(slot, req)
            except ValueError as e:
                self._unslice(slot)
                yield i, e
                continue
            self._book(prep)
            if self.insert_batch > 1 and prep.batchable:
                group = waiting.setdefault(prep.P, [])
                group.append((i, prep))
                if len(group) == self.insert_batch:
                    yield from run(waiting.pop(prep.P))
            else:
                yield from run([(i, prep)])
        for group in waiting.values():
            yield from run(group)

    def group_sizes(self) -> tuple:
        """The group sizes ``insert_rows`` is compiled for (each one program per prompt bucket): powers of two up to
        ``insert_batch`` and ``insert_batch`` itself (at most the slots), none when it is 1. A group of another
        size runs as the largest of them that fit, then the rest: a size not compiled at start-up would compile
        while requests wait (a group of 3 under 4 cost seconds of TTFT before this)."""
        k = min(self.insert_batch, self.num_slots)
        return buckets_up_to(k, 2) if k > 1 else ()

    def _shares_prefix(self, a: SamplingRequest, b: SamplingRequest) -> bool:
        """Whether ``a``'s prompt could find ``b``'s kept: the two begin with the same prefix cache minimum."""
        m = self.prefix.min_tokens
        return len(a.prompt_ids) > m and len(b.prompt_ids) >= m and tuple(a.prompt_ids[:m]) == tuple(b.prompt_ids[:m])

    def _prepare(self, slot: int, req: SamplingRequest) -> _Insert:
        """Every check of ``req`` (ValueError naming what is wrong; the slot as it was) and what its insert program
        takes; no bookkeeping (``_book``)."""
        n = len(req.prompt_ids)
        mode, top, ptop = self._check(req)
        keep = self._keeps(req)
        # a prompt prefilled in slices was counted by the prefix cache at its first (``prefill_slice``); one whose
        # prompt log-probabilities are asked extends its own last slice only (the kept tokens' entries are the
        # slices'), else it is prefilled whole (a hit would skip the kept tokens' entries)
        fits = (lambda m: self.extension_bucket(m, n) is not None)
        rec = self.sliced.get(slot)
        if ptop >= 0:
            last = None if rec is None else rec.last
            hit = None if last is None or not keep else self.prefix.lookup(
                req.prompt_ids, lambda m: m == len(last) and fits(m), count=False)
        else:
            hit = self.prefix.lookup(req.prompt_ids, fits, count=rec is None) if keep else None
        cached = hit[1] if hit is not None else 0
        if hit is None and n > self.prompt_buckets[-1]:
            raise ValueError(f"prompt of {n} tokens exceeds the largest prompt bucket ({self.prompt_buckets[-1]})"
                             + (" and begins with no prompt the prefix cache keeps" if keep and ptop < 0 else "")
                             + ("; prefilled in slices it would be served (the server's --prefill-slice)"
                                if keep and not self.slice_tokens else ""))
        P = self.prompt_bucket(n - cached)  # a hit prefills only the tokens after the kept prompt
        # (a multi-step launch may step a row past its request's end: those positions are written only after the
        # request has all its tokens, clamped into the row's own cache, and the row is reset on its next insert)
        padded = self._padded(req.prompt_ids[cached:])
        media = self._media(req, P)  # before the slot's bookkeeping changes: bad images leave the slot as it was
        cap = self.G if req.speculative else 0
        # an image prompt is prefilled in one pass (chunked prefill with images is not built); its bucket bounds it
        chunk = None if media is not None else dispatch.prefill_chunk(P, self.prefill_chunk)
        top_k = min(int(req.top_k), self.cfg.vocab_size)  # k >= V keeps every token (as 0 does); int32 / float32 exact
        pen = (req.repetition_penalty, req.frequency_penalty, req.presence_penalty)
        controls = self._controls(req)  # before the slot's bookkeeping changes: a bad bias leaves the slot as it was
        grammar = self._grammar(req)
        first_V = self._first(req)
        samp = (req.temperature, top_k, req.top_p, req.min_p)
        return _Insert(slot, req, n, cached, hit, P, padded, media, chunk, top, ptop, keep, samp, pen, controls,
                       grammar, first_V, mode, cap)

    def _check(self, req: SamplingRequest) -> tuple:
        """The checks of ``req`` that do not depend on its slot or the prefix cache (ValueError naming what is wrong):
        (its mode, its first token's top log-probabilities asked, its prompt's; -1: none)."""
        n = len(req.prompt_ids)
        if n + req.max_tokens + self.G + 1 > self.max_len:
            raise ValueError(f"prompt ({n}) + max_tokens ({req.max_tokens}) + a block ({self.G + 1}) exceed the "
                             f"slots' cache of {self.max_len} positions")
        mode = req.spec_mode or ("adaptive" if self.adaptive else "fixed")
        if mode not in ("fixed", "adaptive"):
            raise ValueError(f"spec_mode: expected 'fixed' or 'adaptive', got {mode!r}")
        if mode == "adaptive" and not self.adaptive:
            raise ValueError("spec_mode 'adaptive': this backend was built without adaptive verification")
        top, ptop = (-1 if x is None else int(x) for x in (req.logprobs, req.prompt_logprobs))
        if max(top, ptop) > (-1 if self.max_logprobs is None else self.max_logprobs):
            raise ValueError(f"logprobs: {max(top, ptop)} top entries asked; this backend serves "
                             + ("none" if self.max_logprobs is None else f"at most {self.max_logprobs}"))
        if not 0.0 <= req.min_p <= 1.0:
            raise ValueError(f"min_p: expected in [0, 1] (0: off), got {req.min_p}")
        pen = (req.repetition_penalty, req.frequency_penalty, req.presence_penalty)
        if (pen != (1.0, 0.0, 0.0) or req.has_controls) and not self.penalties:
            raise ValueError("repetition / frequency / presence penalties, logit_bias, min_tokens, allowed_token_ids: "
                             "this backend was "
                             "built without them (SlotBackend(penalties=True); the server's --penalties)")
        return mode, top, ptop

    def _keeps(self, req: SamplingRequest) -> bool:
        """Whether the prefix cache may serve and keep ``req``'s prompt: text prompts (a constrained one too: an
        extension installs the request's own automaton, ``speculative.extend_stream``)."""
        return self.prefix is not None and req.images is None

    def _book(self, prep: _Insert) -> None:
        """The slot's host bookkeeping for ``prep``'s request (sampling parameters, mode, survival tracker, insert
        count), once it is sure to be inserted."""
        req, slot = prep.req, prep.slot
        stops = list(req.stop_token_ids)[:STOP_IDS] if not req.min_tokens else []  # more: the launch runs them all
        t, top_k, top_p, min_p = prep.samp
        self.params[slot] = (t, top_k, top_p, prep.cap, prep.top, *prep.pen, req.has_controls, min_p,
                             *stops, *[-1] * (STOP_IDS - len(stops)))
        self.modes[slot] = prep.mode
        self.tracker.reset(slot)
        self.inserts[slot] += 1

    def _run_one(self, prep: _Insert) -> tuple:
        """``prep``'s own device program: (first token, its log-probabilities, the prompt's) (None where not asked)."""
        if prep.hit is None:
            first, lp = self._prefill(prep.slot, prep.padded, prep.n, prep.req.seed, prep.samp, prep.media, prep.chunk,
                                      prep.ptop >= 0, prep.pen, prep.controls, prep.grammar, prep.first_V)
        else:
            first, lp = self._extend(prep.slot, prep.hit[0], prep.padded, prep.n - prep.cached, prep.req.seed,
                                     prep.samp, prep.pen, prep.controls, prep.first_V, prep.grammar, prep.ptop >= 0)
        lp_first = lp_prompt = None
        if max(prep.top, prep.ptop) >= 0:
            lp_first, lp_prompt = jax.device_get(lp)
        return int(np.asarray(first)[0]), lp_first, lp_prompt

    def _run_rows(self, preps: Sequence[_Insert]) -> tuple:
        """One ``insert_rows`` of ``preps`` (one prompt bucket): (first tokens, each row's first-token
        log-probabilities or None)."""
        args, kw = self._rows_args(preps)
        self.state, first_k1, *lp = insert_rows(*args, **kw)
        self.insert_groups[len(preps)] += 1
        firsts = [int(t) for t in np.asarray(first_k1)[:, 0]]
        if not lp or max(p.top for p in preps) < 0:
            return firsts, None
        lp_k = jax.device_get(lp[0])
        return firsts, [jax.tree.map(lambda x, j=j: x[j], lp_k) for j in range(len(preps))]

    def _rows_args(self, preps: Sequence[_Insert]) -> tuple:
        """``insert_rows``' arguments (one place for a group's insert and the ahead-of-time compile of it)."""
        def stack(xs):  # per-row inputs (None where the programs carry none) with a leading k axis
            return None if xs[0] is None else jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *xs)

        t, top_k, top_p, min_p = zip(*(p.samp for p in preps))
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(p.req.seed))) for p in preps])
        return ((self.t_graph, self.d_graph, self.t_state, self.d_state, self.state,
                 np.asarray([p.slot for p in preps], np.int32), np.concatenate([p.padded for p in preps]),
                 np.asarray([p.n - p.cached for p in preps], np.int32), keys, np.asarray(t, np.float32),
                 np.asarray(top_k, np.int32), np.asarray(top_p, np.float32), np.asarray(min_p, np.float32),
                 np.asarray([p.pen for p in preps], np.float32), stack([p.controls for p in preps]),
                 stack([p.grammar for p in preps]), np.stack([p.first_V for p in preps])),
                dict(max_len=self.max_len, logprobs=self.max_logprobs, penalties=self.penalties))

    def _finish_insert(self, prep: _Insert, first: int, lp_first, lp_prompt) -> StepOutput:
        """After ``prep``'s program: its stop strings on the device, the prefix cache's copy of its prompt, its
        first token's (and prompt's) log-probabilities as the engine reads them."""
        slot, req, n = prep.slot, prep.req, prep.n
        rec = self._unslice(slot) if slot in self.sliced else None
        cached = prep.cached if rec is None else rec.before  # sliced: what was kept before its slices
        self._set_stops(slot, req)
        row = self.prefix.store(req.prompt_ids) if prep.keep else None
        if row is not None:  # the state after this prompt, for the prompts that will begin with it
            self.pool = snapshot(self.pool, self.state, np.int32(slot), np.int32(row))
        entries = prompt = None
        if prep.top >= 0:
            entries = host_entries(lp_first.chosen_K, lp_first.top_ids_KL, lp_first.top_KL, 1, prep.top)
        if prep.ptop >= 0:  # tokens 0 .. kept's from its slices (the first has none), then the rest's
            before = [None] if rec is None else rec.entries[:prep.cached + 1]
            prompt = before + _prompt_entries(lp_prompt, n - 1 - prep.cached, prep.ptop)  # with their ranks
        return StepOutput([first], cached=cached, logprobs=entries, prompt_logprobs=prompt)

    def _set_stops(self, slot: int, req: SamplingRequest) -> None:
        """The request's stop strings on the device (after its insert, which leaves the slot with none), where its
        automaton (``SamplingRequest.stop_fsm``: the engine's, none under min_tokens) fits the slot's tables."""
        if req.stop_fsm is None or not self.stop_states or req.min_tokens:
            return
        tables = req.stop_fsm.device_tables(self.stop_states, self.stop_classes, self.cfg.vocab_size)
        self.stops_on_device["set" if tables is not None else "too_large"] += 1
        if tables is not None:
            self.state = set_stops(self.state, np.int32(slot), *tables)

    def _controls(self, req: Optional[SamplingRequest] = None):
        return controls_input(self.cfg.vocab_size, req, self.penalties)  # (``jdspark.slot_inputs``)

    def _grammar(self, req: Optional[SamplingRequest] = None):
        return grammar_input(self.cfg.vocab_size, self.guided_states, self.guided_classes, req)

    def _first(self, req: Optional[SamplingRequest] = None):
        return first_token_input(self.cfg.vocab_size, req)

    def _extend(self, slot: int, row: int, padded_1E, n: int, seed: int, samp=SAMPLING_OFF,
                penalties=(1.0, 0.0, 0.0), controls=None, first_V=None, grammar=None, prompt_logprobs: bool = False,
                next_token: int = -1):
        """Prefill the first ``n`` tokens of ``padded_1E`` on the kept prompt in pool row ``row``, into ``slot``
        (the state donated and replaced): (the first token [1], (its ``TokenLogprobs``, the extension's prompt
        entries where asked) where they are served, else None)."""
        self.state, first, *lp = extend(*self._extend_args(slot, row, padded_1E, n, seed, samp, penalties, controls,
                                                           first_V, grammar, prompt_logprobs, next_token),
                                        **self._extend_kw())
        return first, (lp[0] if lp else None)

    def _extend_kw(self) -> dict:
        return dict(logprobs=self.max_logprobs, penalties=self.penalties)

    def _extend_args(self, slot: int, row: int, padded_1E, n: int, seed: int, samp=SAMPLING_OFF,
                     penalties=(1.0, 0.0, 0.0), controls=None, first_V=None, grammar=None,
                     prompt_logprobs: bool = False, next_token: int = -1) -> tuple:
        """``prefix.extend``'s arguments (one place for an insert and the ahead-of-time compile)."""
        return (self.t_graph, self.d_graph, self.t_state, self.d_state, self.state, self.pool, np.int32(slot),
                np.int32(row), np.asarray(padded_1E, np.int32), np.int32(n), jax.random.key(seed), *_scalars(samp),
                np.asarray(penalties, np.float32),
                self._controls() if controls is None else controls, self._first() if first_V is None else first_V,
                self._grammar() if grammar is None else grammar, *self._prompt_args(prompt_logprobs, next_token))

    def _prompt_args(self, prompt_logprobs: bool, next_token: int) -> tuple:
        """The insert and extension programs' (want_prompt, next_token): whether the prompt's log-probabilities are
        computed, and the token after the prefilled ones (-1: none); (None, None) where none are served."""
        if self.max_logprobs is None:
            return None, None
        return np.bool_(prompt_logprobs), np.int32(next_token)

    def _prefill(self, slot: int, padded_1P, n: int, seed: int, samp, media_PD, chunk, prompt_logprobs: bool = False,
                 penalties=(1.0, 0.0, 0.0), controls=None, grammar=None, first_V=None, next_token: int = -1):
        """Run the compiled insert into ``slot`` (the state donated and replaced); the first token [1]. The scalars
        go in as NumPy values, converted by the call itself (a ``jnp`` scalar is a device dispatch of its own,
        ~45 us each here). Returns as ``_extend`` (with the prompt's log-probabilities where asked)."""
        args, kw = self._insert_args(slot, padded_1P, n, seed, samp, media_PD, chunk, prompt_logprobs, penalties,
                                     controls, grammar, first_V, next_token)
        self.state, first, *lp = insert_row(*args, **kw)
        return first, (lp[0] if lp else None)

    def _insert_args(self, slot: int, padded_1P, n: int, seed: int, samp, media_PD, chunk,
                     prompt_logprobs: bool = False, penalties=(1.0, 0.0, 0.0), controls=None,
                     grammar=None, first_V=None, next_token: int = -1) -> tuple:
        """``insert_row``'s arguments (one place for a prefill and ``warm_up``'s ahead-of-time compile of it)."""
        want, after = self._prompt_args(prompt_logprobs, next_token)
        return ((self.t_graph, self.d_graph, self.t_state, self.d_state, self.state, np.int32(slot),
                 np.asarray(padded_1P, np.int32), np.int32(n), jax.random.key(seed), *_scalars(samp),
                 np.asarray(penalties, np.float32), media_PD, want,
                 self._controls() if controls is None else controls,
                 self._grammar() if grammar is None else grammar, self._first() if first_V is None else first_V,
                 after),
                dict(max_len=self.max_len, chunk=chunk, logprobs=self.max_logprobs, penalties=self.penalties))

    def _media(self, req: SamplingRequest, P: int):
        """The request's image features padded to [P, D] (rows past its M placeholders unused), or None for a
        text prompt. Encoded by the checkpoint's own target (fp32, as ``jdspark.generate(images=...)``): the
        vision tower compiles once per distinct image grid, outside the slots' programs."""
        if req.images is None:
            return None
        if self.cfg.vision is None:
            raise ValueError("images: this checkpoint is text-only (its config has no vision_config)")
        feats = np.asarray(self.source.image_features(np.asarray(req.prompt_ids), req.images), np.float32)
        out = np.zeros((P, feats.shape[1]), np.float32)
        out[:feats.shape[0]] = feats
        return jnp.asarray(out)

