#!/usr/bin/env bash
# The README's main job: set up (if needed), start a PD deployment of the default model
# (SmolLM2-135M-Instruct) on this machine — a prefill server, a decode server and the router —
# send it one real chat request through the OpenAI-compatible API, print the answer, stop.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
PORT="${PDJAX_DEMO_PORT:-30000}"
LOG="${PDJAX_DEMO_LOG:-/tmp/pdjax_pd_demo.log}"
.venv/bin/python -m pdjax.serve --role pd --port "$PORT" "$@" >"$LOG" 2>&1 &
PID=$!
cleanup() { kill -TERM "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }
trap cleanup EXIT
echo "starting PD deployment (log: $LOG) ..."
.venv/bin/python - "$PORT" "$PID" <<'PY'
import sys, time, urllib.request, os
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 900
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server exited during start-up; see the log")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                break
    except Exception:
        pass
    time.sleep(1)
else:
    sys.exit("server not healthy after 900 s")
from openai import OpenAI
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
t = time.time()
resp = client.chat.completions.create(
    model=client.models.list().data[0].id, max_tokens=48, temperature=0,
    messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
print("answer:", resp.choices[0].message.content)
print("usage:", resp.usage.model_dump(), f"latency {time.time() - t:.2f} s")
PY
