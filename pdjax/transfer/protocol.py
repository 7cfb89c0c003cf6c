"""PD control-plane messages: typed, versioned dataclasses encoded with msgpack (DESIGN.md §4).

Every ZMQ frame between a prefill and a decode server is one msgpack map::

    {"v": PROTOCOL_VERSION, "t": <MessageType>, <field>: <value>, ...}

``decode_message`` accepts only that shape: the version must match, the type tag must be known,
every field must be present with the right type and range, and unknown fields are rejected. Any
violation raises ``ProtocolError`` (a ``ValueError``) naming the field, so a receiver can log it
and keep serving. No pickle anywhere. Page lists travel as packed little-endian uint32 bytes.

Message flow (the room is the key everywhere; rooms are in [1, 2**63); 0 means "unwritten")::

    decode                                   prefill
      |-- RegisterDecode (once per peer) ------->|   buffers, page geometry, fingerprint
      |<------------------ RegisterResult -------|   accepted / reason
      |-- TransferRequest (per room) ----------->|   dst pages, metadata slot, prefix len,
      |                                          |   prompt length + digest (binds the room
      |                                          |   to one prompt)
      |<------------------ TransferStatus -------|   Success / Failed + reason
      |-- Abort ---------------------------------|   either direction
      |<---------------------------- AbortAck ---|   pages may be reused after this
      |<-------------- Heartbeat --------------->|

With a shared secret (``--disaggregation-secret``) every frame is sealed (``seal_frame``): an
HMAC-SHA256 over a sender id, a per-sender counter, a timestamp and the body, checked before the
body is parsed; ``FrameAuthenticator`` also refuses a counter it has seen (replay) and a
timestamp outside the window.

Pure Python (msgpack + numpy); never imports JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import re
import struct
import threading
import time
from typing import Any, ClassVar, Iterable, Sequence

import msgpack
import numpy as np

# 2: TransferRequest binds the room to the prompt (issue 16); 3: KV buffers carry their
# shards' KV head ranges (PD between different TP sizes, issue 14).
PROTOCOL_VERSION = 3

# Bounds on what a peer may send; they keep a hostile or corrupt frame from allocating much.
MAX_FRAME_BYTES = 64 << 20
MAX_ROOM = (1 << 63) - 1
MAX_ADDR = (1 << 64) - 1
MAX_PAGES = (1 << 31) - 1
MAX_LAYERS = 4096
MAX_SHARDS = 1024
MAX_HEADS = 1 << 16
MAX_BUFFERS = 4096
MAX_BYTES_PER_PAGE = 1 << 40
MAX_SLOTS = 1 << 24
MAX_BYTES_PER_SLOT = 1 << 20
MAX_PAGE_SIZE = 1 << 16
MAX_STR = 256
MAX_REASON = 4096
METADATA_ROW_ALIGN = 64
KV_LAYOUTS = ("layer_major", "page_major")
PROMPT_DIGEST_BYTES = 16
MAX_PROMPT_LEN = (1 << 31) - 1

_ENDPOINT_RE = re.compile(r"^tcp://[A-Za-z0-9_.:\[\]-]+:([0-9]{1,5})$")


class ProtocolError(ValueError):
    """A frame or field that breaks the protocol; the message names the offending field."""


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


class MessageType(str, enum.Enum):
    """Type tag carried in field ``t`` of every frame."""

    REGISTER = "register"
    REGISTER_RESULT = "register_result"
    TRANSFER_REQUEST = "transfer_request"
    TRANSFER_STATUS = "transfer_status"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    HEARTBEAT = "heartbeat"


# --------------------------------------------------------------------------------------------
# Field checks. Each raises ProtocolError naming the field; ``bool`` is never accepted as int.


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"field {name!r}: expected int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ProtocolError(f"field {name!r}: {value} outside [{lo}, {hi}]")
    return value


def _check_str(name: str, value: Any, max_len: int = MAX_STR, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"field {name!r}: expected str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ProtocolError(f"field {name!r}: must not be empty")
    if len(value) > max_len:
        raise ProtocolError(f"field {name!r}: length {len(value)} exceeds {max_len}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name!r}: expected bool, got {type(value).__name__}")
    return value


def _check_digest(name: str, value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != PROMPT_DIGEST_BYTES:
        raise ProtocolError(f"field {name!r}: expected {PROMPT_DIGEST_BYTES} bytes, got "
                            f"{type(value).__name__} of length "
                            f"{len(value) if isinstance(value, (bytes, str)) else '-'}")
    return value


def _check_room(name: str, value: Any) -> int:
    return _check_int(name, value, 1, MAX_ROOM)


def _check_endpoint(name: str, value: Any) -> str:
    value = _check_str(name, value)
    m = _ENDPOINT_RE.match(value)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise ProtocolError(f"field {name!r}: {value!r} is not a 'tcp://host:port' endpoint")
    return value


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """What identifies a prompt across servers: BLAKE2b (16 bytes) of its token ids as
    little-endian int32. The decode sends it with its page list, the prefill refuses a room whose
    prompt differs, and the metadata row carries it back (issue 16, item 1)."""
    arr = np.asarray(token_ids, dtype="<i4")
    return hashlib.blake2b(arr.tobytes(), digest_size=PROMPT_DIGEST_BYTES).digest()


def find_duplicates(values: Iterable[int]) -> list[int]:
    """Values that occur more than once, sorted ascending (each reported once)."""
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values)
    if arr.size == 0:
        return []
    uniq, counts = np.unique(arr, return_counts=True)
    return [int(v) for v in uniq[counts > 1]]


def validate_pages(indices: Sequence[int] | np.ndarray, num_pages: int,
                   name: str = "pages") -> np.ndarray:
    """Range- and duplicate-check a page list against a pool of ``num_pages`` pages.

    Page 0 is the null page (padding writes land there), so a real page index must lie in
    ``[1, num_pages)``. Returns the indices as a 1-D int64 array. Raises ``ProtocolError``
    naming ``name`` for a non-integer entry, an index out of range, or a duplicate (two source
    pages written into one destination page would corrupt it).
    """
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ProtocolError(f"field {name!r}: expected a 1-D page list, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ProtocolError(f"field {name!r}: page indices must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 1 or hi >= num_pages:
        bad = int(arr[(arr < 1) | (arr >= num_pages)][0])
        raise ProtocolError(f"field {name!r}: page index {bad} outside [1, {num_pages})")
    dups = find_duplicates(arr)
    if dups:
        raise ProtocolError(f"field {name!r}: duplicate page indices {dups[:8]}")
    return arr


def _pack_pages(pages: Sequence[int]) -> bytes:
    return np.asarray(pages, dtype="<u4").tobytes()


def _unpack_pages(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, (bytes, bytearray)):
        raise ProtocolError(f"field {name!r}: expected packed uint32 bytes, "
                            f"got {type(value).__name__}")
    if len(value) % 4:
        raise ProtocolError(f"field {name!r}: byte length {len(value)} is not a multiple of 4")
    return np.frombuffer(value, dtype="<u4")


def _check_pages(name: str, value: Any) -> tuple[int, ...]:
    """Shape/type check of a page list in a message (range vs the pool is ``validate_pages``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise ProtocolError(f"field {name!r}: expected a sequence of page indices")
    if len(value) == 0:
        return ()
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype != np.bool_ \
            and np.issubdtype(value.dtype, np.integer):
        arr = value
        # Fast path (the common case): one vectorised range check.
        if int(arr.min()) >= 0 and int(arr.max()) <= MAX_PAGES:
            return tuple(arr.tolist())
    return tuple(_check_int(f"{name}[{i}]", p, 0, MAX_PAGES) for i, p in enumerate(value))


# --------------------------------------------------------------------------------------------
# Messages.


@dataclasses.dataclass(frozen=True)
class KVBufferDesc:
    """One KV buffer (one kind, e.g. K or V, all layers) as seen by the transfer engine.

    ``shard_addrs``: base address of each addressable shard, in shard order (one per device for a
    sharded array). Layer-major layout: the shard holds ``[num_layers, num_pages, page bytes]``
    contiguously, so page ``p`` of layer ``l`` starts at
    ``base + (l * num_pages + p) * bytes_per_page``. Page-major layout swaps the two leading
    dimensions. Units: bytes; addresses are uint64.

    Heads (PD between different TP sizes, DESIGN.md §4): the buffer holds ``num_heads`` logical
    KV heads (the checkpoint's, before any replication); shard ``i`` holds heads
    ``[start, start + count)`` for ``(start, count) = shard_heads[i]``, and one page of one
    layer of a shard is ``[page_size, count, head_bytes]`` row-major::

        token t, local head j  ->  offset (t * count + j) * head_bytes

    A buffer that is not head-sharded (an MLA latent, an indexer key cache) is one head
    (``num_heads = 1``) held by every shard. Defaults (also for fields left out on the wire):
    one head held by every shard, one piece per page (``head_bytes = bytes_per_page``). Every
    shard holds the same head count.
    """

    shard_addrs: tuple[int, ...]
    num_layers: int
    num_pages: int
    bytes_per_page: int
    num_heads: int = 1
    shard_heads: tuple[tuple[int, int], ...] = ()
    head_bytes: int = 0

    def __post_init__(self):
        addrs = self.shard_addrs
        if isinstance(addrs, (str, bytes)) or not isinstance(addrs, (list, tuple)):
            raise ProtocolError("field 'shard_addrs': expected a list of addresses")
        if not 1 <= len(addrs) <= MAX_SHARDS:
            raise ProtocolError(f"field 'shard_addrs': {len(addrs)} shards outside "
                                f"[1, {MAX_SHARDS}]")
        object.__setattr__(self, "shard_addrs", tuple(
            _check_int(f"shard_addrs[{i}]", a, 1, MAX_ADDR) for i, a in enumerate(addrs)))
        _check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_int("num_pages", self.num_pages, 2, MAX_PAGES)
        _check_int("bytes_per_page", self.bytes_per_page, 1, MAX_BYTES_PER_PAGE)
        _check_int("num_heads", self.num_heads, 1, MAX_HEADS)
        heads = self.shard_heads
        if not heads:
            heads = ((0, self.num_heads),) * len(addrs)
        if isinstance(heads, (str, bytes)) or not isinstance(heads, (list, tuple)) \
                or len(heads) != len(addrs):
            raise ProtocolError(f"field 'shard_heads': expected one [start, count] per shard "
                                f"({len(addrs)})")
        checked = []
        for i, h in enumerate(heads):
            if not isinstance(h, (list, tuple)) or len(h) != 2:
                raise ProtocolError(f"field 'shard_heads[{i}]': expected [start, count]")
            start = _check_int(f"shard_heads[{i}].start", h[0], 0, self.num_heads - 1)
            count = _check_int(f"shard_heads[{i}].count", h[1], 1, self.num_heads - start)
            checked.append((start, count))
        if len({c for _, c in checked}) != 1:
            raise ProtocolError(f"field 'shard_heads': shards hold different head counts "
                                f"{[c for _, c in checked]}")
        object.__setattr__(self, "shard_heads", tuple(checked))
        count = checked[0][1]
        head_bytes = self.head_bytes or self.bytes_per_page // count
        _check_int("head_bytes", head_bytes, 1, self.bytes_per_page)
        if self.bytes_per_page % (count * head_bytes):
            raise ProtocolError(f"field 'head_bytes': bytes_per_page {self.bytes_per_page} is "
                                f"not a whole number of tokens of {count} heads x {head_bytes} B")
        object.__setattr__(self, "head_bytes", head_bytes)

    @property
    def heads_per_shard(self) -> int:
        return self.shard_heads[0][1]

    @property
    def tokens_per_page(self) -> int:
        """Token slots in one page (the page size, when ``head_bytes`` is one head's row)."""
        return self.bytes_per_page // (self.heads_per_shard * self.head_bytes)

    def to_wire(self) -> dict:
        return {"shard_addrs": list(self.shard_addrs), "num_layers": self.num_layers,
                "num_pages": self.num_pages, "bytes_per_page": self.bytes_per_page,
                "num_heads": self.num_heads, "shard_heads": [list(h) for h in self.shard_heads],
                "head_bytes": self.head_bytes}

    @classmethod
    def from_wire(cls, name: str, d: Any) -> "KVBufferDesc":
        if not isinstance(d, dict):
            raise ProtocolError(f"field {name!r}: expected a map")
        _check_keys(name, d, {"shard_addrs", "num_layers", "num_pages", "bytes_per_page"},
                    optional={"num_heads", "shard_heads", "head_bytes"})
        heads = d.get("shard_heads", [])
        if not isinstance(heads, list):
            raise ProtocolError(f"{name}: field 'shard_heads': expected a list")
        try:
            return cls(**dict(d, shard_heads=tuple(
                tuple(h) if isinstance(h, list) else h for h in heads)))
        except ProtocolError as e:
            raise ProtocolError(f"{name}: {e}") from None


class Message:
    """Base of all control messages: ``encode()`` to one msgpack frame."""

    TYPE: ClassVar[MessageType]

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, d: dict) -> "Message":
        return cls(**d)

    def encode(self) -> bytes:
        """One msgpack frame: ``{"v": PROTOCOL_VERSION, "t": TYPE, **fields}``."""
        body = self.to_wire()
        body["v"] = PROTOCOL_VERSION
        body["t"] = self.TYPE.value
        return msgpack.packb(body, use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class RegisterDecode(Message):
    """One-time registration of a decode engine with a prefill rank (decode -> prefill).

    Fields: ``decode_engine_id`` (unique per decode process, the key of later messages),
    ``reply_endpoint`` (``tcp://host:port`` of the decode's ZMQ PULL socket, where status and
    aborts go), ``engine_session_id`` (the decode transfer engine's peer id, e.g. Mooncake's
    ``ip:rpc_port``), ``tp_rank``/``tp_size``, ``kv_buffers`` (``KVBufferDesc`` per buffer, in
    the same order as the prefill's), ``kv_layout`` (``layer_major`` | ``page_major``),
    ``metadata_addr``/``metadata_bytes_per_slot``/``metadata_num_slots`` (the MetadataBuffers
    pool; rows padded to 64 bytes), ``page_size`` (tokens per page), ``kv_dtype`` and
    ``layout_fingerprint`` (must equal the prefill's).
    """

    TYPE: ClassVar[MessageType] = MessageType.REGISTER
    decode_engine_id: str
    reply_endpoint: str
    engine_session_id: str
    tp_rank: int
    tp_size: int
    kv_buffers: tuple[KVBufferDesc, ...]
    kv_layout: str
    metadata_addr: int
    metadata_bytes_per_slot: int
    metadata_num_slots: int
    page_size: int
    kv_dtype: str
    layout_fingerprint: str

    def __post_init__(self):
        _check_str("decode_engine_id", self.decode_engine_id)
        _check_endpoint("reply_endpoint", self.reply_endpoint)
        _check_str("engine_session_id", self.engine_session_id)
        _check_int("tp_size", self.tp_size, 1, MAX_SHARDS)
        _check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        bufs = self.kv_buffers
        if isinstance(bufs, (str, bytes)) or not isinstance(bufs, (list, tuple)):
            raise ProtocolError("field 'kv_buffers': expected a list")
        if not 1 <= len(bufs) <= MAX_BUFFERS:
            raise ProtocolError(f"field 'kv_buffers': {len(bufs)} buffers outside "
                                f"[1, {MAX_BUFFERS}]")
        for i, b in enumerate(bufs):
            if not isinstance(b, KVBufferDesc):
                raise ProtocolError(f"field 'kv_buffers[{i}]': expected KVBufferDesc")
        object.__setattr__(self, "kv_buffers", tuple(bufs))
        if self.kv_layout not in KV_LAYOUTS:
            raise ProtocolError(f"field 'kv_layout': {self.kv_layout!r} not in {KV_LAYOUTS}")
        _check_int("metadata_addr", self.metadata_addr, 1, MAX_ADDR)
        _check_int("metadata_bytes_per_slot", self.metadata_bytes_per_slot,
                   METADATA_ROW_ALIGN, MAX_BYTES_PER_SLOT)
        if self.metadata_bytes_per_slot % METADATA_ROW_ALIGN:
            raise ProtocolError(f"field 'metadata_bytes_per_slot': {self.metadata_bytes_per_slot}"
                                f" is not a multiple of {METADATA_ROW_ALIGN}")
        _check_int("metadata_num_slots", self.metadata_num_slots, 1, MAX_SLOTS)
        _check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        _check_str("kv_dtype", self.kv_dtype, 32)
        _check_str("layout_fingerprint", self.layout_fingerprint)

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["kv_buffers"] = [b.to_wire() for b in self.kv_buffers]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "RegisterDecode":
        bufs = d.get("kv_buffers")
        if not isinstance(bufs, list) or not 1 <= len(bufs) <= MAX_BUFFERS:
            raise ProtocolError(f"field 'kv_buffers': expected a list of 1..{MAX_BUFFERS} maps")
        d = dict(d, kv_buffers=tuple(KVBufferDesc.from_wire(f"kv_buffers[{i}]", b)
                                     for i, b in enumerate(bufs)))
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class RegisterResult(Message):
    """Prefill's answer to ``RegisterDecode`` (prefill -> decode): accepted, or refused with a
    reason (e.g. a page size or fingerprint mismatch)."""

    TYPE: ClassVar[MessageType] = MessageType.REGISTER_RESULT
    decode_engine_id: str
    accepted: bool
    reason: str = ""

    def __post_init__(self):
        _check_str("decode_engine_id", self.decode_engine_id)
        _check_bool("accepted", self.accepted)
        _check_str("reason", self.reason, MAX_REASON, allow_empty=True)


@dataclasses.dataclass(frozen=True)
class TransferRequest(Message):
    """Per-request destination from decode (decode -> prefill).

    ``bootstrap_room`` in [1, 2**63); ``dst_pages``: decode page indices, one per prompt page
    from ``decode_prefix_len`` on (range-checked by the receiver with ``validate_pages`` against
    the registered ``num_pages``); ``dst_metadata_slot``: the decode MetadataBuffers slot;
    ``decode_prefix_len``: prompt tokens the decode already holds in its prefix cache (tokens);
    ``decode_engine_id``: the registered decode engine this room belongs to;
    ``prompt_len`` (tokens) and ``prompt_digest`` (``prompt_digest`` of the prompt's token ids,
    16 bytes): the prompt the decode reserved the pages for; the prefill refuses to write a
    room whose request has another prompt.
    """

    TYPE: ClassVar[MessageType] = MessageType.TRANSFER_REQUEST
    bootstrap_room: int
    dst_pages: tuple[int, ...]
    dst_metadata_slot: int
    decode_prefix_len: int
    decode_engine_id: str
    prompt_len: int
    prompt_digest: bytes

    def __post_init__(self):
        _check_room("bootstrap_room", self.bootstrap_room)
        object.__setattr__(self, "dst_pages", _check_pages("dst_pages", self.dst_pages))
        _check_int("dst_metadata_slot", self.dst_metadata_slot, 0, MAX_SLOTS - 1)
        _check_int("decode_prefix_len", self.decode_prefix_len, 0, MAX_PAGES)
        _check_str("decode_engine_id", self.decode_engine_id)
        _check_int("prompt_len", self.prompt_len, 1, MAX_PROMPT_LEN)
        _check_digest("prompt_digest", self.prompt_digest)

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["dst_pages"] = _pack_pages(self.dst_pages)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "TransferRequest":
        return cls(**dict(d, dst_pages=_unpack_pages("dst_pages", d.get("dst_pages"))))


@dataclasses.dataclass(frozen=True)
class TransferStatus(Message):
    """Final state of a room from a prefill rank (prefill -> decode): Success or Failed.

    ``status_code``: for Failed, the HTTP status the prefill gave its own client (a 4xx when it
    refused the request: the decode's client gets the same), or 0 (a transfer failure: 500).
    """

    TYPE: ClassVar[MessageType] = MessageType.TRANSFER_STATUS
    bootstrap_room: int
    state: KVPoll
    reason: str = ""
    tp_rank: int = 0
    status_code: int = 0

    def __post_init__(self):
        _check_room("bootstrap_room", self.bootstrap_room)
        state = _check_int("state", self.state, 0, 4)
        if state not in (KVPoll.Success, KVPoll.Failed):
            raise ProtocolError(f"field 'state': {KVPoll(state).name} is not a final state "
                                f"(Success or Failed)")
        object.__setattr__(self, "state", KVPoll(state))
        _check_str("reason", self.reason, MAX_REASON, allow_empty=True)
        _check_int("tp_rank", self.tp_rank, 0, MAX_SHARDS - 1)
        if self.status_code != 0:
            _check_int("status_code", self.status_code, 400, 499)

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["state"] = int(self.state)
        return d


@dataclasses.dataclass(frozen=True)
class Abort(Message):
    """Abort one room (either direction); the receiver marks it Failed and answers ``AbortAck``."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT
    bootstrap_room: int
    sender_id: str
    reason: str = ""

    def __post_init__(self):
        _check_room("bootstrap_room", self.bootstrap_room)
        _check_str("sender_id", self.sender_id)
        _check_str("reason", self.reason, MAX_REASON, allow_empty=True)


@dataclasses.dataclass(frozen=True)
class AbortAck(Message):
    """The aborted side has stopped writing for this room; its destination pages may be reused."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT_ACK
    bootstrap_room: int
    sender_id: str

    def __post_init__(self):
        _check_room("bootstrap_room", self.bootstrap_room)
        _check_str("sender_id", self.sender_id)


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness ping; ``role`` is ``prefill`` or ``decode``, ``seq`` counts up from 0."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    sender_id: str
    role: str
    seq: int

    def __post_init__(self):
        _check_str("sender_id", self.sender_id)
        if self.role not in ("prefill", "decode"):
            raise ProtocolError(f"field 'role': {self.role!r} not in ('prefill', 'decode')")
        _check_int("seq", self.seq, 0, MAX_ADDR)


_MESSAGE_CLASSES: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (RegisterDecode, RegisterResult, TransferRequest, TransferStatus, Abort,
                AbortAck, Heartbeat)
}


def _check_keys(where: str, d: dict, allowed: set[str], optional: set[str] = frozenset()) -> None:
    for k in d:
        if not isinstance(k, str):
            raise ProtocolError(f"{where}: non-string key {k!r}")
    unknown = sorted(set(d) - allowed - optional)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown}")
    missing = sorted(allowed - set(d))
    if missing:
        raise ProtocolError(f"field {missing[0]!r}: missing in {where}")


def encode_message(msg: Message) -> bytes:
    """Encode ``msg`` into one msgpack frame (see ``Message.encode``)."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected a protocol Message, got {type(msg).__name__}")
    return msg.encode()


def decode_message(frame: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one frame.

    Returns the typed message. Raises ``ProtocolError`` (naming the field) for: a frame over
    ``MAX_FRAME_BYTES``, invalid msgpack, a non-map body, a missing/wrong protocol version
    ``v``, an unknown type tag ``t``, missing/unknown fields, wrong types and out-of-range
    values.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame: expected bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame: {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True,
                               max_array_len=1 << 20, max_map_len=64,
                               max_str_len=1 << 16, max_bin_len=MAX_FRAME_BYTES, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame: not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame: expected a map, got {type(body).__name__}")
    if "v" not in body:
        raise ProtocolError("field 'v': missing protocol version")
    version = body.pop("v")
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ProtocolError(f"field 'v': protocol version {version!r} not supported "
                            f"(expected {PROTOCOL_VERSION})")
    tag = body.pop("t", None)
    cls = _MESSAGE_CLASSES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"field 't': unknown message type {tag!r}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    optional = {f.name for f in dataclasses.fields(cls)} - required
    _check_keys(cls.TYPE.value, body, required, optional)
    try:
        return cls.from_wire(body)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{cls.TYPE.value}: {e}") from None


# --------------------------------------------------------------------------------------------
# Frame authentication (issue 16, item 9). A sealed frame is
#
#     offset 0   sender id   16 bytes   random per sending channel
#            16  counter     uint64 LE  strictly increasing per sender
#            24  unix time   float64 LE seconds, when sealed
#            32  tag         32 bytes   HMAC-SHA256(secret, bytes 0..31 + body)
#            64  body        one msgpack message (``Message.encode``)
#
# The receiver checks the tag before it parses anything, then refuses a counter not above the
# last one it accepted from that sender (a replay) and a time outside the window (an old frame
# replayed to a receiver that forgot the sender, e.g. after a restart).

SECRET_ENV = "PDJAX_DISAGGREGATION_SECRET"
AUTH_HEADER = struct.Struct("<16sQd")
AUTH_TAG_BYTES = 32
AUTH_PREFIX_BYTES = AUTH_HEADER.size + AUTH_TAG_BYTES
AUTH_WINDOW_S = 60.0
_MAX_SENDERS = 4096


class AuthError(ProtocolError):
    """A frame that fails authentication; ``reason`` is ``hmac``, ``replay`` or ``stale``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def resolve_secret(configured: str | None) -> str | None:
    """The shared secret: ``--disaggregation-secret``, else ``$PDJAX_DISAGGREGATION_SECRET``,
    else None (unauthenticated control plane)."""
    return configured or os.environ.get(SECRET_ENV) or None


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key of a shared secret (UTF-8 bytes). ``ValueError`` for an empty secret."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("disaggregation_secret: must not be empty")
    return key


def _auth_tag(key: bytes, header: bytes, body: bytes) -> bytes:
    return hmac.new(key, header + body, hashlib.sha256).digest()


class FrameSealer:
    """Seals outgoing frames with one sender id and a counter (thread-safe)."""

    def __init__(self, secret: str | bytes, clock=time.time):
        self._key = secret_key(secret)
        self._clock = clock
        self.sender_id = os.urandom(16)
        self._counter = 0
        self._lock = threading.Lock()

    def seal(self, body: bytes) -> bytes:
        with self._lock:
            self._counter += 1
            header = AUTH_HEADER.pack(self.sender_id, self._counter, float(self._clock()))
        return header + _auth_tag(self._key, header, body) + body


class FrameAuthenticator:
    """Checks sealed frames: tag, then replay and time window. Thread-safe.

    ``open(frame)`` returns the body, or raises ``AuthError`` (``reason`` hmac | replay |
    stale). ``window_s``: the most a frame's time may differ from this clock (seconds).
    """

    def __init__(self, secret: str | bytes, window_s: float = AUTH_WINDOW_S, clock=time.time):
        self._key = secret_key(secret)
        self.window_s = window_s
        self._clock = clock
        self._last: dict[bytes, tuple[int, float]] = {}     # sender -> (counter, time)
        self._lock = threading.Lock()

    def open(self, frame: bytes) -> bytes:
        frame = bytes(frame)
        if len(frame) < AUTH_PREFIX_BYTES:
            raise AuthError("hmac", f"frame: {len(frame)} bytes, shorter than the "
                                    f"{AUTH_PREFIX_BYTES}-byte authentication prefix")
        header, tag = frame[:AUTH_HEADER.size], frame[AUTH_HEADER.size:AUTH_PREFIX_BYTES]
        body = frame[AUTH_PREFIX_BYTES:]
        if not hmac.compare_digest(tag, _auth_tag(self._key, header, body)):
            raise AuthError("hmac", "frame: HMAC mismatch (wrong secret or tampered frame)")
        sender, counter, sent_s = AUTH_HEADER.unpack(header)
        now = self._clock()
        if not abs(now - sent_s) <= self.window_s:
            raise AuthError("stale", f"frame: sealed {now - sent_s:.1f} s ago, outside the "
                                     f"{self.window_s:g} s window")
        with self._lock:
            last = self._last.get(sender)
            if last is not None and counter <= last[0]:
                raise AuthError("replay", f"frame: counter {counter} of sender "
                                          f"{sender.hex()[:8]} already seen (replay)")
            if last is None and len(self._last) >= _MAX_SENDERS:
                # Senders silent for longer than the window can only send fresh frames.
                self._last = {k: v for k, v in self._last.items()
                              if now - v[1] <= self.window_s}
            self._last[sender] = (counter, now)
        return body
