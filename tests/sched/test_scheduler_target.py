"""Stall-free mixed steps (``target_itl_ms``) with a fake clock: the scheduler never
plans a mixed step over the target, fills the largest compiled token bucket that fits where
padding costs as much as tokens and ends the chunk inside its bucket where padding is free,
keeps a waiting prompt moving every step (by one token or the smallest bucket's fill; a page
for page-aligned chunks), plans against an upper quantile of the cost model's errors, and gives
prefill the whole chunk when nothing decodes. Pure Python (no JAX)."""

import random

import math

import pytest

from pdjax.request import Request, SamplingParams
from pdjax.sched.buckets import Buckets
from pdjax.sched.cost_model import StepCostModel
from pdjax.sched.scheduled_batch import chunk_pairs
from pdjax.sched.scheduler import Scheduler, SchedulerConfig

PAGE = 4
CHUNK = 64
BUCKETS = Buckets.create(chunked_prefill_size=CHUNK, max_running_requests=8, max_pages_per_seq=1024,
                         min_tokens=8)       # token buckets 8, 16, 32, 64


class FakeClock:
    """A forward's "measured" time: 2 ms + 0.1 ms per padded token + 1 us per cached token
    (the shape of XLA's forward: padded matmuls plus attention over the context).
    ``padding_free``: the 0.1 ms is per real token, and each bucket costs 0.01 ms per padded
    token on top (the CPU matmul kernel skips padding rows); ``per_pair_s``: per chunk
    attention pair (``ScheduledBatch.num_chunk_pairs``)."""

    def __init__(self, fixed_s=2e-3, per_token_s=1e-4, per_cached_s=1e-6, padding_free=False,
                 per_pair_s=0.0):
        self.fixed_s, self.per_token_s, self.per_cached_s = fixed_s, per_token_s, per_cached_s
        self.padding_free, self.per_pair_s = padding_free, per_pair_s
        self.token_buckets = BUCKETS.token_buckets
        self.now_s = 0.0

    def cost(self, mode, num_tokens, num_rows, pages_per_seq, num_cached_tokens,
             num_chunk_pairs=0):
        key = BUCKETS.pick(mode, num_tokens, num_rows, pages_per_seq)
        tokens = (num_tokens + 0.1 * key.num_tokens) if self.padding_free else key.num_tokens
        return (self.fixed_s + self.per_token_s * tokens + self.per_cached_s * num_cached_tokens
                + self.per_pair_s * num_chunk_pairs)

    predict = cost          # a perfect cost model

    def margin(self, forward_mode):
        return 1.0

    def run(self, batch):
        t = self.cost(batch.forward_mode, batch.num_tokens, len(batch.rows),
                      batch.pages_per_seq(PAGE), batch.num_cached_tokens, batch.num_chunk_pairs)
        self.now_s += t
        return t


def _req(rid, n, max_new):
    return Request(rid, [3 + (7 * i + sum(map(ord, rid))) % 90 for i in range(n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0))


def _stop(req):
    if len(req.output_ids) >= req.sampling_params.max_new_tokens:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def _step(sched, clock=None):
    """One step; the rows' ``is_decode`` / ``samples`` are frozen before the counters move
    (as ``kind`` on each row: "decode", "last" (samples) or "chunk")."""
    batch = sched.schedule()
    if batch is None:
        return None, None
    for r in batch.rows:
        r.kind = "decode" if r.is_decode else ("last" if r.samples else "chunk")
    t = clock.run(batch) if clock is not None else None
    sampled = {i: 5 for i, r in enumerate(batch.rows) if r.samples}
    sched.process_results(batch, sampled, _stop)
    sched.check_invariants()
    return batch, t


def _sched(cost, target_ms, **kw):
    cfg = dict(num_pages=400, page_size=PAGE, max_running_requests=8, chunked_prefill_size=CHUNK,
               enable_mixed_chunk=True, target_itl_ms=target_ms)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), cost_model=cost)


def _start_decoders(sched, clock, n=4, max_new=400):
    for i in range(n):
        sched.add_request(_req(f"d{i}", 6, max_new))
    while any(not sched.requests[f"d{i}"].output_ids for i in range(n)):
        _step(sched, clock)


def test_mixed_steps_stay_inside_the_target_and_fill_the_largest_bucket():
    clock = FakeClock()
    # 4 decode rows: 16 tokens cost 2 + 1.6 ms + context, 32 tokens 2 + 3.2 ms + context.
    target_ms = 5.4
    sched = _sched(clock, target_ms)
    _start_decoders(sched, clock)
    sched.add_request(_req("long", 300, 1))
    chunks, times = [], []
    while True:
        batch, t = _step(sched, clock)
        prefill = [r for r in batch.rows if r.kind != "decode"]
        assert batch.forward_mode == "mixed" and [r.kind == "decode" for r in batch.rows[:4]] == [True] * 4
        assert t <= target_ms / 1000 + 1e-12
        assert batch.predicted_time_s == pytest.approx(t)
        chunks.append(prefill[0].num_tokens)
        times.append(t)
        # Optimal: the next bigger bucket would not have fitted (unless this was the last chunk).
        if prefill[0].kind == "last":
            break
        assert batch.num_tokens in BUCKETS.token_buckets
        bigger = [b for b in BUCKETS.token_buckets if b > batch.num_tokens]
        if bigger:
            over = clock.cost("mixed", bigger[0], 5, 64, batch.num_cached_tokens)
            assert over > target_ms / 1000
    assert sum(chunks) == 300
    # The context grows, so the chunk shrinks from 28 (32 - 4 decode rows) to 12 (16 - 4).
    assert chunks[0] == 28 and 12 in chunks and set(chunks[:-1]) <= {28, 12}


def test_no_target_or_nothing_decoding_gives_the_whole_chunk():
    clock = FakeClock()
    sched = _sched(clock, 0.001)             # a target no step meets
    sched.add_request(_req("a", 150, 2))
    batch, _ = _step(sched, clock)
    assert batch.forward_mode == "prefill_chunk" and batch.rows[0].num_tokens == CHUNK

    plain = _sched(clock, None)
    _start_decoders(plain, clock)
    plain.add_request(_req("long", 150, 1))
    batch, _ = _step(plain, clock)
    assert batch.forward_mode == "mixed" and batch.num_tokens == CHUNK   # 4 decode + 60


@pytest.mark.parametrize("page_aligned", [False, True])
def test_starvation_free_under_continuous_decode_load(page_aligned):
    # Even one decode row alone breaks the target: the prompt still advances every step.
    # Colocated: by the rest of the smallest bucket (6 decode rows -> bucket 8: 2 tokens).
    # Page-aligned (PD prefill): by a page and the rest of the bucket that page needs (6 + 4 =
    # 10 -> bucket 16: 10 tokens, cut back to the page boundary, 8).
    clock = FakeClock(fixed_s=0.05)
    sched = _sched(clock, 1.0, page_aligned_chunks=page_aligned)
    _start_decoders(sched, clock, n=6, max_new=1000)
    long = _req("long", 101, 1)
    sched.add_request(long)
    per_step, bucket = (8, 16) if page_aligned else (2, 8)
    steps = 0
    while not long.output_ids:
        batch, _ = _step(sched, clock)
        steps += 1
        assert [r.kind == "decode" for r in batch.rows] == [True] * 6 + [False]
        assert batch.rows[6].num_tokens == min(per_step, 101 - batch.rows[6].start)
        assert batch.num_tokens <= bucket
    assert steps == math.ceil(101 / per_step)            # from the first step on
    assert long.is_finished


def test_over_target_steps_take_the_smallest_bucket():
    """The smallest step that advances the prompt already breaks the target: take the rest of
    the smallest bucket (same predicted cost), never a bigger one; a sub-page chunk is fine in
    a colocated step. Page-aligned chunks (PD prefill) take a page and the rest of the bucket
    that page lands in, cut back to whole pages."""
    clock = FakeClock(fixed_s=0.05)
    # 4 decode rows -> bucket 8: 4 tokens; 5 -> 3; 7 -> 1.
    for n_decode, fill in ((4, 4), (5, 3), (7, 1)):
        sched = _sched(clock, 1.0)
        _start_decoders(sched, clock, n=n_decode, max_new=1000)
        sched.add_request(_req("long", 200, 1))
        batch, t = _step(sched, clock)
        assert batch.forward_mode == "mixed"
        assert batch.rows[-1].num_tokens == fill, n_decode
        assert batch.num_tokens in BUCKETS.token_buckets
        smallest = clock.cost("mixed", n_decode + 1, n_decode + 1, 64, batch.num_cached_tokens)
        assert t == pytest.approx(smallest)
    # Page-aligned: 4 + a 4-token page = 8 (bucket 8); 5 + 4 = 9 -> 16: 11, cut to 8; 7 -> 8.
    for n_decode, fill in ((4, 4), (5, 8), (7, 8)):
        sched = _sched(clock, 1.0, page_aligned_chunks=True)
        _start_decoders(sched, clock, n=n_decode, max_new=1000)
        sched.add_request(_req("long", 200, 1))
        batch, t = _step(sched, clock)
        assert batch.rows[-1].num_tokens == fill, n_decode
        assert (batch.rows[-1].start + fill) % PAGE == 0


def test_until_timed_the_chunk_is_unconstrained():
    class NoData:
        token_buckets = BUCKETS.token_buckets

        def predict(self, *args):
            return None

        def margin(self, forward_mode):
            return 1.0

    sched = _sched(NoData(), 1.0)
    _start_decoders(sched, None)
    sched.add_request(_req("long", 150, 1))
    batch, _ = _step(sched)
    assert batch.num_tokens == CHUNK and batch.predicted_time_s is None


def test_page_aligned_chunks_and_prefix_hits_under_a_target():
    clock = FakeClock()
    calls = []

    class Recording(FakeClock):
        def predict(self, mode, num_tokens, num_rows, pages, cached, pairs=0):
            calls.append((mode, num_tokens, cached))
            return super().cost(mode, num_tokens, num_rows, pages, cached, pairs)

    rec = Recording()
    sched = _sched(rec, 5.4, page_aligned_chunks=True)
    _start_decoders(sched, clock)
    shared = _req("p1", 40, 1).prompt_ids
    first = Request("p1", shared + [9] * 30, SamplingParams(max_new_tokens=1, temperature=0))
    second = Request("p2", shared + [8] * 30, SamplingParams(max_new_tokens=1, temperature=0))
    for req in (first, second):
        sched.add_request(req)
        while req.rid in sched.requests and not req.output_ids:
            calls.clear()
            batch, _ = _step(sched, rec)
            for r in batch.rows:
                if r.kind == "chunk":
                    assert (r.start + r.num_tokens) % PAGE == 0      # PD: whole pages only
            decode_cached = sum(r.start for r in batch.rows if r.kind == "decode")
            prefill = [r for r in batch.rows if r.kind != "decode"]
            # The planning predictions (all but the batch's own, last) count the prompt's
            # context, prefix hit included, next to the decode rows.
            assert calls[:-1] and all(c == decode_cached + prefill[0].start for _, _, c in calls[:-1])
    assert second.num_cached_tokens == 40                 # 10 shared pages from the cache


def test_retraction_under_a_target_keeps_pages_and_finishes_all():
    clock = FakeClock()
    sched = _sched(clock, 5.4, num_pages=24)
    for i in range(5):
        sched.add_request(_req(f"r{i}", 10 + 7 * i, 12))
    steps = 0
    while sched.has_work:
        _step(sched, clock)
        steps += 1
        assert steps < 2000
    assert sched.num_retractions > 0
    assert sched.allocator.num_free + sched.prefix_cache.num_cached_pages == 23


def test_real_cost_model_learns_the_clock_and_then_keeps_the_target():
    clock = FakeClock()
    model = StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, token_scale=64, cached_scale=1024)
    sched = _sched(model, 5.4)
    _start_decoders(sched, clock, n=4, max_new=1000)
    over = []
    for j in range(4):
        sched.add_request(_req(f"long{j}", 200, 1))
        while f"long{j}" in sched.requests and not sched.requests[f"long{j}"].output_ids:
            batch = sched.schedule()
            t = clock.run(batch)
            key = BUCKETS.pick(batch.forward_mode, batch.num_tokens, len(batch.rows),
                               batch.pages_per_seq(PAGE))
            model.observe(key, batch.num_tokens, batch.num_cached_tokens, t, batch.num_chunk_pairs)
            if batch.forward_mode == "mixed":
                over.append(t > 5.4e-3 + 1e-9)
            sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    # A few exploratory steps while the model has no data, then never over the target.
    assert sum(over[:8]) <= 4 and not any(over[8:]), over
    assert len(over) > 40


def test_max_num_batched_tokens_counts_decode_rows_and_chunk_size_caps_a_prompt():
    sched = Scheduler(SchedulerConfig(num_pages=400, page_size=PAGE, max_running_requests=8,
                                      chunked_prefill_size=16, max_num_batched_tokens=24,
                                      enable_mixed_chunk=True))
    _start_decoders(sched, None, n=4)
    sched.add_request(_req("long", 40, 1))
    batch, _ = _step(sched)
    assert [r.num_tokens for r in batch.rows] == [1, 1, 1, 1, 16]     # the chunk cap
    sched.add_request(_req("s1", 6, 1))
    batch, _ = _step(sched)
    # 4 decode rows + 16 of "long" leave 4 of the 24-token budget; "long" is chunked, so the
    # short prompt waits behind it (one chunked request at a time).
    assert [r.num_tokens for r in batch.rows] == [1, 1, 1, 1, 16]
    batch, _ = _step(sched)
    assert [r.num_tokens for r in batch.rows] == [1, 1, 1, 1, 8, 6]   # long's rest, then s1
    b = Buckets.create(chunked_prefill_size=16, max_running_requests=8, max_pages_per_seq=16,
                       max_num_batched_tokens=24)
    assert b.token_buckets == (16, 24)
    for kw, name in (({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                     ({"target_itl_ms": -1.0}, "target_itl_ms"),
                     ({"max_num_batched_tokens": 2, "page_aligned_chunks": True}, "page_size")):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(num_pages=10, page_size=PAGE, **kw)


def test_server_args_name_the_bad_field():
    from pdjax.config import ServerArgs

    for kw, name in (({"max_num_batched_tokens": 0}, "^max_num_batched_tokens: "),
                     ({"target_itl_ms": 0}, "^target_itl_ms: "),
                     ({"target_itl_ms": True}, "^target_itl_ms: "),
                     ({"target_itl_ms": 25.5}, "^target_itl_ms: .*enable_mixed_chunk")):
        with pytest.raises(ValueError, match=name):
            ServerArgs(**kw)
    assert ServerArgs(max_num_batched_tokens=300, target_itl_ms=25.5,
                      enable_mixed_chunk=True).target_itl_ms == 25.5


class NoisyClock(FakeClock):
    """FakeClock on a shared machine: every forward's time times a factor in [0.85, 1.35]."""

    def __init__(self, seed=0):
        super().__init__()
        self.rng = random.Random(seed)

    def run(self, batch):
        return super().run(batch) * self.rng.uniform(0.85, 1.35)


class PointPlan(StepCostModel):
    def margin(self, forward_mode):
        return 1.0


@pytest.mark.parametrize("model_cls, least_over, most_over",
                         [(StepCostModel, 0.0, 0.05), (PointPlan, 0.15, 1.0)])
def test_noisy_steps_planned_against_the_margin_stay_inside_the_target(model_cls, least_over,
                                                                       most_over):
    """Planned at the point prediction, a fifth to a quarter of the mixed steps of a noisy clock
    run over the target (seed 0: 0.25); planned against the cost model's margin (its errors'
    0.98 quantile), about 1 % do (seed 0: 0.007)."""
    clock = NoisyClock()
    model = model_cls(BUCKETS.pick, BUCKETS.token_buckets, token_scale=64, cached_scale=1024)
    target_ms = 6.5
    sched = _sched(model, target_ms)
    _start_decoders(sched, clock, n=4, max_new=2000)
    over = []
    for j in range(10):
        long = _req(f"long{j}", 200, 1)
        sched.add_request(long)
        while not long.output_ids:
            batch = sched.schedule()
            t = clock.run(batch)
            model.observe(BUCKETS.pick(batch.forward_mode, batch.num_tokens, len(batch.rows),
                                       batch.pages_per_seq(PAGE)),
                          batch.num_tokens, batch.num_cached_tokens, t, batch.num_chunk_pairs)
            if batch.forward_mode == "mixed":
                over.append(t > target_ms / 1000)
            sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples}, _stop)
    share = sum(over[20:]) / len(over[20:])
    print(f"\n{model_cls.__name__}: {share:.3f} of {len(over) - 20} mixed steps over the target")
    assert len(over) > 90
    assert least_over <= share <= most_over


def _chunk_cost(clock, batch, n):
    """``clock``'s cost of ``batch`` with its prompt row (the last) holding ``n`` tokens."""
    *rows, last = batch.rows
    start = last.start
    tokens = sum(r.num_tokens for r in rows) + n
    pages = max([-(-(r.start + r.num_tokens) // PAGE) for r in rows] + [-(-(start + n) // PAGE)])
    pairs = sum(chunk_pairs(r.num_tokens, r.start) for r in rows) + chunk_pairs(n, start)
    return clock.cost("mixed", tokens, len(batch.rows), pages, batch.num_cached_tokens, pairs)


def test_padding_free_steps_end_the_chunk_inside_its_bucket_at_the_most_that_fits():
    """Where padding rows cost (almost) nothing, a chunk ends wherever the target is reached,
    not at a bucket's fill: every planned chunk fits and one more token would not, as the
    chunk's attention pairs (tokens x context) grow late in the prompt."""
    clock = FakeClock(padding_free=True, per_pair_s=2e-7)
    target_ms = 5.4
    sched = _sched(clock, target_ms)
    _start_decoders(sched, clock)
    sched.add_request(_req("long", 300, 1))
    chunks, inside = [], 0
    while True:
        batch, t = _step(sched, clock)
        prefill = batch.rows[-1]
        assert [r.kind for r in batch.rows[:4]] == ["decode"] * 4 and len(batch.rows) == 5
        assert t <= target_ms / 1000 + 1e-12 and batch.predicted_time_s == pytest.approx(t)
        chunks.append(prefill.num_tokens)
        if prefill.kind == "last":
            break
        assert _chunk_cost(clock, batch, prefill.num_tokens + 1) > target_ms / 1000
        inside += batch.num_tokens not in BUCKETS.token_buckets
    assert sum(chunks) == 300
    assert inside > len(chunks) // 2           # most chunks end inside their bucket
    assert chunks[0] > chunks[-2] >= 1         # the chunk shrinks as its context grows


@pytest.mark.parametrize("page_aligned, least", [(False, 1), (True, PAGE)])
def test_padding_free_over_target_steps_advance_by_the_least(page_aligned, least):
    """Nothing fits and padding costs nothing: the prompt advances by one token (one page when
    chunks are page-aligned), not by the rest of the bucket, which would cost more."""
    clock = FakeClock(padding_free=True)
    sched = _sched(clock, 1.0, page_aligned_chunks=page_aligned)     # 2 ms fixed: none fits
    _start_decoders(sched, clock, n=4, max_new=1000)
    sched.add_request(_req("long", 40, 1))
    for _ in range(3):
        batch, _ = _step(sched, clock)
        assert [r.kind for r in batch.rows[:4]] == ["decode"] * 4
        assert batch.rows[-1].num_tokens == least
