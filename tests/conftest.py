"""Test setup: 16 simulated CPU devices and the persistent compilation cache, before JAX starts."""
import gc
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
# The suite's programs are small and mostly compiled once, run a few times: LLVM's backend optimisation is much of
# XLA:CPU's compile time and buys them little (a cold full suite on 2 workers: 24:46 -> 18:42). Only the machine
# code changes, not the HLO; pass --xla_backend_optimization_level yourself to test the optimised backend.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's newer fusion emitters (MLIR) compile the suite's programs a third slower than the loop emitters they
# replace (forty-second session: one slots test cold 33 s -> 22 s); the same HLO, other machine code.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# JAX_COMPILATION_CACHE_DIR overrides the tree's .jax_cache (e.g. an empty dir to time a cold run). Concurrent
# pytest-xdist workers share the cache safely: entries are written atomically.
_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(_ROOT, ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
# 0.5 s: caching the quicker programs too (0.1 s) bought nothing on a cold run (thirty-second session: 668 s of
# wall and 1231 s of CPU, against 657 s and 1216 s for 0.5 s in the session before).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends. Every XLA:CPU executable holds memory mappings of
    its JIT-compiled code; one process running the whole suite kept ~65k of them alive and crossed Linux's
    vm.max_map_count (65530), which XLA meets as a segfault while compiling. The persistent compilation cache
    keeps recompiles across modules cheap."""
    yield
    jax.clear_caches()
    gc.collect()


# ------------------------------------------------------------------ no silent skips of the independent references
PARITY_DEPS = ("torch", "transformers", "fla", "speculators")  # requirements/test.txt; `make test` installs them
_PARITY_DIR = os.path.join(_ROOT, "tests", "parity") + os.sep


def _runs_parity(config) -> bool:
    ignored = [os.path.abspath(p) + os.sep for p in (config.getoption("ignore") or [])]
    if any(_PARITY_DIR.startswith(p) for p in ignored):
        return False
    for arg in config.args or [_ROOT]:
        path = os.path.abspath(arg.split("::")[0])
        if (path + os.sep).startswith(_PARITY_DIR) or _PARITY_DIR.startswith(path + os.sep):
            return True
    return False


def pytest_configure(config):
    """A run that includes tests/parity fails at once when one of the parity references cannot be imported:
    otherwise every comparison with code nobody here wrote would be skipped and the run still green."""
    import importlib.util

    if not _runs_parity(config):
        return
    missing = [m for m in PARITY_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(f"parity dependencies missing: {', '.join(missing)}. Install requirements/test.txt "
                                "(`make install`), or leave tests/parity out explicitly (--ignore=tests/parity).")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A parity test that skips fails instead: the independent comparisons are the point of tests/parity."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and str(item.path).startswith(_PARITY_DIR) and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"parity test skipped (not allowed): {rep.longrepr}"


# ------------------------------------------------------------------ the longest files first (make test: 2 workers)
# pytest-xdist's --dist loadfile hands whole files to idle workers in collection order (with
# --no-loadscope-reorder, as `make test` runs it; else xdist orders them by test count); the longest first keeps
# one long file from running alone at the end while the other worker idles (longest-processing-time scheduling).
# Measured on a cold 2-core run, most expensive first; every other file follows in its usual order.
_LONGEST_FIRST = (  # seventeenth session: every file over 8 s in one cold single-process run, by its total
    # (forty-first: test_prefix, test_grammar, test_penalties, test_logprobs placed by estimate)
    "jdspark/test_sampling_law.py", "jdspark/test_slots.py", "kimi/test_prefill.py", "jdspark/test_speculative.py",
    "jdspark/test_prefix.py", "kimi/test_layers_ops.py", "jdspark/test_train_drafter.py", "kimi/test_kernels_pallas.py",
    "jdspark/test_long_context.py", "jdspark/test_generate_lossless.py", "jdspark/test_grammar.py",
    "jdspark/test_penalties.py", "jdspark/test_logprobs.py", "test_train_target.py", "kimi/test_model.py",
    "kimi/test_kda_ops.py", "sharding/test_sharded_model.py", "kimi/test_vision.py", "jdspark/test_vision_serving.py",
    "test_bench_long.py", "jdspark/test_sampling_rows.py", "parity/test_transformers_kimi_linear.py",
    "test_bench_slots.py", "jdspark/test_shipped_pair.py", "jdspark/test_drafter.py", "jdspark/test_sampling.py",
    "jdspark/test_distill_corpus.py", "test_bench_step_cost.py", "parity/test_vision_transformers.py",
    "sharding/test_multihost.py", "sharding/test_mesh_rules.py", "parity/test_dspark_speculators.py",
    "jdspark/test_serve_load.py",  # forty-seventh: test_serve.py split in three; the flags' real engines here
)


def pytest_collection_modifyitems(session, config, items):
    tests_dir = os.path.join(_ROOT, "tests") + os.sep
    rank = {os.path.join(tests_dir, f): i for i, f in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(str(it.path), len(rank)))  # stable: the rest keep their order
