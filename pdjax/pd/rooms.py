"""The records the PD roles keep per room and per peer (DESIGN.md §4).

Prefill: ``PrefillRoom`` (one ``bootstrap_room``; a registered decode, whose KV layout must
pair with this prefill's, is ``transfer.decode_peer.DecodePeer``). Decode: ``DecodeRoom`` (one
PD request) and ``PrefillPeer`` (one prefill server, with its ``PeerState``). Each record notes which fields helper threads write (under the manager's
lock); the rest belongs to the engine thread. States move along checked tables
(``KVPoll.transition``, ``lifecycle.peer_transition``); failures are ``RoomFailure``s.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from pdjax.engine_io import GenerateOutput
from pdjax.pd.lifecycle import Aborted, PeerState, RoomFailure, peer_transition
from pdjax.pd.lifecycle import KVPoll
from pdjax.request import Request


# ------------------------------------------------------------------------------ prefill side
def prefer_failure(kept: RoomFailure | None, new: RoomFailure) -> RoomFailure:
    """Of the failures a prefill room's worker reported between two polls, the one the room
    fails with: the first, except that the decode's abort wins over a write error."""
    if kept is None or (isinstance(new, Aborted) and not isinstance(kept, Aborted)):
        return new
    return kept


@dataclasses.dataclass
class PrefillRoom:
    """State of one ``bootstrap_room`` on the prefill (engine thread only: the worker's threads
    report chunks written, write failures, page lists and aborts as events)."""

    room: int
    created_s: float
    state: KVPoll = KVPoll.Bootstrapping
    state_s: float = 0.0
    req: Request | None = None
    # From the decode's TransferRequest.
    peer_id: str | None = None
    dst_pages: np.ndarray | None = None
    dst_slot: int = -1
    decode_prefix_len: int = 0
    prompt_len: int = 0                 # the prompt the decode reserved pages for
    prompt_digest: bytes = b""
    # Progress.
    src_slot: int | None = None
    next_page: int = 0                  # next prompt page to send
    jobs_inflight: int = 0              # chunk/notice jobs queued or running in the worker
    last_queued: bool = False
    first_send_s: float = 0.0
    done: bool = False                  # last chunk + metadata written
    failure: RoomFailure | None = None  # why the room is Failed
    status_code: int = 0                # 4xx: this server refused the request (told the decode)
    notified: bool = False              # the decode was told the outcome
    output: GenerateOutput | None = None
    output_sent: bool = False
    # Accounting (the worker's ChunkWritten events).
    bytes: int = 0
    pages: int = 0
    copies: int = 0
    node_bytes: list = dataclasses.field(default_factory=list)   # per decode node, node 0 first
    write_s: float = 0.0          # time inside the transfer engine's batch writes
    chunks: list = dataclasses.field(default_factory=list)

    @property
    def rid(self) -> str | None:
        return None if self.req is None else self.req.rid

    @property
    def fail_reason(self) -> str | None:
        return None if self.failure is None else str(self.failure)

    def tombstone(self) -> "PrefillRoom":
        """What stays of a failed room after its request was answered: a late request or page
        list for the room fails at once, with this reason."""
        assert self.state == KVPoll.Failed, self.state
        return PrefillRoom(room=self.room, created_s=self.state_s, state=KVPoll.Failed,
                           state_s=self.state_s, peer_id=self.peer_id, failure=self.failure,
                           status_code=self.status_code, notified=True, output_sent=True)

    def record(self) -> dict[str, Any]:
        return {"room": self.room, "rid": self.rid, "state": self.state.name,
                "reason": self.fail_reason, "decode_prefix_len": self.decode_prefix_len,
                "prompt_len": None if self.req is None else self.req.num_prompt_tokens,
                "bytes": self.bytes, "pages": self.pages, "copies": self.copies,
                "node_bytes": list(self.node_bytes), "chunks": self.chunks, "write_s": self.write_s,
                "latency_s": (self.state_s - self.first_send_s) if self.first_send_s else None}


class CompletedRooms:
    """The prefill's rooms whose transfer completed, each kept ``ttl_s`` seconds (the bootstrap
    timeout) after it completed: a request or page list that reuses one is refused at once
    instead of waiting for a half that already came and went. Oldest first, so ``expire`` is
    O(expired); not part of the room table the engine's poll walks. Callers hold the
    manager's lock."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._at: collections.OrderedDict[int, float] = collections.OrderedDict()

    def add(self, room: int, now: float) -> None:
        """``room`` completed at ``now`` (monotonic s)."""
        self._at.pop(room, None)
        self._at[room] = now

    def expire(self, now: float) -> None:
        """Forget the rooms that completed ``ttl_s`` or more before ``now``."""
        while self._at and next(iter(self._at.values())) <= now - self.ttl_s:
            self._at.popitem(last=False)

    def __contains__(self, room: object) -> bool:
        return room in self._at

    def __len__(self) -> int:
        return len(self._at)


# ------------------------------------------------------------------------------- decode side
@dataclasses.dataclass
class PrefillPeer:
    """One prefill server, keyed by its bootstrap ``host:port`` (engine thread only; the
    decode worker's threads report pairing and heartbeat outcomes as events)."""

    host: str
    port: int
    engine_id: str                     # this decode's id towards that prefill
    state: PeerState = PeerState.CONNECTING
    failure: RoomFailure | None = None  # why it is FAILED (PairingFailed, PeerLost)
    endpoint: str | None = None        # the prefill rank's ZMQ PULL socket

    @property
    def key(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def reason(self) -> str:
        return str(self.failure) if self.failure is not None else ""

    def set_ready(self) -> None:
        self.state = peer_transition(self.state, PeerState.READY)

    def fail(self, failure: RoomFailure) -> None:
        self.state = peer_transition(self.state, PeerState.FAILED)
        self.failure = failure


@dataclasses.dataclass
class DecodeRoom:
    """One PD request on the decode (engine thread only). ``status`` (the prefill's Success or
    Failed), ``status_failure`` (why, when Failed) and ``status_code`` come from the worker's
    ``StatusArrived`` event."""

    room: int | None                   # None for a fake (warm-up) request
    req: Request
    peer_key: tuple[str, int] | None   # None for a fake request
    created_s: float
    state: KVPoll = KVPoll.Bootstrapping
    state_s: float = 0.0
    slot: int | None = None
    dst_pages: list[int] = dataclasses.field(default_factory=list)
    decode_prefix_len: int = 0
    sent_s: float = 0.0
    status: KVPoll | None = None
    status_failure: RoomFailure | None = None
    status_code: int = 0               # a prefill's 4xx refusal, passed on to the client
    failure: RoomFailure | None = None
    digest: bytes = b""                # wire.prompt_digest of the prompt
    quarantine: bool = False           # failed while the prefill may still write its pages

    @property
    def fake(self) -> bool:
        return self.peer_key is None

    @property
    def fail_reason(self) -> str | None:
        return None if self.failure is None else str(self.failure)

    def record(self) -> dict[str, Any]:
        return {"room": self.room, "rid": self.req.rid, "state": self.state.name,
                "reason": self.fail_reason, "prompt_len": self.req.num_prompt_tokens,
                "decode_prefix_len": self.decode_prefix_len, "dst_pages": list(self.dst_pages),
                "slot": self.slot,
                "peer": None if self.peer_key is None else f"{self.peer_key[0]}:{self.peer_key[1]}"}
