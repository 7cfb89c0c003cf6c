"""scripts/bench_startup.py: launch -> /health 200 is timed at /health, not when every background
shape is compiled (the benchmarks' ServerProcess.wait_healthy waits for those too, so the
start-up figure was the later "every shape compiled" one)."""

import http.server
import json
import threading
import time
import types

import pytest

import bench_startup


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": {},
                "/get_load": {"num_ready_buckets": 2, "num_buckets": 10}}.get(self.path)
        data = json.dumps(body).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def healthy_but_compiling():
    """A stand-in server: /health 200 while /get_load has 2 of 10 buckets ready."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _server(url, timeout_s, returncode=None):
    return types.SimpleNamespace(url=url, health_path="/health", timeout_s=timeout_s,
                                 proc=types.SimpleNamespace(poll=lambda: returncode,
                                                            returncode=returncode),
                                 log_tail=lambda: "log tail")


def test_wait_health_returns_at_health_200_while_shapes_compile(healthy_but_compiling):
    t0 = time.monotonic()
    bench_startup.wait_health(_server(healthy_but_compiling, timeout_s=30))
    assert time.monotonic() - t0 < 5


def test_wait_health_raises_when_the_server_exits_or_times_out(healthy_but_compiling):
    with pytest.raises(RuntimeError, match="exited with 3"):
        bench_startup.wait_health(_server(healthy_but_compiling, 30, returncode=3))
    with pytest.raises(RuntimeError, match="not healthy after 1 s"):
        bench_startup.wait_health(_server("http://127.0.0.1:9", 1))
