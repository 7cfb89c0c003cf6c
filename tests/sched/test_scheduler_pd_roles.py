"""The scheduler as the PD roles use it, without a transfer: held pages outlive a finish
(``request_finished``) until ``finished_sending``; a decode's whole-prompt admission, its first
token and the prefix cache after it; the decode reservation's arithmetic; a lone decode
request the scheduler finishes inside ``schedule()`` handed back for its final output; the
reported cached tokens (the prefill's hit). Pure Python; no JAX."""

import dataclasses

import numpy as np
import pytest

from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.sched.kv_connector import KVConnectorOutput, NullConnector
from pdjax.sched.scheduler import Scheduler, SchedulerConfig
from kv_fakes import WholePromptConnector, admit_whole, arrive

PS = 4


def _req(rid, n, max_new=4, seed=0, ignore_eos=False):
    rng = np.random.default_rng(seed)
    return Request(rid, [int(t) for t in rng.integers(3, 400, n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                  ignore_eos=ignore_eos))


class _Holding(NullConnector):
    """Holds every finished request (the prefill role's ``request_finished``) and keeps the
    pages in ``kept`` (the decode role's quarantine)."""

    def __init__(self):
        self.kept = []

    def request_finished(self, req):
        return True

    def owned_pages(self):
        return list(self.kept)


def _sched(num_pages=33, connector=None, **kw):
    return Scheduler(SchedulerConfig(num_pages=num_pages, page_size=PS, max_running_requests=4,
                                     chunked_prefill_size=16, **kw), connector=connector)


def test_held_pages_outlive_the_finish_until_released():
    s = _sched(page_aligned_chunks=True, connector=_Holding())
    req = _req("p", 10, max_new=1)
    s.add_request(req)
    batch = s.schedule()
    assert [(r.start, r.num_tokens) for r in batch.rows] == [(0, 10)]
    s.process_results(batch, {0: 7}, lambda r: {"type": "length", "length": 1})
    assert req.state == RequestState.FINISHED and s.held == {"p": req}
    assert len(req.pages) == 3 and s.num_used_pages == 3
    s.check_invariants()
    # The two full pages were shared when scheduled; the hold keeps them locked.
    assert s.prefix_cache.num_cached_pages == 2 and s.prefix_cache.num_evictable_pages == 0
    assert s.prefix_cache.evict(5) == 0
    s.update_from_kv_output(KVConnectorOutput(finished_sending={"p"}))
    assert dict(s.held) == {}
    s.update_from_kv_output(KVConnectorOutput(finished_sending={"p"}))   # twice: no-op
    s.check_invariants()
    assert s.prefix_cache.num_cached_pages == 2        # the two full pages, now evictable
    assert s.prefix_cache.num_evictable_pages == 2


def test_prebuilt_request_joins_decode_without_prompt_compute():
    s = _sched(connector=WholePromptConnector())
    req = _req("d", 9, max_new=3)
    admit_whole(s, req)
    assert len(req.pages) == 3 and req.num_cached_tokens == 0
    assert s.waiting_remote == {"d": req}
    s.check_invariants()
    arrive(s, req, 42)
    assert req.output_ids == [42] and req.num_computed_tokens == 9
    batch = s.schedule()
    assert batch.forward_mode == "decode" and [(r.start, r.num_tokens) for r in batch.rows] == [(9, 1)]
    s.process_results(batch, {0: 43}, lambda r: None)
    s.check_invariants()
    assert s.num_prompt_tokens_computed == 0
    # A second prompt sharing two full pages hits the prefix cache after the first finishes.
    first_pages = list(req.pages[:2])
    s.finish_request(req, FinishReason.of_length(2))
    twin = Request("t", req.prompt_ids[:8] + [5, 6, 7], SamplingParams(max_new_tokens=2))
    admit_whole(s, twin)
    assert twin.num_cached_tokens == 8 and twin.pages[:2] == first_pages
    s.check_invariants()


def test_admission_respects_the_pool_and_the_decode_reservation():
    s = _sched(num_pages=10, connector=WholePromptConnector(),   # 9 usable pages
               num_reserved_decode_tokens=8)
    big = _req("big", 30, max_new=16)                            # 8 pages + 2 reserved
    s.add_request(big)
    s.allocator.alloc(1)                           # one page away: 8 free
    s.schedule()
    # Alone, the request is admitted without its reservation (it could never fit otherwise).
    assert dict(s.waiting_remote) == {"big": big} and s.num_used_pages == 9
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(big)


def test_decode_reserve_pages_counts_running_and_reserved():
    s = _sched(connector=WholePromptConnector(), num_reserved_decode_tokens=16)
    running = _req("run", 6, max_new=30)
    admit_whole(s, running)
    arrive(s, running, 11)                            # 1 output token: 29 left, cap 16
    reserved = _req("res", 6, max_new=5)              # none yet (counts 1): 4 left -> 1 page
    admit_whole(s, reserved)
    new = _req("new", 6, max_new=None)                # no limit: the cap, 16 -> 4 pages
    new.sampling_params = dataclasses.replace(new.sampling_params, max_new_tokens=None)
    assert s.remote.reserved_decode_pages(new, s.running) == 4 + 4 + 1
    s.remote.num_reserved_decode_tokens = 3
    assert s.remote.reserved_decode_pages(new, s.running) == 1 + 1 + 1
    s.remote.num_reserved_decode_tokens = 16
    one = _req("one", 6, max_new=1)                   # the prefill's token is its only one
    assert s.remote.reserved_decode_pages(one, s.running) == 0 + 4 + 1
    s.check_invariants()


def test_scheduler_hands_back_a_lone_request_it_cannot_grow():
    # 7 usable pages: A (8 prompt tokens + 1 output) runs; B's reservation takes the other 5.
    s = Scheduler(SchedulerConfig(num_pages=8, page_size=PS, max_running_requests=4,
                                  chunked_prefill_size=16), connector=WholePromptConnector())
    a = _req("a", 8, max_new=100, ignore_eos=True)
    b = _req("b", 20, max_new=100, seed=1, ignore_eos=True)
    admit_whole(s, a)
    arrive(s, a, 7)
    admit_whole(s, b)
    assert s.allocator.num_free == 0
    assert s.schedule() is None                  # A needs a third page; nothing can give one
    assert s.pop_finished() == [a] and s.pop_finished() == []
    assert a.state == RequestState.FINISHED
    assert a.finish_reason == FinishReason.of_length(1)
    assert a.rid not in s.requests and not s.running and a.pages == []
    assert s.allocator.num_free + s.prefix_cache.num_evictable_pages == 2
    s.check_invariants()


def test_reported_cached_tokens_are_the_prefill_hit_not_the_decode_hit():
    """A decode request whose prompt hit 8 tokens of the decode's own prefix cache
    reports ``reported_cached_tokens`` (what ``_commit`` sets from the metadata row and the
    decode's hit); page accounting keeps the decode's."""
    s = Scheduler(SchedulerConfig(num_pages=33, page_size=PS, max_running_requests=4,
                                  chunked_prefill_size=16), connector=WholePromptConnector())
    warm = _req("warm", 12, max_new=100, ignore_eos=True)
    admit_whole(s, warm)
    arrive(s, warm, 5)
    s.finish_request(warm, FinishReason.of_length(1))   # 3 full prompt pages cached
    for prefill_hit, want in ((0, 0), (4, 4), (99, 10)):
        req = Request(f"r{prefill_hit}", warm.prompt_ids[:8] + [9, 9],
                      SamplingParams(max_new_tokens=4))
        admit_whole(s, req)
        assert req.num_cached_tokens == 8                     # the decode's own prefix hit
        arrive(s, req, 3, cached_tokens=prefill_hit)
        assert req.num_cached_tokens_reported == want          # clamped to the prompt (10)
        s.check_invariants()
        s.finish_request(req, FinishReason.of_length(1))
        s.check_invariants()
    colocated = _req("c", 10, max_new=100, ignore_eos=True)
    assert colocated.num_cached_tokens_reported == 0 and colocated.reported_cached_tokens is None
