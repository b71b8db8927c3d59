"""Two local processes x 8 CPU devices form one 16-device mesh (jax.distributed over a 127.0.0.1 coordinator) and
their sharded decode steps equal the single-process result."""
import os
import subprocess
import sys

import jax
import numpy as np

from sharding import distributed
from tests.sharding import multihost_worker
from tests.sharding.common import random_model, sharded_tiny_config

ROOT = multihost_worker.ROOT
TIMEOUT_S = 240


def test_two_processes_form_one_mesh_and_match_single_process(tmp_path):
    out = str(tmp_path / "result.npz")
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    procs = [subprocess.Popen([sys.executable, multihost_worker.__file__, coordinator, "2", str(i), out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        # the single-process reference, computed while the workers start
        model = random_model(sharded_tiny_config())
        cache, want = model.init_cache(1, 8), []
        for t in multihost_worker.STEPS:
            res = model.decode(np.array([t], np.int32), cache)
            want.append(np.asarray(res.logits))
            cache = res.cache
        want_state = np.asarray(jax.device_get(cache.kda_state))
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-3000:]}"
    got = np.load(out)
    assert bool(got["spans_processes"]), "the experts should be split across the two processes"
    np.testing.assert_allclose(got["logits"], np.stack(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["kda_state"], want_state, rtol=1e-5, atol=1e-5)
