"""PD into a DP attention decode, the data plane's part (DESIGN.md §4, §6): a page-sharded
KV pool's layout (``export_kv_layout(dp_size=...)``) and the copies that put a prefill's
pages into the shards of the rank owning each decode page, applied by address to real
page-sharded JAX arrays on the 4 simulated CPU devices (tests/conftest.py)."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.wire import ProtocolError
from pdjax.transfer.kv_copies import KVLayout, build_copies, plan_head_slices
from pdjax.transfer.kv_export import export_kv_layout

L, NP, PS, W = 2, 6, 4, 8          # layers, pages a device, page size, latent width


def _paged(dp):
    """A DP pool buffer [L, 4 * NP, PS, W] (zeros) sharded by page over the 4 devices."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jnp.zeros((L, 4 * NP, PS, W), jnp.float32)
    return jax.device_put(x, NamedSharding(mesh, P(None, "tp")))


def _host_layout(src):
    bpp = PS * W * 4
    return KVLayout("layer_major", (KVBufferDesc((int(src.ctypes.data),), L, src.shape[1],
                                                 bpp, head_bytes=W * 4),))


def _apply(copies):
    for s, d, n in copies:
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("dp", [4, 2])
def test_prefill_pages_land_in_their_ranks_shards(dp):
    arr = _paged(dp)
    layout = export_kv_layout([arr], dp_size=dp)
    desc = layout.buffers[0]
    attn_tp = 4 // dp
    assert desc.dp_size == dp and desc.num_pages == dp * NP and desc.shard_num_pages == NP
    assert desc.shard_ranks == tuple(k // attn_tp for k in range(4))
    assert layout.regions()[0][1] == L * NP * PS * W * 4
    rng = np.random.default_rng(0)
    src = rng.standard_normal((L, 9, PS, W)).astype(np.float32)
    src_pages = [1, 2, 3, 4, 5, 7]
    # consecutive across a rank boundary, one per other rank, none on a null page
    dst_pages = [NP - 2, NP - 1, NP + 1, NP + 2, (dp - 1) * NP + 3, 2]
    copies = build_copies(_host_layout(src), layout, src_pages, dst_pages)
    _apply(copies)
    out = np.asarray(arr)
    want = np.zeros_like(out)
    for sp, g in zip(src_pages, dst_pages):
        rank, local = divmod(g, NP)
        for k in range(rank * attn_tp, (rank + 1) * attn_tp):
            want[:, k * NP + local] = src[:, sp]
    np.testing.assert_array_equal(out, want)
    assert sum(n for _, _, n in copies) == len(dst_pages) * attn_tp * L * PS * W * 4


def _paged_from(logical, dp):
    """A DP pool buffer holding ``logical`` [L, dp * NP, PS, W] (global pages): each device of
    rank r (4 / dp of them) a copy of rank r's NP pages."""
    attn_tp = 4 // dp
    per_dev = np.concatenate([logical[:, (k // attn_tp) * NP:(k // attn_tp + 1) * NP]
                              for k in range(4)], axis=1)
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
    return jax.device_put(jnp.asarray(per_dev), NamedSharding(mesh, P(None, "tp")))


@pytest.mark.parametrize("src_dp,dst", [(4, "host"), (2, "host"), (4, 2), (2, 4)])
def test_prefill_with_dp_attention_reads_its_ranks_pages(src_dp, dst):
    rng = np.random.default_rng(1)
    logical = rng.standard_normal((L, src_dp * NP, PS, W)).astype(np.float32)
    src_arr = _paged_from(logical, src_dp)
    src_layout = export_kv_layout([src_arr], dp_size=src_dp)
    src_pages = [NP + 1, NP + 2, 2, (src_dp - 1) * NP + 5, 3]
    if dst == "host":
        out = np.zeros((L, 12, PS, W), np.float32)
        dst_layout, dst_pages = _host_layout(out), [4, 5, 6, 1, 9]
    else:
        dst_arr = _paged(dst)
        dst_layout = export_kv_layout([dst_arr], dp_size=dst)
        dst_pages = [NP + 3, NP + 4, 1, (dst - 1) * NP + 2, NP - 1]
    copies = build_copies(src_layout, dst_layout, src_pages, dst_pages)
    _apply(copies)
    if dst == "host":
        for sp, g in zip(src_pages, dst_pages):
            np.testing.assert_array_equal(out[:, g], logical[:, sp])
        assert out[:, [0, 2, 3, 7, 8, 10, 11]].sum() == 0
    else:
        got = np.asarray(dst_arr)
        want = np.zeros_like(got)
        attn_tp = 4 // dst
        for sp, g in zip(src_pages, dst_pages):
            rank, local = divmod(g, NP)
            for k in range(rank * attn_tp, (rank + 1) * attn_tp):
                want[:, k * NP + local] = logical[:, sp]
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ProtocolError, match="src_pages"):
        build_copies(src_layout, dst_layout, [NP], dst_pages[:1])   # rank 1's null page


def _replicated(x):
    """``x`` on all 4 devices, every shard a whole copy (a TP 4 MLA pool without DP)."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P()))


@pytest.mark.parametrize("dp", [4, 2])
def test_tp4_without_dp_to_and_from_a_dp_pool(dp):
    """TP 4 without DP holds every page on each of its 4 shards: into a DP pool each page is
    read from one of them; from a DP pool each page goes to all 4."""
    rng = np.random.default_rng(2)
    pages = [1, NP + 1, NP + 2, (dp - 1) * NP + 4]
    # TP 4 prefill -> DP decode
    src = rng.standard_normal((L, 9, PS, W)).astype(np.float32)
    src_arr, dst_arr = _replicated(src), _paged(dp)
    src_layout = export_kv_layout([src_arr])
    assert src_layout.buffers[0].dp_size == 1 and len(src_layout.buffers[0].shard_addrs) == 4
    copies = build_copies(src_layout, export_kv_layout([dst_arr], dp_size=dp), [2, 3, 4, 5],
                          pages)
    regions = src_layout.regions()
    read_from = {next(k for k, (base, n) in enumerate(regions) if base <= a < base + n)
                 for a, _, _ in copies}
    assert len(read_from) > 1, read_from                        # reads spread over replicas
    _apply(copies)
    got, attn_tp = np.asarray(dst_arr), 4 // dp
    for sp, g in zip([2, 3, 4, 5], pages):
        rank, local = divmod(g, NP)
        for k in range(rank * attn_tp, (rank + 1) * attn_tp):
            np.testing.assert_array_equal(got[:, k * NP + local], src[:, sp])
    # DP prefill -> TP 4 decode
    logical = rng.standard_normal((L, dp * NP, PS, W)).astype(np.float32)
    src_arr = _paged_from(logical, dp)
    dst_arr = _replicated(np.zeros((L, 9, PS, W), np.float32))
    _apply(build_copies(export_kv_layout([src_arr], dp_size=dp), export_kv_layout([dst_arr]),
                        pages, [2, 3, 4, 5]))
    for shard in dst_arr.addressable_shards:
        out = np.asarray(shard.data)
        for sp, d in zip(pages, [2, 3, 4, 5]):
            np.testing.assert_array_equal(out[:, d], logical[:, sp])
        assert out[:, [0, 1, 6, 7, 8]].sum() == 0


def test_refusals_name_the_field():
    arr = _paged(4)
    dpl = export_kv_layout([arr], dp_size=4)
    src = np.zeros((L, 9, PS, W), np.float32)
    with pytest.raises(ProtocolError, match="null page"):
        build_copies(_host_layout(src), dpl, [1], [NP])          # rank 1's page 0
    heads = KVLayout("layer_major", (KVBufferDesc((1,), L, 9, PS * W * 4, num_heads=2,
                                                     head_bytes=W * 2),))
    with pytest.raises(ValueError, match="num_heads"):
        plan_head_slices(heads, dpl)
    with pytest.raises(ValueError, match="arrays\\[0\\]: sharded over its layer/page"):
        export_kv_layout([arr])                                   # dp_size left out
    with pytest.raises(ValueError, match="dp_size 3"):
        export_kv_layout([arr], dp_size=3)
    with pytest.raises(ValueError, match="shard_ranks"):
        KVBufferDesc((1, 2), L, 2 * NP, 64, dp_size=4, shard_ranks=(0, 1))


def test_wire_round_trip_and_plain_wire_unchanged():
    d = KVBufferDesc((1, 2, 3, 4), L, 4 * NP, 64, dp_size=2, shard_ranks=(0, 0, 1, 1))
    assert KVBufferDesc.from_wire("b", d.to_wire()) == d
    plain = KVBufferDesc((1,), L, NP, 64).to_wire()
    assert "dp_size" not in plain and "shard_ranks" not in plain


DP_FLAGS = ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "4"]


def _parse_error(capsys, argv) -> str:
    from pdjax.serve import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--role", "prefill", "--disaggregation-transfer-backend", "jax"],
     "error: disaggregation_transfer_backend: 'jax' is not built for a prefill with DP"),
    (["--role", "decode", "--disaggregation-transfer-backend", "jax"],
     "error: disaggregation_transfer_backend: 'jax' is not built for a decode with DP"),
    (["--role", "decode", "--disaggregation-transfer-path", "staging"],
     "error: disaggregation_transfer_path: 'staging' is not built for a decode with DP"),
])
def test_pd_roles_refused_at_parse_time(tiny_checkpoints, capsys, argv, message):
    err = _parse_error(capsys, ["--model-path", tiny_checkpoints["deepseek_v32"], *DP_FLAGS,
                                *argv])
    assert err.startswith(message), err


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_pd_roles_parse(tiny_checkpoints, role):
    from pdjax.ports import free_port
    from pdjax.serve import parse_args
    # a prefill's bootstrap port is checked free at parse time: not the default 8998, which
    # another server on this machine may hold
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["deepseek_v32"],
                       *DP_FLAGS, "--role", role,
                       "--disaggregation-bootstrap-port", str(free_port())])
    assert (args.role, args.dp_size) == (role, 4)


def test_decode_admission_reserves_pages_on_the_assigned_rank():
    """A PD decode's whole-prompt admission (``RemoteKV.admit``) took its pages from rank
    0's allocator whatever rank the request was assigned, and left the rank's books without
    it: every request then went to rank 0 and a decode row held pages of two ranks
    ("pages [16, 17, 18, 38] are not all on rank 0" in the first real run)."""
    from kv_fakes import WholePromptConnector, admit_whole, arrive
    from pdjax.request import Request, SamplingParams
    from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager
    from pdjax.sched.scheduler import Scheduler, SchedulerConfig

    dp, np_, ps = 4, 8, 4
    kv = DpKVCacheManager(dp, np_, ps)
    sched = Scheduler(SchedulerConfig(num_pages=dp * np_, page_size=ps, chunked_prefill_size=64,
                                      max_running_requests=8), kv=kv,
                      connector=WholePromptConnector())
    reqs = [Request(f"r{i}", [3 + (5 * i + j) % 90 for j in range(9 + i)],
                    SamplingParams(max_new_tokens=6, temperature=0)) for i in range(6)]
    for r in reqs:
        admit_whole(sched, r)
        ranks = {kv.allocator.rank_of(p) for p in r.pages}
        assert ranks == {kv.rank_of(r)}, (r.rid, r.pages, kv.rank_of(r))
        assert len(r.pages) == -(-r.num_prompt_tokens // ps)
    assert sorted(kv.rank_of(r) for r in reqs[:dp]) == list(range(dp))     # least loaded
    assert [x["num_requests"] for x in kv.rank_load()] == [2, 2, 1, 1]
    for r in reqs:
        arrive(sched, r, 7)
    for _ in range(12):                         # decode rows grow on their own rank
        batch = sched.schedule()
        if batch is None:
            break
        sched.process_results(batch, {i: 5 for i, row in enumerate(batch.rows) if row.samples},
                              lambda q: ({"type": "length", "length": 6}
                                         if len(q.output_ids) >= 6 else None))
        sched.check_invariants()
        for r in reqs:
            if r.pages:
                assert {kv.allocator.rank_of(p) for p in r.pages} == {kv.rank_of(r)}
    assert all(x["num_requests"] == 0 for x in kv.rank_load())


def test_decode_headroom_is_asked_of_the_requests_rank():
    """A PD decode keeps ``num_reserved_decode_tokens`` free for every running and arriving
    request; with DP attention it asked one rank (7 free pages here) for the headroom of the
    requests of every rank, so with one request in flight no other could be admitted on an
    empty rank. Now only the requests of the same rank count."""
    from kv_fakes import WholePromptConnector
    from pdjax.request import Request, SamplingParams
    from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager
    from pdjax.sched.scheduler import Scheduler, SchedulerConfig

    dp, np_, ps = 4, 8, 4
    kv = DpKVCacheManager(dp, np_, ps)
    sched = Scheduler(SchedulerConfig(num_pages=dp * np_, page_size=ps, chunked_prefill_size=64,
                                      max_running_requests=8, num_reserved_decode_tokens=16),
                      kv=kv, connector=WholePromptConnector())
    reqs = [Request(f"r{i}", [3 + (7 * i + j) % 90 for j in range(8)],
                    SamplingParams(max_new_tokens=64, temperature=0)) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    # 2 pages + 4 of headroom each: one request a rank fits, a second on a rank does not
    assert sorted(sched.waiting_remote) == ["r0", "r1", "r2", "r3"]
    assert sorted(kv.rank_of(r) for r in reqs[:4]) == list(range(dp))
    sched.check_invariants()


def test_per_rank_load_and_the_routers_use_of_it():
    """``/get_load``'s ``dp_ranks`` give each rank's pinned pages and ``kv_usage`` (shared
    prefix pages counted once); the router takes a DP worker's least used rank."""
    from kv_fakes import WholePromptConnector, admit_whole
    from pdjax.request import Request, SamplingParams
    from pdjax.router.pool import WorkerPool
    from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager
    from pdjax.sched.scheduler import Scheduler, SchedulerConfig

    dp, np_, ps = 2, 9, 4
    kv = DpKVCacheManager(dp, np_, ps)
    sched = Scheduler(SchedulerConfig(num_pages=dp * np_, page_size=ps, chunked_prefill_size=64,
                                      max_running_requests=8), kv=kv,
                      connector=WholePromptConnector())
    a = Request("a", list(range(3, 15)), SamplingParams(max_new_tokens=2, temperature=0))
    b = Request("b", list(range(20, 25)), SamplingParams(max_new_tokens=2, temperature=0))
    admit_whole(sched, a)                       # 3 pages on rank 0
    admit_whole(sched, b)                       # 2 pages on rank 1 (least loaded)
    load = kv.rank_load()
    assert [x["num_pinned_pages"] for x in load] == [3, 2]
    assert [x["kv_usage"] for x in load] == [3 / 8, 2 / 8]
    assert [x["num_requests"] for x in load] == [1, 1]

    pool = WorkerPool(["http://w0", "http://w1"])
    pool.set_kv_usage(0, {"kv_usage": 0.3, "dp_ranks": load})
    pool.set_kv_usage(1, {"kv_usage": 0.3})
    assert pool.kv_usage == [0.25, 0.3]
    pool.set_kv_usage(1, {"kv_usage": 0.1, "dp_ranks": [{"rank": 0}]})   # no usage: whole
    assert pool.kv_usage[1] == 0.1


def test_a_plain_description_reshards_with_replace():
    """``dataclasses.replace`` of a description without DP to more shards (a multi-host
    layout joins its nodes' shards that way) stayed valid: an unset ``shard_ranks`` is not
    fixed to the first shard count (``test_decode_ranks`` broke when it was)."""
    import dataclasses
    d = KVBufferDesc((1,), L, NP, 64)
    more = dataclasses.replace(d, shard_addrs=(1, 2), shard_heads=((0, 1), (0, 1)))
    assert more.shard_ranks == () and more.ranks == (0, 0) and more.dp_size == 1
