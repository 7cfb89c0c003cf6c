"""Lifecycle of PD rooms and peers: checked state machines and typed failures (DESIGN.md §4).

A room's transfer state is a ``KVPoll`` (its values travel on the wire, in ``protocol``'s
messages) and moves only along ``KVPoll.transition``'s table. A decode's view of one prefill server is a ``PeerState``:

    CONNECTING --(topology read, registration accepted)--> READY
         '------(no pairing: unreachable, refused)-------> FAILED <--(heartbeats lost)-- READY

A failed peer is dropped once no room uses it, and the next request bootstraps a fresh one.

Why a room failed is one ``RoomFailure`` subclass, never a message to search: its ``label`` is
the ``reason`` of ``kv_transfer_failed_total``. A failure reported by the other side carries
that side's text; the class says only what this side knows (an abort, a refusal with a 4xx
status, or ``RemoteFailure``).

Pure Python.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class IllegalTransition(RuntimeError):
    """A state change a transition table does not allow (a bug in the caller, never a peer's
    input)."""


class KVPoll(enum.IntEnum):
    """Transfer state of one room, on either side (SGLang's order and values).

    The numeric order makes a MIN over ranks the most conservative state, and ``Failed`` is 0 so
    that any failing rank fails the whole room.
    """

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @staticmethod
    def transition(old: "KVPoll", new: "KVPoll") -> "KVPoll":
        """``new`` if a room may move ``old -> new``; ``IllegalTransition`` otherwise. The table::

            Bootstrapping -> WaitingForInput -> Transferring -> Success
                  '---------------'------------------'------------'--> Failed (final)

        ``Success -> Failed``: on the prefill a room whose Success reached the decode still
        fails until its last job ended (a client abort, a moved cache); only its own client
        hears of that.
        """
        if new not in _KVPOLL_TRANSITIONS[old]:
            raise IllegalTransition(f"room state {old.name} -> {new.name} is not allowed")
        return new


_KVPOLL_TRANSITIONS = {
    KVPoll.Bootstrapping: frozenset({KVPoll.WaitingForInput, KVPoll.Failed}),
    KVPoll.WaitingForInput: frozenset({KVPoll.Transferring, KVPoll.Failed}),
    KVPoll.Transferring: frozenset({KVPoll.Success, KVPoll.Failed}),
    KVPoll.Success: frozenset({KVPoll.Failed}),
    KVPoll.Failed: frozenset(),
}


class PeerState(str, enum.Enum):
    """A prefill server as a decode server sees it (``/pd_state`` shows the value)."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


_PEER_TRANSITIONS = {
    PeerState.CONNECTING: frozenset({PeerState.READY, PeerState.FAILED}),
    PeerState.READY: frozenset({PeerState.FAILED}),
    PeerState.FAILED: frozenset(),
}


def peer_transition(old: PeerState, new: PeerState) -> PeerState:
    """``new`` if the peer table allows ``old -> new``; ``IllegalTransition`` otherwise."""
    if new not in _PEER_TRANSITIONS[old]:
        raise IllegalTransition(f"peer state {old.value} -> {new.value} is not allowed")
    return new


class RoomFailure(Exception):
    """Why a room failed; ``str()`` is the message for logs and clients. The base class is
    the ``other`` label. ``status_code``: the HTTP status both clients of the room get when
    the failure is the client's own mistake (a 4xx); None means a server fault (500)."""

    label: ClassVar[str] = "other"
    status_code: ClassVar[int | None] = None


ROOM_CONFLICT_STATUS = 409


class RoomConflict(ValueError):
    """A request names a ``bootstrap_room`` that another request holds (or held) on this
    server: the client's mistake, refused with HTTP 409 Conflict and the room named. A
    ``ValueError`` so that every caller of ``add_request`` refuses it as bad input."""

    status_code = ROOM_CONFLICT_STATUS


class Timeout(RoomFailure):
    """A bootstrap, waiting or transfer timeout ran out."""

    label = "timeout"


class Aborted(RoomFailure):
    """A client or the other server aborted the room."""

    label = "aborted"


class Refused(RoomFailure):
    """A server refused the request (a bad field, a prompt over the context): a 4xx."""

    label = "refused"


class BadDestination(RoomFailure):
    """The decode's page list or metadata slot does not fit the prompt or its pool."""

    label = "dst_pages"


class WriteFailed(RoomFailure):
    """The transfer engine failed a KV or metadata write."""

    label = "write"


class CacheMoved(RoomFailure):
    """A donated step moved the KV buffers while a transfer used their addresses."""

    label = "moved"


class PromptMismatch(RoomFailure):
    """The room is bound to another prompt (its length or digest differ): two requests reused
    one client-chosen room, a 409 on both sides."""

    label = "prompt_mismatch"
    status_code = ROOM_CONFLICT_STATUS


class MetadataGate(RoomFailure):
    """The metadata row does not hold this room and prompt, or is corrupt."""

    label = "metadata"


class PairingFailed(RoomFailure):
    """The decode could not pair with the prefill (unreachable, incompatible, refused)."""

    label = "pair"


class PeerLost(RoomFailure):
    """The prefill stopped answering its heartbeats."""

    label = "lost"


class RemoteFailure(RoomFailure):
    """The prefill reported Failed (its reason is the message)."""

    label = "remote"
