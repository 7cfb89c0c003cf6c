"""Start-up and event-loop liveness: a failed engine start exits the server (it used to answer
503 "warming up" forever); slow tokenization never blocks other requests; bad flags fail fast."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from pdjax.config import ServerArgs
from pdjax.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_start_failure_exits_nonzero(tiny_checkpoints, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pdjax.serve", "--model-path", tiny_checkpoints["llama"],
         "--port", str(free_port()), "--tp-size", "64", "--skip-warmup-progress"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tp_size must be in" in proc.stderr and "failed to start" in proc.stderr


@pytest.mark.parametrize("argv,needle", [(["--port", "99999"], "port"),
                                         (["--page-size", "0"], "page_size"),
                                         (["--role", "bogus"], "role"),
                                         (["--model-path", "/nonexistent/model"],
                                          "/nonexistent/model: model path not found")])
def test_bad_flags_fail_before_loading(argv, needle):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", *argv], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def test_server_args_port_range():
    with pytest.raises(ValueError, match="port must be in"):
        ServerArgs(port=99999)


@pytest.mark.asyncio
async def test_slow_tokenization_does_not_block_the_event_loop(make_client, tokenizer):
    from server_fakes import FakeEngine

    class SlowTokenizer:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __len__(self):
            return len(self._inner)

        def encode(self, *args, **kwargs):
            time.sleep(1.5)
            return self._inner.encode(*args, **kwargs)

    engine = FakeEngine(SlowTokenizer(tokenizer))
    client, _ = await make_client(engine)
    slow = asyncio.create_task(client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "Hello", "max_tokens": 2}))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    health = await client.get("/health")
    assert health.status == 200
    assert time.monotonic() - t0 < 0.5
    assert (await slow).status == 200
