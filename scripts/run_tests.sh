#!/usr/bin/env bash
# The README's test command: set up (if needed) and run the whole suite.
# Exit status: pytest's, except that "no tests collected" (5) is a failure too.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh || exit 1
# The TPU compiler (jax[tpu]) in its own virtualenv: tests/aot/test_tpu_compile.py uses it.
bash scripts/aot_env.sh tpu >/dev/null || exit 1
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/pdjax/jax_compilation_cache}"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
[ $rc -eq 5 ] && { echo "no tests collected: failing"; exit 1; }
exit $rc
