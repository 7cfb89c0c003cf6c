"""The ``jax`` backend's engine and pool in one process (two transfer servers on 127.0.0.1,
each with its own small pool): a chunk offered by one and pulled by the other lands
byte-exact at the decode's pages with the null page clean; a layout mismatch is refused
before any byte moves; the decode's own deadline and the prefill's ack deadline end a transfer
that cannot finish, and both engines keep serving."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.models.cache_spec import CacheBufferSpec
from pdjax.transfer.engine import TransferError, create_transfer_engine
from pdjax.transfer.jax_transfer_kv import JaxLocalKV
from pdjax.transfer.metadata import MetadataBuffers

L, PAGES, PS, KVH, D = 2, 16, 4, 2, 8


class _Jits:
    def __init__(self, shardings):
        self.cache_shardings = shardings
        self.gather_pages = jax.jit(lambda c, idx: {k: jnp.take(v, idx, axis=1)
                                                    for k, v in c.items()})
        self.scatter = jax.jit(lambda c, idx, parts: {k: v.at[:, idx].set(parts[k])
                                                      for k, v in c.items()},
                               donate_argnums=0, out_shardings=shardings)


class FakeRunner:
    """The slice of ``ModelRunner`` the jax backend uses: a K and a V pool
    ``[L, PAGES, PS, kvh * D]`` float32 split over ``tp`` devices by heads (and, with
    ``latent``, an MLA-like ``[L, PAGES, PS, 24]`` buffer replicated on every device)."""

    def __init__(self, seed: int, dtype=jnp.float32, kvh: int = KVH, tp: int = 1,
                 latent: bool = False):
        mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
        heads = P(None, None, None, "tp")
        self.cache_specs = [CacheBufferSpec(n, (L, PAGES, PS, kvh * D), dtype, heads, kvh)
                            for n in ("k_cache", "v_cache")]
        if latent:
            self.cache_specs.append(CacheBufferSpec("latent", (L, PAGES, PS, 24), dtype, P()))
        shardings = {s.name: NamedSharding(mesh, s.partition) for s in self.cache_specs}
        self.jits = _Jits(shardings)
        rng = np.random.default_rng(seed)
        self.caches = {s.name: jax.device_put(jnp.asarray(
            rng.standard_normal(s.shape), dtype), shardings[s.name]) for s in self.cache_specs}

    def kv_buffers(self):
        return [self.caches[s.name] for s in self.cache_specs]

    def scatter_pages(self, idx, parts):
        named = {s.name: p for s, p in zip(self.cache_specs, parts)}
        self.caches = self.jits.scatter(self.caches, jnp.asarray(idx, jnp.int32), named)


@dataclasses.dataclass
class Peer:
    """The slice of ``DecodePeer`` an offer reads: the decode's offer socket and layout."""

    session_id: str
    layout: object


def _slot(meta, i):
    """Row ``i`` of ``meta``'s pool as bytes (a writable view)."""
    return meta._bytes[i * meta.bytes_per_slot:(i + 1) * meta.bytes_per_slot]


def _side(seed, runner_kw=None, **engine_kw):
    engine = create_transfer_engine("jax", "127.0.0.1", **engine_kw)
    runner = FakeRunner(seed, **(runner_kw or {}))
    kv = JaxLocalKV(runner, engine, max_pages_per_seq=8)
    meta = MetadataBuffers(4, 2)
    meta.register(engine)
    return engine, runner, kv, meta


@pytest.fixture(scope="module")
def pair():
    sides = [_side(1, pull_timeout_s=3.0, ack_slack_s=2.0), _side(2, pull_timeout_s=3.0,
                                                                   ack_slack_s=2.0)]
    yield sides
    for engine, *_ in sides:
        engine.close()


def _offer(pair, src, dst):
    (p_engine, p_runner, p_kv, p_meta), (d_engine, d_runner, d_kv, d_meta) = pair
    p_kv.stage_out(src)
    meta = [p_meta.copy_to(1, d_meta.base_addr, 2, d_meta.num_slots, d_meta.bytes_per_slot)]
    return p_engine.write_pages(p_kv, Peer(d_engine.session_id, d_kv.layout), src, dst, meta)


def test_chunk_lands_byte_exact_and_null_page_stays_clean(pair):
    (p_engine, p_runner, p_kv, p_meta), (d_engine, d_runner, d_kv, d_meta) = pair
    src, dst = [3, 7, 8], [10, 1, 5]            # 3 pages: a 4-page bucket, one padding row
    want = {k: np.asarray(v) for k, v in p_runner.caches.items()}
    before = {k: np.asarray(v) for k, v in d_runner.caches.items()}
    _slot(p_meta, 1)[:] = np.arange(p_meta.bytes_per_slot) % 256
    p_count = p_engine.counters()
    nbytes, arrays = _offer(pair, src, dst)
    assert arrays == 2 and nbytes == [3 * d_kv.bytes_per_page]
    assert d_kv.bytes_per_page == 2 * L * PS * KVH * D * 4
    # The metadata row landed in the decode's slot 2 before the ack.
    np.testing.assert_array_equal(_slot(d_meta, 2), np.arange(d_meta.bytes_per_slot) % 256)
    assert d_kv.num_arrived() == 1
    d_kv.stage_in(dst)                           # the decode's step boundary
    assert d_kv.num_arrived() == 0 and d_kv.num_missing_arrivals == 0
    for name in want:
        got = np.asarray(d_runner.caches[name])
        np.testing.assert_array_equal(got[:, dst], want[name][:, src])
        np.testing.assert_array_equal(got[:, 0], 0)           # padding row -> zeros, page 0
        untouched = [p for p in range(1, PAGES) if p not in dst]
        np.testing.assert_array_equal(got[:, untouched], before[name][:, untouched])
    c = p_engine.counters()
    assert c.bytes - p_count.bytes == 3 * d_kv.bytes_per_page and c.failures == 0


def test_layout_mismatch_is_refused_before_any_byte_moves(pair):
    (p_engine, _, p_kv, p_meta), (d_engine, d_runner, d_kv, d_meta) = pair
    other_engine = create_transfer_engine("jax", "127.0.0.1", pull_timeout_s=3.0)
    try:
        # Same bytes per page, other split: [.., 2 heads x 8] against [.., 1 head x 16].
        runner = FakeRunner(3)
        runner.cache_specs = [dataclasses.replace(s, row_heads=1, partition=P())
                              for s in runner.cache_specs]
        kv = JaxLocalKV(runner, other_engine, max_pages_per_seq=8)
        meta = MetadataBuffers(4, 2)
        meta.register(other_engine)
        before = {k: np.asarray(v) for k, v in d_runner.caches.items()}
        _slot(d_meta, 3)[:] = 0
        kv.stage_out([2, 3])
        row = [meta.copy_to(0, d_meta.base_addr, 3, d_meta.num_slots, d_meta.bytes_per_slot)]
        _slot(meta, 0)[:] = 7
        refused = d_engine.num_refused_offers
        with pytest.raises(TransferError, match=r"num_heads: prefill 1 != decode 2"):
            other_engine.write_pages(kv, Peer(d_engine.session_id, d_kv.layout), [2, 3],
                                     [4, 6], row)
        assert d_engine.num_refused_offers == refused + 1
        assert d_kv.num_arrived() == 0 and not _slot(d_meta, 3).any()    # nothing landed
        with pytest.raises(ValueError, match="2 of the room's 2 pages arrived in no pulled"):
            d_kv.stage_in([4, 6])                  # the decode's gate would fail the room
        for name in before:
            np.testing.assert_array_equal(np.asarray(d_runner.caches[name]), before[name])
        assert other_engine.counters().failures == 1
    finally:
        other_engine.close()
    # The pair still works after the refusal.
    assert _offer(pair, [2], [9])[1] == 2
    d_kv.stage_in([9])


def test_decode_deadline_ends_a_pull_of_a_missing_uuid_and_keeps_serving(pair):
    """The library's pull timeout is swept lazily (a pull of an id nobody offered hangs): the
    decode's own deadline fails it, poisons the connection, and the next pull reconnects."""
    import msgpack
    import zmq

    (p_engine, _, p_kv, _), (d_engine, _, d_kv, _) = pair
    offer = {"v": 2, "uuid": 12345, "address": p_engine.transfer_address, "dst": [3],
             "bucket": 1, "buffers": d_kv.offer_descriptor(1, [1, 1]), "meta": [], "room": 1}
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{d_engine.session_id}")
        t0 = time.monotonic()
        sock.send(msgpack.packb(offer))
        assert sock.poll(20_000), "no answer from the decode"
        reply = msgpack.unpackb(sock.recv())
    finally:
        sock.close(0)
    took = time.monotonic() - t0
    assert not reply["ok"] and "timed out after 3 s" in reply["error"], reply
    assert 2.5 <= took < 10, took
    assert d_engine.num_pull_timeouts >= 1 and d_kv.num_arrived() == 0
    assert _offer(pair, [4, 5], [11, 12])[1] == 2            # reconnects and pulls
    d_kv.stage_in([11, 12])


def test_prefill_frees_an_offer_the_decode_never_pulls(pair):
    """A decode that never answers: the prefill gives up at its ack deadline, resets its pull
    table (the offered arrays go) and offers the next chunk normally."""
    import zmq

    (p_engine, _, p_kv, _), _ = pair
    mute = zmq.Context.instance().socket(zmq.ROUTER)     # takes offers, never answers
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        p_kv.stage_out([6])
        failures = p_engine.counters().failures
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="did not ack the pull of 1 pages within 5 s"):
            p_engine.write_pages(p_kv, Peer(f"127.0.0.1:{port}", pair[1][2].layout), [6], [2], [])
        assert 4.5 <= time.monotonic() - t0 < 15
        assert p_engine.counters().failures == failures + 1
    finally:
        mute.close(0)
    assert _offer(pair, [6], [13])[1] == 2
    pair[1][2].stage_in([13])


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2)])
def test_different_tp_sizes_move_head_group_units(tp_p, tp_d):
    """4 KV heads split over ``tp_p`` prefill and ``tp_d`` decode devices (simulated CPU
    devices): ``max(tp_p, tp_d)`` units; the replicated latent reaches every decode device.
    The decode's pool equals the prefill's rows, shard by shard."""
    sides = [_side(4, dict(kvh=4, tp=tp_p, latent=True), pull_timeout_s=5.0),
             _side(5, dict(kvh=4, tp=tp_d, latent=True), pull_timeout_s=5.0)]
    try:
        (p_engine, p_runner, p_kv, _), (d_engine, d_runner, d_kv, _) = sides
        assert p_kv.units_for([tp_d] * 3) == [max(tp_p, tp_d)] * 2 + [1]
        src, dst = [1, 2, 9, 4, 5], [7, 3, 4, 14, 15]
        want = {k: np.asarray(v) for k, v in p_runner.caches.items()}
        p_kv.stage_out(src)
        nbytes, arrays = p_engine.write_pages(p_kv, Peer(d_engine.session_id, d_kv.layout),
                                              src, dst, [])
        assert arrays == 2 * max(tp_p, tp_d) + 1
        # Bytes the decode's shards receive: K and V once, the latent once per decode device.
        assert nbytes == [5 * L * PS * 4 * (2 * 4 * D + tp_d * 24)]
        d_kv.stage_in(dst)
        for name, spec in zip(want, d_runner.cache_specs):
            got = d_runner.caches[name]
            assert got.sharding == d_runner.jits.cache_shardings[name]
            np.testing.assert_array_equal(np.asarray(got)[:, dst], want[name][:, src])
            np.testing.assert_array_equal(np.asarray(got)[:, 0], 0)
            for shard in got.addressable_shards:            # every replica / head shard
                full = want[name][:, src][(slice(None),) * 3 + (shard.index[3],)]
                np.testing.assert_array_equal(np.asarray(shard.data)[:, dst], full)
    finally:
        for engine, *_ in sides:
            engine.close()


def _repeated(runner, rep):
    """``runner``'s K and V with each group of ``rep`` neighbouring heads equal to its first, as
    ``tp_model_config`` lays out a checkpoint KV head repeated ``rep`` times."""
    for name in ("k_cache", "v_cache"):
        x = np.asarray(runner.caches[name]).reshape(L, PAGES, PS, -1, rep, D)
        x = np.broadcast_to(x[:, :, :, :, :1], x.shape).reshape(L, PAGES, PS, -1)
        runner.caches[name] = jax.device_put(jnp.asarray(x), runner.jits.cache_shardings[name])


@pytest.mark.parametrize("tp_p,rep_p,tp_d,rep_d", [(4, 2, 1, 1), (1, 1, 4, 2), (4, 2, 4, 2),
                                                   (4, 2, 2, 1), (2, 1, 4, 2)])
def test_heads_that_tp_repeats_move_once_per_checkpoint_head(tp_p, rep_p, tp_d, rep_d):
    """2 checkpoint KV heads; a side at TP 4 holds each twice (``head_repeat`` 2, one copy a
    device). Each checkpoint head moves once (2 units of K and of V, 1 of the latent); the
    decode copies it to every device holding it, and each decode shard then holds its heads'
    rows of the prefill's pages."""
    sides = []
    try:
        for seed, tp, rep in ((7, tp_p, rep_p), (8, tp_d, rep_d)):
            engine = create_transfer_engine("jax", "127.0.0.1", pull_timeout_s=5.0)
            runner = FakeRunner(seed, kvh=2 * rep, tp=tp, latent=True)
            if rep > 1:
                _repeated(runner, rep)
            sides.append((engine, runner, JaxLocalKV(runner, engine, max_pages_per_seq=8,
                                                     head_repeat=rep)))
        (p_engine, p_runner, p_kv), (d_engine, d_runner, d_kv) = sides
        assert [b.num_heads for b in p_kv.layout.buffers] == [2, 2, 1]
        src, dst = [1, 2, 9, 4, 5], [7, 3, 4, 14, 15]
        want = {k: np.asarray(v)[:, src] for k, v in p_runner.caches.items()}
        p_kv.stage_out(src)
        nbytes, arrays = p_engine.write_pages(p_kv, Peer(d_engine.session_id, d_kv.layout),
                                              src, dst, [])
        assert arrays == 2 * 2 + 1
        # What the decode's shards hold: each checkpoint head once per device holding it.
        assert nbytes == [5 * d_kv.bytes_per_page]
        assert d_kv.bytes_per_page == L * PS * 4 * (2 * 2 * D * rep_d + tp_d * 24)
        assert d_engine.counters().bytes == nbytes[0]         # the decode counts the same
        d_kv.stage_in(dst)
        for name in want:
            got = d_runner.caches[name]
            assert got.sharding == d_runner.jits.cache_shardings[name]
            for shard in got.addressable_shards:
                lo = shard.index[3].start or 0
                rows = np.asarray(shard.data)[:, dst]
                if name == "latent":
                    np.testing.assert_array_equal(rows, want[name])
                    continue
                head = lo // D // rep_d                     # the checkpoint head it holds
                heads = rows.shape[3] // D
                if rep_d > 1:
                    assert heads == 1
                ref = want[name].reshape(L, 5, PS, -1, rep_p, D)[:, :, :, :, 0]
                np.testing.assert_array_equal(rows.reshape(L, 5, PS, heads, D),
                                              ref[:, :, :, head:head + heads])
    finally:
        for engine, *_ in sides:
            engine.close()


def test_routes_pair_units_with_the_decode_nodes_that_hold_them():
    """A two-node decode (TP 4, two shards a node) of 4 KV heads and a replicated latent: a
    TP 2 prefill offers node 1 the units of heads 2-3 and node 0 (last) those of heads 0-1,
    each with the bytes its shards receive; the latent goes to both (prefill node d % 1 = 0).
    A unit offered twice or one the decode node does not hold is refused before any pull."""
    prefill = JaxLocalKV(FakeRunner(9, kvh=4, tp=2, latent=True), object(), max_pages_per_seq=8)
    decode = JaxLocalKV(FakeRunner(10, kvh=4, tp=4, latent=True), object(), max_pages_per_seq=8)
    nodes = [[0, 0, 1, 1]] * 3            # shards in head order: node 0 holds heads 0 and 1
    units, routes = prefill.routes(decode.layout, "s0", ["s0", "s1"], nodes)
    assert units == [4, 4, 1]
    head_page = L * PS * D * 4            # one head of one buffer, a page, every layer
    latent_page = L * PS * 24 * 4
    assert routes == [(1, "s1", [[2, 3], [2, 3], [0]], 2 * 2 * head_page + 2 * latent_page),
                      (0, "s0", [[0, 1], [0, 1], [0]], 2 * 2 * head_page + 2 * latent_page)]
    assert sum(r[3] for r in routes) == decode.bytes_per_page
    desc = prefill.offer_descriptor(2, units, routes[0][2])
    assert decode.check_offer(desc, [3, 4], 2) == (units, [[2, 3], [2, 3], [0]])
    desc[0]["unit_ids"] = [2, 2]
    with pytest.raises(ValueError, match=r"buffers\[0\] \(k_cache\) unit_ids: \[2, 2\]"):
        decode.check_offer(desc, [3, 4], 2)
    desc[0]["unit_ids"] = [5]
    with pytest.raises(ValueError, match=r"unit_ids: \[5\] are not distinct units of the 4"):
        decode.check_offer(desc, [3, 4], 2)


def test_unsupported_pools_and_splits_are_refused_naming_the_field():
    """TP sizes whose head-group units do not split both sides (4 heads on 2 shards here, 3
    on the peer) are refused per buffer."""
    kv = JaxLocalKV(FakeRunner(6, kvh=4, tp=2, latent=True), object(), max_pages_per_seq=8)
    assert kv.units_for([1, 1, 1]) == [2, 2, 1] and kv.units_for([4, 4, 4]) == [4, 4, 1]
    with pytest.raises(ValueError, match=r"kv_buffers\[0\] \(k_cache\): 4 KV heads on 2 shards "
                                         r"here and 3 on the peer do not split into 3"):
        kv.units_for([3, 3, 3])
    with pytest.raises(ValueError, match=r"bucket: the prefill's 3 pages is not a bucket"):
        kv.check_offer(kv.offer_descriptor(4), [1, 2], 3)
    with pytest.raises(ValueError, match=r"dst_pages: \[16\] outside \[1, 16\)"):
        kv.check_offer(kv.offer_descriptor(2), [3, 16], 2)


def test_auto_backend_is_jax_on_tpu_and_mooncake_elsewhere():
    from pdjax.config import ServerArgs
    from pdjax.transfer.pd_connector import resolve_transfer_backend

    assert ServerArgs().disaggregation_transfer_backend == "auto"
    assert ServerArgs(disaggregation_transfer_backend="jax").disaggregation_transfer_backend \
        == "jax"
    assert [resolve_transfer_backend("auto", p) for p in ("tpu", "gpu", "cpu")] == \
        ["jax", "mooncake", "mooncake"]
    assert resolve_transfer_backend("auto") == "mooncake"          # this CPU machine
    assert resolve_transfer_backend("fake", "tpu") == "fake"
    assert resolve_transfer_backend("mooncake", "tpu") == "mooncake"


def test_a_cancelled_chunk_frees_its_gathered_arrays_at_once():
    """The prefill's transfer thread skips a chunk of a failed room: the arrays its
    ``stage_out`` gathered are dropped then, not at the stale sweep."""
    from pdjax.pd.rooms import PrefillRoom
    from pdjax.transfer.prefill_worker import PrefillTransferWorker

    engine = create_transfer_engine("jax", "127.0.0.1")
    try:
        kv = JaxLocalKV(FakeRunner(8), engine, max_pages_per_seq=8)
        events = []
        worker = PrefillTransferWorker(
            channel=None, local_kv=kv, meta=None, transfer_engine=engine, ranks=None,
            page_size=PS, transfer_timeout_s=1.0, sender_id="p", wait_for_kv=lambda: None,
            wake=lambda: events.append("wake"), on_reject=lambda kind: None)
        try:
            kv.stage_out([3, 4])
            kv.stage_out([5])
            worker.cancel(7)
            worker._write_chunk(PrefillRoom(7, 0.0), 7, "d", 0, 0, [3, 4], [1, 2], False)
            with pytest.raises(ValueError, match="no gathered arrays for pages"):
                kv.take_gathered([3, 4])
            assert len(kv.take_gathered([5])) == 2          # another chunk's stay
        finally:
            worker.close()
    finally:
        engine.close()


def test_offers_are_sealed_with_the_shared_secret():
    """With a secret the decode opens every offer before it reads it: the same secret pulls,
    another secret or none is refused before any byte moves, and the decode keeps serving."""
    sides = [_side(9, secret="s3cret", pull_timeout_s=3.0),
             _side(10, secret="s3cret", pull_timeout_s=3.0)]
    strangers = [create_transfer_engine("jax", "127.0.0.1", secret="other", pull_timeout_s=3.0),
                 create_transfer_engine("jax", "127.0.0.1", pull_timeout_s=3.0)]
    try:
        (p_engine, _, p_kv, _), (d_engine, d_runner, d_kv, _) = sides
        p_kv.stage_out([2])
        assert p_engine.write_pages(p_kv, Peer(d_engine.session_id, d_kv.layout), [2], [5],
                                    [])[1] == 2
        d_kv.stage_in([5])
        for other in strangers:
            kv = JaxLocalKV(FakeRunner(11), other, max_pages_per_seq=8)
            kv.stage_out([3])
            with pytest.raises(TransferError, match="offer refused: "):
                other.write_pages(kv, Peer(d_engine.session_id, d_kv.layout), [3], [6], [])
        assert d_engine.num_auth_rejected == 2 and d_kv.num_arrived() == 0
        p_kv.stage_out([4])
        assert p_engine.write_pages(p_kv, Peer(d_engine.session_id, d_kv.layout), [4], [7],
                                    [])[1] == 2
        d_kv.stage_in([7])
    finally:
        for engine in [s[0] for s in sides] + strangers:
            engine.close()


def test_a_room_whose_rows_did_not_arrive_fails_at_the_gate():
    """The decode's metadata gate passes but a page of the room arrived in no pulled chunk:
    the room fails with the reason (it used to log and decode from stale KV); a failed
    room's pulled chunks are dropped, not kept for the stale sweep."""
    from pd_fakes import decode_connector

    from pdjax.pd.lifecycle import Aborted, KVPoll
    from pdjax.pd.rooms import DecodeRoom
    from pdjax.request import Request, SamplingParams

    du = decode_connector()
    conn = du.conn
    try:
        kv = JaxLocalKV(FakeRunner(12), object(), max_pages_per_seq=8)
        conn.local_kv = kv
        conn.transfer_engine.backend = "jax"        # the gate applies (not the fake backend)
        digest = bytes(range(16))

        def room(n, pages):
            req = Request(f"r{n}", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=2))
            r = DecodeRoom(n, req, ("127.0.0.1", 1), time.monotonic(),
                           state=KVPoll.Transferring, slot=conn.meta.alloc(), dst_pages=pages,
                           digest=digest)
            conn.meta.write(r.slot, n, 11, prompt_digest=digest)
            conn.rooms[req.rid] = r
            return r

        kv.put_arrived([3], [np.zeros((L, 1, PS, KVH * D), np.float32)] * 2, room=41)
        r = room(41, [3, 4])                         # page 4 never arrived
        conn._hand_over(r, time.monotonic())
        assert r.state == KVPoll.Failed and r.failure.label == "write"
        assert "KV not received: dst_pages: 1 of the room's 2 pages" in str(r.failure)
        assert kv.num_missing_arrivals == 1 and kv.num_arrived() == 0
        failed = conn.worker.poll().failed_recving
        assert "r41" in failed
        kv.put_arrived([6, 7], [np.zeros((L, 2, PS, KVH * D), np.float32)] * 2, room=42)
        r2 = room(42, [6, 7])
        conn._fail(r2, Aborted("aborted by client"))
        assert kv.num_arrived() == 0
    finally:
        conn.close()
