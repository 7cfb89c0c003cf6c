"""The MTP drafter's pool under DP attention (``spec/mtp.py``): a request's MTP pages are
taken on the rank of its target pages, and a request the scheduler assigned another rank (a
retraction, readmitted elsewhere) gives its old rank's MTP pages back and starts over on the
new one. Pure bookkeeping: the forwards are stubbed (the engine tests run them)."""

import types

import pdjax.spec.mtp as mtp
from pdjax.request import Request, SamplingParams
from pdjax.sched.dp_kv_cache_manager import RankedPageAllocator

NP, PS = 8, 4


def _drafter(monkeypatch, fed_log):
    """An MTP drafter at DP 2 whose forwards are stubbed (``_feed``, ``chain_drafts``)."""
    target = types.SimpleNamespace(page_size=PS)
    runner = types.SimpleNamespace(dp_size=2, pages_per_rank=NP)     # no model: no forward
    d = mtp.MTPDrafter(target, num_pages=2 * NP, max_running_requests=4, context_length=64,
                       chunked_prefill_size=16, runner=runner)
    assert isinstance(d.allocator, RankedPageAllocator) and d.allocator.num_free == 2 * (NP - 1)

    def feed(live):
        for _, st, ids, target_pages in live:
            fed_log.append((st.fed, list(st.pages), list(target_pages)))
            st.fed, st.ids = len(ids) - 1, ids
        return [None] * len(live)

    d._feed = feed
    monkeypatch.setattr(mtp, "chain_drafts", lambda first, ks, decode: [[1] * k for k in ks])
    return d


def test_mtp_pages_follow_the_requests_rank(monkeypatch):
    log = []
    d = _drafter(monkeypatch, log)
    req = Request("r", list(range(3, 13)), SamplingParams(max_new_tokens=8, temperature=0))
    req.pages, req.num_computed_tokens = [NP + 1, NP + 2, NP + 3], 9    # rank 1's pages
    assert d.propose([req], [3]) == [[1, 1, 1]]
    st = d._state["r"]
    # positions < 9 fed, then 2 chained drafts: 11 positions, 3 pages, all on rank 1
    assert st.rank == 1 and len(st.pages) == 3 and {p // NP for p in st.pages} == {1}
    assert log[-1][0] == 0 and d.allocator.num_free_on(0) == NP - 1
    # Retracted and readmitted on rank 0: rank 1's MTP pages go back, it starts over on 0.
    req.pages = [2, 3, 4]
    d.propose([req], [3])
    assert log[-1][0] == 0, "the MTP KV of rank 1 must not count as fed on rank 0"
    assert st.rank == 0 and {p // NP for p in st.pages} == {0}
    assert d.allocator.num_free_on(1) == NP - 1
    d.release("r")
    assert d.allocator.num_free == 2 * (NP - 1)


def test_a_full_rank_drafts_nothing_for_its_requests(monkeypatch):
    d = _drafter(monkeypatch, [])
    taken = d.allocator.alloc(NP - 1, 1)                 # rank 1's MTP pool full
    req = Request("r", list(range(3, 13)), SamplingParams(max_new_tokens=8, temperature=0))
    req.pages, req.num_computed_tokens = [NP + 1, NP + 2, NP + 3], 9
    assert d.propose([req], [3]) == [[]]
    assert d.allocator.num_free_on(0) == NP - 1          # nothing borrowed from rank 0
    d.allocator.free(taken)
