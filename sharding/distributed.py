"""Multi-process (multi-host) helpers around ``jax.distributed.initialize``.

One process per host (or per GPU group) calls ``initialize`` before anything touches the devices; afterwards
``jax.devices()`` lists every process's devices and ``sharding.make_mesh`` builds one global mesh from them, so
2 hosts x 8 GPUs form the same 16-device "tp16" / "dp16-ep16" meshes as one host with 16.

  from sharding import distributed
  distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)   # or from the environment
  mesh = sharding.make_mesh("tp16")

Arguments default to ``JDSPARK_COORDINATOR`` / ``JDSPARK_NUM_PROCESSES`` / ``JDSPARK_PROCESS_ID``, and without
those to JAX's own cluster detection (Slurm, Kubernetes, ...). Timeouts are bounded, so a peer that never comes
fails the start instead of hanging it. On CPU (tests, simulation) ``local_device_count`` sets the number of devices
each process simulates (it must be set before the backend starts, which ``initialize`` checks).
"""

from __future__ import annotations

import inspect
import os
import socket
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a local coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, local_device_count: Optional[int] = None,
               timeout_s: int = 120) -> tuple[int, int]:
    """Join the process group; returns (process_index, process_count). ValueError on inconsistent arguments."""
    env = os.environ
    coordinator_address = coordinator_address or env.get("JDSPARK_COORDINATOR")
    if num_processes is None and env.get("JDSPARK_NUM_PROCESSES"):
        num_processes = int(env["JDSPARK_NUM_PROCESSES"])
    if process_id is None and env.get("JDSPARK_PROCESS_ID"):
        process_id = int(env["JDSPARK_PROCESS_ID"])
    if coordinator_address is not None:
        if num_processes is None or process_id is None:
            raise ValueError("initialize: a coordinator address needs num_processes and process_id "
                             "(arguments or JDSPARK_NUM_PROCESSES / JDSPARK_PROCESS_ID)")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"initialize: process_id {process_id} outside 0..{num_processes - 1}")
    if local_device_count is not None:
        try:
            jax.config.update("jax_num_cpu_devices", int(local_device_count))
        except RuntimeError as e:  # the backend is already up
            raise ValueError(f"initialize: local_device_count must be set before JAX starts its backend ({e})")
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                  initialization_timeout=int(timeout_s))
    params = inspect.signature(jax.distributed.initialize).parameters
    for name in ("heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
        if name in params:
            kwargs[name] = int(timeout_s)
    jax.distributed.initialize(**kwargs)
    return jax.process_index(), jax.process_count()


def shutdown() -> None:
    jax.distributed.shutdown()


def gather(x) -> np.ndarray:
    """The whole value of a global array on every process, as NumPy (sharded over processes or not)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
