#!/usr/bin/env bash
# Issue 7's GPU check: the one prepared script for a session that is lent an NVIDIA H200.
#
#   1. tests/kimi/test_kernels_pallas.py on the GPU: the same tests that run in interpret mode on CPU, here with the
#      kernels compiled through the Pallas Triton backend (timeout 300 s);
#   2. scripts/bench_kernels.py --json at K3 decode shapes: bytes per call, GB/s, % of the measured copy bandwidth,
#      speedup over the XLA reference (timeout 240 s).
#
# Stated timeout: the whole script ends within 560 s; run it with the device tool as
#     run(command="bash scripts/gpu_check.sh", timeout_s=600)
# and read $OUT/bench_kernels.json, $OUT/gpu_tests.log and $OUT/env.txt. Acceptance (issue 7): MXFP4 MoE decode
# >= 60 % of copy bandwidth and >= 1.5x the XLA reference; KDA decode >= 50 % of copy bandwidth.
#
# It uses the machine image's python3 (JAX 0.11.x with CUDA, flax, pytest; the repo's .venv holds a CPU-only
# jaxlib); override with PY=... . Nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())" 2>&1
} | tee "$OUT/env.txt"

rc=0
# fp32 XLA references in the tests must not drop to TF32 (the comparisons are at 1e-5)
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/kimi/test_kernels_pallas.py 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
timeout 240 "$PY" scripts/bench_kernels.py --json 2>&1 | tee "$OUT/bench_kernels.json" || rc=1
exit $rc
