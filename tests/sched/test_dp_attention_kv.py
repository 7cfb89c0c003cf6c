"""DP attention's pages (``sched/dp_kv_cache_manager.py``) under the scheduler, pure Python:
each rank's own pages and null page, least-loaded and prefix-aware rank assignment, a
request's pages all on its rank, per-rank room for decode rows, and the books that
``check_invariants`` keeps with every rank's null page excluded."""

import random

import pytest

from pdjax.request import Request, SamplingParams
from pdjax.sched.dp_batch import local_rows
from pdjax.sched.batch import BatchRow
from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager, RankedPageAllocator
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

NP = 8          # pages per rank
PS = 4


def _req(rid, ids, max_new=3):
    return Request(rid, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0))


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 100) for _ in range(n)]


def _sched(dp=4, **kw):
    kv = DpKVCacheManager(dp, NP, PS)
    cfg = SchedulerConfig(num_pages=dp * NP, page_size=PS, chunked_prefill_size=64, **kw)
    return Scheduler(cfg, kv=kv), kv


def _stop(req):
    if len(req.output_ids) >= req.sampling_params.max_new_tokens:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def _run(sched, on_batch=None):
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        steps += 1
        assert steps < 1000
        if batch is None:
            continue
        if on_batch:
            on_batch(batch)
        sched.process_results(batch, {i: 5 + i for i, r in enumerate(batch.rows) if r.samples},
                              _stop)
        sched.check_invariants()


def test_allocator_ranks_and_null_pages():
    a = RankedPageAllocator(3, 4)
    assert a.num_free == 9 and a.null_pages == {0, 4, 8}
    assert a.alloc(2, rank=1) == [5, 6] and a.alloc(3, rank=2) == [9, 10, 11]
    assert a.alloc(2, rank=2) is None and a.num_free_on(2) == 0
    with pytest.raises(ValueError, match="page 4 is a null page"):
        a.free([5, 4])
    assert not a.is_free(5)                      # nothing changed
    a.free([6, 9])
    assert a.free_pages() == {1, 2, 3, 6, 7, 9}


def test_fewer_requests_than_ranks_each_on_its_own_rank():
    """Three requests on four ranks: least loaded puts each on a rank of its own, every
    page of a request on its rank; rank 3 stays idle."""
    sched, kv = _sched()
    reqs = [_req(f"r{i}", _ids(6 + i, i)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    seen = {}

    def on_batch(batch):
        rows = [BatchRow(r.token_ids, r.start, r.req.pages) for r in batch.rows]
        _, ranks = local_rows(rows, NP)              # ValueError if a row spans ranks
        for r, rank in zip(batch.rows, ranks):
            seen.setdefault(r.req.rid, set()).add(rank)
        loads = kv.rank_load()
        assert loads[3]["num_requests"] == 0 and loads[3]["num_used_pages"] == 0

    _run(sched, on_batch)
    assert seen == {"r0": {0}, "r1": {1}, "r2": {2}}
    assert all(len(r.output_ids) == 3 for r in reqs)


def test_prefix_aware_assignment():
    """A request whose prompt's first pages are cached on rank 1 runs there, reusing them,
    although rank 0 is less loaded."""
    sched, kv = _sched(dp=2)
    shared = _ids(12, 7)                                  # three full pages
    sched.add_request(_req("busy", _ids(5, 1), max_new=50))
    sched.add_request(_req("first", shared + [1, 2]))
    batch = sched.schedule()
    sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    assert kv.rank_of(sched.requests["busy"]) == 0 and kv.rank_of(sched.requests["first"]) == 1
    while "first" in sched.requests:
        batch = sched.schedule()
        sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples},
                              _stop)
    # rank 1 now has no request and its cached prefix; rank 0 has "busy"
    second = _req("second", shared + [9, 9, 9])
    sched.add_request(second)
    batch = sched.schedule()
    assert kv.rank_of(second) == 1 and second.num_cached_tokens == 12
    assert all(p // NP == 1 for p in second.pages)
    sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    sched.check_invariants()


def test_a_full_rank_does_not_borrow_another_ranks_pages():
    """Two ranks of 7 usable pages; a request needing 6 pages admitted on rank 0 and one on
    rank 1: a third that needs 3 pages waits (no rank has room) rather than taking pages of
    two ranks; it runs once one finishes."""
    sched, kv = _sched(dp=2)
    a, b, c = _req("a", _ids(20, 1), 2), _req("b", _ids(20, 2), 2), _req("c", _ids(9, 3), 2)
    for r in (a, b, c):
        sched.add_request(r)
    batch = sched.schedule()
    assert {r.req.rid for r in batch.rows} == {"a", "b"}
    assert {kv.rank_of(a), kv.rank_of(b)} == {0, 1}
    sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    _run(sched)
    assert len(c.output_ids) == 2


def test_full_prefix_rank_falls_back_to_a_rank_with_room():
    """The prefix of C is cached on rank 0, which A (running, its 4 pages) leaves 3 free
    pages of 7; C needs 4 more there but 7 in all, and rank 1 has 7 free: C runs on rank 1,
    computing its prefix again, instead of waiting for A."""
    sched, kv = _sched(dp=2, enable_mixed_chunk=True)
    shared = _ids(12, 7)
    a = _req("a", shared + [1, 2], max_new=50)
    sched.add_request(a)
    batch = sched.schedule()
    sched.process_results(batch, {0: 5}, _stop)
    assert kv.rank_of(a) == 0 and len(a.pages) == 4
    c = _req("c", shared + _ids(12, 8))                      # 24 tokens: 7 pages with the next
    sched.add_request(c)
    sched.schedule()
    assert c in sched.running and kv.rank_of(c) == 1
    assert c.num_cached_tokens == 0 and all(p // NP == 1 for p in c.pages)
    sched.check_invariants()


def test_each_rank_has_its_own_step_budget():
    """Per-rank step budgets: the bucket is sized by the busiest rank, so each rank takes
    ``chunked_prefill_size`` tokens of its own in a step (the group's one budget let 2
    prompts on 2 ranks take 16 tokens in all, one rank idle); a rank's chunked prompt closes
    only that rank's prefill; decode rows spend their own rank's budget."""
    kv = DpKVCacheManager(2, 16, PS)
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=PS, chunked_prefill_size=16,
                                      enable_mixed_chunk=True, dp_size=2), kv=kv)
    a, b, c = _req("a", _ids(30, 1), max_new=8), _req("b", _ids(30, 2), max_new=8), \
        _req("c", _ids(6, 3), max_new=8)
    for r in (a, b, c):
        sched.add_request(r)
    batch = sched.schedule()
    got = [(r.req.rid, kv.rank_of(r.req), r.num_tokens) for r in batch.rows]
    assert got == [("a", 0, 16), ("b", 1, 16)], got     # c waits: both ranks' budgets spent
    sched.process_results(batch, {}, _stop)
    batch = sched.schedule()
    got = [(r.req.rid, kv.rank_of(r.req), r.num_tokens) for r in batch.rows]
    # a and b finish their prompts (14 each); c joins the least loaded rank with what is left
    assert got == [("a", 0, 14), ("b", 1, 14), ("c", 0, 2)], got
    sched.process_results(batch, {i: 7 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    batch = sched.schedule()
    got = [(r.req.rid, r.num_tokens) for r in batch.rows]
    assert got == [("a", 1), ("b", 1), ("c", 4)], got   # decode rows, c's last 4 on rank 0
    sched.check_invariants()


def test_a_rank_that_cannot_take_a_chunk_does_not_stop_the_other_ranks_prefill():
    """Under DP attention a prompt whose chunk cannot run on its rank this step (its rank's
    budget left under a page with page-aligned chunks, or its rank's pool full) closes that
    rank's prefill only: the scheduler stopped every rank's prefill there, so a prompt on an
    idle rank waited a step for nothing."""
    ps = 8
    kv = DpKVCacheManager(2, 16, ps)
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=ps, chunked_prefill_size=8,
                                      enable_mixed_chunk=True, page_aligned_chunks=True,
                                      dp_size=2), kv=kv)
    shared = _ids(16, 1)
    x = _req("x", shared, max_new=8)
    sched.add_request(x)
    for _ in range(2):                       # x's 16 prompt tokens, 8 a step, then its token
        batch = sched.schedule()
        sched.process_results(batch, {i: 7 for i, r in enumerate(batch.rows) if r.samples},
                              _stop)
    assert x.output_ids and kv.rank_of(x) == 0
    a = _req("a", shared + _ids(16, 2), max_new=8)    # its prefix is cached on rank 0
    b = _req("b", _ids(20, 3), max_new=8)
    sched.add_request(a)
    sched.add_request(b)
    batch = sched.schedule()
    got = [(r.req.rid, kv.rank_of(r.req), r.num_tokens) for r in batch.rows]
    # rank 0: x's decode row leaves 7 tokens, under a page: a (past its 16 cached tokens) gets
    # no page-aligned chunk; rank 1 is free for b's first chunk
    assert kv.rank_of(a) == 0
    assert got == [("x", 0, 1), ("b", 1, 8)], got
    sched.check_invariants()
