"""Device meshes: the two serving layouts for 16 GPUs, and explicit dims.

Every mesh has the same two axes, in this order, so the rules in ``sharding/rules.py`` can name them:

  ``data``    data parallel: batch rows (one stream per rank) and, on the same devices, the routed experts
  ``tensor``  tensor parallel: heads, projected widths, expert hidden, vocabulary

Presets (any N, not only 16):
  ``"tpN"``        data=1, tensor=N   batch-1 latency (the seed's tp16)
  ``"dpN-epN"``    data=N, tensor=1   throughput: attention data parallel, experts expert parallel
  ``{"data": 2, "tensor": 8}``        explicit dims (missing axes are 1)

Axis types are set explicitly to ``Auto`` (``jax.make_mesh`` defaults to Explicit in recent JAX): the model runs
under GSPMD propagation from its parameter and cache shardings, and ``jax.shard_map`` handles the expert-parallel
MoE. The mesh takes ``jax.devices()``, which spans every process after ``jax.distributed.initialize`` (see
``sharding/distributed.py``), so the same call builds a 16-device mesh from one process of 16 devices or from two
processes of 8.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Optional, Sequence, Union

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "tensor")
MeshSpec = Union[str, Mapping[str, int]]


def mesh_dims(spec: MeshSpec) -> dict[str, int]:
    """{"data": d, "tensor": t} for a preset name or an explicit dict (ValueError on anything else)."""
    if isinstance(spec, str):
        m = re.fullmatch(r"tp(\d+)", spec)
        if m:
            return {"data": 1, "tensor": int(m.group(1))}
        m = re.fullmatch(r"dp(\d+)-ep(\d+)", spec)
        if m:
            dp, ep = int(m.group(1)), int(m.group(2))
            if dp != ep:
                raise ValueError(f"mesh {spec!r}: data and expert parallelism share the devices, so dp must equal "
                                 f"ep (got dp={dp}, ep={ep}); use explicit dims for other layouts")
            return {"data": dp, "tensor": 1}
        raise ValueError(f"mesh {spec!r}: expected 'tpN', 'dpN-epN' (e.g. 'tp16', 'dp16-ep16') or a dict of dims "
                         f"over {AXES}")
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(AXES))
        if unknown:
            raise ValueError(f"mesh dims: unknown axes {unknown}; the axes are {AXES}")
        dims = {a: int(spec.get(a, 1)) for a in AXES}
        for a, n in dims.items():
            if n < 1:
                raise ValueError(f"mesh dims: axis {a!r} must be >= 1, got {n}")
        return dims
    raise ValueError(f"mesh: expected a preset name or a dict of dims, got {type(spec).__name__}")


def make_mesh(spec: MeshSpec = "tp16", devices: Optional[Sequence] = None) -> Mesh:
    """A ("data", "tensor") mesh with Auto axis types over ``devices`` (default: every device of every process).

    The product of the dims must equal the number of devices."""
    dims = mesh_dims(spec)
    devs = list(jax.devices() if devices is None else devices)
    n = math.prod(dims.values())
    if n != len(devs):
        raise ValueError(f"mesh {spec!r}: needs {n} devices ({dims}), but {len(devs)} are available"
                         + (" (simulate CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                            if devs and devs[0].platform == "cpu" else ""))
    return jax.make_mesh(tuple(dims[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devs)


def mesh_name(mesh) -> str:
    """The preset name of a mesh ('tp16', 'dp16-ep16') or its dims ('data2xtensor8')."""
    d = dict(mesh.shape)
    if d.get("data", 1) == 1:
        return f"tp{d.get('tensor', 1)}"
    if d.get("tensor", 1) == 1:
        return f"dp{d['data']}-ep{d['data']}"
    return "x".join(f"{a}{d[a]}" for a in AXES)
