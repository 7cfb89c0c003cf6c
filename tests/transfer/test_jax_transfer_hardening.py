"""The ``jax`` backend's reviewed edges in one process: gathered arrays released on every
failed write (``write_pages``, the prefill worker, node 0 of a multi-host prefill)."""

import types

import pytest
from pd_fakes import prefill_worker
from rank_fakes import FakeCluster
from test_jax_transfer import FakeRunner, Peer

from pdjax.pd.rooms import PrefillRoom
from pdjax.transfer.engine import TransferError, create_transfer_engine
from pdjax.transfer.jax_transfer_kv import JaxLocalKV
from pdjax.transfer.prefill_ranks import PrefillRanks
from pdjax.transfer.prefill_worker import RoomFailed


@pytest.fixture(scope="module")
def prefill():
    engine = create_transfer_engine("jax", "127.0.0.1", pull_timeout_s=2.0, ack_slack_s=1.0)
    yield engine, JaxLocalKV(FakeRunner(21), engine, max_pages_per_seq=8)
    engine.close()


def _kept(kv, pages) -> int:
    """How many gathered entries ``kv`` keeps for ``pages``."""
    return len(kv._gathered.get(tuple(pages), ()))


def test_write_pages_releases_the_chunk_when_its_metadata_row_is_refused(prefill):
    """``_meta_rows`` raised before the arrays were taken: they stayed until the stale sweep."""
    engine, kv = prefill
    kv.stage_out([3, 4])
    kv.stage_out([5])
    with pytest.raises(ValueError, match=r"meta\[0\].src_addr: \[0x10, \+64\) is not "
                                         r"registered"):
        engine.write_pages(kv, Peer("127.0.0.1:1", kv.layout), [3, 4], [1, 2], [(16, 0, 64)])
    assert _kept(kv, [3, 4]) == 0 and _kept(kv, [5]) == 1        # another chunk's stay
    kv.drop_gathered([5])


def _worker(kv, engine, copy_to):
    peer = types.SimpleNamespace(session_id="decode:1", layout=kv.layout,
                                 reply_endpoint="tcp://d:1", metadata_addr=0x5000,
                                 metadata_num_slots=4, metadata_bytes_per_slot=64)
    worker = prefill_worker(local_kv=kv, transfer_engine=engine,
                            meta=types.SimpleNamespace(copy_to=copy_to))
    worker._peers["d"] = peer
    return worker


def test_the_worker_drops_a_chunk_only_when_the_write_path_never_took_it(prefill, monkeypatch):
    engine, kv = prefill

    def refuse(*a):
        raise ValueError("meta: slot 9 outside [0, 4)")

    worker = _worker(kv, engine, refuse)
    try:
        kv.stage_out([3, 4])
        worker._write_chunk(PrefillRoom(7, 0.0), 7, "d", 9, 0, [3, 4], [1, 2], True)
        (event,) = worker.events()
        assert isinstance(event, RoomFailed) and "slot 9 outside" in str(event.failure)
        assert _kept(kv, [3, 4]) == 0          # copy_to raised before write_pages: dropped
    finally:
        worker.close()

    def fail_after_taking(local_kv, peer, src, dst, meta, room=0):
        local_kv.take_gathered(src)
        raise TransferError("jax pull by decode decode:1 failed: gone")

    monkeypatch.setattr(engine, "write_pages", fail_after_taking)
    worker = _worker(kv, engine, lambda *a: (0, 0, 0))
    try:
        kv.stage_out([3, 4])
        kv.stage_out([3, 4])                   # a later chunk of the same pages
        worker._write_chunk(PrefillRoom(8, 0.0), 8, "d", 0, 0, [3, 4], [1, 2], False)
        (event,) = worker.events()
        assert isinstance(event, RoomFailed) and "gone" in str(event.failure)
        assert _kept(kv, [3, 4]) == 1          # write_pages took its own; the later one stays
    finally:
        worker.close()
        kv.drop_gathered([3, 4])


def test_node_zero_drops_its_chunk_for_a_decode_that_is_not_paired():
    dropped = []
    local_kv = types.SimpleNamespace(layout=None, drop_gathered=dropped.append)
    bootstrap = types.SimpleNamespace(registered_ranks=lambda: [])
    ranks = PrefillRanks(FakeCluster(), bootstrap, local_kv, "tcp://127.0.0.1:1")
    engine = types.SimpleNamespace(write_pages=None)
    with pytest.raises(ValueError, match="decode engine 'd9' is not paired"):
        ranks.write(engine, "d9", [3, 4], [1, 2], [], ranks.writes.new_job(), 0.01)
    assert dropped == [[3, 4]]


# ------------------------------------------------- a chunk's offers join by room and pages
def _units(value0, value1, bucket=2):
    """Head-group units 0 and 1 (one KV head each) of a ``bucket``-page chunk, filled."""
    import jax
    import numpy as np

    from test_jax_transfer import D, L, PS

    dev = jax.devices()[0]
    return [jax.device_put(np.full((L, bucket, PS, D), v, np.float32), dev)
            for v in (value0, value1)]


@pytest.fixture
def decode():
    engine = create_transfer_engine("jax", "127.0.0.1")
    runner = FakeRunner(22)
    yield engine, runner, JaxLocalKV(runner, engine, max_pages_per_seq=8)
    engine.close()


def test_a_late_offer_of_a_failed_room_never_joins_a_later_room_on_its_pages(decode):
    """Room 5 (a TP 2 prefill: unit 0 and 1 from two processes) got only unit 0 of pages
    3-4 before it failed; room 6 reuses the pages. Joined by pages alone, room 5's stale unit
    completed room 6's chunk; by room, room 6 scatters exactly its own rows."""
    import numpy as np

    from test_jax_transfer import D

    engine, runner, kv = decode
    k0, v0 = _units(1.0, 1.0)
    kv.put_units([3, 4], [2, 2], [[0], [0]], [k0, v0], room=5, bucket=2)     # room 5: late
    k1, v1 = _units(3.0, 3.0)
    kv.put_units([3, 4], [2, 2], [[1], [1]], [k1, v1], room=6, bucket=2)
    with pytest.raises(ValueError, match=r"units \[0\] of buffer k_cache arrived in no"):
        kv.stage_in([3, 4], room=6)      # room 5's unit 0 is not room 6's: still missing
    kv.put_units([3, 4], [2, 2], [[1], [1]], [k1, v1], room=6, bucket=2)
    k2, v2 = _units(2.0, 2.0)
    kv.put_units([3, 4], [2, 2], [[0], [0]], [k2, v2], room=6, bucket=2)
    kv.put_units([3, 4], [2, 2], [[0], [0]], [k0, v0], room=5, bucket=2)     # later still
    kv.stage_in([3, 4], room=6)
    assert kv.num_arrived() == 0          # room 5's stale rows of those pages: dropped
    for name in ("k_cache", "v_cache"):
        rows = np.asarray(runner.caches[name])[:, [3, 4]]
        assert (rows[..., :D] == 2.0).all() and (rows[..., D:] == 3.0).all()


def test_an_offer_whose_bucket_differs_from_its_chunks_is_refused(decode):
    engine, runner, kv = decode
    kv.put_units([3, 4], [2, 2], [[0], [0]], _units(1.0, 1.0), room=7, bucket=2)
    with pytest.raises(ValueError, match=r"bucket: an offer of bootstrap_room 7 for pages "
                                         r"\[3, 4\] has 4 pages / units \[2, 2\], the chunk's "
                                         r"earlier offer 2 / \[2, 2\]"):
        kv.check_join(7, [3, 4], [2, 2], 4)
    with pytest.raises(ValueError, match="bucket: an offer of bootstrap_room 7"):
        kv.put_units([3, 4], [2, 2], [[1], [1]], _units(1.0, 1.0, bucket=4), room=7, bucket=4)
    kv.check_join(8, [3, 4], [2, 2], 4)    # another room's chunk: its own
    assert kv.num_arrived() == 1
    kv.drop_arrived([3, 4])


def test_an_offer_with_no_unit_or_a_bad_room_is_refused_before_any_pull(decode):
    engine, runner, kv = decode
    prefill = JaxLocalKV(FakeRunner(23, tp=2), object(), max_pages_per_seq=8)
    desc = prefill.offer_descriptor(2, [2, 2], [[], []])
    with pytest.raises(ValueError, match="unit_ids: the offer carries no unit of any buffer"):
        kv.check_offer(desc, [3, 4], 2)
    assert kv.check_offer(prefill.offer_descriptor(2, [2, 2], [[1], []]), [3, 4], 2) == \
        ([2, 2], [[1], []])
    offer = {"v": 2, "uuid": 3, "address": "127.0.0.1:1", "bucket": 2, "dst": [3, 4],
             "buffers": desc, "meta": []}
    for room, needle in (("x", "expected int"), (True, "expected int"), (-1, "-1 outside"),
                         (None, "expected int"), (1 << 63, "9223372036854775808 outside")):
        with pytest.raises(ValueError, match=f"field 'room': {needle}"):
            engine._pull(dict(offer, room=room))
    refused = engine.num_refused_offers
    with pytest.raises(ValueError, match="carries no unit"):
        engine._pull(dict(offer, room=9))
    assert engine.num_refused_offers == refused + 1 and kv.num_arrived() == 0


# ------------------------------------------------------------ repeated heads over processes
def test_a_head_repeated_over_several_prefill_processes_is_offered_by_the_lowest_once():
    """2 KV heads at TP 4 (each on two devices), as if each device were its own process
    (node 0..3): before, every holder offered its unit (pulled twice, bytes counted twice);
    now node 0 offers head 0, node 2 head 1, nodes 1 and 3 nothing, and the bytes over the
    nodes sum to the decode's bytes per page once."""
    from test_jax_transfer import _repeated

    runner = FakeRunner(24, kvh=4, tp=4, latent=True)
    _repeated(runner, 2)
    kv = JaxLocalKV(runner, object(), max_pages_per_seq=8, head_repeat=2)
    decode = JaxLocalKV(FakeRunner(25, kvh=2, tp=1, latent=True), object(), max_pages_per_seq=8)
    kv._process_of = lambda device: device.id
    kv.num_nodes, offered, per_page = 4, {}, 0
    for node in range(4):
        kv.node_rank = node
        units, [(d, session, which, nbytes)] = kv.routes(decode.layout, "s0")
        assert (units, d, session) == ([2, 2, 1], 0, "s0")
        offered[node], per_page = which, per_page + nbytes
    assert offered == {0: [[0], [0], [0]], 1: [[], [], []], 2: [[1], [1], []],
                       3: [[], [], []]}
    assert per_page == decode.bytes_per_page


def test_a_mistyped_offer_is_refused_and_counted_not_a_type_error(decode):
    """``len()`` of a non-sized descriptor raised TypeError: an unclear message, and the pull
    thread did not count the refused offer."""
    engine, runner, kv = decode
    good = kv.offer_descriptor(2)
    for buffers, dst, needle in (
            (5, [3, 4], "expected a list of buffer dicts, got int"),
            ([5, 6], [3, 4], "expected a list of buffer dicts, got list"),
            (good[:1], [3, 4], "prefill has 1 KV buffers, decode 2"),
            ([dict(d, shard_heads=3) for d in good], [3, 4], "without a shard_heads list"),
            ([dict(d, shard_heads=None) for d in good], [3, 4], "without a shard_heads list"),
            (good, [3, True], "dst_pages: expected a list of page ids"),
            (good, "34", "dst_pages: expected a list of page ids")):
        with pytest.raises(ValueError, match=needle):
            kv.check_offer(buffers, dst, 2)
    offer = {"v": 2, "uuid": 3, "address": "127.0.0.1:1", "bucket": 2, "dst": [3, 4],
             "meta": [], "room": 1}
    refused = engine.num_refused_offers
    for buffers in (5, [5, 6], [dict(d, shard_heads=3) for d in good]):
        with pytest.raises(ValueError, match="layout descriptor"):
            engine._pull(dict(offer, buffers=buffers))
    assert engine.num_refused_offers == refused + 3 and kv.num_arrived() == 0
