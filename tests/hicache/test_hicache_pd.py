"""HiCache's tiers on a PD prefill server (``--role prefill --enable-hierarchical-cache``,
with the ``file`` storage tier): eight 310-token prompts over a 1,024-token prefill pool, sent
through a prefill and a decode server (real processes on 127.0.0.1) twice: the second time the
prefill loads them from its host tier (a tier hit is a prefix hit), the tokens unchanged; then
a restarted prefill finds them in the store (DESIGN.md §3, "Host tier"; issue 43)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_harness import (free_port, get, load, metric_value, pd_pair, pd_server,  # noqa: E402
                        running)

pytestmark = pytest.mark.slow

PAGE = 16
PROMPT = 310
FULL = (PROMPT - 1) // PAGE * PAGE      # 304
ARGS = dict(page_size=PAGE, max_total_tokens=1024, chunked_prefill_size=256,
            max_running_requests=4, context_length=512)


def _round(prefill, decode, bport, prompts, room0):
    outs = [pd_pair(prefill, decode, bport, ids, room0 + i, 8) for i, ids in enumerate(prompts)]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def test_a_prefill_with_the_tiers_serves_re_asked_prompts_from_them(tiny_checkpoints,
                                                                     tmp_path):
    model = tiny_checkpoints["llama"]
    logs = str(tmp_path)
    rng = np.random.default_rng(343)
    prompts = [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(8)]
    store = json.dumps({"path": str(tmp_path / "store")})
    tier = ["--enable-hierarchical-cache", "--hicache-ratio", "4",
            "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", store]
    bport = free_port()
    decode = pd_server("decode", "decode", model, logs, **ARGS)
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, extra=tier,
                        **ARGS)
    with running([decode, prefill]):
        first, cached0 = _round(prefill, decode, bport, prompts, 1000)
        before = load(prefill)
        again, cached1 = _round(prefill, decode, bport, prompts, 2000)
        after = load(prefill)
        assert again == first
        assert cached0 == [0] * 8
        assert all(c >= 0.8 * PROMPT for c in cached1), cached1
        # The prefill's host tier served them (the device pool holds three at most).
        assert after["hicache_hit_tokens"] - before["hicache_hit_tokens"] >= 5 * FULL
        assert after["hicache_host_pages_pinned"] == 0
        assert after["hicache_storage_written_pages"] == 8 * FULL // PAGE

        # A restarted prefill (empty device and host) finds them in the store.
        prefill.stop()
        bport2 = free_port()
        prefill2 = pd_server("prefill2", "prefill", model, logs, bootstrap_port=bport2,
                             extra=tier, **ARGS)
        with running([prefill2]):
            third, cached2 = _round(prefill2, decode, bport2, prompts, 3000)
            got = load(prefill2)
            status, metrics = get(prefill2.url + "/metrics")
        assert status == 200
        # /metrics per tier: the store's hits and bytes, the host's loads.
        assert metric_value(metrics, "pdjax:hicache_storage_hit_tokens_total") == \
            got["hicache_storage_hit_tokens"]
        assert metric_value(metrics, "pdjax:hicache_storage_read_bytes_total") == \
            got["hicache_storage_read_bytes"]
        assert metric_value(metrics, "pdjax:hicache_hit_tokens_total") == got["hicache_hit_tokens"]
        assert metric_value(metrics, "pdjax:hicache_storage_read_seconds_count") >= 5
        assert third == first
        assert all(c >= 0.8 * PROMPT for c in cached2), cached2
        assert got["hicache_storage_hit_tokens"] >= 5 * FULL
        assert got["hicache_host_pages_pinned"] == 0
