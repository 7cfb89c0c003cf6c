"""The decode connector with its worker, over fake parts and a real bootstrap server: only the
engine thread (``poll``) changes rooms and peers; the worker's threads report events."""

import logging
import threading
import time

import numpy as np
import pytest

from pdjax.engine_io import GenerateRequest
from pdjax.pd.bootstrap import BootstrapServer, PrefillRankInfo
from pdjax.pd.lifecycle import KVPoll, PeerState
from pdjax.pd.protocol import Abort, AbortAck, TransferRequest, TransferStatus
from pdjax.request import Request, SamplingParams

from pd_fakes import decode_connector

PS = 4


@pytest.fixture
def prefill_bootstrap():
    """A prefill's bootstrap server (no prefill behind it: the decode only pairs with it)."""
    server = BootstrapServer("127.0.0.1", 0)
    port = server.start()
    yield server, port
    server.stop()


def _request(rid: str, room: int, port: int, n: int = 9, max_new: int = 4):
    ids = [int(t) for t in np.random.default_rng(room).integers(3, 400, n)]
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    g = GenerateRequest(rid, ids, sp, bootstrap_host="127.0.0.1", bootstrap_port=port,
                        bootstrap_room=room)
    return g, Request(rid, ids, sp)


def _poll_until(d, pred, timeout_s: float = 10.0) -> list:
    """Step decode ``d`` as the engine thread would until ``pred()``; returns the outputs."""
    outputs, deadline = [], time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        outputs += d.step()
        time.sleep(0.01)
    return outputs


def _paired(prefill_bootstrap, **args):
    server, port = prefill_bootstrap
    d = decode_connector(page_size=PS, **args)
    server.add_rank(PrefillRankInfo(rank_ip="127.0.0.1", rank_port=5555, tp_rank=0, tp_size=1,
                                    page_size=PS, kv_dtype=d.conn.local_kv.kv_dtype,
                                    layout_fingerprint=d.conn.local_kv.fingerprint))
    return d, d.conn, d.channel, port


def _transfer_requests(channel) -> list[TransferRequest]:
    return [m for _, m in channel.sent if isinstance(m, TransferRequest)]


def test_a_heartbeat_failure_reaches_the_rooms_on_the_engine_thread_only(prefill_bootstrap):
    """The heartbeat thread loses the prefill: the peer it saw as ready stays ready until the
    engine thread polls (no thread but the engine's changes a peer: it was a data race); then
    the room in flight and a room still pairing both end with the reason, and every page comes
    back (the in-flight room's after its drain timeout, as the prefill may still write)."""
    d, conn, channel, port = _paired(prefill_bootstrap, heartbeat_interval_s=0.1,
                                  drain_timeout_s=0.3)
    woke = threading.Event()
    conn.set_wake(woke.set)
    free0 = d.scheduler.allocator.num_free
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        _poll_until(d, lambda: conn.rooms["a"].state == KVPoll.Transferring)
        (tr,) = _transfer_requests(channel)
        assert tr.bootstrap_room == 7 and len(tr.dst_pages) == 3           # 9 tokens, 4 a page
        assert d.scheduler.allocator.num_free == free0 - 3
        peer = conn.peers[("127.0.0.1", port)]
        assert peer.state == PeerState.READY
        g2, req2 = _request("b", 8, port)
        d.add(g2, req2)                   # same peer, not paired again
        assert conn.rooms["b"].state == KVPoll.Bootstrapping

        woke.clear()                                 # nothing else wakes the engine now
        prefill_bootstrap[0].stop()                  # the prefill is gone
        assert woke.wait(5.0)                        # the worker's PeerFailed woke the engine
        assert peer.state == PeerState.READY         # nothing but the engine thread changed it
        assert conn.rooms["a"].state == KVPoll.Transferring

        outs = {o.rid: o for o in d.step()}
        assert peer.state == PeerState.FAILED
        assert set(outs) == {"a", "b"} and not conn.rooms
        for o in outs.values():
            assert o.finished and "lost connection with prefill" in o.error
            assert "2 failed heartbeats" in o.error
        assert conn.num_quarantined_pages == 3       # a's pages: a late write may land there
        _poll_until(d, lambda: conn.num_quarantined_pages == 0)
        assert d.scheduler.allocator.num_free == free0
        assert conn.slots_in_use() == 0 and not d.scheduler.waiting_remote
        d.scheduler.check_invariants()
        assert conn.num_quarantine_released_by_timeout == 1
        assert ("127.0.0.1", port) not in conn.peers   # the next request pairs again
        assert channel.dropped == ["tcp://127.0.0.1:5555"]
    finally:
        conn.close()


def test_a_status_is_applied_by_the_engine_thread_and_commits_the_request(prefill_bootstrap):
    """The prefill's Success arrives on the receiver thread: the room does not change until
    the engine polls; then the request joins the running batch with its first token."""
    d, conn, channel, port = _paired(prefill_bootstrap)
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        _poll_until(d, lambda: conn.rooms["a"].state == KVPoll.Transferring)
        conn.worker.on_message(TransferStatus(bootstrap_room=7, state=KVPoll.Success))
        assert conn.rooms["a"].status is None
        (out,) = d.step()
        assert out.rid == "a" and out.new_token_ids == [0] and out.error is None
        assert [r.rid for r in d.scheduler.running] == ["a"]
        assert req.num_computed_tokens == 9 and not conn.rooms
        assert conn.num_rejected_messages == 0
    finally:
        conn.close()


def test_a_status_crossing_a_room_failed_here_is_not_a_rejected_message(prefill_bootstrap,
                                                                        caplog):
    """A client abort fails the room on the decode while the prefill's Success is on its way:
    that status is expected (logged at INFO, not counted as a refused message); a status for a
    room this decode never failed still is one. An Abort from the prefill is acked."""
    d, conn, channel, port = _paired(prefill_bootstrap)
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        _poll_until(d, lambda: conn.rooms["a"].state == KVPoll.Transferring)
        d.abort("a", "client went away")
        with caplog.at_level(logging.INFO, logger="pdjax.transfer.decode"):
            caplog.clear()                   # (the abort's own warning)
            conn.worker.on_message(TransferStatus(bootstrap_room=7, state=KVPoll.Success))
            d.step()
            assert conn.num_rejected_messages == 0
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                        and r.name == "pdjax.transfer.decode"]
            assert "which ended here already (Failed)" in caplog.text
            for room in (8, 9):          # never seen here: not an expected crossing
                conn.worker.on_message(TransferStatus(bootstrap_room=room, state=KVPoll.Success))
            d.step()
        assert conn.num_rejected_messages == 2

        g2, req2 = _request("b", 10, port)
        d.add(g2, req2)
        _poll_until(d, lambda: conn.rooms["b"].state == KVPoll.Transferring)
        peer = conn.peers[("127.0.0.1", port)]
        conn.worker.on_message(Abort(bootstrap_room=10, sender_id="prefill@x", reason="bye"))
        (out,) = d.step()
        assert out.rid == "b" and "aborted by the prefill server: bye" in out.error
        acks = [(e, m) for e, m in channel.sent if isinstance(m, AbortAck)]
        assert acks == [("tcp://127.0.0.1:5555", AbortAck(bootstrap_room=10,
                                                          sender_id=peer.engine_id))]
    finally:
        conn.close()


def test_a_refused_registration_fails_the_pairing_with_the_prefill_reason(prefill_bootstrap):
    from pd_fakes import FakeChannel

    d, conn, channel, port = _paired(prefill_bootstrap, channel=FakeChannel(accept=False))
    free0 = d.scheduler.allocator.num_free
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        outs = _poll_until(d, lambda: "a" not in conn.rooms)
        (out,) = outs
        assert "cannot pair with prefill" in out.error
        assert d.scheduler.allocator.num_free == free0 and not _transfer_requests(channel)
        assert ("127.0.0.1", port) not in conn.peers
    finally:
        conn.close()


def test_an_abort_for_a_room_that_succeeded_here_is_a_crossing_and_is_acked(prefill_bootstrap,
                                                                            caplog):
    """The client closes a stream whose KV already arrived: the router aborts both sides, and
    the prefill's Abort reaches a decode that finished the room (Success). That is the same
    crossing as after a failure (it was logged as an ERROR and counted as a refused message),
    and the prefill, which waits for the ack, gets it."""
    d, conn, channel, port = _paired(prefill_bootstrap)
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        _poll_until(d, lambda: conn.rooms["a"].state == KVPoll.Transferring)
        conn.worker.on_message(TransferStatus(bootstrap_room=7, state=KVPoll.Success))
        _poll_until(d, lambda: "a" not in conn.rooms)
        d.abort("a", "client went away")
        peer = conn.peers[("127.0.0.1", port)]
        with caplog.at_level(logging.INFO, logger="pdjax.transfer.decode"):
            conn.worker.on_message(Abort(bootstrap_room=7, sender_id="prefill@x", reason="bye"))
            d.step()
        assert conn.num_rejected_messages == 0
        assert "which ended here already (Success)" in caplog.text
        acks = [m for _, m in channel.sent if isinstance(m, AbortAck)]
        assert acks == [AbortAck(bootstrap_room=7, sender_id=peer.engine_id)]
        d.scheduler.check_invariants()
    finally:
        conn.close()


def test_a_page_list_nobody_receives_fails_the_room_and_the_peer(prefill_bootstrap):
    """The prefill was killed and restarted on the same bootstrap port (its heartbeats still
    answer) but a new control port: the page list cannot be sent to the old one. The room
    fails at once naming it, every page comes back, and the peer is dropped so the next
    request bootstraps again (before, the send was queued for ever and both sides waited out
    their timeouts: a bench_faults run lost two requests)."""
    d, conn, channel, port = _paired(prefill_bootstrap)
    free0 = d.scheduler.allocator.num_free
    real_send = channel.send
    channel.send = lambda endpoint, msg: (False if isinstance(msg, TransferRequest)
                                          else real_send(endpoint, msg))
    try:
        g, req = _request("a", 7, port)
        d.add(g, req)
        outs = _poll_until(d, lambda: "a" not in conn.rooms)
        (out,) = [o for o in outs if o.rid == "a"]
        assert out.finished and "could not send the page list to tcp://127.0.0.1:5555" in out.error
        assert d.scheduler.allocator.num_free == free0 and conn.slots_in_use() == 0
        _poll_until(d, lambda: ("127.0.0.1", port) not in conn.peers)
        assert channel.dropped == ["tcp://127.0.0.1:5555"]
        channel.send = real_send                  # the prefill is back: a new pairing works
        g2, req2 = _request("b", 8, port)
        d.add(g2, req2)
        _poll_until(d, lambda: conn.rooms["b"].state == KVPoll.Transferring)
        assert [tr.bootstrap_room for tr in _transfer_requests(channel)] == [8]
        d.scheduler.check_invariants()
    finally:
        conn.close()
