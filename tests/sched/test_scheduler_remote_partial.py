"""Requests admitted with part of their prompt's KV from elsewhere (HiCache's host or storage
tier) still compute the rest: when they took the free pages, a running prompt whose chunk
does not fit must not stall the ones whose chunk does (pure Python; no JAX)."""

import random

from pdjax.request import Request, SamplingParams
from pdjax.sched.kv_connector import KVConnectorOutput, NullConnector
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PS = 4


class _Partial(NullConnector):
    """Offers ``external[rid]`` tokens of a prompt (whole pages, some left to compute)."""

    def __init__(self, external):
        self.external = external

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        return self.external.get(req.rid, 0)


def test_a_chunk_that_does_not_fit_does_not_stall_the_chunks_that_do():
    # 33 pages; prompts of 41 tokens (10 full pages + 1 token). "a" has 1 page from
    # elsewhere and 37 tokens to compute (a 16-token chunk: 4 pages); b, c, d have 10 pages
    # and 1 token each (1 page). After the four admissions two pages are free.
    external = {"a": PS, "b": 10 * PS, "c": 10 * PS, "d": 10 * PS}
    sched = Scheduler(SchedulerConfig(num_pages=34, page_size=PS, max_running_requests=4,
                                      chunked_prefill_size=16), connector=_Partial(external))
    rng = random.Random(0)
    for rid in "abcd":
        sched.add_request(Request(rid, [rng.randrange(3, 400) for _ in range(41)],
                                  SamplingParams(max_new_tokens=2, temperature=0)))
    assert sched.schedule() is None                  # all four wait for their KV
    assert sorted(sched.remote.waiting) == list("abcd")
    sched.update_from_kv_output(KVConnectorOutput(finished_recving=set("abcd")))
    assert [r.rid for r in sched.running] == list("abcd")
    assert sched.allocator.num_free == 2
    batch = sched.schedule()
    # Before the fix: None ("a" could not grow, and nothing else was tried), every step.
    assert batch is not None
    assert [(row.req.rid, row.num_tokens) for row in batch.rows] == [("b", 1), ("c", 1)]
    sched.check_invariants()
