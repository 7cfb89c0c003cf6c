"""The decode's transfer worker (DESIGN.md §4): the threads and messages of a decode server
-- pairing with each prefill (a bootstrap thread per peer: ``GET /route``, the compatibility
check, ``RegisterDecode``), the heartbeat to paired prefills, and the control messages the
ZMQ receiver thread hands over (a room's status, aborts and their acks, registration answers,
a multi-host node's report). They only record what happened under the connector's lock and
wake the engine; ``DecodeConnector.poll`` applies it on the engine thread.

The KV itself is written by the prefill into the pages the decode reserved: ``start`` has
nothing to move and ``poll`` reports nothing to the scheduler (the decode commits its requests
itself, ``Scheduler.commit_remote``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid

from pdjax.pd.bootstrap import (BootstrapError, IncompatiblePeerError,
                                check_bootstrap_health, check_compatible,
                                fetch_prefill_info)
from pdjax.pd.lifecycle import (Aborted, KVPoll, PairingFailed, PeerLost, PeerState,
                                Refused, RemoteFailure, RoomFailure)
from pdjax.pd.protocol import (Abort, AbortAck, DecodeRankInfo, Message, RegisterDecode,
                               RegisterResult, TransferStatus)
from pdjax.pd.rooms import PrefillPeer
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.transfer.worker import KVTransferWorker

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
HEARTBEAT_MAX_FAILURES = 2


class DecodeTransferWorker(KVTransferWorker):
    """The pairing, heartbeat and receiver side of ``pd`` (a ``DecodeConnector``: its lock,
    rooms, peers, channel, local KV, metadata buffers, transfer engine and multi-host ranks)."""

    def __init__(self, pd):
        self.pd = pd
        self._uid = uuid.uuid4().hex[:12]
        self._peer_ids = itertools.count()
        self._acked: set[int] = set()        # rooms whose abort the prefill acknowledged
        self.num_abort_acks = 0
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="pd-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def start(self, meta) -> None:
        """Nothing to move: the prefill writes the KV (``DecodeConnector.build_meta`` is None)."""

    def poll(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def take_acked(self) -> set[int]:
        """Rooms whose Abort the prefill acknowledged since the last call (their quarantined
        pages may go back)."""
        with self.pd.lock:
            acked, self._acked = self._acked, set()
        return acked

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(5.0)

    # ------------------------------------------------------------------ pairing
    def ensure_peer(self, key: tuple[str, int]) -> None:
        with self.pd.lock:
            if key in self.pd.peers:
                return
            peer = PrefillPeer(key[0], key[1], f"decode-{self._uid}-{next(self._peer_ids)}")
            self.pd.peers[key] = peer
        threading.Thread(target=self._bootstrap_peer, args=(peer,), daemon=True,
                         name=f"pd-bootstrap-{key[0]}:{key[1]}").start()

    def register_msg(self, peer: PrefillPeer, wait_s: float = 0.0) -> RegisterDecode:
        """This decode's registration; a multi-host one lists every node's shards and session
        (waiting up to ``wait_s`` for the other nodes' reports; ``ValueError`` after)."""
        layout, sessions, owners = self.pd.local_kv.layout, (), ()
        session = self.pd.transfer_engine.session_id
        if self.pd.ranks is not None:
            layout, sessions, owners = self.pd.ranks.layout(layout, session, wait_s)
        return RegisterDecode(
            decode_engine_id=peer.engine_id, reply_endpoint=self.pd.channel.endpoint,
            engine_session_id=session, tp_rank=0, tp_size=1,
            kv_buffers=layout.buffers, kv_layout=layout.kind, metadata_addr=self.pd.meta.base_addr,
            metadata_bytes_per_slot=self.pd.meta.bytes_per_slot,
            metadata_num_slots=self.pd.meta.num_slots, page_size=self.pd.page_size,
            kv_dtype=self.pd.local_kv.kv_dtype, layout_fingerprint=self.pd.local_kv.fingerprint,
            node_sessions=sessions, shard_nodes=owners)

    def _bootstrap_peer(self, peer: PrefillPeer) -> None:
        """Bootstrap thread: topology, compatibility check, registration (DESIGN.md §4)."""
        where = f"{peer.host}:{peer.port}"
        try:
            info = fetch_prefill_info(peer.host, peer.port,
                                      timeout_s=min(self.pd.args.bootstrap_timeout_s, 30.0))
            check_compatible(info, page_size=self.pd.page_size, kv_dtype=self.pd.local_kv.kv_dtype,
                             layout_fingerprint=self.pd.local_kv.fingerprint)
            rank = info.rank(0)
            peer.endpoint = f"tcp://{rank.rank_ip}:{rank.rank_port}"
            peer.registered.clear()
            msg = self.register_msg(peer, wait_s=self.pd.args.bootstrap_timeout_s)
            if not self.pd.send(peer.endpoint, msg):
                raise BootstrapError(f"could not send the registration to {peer.endpoint}")
            if not peer.registered.wait(REGISTER_TIMEOUT_S):
                raise BootstrapError(f"no answer to the registration from {peer.endpoint} "
                                     f"within {REGISTER_TIMEOUT_S:g} s")
            if not peer.accepted:
                raise IncompatiblePeerError(peer.register_reason)
            peer.set_ready()
            logger.info("PD decode: paired with prefill %s (%s)", where, peer.endpoint)
        except (BootstrapError, IncompatiblePeerError, ValueError, OSError) as e:
            peer.fail(PairingFailed(f"cannot pair with prefill {where}: {e}"))
            logger.error("PD decode: %s", peer.reason)
        self.pd.wake()

    def _heartbeat_loop(self) -> None:
        interval = max(0.1, self.pd.args.heartbeat_interval_s)
        while not self._stop.wait(interval):
            with self.pd.lock:
                peers = [p for p in self.pd.peers.values() if p.state == PeerState.READY]
            for p in peers:
                if check_bootstrap_health(p.host, p.port, timeout_s=min(2.0, interval * 2)):
                    p.health_failures = 0
                    continue
                p.health_failures += 1
                if p.health_failures >= HEARTBEAT_MAX_FAILURES and p.state == PeerState.READY:
                    p.fail(PeerLost(f"lost connection with prefill {p.host}:{p.port} "
                                    f"({p.health_failures} failed heartbeats)"))
                    logger.error("PD decode: %s", p.reason)
                    if p.endpoint:
                        self.pd.channel.drop_peer(p.endpoint)
                    self.pd.wake()

    # ------------------------------------------------------------------ receiver thread
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, TransferStatus):
            failure = None
            if msg.state == KVPoll.Failed:
                failure = (Refused(msg.reason) if 400 <= msg.status_code < 500
                           else RemoteFailure(msg.reason))
            self._on_status(msg.bootstrap_room, msg.state, failure, msg.status_code)
        elif isinstance(msg, Abort):
            self._on_status(msg.bootstrap_room, KVPoll.Failed,
                            Aborted(f"aborted by the prefill server: {msg.reason or 'no reason'}"),
                            ack_sender=msg.sender_id)
        elif isinstance(msg, AbortAck):
            with self.pd.lock:
                self._acked.add(msg.bootstrap_room)
                self.num_abort_acks += 1
            self.pd.wake()
        elif isinstance(msg, DecodeRankInfo):
            why = ("DecodeRankInfo on a one-process decode" if self.pd.ranks is None
                   else self.pd.ranks.report(msg))
            if why is not None:
                self._reject(why)
            else:
                self.pd.wake()
        elif isinstance(msg, RegisterResult):
            with self.pd.lock:
                peer = next((p for p in self.pd.peers.values()
                             if p.engine_id == msg.decode_engine_id), None)
            if peer is None:
                self._reject(f"RegisterResult for unknown engine id {msg.decode_engine_id!r}")
                return
            peer.accepted, peer.register_reason = msg.accepted, msg.reason
            peer.registered.set()
        elif type(msg).__name__ != "Heartbeat":
            self._reject(f"unexpected {type(msg).__name__} on a decode server")

    def _on_status(self, room: int, state: KVPoll, failure: RoomFailure | None,
                   status_code: int = 0,
                   ack_sender: str | None = None) -> None:
        with self.pd.lock:
            rid = self.pd.room_owner.get(room)
            r = self.pd.rooms.get(rid) if rid is not None else None
            ok = r is not None and r.state == KVPoll.Transferring and r.status is None
            if ok:
                r.status, r.status_failure, r.status_code = state, failure, status_code
            peer = None if r is None or r.fake else self.pd.peers.get(r.peer_key)
            # The room failed here (a client abort, a timeout) while the prefill's last word
            # was on its way: the messages crossed, nothing is wrong with either side.
            crossed = r is None and any(rec["room"] == room and rec["state"] == "Failed"
                                        for rec in self.pd.recent)
        if ack_sender is not None and peer is not None and peer.endpoint:
            self.pd.send(peer.endpoint, AbortAck(bootstrap_room=room, sender_id=peer.engine_id))
        if crossed:
            logger.info("PD decode: %s status for bootstrap_room %d, which failed here "
                        "already: ignored", state.name, room)
            return
        if not ok:
            self._reject(f"{state.name} status for bootstrap_room {room}, which is not waiting "
                         f"for a transfer here")
            return
        self.pd.wake()

    def _reject(self, reason: str) -> None:
        logger.error("PD decode: rejected a control message: %s", reason)
        self.pd.count_rejected("refused")
