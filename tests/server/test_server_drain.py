"""SIGTERM drains a real server process (run_server over the fake engine) and exits 0."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from server_fakes import parse_sse

from pdjax.ports import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


async def start_server(drain_timeout_s: float):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = [sys.executable, os.path.join(HERE, "server_fakes.py"), "--port", str(port),
           "--drain-timeout", str(drain_timeout_s), "--step-s", "0.01"]
    proc = subprocess.Popen(cmd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)


async def wait_exit(proc, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "server did not exit"
        await asyncio.sleep(0.05)
    out = proc.stdout.read()
    proc.stdout.close()
    return proc.returncode, out


async def test_sigterm_lets_running_requests_finish_then_exits_0():
    proc, url = await start_server(drain_timeout_s=20.0)
    try:
        async with aiohttp.ClientSession() as session:
            # 300 tokens at 10 ms: the stream outlives the checks below by seconds (the
            # server exits when it ends), and /health turning 503 says SIGTERM was handled.
            body = {"prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert (await resp.content.readline()).startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 20
                while True:
                    async with session.get(url + "/health") as health:
                        if health.status == 503:
                            break
                    assert time.monotonic() < deadline, "SIGTERM not handled"
                    await asyncio.sleep(0.02)
                async with session.post(url + "/v1/completions", json=body) as late:
                    assert late.status == 503
                    assert "shutting down" in (await late.json())["error"]["message"]
                rest = (await resp.read()).decode()
            events = parse_sse(rest)
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        code, out = await wait_exit(proc)
        assert code == 0, out
        assert "SHUTDOWN_HOOK live=0 aborted=0" in out
        assert f"pdjax server ready: {url} (/health answers 200)" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


async def test_sigterm_aborts_what_outlives_the_drain_timeout():
    proc, url = await start_server(drain_timeout_s=0.5)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"text": "Hi", "stream": True,
                    "sampling_params": {"max_new_tokens": 90000, "ignore_eos": True}}
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
                # A token has streamed: the request is running when SIGTERM arrives.
                assert (await resp.content.readline()).startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                events = parse_sse((await resp.read()).decode())
            meta = events[-2]["meta_info"]
            assert events[-1] == "[DONE]"
            assert meta["finish_reason"]["type"] == "abort"
            assert 0 < meta["completion_tokens"] < 100000
        code, out = await wait_exit(proc)
        assert code == 0, out
        assert "SHUTDOWN_HOOK live=0 aborted=1" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
