"""The scheduler's remote-KV books (held, waiting_remote) changed only by its one admission
path and its worker's output, under the invariant check (pure Python; no JAX)."""

import random

import pytest

from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.sched.kv_connector import (FirstToken, KVConnector, KVConnectorOutput, NullConnector,
                                      RecvFailure)
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PS = 4


def _req(rid, n, max_new=4, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 400) for _ in range(n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0))


class _Connector(NullConnector):
    """Holds the rids in ``hold`` at finish, keeps the pages in ``kept``, offers ``external``
    tokens of every prompt (or ``external(req, num_local)`` tokens: None for "not yet");
    records the calls."""

    def __init__(self, hold=(), external=0):
        self.hold, self.kept, self.external = set(hold), [], external
        self.calls = []

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        self.calls.append(("matched", req.rid, num_computed_tokens))
        if callable(self.external):
            return self.external(req, num_computed_tokens)
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


def _whole(req, num_local):
    """A connector answer: the rest of ``req``'s prompt arrives (a PD decode)."""
    return req.num_prompt_tokens - num_local


def test_views_are_read_only():
    s = _sched(connector=_Connector(external=_whole))
    req = _req("d", 9)
    s.add_request(req)
    assert s.schedule() is None
    assert dict(s.waiting_remote) == {"d": req} and dict(s.held) == {}
    with pytest.raises(TypeError):
        s.waiting_remote["x"] = req        # only the scheduler changes the sets
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


def test_failed_kv_pages_stay_held_when_the_connector_keeps_them_and_are_never_cached():
    """A request whose KV will not come ends with the connector's error; the connector keeps
    the pages of one a late write may still hit (held until ``finished_sending``), the
    other's go back at once; neither prompt's pages ever enter the prefix cache."""
    conn = _Connector(hold={"a"}, external=_whole)
    s = _sched(connector=conn)
    a, b = _req("a", 9), _req("b", 5, seed=1)
    s.add_request(a)
    s.add_request(b)
    assert s.schedule() is None and dict(s.waiting_remote) == {"a": a, "b": b}
    assert s.num_used_pages == 5                       # 3 + 2 prompt pages
    changed = s.update_from_kv_output(KVConnectorOutput(failed_recving={
        "a": RecvFailure("transfer timeout", None), "b": RecvFailure("bad room", 400)}))
    assert changed == [a, b] and not s.waiting_remote and not s.requests
    assert a.error == "transfer timeout" and a.finish_reason.status is None
    assert b.error == "bad room" and b.finish_reason.status == 400
    assert dict(s.held) == {"a": a} and s.num_used_pages == 3
    s.check_invariants()
    s.update_from_kv_output(KVConnectorOutput(finished_sending={"a"}))
    assert s.num_used_pages == 0 and s.prefix_cache.num_cached_pages == 0
    # A late report for a request that ended is ignored.
    assert s.update_from_kv_output(KVConnectorOutput(finished_recving={"a"},
                                                     first_tokens={"a": FirstToken(5)})) == []
    assert not s.running
    s.check_invariants()


def test_a_failed_prompt_that_matched_the_prefix_cache_unlocks_the_match():
    s = _sched(connector=_Connector(external=0))
    first = _req("first", 8, max_new=1)
    s.add_request(first)
    batch = s.schedule()
    s.process_results(batch, {0: 5}, _length)
    assert s.prefix_cache.num_cached_pages == 2
    s.connector = conn = _Connector(external=_whole)
    twin = Request("twin", list(first.prompt_ids), SamplingParams(max_new_tokens=2))
    s.add_request(twin)
    assert s.schedule() is None
    # Nothing is computed for a whole-prompt admission: it uses every full page of the prompt
    # the cache holds, the last one too (the rest of the prompt is then 0 tokens).
    assert conn.calls == [("matched", "twin", 4), ("alloc", "twin", 0, 2)]
    assert twin.num_cached_tokens == 8 and s.prefix_cache.num_evictable_pages == 0
    s.update_from_kv_output(KVConnectorOutput(failed_recving={"twin": RecvFailure("x")}))
    s.check_invariants()
    assert s.prefix_cache.num_evictable_pages == 2 and s.num_used_pages == 2


def test_a_whole_prompt_runs_from_the_first_token_the_worker_reports():
    """PD decode: the prompt is never computed here; the request joins the running batch with
    the prefill's first token (and its logprobs) and decodes from its second token."""
    conn = _Connector(external=_whole)
    s = _sched(connector=conn)
    req = Request("d", list(range(10, 19)), SamplingParams(max_new_tokens=4, temperature=0),
                  return_logprob=True, top_logprobs_num=1)
    s.add_request(req)
    assert s.schedule() is None and conn.calls[-1] == ("alloc", "d", 9, 3)
    assert s.update_from_kv_output(KVConnectorOutput()) == []       # nothing yet
    first = FirstToken(42, logprob=-0.5, top_logprobs=((42, -0.5), (7, -1.0)), cached_tokens=8)
    changed = s.update_from_kv_output(KVConnectorOutput(finished_recving={"d"},
                                                        first_tokens={"d": first}),
                                      stop_check=lambda r: None)
    assert changed == [req] and s.running == [req] and not s.waiting_remote
    assert req.output_ids == [42] and req.num_computed_tokens == 9
    assert req.output_logprobs == [-0.5] and req.output_top_logprobs == [[(42, -0.5)]]
    assert req.num_cached_tokens_reported == 8
    batch = s.schedule()
    assert batch.forward_mode == "decode" and [(r.start, r.num_tokens) for r in batch.rows] == [(9, 1)]
    s.process_results(batch, {0: 7}, lambda r: None)
    assert s.num_prompt_tokens_computed == 0 and req.output_ids == [42, 7]
    s.check_invariants()


def test_a_first_token_that_stops_the_request_finishes_it_and_nothing_to_decode_frees_it():
    s = _sched(connector=_Connector(external=_whole))
    stopped, zero = _req("stop", 9), _req("zero", 6, max_new=0, seed=1)
    s.add_request(stopped)
    s.add_request(zero)
    s.schedule()
    out = KVConnectorOutput(finished_recving={"stop", "zero"},
                            first_tokens={"stop": FirstToken(2), "zero": FirstToken(3)})
    changed = s.update_from_kv_output(out, stop_check=lambda r: FinishReason.stop(2))
    assert sorted(r.rid for r in changed) == ["stop", "zero"]
    assert stopped.state == RequestState.FINISHED and stopped.output_ids == [2]
    assert zero.state == RequestState.FINISHED and zero.output_ids == []
    assert zero.finish_reason.length == 0 and not s.running and not s.requests
    # The stopped one's two full prompt pages went into the prefix cache, the rest is free.
    assert s.num_used_pages == s.prefix_cache.num_evictable_pages == 2
    s.check_invariants()


def test_a_whole_prompt_without_its_first_token_fails_the_request():
    s = _sched(connector=_Connector(external=_whole))
    req = _req("d", 9)
    s.add_request(req)
    s.schedule()
    (changed,) = s.update_from_kv_output(KVConnectorOutput(finished_recving={"d"}))
    assert changed is req and "without its first token" in req.error
    assert s.num_used_pages == 0 and not s.running
    s.check_invariants()


def test_not_yet_skips_a_request_and_the_queue_goes_on():
    """A request whose connector does not know yet (a decode still pairing) stays queued
    without holding back the ones after it, and gives the engine no reason to step."""
    ready = set()
    conn = _Connector(external=lambda r, local: (r.num_prompt_tokens - local
                                                 if r.rid in ready else None))
    s = _sched(connector=conn)
    a, b = _req("a", 9), _req("b", 5, seed=1)
    s.add_request(a)
    s.add_request(b)
    assert s.has_work
    assert s.schedule() is None and not s.waiting_remote
    assert list(s.waiting) == [a, b] and not s.has_work
    ready.add("b")
    s.schedule()
    assert dict(s.waiting_remote) == {"b": b} and list(s.waiting) == [a]
    ready.add("a")
    s.schedule()
    assert set(s.waiting_remote) == {"a", "b"} and not s.waiting
    s.check_invariants()


def test_arrived_requests_wait_for_a_running_slot_and_in_flight_admissions_are_capped():
    conn = _Connector(external=_whole)
    s = _sched(connector=conn)              # max_running_requests 4
    reqs = [_req(f"r{i}", 5, seed=i) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    s.schedule()
    assert list(s.waiting_remote) == ["r0", "r1", "r2", "r3"] and len(s.waiting) == 2
    out = KVConnectorOutput(finished_recving={"r0", "r1", "r2", "r3"},
                            first_tokens={f"r{i}": FirstToken(9) for i in range(4)})
    s.update_from_kv_output(out)
    assert [r.rid for r in s.running] == ["r0", "r1", "r2", "r3"]
    s.schedule()                            # admitted while all four run
    assert list(s.waiting_remote) == ["r4", "r5"]
    out = KVConnectorOutput(finished_recving={"r4", "r5"},
                            first_tokens={"r4": FirstToken(9), "r5": FirstToken(9)})
    assert s.update_from_kv_output(out) == []          # no slot: they wait, in order
    assert list(s.remote.arrived) == ["r4", "r5"]
    s.abort_request("r1")
    assert [r.rid for r in s.update_from_kv_output(None)] == ["r4"]
    s.check_invariants()


def test_the_decode_reservation_keeps_pages_for_tokens_to_come():
    """With ``num_reserved_decode_tokens`` a whole-prompt admission also needs free pages for
    the decode tokens of every running and arriving request; alone, a request is admitted
    without them (it could never fit otherwise)."""
    conn = _Connector(external=_whole)
    s = _sched(num_pages=12, connector=conn, num_reserved_decode_tokens=8)   # 11 usable
    a = _req("a", 16, max_new=20)
    s.add_request(a)
    s.schedule()
    assert dict(s.waiting_remote) == {"a": a} and s.num_used_pages == 4   # 4 + 2 reserved free
    b = _req("b", 12, max_new=20, seed=1)   # 3 pages + 2 for b + 2 for a = 7 > 7 free? no: 7
    s.add_request(b)
    s.schedule()
    assert "b" in s.waiting_remote and s.num_used_pages == 7
    c = _req("c", 8, max_new=20, seed=2)    # 2 pages + 2 x 3 reserved = 8 > 4 free
    s.add_request(c)
    s.schedule()
    assert "c" not in s.waiting_remote and list(s.waiting) == [c]
    assert s.remote.reserved_decode_pages(c, []) == 2 + 2 + 2
    s.check_invariants()


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


@pytest.mark.parametrize("external", [3, 9])
def test_a_connector_count_that_is_not_whole_pages_inside_the_prompt_is_refused(external):
    s = _sched(connector=_Connector(external=external))
    s.add_request(_req("r", 8))
    with pytest.raises(ValueError, match="whole pages"):
        s.schedule()


def test_invariants_catch_a_request_in_two_sets():
    s = _sched(connector=_Connector(external=_whole))
    req = _req("d", 9)
    s.add_request(req)
    s.schedule()
    s.running.append(req)                 # corrupt on purpose: reserved and running at once
    with pytest.raises(AssertionError, match="also runs"):
        s.check_invariants()


def test_a_request_for_prompt_logprobs_takes_a_whole_prompt_but_computes_a_partial_one():
    """A PD decode's request may ask for prompt logprobs (the router merges the prefill's):
    its whole prompt still comes from the connector (it hung, the prefill waiting for a page
    list the decode never sent). A part of a prompt is not taken for such a request: the
    logprobs of those positions need the prompt computed here."""
    def want(req):
        return Request(req.rid, req.prompt_ids, req.sampling_params, return_logprob=True,
                       logprob_start_len=0)

    s = _sched(connector=_Connector(external=_whole))
    req = want(_req("d", 9))
    s.add_request(req)
    assert s.schedule() is None and dict(s.waiting_remote) == {"d": req}
    conn = _Connector(external=4)
    s = _sched(connector=conn)
    req = want(_req("p", 9))
    s.add_request(req)
    batch = s.schedule()
    assert not s.waiting_remote and [(r.start, r.num_tokens) for r in batch.rows] == [(0, 9)]
    assert conn.calls == [("matched", "p", 0), ("matched", "p", 0), ("alloc", "p", 0, 0)]
    s.check_invariants()
