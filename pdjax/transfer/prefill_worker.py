"""The prefill's transfer worker (DESIGN.md §4): its threads and messages.

* The transfer thread writes each room's chunks into the decode's pages
  (``kv_export.write_nodes``: contiguous runs x layer buffers x head slices, in engine batches
  of at most ``max_batch`` copies), then its metadata row, and sends the room's status, aborts
  and abort acks to the decode in the same queue, so that each is sent only after the room's
  last write has finished (a decode that gets Failed, Abort or AbortAck may reuse its pages at
  once).
* The ZMQ receiver thread hands it the decode's messages: a registration (checked, and
  planned over every node of a multi-host prefill), a page list (validated against the
  registered pool; bound to its room), an Abort (acked through the transfer queue), a
  multi-host node's write report.

``PrefillConnector.build_meta`` plans a step's chunks on the engine thread; ``start`` stages
their pages and queues them; the threads only record what happened on a room (under the
connector's lock) and wake the engine; ``poll`` reports the requests whose pages may go back
(``finished_sending``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import numpy as np

from pdjax.pd.lifecycle import (ROOM_CONFLICT_STATUS, Aborted, BadDestination, KVPoll,
                                RoomFailure, WriteFailed)
from pdjax.pd.protocol import (Abort, AbortAck, Message, RankWriteDone, RegisterDecode,
                               RegisterResult, TransferRequest, TransferStatus)
from pdjax.pd.rooms import PrefillRoom
from pdjax.pd.wire import ProtocolError, validate_pages
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.transfer.decode_peer import DecodePeer
from pdjax.transfer.engine import TransferError
from pdjax.transfer.kv_export import write_nodes
from pdjax.transfer.worker import KVTransferWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PrefillChunk:
    """Pages ``src`` (this server's) of ``room`` go to ``dst`` (the decode's); ``last``: the
    room's metadata row follows them."""

    room: PrefillRoom
    src: list[int]
    dst: list[int]
    last: bool


class PrefillTransferWorker(KVTransferWorker):
    """The transfer thread of ``pd`` (a ``PrefillConnector``: its lock, peers, metadata
    buffers, local KV, transfer engine, multi-host ranks, control channel and metrics)."""

    def __init__(self, pd):
        self.pd = pd
        self._jobs: queue.Queue = queue.Queue()
        self._finished_sending: set[str] = set()
        self._thread = threading.Thread(target=self._work, name="pd-prefill-transfer",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def start(self, meta: list[PrefillChunk]) -> None:
        """Stage the chunks' pages (after every KV write dispatched so far has landed) and
        queue them; the other nodes of a multi-host prefill are told to write theirs."""
        self.pd.host.wait_for_kv()
        for c in meta:
            self.pd.local_kv.stage_out(c.src)
            job = (self.pd.ranks.send_write(c.room.peer_id, c.src, c.dst)
                   if self.pd.ranks is not None else None)
            with self.pd.lock:
                c.room.jobs_inflight += 1
            self._jobs.put(("chunk", c.room, (c.src, c.dst, c.last, job)))

    def notify(self, r: PrefillRoom, kind: str) -> None:
        """Tell the decode that ``r`` failed (``kind`` ``status``: a Failed status; ``abort``:
        an Abort) after the room's queued chunks."""
        with self.pd.lock:
            r.jobs_inflight += 1
        self._jobs.put(("notice", r, kind))

    def ack(self, room: int, endpoint: str, sender: str) -> None:
        """Acknowledge a decode's Abort of ``room`` after every job queued so far."""
        self._jobs.put(("ack", room, (endpoint, sender)))

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
                    self._send_notice(r, arg)
                elif kind == "ack":
                    endpoint, sender = arg
                    self.pd.send(endpoint, AbortAck(bootstrap_room=r, sender_id=sender))
            except Exception as e:       # never let the worker die
                logger.exception("PD prefill worker: %s job failed", kind)
                if kind == "chunk":
                    with self.pd.lock:
                        r.report(WriteFailed(f"internal error in the transfer worker: {e}"))
            finally:
                if kind in ("chunk", "notice"):
                    with self.pd.lock:
                        r.jobs_inflight -= 1
                self.pd.wake()

    def _write_chunk(self, r: PrefillRoom, src: list[int], dst: list[int], last: bool,
                     job: int | None = None) -> None:
        with self.pd.lock:
            skip = r.reported is not None or r.state == KVPoll.Failed
            peer = self.pd.peers.get(r.peer_id)
        if skip or peer is None:
            if job is not None:          # the other nodes were told to write: wait for them
                self.pd.ranks.join(job, self.pd.args.transfer_timeout_s)
            if peer is None and not skip:
                with self.pd.lock:
                    r.report(RoomFailure(f"decode engine {r.peer_id!r} is no longer registered"))
            return
        try:
            meta = [self.pd.meta.copy_to(r.src_slot, peer.metadata_addr, r.dst_slot,
                                         peer.metadata_num_slots,
                                         peer.metadata_bytes_per_slot)] if last else []
            t0 = time.perf_counter()
            if job is None:
                node_bytes, n_kv = self._write_nodes(peer, src, dst, meta)
            else:            # multi-host: every node's shards, then the metadata row
                node_bytes, n_kv = self.pd.ranks.write(self.pd.transfer_engine, r.peer_id, src,
                                                       dst, meta, job,
                                                       self.pd.args.transfer_timeout_s)
            write_s = time.perf_counter() - t0
            # What the decode's shards receive: pages x its bytes per page, over its shards.
            nbytes = sum(node_bytes)
        except (TransferError, ValueError) as e:
            reason = f"KV write to decode {peer.session_id} failed: {e}"
            with self.pd.lock:
                r.report(WriteFailed(reason))
                r.notified = True
            self.pd.send(peer.reply_endpoint, TransferStatus(bootstrap_room=r.room,
                                                             state=KVPoll.Failed, reason=reason))
            return
        with self.pd.lock:
            r.bytes += nbytes
            r.pages += len(src)
            r.copies += n_kv
            r.node_bytes = [a + b for a, b in zip(r.node_bytes or [0] * len(node_bytes),
                                                  node_bytes)]
            r.write_s += write_s
            r.chunks.append({"src": src, "dst": dst, "copies": n_kv, "last": last,
                             "write_s": write_s})
        self.pd.metrics.on_chunk(nbytes, len(src), n_kv, write_s)
        if last:
            self.pd.send(peer.reply_endpoint, TransferStatus(bootstrap_room=r.room,
                                                             state=KVPoll.Success))
            with self.pd.lock:
                r.done = True
                r.notified = True

    def _write_nodes(self, peer, src: list[int], dst: list[int],
                     meta: list) -> tuple[list[int], int]:
        """Write ``src`` -> ``dst`` pages into every node of the decode (one process: one), each
        node's shards into its own session, node 0 last with the metadata row ``meta`` (the
        gate comes after all the KV). Returns (bytes per decode node, node 0 first; copies)."""
        return write_nodes(self.pd.transfer_engine, self.pd.local_kv.layout, peer.layout,
                           peer.node_writes(), src, dst, meta=meta)

    def _send_notice(self, r: PrefillRoom, kind: str) -> None:
        peer = self.pd.peers.get(r.peer_id)
        if peer is None:
            return
        reason = r.fail_reason or "failed"
        if kind == "abort":
            self.pd.send(peer.reply_endpoint, Abort(bootstrap_room=r.room,
                                                    sender_id=self.pd.sender_id,
                                                    reason=reason[:4000]))
        else:
            self.pd.send(peer.reply_endpoint, TransferStatus(bootstrap_room=r.room,
                                                             state=KVPoll.Failed,
                                                             reason=reason[:4000],
                                                             status_code=r.status_code))

    # ------------------------------------------------------------------ receiver thread
    def on_message(self, msg: Message) -> None:
        if isinstance(msg, RegisterDecode):
            self._on_register(msg)
        elif isinstance(msg, TransferRequest):
            self._on_transfer_request(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)
        elif isinstance(msg, AbortAck):
            logger.info("PD prefill: abort of bootstrap_room %d acknowledged", msg.bootstrap_room)
        elif isinstance(msg, RankWriteDone):
            if self.pd.ranks is None or not self.pd.ranks.on_done(msg):
                self._reject(f"RankWriteDone of unknown job {msg.job} from node {msg.node_rank}")
        elif type(msg).__name__ != "Heartbeat":
            self._reject(f"unexpected {type(msg).__name__} on a prefill server")

    def _reject(self, reason: str) -> None:
        logger.error("PD prefill: rejected a control message: %s", reason)
        self.pd.count_rejected("refused")

    def _on_register(self, msg: RegisterDecode) -> None:
        try:
            plan = self.pd.ranks.plan() if self.pd.ranks is not None else None
            peer = DecodePeer.from_registration(msg, self.pd.local_kv, self.pd.page_size,
                                                self.pd.meta.bytes_per_slot,
                                                plan.layout if plan is not None else None)
        except ValueError as e:
            reason = str(e)
            self._reject(f"registration of {msg.decode_engine_id}: {reason}")
            self.pd.send(msg.reply_endpoint, RegisterResult(decode_engine_id=msg.decode_engine_id,
                                                         accepted=False, reason=reason))
            return
        layout = peer.layout
        with self.pd.lock:
            self.pd.peers[msg.decode_engine_id] = peer
        if plan is not None:
            self.pd.ranks.paired(msg.decode_engine_id, peer, plan)
        logger.info("PD prefill: decode %s registered (session %s, %d pages)",
                    msg.decode_engine_id, msg.engine_session_id, layout.num_pages)
        self.pd.send(msg.reply_endpoint, RegisterResult(decode_engine_id=msg.decode_engine_id,
                                                     accepted=True))

    def _on_transfer_request(self, msg: TransferRequest) -> None:
        with self.pd.lock:
            peer = self.pd.peers.get(msg.decode_engine_id)
        if peer is None:
            self._reject(f"TransferRequest for bootstrap_room {msg.bootstrap_room} from "
                         f"unregistered decode {msg.decode_engine_id!r}")
            return
        try:
            dst = validate_pages(np.asarray(msg.dst_pages, np.int64), peer.layout.num_pages,
                                 "dst_pages")
            if not 0 <= msg.dst_metadata_slot < peer.metadata_num_slots:
                raise ProtocolError(f"field 'dst_metadata_slot': {msg.dst_metadata_slot} outside "
                                    f"[0, {peer.metadata_num_slots})")
        except ProtocolError as e:
            reason = f"bad TransferRequest for bootstrap_room {msg.bootstrap_room}: {e}"
            self._reject(reason)
            self.pd.send(peer.reply_endpoint, TransferStatus(bootstrap_room=msg.bootstrap_room,
                                                          state=KVPoll.Failed, reason=reason))
            with self.pd.lock:
                r = self.pd.rooms.get(msg.bootstrap_room)
                if r is not None and r.peer_id is None:
                    r.report(BadDestination(reason))     # the prefill client hears of it too
                    r.notified = True
            self.pd.wake()
            return
        duplicate, refused = self._bind(msg, dst)
        if refused is not None:
            reason, status_code = refused
            self.pd.send(peer.reply_endpoint, TransferStatus(
                bootstrap_room=msg.bootstrap_room, state=KVPoll.Failed, reason=reason[:4000],
                status_code=status_code))
            return
        if duplicate:
            reason = (f"duplicate TransferRequest for bootstrap_room {msg.bootstrap_room} "
                      f"(the room already has a destination)")
            self._reject(reason)
            # Also to the room's own decode: it sends one page list per request and binds a
            # room to one request at a time, so this one is from a later request there.
            self.pd.send(peer.reply_endpoint, TransferStatus(
                bootstrap_room=msg.bootstrap_room, state=KVPoll.Failed, reason=reason,
                status_code=ROOM_CONFLICT_STATUS))
            return
        self.pd.wake()

    def _bind(self, msg: TransferRequest, dst: np.ndarray
              ) -> tuple[bool, tuple[str, int] | None]:
        """Give the room of a checked ``TransferRequest`` its destination, unless the room
        already has one (``duplicate``) or is refused: this server failed it, or it completed
        a transfer within the bootstrap timeout (``(reason, HTTP status or 0)``). Returns
        ``(duplicate, refused)``."""
        now = time.monotonic()
        with self.pd.lock:
            r = self.pd.rooms.get(msg.bootstrap_room)
            if r is None and msg.bootstrap_room in self.pd.completed_rooms:
                return False, (self.pd.completed_reason(msg.bootstrap_room), ROOM_CONFLICT_STATUS)
            if r is not None and r.state == KVPoll.Failed and r.jobs_inflight == 0:
                # This server already failed the room (refused its request, a prompt mismatch,
                # an abort): the decode hears why at once instead of waiting out a timeout.
                if r.peer_id is None:
                    r.peer_id, r.notified = msg.decode_engine_id, True
                return False, (r.fail_reason or "failed", r.status_code)
            if r is not None and (r.peer_id is not None or r.state == KVPoll.Failed):
                return True, None
            r = r or self.pd.rooms.setdefault(msg.bootstrap_room,
                                              PrefillRoom(msg.bootstrap_room, now, state_s=now))
            r.peer_id = msg.decode_engine_id
            r.dst_pages = dst
            r.dst_slot = msg.dst_metadata_slot
            r.decode_prefix_len = msg.decode_prefix_len
            r.prompt_len = msg.prompt_len
            r.prompt_digest = msg.prompt_digest
        return False, None

    def _on_abort(self, msg: Abort) -> None:
        with self.pd.lock:
            peer = self.pd.peers.get(msg.sender_id)
            r = self.pd.rooms.get(msg.bootstrap_room)
            if r is not None and r.peer_id == msg.sender_id:
                r.report(Aborted(f"aborted by the decode server: {msg.reason or 'no reason'}"))
                r.notified = True
        if peer is None:
            self._reject(f"Abort of bootstrap_room {msg.bootstrap_room} from unknown sender "
                         f"{msg.sender_id!r}")
            return
        # Acked after every job queued so far (the room's in-flight chunk included) is done.
        self.ack(msg.bootstrap_room, peer.reply_endpoint, self.pd.sender_id)
        self.pd.wake()
