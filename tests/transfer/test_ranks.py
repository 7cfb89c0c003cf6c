"""A multi-host prefill's data plane without processes (``transfer/prefill_ranks.py``, DESIGN.md §6):
the plan over every node's shards, each node's part of the copies (the parts partition the
one-process plan), the messages' range checks, node 0's wait for every node's report, and a
chunk whose other node fails: the room fails, the metadata row is never written."""

from __future__ import annotations

import collections
import threading
import time
import types

import numpy as np
import pytest
from pd_fakes import FakeChannel, prefill_worker
from rank_fakes import FakeCluster, RecordingEngine

from pdjax.pd.bootstrap import PrefillRankInfo
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.lifecycle import WriteFailed
from pdjax.pd.lifecycle import KVPoll
from pdjax.pd.protocol import ProtocolError, RankWriteDone, TransferStatus, decode_message
from pdjax.pd.rooms import PrefillRoom
from pdjax.transfer.engine import TransferError, create_transfer_engine
from pdjax.transfer.kv_copies import KVLayout, build_copies, node_shards, write_nodes
from pdjax.transfer.prefill_worker import ChunkWritten, RoomFailed
from pdjax.transfer.prefill_ranks import PrefillRanks, RankSender, RankWrites
from pdjax.transfer.ranks import RankedLayout, RankError, rank_layouts

PS, LAYERS, HEAD_BYTES, PAGES = 4, 2, 16, 16


def _buf(addr, heads, num_heads=2):
    count = heads[0][1]
    return KVBufferDesc(shard_addrs=tuple(addr), num_layers=LAYERS, num_pages=PAGES,
                        bytes_per_page=PS * count * HEAD_BYTES, num_heads=num_heads,
                        shard_heads=tuple(heads), head_bytes=HEAD_BYTES)


def _node(rank):
    """Node ``rank`` of a TP 2 prefill over 2 nodes: head ``rank`` of K and V."""
    base = 0x100000 * (rank + 1)
    return KVLayout("layer_major", (_buf([base], [(rank, 1)]), _buf([base + 0x10000],
                                                                      [(rank, 1)])))


DECODE = KVLayout("layer_major", (_buf([0x900000], [(0, 2)]), _buf([0x990000], [(0, 2)])))


def test_plan_over_the_nodes_partitions_the_one_process_copies():
    ranked = RankedLayout.from_ranks({1: _node(1), 0: _node(0)})
    assert ranked.owners == ((0, 1), (0, 1)) and ranked.local == ((0, 0), (0, 0))
    assert [b.shard_heads for b in ranked.layout.buffers] == [((0, 1), (1, 1))] * 2
    src, dst = [3, 4, 9], [7, 8, 2]
    whole = build_copies(ranked.layout, DECODE, src, dst)
    parts = [build_copies(ranked.with_local(r, _node(r)), DECODE, src, dst,
                          src_shards=ranked.shards_of(r)) for r in (0, 1)]
    assert collections.Counter(whole) == collections.Counter(parts[0] + parts[1])
    # Each node reads only its own memory; together pages x the decode's bytes per page.
    for r, part in enumerate(parts):
        lo = 0x100000 * (r + 1)
        assert part and all(lo <= s < lo + 0x20000 for s, _, _ in part)
        assert len(part) == 2 * len(src) * LAYERS * PS          # K, V: a copy per token slot
    assert sum(n for *_, n in whole) == len(src) * LAYERS * sum(
        b.bytes_per_page for b in DECODE.buffers)
    # A node's cache moved: its copies read the new address, the others' do not change.
    moved = KVLayout("layer_major", tuple(
        KVBufferDesc(**dict(vars(b), shard_addrs=(b.shard_addrs[0] + 0x40000,)))
        for b in _node(1).buffers))
    again = build_copies(ranked.with_local(1, moved), DECODE, src, dst,
                         src_shards=ranked.shards_of(1))
    assert [s - 0x40000 for s, _, _ in again] == [s for s, _, _ in parts[1]]


def test_nodes_that_do_not_fit_one_plan_are_refused_naming_the_field():
    other = KVLayout("layer_major", (_buf([1 << 30], [(1, 1)]),) * 2)
    other = KVLayout("layer_major", tuple(KVBufferDesc(**dict(vars(b), num_pages=PAGES * 2))
                                          for b in other.buffers))
    with pytest.raises(ValueError, match=r"kv_buffers\[0\].num_pages: node 1 has 32, node 0"):
        RankedLayout.from_ranks({0: _node(0), 1: other})
    with pytest.raises(ValueError, match="kv_layout: node 1"):
        RankedLayout.from_ranks({0: _node(0), 1: KVLayout("layer_major", _node(1).buffers[:1])})
    ranked = RankedLayout.from_ranks({0: _node(0), 1: _node(1)})
    with pytest.raises(ValueError, match="node 1's shard 0 does not hold heads"):
        ranked.with_local(1, _node(0))
    infos = [PrefillRankInfo(rank_ip="127.0.0.1", rank_port=9000, tp_rank=0, tp_size=2,
                             page_size=PS, kv_dtype="float32", layout_fingerprint="f",
                             session_id="127.0.0.1:1", kv_layout="layer_major",
                             kv_buffers=_node(0).buffers)]
    with pytest.raises(ValueError, match=r"prefill node\(s\) \[1\] have not registered"):
        rank_layouts(infos, 2)


def test_rank_registration_and_plan_round_trip_with_range_checks():
    info = PrefillRankInfo(rank_ip="127.0.0.1", rank_port=9000, tp_rank=1, tp_size=2,
                           page_size=PS, kv_dtype="float32", layout_fingerprint="f",
                           session_id="127.0.0.1:1", kv_layout="layer_major",
                           kv_buffers=_node(1).buffers)
    assert PrefillRankInfo.from_json(info.to_json()) == info
    for bad, field in ((dict(kv_layout="sideways"), "kv_layout"),
                       (dict(kv_buffers=[dict(_node(1).buffers[0].to_wire(), shard_addrs=[0])]),
                        "shard_addrs"),
                       (dict(session_id=7), "session_id")):
        with pytest.raises(ValueError, match=field):
            PrefillRankInfo.from_json(dict(info.to_json(), **bad))
    ranked = RankedLayout.from_ranks({0: _node(0), 1: _node(1)})
    assert RankedLayout.from_wire(ranked.to_wire(), 2) == ranked
    for edit, needle in (
            (lambda w: w["owners"][0].__setitem__(1, 2), r"src.owners\[0\]: expected 2 integers"),
            (lambda w: w["local"].pop(), "src.local: expected one list per buffer"),
            (lambda w: w["buffers"][0].__setitem__("num_pages", 1), "num_pages"),
            (lambda w: w.pop("kind"), "src: expected")):
        wire = ranked.to_wire()
        edit(wire)
        with pytest.raises(RankError, match=needle):
            RankedLayout.from_wire(wire, 2)


def test_rank_write_done_round_trip_and_range_checks():
    msg = RankWriteDone(job=3, node_rank=1, ok=True, bytes=4096, copies=64,
                        node_bytes=(1024, 3072))
    assert decode_message(msg.encode()) == msg and msg.node_bytes == (1024, 3072)
    assert decode_message(RankWriteDone(job=3, node_rank=1, ok=False, reason="x").encode()
                          ).node_bytes == ()
    for bad, field in ((dict(job=0), "job"), (dict(node_rank=0), "node_rank"),
                       (dict(ok=1), "ok"), (dict(bytes=-1), "bytes"),
                       (dict(node_bytes=()), r"'node_bytes': expected 1\.\.1024"),
                       (dict(node_bytes=(1, 2)), r"'node_bytes': sums to 3, not bytes \(0\)"),
                       (dict(node_bytes=(-1,)), r"'node_bytes\[0\]'"),
                       (dict(node_bytes=(0,) * 1025), "node_bytes"),
                       (dict(node_bytes="7"), "node_bytes")):
        with pytest.raises(ProtocolError, match=field):
            RankWriteDone(**{**dict(job=3, node_rank=1, ok=True, node_bytes=(0,)), **bad})


def test_node_zero_waits_for_every_node_and_names_the_missing_or_failed_one():
    writes = RankWrites([1, 2])
    ok = dict(ok=True, node_bytes=(0,))
    a, b = writes.new_job(), writes.new_job()
    assert writes.report(RankWriteDone(job=a, node_rank=1, ok=True, bytes=10, copies=2,
                                       node_bytes=(10,)))
    assert not writes.report(RankWriteDone(job=a, node_rank=1, **ok))      # twice
    assert not writes.report(RankWriteDone(job=a, node_rank=3, **ok))      # no such node
    assert not writes.report(RankWriteDone(job=99, node_rank=2, **ok))     # no such job
    threading.Timer(0.05, writes.report, (RankWriteDone(job=a, node_rank=2, ok=True, bytes=5,
                                                        copies=1, node_bytes=(5,)),)).start()
    assert writes.wait(a, 5.0) == ([15], 3, [])
    assert writes.report(RankWriteDone(job=b, node_rank=2, ok=False, reason="rc=-1"))
    assert writes.wait(b, 0.05) == ([0], 0, ["node 2: rc=-1",
                                           "node 1: no report of its KV writes (within 0.05 s)"])
    c = writes.new_job()          # a node went away: no wait for the timeout
    t0 = time.monotonic()
    assert writes.wait(c, 60.0, lost=lambda: "node 2 went away")[2] == [
        "node 1: no report of its KV writes (node 2 went away)",
        "node 2: no report of its KV writes (node 2 went away)"]
    assert time.monotonic() - t0 < 1.0
    # A two-node decode: bytes per decode node summed over the prefill nodes; a report naming
    # another number of decode nodes is a failure, its bytes not counted.
    d = writes.new_job()
    writes.report(RankWriteDone(job=d, node_rank=1, ok=True, bytes=7, copies=3,
                                node_bytes=(3, 4)))
    writes.report(RankWriteDone(job=d, node_rank=2, ok=True, bytes=6, copies=2,
                                node_bytes=(6,)))
    assert writes.wait(d, 1.0, dst_nodes=2) == (
        [3, 4], 3, ["node 2: node_bytes names 1 decode nodes, not 2"])
    assert writes.pending() == 0
    assert not writes.report(RankWriteDone(job=b, node_rank=1, **ok))      # too late


def _worker(fail_node: bool):
    """A prefill worker over node 0's half on the fake engine, node 1 answering the job as
    ``fail_node`` says, one registered decode ``d1``."""
    engine = create_transfer_engine("fake")
    local_kv = types.SimpleNamespace(layout=_node(0))
    bootstrap = types.SimpleNamespace(registered_ranks=lambda: [
        PrefillRankInfo(rank_ip="h", rank_port=1, tp_rank=r, tp_size=2, page_size=PS,
                        kv_dtype="float32", layout_fingerprint="f", session_id=f"s{r}",
                        kv_layout="layer_major", kv_buffers=_node(r).buffers) for r in (0, 1)])
    cluster = FakeCluster()
    ranks = PrefillRanks(cluster, bootstrap, local_kv, "tcp://127.0.0.1:1")
    peer = types.SimpleNamespace(session_id="decode:1", layout=DECODE, reply_endpoint="tcp://d:1",
                                 metadata_addr=0x5000, metadata_num_slots=4,
                                 metadata_bytes_per_slot=64, node_sessions=(), shard_nodes=())
    ranks.paired("d1", peer, ranks.plan())
    channel = FakeChannel()
    worker = prefill_worker(channel=channel, local_kv=local_kv, transfer_engine=engine,
                            ranks=ranks, meta=types.SimpleNamespace(
                                copy_to=lambda *a: (0x7000, 0x5000, 64)))
    worker._peers["d1"] = peer
    job = ranks.send_write("d1", [3, 4], [7, 8])
    ranks.on_done(RankWriteDone(job=job, node_rank=1, ok=not fail_node, bytes=4 * 512,
                                copies=32, reason="KV write to decode:1 failed: rc=-1",
                                node_bytes=() if fail_node else (4 * 512,)))
    return worker, channel, job, engine, cluster


@pytest.mark.parametrize("fail_node", [False, True])
def test_a_chunk_succeeds_only_when_every_node_wrote(fail_node):
    worker, channel, job, engine, cluster = _worker(fail_node)
    try:
        assert [op for op, _ in cluster.sent] == ["kv_peer", "kv_write"]
        assert cluster.sent[1][1] == dict(job=job, peer=1, src=[3, 4], dst=[7, 8], room=0)
        r = PrefillRoom(room=11, created_s=0.0, peer_id="d1", dst_slot=0, src_slot=0)
        worker._write_chunk(r, 11, "d1", 0, 0, [3, 4], [7, 8], True, job)
        told = [m for _, m in channel.sent]
        (event,) = worker.events()
        assert event.room is r
        own = 2 * 2 * LAYERS * PS      # node 0: K and V of head 0, a copy per page, layer, token
        if fail_node:
            assert isinstance(event, RoomFailed) and isinstance(event.failure, WriteFailed)
            assert "node 1: KV write" in str(event.failure)
            assert engine.counters().copies == own      # the metadata row was never written
            assert told == [TransferStatus(bootstrap_room=11, state=KVPoll.Failed,
                                           reason=told[0].reason)]
            assert "node 1: KV write to decode:1 failed" in told[0].reason
            assert worker.state()["num_cancelled_rooms"] == 1   # no later chunk is written
        else:
            assert isinstance(event, ChunkWritten) and event.last
            assert (event.copies, event.nbytes) == (own + 32,
                                                    2 * 2 * LAYERS * PS * HEAD_BYTES + 4 * 512)
            assert engine.counters().copies == own + 1  # then the metadata row
            assert told == [TransferStatus(bootstrap_room=11, state=KVPoll.Success)]
        assert worker.ranks.writes.pending() == 0
    finally:
        worker.close()


class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, endpoint, msg):
        self.sent.append((endpoint, msg))


def _sender():
    """Node 1 of a 2-node prefill, not started (its write queue is read by the test)."""
    return RankSender(types.SimpleNamespace(nnodes=2, node_rank=1),
                      types.SimpleNamespace(caches=[]), None,
                      types.SimpleNamespace(layout=_node(1), num_pages=PAGES,
                                            check_addresses=lambda: False),
                      _Channel())


def test_a_follower_refuses_bad_commands_and_says_why():
    s = _sender()
    ranked = RankedLayout.from_ranks({0: _node(0), 1: _node(1)})
    dst = {"kind": "layer_major", "buffers": [b.to_wire() for b in DECODE.buffers]}
    s.on_write({"job": 1, "peer": 1, "src": [3], "dst": [7]})     # no kv_peer: nowhere to say
    assert s.channel.sent == [] and s._jobs.empty()
    s.on_peer({"peer": 1, "session": "decode:1", "reply": "tcp://n0:1", "src": ranked.to_wire(),
               "dst": dst})
    bad = ranked.to_wire()
    bad["owners"][0][1] = 5
    s.on_peer({"peer": 2, "session": "decode:1", "reply": "tcp://n0:1", "src": bad, "dst": dst})
    for msg, needle in (({"job": 2, "peer": 2, "src": [3], "dst": [7]}, "src.owners[0]"),
                        ({"job": 3, "peer": 9, "src": [3], "dst": [7]}, "never announced"),
                        ({"job": 4, "peer": 1, "src": [PAGES], "dst": [7]}, "src_pages"),
                        ({"job": 5, "peer": 1, "src": [3], "dst": [3, 4]}, "dst_pages"),
                        ({"job": 6, "peer": 1, "src": "3", "dst": [7]}, "page lists")):
        s.on_write(msg)
        endpoint, done = s.channel.sent[-1]
        assert endpoint == "tcp://n0:1" and done.job == msg["job"] and not done.ok
        assert needle in done.reason, done.reason
    s.on_write({"job": 0, "peer": 1, "src": [3], "dst": [7]})     # no valid job: logged only
    assert len(s.channel.sent) == 5 and s._jobs.empty()
    s.on_write({"job": 7, "peer": 1, "src": [3, 4], "dst": [7, 8]})
    job, generation, peer, [(session, copies)] = s._jobs.get_nowait()
    assert job == 7 and session == peer.session == "decode:1"
    assert len(copies) == 2 * 2 * LAYERS * PS
    assert all(0x200000 <= src < 0x220000 for src, _, _ in copies)
    assert np.unique([d for _, d, _ in copies]).size == len(copies)


class _JaxKV:
    """A follower's ``JaxLocalKV`` as ``on_write`` sees it: 8 pages, ``stage_out`` recorded."""
    mode = "jax"

    def __init__(self):
        self.layout, self.num_pages, self.staged = _node(1), 8, []

    def stage_out(self, pages):
        self.staged.append(list(pages))


def test_a_jax_follower_range_checks_both_page_lists_before_it_gathers():
    kv = _JaxKV()
    s = RankSender(types.SimpleNamespace(nnodes=2, node_rank=1),
                   types.SimpleNamespace(caches=[]), None, kv, _Channel())
    ranked = RankedLayout.from_ranks({0: _node(0), 1: _node(1)})
    dst = {"kind": "layer_major", "buffers": [b.to_wire() for b in DECODE.buffers]}
    s.on_peer({"peer": 1, "session": "decode:1", "reply": "tcp://n0:1", "src": ranked.to_wire(),
               "dst": dst})
    cases = (([0], [7], "src_pages"), ([-1], [7], "src_pages"), ([8], [7], "src_pages"),
             (["x"], [7], "src_pages"), ([None], [7], "src_pages"), ([3, 3], [7, 8], "src_pages"),
             ([3], [0], "dst_pages"), ([3], [PAGES], "dst_pages"), ([3], [-2], "dst_pages"),
             ([3], ["7"], "dst_pages"), ([3], [True], "dst_pages"), ([3, 4], [7], "!= 1"))
    for job, (src, dst_pages, needle) in enumerate(cases, start=1):
        s.on_write({"job": job, "peer": 1, "src": src, "dst": dst_pages})
        endpoint, done = s.channel.sent[-1]
        assert endpoint == "tcp://n0:1" and done.job == job and not done.ok
        assert needle in done.reason, (src, dst_pages, done.reason)
    assert len(s.channel.sent) == len(cases) and kv.staged == [] and s._jobs.empty()
    s.on_write({"job": 99, "peer": 1, "src": [7, 1], "dst": [PAGES - 1, 1], "room": 41})
    assert kv.staged == [[7, 1]] and len(s.channel.sent) == len(cases)     # both in range
    job, _, peer, (src, dst_pages, meta, room) = s._jobs.get_nowait()
    assert (job, peer.session, src, dst_pages, meta, room) == (
        99, "decode:1", [7, 1], [PAGES - 1, 1], [], 41)
    s.on_write({"job": 100, "peer": 1, "src": [7], "dst": [1], "room": "41"})
    assert "field 'room': expected int" in s.channel.sent[-1][1].reason
    assert kv.staged == [[7, 1]] and s._jobs.empty()


# ----------------------------------------------- a multi-host prefill -> a multi-host decode
def _decode_node(rank):
    """Node ``rank`` of a decode over 2 nodes of a 4-head model, heads interleaved (node 0:
    heads 0 and 2, node 1: heads 1 and 3, one shard each), so that every prefill node (heads
    0-1, 2-3) writes into both decode nodes."""
    base = 0x900000 + 0x100000 * rank
    return KVLayout("layer_major", tuple(
        _buf([base + k * 0x40000, base + k * 0x40000 + 0x20000], [(rank, 1), (rank + 2, 1)], 4)
        for k in (0, 1)))


def _prefill_node4(rank):
    """Node ``rank`` of a TP 2 prefill of the 4-head model: heads ``2 rank``, ``2 rank + 1``."""
    base = 0x100000 * (rank + 1)
    return KVLayout("layer_major", (_buf([base], [(2 * rank, 2)], 4),
                                    _buf([base + 0x10000], [(2 * rank, 2)], 4)))


def test_two_node_prefill_to_two_node_decode_partitions_by_src_and_dst_node():
    src = RankedLayout.from_ranks({0: _prefill_node4(0), 1: _prefill_node4(1)})
    dst = RankedLayout.from_ranks({0: _decode_node(0), 1: _decode_node(1)})
    assert dst.owners == ((0, 1, 0, 1),) * 2       # by first head: 0, 1, 2, 3
    writes = node_shards("d0", ("d0", "d1"), dst.owners)
    assert [s for s, _ in writes] == ["d1", "d0"]    # decode node 0 (the metadata row's) last
    pages_src, pages_dst = [3, 4, 9], [7, 8, 2]
    whole = build_copies(src.layout, dst.layout, pages_src, pages_dst)
    parts, totals = {}, [0, 0]
    for r in (0, 1):
        engine = RecordingEngine()
        node_bytes, n = write_nodes(engine, src.with_local(r, _prefill_node4(r)), dst.layout,
                                    writes, pages_src, pages_dst, src_shards=src.shards_of(r))
        assert [s for s, _ in engine.writes] == ["d1", "d0"]
        for session, copies in engine.writes:
            parts[(r, session)] = copies
            node = int(session[1])
            lo, hi = 0x100000 * (r + 1), 0x100000 * (r + 1) + 0x20000
            assert copies and all(lo <= a < hi for a, _, _ in copies)       # its own memory
            dlo = 0x900000 + 0x100000 * node
            assert all(dlo <= d < dlo + 0x100000 for _, d, _ in copies)    # that node's
            assert node_bytes[node] == sum(n for *_, n in copies)
        assert n == sum(len(c) for _, c in engine.writes)
        totals = [a + b for a, b in zip(totals, node_bytes)]
    # Every copy of the one-process plan exactly once over the 4 (prefill node, decode node)
    # pairs; each decode node gets pages x its bytes per page (half the heads).
    assert len(parts) == 4
    assert collections.Counter(whole) == collections.Counter(sum(parts.values(), []))
    assert sum(len(c) for c in parts.values()) == len(whole)
    per_node = len(pages_src) * LAYERS * sum(b.bytes_per_page * 2 for b in _decode_node(0).buffers)
    assert totals == [per_node, per_node] and sum(totals) == sum(n for *_, n in whole)


def test_a_follower_writes_each_decode_node_into_its_session_and_reports_per_node():
    s = _sender()
    s.local_kv = types.SimpleNamespace(layout=_prefill_node4(1), num_pages=PAGES,
                                       check_addresses=lambda: False)
    s.engine = RecordingEngine()
    src = RankedLayout.from_ranks({0: _prefill_node4(0), 1: _prefill_node4(1)})
    dst = RankedLayout.from_ranks({0: _decode_node(0), 1: _decode_node(1)})
    peer = {"peer": 1, "session": "d0", "reply": "tcp://n0:1", "src": src.to_wire(),
            "dst": {"kind": "layer_major", "buffers": [b.to_wire() for b in dst.layout.buffers]},
            "node_sessions": ["d0", "d1"], "shard_nodes": [list(o) for o in dst.owners]}
    # Range checks of the mirrored decode nodes: a later kv_write says why it was refused.
    for k, (edit, needle) in enumerate((
            (dict(node_sessions=["d0"]), "node_sessions: expected 2..1024"),
            (dict(node_sessions=["d9", "d1"]), "node_sessions[0]: not session"),
            (dict(node_sessions=["d0", 7]), "node_sessions: expected"),
            (dict(shard_nodes=[[0, 1, 0, 2]] * 2), "shard_nodes[0]: expected 4 integers in [0, 2)"),
            (dict(shard_nodes=[[0, 1, 0, True]] * 2), "shard_nodes[0]"),
            (dict(shard_nodes=[[0, 1, 0, 1]]), "shard_nodes: expected one list per buffer"),
            (dict(shard_nodes=[]), "shard_nodes: expected one list per buffer")), start=2):
        s.on_peer(dict(peer, peer=k, **edit))
        s.on_write({"job": k, "peer": k, "src": [3], "dst": [7]})
        assert not s.channel.sent[-1][1].ok and needle in s.channel.sent[-1][1].reason, \
            s.channel.sent[-1][1].reason
    s.on_peer(peer)
    s.on_write({"job": 1, "peer": 1, "src": [3, 4, 9], "dst": [7, 8, 2]})
    s._jobs.put(None)
    s._work()
    endpoint, done = s.channel.sent[-1]
    assert endpoint == "tcp://n0:1" and done.ok and done.job == 1
    assert [session for session, _ in s.engine.writes] == ["d1", "d0"]
    want = write_nodes(RecordingEngine(), src.with_local(1, _prefill_node4(1)), dst.layout,
                       node_shards("d0", ("d0", "d1"), dst.owners), [3, 4, 9], [7, 8, 2],
                       src_shards=src.shards_of(1))
    assert (list(done.node_bytes), done.copies) == want and done.bytes == sum(want[0])
    assert want[0][0] == want[0][1] > 0


def test_node_zero_writes_both_decode_nodes_then_the_row_into_node_zero():
    cluster = FakeCluster()
    bootstrap = types.SimpleNamespace(registered_ranks=lambda: [
        PrefillRankInfo(rank_ip="h", rank_port=1, tp_rank=r, tp_size=2, page_size=PS,
                        kv_dtype="float32", layout_fingerprint="f", session_id=f"s{r}",
                        kv_layout="layer_major", kv_buffers=_prefill_node4(r).buffers)
        for r in (0, 1)])
    local_kv = types.SimpleNamespace(layout=_prefill_node4(0), kv_dtype="float32",
                                     fingerprint="f")
    ranks = PrefillRanks(cluster, bootstrap, local_kv, "tcp://127.0.0.1:1")
    dst = RankedLayout.from_ranks({0: _decode_node(0), 1: _decode_node(1)})
    peer = types.SimpleNamespace(session_id="d0", layout=dst.layout, node_sessions=("d0", "d1"),
                                 shard_nodes=dst.owners)
    ranks.paired("x", peer, ranks.plan())
    job = ranks.send_write("x", [3, 4], [7, 8])
    kv_peer = cluster.sent[0][1]
    assert kv_peer["node_sessions"] == ["d0", "d1"]
    assert kv_peer["shard_nodes"] == [[0, 1, 0, 1]] * 2
    other = (100, 60)           # node 1's report: its bytes into decode node 0 and 1
    ranks.on_done(RankWriteDone(job=job, node_rank=1, ok=True, bytes=160, copies=5,
                                node_bytes=other))
    engine = RecordingEngine()
    meta = [(0x7000, 0x5000, 64)]
    node_bytes, n = ranks.write(engine, "x", [3, 4], [7, 8], meta, job, 5.0)
    own = sum(len(c) for _, c in engine.writes[:-1])
    assert [s for s, _ in engine.writes] == ["d1", "d0", "d0"]
    assert engine.writes[-1][1] == meta                 # the row alone, last, into node 0
    half = 2 * LAYERS * sum(b.bytes_per_page for b in _decode_node(0).buffers)
    assert node_bytes == [half + 100, half + 60] and n == own + 5
    # A node reporting another number of decode nodes fails the chunk: no metadata row.
    job = ranks.send_write("x", [3, 4], [7, 8])
    ranks.on_done(RankWriteDone(job=job, node_rank=1, ok=True, bytes=160, copies=5,
                                node_bytes=(160,)))
    engine = RecordingEngine()
    with pytest.raises(TransferError, match="node 1: node_bytes names 1 decode nodes, not 2"):
        ranks.write(engine, "x", [3, 4], [7, 8], meta, job, 5.0)
    assert meta[0] not in sum((c for _, c in engine.writes), [])
