"""Scheduler unit tests with a fake model (pure Python; no JAX)."""

import dataclasses
import random
import sys

import pytest

from pdjax.request import Request, RequestState, SamplingParams
from pdjax.sched.batch import BatchRow, build_flat_batch
from pdjax.sched.buckets import BucketKey, Buckets
from pdjax.sched.scheduler import Scheduler, SchedulerConfig


def _req(rid, n_prompt, max_new=4, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 100) for _ in range(n_prompt)],
                   SamplingParams(max_new_tokens=max_new, temperature=0))


def _fake_token(req):
    # Deterministic "model": next token depends on the whole sequence.
    return 3 + sum(req.all_ids) % 97


def _stop(req):
    if len(req.output_ids) >= req.sampling_params.max_new_tokens:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def run_to_completion(sched, max_steps=10_000, on_batch=None):
    steps = 0
    while sched.has_work:
        batch = sched.schedule()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
        if batch is None:
            continue
        if on_batch:
            on_batch(batch)
        sampled = {i: _fake_token(r.req) for i, r in enumerate(batch.rows) if r.samples}
        sched.process_results(batch, sampled, _stop)
        sched.check_invariants()
    return steps


@pytest.mark.slow      # starts a process
def test_no_jax_import():
    import subprocess

    code = "import sys, pdjax.sched.scheduler, pdjax.sched.batch, pdjax.sched.buckets; " \
           "assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_and_decode_rows_first():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=8,
                                      enable_mixed_chunk=True))
    a, b = _req("a", 3, max_new=6), _req("b", 20, max_new=2, seed=1)
    sched.add_request(a)
    batch = sched.schedule()
    assert batch.forward_mode == "prefill_chunk" and [(r.start, r.num_tokens) for r in batch.rows] == [(0, 3)]
    sched.process_results(batch, {0: 50}, _stop)
    sched.add_request(b)
    batch = sched.schedule()
    # Mixed: a's decode row first, then b's first chunk (budget 8 - 1 decode row = 7 tokens).
    assert batch.forward_mode == "mixed"
    assert [(r.req.rid, r.start, r.num_tokens) for r in batch.rows] == [("a", 3, 1), ("b", 0, 7)]
    assert batch.rows[0].is_decode and not batch.rows[1].samples
    sched.process_results(batch, {0: 51}, _stop)
    sched.check_invariants()
    run_to_completion(sched)
    assert a.output_ids[:2] == [50, 51] and len(a.output_ids) == 6 and len(b.output_ids) == 2


def test_page_aligned_chunks_for_pd_prefill():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=10,
                                      page_aligned_chunks=True))
    sched.add_request(_req("a", 23, max_new=1))
    spans = []
    run_to_completion(sched, on_batch=lambda b: spans.extend((r.start, r.num_tokens) for r in b.rows))
    assert spans == [(0, 8), (8, 8), (16, 7)]      # non-last chunks end on page boundaries


def test_without_mixing_decode_waits_at_most_one_step():
    sched = Scheduler(SchedulerConfig(num_pages=256, page_size=4, chunked_prefill_size=8,
                                      max_running_requests=8))
    sched.add_request(_req("d", 3, max_new=40))
    for i in range(5):
        sched.add_request(_req(f"p{i}", 30, max_new=2, seed=i))
    last_decode, gaps = None, []

    def on_batch(batch):
        nonlocal last_decode
        assert batch.forward_mode in ("decode", "prefill_chunk")
        if any(r.req.rid == "d" and r.is_decode for r in batch.rows):
            if last_decode is not None:
                gaps.append(batch.step - last_decode)
            last_decode = batch.step

    run_to_completion(sched, on_batch=on_batch)
    assert gaps and max(gaps) <= 2


def test_small_pool_retracts_and_completes_with_same_tokens():
    def workload():
        return [_req(f"r{i}", 5 + 3 * i, max_new=12, seed=i) for i in range(8)]

    big = Scheduler(SchedulerConfig(num_pages=512, page_size=4, chunked_prefill_size=16))
    reqs_big = workload()
    for r in reqs_big:
        big.add_request(r)
    run_to_completion(big)
    assert big.num_retractions == 0

    small = Scheduler(SchedulerConfig(num_pages=20, page_size=4, chunked_prefill_size=16,
                                      max_context_len=64))
    reqs_small = workload()
    for r in reqs_small:
        small.add_request(r)
    run_to_completion(small)
    assert small.num_retractions > 0
    assert [r.output_ids for r in reqs_small] == [r.output_ids for r in reqs_big]
    assert all(r.state == RequestState.FINISHED for r in reqs_small)
    assert not small.running and small.num_used_pages == small.prefix_cache.num_cached_pages


def test_prefix_cache_hit_skips_cached_pages():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=64))
    a = _req("a", 13, max_new=1)
    sched.add_request(a)
    run_to_completion(sched)
    b = Request("b", list(a.prompt_ids[:12]) + [9, 9], SamplingParams(max_new_tokens=1))
    sched.add_request(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 12 and [(r.start, r.num_tokens) for r in batch.rows] == [(12, 2)]
    # Capped so at least one token is computed even on a full hit.
    c = Request("c", list(a.prompt_ids[:12]), SamplingParams(max_new_tokens=1))
    sched.process_results(batch, {0: 5}, _stop)
    sched.add_request(c)
    batch = sched.schedule()
    assert c.num_cached_tokens == 8 and [(r.start, r.num_tokens) for r in batch.rows] == [(8, 4)]


def test_abort_returns_pages_and_rejects_long_prompt():
    sched = Scheduler(SchedulerConfig(num_pages=32, page_size=4, chunked_prefill_size=8,
                                      max_context_len=64, disable_radix_cache=True))
    sched.add_request(_req("a", 30, max_new=5))
    batch = sched.schedule()
    sched.process_results(batch, {}, _stop)
    assert sched.num_used_pages > 0
    assert sched.abort_request("a").state == RequestState.ABORTED
    sched.check_invariants()
    assert sched.num_used_pages == 0
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(_req("long", 64))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(_req("x", 3))
        sched.add_request(_req("x", 3))


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_page_invariants(seed):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(num_pages=rng.choice([24, 40, 200]), page_size=4,
                                      chunked_prefill_size=rng.choice([8, 16, 32]),
                                      max_running_requests=rng.choice([2, 4, 8]),
                                      enable_mixed_chunk=bool(seed % 2), max_context_len=80))
    sched.allocator.shuffle(seed)
    base = [rng.randrange(3, 100) for _ in range(24)]
    reqs = []
    for i in range(30):
        n = rng.randrange(1, 60)
        prompt = (base[:rng.randrange(0, 24)] + [rng.randrange(3, 100) for _ in range(n)])[:70] or [5]
        r = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 9)))
        sched.add_request(r)
        reqs.append(r)
    aborted = set()

    def on_batch(batch):
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            aborted.add(rid)
            sched.abort_request(rid)
            sched.check_invariants()

    run_to_completion(sched, on_batch=on_batch)
    for r in reqs:
        if r.rid not in aborted:
            assert r.state == RequestState.FINISHED and len(r.output_ids) == r.sampling_params.max_new_tokens


def test_flat_batch_layout():
    rows = [BatchRow([5], 6, [3, 7]), BatchRow([1, 2, 3, 4, 5], 2, [9, 2])]
    fb = build_flat_batch(rows, page_size=4, num_tokens_pad=16, num_rows_pad=4, pages_per_seq_pad=4,
                          chunk_size=5)
    assert fb.input_ids[:6].tolist() == [5, 1, 2, 3, 4, 5] and fb.input_ids[6:].tolist() == [0] * 10
    assert fb.positions[:6].tolist() == [6, 2, 3, 4, 5, 6]
    assert fb.slot_mapping[:6].tolist() == [7 * 4 + 2, 9 * 4 + 2, 9 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2]
    assert fb.slot_mapping[6:].tolist() == [0] * 10
    assert fb.cu_q_lens.tolist() == [0, 1, 6, 6, 6] and fb.kv_lens.tolist() == [7, 7, 0, 0]
    assert fb.distribution.tolist() == [1, 2, 2]
    assert fb.logits_indices.tolist() == [0, 5, 0, 0]


def test_buckets_traced_pages_bound():
    """The jnp attention paths need one pages-per-sequence bucket: 5 + 5 shapes, not 50."""
    b = Buckets.create(chunked_prefill_size=256, max_running_requests=16, max_pages_per_seq=512,
                       traced_pages_bound=True)
    assert b.pages_per_seq_buckets == (512,)
    assert len(b.all_keys()) == 5 + 5
    assert b.pick("decode", 3, 3, 1) == BucketKey("decode", 4, 4, 512)
    assert b.pick("mixed", 17, 2, 512) == BucketKey("extend", 32, 16, 512)
    with pytest.raises(ValueError, match="pages per sequence 513"):
        b.pick("decode", 1, 1, 513)
    with pytest.raises(ValueError, match="pages_growth must be >= 2, got 1"):
        Buckets.create(chunked_prefill_size=256, max_running_requests=16, max_pages_per_seq=512,
                       pages_growth=1)


def test_buckets_bounded_and_pick():
    b = Buckets.create(chunked_prefill_size=256, max_running_requests=16, max_pages_per_seq=512)
    assert b.token_buckets == (16, 32, 64, 128, 256)
    assert b.request_buckets == (1, 2, 4, 8, 16)
    assert b.pages_per_seq_buckets == (4, 16, 64, 256, 512)
    # decode x pages + one extend executable (prefill_chunk and mixed) x tokens x pages
    assert len(b.all_keys()) == 5 * 5 + 5 * 5
    assert len(set(b.all_keys())) == len(b.all_keys())
    k = b.pick("decode", 3, 3, 17)
    assert (k.entry, k.num_tokens, k.num_rows, k.pages_per_seq) == ("decode", 4, 4, 64)
    k = b.pick("mixed", 100, 5, 3)
    assert (k.entry, k.num_tokens, k.num_rows, k.pages_per_seq) == ("extend", 128, 16, 4)
    assert b.pick("prefill_chunk", 100, 5, 3) == k
    assert set(b.all_keys()) >= {b.pick("decode", 3, 3, 17), k}
    with pytest.raises(ValueError, match="mode must be one of"):
        b.pick("extend", 100, 5, 3)
    with pytest.raises(ValueError, match="tokens"):
        b.pick("prefill_chunk", 257, 1, 1)


def test_buckets_pick_among_ready_keys():
    """While the background warm-up runs, a batch takes the smallest *compiled* bucket that
    holds it; the core keys alone hold every batch."""
    b = Buckets.create(chunked_prefill_size=256, max_running_requests=16, max_pages_per_seq=512)
    core = b.core_keys()
    assert core == [BucketKey("decode", 16, 16, 512), BucketKey("extend", 256, 16, 512)]
    ready = set(core)
    assert b.pick("decode", 3, 3, 17, ready=ready) == BucketKey("decode", 16, 16, 512)
    assert b.pick("mixed", 17, 2, 3, ready=ready) == BucketKey("extend", 256, 16, 512)
    ready |= {BucketKey("decode", 8, 8, 64), BucketKey("decode", 4, 4, 16),
              BucketKey("extend", 64, 16, 256), BucketKey("extend", 32, 16, 4)}
    # 4 rows at 17 pages: (4, 16) is too few pages, (8, 64) is the smallest that holds it.
    assert b.pick("decode", 3, 3, 17, ready=ready) == BucketKey("decode", 8, 8, 64)
    assert b.pick("decode", 3, 3, 9, ready=ready) == BucketKey("decode", 4, 4, 16)
    assert b.pick("prefill_chunk", 20, 1, 5, ready=ready) == BucketKey("extend", 64, 16, 256)
    assert b.pick("mixed", 20, 1, 4, ready=ready) == BucketKey("extend", 32, 16, 4)
    assert b.pick("mixed", 20, 1, 4) == BucketKey("extend", 32, 16, 4)       # None: all ready
    for mode, t, r, p in [("decode", 1, 1, 1), ("decode", 16, 16, 512), ("mixed", 256, 16, 512),
                          ("prefill_chunk", 1, 1, 1)]:
        assert b.pick(mode, t, r, p, ready=set(core)) in core
    with pytest.raises(ValueError, match="no compiled bucket holds"):
        b.pick("decode", 3, 3, 17, ready={BucketKey("extend", 256, 16, 512)})


def test_buckets_chosen_by_hand_must_hold_every_batch():
    """EngineCore(buckets=...) (scripts/gpu_engine_check.py's few shapes): each list must reach
    the settings' largest batch, ascend, and keep the extend row count."""
    limits = Buckets.create(chunked_prefill_size=256, max_running_requests=16,
                            max_pages_per_seq=512)
    few = Buckets(token_buckets=(256,), request_buckets=(1, 16), pages_per_seq_buckets=(64, 512),
                  max_rows=16)
    few.check_serves(limits)
    assert len(few.all_keys()) == 2 * 2 + 1 * 2
    assert few.pick("decode", 3, 3, 17) == BucketKey("decode", 16, 16, 64)
    assert few.pick("prefill_chunk", 20, 1, 65) == BucketKey("extend", 256, 16, 512)
    bad = [(dict(token_buckets=(128,)), r"buckets.token_buckets: the largest, 128, is below the 256"),
           (dict(request_buckets=(1, 8)), r"buckets.request_buckets: the largest, 8, is below the 16"),
           (dict(pages_per_seq_buckets=(511,)), r"pages_per_seq_buckets: the largest, 511"),
           (dict(request_buckets=(16, 1)), r"request_buckets must be positive and strictly ascending"),
           (dict(token_buckets=(0, 256)), r"token_buckets must be positive"),
           (dict(pages_per_seq_buckets=()), r"pages_per_seq_buckets must be positive"),
           (dict(max_rows=32), r"max_rows must equal max_running_requests \(16\), got 32")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(few, **change).check_serves(limits)


def _shared_prefix_reqs(prefix_len, tails, max_new=2):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 100) for _ in range(prefix_len)]
    return [Request(f"r{i}", prefix + [rng.randrange(3, 100) for _ in range(t)],
                    SamplingParams(max_new_tokens=max_new, temperature=0))
            for i, t in enumerate(tails)]


def test_requests_of_one_step_share_a_prefix_computed_in_that_step():
    """In-batch prefix sharing: the second request's first 12 tokens are in pages the first
    one computes in the same forward, so it computes only its own tail."""
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=64))
    a, b, c = _shared_prefix_reqs(13, [2, 5, 3])
    for r in (a, b, c):
        sched.add_request(r)
    batch = sched.schedule()
    assert [(r.req.rid, r.start, r.num_tokens) for r in batch.rows] == \
        [("r0", 0, 15), ("r1", 12, 6), ("r2", 12, 4)]
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 12, 12)
    assert b.pages[:3] == a.pages[:3] == c.pages[:3]
    # Their own full tail pages are shared too (b has 18 tokens, c 16).
    assert [sched.num_shared_pages(r) for r in (a, b, c)] == [3, 4, 4]
    sched.check_invariants()
    sampled = {i: _fake_token(r.req) for i, r in enumerate(batch.rows) if r.samples}
    sched.process_results(batch, sampled, _stop)
    sched.check_invariants()
    run_to_completion(sched)
    assert sched.num_used_pages == sched.prefix_cache.num_cached_pages   # all pages back
    # The same tokens as requests run one at a time without any cache.
    for r in (a, b, c):
        alone = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=64,
                                          disable_radix_cache=True))
        twin = Request(r.rid, list(r.prompt_ids), r.sampling_params)
        alone.add_request(twin)
        run_to_completion(alone)
        assert twin.output_ids == r.output_ids


def test_a_chunked_prompt_shares_its_pages_with_a_row_of_its_last_chunk_step():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=8,
                                      max_num_batched_tokens=16))
    long, short = _shared_prefix_reqs(20, [4, 1])
    sched.add_request(long)
    sched.add_request(short)
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append([(r.req.rid, r.start, r.num_tokens) for r in batch.rows])
        sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples},
                              _stop)
        sched.check_invariants()
    # One chunked request at a time: short waits for long's last chunk, then matches the
    # 20 tokens long has by the end of that same step.
    assert steps == [[("r0", 0, 8)], [("r0", 8, 8)], [("r0", 16, 8), ("r1", 20, 1)]]
    assert short.num_cached_tokens == 20 and short.pages[:5] == long.pages[:5]
    run_to_completion(sched)


def test_dropping_a_request_before_its_forward_keeps_the_pages_it_shared():
    """Scheduled, its pages shared and matched by another row of the same step, then aborted
    before the forward is launched: the forward still writes those pages (its batch was built),
    so they stay in the cache, held by the request that matched them."""
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=64))
    a, b = _shared_prefix_reqs(12, [3, 2])
    sched.add_request(a)
    sched.add_request(b)
    batch = sched.schedule()
    assert b.pages[:3] == a.pages[:3] and b.num_cached_tokens == 12
    shared = a.pages[:3]
    sched.abort_request("r0")
    sched.check_invariants()
    assert set(shared) <= sched.prefix_cache.cached_pages()
    assert not any(sched.allocator.is_free(p) for p in shared)
    assert sched.prefix_cache.evict(100) == 0       # b's lock holds them
    assert set(shared) <= sched.prefix_cache.cached_pages()
    sched.process_results(batch, {1: 5}, _stop)
    run_to_completion(sched)
    sched.check_invariants()


def test_no_prefix_sharing_without_the_radix_cache():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, chunked_prefill_size=64,
                                      disable_radix_cache=True))
    a, b = _shared_prefix_reqs(12, [3, 2])
    sched.add_request(a)
    sched.add_request(b)
    batch = sched.schedule()
    assert [(r.start, r.num_tokens) for r in batch.rows] == [(0, 15), (0, 14)]
    assert not set(a.pages) & set(b.pages)
    run_to_completion(sched)
    sched.check_invariants()
