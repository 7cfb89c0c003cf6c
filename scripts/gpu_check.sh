#!/usr/bin/env bash
# Real (not interpreted) check of pdjax on one NVIDIA GPU host:
#   1. the kernel tests of tests/pallas_kernels, with the GPU kernel compiled through Triton;
#   2. scripts/gpu_kernel_bench.py: the attention kernel's HBM GB/s (decode) and TFLOP/s
#      (prefill) against the device's peak;
#   3. scripts/gpu_engine_check.py: the whole engine on a random-weight model of Llama-3-8B's
#      shape in bfloat16 (nothing downloaded): decode step time against the weight-read
#      roofline at a few batch sizes x contexts, prefill TFLOP/s of 2048-token chunks, and the
#      Pallas GPU attention path against the jnp/XLA path (same greedy tokens).
# About 8 minutes on an H100/H200 in all. Needs Python 3.12 with jax + its CUDA plugin (0.10 or
# 0.11), numpy, flax, transformers and tokenizers: the repo goes on PYTHONPATH, nothing is
# installed in the environment. Modules the host lacks (pytest and its dependencies) are
# installed from a wheelhouse of pure-Python wheels into a folder put on PYTHONPATH; build it
# on a machine with a package index and bring it along (it is ignored by git):
#     python scripts/gpu_wheelhouse.py build .wheelhouse
#
#   scripts/gpu_check.sh [extra pytest args for step 1]
#   env: PYTHON (default python3); OUT (optional folder for gpu_check.log, gpu_kernel_bench.json
#        and gpu_engine_check.json); GPU_CHECK_WHEELHOUSE (default .wheelhouse);
#        GPU_CHECK_ENGINE_ARGS (extra arguments of gpu_engine_check.py, e.g. --max-batch 16 or
#        --peak-hbm-gbs X); GPU_CHECK_ALLOW_CPU=1 runs the same steps on a CPU-only host
#        (kernels interpreted, the benchmark in its tiny reference mode, the engine check on a
#        tiny model) to test this script (tests/bench/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
total_start=$SECONDS

echo "== environment"
site="$(mktemp -d "${TMPDIR:-/tmp}/pdjax_gpu_site.XXXXXX")"
trap 'rm -rf "$site"' EXIT
"$PY" scripts/gpu_wheelhouse.py install "${GPU_CHECK_WHEELHOUSE:-.wheelhouse}" "$site"
export PYTHONPATH="$PYTHONPATH:$site"
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

echo "== engine check"
start=$SECONDS
# Most of the device's memory for the 16 GB model and its 35 GB KV pool (JAX's default: 75%).
# shellcheck disable=SC2086  # GPU_CHECK_ENGINE_ARGS is a list of words
AOT_DIR="${GPU_CHECK_AOT_DIR:-.aot-h200}"
AOT_ARGS=()
if [[ -f "$AOT_DIR/gpu/manifest.json" ]]; then
  AOT_ARGS=(--aot-executables "$AOT_DIR")
  echo "loading executables from $AOT_DIR where they match"
fi
XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}" \
  "$PY" scripts/gpu_engine_check.py ${OUT:+--json "$OUT/gpu_engine_check.json"} \
  ${AOT_ARGS[@]+"${AOT_ARGS[@]}"} ${GPU_CHECK_ENGINE_ARGS:-}
echo "engine check took $((SECONDS - start)) s"
echo "gpu_check: all steps passed in $((SECONDS - total_start)) s"
