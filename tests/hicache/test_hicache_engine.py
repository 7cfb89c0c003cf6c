"""The host tier through ``pdjax.Engine`` on the tiny llama (issue 43's first done-when, at the
engine): a device pool of 1,024 tokens that eight 310-token prompts overflow, so they evict
each other from the device prefix cache. Asked again, they come back from the host tier, with
the greedy tokens of an engine without it, which recomputes them (DESIGN.md §3, "Host tier")."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_utils import agree, cached_tokens, generate

from pdjax.engine import Engine
from pdjax.engine_io import GenerateRequest
from pdjax.request import SamplingParams

PAGE = 16
PROMPT = 310
SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
FULL = (PROMPT - 1) // PAGE * PAGE      # 304: every full page, one prompt token left


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(43)
    return [[int(t) for t in rng.integers(3, 250, PROMPT)] for _ in range(8)]


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    kw = dict(dtype="float32", page_size=PAGE, max_total_tokens=1024, max_running_requests=4,
              chunked_prefill_size=256, context_length=512, progress=False)
    made = {"plain": Engine(tiny_checkpoints["llama"], **kw),
            # 4 x 64 device pages: all eight prompts (19 full pages each) fit on the host
            "tier": Engine(tiny_checkpoints["llama"], enable_hierarchical_cache=True,
                           hicache_ratio=4, **kw),
            # 2 x 64: the host pool overflows too
            "small": Engine(tiny_checkpoints["llama"], enable_hierarchical_cache=True, **kw)}
    yield made
    for e in made.values():
        e.shutdown()


def _parts(engine):
    conn_core = engine.core
    return conn_core.scheduler, conn_core.scheduler.connector, conn_core.kv_worker


def _check_idle(engine):
    sched, conn, worker = _parts(engine)
    sched.check_invariants()
    conn.index.check()
    assert conn.index.num_pinned == 0 and not sched.waiting_remote and not sched.held


def test_prompts_asked_twice_come_back_cached_from_the_host(engines, prompts):
    plain = engines["plain"]
    first = generate(plain, prompts, SP)
    again = generate(plain, prompts, SP)
    agree(first, again, "plain, asked again")
    # Without the tier the prompts evicted each other: all recomputed.
    assert cached_tokens(first) == cached_tokens(again) == [0] * 8

    tier = engines["tier"]
    sched, conn, worker = _parts(tier)
    agree(first, generate(tier, prompts, SP), "tier, first time")
    computed = sched.num_prompt_tokens_computed
    loaded = conn.stats.loaded_pages
    outs = generate(tier, prompts, SP)
    agree(first, outs, "tier, asked again")
    cached = cached_tokens(outs)
    assert all(c >= 0.8 * PROMPT for c in cached), cached
    assert cached == [FULL] * 8
    # Only each prompt's last partial page was computed (6 tokens of 310) ...
    assert sched.num_prompt_tokens_computed - computed == 8 * (PROMPT - FULL)
    # ... the rest came from the host, beyond what the device cache still held.
    from_host = conn.stats.loaded_pages - loaded
    assert from_host * PAGE >= 5 * FULL
    load = tier.core.get_load()
    assert load["hicache_hit_tokens"] == conn.stats.loaded_pages * PAGE
    assert load["hicache_loaded_bytes"] == conn.stats.loaded_pages * worker.pool.bytes_per_page
    assert load["hicache_written_bytes"] > 0 and load["hicache_host_pages_pinned"] == 0
    assert load["hicache_host_pages_used"] <= load["hicache_host_pages_total"] == 4 * 64
    _check_idle(tier)


def test_an_abort_during_a_load_leaks_no_page(engines, prompts):
    tier = engines["tier"]
    core = tier.core
    sched, conn, worker = _parts(tier)
    tier.generate(input_ids=prompts[:3], sampling_params=SP)
    want = generate(engines["plain"], prompts[:3], SP)
    assert sched.prefix_cache.reset()            # the device forgets: only the host has them
    sp = SamplingParams.from_dict(SP)

    # Aborted while its load is in flight (dispatched, not yet reported).
    loaded, dropped = conn.stats.loaded_pages, conn.stats.load_jobs_dropped
    core.add_request(GenerateRequest("load-then-abort", prompts[0], sp))
    core.step()
    assert "load-then-abort" in sched.waiting_remote and worker.num_in_flight == 1
    free_before = sched.allocator.num_free
    core.abort_request("load-then-abort")
    assert sched.allocator.num_free == free_before + FULL // PAGE     # its load's pages
    worker.flush()          # the slots were read; the pages are not written (maybe reused)
    assert conn.stats.load_jobs_dropped == dropped + 1 and conn.stats.loaded_pages == loaded
    while core.has_work:
        core.step()
    core.drain()
    _check_idle(tier)

    # Aborted after admission planned its load, before the worker started it.
    dropped = conn.stats.load_jobs_dropped
    core.add_request(GenerateRequest("plan-then-abort", prompts[1], sp))
    assert sched.schedule() is None              # it waits for its KV: nothing to run
    assert conn.index.num_pinned == FULL // PAGE
    core.abort_request("plan-then-abort")
    assert sched.build_connector_meta(None) is None
    assert conn.stats.load_jobs_dropped == dropped + 1
    _check_idle(tier)

    outs = generate(tier, prompts[:3], SP)
    agree(want, outs, "after the aborts")
    assert cached_tokens(outs) == [FULL] * 3
    _check_idle(tier)


def test_a_full_host_pool_evicts_its_least_recent_pages_and_stays_correct(engines, prompts):
    small = engines["small"]
    sched, conn, worker = _parts(small)
    want = generate(engines["plain"], prompts, SP)
    agree(want, generate(small, prompts, SP), "small host pool, first time")
    worker.flush()
    index = conn.index
    # 8 x 19 pages written into 128 slots: the oldest 24 went, prompt 0's first.
    assert index.num_used == index.num_slots == 128 and index.num_evicted == 8 * 19 - 128
    assert sched.prefix_cache.reset()
    for i, expect in ((3, FULL), (0, 0)):
        outs = generate(small, [prompts[i]], SP)
        agree([want[i]], outs, f"small host pool, prompt {i} again")
        assert cached_tokens(outs) == [expect], i
    _check_idle(small)
    # Everything asked once more: whatever hit or missed, the tokens are unchanged.
    agree(want, generate(small, prompts, SP), "small host pool, all again")
    _check_idle(small)


def test_prefixes_of_prefixes_under_host_pressure_keep_the_tokens(engines, prompts):
    """Prompts cut from three long ones at random lengths, with random tails: a host hit ends
    mid-prompt, on a page another prompt wrote, or past the device hit; three rounds on the
    small host pool, each against the engine without the tier."""
    small = engines["small"]
    sched, conn, _ = _parts(small)
    rng = np.random.default_rng(5)
    loaded = conn.stats.loaded_pages
    for round_ in range(3):
        batch = []
        for _ in range(10):
            base = prompts[int(rng.integers(0, 3))]
            cut = int(rng.integers(20, PROMPT))
            batch.append(base[:cut] + [int(t) for t in rng.integers(3, 250,
                                                                    int(rng.integers(1, 30)))])
        agree(generate(engines["plain"], batch, SP), generate(small, batch, SP), f"round {round_}")
        _check_idle(small)
    assert conn.stats.loaded_pages > loaded          # the host served some of them
