"""The ``file`` storage tier through the HTTP API of real ``pdjax.serve`` processes: a
restarted server with the same folder finds the eight 310-token prompts (>= 80% cached,
unchanged greedy tokens); its folder removed at runtime, it still answers every request
(recomputed, never a 500) with the same tokens (DESIGN.md §3, "Storage tier"; issue 43)."""

import json
import shutil
import urllib.request

import numpy as np
import pytest

from test_hicache_server import PROMPT, _get, _post, _serve

pytestmark = pytest.mark.slow

SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _stop(proc):
    proc.terminate()
    proc.wait(timeout=60)
    out = proc.stdout.read()
    proc.stdout.close()
    return out


def _ask(url, prompts):
    outs = _post(url + "/generate", {"input_ids": prompts, "sampling_params": SP})
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def test_a_restarted_server_finds_the_store_and_survives_its_removal(tiny_checkpoints,
                                                                     tmp_path):
    model = tiny_checkpoints["llama"]
    rng = np.random.default_rng(443)
    prompts = [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(10)]
    store = tmp_path / "store"
    tier = ("--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-storage-backend",
            "file", "--hicache-storage-backend-extra-config", json.dumps({"path": str(store)}))
    proc, url = _serve(model, *tier)
    try:
        first, cached = _ask(url, prompts[:8])
        assert cached == [0] * 8
    finally:
        _stop(proc)
    proc, url = _serve(model, *tier)
    try:
        again, cached = _ask(url, prompts[:8])
        assert again == first
        assert all(c >= 0.8 * PROMPT for c in cached), cached
        load = _get(url + "/get_load")
        assert load["hicache_storage_hit_tokens"] >= 8 * 304
        shutil.rmtree(store)
        # Two new prompts (the store cannot be read or written) and the eight again.
        later, cached = _ask(url, prompts[8:] + prompts[:8])
        assert later[2:] == first and cached[:2] == [0, 0]
        load = _get(url + "/get_load")
        assert load["hicache_storage_errors"] >= 1 and load["hicache_host_pages_pinned"] == 0
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
    finally:
        log = _stop(proc)
    assert "HiCache storage tier: write failed" in log
    assert not store.exists()
