"""The prefill side of PD disaggregation (DESIGN.md §4).

A prefill server computes a prompt's KV and its first token, copies the KV page by page into
pages a decode server reserved, then the metadata row (first token, logprobs, room), and only
then releases its own pages. One ``PrefillRoom`` per ``bootstrap_room``:

    HTTP request --------.                       decode's TransferRequest (ZMQ) --.
                         v                                                         v
    Bootstrapping --(dst pages + slot known)--> WaitingForInput --(first chunk sent)-->
    Transferring --(last chunk + metadata written, status sent)--> Success
         any state --(timeout, bad destination, write error, abort either way)--> Failed

Rules kept here:
* nothing is written before the decode's page list arrives; the request is not even admitted
  (it waits in the scheduler's queue: ``get_num_new_matched_tokens`` answers "not yet");
* non-last chunks send full pages only (the scheduler ends them on page boundaries), the last
  chunk sends the rest plus the metadata row; pages the decode already holds
  (``decode_prefix_len``) are skipped;
* copies are contiguous runs x layer buffers x head slices (``kv_copies.build_copies``; head
  slices when the two sides have different TP sizes, planned and checked at registration),
  written by the worker's thread (``PrefillTransferWorker``) in engine batches of at most
  ``max_batch`` copies;
* the request's pages stay held (``request_finished`` returns True: ``Scheduler.held``) until
  Success or Failed and no chunk of the room is in flight (then the worker reports it in
  ``finished_sending``); the HTTP answer is held until then too, so a failed transfer reaches
  the prefill client as an error;
* every message to the decode about a room (status, abort, abort ack) goes through the same
  worker queue as its chunks, so it is sent only after the room's last write has finished:
  a decode that gets Failed, Abort or AbortAck may reuse its pages at once.

This module is the engine-thread half (the room table and its state machine, the scheduler's
``KVConnector``, the engine's ``EngineRole``); ``prefill_worker.py`` holds the threads. Pure
Python below the engine: it sees the engine as a ``RoleHost`` (``pdjax/engine_roles.py``); JAX
only through ``LocalKV``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pdjax.distributed import join as join_cluster
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.pd.bootstrap import BootstrapServer
from pdjax.pd.lifecycle import (ROOM_CONFLICT_STATUS, Aborted, BadDestination, CacheMoved,
                                KVPoll, PromptMismatch, Refused, RoomConflict, RoomFailure,
                                Timeout)
from pdjax.pd.protocol import Message, TransferRequest, TransferStatus
from pdjax.pd.rooms import CompletedRooms, PrefillRoom, prefer_failure
from pdjax.pd.wire import MAX_ROOM, prompt_digest
from pdjax.request import FinishReason, Request
from pdjax.transfer.engine import FAKE_BOOTSTRAP_HOST
from pdjax.transfer.prefill_ranks import PrefillRanks, rank_info
from pdjax.transfer.prefill_worker import (BadPageList, ChunkWritten, DecodeAborted, JobDone,
                                           PageListArrived, PrefillChunk,
                                           PrefillTransferWorker, RoomFailed)
from pdjax.transfer.pd_connector import PDConnector, check_room, error_output

logger = logging.getLogger(__name__)


class PrefillConnector(PDConnector):
    """``--role prefill``: bootstrap server, ZMQ control, room table; its transfer worker is
    ``self.worker`` (``PrefillTransferWorker``).

    ``KVConnector`` (``pdjax/sched/kv_connector.py``): ``request_finished`` holds the pages of
    every PD request until its room concludes (reported by the worker's ``finished_sending``);
    ``build_meta`` plans the chunks each step completed. ``EngineRole``
    (``pdjax/engine_roles.py``): ``add_request``, ``poll``, ``after_step``, ``abort``,
    ``has_work``, ``load``, ``debug_state``, ``close``.
    """

    role = "prefill"

    def __init__(self, host, parts):
        self.ranks: PrefillRanks | None = None
        super().__init__(host, parts)
        self.rooms: dict[int, PrefillRoom] = {}
        self.rooms_by_rid: dict[str, PrefillRoom] = {}
        self.held: set[str] = set()      # rids whose pages the scheduler holds for their room
        # Rooms whose transfer completed, for the bootstrap timeout: a reuse is a 409 at once.
        self.completed_rooms = CompletedRooms(self.args.bootstrap_timeout_s)
        self.bootstrap = BootstrapServer(self.args.host, self.args.disaggregation_bootstrap_port,
                                         secret=self.secret,
                                         on_unauthorized=lambda: self.count_rejected("bootstrap"))
        self.bootstrap_port = self.bootstrap.start()
        # Multi-host (DESIGN.md §6): every node registers its own shards; node 0 plans over all.
        self.ranks = (PrefillRanks(join_cluster(self.args), self.bootstrap, self.local_kv,
                                   self.channel.endpoint) if self.args.nnodes > 1 else None)
        self.worker = PrefillTransferWorker(
            channel=self.channel, local_kv=self.local_kv, meta=self.meta,
            transfer_engine=self.transfer_engine, ranks=self.ranks, page_size=self.page_size,
            transfer_timeout_s=self.args.transfer_timeout_s, sender_id=self.sender_id,
            wait_for_kv=host.wait_for_kv, wake=self.wake, on_reject=self.count_rejected)
        self.start_channel()
        # Only now can a decode find this server: its rank is published.
        self.bootstrap.add_rank(rank_info(self.args, 0, self.channel, self.local_kv,
                                          self.transfer_engine))
        logger.info("PD prefill: bootstrap server on port %d", self.bootstrap_port)

    # ------------------------------------------------------------------ requests
    def add_request(self, g: GenerateRequest, req: Request) -> None:
        """Open (or join) the room of a PD request; the request then waits in the scheduler's
        queue, where it waits, "not yet" admitted, until the decode's page list is
        here (``get_num_new_matched_tokens``); a warm-up request with the fake host 2.2.2.2
        has no room. Forces ``max_new_tokens = 1``. Raises ``ValueError`` for a missing or
        bad ``bootstrap_room``, ``RoomConflict`` (HTTP 409) for a room another request holds
        or that failed here."""
        # min_new_tokens >= 1 still holds back the first token's EOS (sampled here).
        sp = req.sampling_params
        req.sampling_params = dataclasses.replace(sp, max_new_tokens=1,
                                                  min_new_tokens=min(sp.min_new_tokens, 1))
        if g.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            return
        room = check_room(g.bootstrap_room, self.role)
        # Raised to the caller, whose ``on_rejected`` tells the decode.
        self._check_new_request(req, self.rooms_by_rid)
        now = time.monotonic()
        r = self.rooms.get(room)
        if r is not None and r.req is not None:
            raise RoomConflict(f"bootstrap_room {room} is already in use on this prefill "
                               f"server (duplicate room)")
        if room in self.completed_rooms:
            raise RoomConflict(self.completed_reason(room))
        if r is not None and r.state == KVPoll.Failed:
            # A client room that failed (e.g. a prompt mismatch) is not used again until its
            # tombstone expires; a refusal keeps its own status.
            cls = RoomConflict if r.status_code in (0, RoomConflict.status_code) else ValueError
            raise cls(f"bootstrap_room {room} already failed on this prefill "
                      f"server: {r.fail_reason}")
        r = r or self.rooms.setdefault(room, PrefillRoom(room, created_s=now, state_s=now))
        r.req = req
        r.created_s = now
        self.rooms_by_rid[req.rid] = r
        self.wake()

    def completed_reason(self, room: int) -> str:
        """Why a request or page list for ``room``, one of ``completed_rooms``, is refused."""
        return (f"bootstrap_room {room} was already used by a transfer that completed on this "
                f"prefill server (room reused?)")

    def reject_room(self, room: Any, message: str, status_code: int = 400) -> None:
        """This server refused the request for ``room`` (a bad field, a prompt over the context
        length): fail the room at once and tell its decode, whose client gets the same status
        instead of waiting out its transfer timeout. A room that belongs to
        another request (a duplicate) or already failed is left alone. Engine thread."""
        if isinstance(room, bool) or not isinstance(room, int) or not 1 <= room <= MAX_ROOM:
            return
        now = time.monotonic()
        r = self.rooms.get(room)
        if r is not None and (r.req is not None or r.state == KVPoll.Failed) \
                or room in self.completed_rooms:
            return
        r = r or self.rooms.setdefault(room, PrefillRoom(room, created_s=now, state_s=now))
        r.status_code = status_code if 400 <= status_code < 500 else 0
        self._fail(r, Refused(f"the prefill server refused the request: {message}"))
        self.wake()

    def abort(self, rid: str, message: str) -> GenerateOutput | None:
        """Client abort of a PD request (engine thread); None if ``rid`` is not one."""
        r = self.rooms_by_rid.get(rid)
        if r is None:
            return None
        self._fail(r, Aborted(f"aborted on the prefill server: {message}"), notify="abort")
        r.output_sent = True           # the client is gone; nothing more to say
        out = GenerateOutput(rid, [], finished=True, prompt_tokens=r.req.num_prompt_tokens,
                             finish_reason=FinishReason.abort(message))
        self._try_conclude(r)
        return out

    # ------------------------------------------------------------------ engine thread
    def poll(self) -> list[GenerateOutput]:
        """Advance every room: admit bootstrapped requests, apply worker/receiver events,
        enforce timeouts, conclude finished rooms. Returns outputs to push."""
        now = self._begin_poll()
        outputs: list[GenerateOutput] = []
        self.completed_rooms.expire(now)
        self._apply_events()
        for r in list(self.rooms.values()):
            if r.state != KVPoll.Failed:
                if r.done and r.state != KVPoll.Success:
                    self._set_state(r, KVPoll.Success, now)
                    self.metrics.on_success(r.bytes, now - r.first_send_s)
                elif r.state == KVPoll.Bootstrapping:
                    self._try_start(r, now)
                else:
                    self._check_timeouts(r, now)
            out = self._try_conclude(r)
            if out is not None:
                outputs.append(out)
        self.update_gauges()
        return outputs

    def _apply_events(self) -> None:
        """What the worker's threads saw since the last poll, in order (DESIGN.md §4). A room
        fails with the first failure reported, except that the decode's abort wins
        (``prefer_failure``)."""
        failed: dict[int, tuple[PrefillRoom, RoomFailure]] = {}

        def report(r: PrefillRoom, failure: RoomFailure) -> None:
            r.notified = True                  # told by the worker, or nobody to tell
            kept = failed.get(id(r), (r, None))[1]
            failed[id(r)] = (r, prefer_failure(kept, failure))

        for ev in self.worker.events():
            if isinstance(ev, ChunkWritten):
                r = ev.room
                r.bytes += ev.nbytes
                r.pages += len(ev.src)
                r.copies += ev.copies
                r.node_bytes = [a + b for a, b in zip(r.node_bytes or [0] * len(ev.node_bytes),
                                                      ev.node_bytes)]
                r.write_s += ev.write_s
                r.chunks.append({"src": ev.src, "dst": ev.dst, "copies": ev.copies,
                                 "last": ev.last, "write_s": ev.write_s})
                self.metrics.on_chunk(ev.nbytes, len(ev.src), ev.copies, ev.write_s)
                if ev.last:
                    r.done = r.notified = True      # the worker sent Success
            elif isinstance(ev, RoomFailed):
                report(ev.room, ev.failure)
            elif isinstance(ev, JobDone):
                ev.room.jobs_inflight -= 1
            elif isinstance(ev, PageListArrived):
                self._bind(ev.msg, ev.dst)
            elif isinstance(ev, BadPageList):
                r = self.rooms.get(ev.room)
                if r is not None and r.peer_id is None:
                    report(r, BadDestination(ev.reason))   # the prefill client hears of it
            elif isinstance(ev, DecodeAborted):
                r = self.rooms.get(ev.room)
                if r is not None and r.peer_id == ev.sender_id:
                    report(r, Aborted(f"aborted by the decode server: "
                                      f"{ev.reason or 'no reason'}"))
                    self.worker.cancel(ev.room)     # before the ack is queued
                peer = self.worker.peer(ev.sender_id)
                if peer is not None:
                    # After every job queued so far (the room's chunk in flight included).
                    self.worker.ack(ev.room, peer.reply_endpoint)
        for r, failure in failed.values():
            self._fail(r, failure, notify=None)

    def _bind(self, msg: TransferRequest, dst) -> None:
        """Give the room of a checked page list its destination; the decode hears at once
        when the room already has one (409), this server failed it, or it completed a transfer
        within the bootstrap timeout."""
        peer = self.worker.peer(msg.decode_engine_id)
        r = self.rooms.get(msg.bootstrap_room)
        refused = None
        if r is None and msg.bootstrap_room in self.completed_rooms:
            refused = (self.completed_reason(msg.bootstrap_room), ROOM_CONFLICT_STATUS)
        elif r is not None and r.state == KVPoll.Failed and r.jobs_inflight == 0:
            # This server already failed the room (refused its request, a prompt mismatch, an
            # abort): the decode hears why at once instead of waiting out a timeout.
            if r.peer_id is None:
                r.peer_id, r.notified = msg.decode_engine_id, True
            refused = (r.fail_reason or "failed", r.status_code)
        elif r is not None and (r.peer_id is not None or r.state == KVPoll.Failed):
            reason = (f"duplicate TransferRequest for bootstrap_room {msg.bootstrap_room} "
                      f"(the room already has a destination)")
            self.worker.reject(reason)
            # Also to the room's own decode: it sends one page list per request and binds a
            # room to one request at a time, so this one is from a later request there.
            refused = (reason, ROOM_CONFLICT_STATUS)
        if refused is not None:
            if peer is not None:
                self.send(peer.reply_endpoint, TransferStatus(
                    bootstrap_room=msg.bootstrap_room, state=KVPoll.Failed,
                    reason=refused[0][:4000], status_code=refused[1]))
            return
        now = time.monotonic()
        r = r or self.rooms.setdefault(msg.bootstrap_room,
                                       PrefillRoom(msg.bootstrap_room, now, state_s=now))
        r.peer_id = msg.decode_engine_id
        r.dst_pages = dst
        r.dst_slot = msg.dst_metadata_slot
        r.decode_prefix_len = msg.decode_prefix_len
        r.prompt_len = msg.prompt_len
        r.prompt_digest = msg.prompt_digest

    def _try_start(self, r: PrefillRoom, now: float) -> None:
        """Bootstrapping -> WaitingForInput once both the request and its destination are here."""
        timeout = self.args.bootstrap_timeout_s
        if r.req is None or r.dst_pages is None:
            if now - r.created_s > timeout:
                what = "request" if r.req is None else "page list from the decode server"
                self._fail(r, Timeout(f"bootstrap timeout: no {what} for bootstrap_room "
                                      f"{r.room} within {timeout:g} s"))
            return
        req = r.req
        if r.prompt_len != req.num_prompt_tokens or r.prompt_digest != prompt_digest(req.prompt_ids):
            # The room is the only key the two halves share: a room reused by another prompt
            # must not write its KV into pages reserved for the first.
            self._fail(r, PromptMismatch(
                f"bootstrap_room {r.room} is bound to another prompt: the decode reserved "
                f"pages for {r.prompt_len} tokens with another digest, this request has "
                f"{req.num_prompt_tokens} tokens (room reused?)"))
            return
        ps = self.page_size
        n_prompt_pages = -(-req.num_prompt_tokens // ps)
        if r.decode_prefix_len % ps or r.decode_prefix_len > req.num_prompt_tokens:
            self._fail(r, RoomFailure(
                f"decode_prefix_len {r.decode_prefix_len} is not a multiple of page_size {ps} "
                f"within the prompt of {req.num_prompt_tokens} tokens"))
            return
        r.next_page = r.decode_prefix_len // ps
        if len(r.dst_pages) != n_prompt_pages - r.next_page:
            self._fail(r, BadDestination(
                f"dst_pages: {len(r.dst_pages)} pages for a prompt of {req.num_prompt_tokens} "
                f"tokens needing {n_prompt_pages - r.next_page} (page_size {ps}, "
                f"decode_prefix_len {r.decode_prefix_len})"))
            return
        slot = self.meta.alloc()
        if slot is None:
            return                       # all metadata slots busy: try again next poll
        r.src_slot = slot
        self.metrics.on_bootstrap(now - r.created_s)
        self._set_state(r, KVPoll.WaitingForInput, now)

    def _check_timeouts(self, r: PrefillRoom, now: float) -> None:
        if r.state == KVPoll.WaitingForInput and now - r.state_s > self.args.waiting_timeout_s:
            self._fail(r, Timeout(f"waiting timeout: bootstrap_room {r.room} not computed "
                                  f"within {self.args.waiting_timeout_s:g} s"))
        elif r.state == KVPoll.Transferring and now - r.state_s > self.args.transfer_timeout_s:
            self._fail(r, Timeout(f"transfer timeout: bootstrap_room {r.room} not transferred "
                                  f"within {self.args.transfer_timeout_s:g} s"))

    def _fail(self, r: PrefillRoom, failure: RoomFailure, notify: str | None = "status") -> None:
        """Mark ``r`` Failed (engine thread). ``notify``: tell the decode with a Failed status
        or an Abort (through the worker queue, after the room's chunks), or not (None: the
        decode already knows)."""
        if r.state == KVPoll.Failed:
            return
        self._set_state(r, KVPoll.Failed)
        self.worker.cancel(r.room)           # its chunks still queued are not written
        r.failure = failure
        if failure.status_code is not None and not r.status_code:
            r.status_code = failure.status_code   # the client's mistake: a 4xx on both sides
        reason = str(failure)
        logger.warning("PD prefill: bootstrap_room %d failed: %s", r.room, reason)
        self.metrics.on_failure(failure.label)
        if r.req is not None:
            self.host.abort_request(r.req.rid, reason)     # nothing if it is not scheduled
        if notify is not None and r.peer_id is not None and not r.notified:
            r.notified = True
            self.worker.notify(r, notify)

    def _try_conclude(self, r: PrefillRoom) -> GenerateOutput | None:
        """Release pages and answer the client once the room is final and idle."""
        if r.state not in (KVPoll.Success, KVPoll.Failed) or r.jobs_inflight:
            return None
        req = r.req
        if req is not None and req.rid in self.held:
            self.held.discard(req.rid)
            self.worker.sent(req.rid)      # the scheduler gives its pages back
        if r.src_slot is not None:
            self.meta.free(r.src_slot)
            r.src_slot = None
        out = None
        if req is not None and not r.output_sent:
            r.output_sent = True
            if r.state == KVPoll.Success and r.output is not None:
                out = r.output
            else:
                out = error_output(req.rid, f"PD transfer failed (bootstrap_room {r.room}): "
                                            f"{r.fail_reason}", req.num_prompt_tokens,
                                   r.status_code or None)
        if self.rooms.get(r.room) is r:
            if r.state == KVPoll.Failed and req is None:
                # Keep a tombstone so a late request or page list for this room fails at once
                # (with this reason) instead of starting the room again.
                if time.monotonic() - r.state_s < self.args.bootstrap_timeout_s:
                    return out
                del self.rooms[r.room]
                self.worker.release(r.room)
            elif r.state == KVPoll.Failed:
                self.rooms[r.room] = r.tombstone()
            else:
                del self.rooms[r.room]
                self.worker.release(r.room)
                self.completed_rooms.add(r.room, time.monotonic())
        if req is not None:
            self.rooms_by_rid.pop(req.rid, None)
        self.recent.append(r.record())
        return out

    # ------------------------------------------------------------------ KVConnector
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int | None:
        """0 (the prompt is computed here) once the request's room has the decode's page list
        and a metadata row (WaitingForInput); None (not yet) before: nothing is computed that
        could not be sent. A warm-up request (no room): 0."""
        r = self.rooms_by_rid.get(req.rid)
        if r is None or r.state == KVPoll.WaitingForInput:
            return 0
        return None

    def request_finished(self, req: Request) -> bool:
        """Hold the pages of a PD request until its room concludes (DESIGN.md §4 step 7); a
        request that never got pages (ended in the queue) holds nothing."""
        keep = req.rid in self.rooms_by_rid and bool(req.pages)
        if keep:
            self.held.add(req.rid)
        return keep

    def build_meta(self, batch) -> list[PrefillChunk] | None:
        """After a step (``batch`` None: no forward ran): re-check the KV addresses, then the
        pages each PD row completed -- full pages for a chunk, all the rest plus the metadata
        row (written here) once the first token is sampled. None when there is nothing."""
        if self.local_kv.check_addresses():
            moving = [r for r in self.rooms.values()
                      if r.state == KVPoll.Transferring or r.jobs_inflight]
            for r in moving:
                self._fail(r, CacheMoved("the prefill KV cache moved after a donated step; "
                                         "transfers in flight were failed"))
        chunks = []
        for row in batch.rows if batch is not None else ():
            r = self.rooms_by_rid.get(row.req.rid)
            if r is None or r.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                continue
            req = row.req
            last = req.is_finished
            end = -(-req.num_prompt_tokens // self.page_size) if last else \
                min(req.num_computed_tokens, req.num_prompt_tokens) // self.page_size
            if end <= r.next_page and not last:
                continue
            chunks.append(self._plan_chunk(r, end, last))
        return chunks or None

    def _plan_chunk(self, r: PrefillRoom, end: int, last: bool) -> PrefillChunk:
        req = r.req
        start = r.next_page
        src = list(req.pages[start:end])
        first_dst = start - r.decode_prefix_len // self.page_size
        dst = r.dst_pages[first_dst:first_dst + len(src)].tolist()
        if last:
            lp, ids, vals = 0.0, [], []
            if req.return_logprob and req.output_logprobs:
                lp = req.output_logprobs[0]
                tops = (req.output_top_logprobs[0] or [])[:self.meta.max_top_logprobs]
                ids, vals = [t for t, _ in tops], [v for _, v in tops]
            self.meta.write(r.src_slot, r.room, req.output_ids[0],
                            req.num_cached_tokens_reported, lp, ids, vals,
                            prompt_digest=r.prompt_digest)
        r.next_page = end
        r.last_queued = last
        if r.state == KVPoll.WaitingForInput:
            r.first_send_s = time.monotonic()
            self._set_state(r, KVPoll.Transferring)
        return PrefillChunk(r, src, dst, last)

    def after_step(self, batch, outputs: list[GenerateOutput]) -> list[GenerateOutput]:
        """After the step's chunks were handed to the worker: hold the final output of each PD
        request whose last chunk is queued until its transfer ends (``_try_conclude``)."""
        kept = []
        for out in outputs:
            r = self.rooms_by_rid.get(out.rid) if out.finished else None
            if r is not None and r.last_queued and r.output is None and not r.output_sent:
                r.output = out
            else:
                kept.append(out)
        return kept

    def has_work(self) -> bool:
        return self.worker.has_work() or super().has_work()

    @property
    def sender_id(self) -> str:
        return f"prefill@{self.channel.endpoint}"

    def _on_message(self, msg: Message) -> None:
        self.worker.on_message(msg)         # the receiver thread

    # ------------------------------------------------------------------ introspection
    def num_live_rooms(self) -> int:
        return len(self.rooms)

    def queue_sizes(self) -> dict[str, int]:
        count = self.count_rooms({KVPoll.Bootstrapping: "bootstrap",
                                  KVPoll.WaitingForInput: "waiting",
                                  KVPoll.Transferring: "inflight"})
        count["held"] = len(self.held)
        return count

    def load(self) -> dict[str, Any]:
        live = sum(r.state != KVPoll.Failed for r in self.rooms.values())
        return {"disaggregation_mode": "prefill", "num_pd_rooms": live,
                "num_held_reqs": len(self.held), **self.baseline_load(),
                "num_prefill_bootstrap_queue_reqs": self.queue_sizes()["bootstrap"]}

    def debug_state(self) -> dict[str, Any]:
        state = self.base_state()
        state["rooms"] = [r.record() for r in self.rooms.values()]
        state["num_completed_rooms"] = len(self.completed_rooms)
        state["peers"] = self.worker.peer_ids()
        state["bootstrap_port"] = self.bootstrap_port
        return state

    def close(self) -> None:
        self.worker.close()
        self.bootstrap.stop()
        self.close_base()

