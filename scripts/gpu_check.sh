#!/usr/bin/env bash
# Real (not interpreted) check of the Pallas GPU attention kernel on an NVIDIA GPU host:
#   1. the kernel tests of tests/pallas_kernels, with the GPU kernel compiled through Triton;
#   2. scripts/gpu_kernel_bench.py: achieved HBM GB/s (decode) and TFLOP/s (prefill) vs peak.
# Needs only Python 3.12 with jax + its CUDA plugin (0.10 or 0.11), numpy and pytest: the repo
# goes on PYTHONPATH, nothing is installed. Synthetic inputs; a few minutes on an H100/H200.
#
#   scripts/gpu_check.sh [extra pytest args]
#   env: PYTHON (default python3); OUT (optional folder for gpu_check.log and
#        gpu_kernel_bench.json); GPU_CHECK_ALLOW_CPU=1 runs the same steps on a CPU-only host
#        (kernels interpreted, benchmark in its tiny reference mode) to test this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
fi

echo "== environment"
"$PY" - <<'PYEOF'
import sys
import jax, numpy, pytest
print("python", sys.version.split()[0], "| jax", jax.__version__, "| numpy", numpy.__version__,
      "| pytest", pytest.__version__)
print("devices:", jax.devices())
import os
if jax.default_backend() != "gpu" and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit(f"gpu_check: no GPU backend (jax.default_backend() = {jax.default_backend()!r})")
import pdjax.pallas_kernels.ragged_paged_attention.kernel_gpu  # noqa: F401
heavy = [m for m in ("flax", "zmq", "transformers", "torch") if m in sys.modules]
if heavy:
    sys.exit(f"gpu_check: importing the kernels pulled in {heavy}")
PYEOF

echo "== kernel tests (GPU kernel compiled, TPU kernel interpreted on the host CPU)"
start=$SECONDS
"$PY" -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_ragged_paged_attention.py "$@"
echo "tests took $((SECONDS - start)) s"

echo "== micro-benchmark"
start=$SECONDS
"$PY" scripts/gpu_kernel_bench.py ${OUT:+--json "$OUT/gpu_kernel_bench.json"}
echo "benchmark took $((SECONDS - start)) s"
