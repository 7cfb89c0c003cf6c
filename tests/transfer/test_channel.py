"""The PD control channel without processes (``pdjax/transfer/channel.py``): sealed frames
(HMAC, replay, time window) over real ZMQ sockets, each rejection counted by reason (also in
``PDMetrics``); a send to a peer that died fails instead of queueing forever."""

import time

from pdjax.pd.frame_auth import FrameSealer
from pdjax.pd.protocol import Heartbeat
from pdjax.transfer.channel import MessageChannel
from pdjax.transfer.pd_metrics import PDMetrics


def _wait(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


def test_channels_with_a_secret_count_each_rejection():
    import zmq

    got, rejected = [], []
    rx = MessageChannel("127.0.0.1", got.append, "rx", secret="k1",
                        on_reject=lambda reason, kind: rejected.append(kind))
    good = MessageChannel("127.0.0.1", lambda m: None, "good", secret="k1")
    wrong = MessageChannel("127.0.0.1", lambda m: None, "wrong", secret="k2")
    plain = MessageChannel("127.0.0.1", lambda m: None, "plain")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(rx.endpoint)
        hb = Heartbeat("good", "prefill", 7)
        assert good.send(rx.endpoint, hb)
        assert _wait(lambda: got == [hb])
        frame = good.seal(Heartbeat("good", "prefill", 8))
        raw.send(frame)
        assert _wait(lambda: len(got) == 2)
        raw.send(frame)                                         # replayed
        raw.send(frame[:-2] + b"\x00\x00")                      # tampered
        wrong.send(rx.endpoint, hb)                             # wrong secret
        plain.send(rx.endpoint, hb)                             # no secret
        stale = FrameSealer("k1", clock=lambda: time.time() - 3600).seal(hb.encode())
        raw.send(stale)
        assert _wait(lambda: len(rejected) == 5)
        assert sorted(rejected) == ["hmac", "hmac", "hmac", "replay", "stale"]
        assert rx.rejected_by_kind == {"hmac": 3, "replay": 1, "stale": 1}
        assert len(got) == 2
        # Without a secret on either side frames are plain msgpack, as before.
        plain_rx = MessageChannel("127.0.0.1", got.append, "plain-rx")
        try:
            assert plain.send(plain_rx.endpoint, hb) and _wait(lambda: len(got) == 3)
        finally:
            plain_rx.close()
    finally:
        raw.close()
        ctx.term()
        for c in (rx, good, wrong, plain):
            c.close()


def test_a_send_to_a_peer_that_died_fails_instead_of_queueing_forever():
    """A killed peer's endpoint: the send fails (False, within the send timeout) so the
    sender can drop the peer and bootstrap again; before, it was queued for a reconnect that
    never came (a bench_faults run lost two requests for 180 s after a prefill restart)."""
    from pdjax.transfer.channel import SEND_TIMEOUT_MS

    got = []
    rx = MessageChannel("127.0.0.1", got.append, "rx")
    tx = MessageChannel("127.0.0.1", lambda m: None, "tx")
    try:
        hb = Heartbeat("tx", "decode", 1)
        assert tx.send(rx.endpoint, hb) and _wait(lambda: got == [hb])
        endpoint = rx.endpoint
        rx.close()
        time.sleep(0.3)                    # the PUSH side sees the connection drop
        t0 = time.monotonic()
        assert not tx.send(endpoint, Heartbeat("tx", "decode", 2))
        assert time.monotonic() - t0 <= SEND_TIMEOUT_MS / 1000 + 1.0
        # A live peer still gets its messages at once.
        rx2 = MessageChannel("127.0.0.1", got.append, "rx2")
        try:
            assert tx.send(rx2.endpoint, hb) and _wait(lambda: len(got) == 2)
        finally:
            rx2.close()
    finally:
        tx.close()


def test_metrics_count_auth_rejections_by_reason():
    from pdjax.metrics import Metrics

    m = Metrics()
    pd = PDMetrics(m, "prefill")
    pd.on_auth_rejected("replay")
    pd.on_auth_rejected("replay")
    text = m.render()[0].decode()
    assert 'pdjax:pd_auth_rejected_total{reason="replay",role="prefill"} 2.0' in text


