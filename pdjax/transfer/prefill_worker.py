"""The prefill's transfer worker (DESIGN.md §4): its threads and messages.

* The transfer thread writes each room's chunks into the decode's pages
  (``kv_copies.write_nodes``: contiguous runs x layer buffers x head slices, in engine batches
  of at most ``max_batch`` copies), then its metadata row, and sends the room's status, aborts
  and abort acks to the decode in the same queue, so that each is sent only after the room's
  last write has finished (a decode that gets Failed, Abort or AbortAck may reuse its pages at
  once).
* The ZMQ receiver thread hands it the decode's messages: a registration (checked, and
  planned over every node of a multi-host prefill), a page list (validated against the
  registered pool), an Abort, a multi-host node's write report.

The worker owns what its threads share -- the registered decodes (``peer``) and the rooms
whose remaining chunks must not be written (``cancel``) -- under its own lock, and touches no
room: what happened reaches the engine thread as typed events through one queue, which
``PrefillConnector.poll`` drains::

    transfer thread:  a chunk written        -> ChunkWritten   (then JobDone, per job)
                      a write failed         -> RoomFailed     (the decode was told)
    receiver thread:  a checked page list    -> PageListArrived
                      a page list refused    -> BadPageList    (the decode was told)
                      the decode's Abort     -> DecodeAborted  (acked by the engine, in order)

``PrefillConnector.build_meta`` plans a step's chunks on the engine thread; ``start`` stages
their pages and queues them; ``poll`` reports the requests whose pages may go back
(``finished_sending``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from pdjax.pd.lifecycle import KVPoll, RoomFailure, WriteFailed
from pdjax.pd.protocol import (Abort, AbortAck, Message, RankWriteDone, RegisterDecode,
                               RegisterResult, TransferRequest, TransferStatus)
from pdjax.pd.rooms import PrefillRoom
from pdjax.pd.wire import ProtocolError, validate_pages
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.transfer.decode_peer import DecodePeer
from pdjax.transfer.engine import TransferError
from pdjax.transfer.kv_copies import check_rank_pages, write_nodes
from pdjax.transfer.worker import EventQueue, KVTransferWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PrefillChunk:
    """Pages ``src`` (this server's) of ``room`` go to ``dst`` (the decode's); ``last``: the
    room's metadata row follows them."""

    room: PrefillRoom
    src: list[int]
    dst: list[int]
    last: bool


# --------------------------------------------------------------------------- events
@dataclasses.dataclass(frozen=True)
class ChunkWritten:
    """A chunk of ``room`` reached the decode: ``nbytes`` bytes over ``copies`` copies
    (``node_bytes`` per decode node, node 0 first) in ``write_s`` seconds; ``last``: with the
    metadata row, and the Success status was sent."""

    room: PrefillRoom
    src: list[int]
    dst: list[int]
    nbytes: int
    copies: int
    node_bytes: list[int]
    write_s: float
    last: bool


@dataclasses.dataclass(frozen=True)
class RoomFailed:
    """The transfer thread could not write ``room`` (the decode was told, where it could be)."""

    room: PrefillRoom
    failure: RoomFailure


@dataclasses.dataclass(frozen=True)
class JobDone:
    """One chunk or notice job of ``room`` is over (after its ``ChunkWritten`` or
    ``RoomFailed``)."""

    room: PrefillRoom


@dataclasses.dataclass(frozen=True)
class PageListArrived:
    """A ``TransferRequest`` from a registered decode, its ``dst`` pages range-checked."""

    msg: TransferRequest
    dst: np.ndarray


@dataclasses.dataclass(frozen=True)
class BadPageList:
    """A page list for ``room`` was refused (``reason``; the decode was told)."""

    room: int
    reason: str


@dataclasses.dataclass(frozen=True)
class DecodeAborted:
    """The registered decode ``sender_id`` aborted ``room``; it waits for an ``AbortAck``."""

    room: int
    sender_id: str
    reason: str


PrefillEvent = ChunkWritten | RoomFailed | JobDone | PageListArrived | BadPageList | DecodeAborted


class PrefillTransferWorker(KVTransferWorker):
    """The transfer and receiver threads of a prefill server (see the module docstring).

    Parts: ``channel`` (``MessageChannel``: ``send``), ``local_kv`` (``LocalKV``: ``layout``,
    ``stage_out``), ``meta`` (``MetadataBuffers``: ``copy_to``, ``bytes_per_slot``),
    ``transfer_engine``, ``ranks`` (``PrefillRanks`` of a multi-host prefill, else None),
    ``page_size``, ``transfer_timeout_s`` (a multi-host write's wait for the other nodes),
    ``sender_id`` (this prefill's id in its Abort messages), ``wait_for_kv()`` (blocks until
    the KV writes dispatched so far landed), ``wake()`` and ``on_reject(kind)``.
    """

    def __init__(self, *, channel, local_kv, meta, transfer_engine, ranks, page_size: int,
                 transfer_timeout_s: float, sender_id: str, wait_for_kv: Callable[[], None],
                 wake: Callable[[], None], on_reject: Callable[[str], None]):
        self.channel, self.local_kv, self.meta = channel, local_kv, meta
        self.transfer_engine, self.ranks, self.page_size = transfer_engine, ranks, page_size
        self.transfer_timeout_s, self.sender_id = transfer_timeout_s, sender_id
        self._wait_for_kv, self._wake, self._on_reject = wait_for_kv, wake, on_reject
        self._events = EventQueue(wake)
        self._finished_sending: set[str] = set()      # engine thread only
        # The worker's own state, shared by its threads (and the engine's calls) under _lock.
        self._lock = threading.Lock()
        self._peers: dict[str, DecodePeer] = {}        # registered decodes by engine id
        self._cancelled: set[int] = set()              # rooms whose chunks are not written
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="pd-prefill-transfer",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def start(self, meta: list[PrefillChunk]) -> None:
        """Stage the chunks' pages (after every KV write dispatched so far has landed) and
        queue them; the other nodes of a multi-host prefill are told to write theirs."""
        self._wait_for_kv()
        for c in meta:
            r = c.room
            self.local_kv.stage_out(c.src)
            job = (self.ranks.send_write(r.peer_id, c.src, c.dst, r.room)
                   if self.ranks is not None else None)
            r.jobs_inflight += 1
            self._jobs.put(("chunk", r, (r.room, r.peer_id, r.src_slot, r.dst_slot, c.src,
                                         c.dst, c.last, job)))

    def notify(self, r: PrefillRoom, kind: str) -> None:
        """Tell the decode that ``r`` failed (``kind`` ``status``: a Failed status; ``abort``:
        an Abort) after the room's queued chunks."""
        r.jobs_inflight += 1
        self._jobs.put(("notice", r, (r.room, r.peer_id, kind, r.fail_reason or "failed",
                                      r.status_code)))

    def ack(self, room: int, endpoint: str) -> None:
        """Acknowledge a decode's Abort of ``room`` after every job queued so far."""
        self._jobs.put(("ack", None, (room, endpoint)))

    def cancel(self, room: int) -> None:
        """The engine failed ``room``: chunks of it still queued are not written."""
        with self._lock:
            self._cancelled.add(room)

    def release(self, room: int) -> None:
        """The engine forgot ``room`` (no job of it is queued): the number may be used again."""
        with self._lock:
            self._cancelled.discard(room)

    def peer(self, engine_id: str | None) -> DecodePeer | None:
        """The registered decode ``engine_id`` (any thread)."""
        with self._lock:
            return self._peers.get(engine_id)

    def peer_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def events(self) -> list[PrefillEvent]:
        """Every event since the last call, oldest first (engine thread)."""
        return self._events.drain()

    def sent(self, rid: str) -> None:
        """The room of held request ``rid`` is concluded: report it in ``finished_sending``."""
        self._finished_sending.add(rid)

    def poll(self) -> KVConnectorOutput:
        done, self._finished_sending = self._finished_sending, set()
        return KVConnectorOutput(finished_sending=done)

    def has_work(self) -> bool:
        return bool(self._finished_sending)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)

    def _post(self, event: PrefillEvent) -> None:
        self._events.post(event)

    # ------------------------------------------------------------------ transfer thread
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, r, arg = job
            try:
                if kind == "chunk":
                    self._write_chunk(r, *arg)
                elif kind == "notice":
                    self._send_notice(*arg)
                elif kind == "ack":
                    room, endpoint = arg
                    self.channel.send(endpoint, AbortAck(bootstrap_room=room,
                                                         sender_id=self.sender_id))
            except Exception as e:       # never let the worker die
                logger.exception("PD prefill worker: %s job failed", kind)
                if kind == "chunk":
                    self._post(RoomFailed(r, WriteFailed(f"internal error in the transfer "
                                                         f"worker: {e}")))
            finally:
                if kind in ("chunk", "notice"):
                    self._post(JobDone(r))
                else:
                    self._wake()

    def _write_chunk(self, r: PrefillRoom, room: int, peer_id: str, src_slot: int,
                     dst_slot: int, src: list[int], dst: list[int], last: bool,
                     job: int | None = None) -> None:
        with self._lock:
            skip = room in self._cancelled
            peer = self._peers.get(peer_id)
        if skip or peer is None:
            drop = getattr(self.local_kv, "drop_gathered", None)
            if drop is not None:         # a pull-based pool (jax): free the chunk's arrays now
                drop(src)
            if job is not None:          # the other nodes were told to write: wait for them
                self.ranks.join(job, self.transfer_timeout_s)
            if peer is None and not skip:
                self._post(RoomFailed(r, RoomFailure(f"decode engine {peer_id!r} is no longer "
                                                     f"registered")))
            return
        offered = False      # the write path was entered: it releases the gathered arrays
        try:
            meta = [self.meta.copy_to(src_slot, peer.metadata_addr, dst_slot,
                                      peer.metadata_num_slots,
                                      peer.metadata_bytes_per_slot)] if last else []
            t0 = time.perf_counter()
            offered = True
            if job is None:
                node_bytes, n_kv = self._write_nodes(peer, src, dst, meta, room)
            else:            # multi-host: every node's shards, then the metadata row
                node_bytes, n_kv = self.ranks.write(self.transfer_engine, peer_id, src, dst,
                                                    meta, job, self.transfer_timeout_s, room)
            write_s = time.perf_counter() - t0
        except (TransferError, ValueError) as e:
            drop = getattr(self.local_kv, "drop_gathered", None)
            if drop is not None and not offered:  # never taken (a later chunk may share the key)
                drop(src)
            reason = f"KV write to decode {peer.session_id} failed: {e}"
            self.cancel(room)                # the room's later chunks are not written
            self.channel.send(peer.reply_endpoint, TransferStatus(
                bootstrap_room=room, state=KVPoll.Failed, reason=reason))
            self._post(RoomFailed(r, WriteFailed(reason)))
            return
        if last:
            self.channel.send(peer.reply_endpoint, TransferStatus(bootstrap_room=room,
                                                                  state=KVPoll.Success))
        # What the decode's shards receive: pages x its bytes per page, over its shards.
        self._post(ChunkWritten(r, src, dst, sum(node_bytes), n_kv, list(node_bytes), write_s,
                                last))

    def _write_nodes(self, peer, src: list[int], dst: list[int], meta: list,
                     room: int = 0) -> tuple[list[int], int]:
        """Write ``src`` -> ``dst`` pages into every node of the decode (one process: one), each
        node's shards into its own session, node 0 last with the metadata row ``meta`` (the
        gate comes after all the KV). Returns (bytes per decode node, node 0 first; copies)."""
        write_pages = getattr(self.transfer_engine, "write_pages", None)
        if write_pages is not None:        # a pull-based backend (jax): one offer per chunk
            return write_pages(self.local_kv, peer, src, dst, meta, room)
        return write_nodes(self.transfer_engine, self.local_kv.layout, peer.layout,
                           peer.node_writes(), src, dst, meta=meta)

    def _send_notice(self, room: int, peer_id: str, kind: str, reason: str,
                     status_code: int) -> None:
        peer = self.peer(peer_id)
        if peer is None:
            return
        if kind == "abort":
            self.channel.send(peer.reply_endpoint, Abort(bootstrap_room=room,
                                                         sender_id=self.sender_id,
                                                         reason=reason[:4000]))
        else:
            self.channel.send(peer.reply_endpoint, TransferStatus(
                bootstrap_room=room, state=KVPoll.Failed, reason=reason[:4000],
                status_code=status_code))

    # ------------------------------------------------------------------ receiver thread
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, RegisterDecode):
            self._on_register(msg)
        elif isinstance(msg, TransferRequest):
            self._on_transfer_request(msg)
        elif isinstance(msg, Abort):
            if self.peer(msg.sender_id) is None:
                self.reject(f"Abort of bootstrap_room {msg.bootstrap_room} from unknown sender "
                            f"{msg.sender_id!r}")
            else:
                self._post(DecodeAborted(msg.bootstrap_room, msg.sender_id, msg.reason))
        elif isinstance(msg, AbortAck):
            logger.info("PD prefill: abort of bootstrap_room %d acknowledged", msg.bootstrap_room)
        elif isinstance(msg, RankWriteDone):
            if self.ranks is None or not self.ranks.on_done(msg):
                self.reject(f"RankWriteDone of unknown job {msg.job} from node {msg.node_rank}")
        elif type(msg).__name__ != "Heartbeat":
            self.reject(f"unexpected {type(msg).__name__} on a prefill server")

    def reject(self, reason: str) -> None:
        """Log and count a refused control message (any thread)."""
        logger.error("PD prefill: rejected a control message: %s", reason)
        self._on_reject("refused")

    def _on_register(self, msg: RegisterDecode) -> None:
        try:
            plan = self.ranks.plan() if self.ranks is not None else None
            peer = DecodePeer.from_registration(msg, self.local_kv, self.page_size,
                                                self.meta.bytes_per_slot,
                                                plan.layout if plan is not None else None)
        except ValueError as e:
            reason = str(e)
            self.reject(f"registration of {msg.decode_engine_id}: {reason}")
            self.channel.send(msg.reply_endpoint, RegisterResult(
                decode_engine_id=msg.decode_engine_id, accepted=False, reason=reason))
            return
        with self._lock:
            self._peers[msg.decode_engine_id] = peer
        if plan is not None:
            self.ranks.paired(msg.decode_engine_id, peer, plan)
        logger.info("PD prefill: decode %s registered (session %s, %d pages)",
                    msg.decode_engine_id, msg.engine_session_id, peer.layout.num_pages)
        self.channel.send(msg.reply_endpoint, RegisterResult(
            decode_engine_id=msg.decode_engine_id, accepted=True))

    def _on_transfer_request(self, msg: TransferRequest) -> None:
        peer = self.peer(msg.decode_engine_id)
        if peer is None:
            self.reject(f"TransferRequest for bootstrap_room {msg.bootstrap_room} from "
                        f"unregistered decode {msg.decode_engine_id!r}")
            return
        try:
            dst = validate_pages(np.asarray(msg.dst_pages, np.int64), peer.layout.num_pages,
                                 "dst_pages")
            check_rank_pages(peer.layout, dst)      # a DP attention decode's null pages
            if not 0 <= msg.dst_metadata_slot < peer.metadata_num_slots:
                raise ProtocolError(f"field 'dst_metadata_slot': {msg.dst_metadata_slot} outside "
                                    f"[0, {peer.metadata_num_slots})")
        except ProtocolError as e:
            reason = f"bad TransferRequest for bootstrap_room {msg.bootstrap_room}: {e}"
            self.reject(reason)
            self.channel.send(peer.reply_endpoint, TransferStatus(
                bootstrap_room=msg.bootstrap_room, state=KVPoll.Failed, reason=reason))
            self._post(BadPageList(msg.bootstrap_room, reason))
            return
        self._post(PageListArrived(msg, dst))

    # ------------------------------------------------------------------ introspection
    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"peers": sorted(self._peers), "num_cancelled_rooms": len(self._cancelled)}
