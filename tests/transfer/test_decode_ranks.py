"""A multi-host decode's data plane without processes (``transfer/decode_ranks.py``, DESIGN.md §6):
``RegisterDecode``'s node fields and ``DecodeRankInfo`` (range checks naming the field), node
0's record of the other nodes' reports, the follower's reports, and the prefill writing each
decode node's shards into that node's session (the parts partition the one-process plan, the
metadata row goes last to node 0)."""

from __future__ import annotations

import collections
import threading
import types

import pytest
from pd_fakes import FakeChannel, prefill_worker
from rank_fakes import FakeCluster, RecordingEngine

from pdjax.pd.bootstrap import PrefillRankInfo
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import DecodeRankInfo, ProtocolError, RegisterDecode, decode_message
from pdjax.pd.rooms import PrefillRoom
from pdjax.transfer.decode_peer import DecodePeer
from pdjax.transfer.decode_ranks import DecodeRankNode, DecodeRanks
from pdjax.transfer.kv_copies import KVLayout, build_copies
from pdjax.transfer.prefill_ranks import PrefillRanks

PS, LAYERS, HEAD_BYTES, PAGES = 4, 2, 16, 16


def _buf(addr, heads):
    count = heads[0][1]
    return KVBufferDesc(shard_addrs=tuple(addr), num_layers=LAYERS, num_pages=PAGES,
                        bytes_per_page=PS * count * HEAD_BYTES, num_heads=2,
                        shard_heads=tuple(heads), head_bytes=HEAD_BYTES)


def _node(rank):
    """Node ``rank`` of a TP 2 decode over 2 nodes: head ``rank`` of K and V."""
    base = 0x100000 * (rank + 1)
    return KVLayout("layer_major", (_buf([base], [(rank, 1)]),
                                    _buf([base + 0x10000], [(rank, 1)])))


PREFILL = KVLayout("layer_major", (_buf([0x900000], [(0, 2)]), _buf([0x990000], [(0, 2)])))


def _register(**kw):
    base = dict(decode_engine_id="d1", reply_endpoint="tcp://127.0.0.1:5", engine_session_id="s0",
                tp_rank=0, tp_size=1, kv_buffers=tuple(_buf([0x100000 * (r + 1)], [(r, 1)])
                                                       for r in (0, 1)),
                kv_layout="layer_major", metadata_addr=0x5000, metadata_bytes_per_slot=64,
                metadata_num_slots=4, page_size=PS, kv_dtype="float32", layout_fingerprint="f")
    return dict(base, **kw)


def _merged():
    """Both nodes' shards as ``DecodeRanks.layout`` gives them to ``RegisterDecode``."""
    ranks = DecodeRanks(FakeCluster())
    assert ranks.report(_info(1)) is None
    return ranks.layout(_node(0), "s0", 1.0)


def _info(rank=1, generation=0, layout=None):
    layout = layout or _node(rank)
    return DecodeRankInfo(node_rank=rank, session_id=f"s{rank}", kv_layout=layout.kind,
                          kv_buffers=layout.buffers, generation=generation)


def test_register_decode_carries_every_node_and_checks_the_fields():
    layout, sessions, owners = _merged()
    assert sessions == ("s0", "s1") and owners == ((0, 1), (0, 1))
    assert [b.shard_heads for b in layout.buffers] == [((0, 1), (1, 1))] * 2
    msg = RegisterDecode(**_register(kv_buffers=layout.buffers, node_sessions=sessions,
                                     shard_nodes=owners))
    assert decode_message(msg.encode()) == msg
    one = RegisterDecode(**_register(kv_buffers=_node(0).buffers))
    assert decode_message(one.encode()) == one and one.node_sessions == ()
    for bad, needle in (
            (dict(node_sessions=("s0",), shard_nodes=((0, 1),) * 2), r"1 nodes outside \[2,"),
            (dict(node_sessions=("s9", "s1"), shard_nodes=owners), r"node_sessions\[0\]"),
            (dict(node_sessions=("s0", ""), shard_nodes=owners), r"node_sessions\[1\]"),
            (dict(shard_nodes=owners), "given without node_sessions"),
            (dict(node_sessions=sessions, shard_nodes=((0, 1),)), "one list per buffer"),
            (dict(node_sessions=sessions, shard_nodes=((0, 2), (0, 1))),
             r"shard_nodes\[0\]\[1\]': 2 outside \[0, 1\]"),
            (dict(node_sessions=sessions, shard_nodes=((0, 0), (0, 1))),
             r"shard_nodes\[0\]': nodes \[1\] hold no shard"),
            (dict(node_sessions=sessions, shard_nodes=((0,), (0, 1))), "one node per shard"),
            (dict(node_sessions="s0s1", shard_nodes=owners), "node_sessions': expected a list")):
        with pytest.raises(ProtocolError, match=needle):
            RegisterDecode(**_register(kv_buffers=layout.buffers, **bad))
    # The same checks on a frame from the network.
    wire = msg.to_wire()
    wire["shard_nodes"][1][0] = -1
    frame = RegisterDecode.encode.__get__(types.SimpleNamespace(
        to_wire=lambda: wire, TYPE=RegisterDecode.TYPE))()
    with pytest.raises(ProtocolError, match=r"shard_nodes\[1\]\[0\]"):
        decode_message(frame)


def test_decode_rank_info_round_trip_and_range_checks():
    msg = _info(1, 3)
    assert decode_message(msg.encode()) == msg
    for bad, field in ((dict(node_rank=0), "node_rank"), (dict(generation=-1), "generation"),
                       (dict(kv_layout="sideways"), "kv_layout"), (dict(session_id=""),
                                                                   "session_id"),
                       (dict(kv_buffers=()), "kv_buffers")):
        with pytest.raises(ProtocolError, match=field):
            DecodeRankInfo(**{**dict(node_rank=1, session_id="s1", kv_layout="layer_major",
                                     kv_buffers=_node(1).buffers, generation=0), **bad})
    wire = msg.to_wire()
    wire["kv_buffers"][0]["shard_addrs"] = [0]
    frame = DecodeRankInfo.encode.__get__(types.SimpleNamespace(
        to_wire=lambda: wire, TYPE=DecodeRankInfo.TYPE))()
    with pytest.raises(ProtocolError, match=r"kv_buffers\[0\].*shard_addrs"):
        decode_message(frame)


def test_node_zero_records_reports_in_generation_order_and_names_a_missing_node():
    cluster = FakeCluster()
    ranks = DecodeRanks(cluster)
    ranks.announce("tcp://n0:1")
    ranks.check()
    assert cluster.sent == [("kv_ranks", {"reply": "tcp://n0:1"}), ("kv_check", {})]
    with pytest.raises(ValueError, match=r"decode node\(s\) \[1\] did not report"):
        ranks.layout(_node(0), "s0", 0.05)
    assert ranks.report(_info(1).__class__(**dict(vars(_info(1)), node_rank=2))) == \
        "DecodeRankInfo from node 2, not in [1, 2)"
    threading.Timer(0.05, ranks.report, (_info(1),)).start()
    layout, sessions, owners = ranks.layout(_node(0), "s0", 5.0)     # waits for node 1
    assert sessions == ("s0", "s1") and layout.buffers[0].shard_addrs == (0x100000, 0x200000)
    assert not ranks.take_moved()
    assert "generation 0 is not after 0" in ranks.report(_info(1))
    moved = KVLayout("layer_major", tuple(KVBufferDesc(**dict(vars(b), shard_addrs=(
        b.shard_addrs[0] + 0x40000,))) for b in _node(1).buffers))
    assert ranks.report(_info(1, 1, moved)) is None
    assert ranks.take_moved() and not ranks.take_moved()
    assert ranks.state() == [{"node_rank": 1, "session_id": "s1", "generation": 1}]
    assert ranks.layout(_node(0), "s0", 0.0)[0].buffers[0].shard_addrs == (0x100000, 0x240000)
    cluster.lost = "node 1 went away"
    ranks.check()                        # no command to a cluster that is gone
    assert len(cluster.sent) == 2


def test_a_decode_follower_reports_at_current_addresses_and_after_a_move():
    moves = [True, False, True]            # moved in warm-up, then not, then once more
    sent = []
    node = DecodeRankNode(
        1, types.SimpleNamespace(session_id="s1"),
        types.SimpleNamespace(layout=_node(1), check_addresses=lambda: moves.pop(0)),
        types.SimpleNamespace(send=lambda endpoint, msg: sent.append((endpoint, msg))))
    assert set(node.handlers) == {"kv_ranks", "kv_check"}
    node.on_ranks({"reply": "udp://x"})            # refused: nothing reported, nothing checked
    assert sent == [] and len(moves) == 3
    node.on_ranks({"reply": "tcp://n0:1"})
    node.on_check({})
    node.on_check({})
    assert [(e, m.generation) for e, m in sent] == [("tcp://n0:1", 1), ("tcp://n0:1", 2)]
    assert sent[0][1] == _info(1, 1)


def test_the_prefill_writes_each_decode_node_into_its_own_session():
    layout, sessions, owners = _merged()
    msg = RegisterDecode(**_register(kv_buffers=layout.buffers, node_sessions=sessions,
                                     shard_nodes=owners))
    peer = DecodePeer("d1", msg.reply_endpoint, "s0", layout, 0x5000, 4, 64, sessions, owners)
    assert [s for s, _ in peer.node_writes()] == ["s1", "s0"]      # node 0 (metadata) last
    worker = prefill_worker(transfer_engine=RecordingEngine(),
                            local_kv=types.SimpleNamespace(layout=PREFILL))
    src, dst, meta = [3, 4, 9], [7, 8, 2], [(0x7000, 0x5000, 64)]
    node_bytes, n = worker._write_nodes(peer, src, dst, meta)
    (s1, c1), (s0, c0) = worker.transfer_engine.writes
    assert (s1, s0) == ("s1", "s0") and c0[-1] == meta[0] and meta[0] not in c1
    whole = build_copies(PREFILL, layout, src, dst)
    assert collections.Counter(whole) == collections.Counter(c0[:-1] + c1) and n == len(whole)
    # Each node's copies land in its own buffers only; half the bytes each.
    for r, part in ((0, c0[:-1]), (1, c1)):
        lo = 0x100000 * (r + 1)
        assert part and all(lo <= d < lo + 0x20000 for _, d, _ in part)
    half = len(src) * LAYERS * sum(b.bytes_per_page for b in _node(0).buffers)
    assert node_bytes == [half, half]
    # One process: one write with everything.
    worker.transfer_engine = RecordingEngine()
    single = DecodePeer("d2", "tcp://d:2", "s9", KVLayout("layer_major", PREFILL.buffers),
                        0x5000, 4, 64)
    assert worker._write_nodes(single, src, dst, meta) == ([2 * half], len(build_copies(
        PREFILL, PREFILL, src, dst)))
    assert [s for s, _ in worker.transfer_engine.writes] == ["s9"]
    worker.close()


def test_a_multi_host_prefill_pairs_with_a_multi_host_decode():
    layout, sessions, owners = _merged()
    msg = RegisterDecode(**_register(kv_buffers=layout.buffers, node_sessions=sessions,
                                     shard_nodes=owners))
    local_kv = types.SimpleNamespace(layout=_node(0), kv_dtype="float32", fingerprint="f")
    bootstrap = types.SimpleNamespace(registered_ranks=lambda: [
        PrefillRankInfo(rank_ip="h", rank_port=1, tp_rank=r, tp_size=2, page_size=PS,
                        kv_dtype="float32", layout_fingerprint="f", session_id=f"p{r}",
                        kv_layout="layer_major", kv_buffers=_node(r).buffers) for r in (0, 1)])
    ranks = PrefillRanks(FakeCluster(), bootstrap, local_kv, "tcp://127.0.0.1:1")
    channel, rejected = FakeChannel(), []
    worker = prefill_worker(channel=channel, local_kv=local_kv, ranks=ranks, page_size=PS,
                            meta=types.SimpleNamespace(bytes_per_slot=64),
                            on_reject=rejected.append)
    worker.on_message(msg)
    worker.close()
    told = [m for _, m in channel.sent]
    assert told[0].accepted and rejected == [], told[0].reason
    peer = worker.peer("d1")
    assert (peer.node_sessions, peer.shard_nodes) == (sessions, owners)
    # The plan over both prefill nodes' shards, for kv_peer: each node writes both sessions.
    job = ranks.send_write("d1", [3], [7])
    op, kv_peer = ranks.cluster.sent[0]
    assert op == "kv_peer" and kv_peer["node_sessions"] == ["s0", "s1"]
    assert kv_peer["shard_nodes"] == [[0, 1]] * 2 and job == 1
    assert PrefillRoom(room=1, created_s=0.0).record()["node_bytes"] == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_follower_node_builds_its_own_data_plane(role):
    """``RankSender.for_host`` / ``DecodeRankNode.for_host``, the follower's real path (run
    only in multi-host children before): its own fake-backend engine, a direct ``LocalKV``
    over the runner's buffers, a control channel that reads."""
    from pd_fakes import KVRunner

    from pdjax.config import ServerArgs
    from pdjax.transfer.prefill_ranks import RankSender

    args = ServerArgs(role=role, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:9",
                      page_size=4, disaggregation_transfer_backend="fake")
    host = types.SimpleNamespace(args=args, runner=KVRunner((2, 9, 4, 2, 8)), context_length=32,
                                 model_cfg=types.SimpleNamespace(num_kv_heads=2),
                                 model_path="unused")
    node = (RankSender if role == "prefill" else DecodeRankNode).for_host(host)
    try:
        assert node.rank == 1 and node.engine.backend == "fake"
        assert node.local_kv.mode == "direct" and node.local_kv.num_pages == 9
        assert node.channel.name == f"{role}-node-1" and node.channel._thread.is_alive()
        assert set(node.handlers) == ({"kv_peer", "kv_write"} if role == "prefill"
                                      else {"kv_ranks", "kv_check"})
    finally:
        node.channel.close()


def test_jax_decode_nodes_scatter_and_drop_at_node_0s_step_boundary():
    """A pull-based pool (the jax backend): node 0's pool sends ``kv_stage_in`` / ``kv_drop``
    on the step socket; with a node gone a stage-in fails the room (ValueError) and a drop is
    skipped; a follower scatters or drops its own units for valid pages only."""
    cluster = FakeCluster()
    ranks = DecodeRanks(cluster)
    pool = types.SimpleNamespace(mode="jax", mirror=None)
    ranks.attach(pool)
    pool.mirror("kv_stage_in", pages=[3, 4])
    pool.mirror("kv_drop", pages=[5])
    assert cluster.sent == [("kv_stage_in", {"pages": [3, 4]}), ("kv_drop", {"pages": [5]})]
    cluster.lost = "node 1 went away"
    with pytest.raises(ValueError, match=r"cannot scatter their KV \(node 1 went away\)"):
        pool.mirror("kv_stage_in", pages=[6])
    pool.mirror("kv_drop", pages=[6])
    assert len(cluster.sent) == 2
    mooncake = types.SimpleNamespace(mode="direct")
    ranks.attach(mooncake)
    assert not hasattr(mooncake, "mirror")

    calls = []
    kv = types.SimpleNamespace(mode="jax", num_pages=16, stage_in=lambda p, room=None: calls.append(
        ("in", p)), drop_arrived=lambda p: calls.append(("drop", p)))
    node = DecodeRankNode(1, types.SimpleNamespace(session_id="s1"), kv, FakeChannel())
    handlers = node.handlers
    assert {"kv_ranks", "kv_check", "kv_stage_in", "kv_drop"} == set(handlers)
    broken = []
    node.on_broken = broken.append
    handlers["kv_stage_in"]({"op": "kv_stage_in", "pages": [3, 4]})
    handlers["kv_drop"]({"op": "kv_drop", "pages": [5]})
    handlers["kv_drop"]({"op": "kv_drop", "pages": "5"})                # logged only
    handlers["kv_drop"]({"op": "kv_drop", "pages": [16]})
    assert calls == [("in", [3, 4]), ("drop", [5])] and broken == []


@pytest.mark.parametrize("pages, fail, needle", [
    ([0, 3], None, "page index 0 outside [1, 16)"),           # the null page
    ([3, 3], None, "duplicate page indices [3]"),
    ([3, True], None, "must be integers"),
    ("3", None, "expected a page list"),
    ([3, 4], ValueError("dst_pages: 1 of the room's 2 pages arrived in no pulled chunk"),
     "ValueError: dst_pages: 1 of"),
    ([3, 4], RuntimeError("INTERNAL: scatter failed"), "RuntimeError: INTERNAL"),
])
def test_a_jax_decode_follower_whose_scatter_fails_leaves_the_cluster(pages, fail, needle):
    """A follower that does not scatter a room node 0 scattered would decode with stale heads
    (wrong tokens, no error): any failure, refused pages or a JAX runtime error included, is
    fatal to the node (node 0 then marks it lost); it never escapes into the follow loop."""
    calls, broken = [], []

    def stage_in(p, room=None):
        calls.append(list(p))
        if fail is not None:
            raise fail

    kv = types.SimpleNamespace(mode="jax", num_pages=16, stage_in=stage_in)
    node = DecodeRankNode(2, types.SimpleNamespace(session_id="s2"), kv, FakeChannel())
    node.on_broken = broken.append
    node.handlers["kv_stage_in"]({"op": "kv_stage_in", "pages": pages})
    assert len(broken) == 1 and broken[0].startswith("PD decode node 2: kv_stage_in of pages ")
    assert needle in broken[0] and "stale" in broken[0], broken[0]
    assert calls == ([pages] if fail is not None else [])


def test_a_jax_decode_follower_scatters_only_the_room_node_0_names():
    calls, broken = [], []
    kv = types.SimpleNamespace(mode="jax", num_pages=16,
                               stage_in=lambda p, room=None: calls.append((p, room)))
    node = DecodeRankNode(1, types.SimpleNamespace(session_id="s1"), kv, FakeChannel())
    node.on_broken = broken.append
    node.handlers["kv_stage_in"]({"op": "kv_stage_in", "pages": [3, 4], "room": 41})
    assert calls == [([3, 4], 41)] and broken == []
    node.handlers["kv_stage_in"]({"op": "kv_stage_in", "pages": [3, 4], "room": "41"})
    assert calls == [([3, 4], 41)] and "field 'room': expected int" in broken[0]
