"""The scheduler's remote-KV books (held, waiting_remote) changed only through a connector's
calls and ``reserve_remote`` / ``commit_remote`` / ``drop_remote``, under the invariant check
(pure Python; no JAX)."""

import random

import pytest

from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.sched.kv_connector import KVConnector, KVConnectorOutput, NullConnector
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PS = 4


def _req(rid, n, max_new=4, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 400) for _ in range(n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0))


class _Connector(NullConnector):
    """Holds the rids in ``hold`` at finish, keeps the pages in ``kept``, offers ``external``
    tokens of every prompt; records the calls."""

    def __init__(self, hold=(), external=0):
        self.hold, self.kept, self.external = set(hold), [], external
        self.calls = []

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        self.calls.append(("matched", req.rid, num_computed_tokens))
        return self.external

    def update_state_after_alloc(self, req, num_external_tokens):
        self.calls.append(("alloc", req.rid, num_external_tokens, len(req.pages)))

    def request_finished(self, req):
        return req.rid in self.hold

    def update(self, output):
        self.calls.append(("update", sorted(output.finished_sending),
                           sorted(output.finished_recving)))

    def owned_pages(self):
        return list(self.kept)


def _sched(num_pages=33, connector=None, **kw):
    return Scheduler(SchedulerConfig(num_pages=num_pages, page_size=PS, max_running_requests=4,
                                     chunked_prefill_size=16, **kw), connector=connector)


def _length(req):
    return FinishReason.of_length(len(req.output_ids))


def test_the_null_connector_is_a_kv_connector_and_the_default():
    assert isinstance(NullConnector(), KVConnector) and isinstance(_Connector(), KVConnector)
    s = _sched()
    assert isinstance(s.connector, NullConnector)
    assert not KVConnectorOutput() and KVConnectorOutput(finished_sending={"x"})


def test_views_are_read_only():
    s = _sched()
    req = _req("d", 9)
    assert s.reserve_remote(req)
    assert dict(s.waiting_remote) == {"d": req} and dict(s.held) == {}
    with pytest.raises(TypeError):
        s.waiting_remote["x"] = req        # only the methods change the sets
    with pytest.raises(TypeError):
        s.held["x"] = req


def test_a_request_the_connector_does_not_hold_is_freed_at_finish():
    s = _sched(page_aligned_chunks=True, connector=_Connector(hold=()))
    req = _req("p", 10, max_new=1)
    s.add_request(req)
    batch = s.schedule()
    s.process_results(batch, {0: 7}, _length)
    assert req.state == RequestState.FINISHED and dict(s.held) == {}
    s.update_from_kv_output(KVConnectorOutput(finished_sending={"p"}))     # nothing held
    s.check_invariants()
    assert s.prefix_cache.num_cached_pages == 2 and s.num_used_pages == 2   # 2 full pages


def test_abort_frees_a_request_the_connector_would_hold():
    conn = _Connector(hold={"p"})
    s = _sched(page_aligned_chunks=True, connector=conn)
    req = _req("p", 10, max_new=1)
    s.add_request(req)
    s.check_invariants()
    assert s.abort_request("p") is req
    assert dict(s.held) == {} and s.num_used_pages == 0      # an abort never asks
    s.check_invariants()
    again = _req("p", 10, max_new=1)
    s.add_request(again)                 # the same rid: held at its finish this time
    batch = s.schedule()
    s.process_results(batch, {0: 7}, _length)
    assert dict(s.held) == {"p": again} and again.state == RequestState.FINISHED
    assert s.num_used_pages == 3 and s.prefix_cache.num_evictable_pages == 0
    s.check_invariants()
    s.update_from_kv_output(KVConnectorOutput(finished_sending={"p"}))
    assert dict(s.held) == {} and s.prefix_cache.num_evictable_pages == 2
    assert conn.calls[-1] == ("update", ["p"], [])
    s.check_invariants()


def test_dropped_pages_the_connector_keeps_are_counted_until_freed():
    conn = _Connector()
    s = _sched(connector=conn)
    a, b = _req("a", 9), _req("b", 5, seed=1)
    assert s.reserve_remote(a) and s.reserve_remote(b)
    pages_a = list(a.pages)
    kept = s.drop_remote(a, free=False)
    assert kept == pages_a and a.pages == [] and dict(s.waiting_remote) == {"b": b}
    with pytest.raises(AssertionError, match="pages leaked: 3 missing"):
        s.check_invariants()             # the connector must report what it keeps
    conn.kept = kept
    s.check_invariants()
    with pytest.raises(ValueError, match="no reserved pages"):
        s.drop_remote(a)
    assert dict(s.waiting_remote) == {"b": b}          # the refused call changed nothing
    conn.kept += s.drop_remote(b, free=False)
    assert len(conn.kept) == 5 and s.num_used_pages == 5
    s.check_invariants()
    # Dropped with free=True, a request's pages go straight back to the pool.
    c = _req("c", 6, seed=2)
    assert s.reserve_remote(c) and s.num_used_pages == 7
    assert s.drop_remote(c) and s.num_used_pages == 5
    s.check_invariants()
    assert s.free_pages(conn.kept[:3]) == 3 and s.free_pages(conn.kept[3:]) == 2
    assert s.free_pages([]) == 0
    conn.kept = []
    # Pages of a prompt whose KV never arrived are never cached.
    assert s.num_used_pages == 0 and s.prefix_cache.num_cached_pages == 0
    s.check_invariants()


def test_dropping_a_fully_cached_prompt_keeps_no_page_and_unlocks_the_match():
    s = _sched()
    first = _req("first", 8, max_new=1)
    s.add_request(first)
    batch = s.schedule()
    s.process_results(batch, {0: 5}, _length)
    assert s.prefix_cache.num_cached_pages == 2
    twin = Request("twin", list(first.prompt_ids), SamplingParams(max_new_tokens=2))
    assert s.reserve_remote(twin) and twin.num_cached_tokens == 8 and len(twin.pages) == 2
    assert s.drop_remote(twin, free=False) == []
    s.check_invariants()
    assert s.prefix_cache.num_evictable_pages == 2      # the match was unlocked


def test_admission_waits_for_the_connectors_tokens_then_computes_the_rest():
    conn = _Connector(external=8)
    s = _sched(connector=conn)
    req = _req("r", 11, max_new=2)
    s.add_request(req)
    assert s.schedule() is None                     # admitted; its KV is arriving
    assert dict(s.waiting_remote) == {"r": req} and not s.running and not s.waiting
    assert conn.calls == [("matched", "r", 0), ("alloc", "r", 8, 2)]
    s.check_invariants()
    s.update_from_kv_output(KVConnectorOutput(finished_recving={"r"}))
    assert req.num_computed_tokens == 8 and req.num_cached_tokens_reported == 8
    assert s.prefix_cache.num_cached_pages == 2     # the arrived pages are shared
    batch = s.schedule()
    assert [(r.start, r.num_tokens) for r in batch.rows] == [(8, 3)]
    s.process_results(batch, {0: 7}, lambda r: None)
    assert s.num_prompt_tokens_computed == 3
    s.check_invariants()


def test_an_abort_while_the_kv_arrives_frees_the_pages_and_ignores_the_late_report():
    conn = _Connector(external=4)
    s = _sched(connector=conn)
    req = _req("r", 9)
    s.add_request(req)
    assert s.schedule() is None and s.num_used_pages == 1
    assert s.abort_request("r") is req and dict(s.waiting_remote) == {}
    assert s.num_used_pages == 0 and s.prefix_cache.num_cached_pages == 0
    s.update_from_kv_output(KVConnectorOutput(finished_recving={"r"}))
    assert not s.running
    s.check_invariants()


@pytest.mark.parametrize("external", [3, 8])
def test_a_connector_count_that_is_not_whole_pages_inside_the_prompt_is_refused(external):
    s = _sched(connector=_Connector(external=external))
    s.add_request(_req("r", 8))
    with pytest.raises(ValueError, match="whole pages"):
        s.schedule()


def test_invariants_catch_a_request_in_two_sets():
    s = _sched()
    req = _req("d", 9)
    assert s.reserve_remote(req)
    s.running.append(req)                 # corrupt on purpose: reserved and running at once
    with pytest.raises(AssertionError, match="also runs"):
        s.check_invariants()
