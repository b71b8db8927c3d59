"""Every backend- or size-dependent choice of code path, in one place: layers and ops ask here, none decides itself.

Each threshold is a named constant with its reason in one line; the measurements behind them, with the commands that
reproduce them (``scripts/bench_dispatch.py``, ``scripts/bench.py``), are in ``docs/performance.md``. The choices
never change results beyond float summation order (and bf16 rounding where the serving copy asks for bf16): every
path has a test against its reference.

  KDA prefill     kda_prefill_form     chunked (WY) on accelerators, token scan on CPU
  KDA verify      kda_verify_form      closed-form block up to KDA_BLOCK_MAX_TOKENS, else the scan; the scan on
                                       KDA_VERIFY_SCAN_BACKENDS (the CPU) up to KDA_VERIFY_SCAN_MAX_ROWS token rows
                                       (a batch-1 block: each position the decode step's own arithmetic, its
                                       logits bit-equal to decode's at 79% of positions); kda_verify_form_as
  Pallas or XLA   kda_uses_pallas      the fused KDA step for decode / verify when KimiConfig.kernels == "pallas"
                  moe_uses_pallas      the MXFP4 expert kernels when kernels == "pallas" on packed experts
                  pallas_interpret     interpret mode on CPU, compiled (Triton) elsewhere
  MoE path        moe_path             gathered / used / all / all_or_used / blocked / grouped
                  USED_UNROLL_MAX_EXPERTS, USED_LOOP_MAX_FRACTION (the serving copy's per-expert loop);
                  MOE_ALL_OVER_BLOCKED, MOE_ALL_OVER_GATHERED (the serving copy's 'all' for many rows, mapped rows)
  serving copy    serving_copy         a generation serves small models from a rearranged copy of the weights
  bf16 matvec     bf16_rows            a single bf16 row is padded to BF16_ROWS_MIN rows (mapped rows: their share)
  prefill         prefill_chunk        one pass up to a bound, else chunks (prefill_limits: 1664 / 256 on CPU)
  MLA prefill     mla_key_tile         whole-cache scores up to MLA_TILED_MIN_KEYS keys, else key tiles of MLA_KEY_TILE,
                                       absorbed on CPU (MLA_PREFILL_TILED_FORM), unabsorbed elsewhere
  MLA decode      mla_absorbed_key_tile  decode and verify on CPU over more than MLA_ABSORBED_TILED_MIN_KEYS keys:
                                       equal key tiles of at most MLA_ABSORBED_KEY_TILE; else one whole-cache pass
  run-time skips  runtime_skips        lax.cond that skips MoE experts only where RUNTIME_SKIP_BACKENDS says it
                                       pays (the CPU); elsewhere compute and select
  sampling        sampling_form        top-k / top-p / draws by bisection, a top-64 fast path and conds on CPU
                                       ("bisect"), by one sort and full-vocabulary Gumbel-max elsewhere ("sort");
                                       sampling_form_as(form) to trace either on any backend
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp

# --------------------------------------------------------------------------------------------------- KDA
# Verify blocks of up to this many tokens use the closed-form block (a few small matmuls, no loop, the state after
# any prefix rebuilt on demand): faster than the scan for a DSpark block; its T x T matrices grow with T.
KDA_BLOCK_MAX_TOKENS = 16
# ... except a verify of at most KDA_VERIFY_SCAN_MAX_ROWS token rows (all rows of a batch, mapped ones included) on
# these backends, which scans its tokens: on the 2-core CPU a batch-1 block of 8 costs the same either way (verify +
# rollback, 25 interleaved rounds: 3.55 / 3.83 ms min / median against the block's 3.54 / 3.87), and each position
# is then the decode step's own arithmetic, so a verify rounds as plain decoding does: its logits equal 8 decode
# steps' bit for bit at 79% of positions against 68%, and greedy DSpark left plain decoding on 2 of 24 bench prompts
# against 4. At 16 slots x 8 tokens the scan's kept per-position states (~50 MB) made a step 1.7-2x the block's
# (docs/performance.md, "KDA verify form").
KDA_VERIFY_SCAN_BACKENDS = ("cpu",)
KDA_VERIFY_SCAN_MAX_ROWS = 8
KDA_VERIFY_FORMS = ("block", "recurrent")
_KDA_VERIFY_FORM = [None]  # None: by the backend; else the form ``kda_verify_form_as`` set while tracing


def kda_prefill_form(cfg) -> str:
    """KDA's prefill form: the config's choice, or for "auto" the chunked (WY) form on accelerators and the token
    scan on CPU, where XLA runs the small per-token scan faster than the chunk algebra."""
    if cfg.kda_prefill != "auto":
        return cfg.kda_prefill
    return "recurrent" if jax.default_backend() == "cpu" else "chunked"


def kda_verify_form(T: int, batch: int = 1) -> str:
    """KDA's verify form for ``batch`` rows of T tokens (times the rows of ``mapped_rows``): "block"
    (``kda_ops.kda_block``) or "recurrent" (the scan that keeps every per-position state): the scan past
    ``KDA_BLOCK_MAX_TOKENS``, and on ``KDA_VERIFY_SCAN_BACKENDS`` up to ``KDA_VERIFY_SCAN_MAX_ROWS`` token rows."""
    if _KDA_VERIFY_FORM[-1] is not None:
        return _KDA_VERIFY_FORM[-1]
    rows = T * batch * (_MAPPED_ROWS[-1] or 1)
    if jax.default_backend() in KDA_VERIFY_SCAN_BACKENDS and rows <= KDA_VERIFY_SCAN_MAX_ROWS:
        return "recurrent"
    return "block" if T <= KDA_BLOCK_MAX_TOKENS else "recurrent"


@contextlib.contextmanager
def kda_verify_form_as(form: str):
    """Trace-time context: a verify takes ``form`` at every width whatever the backend, so both forms can be tested
    and timed on one machine (functions traced inside it must not be served from a jit cache filled outside it:
    call ``model.forward``, not the jitted ``model.verify``)."""
    if form not in KDA_VERIFY_FORMS:
        raise ValueError(f"kda_verify_form_as: expected one of {KDA_VERIFY_FORMS}, got {form!r}")
    _KDA_VERIFY_FORM.append(form)
    try:
        yield
    finally:
        _KDA_VERIFY_FORM.pop()


# --------------------------------------------------------------------------------------------------- Pallas
def kda_uses_pallas(cfg, mode: str) -> bool:
    """The fused Pallas KDA step (kimi/kernels/kda_decode.py) for decode and verify; prefill stays on XLA."""
    return cfg.kernels == "pallas" and mode in ("decode", "verify")


def moe_uses_pallas(cfg) -> bool:
    """The MXFP4 Pallas expert kernels (kimi/kernels/mxfp4_moe.py): they read packed experts only."""
    return cfg.kernels == "pallas" and cfg.expert_format == "mxfp4"


def pallas_interpret(interpret: Optional[bool] = None) -> bool:
    """Whether a Pallas kernel runs in interpret mode: an explicit choice, else on CPU (no Triton backend)."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


# --------------------------------------------------------------------------------------------------- MoE
# Rows at or under this that route to at least as many slots as there are experts: every expert once, no sort
# (a verify block on a small model touches most experts anyway).
MOE_ALL_MAX_ROWS = 16
# The 'blocked' path's block: each expert's rows padded to a multiple of this (docs/performance.md, "Where a
# 128-token prefill goes": smaller blocks lose more to small batched matmuls on XLA:CPU than they save in rows).
MOE_BLOCK_ROWS = 64
# Many rows on the serving copy run 'all' (T*E rows of work, two large matmuls) while that is at most this many
# times the rows 'blocked' computes (T*X + E*block, plus its sort, gathers and scatter): measured on this CPU with
# E = 8 and 32, top-2, 128-2048 rows, 'all' won where T*E <= ~2x those rows and lost past it (docs/performance.md).
MOE_ALL_OVER_BLOCKED = 2.0
# Mapped rows (the serving slots' vmap) on the bf16 serving copy on a CPU run 'all' while E is at most this many
# times the slots they route to: 'gathered' copies each routed expert's fp32 weights out of the copy (~58 us an
# expert of 192 x 192 here), 'all' reads every expert's bf16 pair in place (~8 us an expert): at 1 row of top-2,
# E = 8: 113 against 161 us a layer, E = 16: 128 against 159, E = 32: 248 against 166 (docs/performance.md).
MOE_ALL_OVER_GATHERED = 6
# The serving copy's per-expert loop with at most this many experts: one lax.cond per expert, each on its own
# arrays (XLA:CPU upcasts a loop's dynamic slice of bf16 weights to fp32 on every step); more: a fori_loop.
USED_UNROLL_MAX_EXPERTS = 32
# The per-expert loop ('used') instead of the fused pair ('all') while the rows pick at most this fraction of the
# experts (a loop over all of them costs more than the fused pair); decided at run time on the routing.
USED_LOOP_MAX_FRACTION = 0.5
# Backends where skipping experts by a run-time lax.cond pays ('used', 'all_or_used'): XLA:CPU runs the chosen branch
# inline. XLA:GPU reads each predicate back to the host before it launches a branch, and the first H200 run
# (2026-12-04) looks like it: in the shipped pair's greedy loops a plain decode step ('used': 8 conds per MoE layer)
# cost 1.33x a whole DSpark step (a draft and an 8-token verify, 'all_or_used': 1 cond). Elsewhere the serving
# copy's few rows take 'all' (docs/performance.md; not yet timed on a GPU).
RUNTIME_SKIP_BACKENDS = ("cpu",)


def runtime_skips() -> bool:
    """Whether a run-time ``lax.cond`` that skips work pays on this backend (``RUNTIME_SKIP_BACKENDS``); where it
    does not, the callers compute every branch and select per row (their results are the same either way)."""
    return jax.default_backend() in RUNTIME_SKIP_BACKENDS


SAMPLING_FORMS = ("bisect", "sort")
_SAMPLING_FORM = [None]  # None: by the backend; else the form ``sampling_form_as`` set while tracing


@contextlib.contextmanager
def sampling_form_as(form: str):
    """Trace-time context: sampling takes ``form`` whatever the backend, so both forms can be tested and timed side
    by side on one machine (functions traced inside it must not be served from a jit cache filled outside it)."""
    if form not in SAMPLING_FORMS:
        raise ValueError(f"sampling_form_as: expected one of {SAMPLING_FORMS}, got {form!r}")
    _SAMPLING_FORM.append(form)
    try:
        yield
    finally:
        _SAMPLING_FORM.pop()


def sampling_form() -> str:
    """How ``jdspark.sampling`` finds top-k / top-p boundaries and draws: "bisect" where run-time skips pay (XLA:CPU
    sorts a 4096 vocabulary slower than a small model's decode step, so bisection over the float bits, a top-64
    fast path behind a cond, Gumbel noise for 64 candidates unless a row needs the rest, and per-batch flags that
    skip greedy rows' sampling behind conds); "sort" elsewhere (one sort per row, Gumbel noise over the whole
    vocabulary, every row's sampling computed and selected: no cond, which XLA:GPU would read back to the host).
    Both keep the same tokens (up to the rounding of a mass at the top-p boundary) and draw from the same law; the
    second H200 run (2026-12-04) measured a sampled plain step at 1.94x a greedy one under "bisect", 1.13x under
    "sort" (docs/performance.md)."""
    if _SAMPLING_FORM[-1] is not None:
        return _SAMPLING_FORM[-1]
    return "bisect" if runtime_skips() else "sort"


# A program that maps a batch-1 step over n rows with ``jax.vmap`` (the serving engine's slots) says so with
# ``mapped_rows(n)`` while it traces: a ``lax.cond`` on per-row data runs both branches under vmap, so the paths
# that skip work at run time ('used', 'all_or_used') would do every path's work; and the rows a path serves are
# n times the rows one mapped call sees.
_MAPPED_ROWS = [None]  # None: not mapped


@contextlib.contextmanager
def mapped_rows(n: int):
    """Trace-time context: the model is being mapped over ``n`` rows (``jax.vmap``); see ``moe_path``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"mapped_rows: expected an int >= 1, got {n!r}")
    _MAPPED_ROWS.append(n)
    try:
        yield
    finally:
        _MAPPED_ROWS.pop()


def moe_path(rows: int, top_k: int, num_experts: int, serving_dtype=None) -> str:
    """How routed experts run, from static shapes and ``serving_dtype`` (the dtype of the serving copy's expert
    layouts when ``with_serving_layout`` made them, else None):

    'gathered' when the rows route to fewer slots than there are experts (decode, small verifies): only the routed
    experts' weights are read; on the bf16 serving copy 'used' instead (the verify's per-expert loop, so a row is
    rounded at the same points whichever pass computes it); 'all' when every expert is likely touched anyway and
    the rows are few: each expert once, no sort; 'all_or_used' for those rows on the serving copy (the picked
    experts only, when they are few; decided at run time); 'grouped' otherwise (prefill and training): sort by
    expert and a grouped matmul, or on CPU 'blocked' (the same sort, block-padded batched matmuls), because
    XLA:CPU's ragged_dot runs every row against every group; on the serving copy on CPU 'all' while its T*E rows
    are at most ``MOE_ALL_OVER_BLOCKED`` x blocked's (a 128-token prefill of 8 experts), and 'blocked' multiplies
    the copy's bf16 per-expert layout (``experts_blocked_fused``), not its dense fp32 experts in fp32.

    On a backend outside ``RUNTIME_SKIP_BACKENDS`` (a GPU) the serving copy's few rows take 'all' instead of
    'used' / 'all_or_used': no run-time cond. Inside ``mapped_rows(n)``: 'gathered' when the n * rows rows route
    to fewer slots than there are experts, else 'all' (no run-time skipping, which vmap would turn into both
    branches), each as for rows that many; on the bf16 serving copy on a CPU 'all' already from E <=
    ``MOE_ALL_OVER_GATHERED`` x those slots (a b = 1 decode of 8 experts: its rows then round close to batch-1
    decode's 'used', not bit for bit: 'all' sums the experts inside one matmul over E * F, 'used' one expert after
    another; docs/serving.md, "Greedy outputs under batching")."""
    mapped = _MAPPED_ROWS[-1]
    if mapped is not None:
        slots = rows * mapped * top_k
        if slots >= num_experts or (serving_dtype == jnp.bfloat16 and jax.default_backend() == "cpu"
                                    and num_experts <= MOE_ALL_OVER_GATHERED * slots):
            return "all"
        return "gathered"
    skips = runtime_skips()
    if rows * top_k < num_experts:
        if serving_dtype == jnp.bfloat16:  # decode and verify must round a row at the same points
            return "used" if skips else ("all" if rows <= MOE_ALL_MAX_ROWS else "gathered")
        return "gathered"
    if rows <= MOE_ALL_MAX_ROWS:
        return "all_or_used" if serving_dtype is not None and skips else "all"
    if jax.default_backend() == "cpu":
        if serving_dtype is not None and rows * num_experts <= MOE_ALL_OVER_BLOCKED * (
                rows * top_k + num_experts * MOE_BLOCK_ROWS):
            return "all"
        return "blocked"
    return "grouped"


# --------------------------------------------------------------------------------------------------- serving
# The serving copy (experts dequantised, fused for 'all' and per expert for 'used': ~3x the dense experts' bytes)
# is made once per generation when it fits this budget; K3-sized experts stay packed (they are why MXFP4 exists).
SERVING_COPY_BUDGET_BYTES = 512 << 20


def serving_copy(cfg, sharded: bool) -> bool:
    """Whether a generation serves a copy of the target's weights (``kimi.model.with_serving_layout``, made once
    per set of weights and kept between generations): only when it is small; a sharded model keeps its layout, and
    so does a model that runs the MXFP4 Pallas kernels (they read the packed experts the copy would unpack)."""
    if sharded or moe_uses_pallas(cfg):
        return False
    moe_layers = sum(k == "moe" for k in cfg.ffn_kinds)
    dense = moe_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.expert_in_dim * cfg.dtype.itemsize
    return 3 * dense <= SERVING_COPY_BUDGET_BYTES


# --------------------------------------------------------------------------------------------------- bf16
# A single bf16 row is zero-padded to this many: XLA:CPU's bf16 matrix-vector path is slower than its fp32 one,
# while 2 padded rows cost about one fp32 matrix-vector product.
BF16_ROWS_MIN = 2


def bf16_rows(rows: int) -> int:
    """The rows a bf16 weight matmul of ``rows`` input rows runs with (padding rows are zeros, cut after). Inside
    ``mapped_rows(n)`` the n mapped calls' rows are one matmul to XLA (vmap stacks them): each call pads only to
    its share of BF16_ROWS_MIN, so a plain step of 16 rows multiplies 16 rows, not 32."""
    mapped = _MAPPED_ROWS[-1] or 1
    return max(rows, -(-BF16_ROWS_MIN // mapped))


# --------------------------------------------------------------------------------------------------- prefill
# (one pass up to this many prompt tokens, else chunks of this many; kimi/prefill.py) per backend. A chunk's peak
# memory is the caches plus its activations (MLA scores C x S per head, S the cache length), the work the same as
# one pass. On XLA:CPU the [T, T] scores of one long pass go to memory on every pass over them: chunks of 256
# prefill the shipped pair's 2K / 4K prompts 1.4x / 1.5x faster than one pass (and 1.5x / 1.2x than chunks of
# 1024) in a seventh / a fifteenth of one pass's memory growth; one pass, padded only to 64, still wins up to
# ~1664 tokens (docs/performance.md, "Prefill chunks of 256 on a CPU"). Elsewhere (unmeasured): one pass up to 4096.
PREFILL_LIMITS = {"cpu": (1664, 256)}
PREFILL_LIMITS_DEFAULT = (4096, 1024)


def prefill_limits() -> tuple:
    """(the longest prompt prefilled in one pass, the chunk size of longer ones) on this backend."""
    return PREFILL_LIMITS.get(jax.default_backend(), PREFILL_LIMITS_DEFAULT)


def prefill_chunk(T: int, chunk: Optional[int] = None) -> Optional[int]:
    """The chunk size a prefill of T prompt tokens runs with (None: one pass, ``model.forward(mode="prefill")``).

    ``chunk``: the caller's choice (a ``--prefill-chunk`` flag): 0 forces one pass, a positive int chunks of that
    size (one pass when the prompt fits one chunk); None: as ``prefill_limits()`` says for this backend."""
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"prefill_chunk: expected None or an int >= 0, got {chunk!r}")
        return chunk if 0 < chunk < T else None
    one_pass, size = prefill_limits()
    return size if T > one_pass else None


# --------------------------------------------------------------------------------------------------- MLA prefill
# A prefill (or prefill chunk) over a cache of more keys than this attends key tile by key tile (online softmax,
# kimi/ops/mla.py): its scores are [T, tile] per head instead of [T, S], and the cache's empty tail is skipped.
# Below it the whole-cache form is one fused pass (fewer, larger matmuls).
MLA_TILED_MIN_KEYS = 8192
# Which form the tiles take, per backend (default "unabsorbed"), and their size. Unabsorbed (keys and values
# expanded per head from each tile's latents) does the fewest flops, which is what an accelerator wants. On
# XLA:CPU the time goes to the passes over the [H, T, tile] scores instead (mask, max, exp, sum: each from memory
# for a 1024-token chunk), and the absorbed form's [H * T, tile] scores are cheaper to make and to read: one
# layer's attention for a 1024-token chunk at 32K keys, unabsorbed by 2048 / 512 / 128 keys 2530 / 1932 / 1043 ms,
# absorbed by 8192 / 2048 / 512 / 128 keys 798 / 568 / 463 / 562 ms (docs/performance.md).
MLA_PREFILL_TILED_FORM = {"cpu": "absorbed"}
MLA_KEY_TILE = {"unabsorbed": 2048, "absorbed": 512}


def mla_key_tile(num_keys: int) -> Optional[tuple]:
    """(form, tile): how a prefill over a cache of ``num_keys`` positions attends by key tiles, form "unabsorbed"
    or "absorbed" (``MLA_PREFILL_TILED_FORM``); None: one whole-cache pass (unabsorbed)."""
    if num_keys <= MLA_TILED_MIN_KEYS:
        return None
    form = MLA_PREFILL_TILED_FORM.get(jax.default_backend(), "unabsorbed")
    return form, MLA_KEY_TILE[form]


# --------------------------------------------------------------------------------------------------- MLA decode
# A decode or verify (the absorbed form) over a cache of more keys than this goes in equal key tiles of at most
# MLA_ABSORBED_KEY_TILE keys (online softmax, kimi/ops/mla.py: mla_attend_absorbed_tiled), each tile read from the
# stacked [n_mla, B, S, L] cache where it lies. The one-pass form needs the layer's cache as an operand of its
# matmuls, and XLA:CPU copies the layer out of the stacked array for that on every step (50 MB per layer at 128K);
# and a verify's [H * T, S] fp32 scores outgrow the CPU's cache, so each of XLA:CPU's passes over them (mask, max,
# exp-sum, the weighted sum) goes to memory. Decode at 128K keys 31-36 -> 14 ms, an 8-token verify 49-54 -> 30-33
# ms; at 32K 6.9-7.2 -> 5.3 and 12.8-14.4 -> 10.1-10.8 (scripts/bench_step_cost.py, docs/performance.md). Up
# to 16K keys this CPU's run-to-run noise hides any difference, so shorter caches (the serving engine's slots)
# keep the one-pass form.
# On accelerators one fused pass (the tile loop is not measured there).
MLA_ABSORBED_TILED_MIN_KEYS = 16384
MLA_ABSORBED_KEY_TILE = 8192


def mla_absorbed_key_tile(num_keys: int) -> Optional[int]:
    """The key tile a decode or verify over a cache of ``num_keys`` positions uses: None (one pass) up to
    MLA_ABSORBED_TILED_MIN_KEYS and off CPU; else ceil(S / MLA_ABSORBED_KEY_TILE) tiles of equal size."""
    if jax.default_backend() != "cpu" or num_keys <= MLA_ABSORBED_TILED_MIN_KEYS:
        return None
    n_tiles = -(-num_keys // MLA_ABSORBED_KEY_TILE)
    return -(-num_keys // n_tiles)
