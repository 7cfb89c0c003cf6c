#!/usr/bin/env bash
# The README's test command: set up (if needed) and run the whole suite (CI runs this).
#   --fast   the loop before each commit: ``-m "not slow"`` (no test that starts a process,
#            runs a benchmark or is a heavy model or kernel check) and no TPU/GPU compiler
#            virtualenvs; a few minutes
# Other arguments go to pytest. Exit status: pytest's, except that "no tests collected" (5)
# is a failure too.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FAST=0
if [ "${1:-}" = "--fast" ]; then FAST=1; shift; set -- -m "not slow" "$@"; fi
bash scripts/setup_env.sh || exit 1
if [ $FAST = 0 ]; then
  # The TPU compiler (jax[tpu]) and the GPU compiler (jax[cuda12]), each in its own
  # virtualenv: tests/aot/test_target_compile.py (slow) compiles the tiny models with both.
  bash scripts/aot_env.sh tpu >/dev/null || exit 1
  bash scripts/aot_env.sh cuda >/dev/null || exit 1
fi
# XLA CPU maps each kernel of an executable on its own: the suite's one process needs more
# memory maps than Linux's default vm.max_map_count (65,530) allows (tests/conftest.py).
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 1048576)" -lt 1048576 ]; then
  sysctl -qw vm.max_map_count=1048576 2>/dev/null \
    || sudo -n sysctl -qw vm.max_map_count=1048576 2>/dev/null \
    || echo "note: vm.max_map_count stays $(cat /proc/sys/vm/max_map_count); tests/conftest.py releases executables near it"
fi
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/pdjax/jax_compilation_cache}"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
[ $rc -eq 5 ] && { echo "no tests collected: failing"; exit 1; }
exit $rc
