"""What the Pallas kernels share: interpret-or-compile, the Triton compiler params, block-size picking.

Every kernel here is a plain ``pl.pallas_call`` over a grid:
* on CPU it runs with ``interpret=True`` (a jitted scan over the grid; cost grows with the number of grid steps);
* on an NVIDIA GPU it lowers through the Triton backend (``jax.experimental.pallas.triton.CompilerParams``), which
  still works in JAX 0.10-0.11 (deprecated from 0.11; the Mosaic GPU port is a follow-up). Triton wants every array
  a kernel loads or stores to have a power-of-2 size, supports no scalar prefetch and runs grid steps in parallel,
  so the kernels index experts / heads *inside* the body (dynamic ``ref[e, pl.ds(...)]`` loads of an integer read
  from a ref) and never revisit an output block.

``interpret=None`` everywhere means "as ``kimi.dispatch.pallas_interpret`` decides" (interpret on the CPU).
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pltriton


def compiler_params(interpret: bool, num_warps: int = 4, num_stages: int = 2):
    """Triton params for a compiled GPU kernel; None (ignored anyway) in interpret mode."""
    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pick_block(dim: int, target: int, quantum: int = 1) -> int:
    """The largest power of 2 <= target that divides ``dim`` and is a multiple of ``quantum``; else ``dim`` itself
    (one block; fine in interpret mode, and on the GPU whenever ``dim`` is a power of 2)."""
    b = 1
    while b * 2 <= target:
        b *= 2
    while b >= quantum:
        if dim % b == 0 and b % quantum == 0:
            return b
        b //= 2
    return dim
