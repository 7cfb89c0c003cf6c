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

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tp,needle", [(64, "tp_size: must be in"),
                                       (3, "tp_size: 3 must divide num_attention_heads (4)")])
def test_engine_start_failure_exits_nonzero(tiny_checkpoints, tp, needle):
    """A setting the engine would refuse at start (too many devices; heads that do not split)
    exits 2 at parse time with the reason on one line, no traceback (it is the user's
    setting, not a bug; it was exit 1 once the engine had started)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, "-m", "pdjax.serve", "--model-path", tiny_checkpoints["llama"],
         "--port", str(free_port()), "--tp-size", str(tp), "--skip-warmup-progress"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {needle}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv,needle", [(["--port", "99999"], "port"),
                                         (["--page-size", "0"], "page_size"),
                                         (["--role", "bogus"], "role"),
                                         (["--model-path", "/nonexistent/model"],
                                          "/nonexistent/model: model path not found"),
                                         (["--profile-dir", "/proc/traces"],
                                          "profile_dir: cannot write in /proc/traces")])
def test_bad_flags_fail_before_loading(argv, needle):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", *argv], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def _bad_checkpoint(tmp_path, kind):
    """A path that exists but is no checkpoint, and the words its error must hold."""
    if kind == "text file":
        return os.path.join(ROOT, "README.md"), "neither a directory nor a .gguf file"
    if kind == "empty folder":
        return str(tmp_path), "config.json: file not found"
    if kind == "malformed config":
        (tmp_path / "config.json").write_text("{")
        return str(tmp_path), "config.json: malformed JSON"
    if kind == "config list":
        (tmp_path / "config.json").write_text("[1, 2]")
        return str(tmp_path), "config.json: a JSON object of settings, got a JSON list"
    if kind == "unknown architecture":
        (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
        return str(tmp_path), "architecture: 'FooForCausalLM' is not supported"
    (tmp_path / "x.gguf").write_text("not a gguf")
    return str(tmp_path / "x.gguf"), "x.gguf: cannot read GGUF"


@pytest.mark.parametrize("kind", ["text file", "empty folder", "malformed config",
                                  "config list", "unknown architecture", "corrupt gguf"])
@pytest.mark.parametrize("flag", ["--model-path", "--speculative-draft-model-path"])
def test_a_path_that_is_no_checkpoint_fails_before_loading(tmp_path, kind, flag):
    """Every checkpoint flag is read at parse time: a path that exists but holds no
    checkpoint is one 'error: FIELD: ...' line and exit 2 (README.md as --model-path was a
    transformers traceback from the tokenizer thread)."""
    path, words = _bad_checkpoint(tmp_path, kind)
    argv = [flag, path, "--port", str(free_port())]
    if flag != "--model-path":
        argv += ["--speculative-algorithm", "draft"]
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", *argv], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=120)
    field = flag[2:].replace("-", "_")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {field}: " in proc.stderr and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_one_port_for_http_and_bootstrap_fails_before_loading():
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", "--role", "prefill", "--port",
                           port, "--disaggregation-bootstrap-port", port], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: disaggregation_bootstrap_port: {port} is --port too" in proc.stderr


def test_a_missing_tokenizer_path_fails_before_loading():
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", "--tokenizer-path",
                           "/nonexistent/tok", "--port", str(free_port())], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: tokenizer_path: /nonexistent/tok: not found" in proc.stderr


@pytest.mark.parametrize("role,flag,field", [("colocated", "--port", "port"),
                                              ("prefill", "--disaggregation-bootstrap-port",
                                               "disaggregation_bootstrap_port")])
def test_a_port_in_use_fails_before_loading(role, flag, field):
    """A port another process listens on is one error line at once (it was a traceback from
    the HTTP server's bind after the model had loaded and compiled)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["--role", role, "--host", "127.0.0.1", flag, str(port)]
        if flag != "--port":
            argv += ["--port", str(free_port())]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pdjax.serve", *argv], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                              text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{field}: cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def test_server_args_port_range():
    with pytest.raises(ValueError, match="^port: must be in"):
        ServerArgs(port=99999)


@pytest.mark.asyncio
async def test_slow_tokenization_does_not_block_the_event_loop(make_client, tokenizer):
    """/health answers while a tokenization is blocked in its worker thread: the encode
    waits on an event that is only set after /health has answered (no wall-clock bound)."""
    import threading

    from server_fakes import FakeEngine

    entered, release, released = threading.Event(), threading.Event(), []

    class SlowTokenizer:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __len__(self):
            return len(self._inner)

        def encode(self, *args, **kwargs):
            entered.set()
            # On the event loop this would block /health until the wait timed out.
            released.append(release.wait(10))
            return self._inner.encode(*args, **kwargs)

    engine = FakeEngine(SlowTokenizer(tokenizer))
    client, _ = await make_client(engine)
    slow = asyncio.create_task(client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "Hello", "max_tokens": 2}))
    assert await asyncio.to_thread(entered.wait, 30)
    health = await client.get("/health")
    assert health.status == 200 and not release.is_set()
    release.set()
    assert (await slow).status == 200 and released and all(released)
