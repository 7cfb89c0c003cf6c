"""The decode's transfer worker (DESIGN.md §4): the threads and messages of a decode server
-- pairing with each prefill (a bootstrap thread per peer: ``GET /route``, the compatibility
check, ``RegisterDecode``), the heartbeat to paired prefills, and the control messages the
ZMQ receiver thread hands over (a room's status, aborts and their acks, registration answers,
a multi-host node's report).

The worker owns the state its threads share (the peers it watches, the registrations it waits
for, under its own lock) and touches nothing of the connector's: what happened reaches the
engine thread as typed events through one queue, which ``DecodeConnector.poll`` drains::

    bootstrap thread:  pairing done / failed          -> PeerReady / PeerFailed
    heartbeat thread:  HEARTBEAT_MAX_FAILURES misses  -> PeerFailed
    receiver thread:   TransferStatus, Abort          -> StatusArrived
                       AbortAck                       -> AbortAcked
    engine thread:     events() -> rooms and peers change, in the order the events came

The KV itself is written by the prefill into the pages the decode reserved: ``start`` has
nothing to move. What the engine thread concluded from the events (``DecodeConnector.poll``)
the worker reports to the scheduler at ``poll``, as a ``KVConnectorOutput``: a request's KV in,
with its first token (``received``), given up (``failed``), or its quarantined pages free
again (``released``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import uuid
from typing import Any, Callable

from pdjax.pd.bootstrap import (BootstrapError, IncompatiblePeerError,
                                check_bootstrap_health, check_compatible,
                                fetch_prefill_info)
from pdjax.pd.lifecycle import (Aborted, KVPoll, PairingFailed, PeerLost, Refused,
                                RemoteFailure, RoomFailure)
from pdjax.pd.protocol import (Abort, AbortAck, DecodeRankInfo, Message, RegisterDecode,
                               RegisterResult, TransferStatus)
from pdjax.sched.kv_connector import FirstToken, KVConnectorOutput, RecvFailure
from pdjax.transfer.worker import EventQueue, KVTransferWorker

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
HEARTBEAT_MAX_FAILURES = 2


# --------------------------------------------------------------------------- events
@dataclasses.dataclass(frozen=True)
class PeerReady:
    """Pairing with the prefill at bootstrap ``key`` (host, port) succeeded: its rank 0 takes
    control messages at ``endpoint``."""

    key: tuple[str, int]
    engine_id: str
    endpoint: str


@dataclasses.dataclass(frozen=True)
class PeerFailed:
    """Pairing failed, or a paired prefill stopped answering its heartbeat."""

    key: tuple[str, int]
    engine_id: str
    failure: RoomFailure


@dataclasses.dataclass(frozen=True)
class StatusArrived:
    """The prefill's last word on ``room``: ``state`` Success or Failed (``failure``: why;
    ``status_code``: its 4xx refusal, else 0). ``ack_sender``: the room was aborted by the
    prefill, which waits for an ``AbortAck`` addressed to this engine id."""

    room: int
    state: KVPoll
    failure: RoomFailure | None = None
    status_code: int = 0
    ack_sender: str | None = None


@dataclasses.dataclass(frozen=True)
class AbortAcked:
    """The prefill acknowledged this decode's Abort of ``room``: it writes there no more."""

    room: int


DecodeEvent = PeerReady | PeerFailed | StatusArrived | AbortAcked


@dataclasses.dataclass
class _Watched:
    """A paired prefill the heartbeat thread probes (the worker's own record)."""

    key: tuple[str, int]
    endpoint: str
    failures: int = 0


@dataclasses.dataclass
class _Registration:
    """A ``RegisterDecode`` a bootstrap thread waits to hear about."""

    answered: threading.Event = dataclasses.field(default_factory=threading.Event)
    accepted: bool = False
    reason: str = ""


class DecodeTransferWorker(KVTransferWorker):
    """The pairing, heartbeat and receiver side of a decode server (see the module docstring).

    Parts: ``channel`` (``MessageChannel``: ``endpoint``, ``send``, ``drop_peer``),
    ``local_kv`` (``LocalKV``: ``layout``, ``kv_dtype``, ``fingerprint``), ``meta``
    (``MetadataBuffers``), ``transfer_engine`` (its ``session_id``), ``ranks``
    (``DecodeRanks`` of a multi-host decode, else None), ``page_size``, the pairing's
    ``bootstrap_timeout_s`` and the heartbeat's ``heartbeat_interval_s`` (seconds), ``wake()``
    (the engine should step) and ``on_reject(kind)`` (a refused control message).
    ``fetch_info`` / ``health_check`` are ``pdjax.pd.bootstrap``'s ``fetch_prefill_info`` /
    ``check_bootstrap_health`` unless a test passes its own.
    """

    def __init__(self, *, channel, local_kv, meta, transfer_engine, ranks, page_size: int,
                 bootstrap_timeout_s: float, heartbeat_interval_s: float,
                 wake: Callable[[], None], on_reject: Callable[[str], None],
                 fetch_info: Callable[..., Any] = fetch_prefill_info,
                 health_check: Callable[..., bool] = check_bootstrap_health):
        self.channel, self.local_kv, self.meta = channel, local_kv, meta
        self.transfer_engine, self.ranks, self.page_size = transfer_engine, ranks, page_size
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._wake, self._on_reject = wake, on_reject
        self._fetch_info, self._health_check = fetch_info, health_check
        self._events = EventQueue(wake)
        self._outbox = KVConnectorOutput()               # engine thread only
        self._uid = uuid.uuid4().hex[:12]
        self._peer_ids = itertools.count()
        # The worker's own state, shared by its threads only.
        self._lock = threading.Lock()
        self._engine_ids: set[str] = set()
        self._watched: dict[str, _Watched] = {}          # engine id -> paired prefill
        self._pending: dict[str, _Registration] = {}     # engine id -> its registration
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="pd-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def start(self, meta) -> None:
        """Nothing to move: the prefill writes the KV (``DecodeConnector.build_meta`` is None)."""

    # ------------------------------------------------------------------ the engine's reports
    def received(self, rid: str, first: FirstToken) -> None:
        """Engine thread: ``rid``'s prompt KV is in its pages, its first token ``first``."""
        self._outbox.finished_recving.add(rid)
        self._outbox.first_tokens[rid] = first

    def failed(self, rid: str, failure: RecvFailure) -> None:
        """Engine thread: ``rid``'s KV will not come."""
        self._outbox.failed_recving[rid] = failure

    def released(self, rid: str) -> None:
        """Engine thread: no write can land in ``rid``'s held pages any more."""
        self._outbox.finished_sending.add(rid)

    def poll(self) -> KVConnectorOutput:
        """What the engine thread reported since the last call (engine thread)."""
        out, self._outbox = self._outbox, KVConnectorOutput()
        return out

    def has_work(self) -> bool:
        return bool(self._outbox)

    def events(self) -> list[DecodeEvent]:
        """Every event since the last call, oldest first (engine thread)."""
        return self._events.drain()

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(5.0)

    def _post(self, event: DecodeEvent) -> None:
        self._events.post(event)

    # ------------------------------------------------------------------ pairing
    def pair(self, key: tuple[str, int]) -> str:
        """Start pairing with the prefill whose bootstrap server is ``key`` (host, port) on a
        thread of its own; returns the engine id this decode uses towards it. The outcome
        arrives as ``PeerReady`` or ``PeerFailed``."""
        engine_id = f"decode-{self._uid}-{next(self._peer_ids)}"
        with self._lock:
            self._engine_ids.add(engine_id)
        threading.Thread(target=self._bootstrap_peer, args=(key, engine_id), daemon=True,
                         name=f"pd-bootstrap-{key[0]}:{key[1]}").start()
        return engine_id

    def register_msg(self, engine_id: str, wait_s: float = 0.0) -> RegisterDecode:
        """This decode's registration as ``engine_id``; a multi-host one lists every node's
        shards and session (waiting up to ``wait_s`` for the other nodes' reports;
        ``ValueError`` after)."""
        layout, sessions, owners = self.local_kv.layout, (), ()
        session = self.transfer_engine.session_id
        if self.ranks is not None:
            layout, sessions, owners = self.ranks.layout(layout, session, wait_s)
        return RegisterDecode(
            decode_engine_id=engine_id, reply_endpoint=self.channel.endpoint,
            engine_session_id=session, tp_rank=0, tp_size=1,
            kv_buffers=layout.buffers, kv_layout=layout.kind, metadata_addr=self.meta.base_addr,
            metadata_bytes_per_slot=self.meta.bytes_per_slot,
            metadata_num_slots=self.meta.num_slots, page_size=self.page_size,
            kv_dtype=self.local_kv.kv_dtype, layout_fingerprint=self.local_kv.fingerprint,
            node_sessions=sessions, shard_nodes=owners)

    def _bootstrap_peer(self, key: tuple[str, int], engine_id: str) -> None:
        """Bootstrap thread: topology, compatibility check, registration (DESIGN.md §4)."""
        where = f"{key[0]}:{key[1]}"
        try:
            info = self._fetch_info(key[0], key[1], timeout_s=min(self.bootstrap_timeout_s, 30.0))
            check_compatible(info, page_size=self.page_size, kv_dtype=self.local_kv.kv_dtype,
                             layout_fingerprint=self.local_kv.fingerprint,
                             transfer_backend=self.transfer_engine.data_plane)
            rank = info.rank(0)
            endpoint = f"tcp://{rank.rank_ip}:{rank.rank_port}"
            pending = _Registration()
            with self._lock:
                self._pending[engine_id] = pending
            try:
                msg = self.register_msg(engine_id, wait_s=self.bootstrap_timeout_s)
                if not self.channel.send(endpoint, msg):
                    raise BootstrapError(f"could not send the registration to {endpoint}")
                if not pending.answered.wait(REGISTER_TIMEOUT_S):
                    raise BootstrapError(f"no answer to the registration from {endpoint} "
                                         f"within {REGISTER_TIMEOUT_S:g} s")
            finally:
                with self._lock:
                    self._pending.pop(engine_id, None)
            if not pending.accepted:
                raise IncompatiblePeerError(pending.reason)
            with self._lock:
                self._watched[engine_id] = _Watched(key, endpoint)
            logger.info("PD decode: paired with prefill %s (%s)", where, endpoint)
            self._post(PeerReady(key, engine_id, endpoint))
        except (BootstrapError, IncompatiblePeerError, ValueError, OSError) as e:
            failure = PairingFailed(f"cannot pair with prefill {where}: {e}")
            logger.error("PD decode: %s", failure)
            self._post(PeerFailed(key, engine_id, failure))

    def _heartbeat_loop(self) -> None:
        interval = max(0.1, self.heartbeat_interval_s)
        while not self._stop.wait(interval):
            with self._lock:
                watched = list(self._watched.items())
            for engine_id, w in watched:
                if self._health_check(w.key[0], w.key[1], timeout_s=min(2.0, interval * 2)):
                    w.failures = 0
                    continue
                w.failures += 1
                if w.failures < HEARTBEAT_MAX_FAILURES:
                    continue
                with self._lock:
                    if self._watched.pop(engine_id, None) is None:
                        continue
                failure = PeerLost(f"lost connection with prefill {w.key[0]}:{w.key[1]} "
                                   f"({w.failures} failed heartbeats)")
                logger.error("PD decode: %s", failure)
                self.channel.drop_peer(w.endpoint)
                self._post(PeerFailed(w.key, engine_id, failure))

    def forget(self, engine_id: str) -> None:
        """The engine dropped the peer of ``engine_id`` (failed, no room uses it): stop
        watching it; a message for it is refused from now on."""
        with self._lock:
            self._watched.pop(engine_id, None)
            self._engine_ids.discard(engine_id)

    # ------------------------------------------------------------------ receiver thread
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, TransferStatus):
            failure = None
            if msg.state == KVPoll.Failed:
                failure = (Refused(msg.reason) if 400 <= msg.status_code < 500
                           else RemoteFailure(msg.reason))
            self._post(StatusArrived(msg.bootstrap_room, msg.state, failure, msg.status_code))
        elif isinstance(msg, Abort):
            self._post(StatusArrived(
                msg.bootstrap_room, KVPoll.Failed,
                Aborted(f"aborted by the prefill server: {msg.reason or 'no reason'}"),
                ack_sender=msg.sender_id))
        elif isinstance(msg, AbortAck):
            self._post(AbortAcked(msg.bootstrap_room))
        elif isinstance(msg, DecodeRankInfo):
            why = ("DecodeRankInfo on a one-process decode" if self.ranks is None
                   else self.ranks.report(msg))
            if why is not None:
                self.reject(why)
            else:
                self._wake()
        elif isinstance(msg, RegisterResult):
            with self._lock:
                known = msg.decode_engine_id in self._engine_ids
                pending = self._pending.get(msg.decode_engine_id)
            if not known:
                self.reject(f"RegisterResult for unknown engine id {msg.decode_engine_id!r}")
            elif pending is not None:
                pending.accepted, pending.reason = msg.accepted, msg.reason
                pending.answered.set()
            elif not msg.accepted:        # a registration again after the KV cache moved
                logger.error("PD decode: the prefill refused the registration of %s again: %s",
                             msg.decode_engine_id, msg.reason)
        elif type(msg).__name__ != "Heartbeat":
            self.reject(f"unexpected {type(msg).__name__} on a decode server")

    def reject(self, reason: str) -> None:
        """Log and count a refused control message (any thread)."""
        logger.error("PD decode: rejected a control message: %s", reason)
        self._on_reject("refused")
