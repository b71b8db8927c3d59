"""Test setup: 16 simulated CPU devices and the persistent compilation cache, before JAX starts."""
import gc
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
jax.config.update("jax_compilation_cache_dir", os.path.join(_ROOT, ".jax_cache"))
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
