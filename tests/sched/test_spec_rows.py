"""Verify rows in the scheduler (``pdjax.sched.spec_rows``): drafts added to decode rows, and
the rollback of rejected drafts: counters, pages back to the free list, nothing rejected in
the prefix cache. Pure Python (a fixed drafter, tokens given by hand)."""

from pdjax.request import FinishReason, Request, SamplingParams
from pdjax.sched.scheduler import Scheduler, SchedulerConfig
from pdjax.spec.controller import SpecController
from pdjax.spec.drafter import Drafter

PROMPT = [11, 12, 13, 14, 15, 16]
DRAFT = [60, 61, 62, 63, 64]


class FixedDrafter(Drafter):
    def propose(self, requests, max_tokens):
        return [DRAFT[:k] for k in max_tokens]


def _no_stop(req):
    return None


def _setup(max_new=20, **kw):
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, chunked_prefill_size=16, **kw))
    sched.speculator = SpecController(FixedDrafter(), num_draft_tokens=6, adaptive=False)
    free0 = sched.allocator.num_free
    req = Request("a", list(PROMPT), SamplingParams(max_new_tokens=max_new, temperature=0))
    sched.add_request(req)
    while not req.output_ids:                 # the prompt (in chunks under a small budget)
        batch = sched.schedule()
        sched.process_results(batch, {i: 50 for i, r in enumerate(batch.rows) if r.samples},
                              _no_stop)
    return sched, req, free0


def test_rejected_drafts_roll_back_without_a_trace():
    sched, req, free0 = _setup()
    assert len(req.pages) == 2 and req.num_computed_tokens == 6
    free1 = sched.allocator.num_free
    # Step 1: the decode row carries 5 drafts (positions 6..11: a third page for one step).
    batch = sched.schedule()
    row = batch.rows[0]
    assert batch.forward_mode == "mixed" and row.is_verify and not row.is_decode and row.samples
    assert (row.start, row.num_tokens, row.draft_ids) == (6, 6, DRAFT)
    assert row.token_ids == [50, *DRAFT]
    assert len(req.pages) == 3 and sched.allocator.num_free == free1 - 1
    assert sched.advance(batch) == [(0, req, 1)] and req.num_computed_tokens == 7
    # The first draft is rejected: the target's own token 99 only.
    assert sched.resolve_verify(row, 1, [99], _no_stop) == (1, False)
    assert req.output_ids == [50, 99] and req.num_computed_tokens == 7
    assert len(req.pages) == 2 and sched.allocator.num_free == free1     # page 3 freed
    sched.check_invariants()
    # Step 2: one draft accepted, then the target's 98 (positions 7..12 written, 7..8 kept).
    batch = sched.schedule()
    row = batch.rows[0]
    assert (row.start, row.draft_ids) == (7, DRAFT)
    sched.advance(batch)
    assert sched.resolve_verify(row, 2, [60, 98], _no_stop) == (2, False)
    assert req.output_ids == [50, 99, 60, 98] and req.num_computed_tokens == 9
    assert len(req.pages) == 3                # the next token (98, position 9) needs page 3
    sched.check_invariants()
    # On finish the prefix cache gets the full pages of computed tokens only.
    sched.finish_request(req, FinishReason.of_length(4))
    cache = sched.prefix_cache
    assert len(cache.cached_pages()) == 2
    pages, _ = cache.match_prefix(PROMPT + [50, 99, 60, 98, 0], max_pages=10)
    assert len(pages) == 2
    pages, _ = cache.match_prefix(PROMPT + [50, *DRAFT], max_pages=10)    # a rejected path
    assert len(pages) == 1
    assert sched.allocator.num_free + len(cache.cached_pages()) == free0
    sched.check_invariants()


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    sched, req, free0 = _setup()
    batch = sched.schedule()
    row = batch.rows[0]
    sched.advance(batch)
    stop_at_61 = lambda r: FinishReason.stop(61) if r.output_ids[-1] == 61 else None  # noqa: E731
    assert sched.resolve_verify(row, 1, [60, 61, 62, 97], stop_at_61) == (2, True)
    assert req.output_ids == [50, 60, 61] and req.is_finished and req.pages == []
    # KV of 50 and 60 computed (positions 6, 7): two full pages cached, the rest freed.
    assert req.num_computed_tokens == 8 and len(sched.prefix_cache.cached_pages()) == 2
    assert sched.allocator.num_free + 2 == free0
    sched.check_invariants()


def test_drafts_respect_max_new_tokens_the_budget_and_opt_outs():
    sched, req, _ = _setup(max_new=3)
    row = sched.schedule().rows[0]
    # 1 output so far, 3 at most: the row may emit 2 tokens, so 1 draft.
    assert row.draft_ids == DRAFT[:1]
    sched2, req2, _ = _setup(max_num_batched_tokens=4)
    assert sched2.schedule().rows[0].draft_ids == DRAFT[:3]          # 1 + 3 drafts = budget
    sched3 = Scheduler(SchedulerConfig(num_pages=32, page_size=4, chunked_prefill_size=16))
    sched3.speculator = SpecController(FixedDrafter(), num_draft_tokens=6)
    opt_out = Request("b", list(PROMPT), SamplingParams(temperature=0, speculative=False))
    sched3.add_request(opt_out)
    sched3.process_results(sched3.schedule(), {0: 50}, _no_stop)
    batch = sched3.schedule()
    assert batch.forward_mode == "decode" and not batch.rows[0].is_verify
    # More decode rows than speculative_disable_by_batch_size: no drafts that step.
    sched4, _, _ = _setup()
    sched4.speculator.max_batch_size = 0
    assert sched4.schedule().forward_mode == "decode"
    sched4.speculator.max_batch_size = 1
    assert sched4.schedule().rows[0].draft_ids == DRAFT


def test_pd_decode_drafts_from_its_first_step():
    """A PD decode server gets the prompt's KV and the first token from the prefill server:
    its first decode step already carries drafts looked up in the prompt (DESIGN.md §4)."""
    from kv_fakes import WholePromptConnector, admit_whole, arrive

    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, chunked_prefill_size=16),
                      connector=WholePromptConnector())
    sched.speculator = SpecController(FixedDrafter(), num_draft_tokens=4, adaptive=False)
    from pdjax.spec.drafter import NgramDrafter
    sched.speculator.drafter = NgramDrafter(1, 4)
    req = Request("pd", [7, 8, 9, 5, 6, 7, 8], SamplingParams(max_new_tokens=10, temperature=0))
    admit_whole(sched, req)
    assert arrive(sched, req, 9) == [req]      # the prefill's first token
    batch = sched.schedule()
    row = batch.rows[0]
    assert row.is_verify and row.start == 7 and row.draft_ids == [5, 6, 7]
    assert row.token_ids == [9, 5, 6, 7]


def test_dp_attention_drafts_take_pages_of_the_requests_rank():
    """Under DP attention a verify row's draft pages come from its request's rank (they were
    taken from rank 0 whatever the request's rank: the row's pages then spanned two ranks and
    ``dp_batch.local_rows`` refused the batch); a rank without free pages drafts nothing
    though other ranks have room."""
    from pdjax.sched.dp_batch import local_rows
    from pdjax.sched.batch import BatchRow
    from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager

    np_, ps = 6, 4
    kv = DpKVCacheManager(2, np_, ps)
    sched = Scheduler(SchedulerConfig(num_pages=2 * np_, page_size=ps, chunked_prefill_size=32,
                                      dp_size=2), kv=kv)
    sched.speculator = SpecController(FixedDrafter(), num_draft_tokens=6, adaptive=False)
    reqs = [Request(rid, [t + k for t in PROMPT], SamplingParams(max_new_tokens=20,
                                                                 temperature=0))
            for k, rid in enumerate("ab")]
    for r in reqs:
        sched.add_request(r)
    while not all(r.output_ids for r in reqs):
        batch = sched.schedule()
        sched.process_results(batch, {i: 50 for i, r in enumerate(batch.rows) if r.samples},
                              _no_stop)
    assert sorted(kv.rank_of(r) for r in reqs) == [0, 1]
    b = next(r for r in reqs if kv.rank_of(r) == 1)
    batch = sched.schedule()
    rows = {r.req.rid: r for r in batch.rows}
    assert all(r.is_verify and r.draft_ids == DRAFT for r in rows.values())
    # 6 + 5 tokens: a third page each, on the request's own rank
    for r in reqs:
        assert len(r.pages) == 3
        assert {p // np_ for p in r.pages} == {kv.rank_of(r)}, r.pages
    _, ranks = local_rows([BatchRow(r.token_ids, r.start, r.req.pages, 0)
                           for r in batch.rows], np_)
    assert ranks == [kv.rank_of(r.req) for r in batch.rows]
    sched.advance(batch)
    for i, row in enumerate(batch.rows):
        sched.resolve_verify(row, 1, [99], _no_stop)
    sched.check_invariants()
    # Rank 1 full (its 5 usable pages: b's 2 and 3 taken here), rank 0 with room: b's row
    # carries no drafts, a's does.
    taken = kv.allocator.alloc(kv.allocator.num_free_on(1), 1)
    batch = sched.schedule()
    rows = {r.req.rid: r for r in batch.rows}
    a = next(r for r in reqs if r is not b)
    assert rows[b.rid].draft_ids == [] and rows[a.rid].draft_ids == DRAFT
    assert {p // np_ for p in b.pages} == {1}
    kv.allocator.free(taken)
