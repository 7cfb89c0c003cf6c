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

Admission (SGLang's ``pop_preallocated``, simplified): a request is preallocated when the pool
can free its prompt pages minus the decode-side prefix hit, plus
``ceil(min(num_reserved_decode_tokens, tokens still to generate) / page_size)`` pages for it
and for every running or preallocated request. Requests are preallocated in arrival order. A request that does not fit waits (pages held by
running requests or quarantined come back) and fails only by ``waiting_timeout_s``.

Over several hosts (``--nnodes > 1``, DESIGN.md §6) this is node 0: it pairs only once every
other node reported its KV shards (``transfer/decode_ranks.py``, ``DecodeRanks``), and registers them
all; the prefill writes each node's shards itself.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from pdjax.distributed import join as join_cluster
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.pd.lifecycle import (Aborted, CacheMoved, DoesNotFit, KVPoll, MetadataGate,
                                PeerState, RoomConflict, RoomFailure, Timeout)
from pdjax.pd.protocol import Abort, AbortAck, Message, TransferRequest
from pdjax.pd.rooms import DecodeRoom, PrefillPeer
from pdjax.pd.wire import prompt_digest
from pdjax.request import FinishReason, Request
from pdjax.transfer.decode_ranks import DecodeRanks
from pdjax.transfer.decode_worker import (AbortAcked, DecodeTransferWorker, PeerFailed,
                                          PeerReady, StatusArrived)
from pdjax.transfer.engine import FAKE_BOOTSTRAP_HOST
from pdjax.transfer.role import RoleManager, check_room, error_output

logger = logging.getLogger(__name__)


def decode_reserve_pages(s, req: Request, num_reserved_decode_tokens: int) -> int:
    """Pages the scheduler ``s`` must keep free for decode tokens when ``req`` is admitted: for
    ``req`` and every running or reserved request, ``ceil(min(num_reserved_decode_tokens,
    tokens it may still generate) / page_size)`` (SGLang's ``pop_preallocated``, simplified; a
    request that has no output yet counts its first token as generated)."""
    ps = s.page_size

    def need(r: Request) -> int:
        mnt = r.sampling_params.max_new_tokens
        left = (num_reserved_decode_tokens if mnt is None else
                max(0, min(num_reserved_decode_tokens, mnt - max(1, len(r.output_ids)))))
        return -(-left // ps)

    return need(req) + sum(map(need, s.running)) + sum(map(need, s.waiting_remote.values()))


class DecodeConnector(RoleManager):
    """``--role decode``: pairing with prefills, preallocation, the metadata gate, commits.

    ``EngineRole`` (``pdjax/engine_roles.py``): ``add_request``, ``poll``, ``after_step``,
    ``abort``, ``has_work``, ``load``, ``debug_state``, ``close``.
    """

    role = "decode"

    def __init__(self, host, parts):
        super().__init__(host, parts)
        self.rooms: dict[str, DecodeRoom] = {}          # by rid, arrival order
        self.room_owner: dict[int, str] = {}            # room -> rid, until the request ends
        self.peers: dict[tuple[str, int], PrefillPeer] = {}
        # (room, seq) -> (drain deadline, metadata slot, pages): where a late write may land
        self.quarantine: dict[tuple[int, int], tuple[float, int | None, list[int]]] = {}
        self._quarantine_seq = itertools.count()
        self.num_quarantine_released_by_ack = 0
        self.num_quarantine_released_by_timeout = 0
        self._acked: set[int] = set()        # rooms whose abort the prefill acknowledged
        self.num_abort_acks = 0
        # Multi-host (DESIGN.md §6): the other nodes report their sessions and KV shards here.
        self.ranks = DecodeRanks(join_cluster(self.args)) if self.args.nnodes > 1 else None
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
    def add_request(self, g: GenerateRequest, req: Request) -> bool:
        """Queue a PD request (always True: the decode owns every request until its KV is
        in). Raises ``ValueError`` for missing/bad bootstrap fields or a prompt over the context
        length, ``RoomConflict`` (HTTP 409) for a room another request holds here."""
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
        return True

    def abort(self, rid: str, message: str) -> GenerateOutput | None:
        """Client abort (engine thread). A request still waiting for its KV fails here (an
        Abort goes to the prefill if it may be writing); a running one is left to the
        scheduler (returns None)."""
        r = self.rooms.get(rid)
        if r is None:
            for room, owner in list(self.room_owner.items()):
                if owner == rid:
                    del self.room_owner[room]
            return None
        in_flight = r.state == KVPoll.Transferring and not r.fake
        self._fail(r, Aborted(f"aborted by client: {message}"), quarantine=in_flight,
                   send_abort=in_flight, answer=False)
        return GenerateOutput(rid, [], finished=True, prompt_tokens=r.req.num_prompt_tokens,
                              finish_reason=FinishReason.abort(message))

    # ------------------------------------------------------------------ engine thread
    def poll(self) -> list[GenerateOutput]:
        """Advance rooms in arrival order: pairing, preallocation, commits, failures and
        timeouts; release quarantined pages. Returns outputs to push."""
        now = self._begin_poll()
        self._apply_events()
        outputs: list[GenerateOutput] = []
        self._release_quarantine(now)
        rooms = list(self.rooms.values())
        admit = True
        for r in rooms:
            peer = None if r.fake else self.peers.get(r.peer_key)
            if not r.fake and (peer is None or peer.state == PeerState.FAILED):
                failure = peer.failure if peer is not None else RoomFailure("prefill peer dropped")
                in_flight = r.state == KVPoll.Transferring
                out = self._fail(r, failure, quarantine=in_flight, send_abort=False)
            elif r.state == KVPoll.Bootstrapping:
                out = None
                if r.fake or peer.state == PeerState.READY:
                    self._set_state(r, KVPoll.WaitingForInput, now)
                elif now - r.created_s > self.args.bootstrap_timeout_s:
                    out = self._fail(r, Timeout(f"bootstrap timeout: no pairing with the prefill "
                                                f"within {self.args.bootstrap_timeout_s:g} s"))
            else:
                out = None
            if out is None and r.state == KVPoll.WaitingForInput:
                if admit:
                    admit, out = self._prealloc(r, peer, now)
                if r.state == KVPoll.WaitingForInput and \
                        now - r.state_s > self.args.waiting_timeout_s:
                    out = self._fail(r, Timeout(f"waiting timeout: no KV pages free within "
                                                f"{self.args.waiting_timeout_s:g} s"))
            if out is None and r.state == KVPoll.Transferring:
                status, failure = r.status, r.status_failure
                if status == KVPoll.Success or r.fake:
                    # The KV is in; the request joins the running batch when it has a row.
                    if len(self.scheduler.running) < self.args.max_running_requests:
                        out = self._commit(r, now)
                elif status == KVPoll.Failed:
                    out = self._fail(r, failure, status_code=r.status_code or None)
                elif now - r.state_s > self.args.transfer_timeout_s:
                    out = self._fail(r, Timeout(f"transfer timeout: no KV from the prefill "
                                                f"within {self.args.transfer_timeout_s:g} s"),
                                     quarantine=True, send_abort=True)
            if out is not None:
                outputs.append(out)
        used = {r.peer_key for r in self.rooms.values()}
        for key, p in list(self.peers.items()):
            if p.state == PeerState.FAILED and key not in used:
                del self.peers[key]          # the next request bootstraps again
                self.worker.forget(p.engine_id)
        self.update_gauges()
        return outputs

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
        it crossed this side's own failure of the room (a client abort)."""
        rid = self.room_owner.get(ev.room)
        r = self.rooms.get(rid) if rid is not None else None
        ok = r is not None and r.state == KVPoll.Transferring and r.status is None
        if ok:
            r.status, r.status_failure, r.status_code = ev.state, ev.failure, ev.status_code
        peer = None if r is None or r.fake else self.peers.get(r.peer_key)
        if ev.ack_sender is not None and peer is not None and peer.endpoint:
            self.send(peer.endpoint, AbortAck(bootstrap_room=ev.room, sender_id=peer.engine_id))
        if ok:
            return
        if r is None and any(rec["room"] == ev.room and rec["state"] == "Failed"
                             for rec in self.recent):
            # The room failed here (a client abort, a timeout) while the prefill's last word
            # was on its way: the messages crossed, nothing is wrong with either side.
            logger.info("PD decode: %s status for bootstrap_room %d, which failed here "
                        "already: ignored", ev.state.name, ev.room)
            return
        self.worker.reject(f"{ev.state.name} status for bootstrap_room {ev.room}, which is not "
                           f"waiting for a transfer here")

    def _prealloc(self, r: DecodeRoom, peer: PrefillPeer | None,
                  now: float) -> tuple[bool, GenerateOutput | None]:
        """Reserve pages and a slot, send the page list. Returns (keep admitting, output)."""
        s = self.scheduler
        req = r.req
        reserve = decode_reserve_pages(s, req, self.args.num_reserved_decode_tokens)
        if not s.reserve_remote(req, reserve):
            if s.running or s.waiting_remote:
                return False, None
            if not s.reserve_remote(req, 0):
                if self.quarantine:
                    # Pages a late write may still hit come back by ack or drain timeout: wait
                    # like any request that does not fit yet.
                    return False, None
                return False, self._fail(r, DoesNotFit(f"the prompt of {req.num_prompt_tokens} "
                                                       f"tokens does not fit the decode KV pool"))
        # Pages a finish or abort just released may still be written by the step in flight
        # (overlapped scheduling): let it land before a transfer may write them.
        self.host.wait_for_device()
        slot = None
        if not r.fake:
            slot = self.meta.alloc()
            if slot is None:
                s.drop_remote(req)
                return False, None
        r.slot = slot
        k = req.num_cached_tokens // self.page_size
        r.dst_pages = list(req.pages[k:])
        r.decode_prefix_len = req.num_cached_tokens
        r.sent_s = now
        self.metrics.on_bootstrap(now - r.created_s)
        self._set_state(r, KVPoll.Transferring, now)
        if r.fake:
            return True, None
        msg = TransferRequest(bootstrap_room=r.room, dst_pages=tuple(r.dst_pages),
                              dst_metadata_slot=slot, decode_prefix_len=r.decode_prefix_len,
                              decode_engine_id=peer.engine_id, prompt_len=req.num_prompt_tokens,
                              prompt_digest=r.digest)
        if not self.send(peer.endpoint, msg):
            return True, self._fail(r, RoomFailure(f"could not send the page list to "
                                                   f"{peer.endpoint}"))
        return True, None

    def _commit(self, r: DecodeRoom, now: float) -> GenerateOutput | None:
        """The metadata gate, then the prebuilt path into the running batch."""
        req = r.req
        token, lp, top = 0, None, None
        if not r.fake and self.transfer_engine.backend == "fake":
            # --disaggregation-transfer-backend fake moves no bytes (SGLang's fake transfer):
            # no metadata gate, and the "first token" is whatever the slot holds.
            token = self.meta.read(r.slot).output_token_id
            self.meta.free(r.slot)
            r.slot = None
        elif not r.fake:
            got = self.meta.room(r.slot)
            if got != r.room:
                what = "was never written" if got == 0 else f"holds room {got}"
                return self._fail(r, MetadataGate(
                    f"metadata gate: slot {r.slot} {what}, expected bootstrap_room {r.room} "
                    f"(metadata not ready or corrupt)"))
            try:
                row = self.meta.read(r.slot)
            except ValueError as e:
                return self._fail(r, MetadataGate(f"metadata row is corrupt: {e}"))
            if row.prompt_digest != r.digest:
                return self._fail(r, MetadataGate(
                    f"metadata gate: slot {r.slot} holds the KV of another prompt (digest "
                    f"mismatch for bootstrap_room {r.room})"))
            token = row.output_token_id
            if not 0 <= token < self.host.model_cfg.vocab_size:
                return self._fail(r, MetadataGate(f"metadata: first token {token} outside the "
                                                  f"vocabulary"))
            lp = row.output_token_logprob
            top = list(zip(row.top_logprob_ids, row.top_logprob_vals))[:req.top_logprobs_num]
            self.local_kv.stage_in(r.dst_pages)
            self.meta.free(r.slot)
            r.slot = None
            # What the request reused: the longer of the two prefix hits. Below the prefill's
            # hit no KV was computed, below the decode's none was computed for it here or
            # moved (DESIGN.md §4; the prefill's hit alone would report 0 of 9 tokens where
            # the decode reused 8).
            req.set_reported_cached_tokens(max(row.cached_tokens, r.decode_prefix_len))
        tokens, lps, tops = [token], [], []
        if req.sampling_params.max_new_tokens == 0:
            # Nothing to decode (colocated finishes such a request without a forward): the
            # prefill's first token is not the client's, and the pages go back at once.
            self.scheduler.drop_remote(req)
            req.finish(FinishReason.of_length(0))
            tokens = []
        else:
            self.scheduler.commit_remote(req, token)
            if req.return_logprob:
                lps, tops = [float(lp or 0.0)], [top or []]
                req.append_logprobs(lps[0], tops[0])
            reason = self.host.stop_check(req)
            if reason is None and req.num_tokens >= self.scheduler.max_request_tokens:
                reason = FinishReason.of_length(len(req.output_ids))
            if reason is not None:
                self.scheduler.finish_request(req, reason)
        self._set_state(r, KVPoll.Success, now)
        nbytes = len(r.dst_pages) * self.local_kv.bytes_per_page
        if not r.fake:
            self.metrics.on_chunk(nbytes, len(r.dst_pages), 0)
            self.metrics.on_success(nbytes, now - r.sent_s)
        rec = r.record()
        rec.update(bytes=nbytes, latency_s=now - r.sent_s)
        del self.rooms[req.rid]
        if req.is_finished and r.room is not None:
            self.room_owner.pop(r.room, None)
        self.recent.append(rec)
        return self.host.make_output(req, tokens, lps, tops)

    def _fail(self, r: DecodeRoom, failure: RoomFailure, quarantine: bool = False,
              send_abort: bool = False, answer: bool = True,
              status_code: int | None = None) -> GenerateOutput | None:
        """Fail a room: pages back (never into the prefix cache; quarantined when the prefill
        may still write), the client answered with an error (HTTP ``status_code``, default
        500) unless ``answer`` is False."""
        self._set_state(r, KVPoll.Failed)
        r.failure = failure
        reason = str(failure)
        logger.warning("PD decode: bootstrap_room %s (rid %s) failed: %s", r.room, r.req.rid,
                       reason)
        self.metrics.on_failure(failure.label)
        peer = None if r.fake else self.peers.get(r.peer_key)
        if send_abort and peer is not None and peer.endpoint:
            self.send(peer.endpoint, Abort(bootstrap_room=r.room, sender_id=peer.engine_id,
                                           reason=reason[:4000]))
        req = r.req
        if req.rid in self.scheduler.waiting_remote:
            if quarantine and r.room is not None:
                key = (r.room, next(self._quarantine_seq))
                own = self.scheduler.drop_remote(req, free=False)
                self.quarantine[key] = (time.monotonic() + self.args.drain_timeout_s, r.slot,
                                        own)
                r.slot = None
            else:
                self.scheduler.drop_remote(req)
        if r.slot is not None:
            self.meta.free(r.slot)
            r.slot = None
        self.rooms.pop(req.rid, None)
        if r.room is not None and self.room_owner.get(r.room) == req.rid:
            del self.room_owner[r.room]
        self.recent.append(r.record())
        if not answer:
            return None
        return error_output(req.rid, f"PD transfer failed (bootstrap_room {r.room}): {reason}",
                            req.num_prompt_tokens, status_code)

    def _release_quarantine(self, now: float) -> None:
        if not self.quarantine:
            return
        acked, self._acked = self._acked, set()
        for key, (deadline, slot, pages) in list(self.quarantine.items()):
            by_ack = key[0] in acked
            if not by_ack and now < deadline:
                continue
            del self.quarantine[key]
            self.scheduler.free_pages(pages)
            if slot is not None:
                self.meta.free(slot)
            if by_ack:
                self.num_quarantine_released_by_ack += 1
            else:
                self.num_quarantine_released_by_timeout += 1
                logger.warning("PD decode: drain timeout: reusing the pages of bootstrap_room %d "
                               "without an abort ack", key[0])

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
                out = self._fail(r, CacheMoved("the decode KV cache moved after a donated step"),
                                 quarantine=True, send_abort=True)
                if out is not None:
                    outputs.append(out)
            for p in peers:
                try:
                    self.send(p.endpoint, self.worker.register_msg(p.engine_id))
                except ValueError as e:      # a node's buffers changed shape: cannot happen
                    logger.error("PD decode: cannot register again with %s: %s", p.endpoint, e)
        done = [o.rid for o in outputs if o.finished]
        if done and self.room_owner:
            finished = set(done)
            for room, rid in list(self.room_owner.items()):
                if rid in finished and rid not in self.rooms:
                    del self.room_owner[room]
        return outputs

    def _on_message(self, msg: Message) -> None:
        self.worker.on_message(msg)         # the receiver thread

    # ------------------------------------------------------------------ KVConnector
    def owned_pages(self) -> list[int]:
        """The quarantined pages (the scheduler's invariant check counts them)."""
        return [p for _, _, pages in self.quarantine.values() for p in pages]

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

