"""The test process as a prefill server over the real PD protocol, for the fault tests
(test_pd_faults.py, test_pd_hardening.py)."""

from pd_harness import PAGE_SIZE, wait_until

from pdjax.pd.bootstrap import BootstrapServer, PrefillRankInfo
from pdjax.pd.protocol import Abort, AbortAck, RegisterDecode, RegisterResult
from pdjax.transfer.channel import MessageChannel


class RoguePrefill:
    """A bootstrap server and a control channel that accept every registration and record
    every message in ``got``; it writes no KV. ``secret``: the PD secret both sides use.
    ``ack_aborts``: answer a decode's Abort with an AbortAck (settable between tests)."""

    def __init__(self, fingerprint: str, secret: str | None = None, ack_aborts: bool = False):
        self.got: list = []
        self.ack_aborts = ack_aborts
        self.decode_endpoint = None
        self.channel = MessageChannel("127.0.0.1", self._on_message, "rogue-prefill",
                                      secret=secret)
        self.bootstrap = BootstrapServer("127.0.0.1", 0, secret=secret)
        self.port = self.bootstrap.start()
        self.bootstrap.add_rank(PrefillRankInfo(
            rank_ip="127.0.0.1", rank_port=self.channel.port, tp_rank=0, tp_size=1,
            page_size=PAGE_SIZE, kv_dtype="float32", layout_fingerprint=fingerprint))

    def _on_message(self, msg) -> None:
        if isinstance(msg, RegisterDecode):
            self.decode_endpoint = msg.reply_endpoint
            self.channel.send(msg.reply_endpoint, RegisterResult(
                decode_engine_id=msg.decode_engine_id, accepted=True))
        elif isinstance(msg, Abort) and self.ack_aborts:
            self.channel.send(self.decode_endpoint, AbortAck(bootstrap_room=msg.bootstrap_room,
                                                             sender_id="rogue-prefill"))
        self.got.append(msg)

    def wait(self, kind, room, timeout_s=5.0):
        """The first recorded ``kind`` message for ``room``; fails after ``timeout_s``."""
        msg = wait_until(lambda: next((m for m in self.got if isinstance(m, kind)
                                       and m.bootstrap_room == room), None), timeout_s)
        assert msg is not None, f"no {kind.__name__} for room {room} in {self.got}"
        return msg

    def close(self) -> None:
        self.bootstrap.stop()
        self.channel.close()
