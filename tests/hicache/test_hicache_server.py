"""Issue 43's first done-when through the HTTP API of a real ``pdjax.serve`` process: with
``--max-total-tokens 1024 --enable-hierarchical-cache --hicache-size 1``, eight 310-token
prompts asked twice come back the second time >= 80% cached with unchanged greedy tokens,
while the same server without the tier recomputes them (DESIGN.md §3, "Host tier")."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from pdjax.ports import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = 310


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _serve(model, *extra):
    port = free_port()
    cmd = [sys.executable, "-m", "pdjax.serve", "--model-path", model, "--port", str(port),
           "--dtype", "float32", "--page-size", "16", "--max-total-tokens", "1024",
           "--max-running-requests", "4", "--chunked-prefill-size", "256",
           "--context-length", "512", "--skip-warmup-progress", *extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not start"
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)


def _ask_twice(model, *extra):
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(8)]
    body = {"input_ids": prompts,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    proc, url = _serve(model, *extra)
    try:
        first = _post(url + "/generate", body)
        again = _post(url + "/generate", body)
        load = _get(url + "/get_load")
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            load["metrics"] = r.read().decode()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    ids = [[o["output_ids"] for o in first], [o["output_ids"] for o in again]]
    cached = [[o["meta_info"]["cached_tokens"] for o in first],
              [o["meta_info"]["cached_tokens"] for o in again]]
    return ids, cached, load


def test_a_server_with_the_host_tier_serves_re_asked_prompts_from_it(tiny_checkpoints):
    model = tiny_checkpoints["llama"]
    plain_ids, plain_cached, _ = _ask_twice(model)
    assert plain_ids[0] == plain_ids[1]
    assert plain_cached == [[0] * 8, [0] * 8]            # they evicted each other
    ids, cached, load = _ask_twice(model, "--enable-hierarchical-cache", "--hicache-size", "1")
    assert ids == plain_ids
    assert cached[0] == [0] * 8
    assert all(c >= 0.8 * PROMPT for c in cached[1]), cached[1]
    assert load["hicache_hit_tokens"] >= 5 * 304 and load["hicache_host_pages_pinned"] == 0
    assert load["hicache_host_pages_total"] == (1 << 30) // load["hicache_bytes_per_page"]
    assert f"pdjax:hicache_hit_tokens_total {load['hicache_hit_tokens']}.0" in load["metrics"]
