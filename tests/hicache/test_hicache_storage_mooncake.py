"""HiCache's storage tier on the Mooncake store (``--hicache-storage-backend mooncake``): a
``mooncake_master`` on 127.0.0.1 (its HTTP metadata server on), two engines sharing it: the
second finds what the first computed; with the master killed, an engine recomputes, with the
same tokens (DESIGN.md §3, "Storage tier"; issue 43)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from hicache_utils import agree, cached_tokens, generate

from pdjax.engine import Engine
from pdjax.ports import free_port

pytestmark = pytest.mark.slow

PAGE = 16
PROMPT = 310
FULL = (PROMPT - 1) // PAGE * PAGE      # 304
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _master_binary():
    found = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable),
                                                            "mooncake_master")
    # scripts/setup_env.sh installs it (the mooncake extra): missing is a broken set-up.
    assert os.path.exists(found), "mooncake_master is not installed (mooncake-transfer-engine)"
    return found


@pytest.fixture
def master(tmp_path):
    """A mooncake_master on 127.0.0.1: (process, the engines' extra config)."""
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(tmp_path / "master.log", "w")
    proc = subprocess.Popen(
        [_master_binary(), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
         "--enable_metric_reporting=false"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:                          # up once its RPC port and metadata server answer
        assert proc.poll() is None, (tmp_path / "master.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=2).close()
            urllib.request.urlopen(f"http://127.0.0.1:{http}/metadata?key=x", timeout=2)
            break
        except urllib.error.HTTPError:   # 404 for an unknown key: it is up
            break
        except OSError:
            assert time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.2)
    cfg = {"master_server_address": f"127.0.0.1:{rpc}",
           "metadata_server": f"http://127.0.0.1:{http}/metadata",
           "local_hostname": "127.0.0.1", "global_segment_size": 64 << 20,
           "local_buffer_size": 16 << 20}
    yield proc, json.dumps(cfg)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)
    log.close()


def _engine(ckpt, cfg):
    return Engine(ckpt, dtype="float32", page_size=PAGE, max_total_tokens=1024,
                  max_running_requests=4, chunked_prefill_size=256, context_length=512,
                  progress=False, enable_hierarchical_cache=True, hicache_ratio=4,
                  hicache_storage_backend="mooncake", hicache_storage_backend_extra_config=cfg)


def _settle(engine):
    core = engine.core
    core.kv_worker.flush()
    core.kv_worker.storage.flush()
    core.scheduler.check_invariants()
    core.scheduler.connector.index.check()
    assert core.scheduler.connector.index.num_pinned == 0
    return core.get_load()


def test_a_second_engine_finds_what_the_first_computed(tiny_checkpoints, master):
    proc, cfg = master
    rng = np.random.default_rng(243)
    prompts = [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(10)]
    first = _engine(tiny_checkpoints["llama"], cfg)
    second = _engine(tiny_checkpoints["llama"], cfg)
    try:
        ref = generate(first, prompts[:8], SP)
        assert cached_tokens(ref) == [0] * 8
        load = _settle(first)
        assert load["hicache_storage_written_pages"] == 8 * FULL // PAGE
        outs = generate(second, prompts[:8], SP)
        agree(ref, outs, "second engine")
        assert cached_tokens(outs) == [FULL] * 8
        load = _settle(second)
        assert load["num_prompt_tokens_computed"] == 8 * (PROMPT - FULL)
        assert load["hicache_storage_hit_tokens"] == 8 * FULL
        assert load["hicache_storage_errors"] == load["hicache_storage_corrupt_pages"] == 0

        # The master killed: the first engine asks two prompts only the second has seen;
        # the store does not answer, so they are recomputed, with the second's tokens.
        want = generate(second, prompts[8:], SP)
        _settle(second)
        proc.kill()
        proc.wait()
        outs = generate(first, prompts[8:], SP)
        agree(want, outs, "master killed")
        assert cached_tokens(outs) == [0, 0]
        load = _settle(first)
        assert load["hicache_storage_errors"] >= 1
        # Its host tier still serves what it computed.
        agree(ref[:2], generate(first, prompts[:2], SP), "host tier, master killed")
    finally:
        first.shutdown()
        second.shutdown()
