"""The prefill's transfer worker (DESIGN.md §4): one thread that writes each room's chunks
into the decode's pages (``kv_export.write_nodes``: contiguous runs x layer buffers x head
slices, in engine batches of at most ``max_batch`` copies), then its metadata row, and sends
the room's status, aborts and abort acks to the decode in the same queue, so that each is sent
only after the room's last write has finished (a decode that gets Failed, Abort or AbortAck
may reuse its pages at once).

``PrefillConnector.build_meta`` plans a step's chunks on the engine thread; ``start`` stages
their pages and queues them; the thread only records what happened on the room (under the
connector's lock) and wakes the engine; ``poll`` reports the requests whose pages may go back
(``finished_sending``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from pdjax.pd.lifecycle import KVPoll, RoomFailure, WriteFailed
from pdjax.pd.protocol import Abort, AbortAck, TransferStatus
from pdjax.pd.rooms import PrefillRoom
from pdjax.sched.kv_connector import KVConnectorOutput
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
