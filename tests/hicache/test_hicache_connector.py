"""The host tier's connector with the real scheduler and no device: what admission finds on
the host, which pages a step writes, loads into the pages the scheduler allocated, and loads
dropped for an aborted request (DESIGN.md §3, "Host tier"; the worker's copies are played by
hand here, the engine tests run them)."""

from pdjax.kv.hicache.connector import HiCacheConnector
from pdjax.kv.hicache.host_pool import HostIndex
from pdjax.kv.hicache.page_hash import page_hashes
from pdjax.request import Request, SamplingParams
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PS = 4
PROMPT = list(range(100, 113))            # 13 tokens: 3 full pages and 1 token


def _setup(slots=8):
    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=PS, chunked_prefill_size=64,
                                      max_context_len=64))
    index = HostIndex(slots)
    conn = HiCacheConnector(sched.kv, index, PS)
    sched.connector = conn
    return sched, conn, index


def _req(rid, ids=PROMPT):
    return Request(rid, list(ids), SamplingParams(max_new_tokens=4, temperature=0.0))


def _write_all(sched, conn, index, batch):
    meta = conn.build_meta(batch)
    for w in meta.writes:
        index.commit(w.path)          # the worker's poll, its bytes landed
    return meta


def test_a_step_writes_the_pages_it_cached_and_a_later_prompt_loads_them():
    sched, conn, index = _setup()
    a = _req("a")
    sched.add_request(a)
    batch = sched.schedule()
    assert [r.num_tokens for r in batch.rows] == [13]
    meta = _write_all(sched, conn, index, batch)
    (job,) = meta.writes
    assert meta.loads == [] and job.pages == a.pages[:3] and job.new == [0, 1, 2]
    assert job.path == page_hashes(PROMPT, PS) and len(set(job.slots)) == 3
    assert conn.build_meta(None) is None                  # the host knows them now
    sched.abort_request("a")
    assert sched.prefix_cache.reset()                     # the device forgets them

    b = _req("b")
    assert conn.get_num_new_matched_tokens(b, 0) == 12    # 3 pages; the 13th token computes
    assert conn.get_num_new_matched_tokens(b, 8) == 4     # past a device hit of 2 pages
    sched.add_request(b)
    assert sched.schedule() is None and "b" in sched.waiting_remote
    assert index.num_pinned == 3
    meta = conn.build_meta(None)
    (load,) = meta.loads
    assert load.req is b and load.pages == b.pages[:3] and load.slots == job.slots
    index.unpin(load.slots)                               # the worker's start
    sched.update_from_kv_output(KVConnectorOutput(finished_recving={"b"}))
    assert b.num_computed_tokens == 12 and b.num_cached_tokens_reported == 12
    batch = sched.schedule()
    assert [(r.start, r.num_tokens) for r in batch.rows] == [(12, 1)]
    sched.check_invariants()
    index.check()


def test_a_page_still_being_written_is_waited_for_not_recomputed():
    sched, conn, index = _setup()
    path = page_hashes(PROMPT, PS)
    index.reserve(path)                                   # copies in flight
    waited = []
    conn.wait_for_writes = lambda: (waited.append(1), index.commit(path))
    assert conn.get_num_new_matched_tokens(_req("x"), 0) == 12 and waited == [1]
    assert conn.get_num_new_matched_tokens(_req("y"), 0) == 12 and waited == [1]


def test_a_load_planned_for_an_aborted_request_is_dropped_and_unpinned():
    sched, conn, index = _setup()
    path = page_hashes(PROMPT, PS)
    index.reserve(path)
    index.commit(path)
    sched.add_request(_req("c"))
    assert sched.schedule() is None and index.num_pinned == 3
    sched.abort_request("c")
    assert conn.build_meta(None) is None
    assert conn.stats.load_jobs_dropped == 1 and index.num_pinned == 0
    sched.check_invariants()
    index.check()


def test_a_host_too_small_for_a_path_writes_its_head():
    sched, conn, index = _setup(slots=2)
    sched.add_request(_req("d"))
    meta = conn.build_meta(sched.schedule())
    (job,) = meta.writes
    assert job.new == [0, 1] and len(job.path) == 2       # the first two pages, chained
    for w in meta.writes:
        index.commit(w.path)
    assert index.match(page_hashes(PROMPT, PS), 0) == 2
