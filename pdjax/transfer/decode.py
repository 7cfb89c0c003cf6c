"""The decode side of PD disaggregation (DESIGN.md §4).

A decode server reserves pages for a prompt, tells the prefill where to write them, waits for
the KV and the metadata row, then continues generation from the second token without ever
computing the prompt. One ``DecodeRoom`` per request:

    Bootstrapping --(prefill found and paired: GET /route, RegisterDecode -> accepted)-->
    WaitingForInput --(pages + metadata slot reserved, TransferRequest sent)-->
    Transferring --(prefill's Success status AND the metadata row holds our room and the digest
                    of our prompt)--> Success:
        the request joins the running batch with its first token (no prompt recompute)
    any state --(timeout, refused pairing, prefill Failed/Abort, lost heartbeat, client abort,
                 metadata room or prompt digest mismatch)--> Failed: the client gets an error

Safety rules (each one a bug SGLang once shipped; DESIGN.md §4):
* pages of a failed or aborted transfer never enter the prefix cache;
* when this side gives up on a transfer the prefill may still be writing (client abort,
  timeout, lost prefill, KV cache moved), the pages and the metadata slot are quarantined until
  the prefill's ``AbortAck`` or ``drain_timeout_s``; a prefill Failed/Abort comes after its last
  write, so those pages are freed at once;
* a metadata slot is zeroed before it is handed out again (``MetadataBuffers``);
* a failed prefill is not failed forever: its peer entry is dropped, and the next request
  bootstraps again (a restarted prefill has a new ZMQ port);
* the page list carries the prompt's length and digest, and the metadata row must carry the
  same digest back: a room reused by another prompt never commits foreign KV.

Admission is the scheduler's, the one path every request takes (DESIGN.md §4): a decode
request waits in the scheduler's queue; ``get_num_new_matched_tokens`` answers "not yet" while
its room pairs (or no metadata slot is free), then "the rest of the prompt"; the scheduler
allocates the pages (keeping ``num_reserved_decode_tokens`` free, SGLang's
``pop_preallocated``, simplified) and hands them over in ``update_state_after_alloc``, which
sends the page list. The worker reports the KV in with the prefill's first token (the
scheduler's ``finished_recving`` + ``first_tokens``) or the room's failure
(``failed_recving``); ``request_finished`` answers whether a failed or aborted room's pages
stay held (quarantined) until the prefill's ``AbortAck`` or ``drain_timeout_s``. A request that
does not fit waits in the queue and fails only by ``waiting_timeout_s``.

Over several hosts (``--nnodes > 1``, DESIGN.md §6) this is node 0: it pairs only once every
other node reported its KV shards (``transfer/decode_ranks.py``, ``DecodeRanks``), and registers them
all; the prefill writes each node's shards itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdjax.distributed import join as join_cluster
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.pd.lifecycle import (Aborted, CacheMoved, KVPoll, MetadataGate, PeerLost,
                                PeerState, RoomConflict, RoomFailure, Timeout, WriteFailed)
from pdjax.pd.protocol import Abort, AbortAck, Message, TransferRequest
from pdjax.pd.rooms import DecodeRoom, PrefillPeer
from pdjax.pd.wire import prompt_digest
from pdjax.request import Request
from pdjax.sched.kv_connector import FirstToken, RecvFailure
from pdjax.transfer.decode_ranks import DecodeRanks
from pdjax.transfer.decode_worker import (AbortAcked, DecodeTransferWorker, PeerFailed,
                                          PeerReady, StatusArrived)
from pdjax.transfer.engine import FAKE_BOOTSTRAP_HOST
from pdjax.transfer.pd_connector import PDConnector, check_room

logger = logging.getLogger(__name__)


class DecodeConnector(PDConnector):
    """``--role decode``: pairing with prefills, the page lists, the metadata gate, failures.

    The scheduler's ``KVConnector``: ``get_num_new_matched_tokens``,
    ``update_state_after_alloc``, ``request_finished``. ``EngineRole``
    (``pdjax/engine_roles.py``): ``add_request``, ``poll``, ``after_step``, ``abort``,
    ``has_work``, ``load``, ``debug_state``, ``close``.
    """

    role = "decode"

    def __init__(self, host, parts):
        super().__init__(host, parts)
        self.rooms: dict[str, DecodeRoom] = {}          # by rid, arrival order
        self.room_owner: dict[int, str] = {}            # room -> rid, until the request ends
        self.peers: dict[tuple[str, int], PrefillPeer] = {}
        # rid -> (drain deadline, metadata slot, room, pages): a failed room's request, held
        # by the scheduler, whose pages a late write may still hit
        self.quarantine: dict[str, tuple[float, int | None, int, int]] = {}
        self.num_quarantine_released_by_ack = 0
        self.num_quarantine_released_by_timeout = 0
        self._acked: set[int] = set()        # rooms whose abort the prefill acknowledged
        self.num_abort_acks = 0
        # Multi-host (DESIGN.md §6): the other nodes report their sessions and KV shards here.
        self.ranks = DecodeRanks(join_cluster(self.args)) if self.args.nnodes > 1 else None
        if self.ranks is not None:
            self.ranks.attach(self.local_kv)
        # The worker handles what the channel receives: it exists before the other nodes are
        # told this endpoint (a DecodeRankInfo that came first was lost, and the decode waited
        # for it until its clients timed out).
        self.worker = DecodeTransferWorker(
            channel=self.channel, local_kv=self.local_kv, meta=self.meta,
            transfer_engine=self.transfer_engine, ranks=self.ranks, page_size=self.page_size,
            bootstrap_timeout_s=self.args.bootstrap_timeout_s,
            heartbeat_interval_s=self.args.heartbeat_interval_s, wake=self.wake,
            on_reject=self.count_rejected)
        self.start_channel()
        if self.ranks is not None:
            self.ranks.announce(self.channel.endpoint)

    # ------------------------------------------------------------------ requests
    def add_request(self, g: GenerateRequest, req: Request) -> None:
        """Open a room for a PD request; the request then waits in the scheduler's queue until
        the room is paired (``get_num_new_matched_tokens``). Raises
        ``ValueError`` for missing/bad bootstrap fields or a prompt over the context length,
        ``RoomConflict`` (HTTP 409) for a room another request holds here."""
        fake = g.bootstrap_host == FAKE_BOOTSTRAP_HOST
        room = None
        if not fake:
            room = check_room(g.bootstrap_room, self.role)
            if not isinstance(g.bootstrap_host, str) or not g.bootstrap_host:
                raise ValueError("bootstrap_host: required on a decode server (the prefill "
                                 "server's host)")
        self._check_new_request(req, self.rooms)
        now = time.monotonic()
        peer_key = None
        if room is not None:
            if room in self.room_owner:
                raise RoomConflict(f"bootstrap_room {room} is already in use on this "
                                   f"decode server (duplicate room)")
            self.room_owner[room] = req.rid
            port = g.bootstrap_port or self.args.disaggregation_bootstrap_port
            peer_key = (g.bootstrap_host, int(port))
            if peer_key not in self.peers:
                self.peers[peer_key] = PrefillPeer(peer_key[0], peer_key[1],
                                                   self.worker.pair(peer_key))
        self.rooms[req.rid] = DecodeRoom(room, req, peer_key, now, state_s=now,
                                         digest=b"" if fake else prompt_digest(req.prompt_ids))
        self.wake()

    def abort(self, rid: str, message: str) -> GenerateOutput | None:
        """Client abort (engine thread): always the scheduler's (None). A request whose room
        is open ends there (``request_finished``); one that runs gives its room back here."""
        if rid not in self.rooms:
            self._unbind(rid)
        return None

    def _unbind(self, rid: str) -> None:
        """``rid``'s request ended: its ``bootstrap_room`` may be used again."""
        for room, owner in list(self.room_owner.items()):
            if owner == rid:
                del self.room_owner[room]

    # ------------------------------------------------------------------ engine thread
    def poll(self) -> list[GenerateOutput]:
        """Advance rooms in arrival order: pairing, the prefill's status, the metadata gate,
        failures and timeouts; release quarantined pages. What it concludes reaches the
        scheduler through the worker (``received`` / ``failed`` / ``released``); the engine
        answers the clients. Returns no outputs of its own."""
        now = self._begin_poll()
        self._apply_events()
        self._release_quarantine(now)
        for r in list(self.rooms.values()):
            if r.state == KVPoll.Failed:
                continue                      # the scheduler ends its request next
            peer = None if r.fake else self.peers.get(r.peer_key)
            if not r.fake and (peer is None or peer.state == PeerState.FAILED):
                failure = peer.failure if peer is not None else RoomFailure("prefill peer dropped")
                self._fail(r, failure, quarantine=r.state == KVPoll.Transferring)
            elif r.state == KVPoll.Bootstrapping:
                if r.fake or peer.state == PeerState.READY:
                    self._set_state(r, KVPoll.WaitingForInput, now)
                elif now - r.created_s > self.args.bootstrap_timeout_s:
                    self._fail(r, Timeout(f"bootstrap timeout: no pairing with the prefill "
                                          f"within {self.args.bootstrap_timeout_s:g} s"))
            elif r.state == KVPoll.WaitingForInput:
                if now - r.state_s > self.args.waiting_timeout_s:
                    self._fail(r, Timeout(f"waiting timeout: no KV pages free within "
                                          f"{self.args.waiting_timeout_s:g} s"))
            elif r.state == KVPoll.Transferring:
                if r.status == KVPoll.Success or r.fake:
                    self._hand_over(r, now)
                elif r.status == KVPoll.Failed:
                    self._fail(r, r.status_failure, status_code=r.status_code or None)
                elif now - r.state_s > self.args.transfer_timeout_s:
                    self._fail(r, Timeout(f"transfer timeout: no KV from the prefill "
                                          f"within {self.args.transfer_timeout_s:g} s"),
                               quarantine=True, send_abort=True)
        self._drop_failed_peers()
        self.update_gauges()
        return []

    def _drop_failed_peers(self) -> None:
        """Forget failed prefills no room uses: the next request bootstraps again (a restarted
        prefill has a new ZMQ port)."""
        used = {r.peer_key for r in self.rooms.values()}
        for key, p in list(self.peers.items()):
            if p.state == PeerState.FAILED and key not in used:
                del self.peers[key]
                self.worker.forget(p.engine_id)

    def _apply_events(self) -> None:
        """What the worker's threads saw since the last poll, in order (DESIGN.md §4): peers
        paired or lost, the prefill's status of a room, abort acks."""
        for ev in self.worker.events():
            if isinstance(ev, StatusArrived):
                self._on_status(ev)
                continue
            if isinstance(ev, AbortAcked):
                self._acked.add(ev.room)
                self.num_abort_acks += 1
                continue
            peer = self.peers.get(ev.key)
            if peer is None or peer.engine_id != ev.engine_id:
                continue                      # a peer dropped already: its rooms are gone
            if isinstance(ev, PeerReady) and peer.state == PeerState.CONNECTING:
                peer.endpoint = ev.endpoint
                peer.set_ready()
            elif isinstance(ev, PeerFailed) and peer.state != PeerState.FAILED:
                peer.fail(ev.failure)         # its rooms fail in this poll

    def _on_status(self, ev: StatusArrived) -> None:
        """Record the prefill's Success or Failed on its room (answering an Abort with an
        ``AbortAck``); a status for a room that is not waiting for one is refused, except when
        it crossed this side's own end of the room (a failure, or a success whose request the
        client then aborted)."""
        rid = self.room_owner.get(ev.room)
        r = self.rooms.get(rid) if rid is not None else None
        ok = r is not None and r.state == KVPoll.Transferring and r.status is None
        if ok:
            r.status, r.status_failure, r.status_code = ev.state, ev.failure, ev.status_code
        # A room that ended here (failed: a client abort, a timeout; or succeeded, its
        # request then aborted by the client on both sides) while the prefill's last word was
        # on its way: the messages crossed, nothing is wrong with either side.
        ended = None
        if r is None or r.state == KVPoll.Failed:
            ended = next((rec for rec in reversed(self.recent) if rec["room"] == ev.room), None)
        peer = None if r is None or r.fake else self.peers.get(r.peer_key)
        if peer is None and ended is not None and ended["peer"]:
            host, _, port = ended["peer"].rpartition(":")
            peer = self.peers.get((host, int(port)))
        if ev.ack_sender is not None and peer is not None and peer.endpoint:
            self.send(peer.endpoint, AbortAck(bootstrap_room=ev.room, sender_id=peer.engine_id))
        if ok:
            return
        if ended is not None:
            logger.info("PD decode: %s status for bootstrap_room %d, which ended here "
                        "already (%s): ignored", ev.state.name, ev.room, ended["state"])
            return
        self.worker.reject(f"{ev.state.name} status for bootstrap_room {ev.room}, which is not "
                           f"waiting for a transfer here")

    # ------------------------------------------------------------------ KVConnector
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int | None:
        """The rest of ``req``'s prompt once its room is paired and a metadata slot is free;
        None (not yet) before. Its KV arrives with the prefill's first token."""
        r = self.rooms.get(req.rid)
        if r is None:
            return 0
        if r.state != KVPoll.WaitingForInput or (not r.fake and self.meta.num_free == 0):
            return None
        return req.num_prompt_tokens - num_computed_tokens

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """The scheduler reserved ``req``'s pages: take a metadata slot and send the page list
        (the pages past the decode's own prefix hit) to the prefill."""
        r = self.rooms.get(req.rid)
        if r is None or r.state != KVPoll.WaitingForInput:
            return
        now = time.monotonic()
        # Pages a finish or abort just released may still be written by the step in flight
        # (overlapped scheduling): let it land before a transfer may write them.
        self.host.wait_for_device()
        r.slot = None if r.fake else self.meta.alloc()   # free: checked at the answer above
        r.decode_prefix_len = req.num_cached_tokens
        r.dst_pages = list(req.pages[req.num_cached_tokens // self.page_size:])
        r.sent_s = now
        self.metrics.on_bootstrap(now - r.created_s)
        self._set_state(r, KVPoll.Transferring, now)
        if r.fake:
            return
        peer = self.peers[r.peer_key]
        msg = TransferRequest(bootstrap_room=r.room, dst_pages=tuple(r.dst_pages),
                              dst_metadata_slot=r.slot, decode_prefix_len=r.decode_prefix_len,
                              decode_engine_id=peer.engine_id, prompt_len=req.num_prompt_tokens,
                              prompt_digest=r.digest)
        if not self.send(peer.endpoint, msg):
            # Nobody listens there any more (a restarted prefill has a new port): this room
            # fails now, and so does the peer, so the next request bootstraps again.
            failure = PeerLost(f"could not send the page list to {peer.endpoint} (the prefill "
                               f"went away or restarted)")
            self._fail(r, failure)
            if peer.state != PeerState.FAILED:
                peer.fail(failure)
                self.channel.drop_peer(peer.endpoint)

    def request_finished(self, req: Request) -> bool:
        """``req`` ended. A room still open (the client aborted, or the room failed) closes
        here: True keeps the pages held (quarantined) when the prefill may still write them,
        until its ``AbortAck`` or ``drain_timeout_s``; False otherwise."""
        r = self.rooms.pop(req.rid, None)
        if r is None:
            self._unbind(req.rid)
            return False
        if r.state != KVPoll.Failed:        # the client's abort (the scheduler's abort_request)
            in_flight = r.state == KVPoll.Transferring and not r.fake
            why = req.finish_reason.message if req.finish_reason is not None else "aborted"
            self._fail(r, Aborted(f"aborted by client: {why}"), quarantine=in_flight,
                       send_abort=in_flight, report=False)
        self._unbind(req.rid)
        self._drop_failed_peers()
        if r.quarantine:
            self.quarantine[req.rid] = (time.monotonic() + self.args.drain_timeout_s, r.slot,
                                        r.room, len(r.dst_pages))
            return True
        if r.slot is not None:
            self.meta.free(r.slot)
        return False

    # ------------------------------------------------------------------ engine thread
    def _hand_over(self, r: DecodeRoom, now: float) -> None:
        """The metadata gate; then the worker reports the KV in with the prefill's first token
        (the scheduler starts the request when it has a slot)."""
        req = r.req
        first = FirstToken(0)
        if not r.fake and self.transfer_engine.backend == "fake":
            # --disaggregation-transfer-backend fake moves no bytes (SGLang's fake transfer):
            # no metadata gate, and the "first token" is whatever the slot holds.
            first = FirstToken(self.meta.read(r.slot).output_token_id)
        elif not r.fake:
            got = self.meta.room(r.slot)
            if got != r.room:
                what = "was never written" if got == 0 else f"holds room {got}"
                self._fail(r, MetadataGate(
                    f"metadata gate: slot {r.slot} {what}, expected bootstrap_room {r.room} "
                    f"(metadata not ready or corrupt)"))
                return
            try:
                row = self.meta.read(r.slot)
            except ValueError as e:
                self._fail(r, MetadataGate(f"metadata row is corrupt: {e}"))
                return
            if row.prompt_digest != r.digest:
                self._fail(r, MetadataGate(
                    f"metadata gate: slot {r.slot} holds the KV of another prompt (digest "
                    f"mismatch for bootstrap_room {r.room})"))
                return
            token = row.output_token_id
            if not 0 <= token < self.host.model_cfg.vocab_size:
                self._fail(r, MetadataGate(f"metadata: first token {token} outside the "
                                           f"vocabulary"))
                return
            try:
                self.local_kv.stage_in(r.dst_pages, room=r.room)    # its own offers only
            except ValueError as e:      # a pull-based pool (jax) missing a page's rows
                self._fail(r, WriteFailed(f"KV not received: {e}"))
                return
            # What the request reused: the longer of the two prefix hits. Below the prefill's
            # hit no KV was computed, below the decode's none was computed for it here or
            # moved (DESIGN.md §4; the prefill's hit alone would report 0 of 9 tokens where
            # the decode reused 8).
            first = FirstToken(token, row.output_token_logprob,
                               tuple(zip(row.top_logprob_ids, row.top_logprob_vals)),
                               max(row.cached_tokens, r.decode_prefix_len))
        if r.slot is not None:
            self.meta.free(r.slot)
            r.slot = None
        self.worker.received(req.rid, first)
        self._set_state(r, KVPoll.Success, now)
        nbytes = len(r.dst_pages) * self.local_kv.bytes_per_page
        if not r.fake:
            self.metrics.on_chunk(nbytes, len(r.dst_pages), 0)
            self.metrics.on_success(nbytes, now - r.sent_s)
        rec = r.record()
        rec.update(bytes=nbytes, latency_s=now - r.sent_s)
        del self.rooms[req.rid]
        self.recent.append(rec)

    def _fail(self, r: DecodeRoom, failure: RoomFailure, quarantine: bool = False,
              send_abort: bool = False, status_code: int | None = None,
              report: bool = True) -> None:
        """Fail a room: an Abort to the prefill if ``send_abort``; ``quarantine``: its pages
        (if any were reserved) stay held until the prefill's ack or the drain timeout, as the
        prefill may still write them; never into the prefix cache. ``report``: the worker
        tells the scheduler, which ends the request with the error (HTTP ``status_code``,
        default 500) and asks ``request_finished``."""
        r.quarantine = quarantine and r.room is not None and r.state == KVPoll.Transferring
        self._set_state(r, KVPoll.Failed)
        r.failure = failure
        drop = getattr(self.local_kv, "drop_arrived", None)
        if drop is not None and r.dst_pages:       # pulled rows (jax) that will not be used
            drop(r.dst_pages)
        reason = str(failure)
        logger.warning("PD decode: bootstrap_room %s (rid %s) failed: %s", r.room, r.req.rid,
                       reason)
        self.metrics.on_failure(failure.label)
        peer = None if r.fake else self.peers.get(r.peer_key)
        if send_abort and peer is not None and peer.endpoint:
            self.send(peer.endpoint, Abort(bootstrap_room=r.room, sender_id=peer.engine_id,
                                           reason=reason[:4000]))
        self.recent.append(r.record())
        if report:
            self.worker.failed(r.req.rid, RecvFailure(
                f"PD transfer failed (bootstrap_room {r.room}): {reason}", status_code))

    def _release_quarantine(self, now: float) -> None:
        if not self.quarantine:
            return
        acked, self._acked = self._acked, set()
        for rid, (deadline, slot, room, _) in list(self.quarantine.items()):
            by_ack = room in acked
            if not by_ack and now < deadline:
                continue
            del self.quarantine[rid]
            self.worker.released(rid)          # the scheduler gives the held pages back
            if slot is not None:
                self.meta.free(slot)
            if by_ack:
                self.num_quarantine_released_by_ack += 1
            else:
                self.num_quarantine_released_by_timeout += 1
                logger.warning("PD decode: drain timeout: reusing the pages of bootstrap_room %d "
                               "without an abort ack", room)

    def after_step(self, batch, outputs: list[GenerateOutput]) -> list[GenerateOutput]:
        """After a step (``batch`` None: nothing ran, but requests may have finished): re-check
        the KV addresses (a move fails the transfers in flight and re-registers with every
        prefill) and forget rooms of finished requests. A multi-host decode's other nodes
        re-check theirs after each forward and report a move (``DecodeRanks``): the same."""
        moved = self.local_kv.check_addresses()
        if self.ranks is not None:
            if batch is not None:
                self.ranks.check()
            moved = self.ranks.take_moved() or moved
        if moved:
            moving = [r for r in self.rooms.values()
                      if r.state == KVPoll.Transferring and not r.fake]
            peers = [p for p in self.peers.values() if p.state == PeerState.READY]
            for r in moving:
                self._fail(r, CacheMoved("the decode KV cache moved after a donated step"),
                           quarantine=True, send_abort=True)
            for p in peers:
                try:
                    self.send(p.endpoint, self.worker.register_msg(p.engine_id))
                except ValueError as e:      # a node's buffers changed shape: cannot happen
                    logger.error("PD decode: cannot register again with %s: %s", p.endpoint, e)
        return outputs

    def _on_message(self, msg: Message) -> None:
        self.worker.on_message(msg)         # the receiver thread

    @property
    def num_quarantined_pages(self) -> int:
        """Pages of failed rooms a late write may still hit (held by the scheduler)."""
        return sum(n for _, _, _, n in self.quarantine.values())

    # ------------------------------------------------------------------ introspection
    def num_live_rooms(self) -> int:
        return len(self.rooms) + len(self.quarantine)

    def queue_sizes(self) -> dict[str, int]:
        return self.count_rooms({KVPoll.Bootstrapping: "bootstrap",
                                 KVPoll.WaitingForInput: "prealloc",
                                 KVPoll.Transferring: "transfer"})

    def load(self) -> dict[str, Any]:
        q = self.queue_sizes()
        return {"disaggregation_mode": "decode", "num_pd_rooms": len(self.rooms),
                "num_bound_rooms": len(self.room_owner),      # rooms held until a request ends
                "num_decode_prealloc_queue_reqs": q["bootstrap"] + q["prealloc"],
                "num_decode_transfer_queue_reqs": q["transfer"],
                "num_quarantined_pages": self.num_quarantined_pages,
                **self.baseline_load()}

    def debug_state(self) -> dict[str, Any]:
        state = self.base_state()
        state["rooms"] = [r.record() for r in self.rooms.values()]
        state["peers"] = [{"bootstrap": f"{p.host}:{p.port}", "state": p.state.value,
                           "reason": p.reason, "endpoint": p.endpoint,
                           "engine_id": p.engine_id} for p in self.peers.values()]
        if self.ranks is not None:
            state["nodes"] = self.ranks.state()
        state.update(num_quarantined_pages=self.num_quarantined_pages,
                     num_abort_acks=self.num_abort_acks,
                     num_quarantine_released_by_ack=self.num_quarantine_released_by_ack,
                     num_quarantine_released_by_timeout=self.num_quarantine_released_by_timeout)
        return state

    def close(self) -> None:
        self.worker.close()
        self.close_base()

