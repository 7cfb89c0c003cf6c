"""The scheduler's PD page sets (hold, reserve, commit, release, quarantine) through its
methods only, under the invariant check (pure Python; no JAX)."""

import dataclasses
import random

import pytest

from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PS = 4


def _req(rid, n, max_new=4, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 400) for _ in range(n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0))


def _sched(num_pages=33, **kw):
    return Scheduler(SchedulerConfig(num_pages=num_pages, page_size=PS, max_running_requests=4,
                                     chunked_prefill_size=16, **kw))


def _length(req):
    return FinishReason.of_length(len(req.output_ids))


def test_views_are_read_only():
    s = _sched()
    req = _req("d", 9)
    assert s.reserve_prebuilt(req)
    assert dict(s.prealloc) == {"d": req} and dict(s.held) == {}
    with pytest.raises(TypeError):
        s.prealloc["x"] = req        # only the methods change the sets
    with pytest.raises(TypeError):
        s.held["x"] = req


def test_hold_then_cancel_frees_at_finish():
    s = _sched(page_aligned_chunks=True)
    req = _req("p", 10, max_new=1)
    s.hold_on_finish("p")
    s.add_request(req)
    s.cancel_hold("p")
    batch = s.schedule()
    s.process_results(batch, {0: 7}, _length)
    assert req.state == RequestState.FINISHED and dict(s.held) == {}
    assert not s.release_held("p")
    s.check_invariants()
    assert s.prefix_cache.num_cached_pages == 2 and s.num_used_pages == 2   # 2 full pages


def test_abort_drops_the_hold_mark():
    s = _sched(page_aligned_chunks=True)
    req = _req("p", 10, max_new=1)
    s.hold_on_finish("p")
    s.add_request(req)
    s.check_invariants()
    assert s.abort_request("p") is req
    s.check_invariants()                 # no hold mark outlives its request
    again = _req("p", 10, max_new=1)
    s.add_request(again)                 # the same rid, not held this time
    batch = s.schedule()
    s.process_results(batch, {0: 7}, _length)
    assert dict(s.held) == {} and again.state == RequestState.FINISHED
    s.check_invariants()


def test_quarantine_key_rules():
    s = _sched()
    a, b = _req("a", 9), _req("b", 5, seed=1)
    assert s.reserve_prebuilt(a) and s.reserve_prebuilt(b)
    with pytest.raises(ValueError, match="quarantine_key"):
        s.quarantine_prebuilt(a, None)
    pages_a = list(a.pages)
    assert s.quarantine_prebuilt(a, (5, 0)) == pages_a and a.pages == []
    assert s.has_quarantine and s.num_quarantined_pages == 3
    with pytest.raises(ValueError, match="already in use"):
        s.quarantine_prebuilt(b, (5, 0))
    assert dict(s.prealloc) == {"b": b}          # the refused call changed nothing
    s.check_invariants()
    assert len(s.quarantine_prebuilt(b, (5, 1))) == 2 and s.num_quarantined_pages == 5
    assert s.release_quarantine((5, 0)) == 3 and s.release_quarantine((5, 1)) == 2
    assert not s.has_quarantine and s.num_used_pages == 0
    s.check_invariants()


def test_quarantine_of_a_fully_cached_prompt_holds_no_page_but_stays_open():
    s = _sched()
    first = _req("first", 8, max_new=1)
    s.add_request(first)
    batch = s.schedule()
    s.process_results(batch, {0: 5}, _length)
    assert s.prefix_cache.num_cached_pages == 2
    twin = Request("twin", list(first.prompt_ids), SamplingParams(max_new_tokens=2))
    assert s.reserve_prebuilt(twin) and twin.num_cached_tokens == 8 and len(twin.pages) == 2
    assert s.quarantine_prebuilt(twin, (1, 0)) == []
    assert s.has_quarantine and s.num_quarantined_pages == 0
    s.check_invariants()
    assert s.release_quarantine((1, 0)) == 0 and not s.has_quarantine
    assert s.prefix_cache.num_evictable_pages == 2      # the match was unlocked


def test_decode_reserve_pages_counts_running_and_reserved():
    s = _sched()
    running = _req("run", 6, max_new=30)
    assert s.reserve_prebuilt(running)
    s.add_prebuilt(running, 11)                      # 1 output token: 29 left, cap 16
    reserved = _req("res", 6, max_new=5)              # none yet (counts 1): 4 left -> 1 page
    assert s.reserve_prebuilt(reserved)
    new = _req("new", 6, max_new=None)                # no limit: the cap, 16 -> 4 pages
    new.sampling_params = dataclasses.replace(new.sampling_params, max_new_tokens=None)
    assert s.decode_reserve_pages(new, 16) == 4 + 4 + 1
    assert s.decode_reserve_pages(new, 3) == 1 + 1 + 1
    one = _req("one", 6, max_new=1)                   # the prefill's token is its only one
    assert s.decode_reserve_pages(one, 16) == 0 + 4 + 1
    s.check_invariants()


def test_invariants_catch_a_request_in_two_sets():
    s = _sched()
    req = _req("d", 9)
    assert s.reserve_prebuilt(req)
    s.requests["d"] = req                 # corrupt on purpose: reserved and scheduled at once
    with pytest.raises(AssertionError, match="held or reserved"):
        s.check_invariants()
