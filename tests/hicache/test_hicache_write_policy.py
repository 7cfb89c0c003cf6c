"""``--hicache-write-policy`` write_back and write_through_selective (SGLang's policies,
DESIGN.md §3 "Host tier"), on the tiny llama: a 1,024-token device pool that eight 310-token
prompts overflow (as ``test_hicache_engine``).

write_back copies a page to the host only when the device evicts it: after a round, the host
holds exactly the pages the device gave up, and a second round comes back cached with the
greedy tokens of an engine without the tier. write_through_selective copies only pages found
in the device prefix cache at least once: prompts asked once cost no host copy."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_utils import agree, cached_tokens, generate

from pdjax.engine import Engine
from pdjax.kv.prefix_cache import RadixCache
from pdjax.kv.allocator import PageAllocator

PAGE = 16
PROMPT = 310
SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
FULL = (PROMPT - 1) // PAGE * PAGE      # 304
KW = dict(dtype="float32", page_size=PAGE, max_total_tokens=1024, max_running_requests=4,
          chunked_prefill_size=256, context_length=512, progress=False)


def test_the_prefix_cache_reports_each_evicted_leaf_with_its_whole_prefix():
    cache = RadixCache(4, PageAllocator(16))
    seen = []
    cache.on_evict = lambda ids, pages: seen.append((ids, pages))
    a = list(range(1, 13))                                  # 3 pages
    pages = cache.allocator.alloc(3)
    cache.insert(a, pages)
    b = a[:8] + [50, 51, 52, 53]                            # shares 2 pages, 1 of its own
    pb = cache.allocator.alloc(3)
    cache.insert(b, pages[:2] + pb[2:])
    cache.allocator.free(pb[:2])
    assert cache.evict(1) == 1                              # one leaf's last page
    assert len(seen) == 1
    ids, evicted = seen[0]
    assert len(ids) % 4 == 0 and ids[:8] == a[:8] and len(evicted) == 1
    assert evicted[0] in (pages[2], pb[2]) and ids in (a, b)
    assert cache.evict(8) == 3                              # the other leaf, then the shared run
    assert [len(e) for _, e in seen] == [1, 1, 2] and seen[-1][0] == a[:8]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(8)]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, prompts):
    engine = Engine(tiny_checkpoints["llama"], **KW)
    try:
        return generate(engine, prompts, SP)
    finally:
        engine.shutdown()


def _idle(engine):
    sched, conn = engine.core.scheduler, engine.core.scheduler.connector
    engine.core.kv_worker.flush()
    sched.check_invariants()
    conn.index.check()
    assert conn.index.num_pinned == 0 and not sched.waiting_remote and not sched.held


def test_write_back_copies_only_what_the_device_evicts(tiny_checkpoints, prompts, reference):
    engine = Engine(tiny_checkpoints["llama"], enable_hierarchical_cache=True, hicache_ratio=4,
                    hicache_write_policy="write_back", **KW)
    try:
        core = engine.core
        conn, cache = core.scheduler.connector, core.scheduler.prefix_cache
        evicted = []
        inner = cache.on_evict
        cache.on_evict = lambda ids, pages: (evicted.append(len(pages)), inner(ids, pages))
        agree(reference, generate(engine, prompts, SP), "write_back, first time")
        core.kv_worker.flush()
        # Every page the host got, the device evicted (none is written twice); the pages the
        # device still holds are not on the host.
        assert sum(evicted) > 0 and conn.stats.written_pages == sum(evicted)
        assert conn.index.num_used == conn.stats.written_pages
        outs = generate(engine, prompts, SP)
        agree(reference, outs, "write_back, asked again")
        cached = cached_tokens(outs)
        assert cached == [FULL] * 8, cached
        assert conn.stats.loaded_pages * PAGE >= 4 * FULL      # from the host
        _idle(engine)
    finally:
        engine.shutdown()


def test_write_through_selective_copies_only_reused_pages(tiny_checkpoints, prompts, reference):
    engine = Engine(tiny_checkpoints["llama"], enable_hierarchical_cache=True, hicache_ratio=4,
                    hicache_write_policy="write_through_selective", **KW)
    try:
        core = engine.core
        conn = core.scheduler.connector
        agree(reference, generate(engine, prompts, SP), "selective, first time")
        core.kv_worker.flush()
        assert conn.stats.written_pages == 0            # each prompt seen once: no host copy
        # The last prompt is still on the device: asked again it is a device hit, so its
        # pages become worth a copy.
        again = generate(engine, prompts[-1:], SP)
        agree(reference[-1:], again, "selective, the last prompt again")
        assert again[0]["meta_info"]["cached_tokens"] == FULL
        core.kv_worker.flush()
        assert conn.stats.written_pages == FULL // PAGE
        # Pushed off the device by the others, it comes back from the host.
        generate(engine, prompts[:4], SP)
        outs = generate(engine, prompts[-1:], SP)
        agree(reference[-1:], outs, "selective, from the host")
        assert outs[0]["meta_info"]["cached_tokens"] == FULL
        assert conn.stats.loaded_pages >= 1
        _idle(engine)
    finally:
        engine.shutdown()
