"""Fast PD pieces without processes: the scheduler's remote-KV books as the PD roles use them
(held by ``request_finished``; a decode's whole-prompt admission and its first token) under
its invariant check, the decode's reservation arithmetic, the staging path of ``LocalKV``, and the
router's request arithmetic."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.router import parse_prefill_args
from pdjax.router.pd_router import _merge_input_logprobs
from pdjax.server.validation import num_samples
from pdjax.models.loader import make_mesh
from pdjax.sched.buckets import BucketKey
from pdjax.sched.kv_connector import KVConnectorOutput, NullConnector
from pdjax.sched.scheduler import Scheduler, SchedulerConfig
from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.local_kv import LocalKV
from kv_fakes import WholePromptConnector, admit_whole, arrive
from pd_fakes import KVRunner as _Runner

PS = 4


def _req(rid, n, max_new=4, seed=0):
    rng = np.random.default_rng(seed)
    return Request(rid, [int(t) for t in rng.integers(3, 400, n)],
                   SamplingParams(max_new_tokens=max_new, temperature=0.0))


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


def test_staging_path_round_trip_and_direct_addresses():
    shape = (2, 9, PS, 2, 8)                       # [layers, pages, page_size, heads, dim]
    src, dst = _Runner(shape), _Runner(shape)
    dst.caches = {s.name: jnp.zeros(s.shape) for s in dst.cache_specs}
    engine = FakeTransferEngine()
    out = LocalKV(src, engine, "staging", max_pages_per_seq=4)
    into = LocalKV(dst, FakeTransferEngine(), "staging", max_pages_per_seq=4)
    assert out.mode == into.mode == "staging"
    # The mirrors are rows of 2 heads: a staging side pairs with a direct side head by head.
    assert [(d.num_heads, d.head_bytes) for d in out.layout.buffers] == [(2, 8 * 4)] * 2
    assert out.bytes_per_page == 2 * 2 * PS * 2 * 8 * 4 and out.num_layer_buffers == 4
    out.warmup()
    into.warmup()
    pages_src, pages_dst = [3, 5, 6], [8, 1, 2]
    out.stage_out(pages_src)
    # What the transfer engine would do: copy page by page between the registered mirrors.
    for m_src, m_dst in zip(out.mirrors, into.mirrors):
        m_dst[:, pages_dst] = m_src[:, pages_src]
    into.stage_in(pages_dst)
    for name in ("k_cache", "v_cache"):
        a, b = src.caches[name], dst.caches[name]
        np.testing.assert_array_equal(np.asarray(b)[:, pages_dst], np.asarray(a)[:, pages_src])
        untouched = [p for p in range(1, 9) if p not in pages_dst]
        assert not np.asarray(b)[:, untouched].any()
    # The registered regions are the mirrors, labelled "kv".
    regions = {r.addr: r for r in engine.registered_regions()}
    assert {int(m.ctypes.data) for m in out.mirrors} <= set(regions)
    assert all(regions[int(m.ctypes.data)].label == "kv" for m in out.mirrors)
    direct = LocalKV(_Runner(shape), FakeTransferEngine(), "auto")
    assert direct.mode == "direct" and not direct.check_addresses()
    with pytest.raises(ValueError, match="transfer path"):
        LocalKV(_Runner(shape), FakeTransferEngine(), "rdma")


def test_a_pool_peers_touch_takes_the_direct_path_only_where_steps_update_it_in_place():
    """Pages a peer writes during a step that copies the pool are lost, and pages a peer reads
    during a step that uses the pool as scratch are garbage (``runner/pool_copy``): a pool goes
    direct only when no bucket copies it, on the decode and on the prefill alike (a prefill
    sends a chunk while the next one computes: with FP8 KV on CPU the decode got wrong tokens
    or 0s when the prefill's pool went direct)."""
    shape = (2, 9, PS, 2, 8)
    clean = _Runner(shape)
    assert LocalKV(clean, FakeTransferEngine(), "auto").mode == "direct"
    assert clean.in_place_kv_required
    copying = _Runner(shape)
    copying.kv_copying = {BucketKey("decode", 1, 1, 64): "2630280 B of temporaries"}
    with pytest.raises(ValueError, match=r"not updated in place by 1 bucket.*decode"):
        LocalKV(copying, FakeTransferEngine(), "direct")
    staged = LocalKV(copying, FakeTransferEngine(), "auto")
    assert staged.mode == "staging" and not copying.in_place_kv_required
    # Two shards cannot stage: the error says why direct was refused.
    two = _Runner(shape)
    two.kv_copying = dict(copying.kv_copying)
    heads = NamedSharding(make_mesh(2), PartitionSpec(None, None, None, "tp", None))
    two.caches = {k: jax.device_put(v, heads) for k, v in two.caches.items()}
    assert len(two.caches["k_cache"].addressable_shards) == 2
    with pytest.raises(ValueError, match="one shard.*not updated in place"):
        LocalKV(two, FakeTransferEngine(), "auto")


def test_router_sample_counts_ports_and_logprob_merge():
    assert num_samples("/generate", {"text": "a"}) == 1
    assert num_samples("/generate", {"text": ["a", "b"], "sampling_params": {"n": 3}}) == 6
    assert num_samples("/generate", {"input_ids": [[1], [2]]}) == 2
    assert num_samples("/generate", {"input_ids": [1, 2, 3]}) == 1
    assert num_samples("/v1/completions", {"prompt": ["a", "b"], "n": 2}) == 4
    assert num_samples("/v1/completions", {"prompt": [1, 2]}) == 1
    assert num_samples("/v1/chat/completions", {"messages": [], "n": 2}) == 2
    assert parse_prefill_args([["http://p:1"], ["http://q:2", "8998"], ["http://r:3", "none"]]) \
        == [("http://p:1", None), ("http://q:2", 8998), ("http://r:3", None)]
    with pytest.raises(ValueError, match="bootstrap port"):
        parse_prefill_args([["http://p:1", "x"]])
    d = {"meta_info": {"input_token_logprobs": []}}
    p = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None]],
                       "input_top_logprobs": [None, []]}}
    merged = _merge_input_logprobs([d], [p])[0]["meta_info"]
    assert merged["input_token_logprobs"] == [[None, 5, None], [-1.5, 6, None]]
    assert merged["input_top_logprobs"] == [None, []]
