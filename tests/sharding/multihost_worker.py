"""One of the processes of tests/sharding/test_multihost.py (not a test itself).

  python tests/sharding/multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npz

Joins the process group with 8 simulated CPU devices, builds the {"data": 2, "tensor": 8} mesh over both
processes (experts split across the processes, heads within each), runs two sharded decode steps of the tiny
model and, on process 0, writes the logits and the final KDA state."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STEPS = (5, 77)  # the tokens decoded, one per step, batch 1


def main(coordinator: str, num_processes: int, process_id: int, out: str) -> int:
    from sharding import distributed

    distributed.initialize(coordinator, num_processes, process_id, local_device_count=8, timeout_s=90)
    import jax
    import numpy as np

    import sharding
    from tests.sharding.common import random_model, sharded_tiny_config

    assert jax.device_count() == 16 and jax.local_device_count() == 8, (jax.device_count(), jax.local_device_count())
    mesh = sharding.make_mesh({"data": 2, "tensor": 8})
    model = random_model(sharded_tiny_config())  # the same seed, hence the same values, in every process
    sharding.shard_model(model, mesh)
    cache = model.init_cache(1, 8)
    logits = []
    for t in STEPS:
        res = model.decode(np.array([t], np.int32), cache)
        logits.append(distributed.gather(res.logits))
        cache = res.cache
    state = distributed.gather(cache.kda_state)
    experts = model.model.layers[1].block_sparse_moe.experts.w1_packed[...]
    spans_processes = len({d.process_index for d in experts.sharding.device_set}) == num_processes
    if jax.process_index() == 0:
        np.savez(out, logits=np.stack(logits), kda_state=state, spans_processes=spans_processes)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
