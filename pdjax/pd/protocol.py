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

    prefill node R > 0 (multi-host)          prefill node 0
      |-- RankWriteDone (per chunk job) -------->|   its shards' writes done / failed
    decode node R > 0 (multi-host)           decode node 0
      |-- DecodeRankInfo (at start, on a move) ->|   its transfer session and own KV shards

With a shared secret (``--disaggregation-secret``) every frame is sealed (``frame_auth.py``:
an HMAC-SHA256 over a sender id, a per-sender counter, a timestamp and the body, checked before
the body is parsed; a seen counter (replay) and a timestamp outside the window are refused).
The limits and field checks are in ``wire.py``, the KV buffer descriptions the registrations
carry in ``kv_buffers.py``, the room state ``KVPoll`` (an int on the wire) in ``lifecycle.py``.

Pure Python (msgpack + numpy); never imports JAX.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

import msgpack

from pdjax.pd.kv_buffers import KVBufferDesc, kv_buffers_from_wire
from pdjax.pd.lifecycle import KVPoll
from pdjax.pd.wire import (KV_LAYOUTS, MAX_ADDR, MAX_BUFFERS, MAX_BYTES_PER_SLOT,
                           MAX_FRAME_BYTES, MAX_PAGE_SIZE, MAX_PAGES, MAX_PROMPT_LEN, MAX_REASON,
                           MAX_ROOM, MAX_SHARDS, MAX_SLOTS, METADATA_ROW_ALIGN, ProtocolError,
                           check_bool, check_digest, check_endpoint, check_int, check_keys,
                           check_list, check_pages, check_room, check_str, pack_pages, unpack_pages)

# 2: TransferRequest binds the room to the prompt; 3: KV buffers carry their
# shards' KV head ranges (PD between different TP sizes).
PROTOCOL_VERSION = 3


class MessageType(str, enum.Enum):
    """Type tag carried in field ``t`` of every frame."""

    REGISTER = "register"
    REGISTER_RESULT = "register_result"
    TRANSFER_REQUEST = "transfer_request"
    TRANSFER_STATUS = "transfer_status"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    HEARTBEAT = "heartbeat"
    RANK_WRITE_DONE = "rank_write_done"
    DECODE_RANK_INFO = "decode_rank_info"


# --------------------------------------------------------------------------------------------
# Messages.


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
    pool; rows padded to 64 bytes), ``page_size`` (tokens per page), ``kv_dtype`` (the KV
    format, ``cache_spec.kv_format``: a dtype name, or the FP8 record such as
    ``fp8:mla656+idx132``) and ``layout_fingerprint`` (both must equal the prefill's).

    A multi-host decode (DESIGN.md §6) lists every node's shards in ``kv_buffers`` and says
    which node holds each: ``node_sessions[n]`` is node ``n``'s transfer session (node 0's is
    ``engine_session_id``), ``shard_nodes[b][s]`` the node of shard ``s`` of buffer ``b``; the
    prefill writes each node's shards into that node's session. Both empty: one process.
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
    node_sessions: tuple[str, ...] = ()
    shard_nodes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        check_str("decode_engine_id", self.decode_engine_id)
        check_endpoint("reply_endpoint", self.reply_endpoint)
        check_str("engine_session_id", self.engine_session_id)
        check_int("tp_size", self.tp_size, 1, MAX_SHARDS)
        check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        bufs = check_list("kv_buffers", self.kv_buffers, 1, MAX_BUFFERS, "buffers")
        for i, b in enumerate(bufs):
            if not isinstance(b, KVBufferDesc):
                raise ProtocolError(f"field 'kv_buffers[{i}]': expected KVBufferDesc")
        object.__setattr__(self, "kv_buffers", tuple(bufs))
        if self.kv_layout not in KV_LAYOUTS:
            raise ProtocolError(f"field 'kv_layout': {self.kv_layout!r} not in {KV_LAYOUTS}")
        check_int("metadata_addr", self.metadata_addr, 1, MAX_ADDR)
        check_int("metadata_bytes_per_slot", self.metadata_bytes_per_slot,
                   METADATA_ROW_ALIGN, MAX_BYTES_PER_SLOT)
        if self.metadata_bytes_per_slot % METADATA_ROW_ALIGN:
            raise ProtocolError(f"field 'metadata_bytes_per_slot': {self.metadata_bytes_per_slot}"
                                f" is not a multiple of {METADATA_ROW_ALIGN}")
        check_int("metadata_num_slots", self.metadata_num_slots, 1, MAX_SLOTS)
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_str("kv_dtype", self.kv_dtype, 32)
        check_str("layout_fingerprint", self.layout_fingerprint)
        self._check_nodes()

    def _check_nodes(self) -> None:
        sessions, owners = self.node_sessions, self.shard_nodes
        for name, v in (("node_sessions", sessions), ("shard_nodes", owners)):
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
                raise ProtocolError(f"field {name!r}: expected a list")
        if not sessions:
            if owners:
                raise ProtocolError("field 'shard_nodes': given without node_sessions")
            object.__setattr__(self, "node_sessions", ())
            object.__setattr__(self, "shard_nodes", ())
            return
        if not 2 <= len(sessions) <= MAX_SHARDS:
            raise ProtocolError(f"field 'node_sessions': {len(sessions)} nodes outside "
                                f"[2, {MAX_SHARDS}]")
        for n, sid in enumerate(sessions):
            check_str(f"node_sessions[{n}]", sid)
        if sessions[0] != self.engine_session_id:
            raise ProtocolError("field 'node_sessions[0]': not engine_session_id (node 0's)")
        if len(owners) != len(self.kv_buffers):
            raise ProtocolError(f"field 'shard_nodes': expected one list per buffer "
                                f"({len(self.kv_buffers)})")
        checked = []
        for i, (row, b) in enumerate(zip(owners, self.kv_buffers)):
            if isinstance(row, (str, bytes)) or not isinstance(row, (list, tuple)) \
                    or len(row) != len(b.shard_addrs):
                raise ProtocolError(f"field 'shard_nodes[{i}]': expected one node per shard "
                                    f"({len(b.shard_addrs)})")
            row = tuple(check_int(f"shard_nodes[{i}][{s}]", n, 0, len(sessions) - 1)
                        for s, n in enumerate(row))
            missing = sorted(set(range(len(sessions))) - set(row))
            if missing:
                raise ProtocolError(f"field 'shard_nodes[{i}]': nodes {missing} hold no shard")
            checked.append(row)
        object.__setattr__(self, "node_sessions", tuple(sessions))
        object.__setattr__(self, "shard_nodes", tuple(checked))

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["kv_buffers"] = [b.to_wire() for b in self.kv_buffers]
        if self.node_sessions:        # one process: the frame an older prefill reads
            d["node_sessions"] = list(self.node_sessions)
            d["shard_nodes"] = [list(row) for row in self.shard_nodes]
        else:
            del d["node_sessions"], d["shard_nodes"]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "RegisterDecode":
        return cls(**dict(d, kv_buffers=kv_buffers_from_wire(d.get("kv_buffers"))))


@dataclasses.dataclass(frozen=True)
class RegisterResult(Message):
    """Prefill's answer to ``RegisterDecode`` (prefill -> decode): accepted, or refused with a
    reason (e.g. a page size or fingerprint mismatch)."""

    TYPE: ClassVar[MessageType] = MessageType.REGISTER_RESULT
    decode_engine_id: str
    accepted: bool
    reason: str = ""

    def __post_init__(self):
        check_str("decode_engine_id", self.decode_engine_id)
        check_bool("accepted", self.accepted)
        check_str("reason", self.reason, MAX_REASON, allow_empty=True)


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
        check_room("bootstrap_room", self.bootstrap_room)
        object.__setattr__(self, "dst_pages", check_pages("dst_pages", self.dst_pages))
        check_int("dst_metadata_slot", self.dst_metadata_slot, 0, MAX_SLOTS - 1)
        check_int("decode_prefix_len", self.decode_prefix_len, 0, MAX_PAGES)
        check_str("decode_engine_id", self.decode_engine_id)
        check_int("prompt_len", self.prompt_len, 1, MAX_PROMPT_LEN)
        check_digest("prompt_digest", self.prompt_digest)

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["dst_pages"] = pack_pages(self.dst_pages)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "TransferRequest":
        return cls(**dict(d, dst_pages=unpack_pages("dst_pages", d.get("dst_pages"))))


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
        check_room("bootstrap_room", self.bootstrap_room)
        state = check_int("state", self.state, 0, 4)
        if state not in (KVPoll.Success, KVPoll.Failed):
            raise ProtocolError(f"field 'state': {KVPoll(state).name} is not a final state "
                                f"(Success or Failed)")
        object.__setattr__(self, "state", KVPoll(state))
        check_str("reason", self.reason, MAX_REASON, allow_empty=True)
        check_int("tp_rank", self.tp_rank, 0, MAX_SHARDS - 1)
        if self.status_code != 0:
            check_int("status_code", self.status_code, 400, 499)

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
        check_room("bootstrap_room", self.bootstrap_room)
        check_str("sender_id", self.sender_id)
        check_str("reason", self.reason, MAX_REASON, allow_empty=True)


@dataclasses.dataclass(frozen=True)
class AbortAck(Message):
    """The aborted side has stopped writing for this room; its destination pages may be reused."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT_ACK
    bootstrap_room: int
    sender_id: str

    def __post_init__(self):
        check_room("bootstrap_room", self.bootstrap_room)
        check_str("sender_id", self.sender_id)


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness ping; ``role`` is ``prefill`` or ``decode``, ``seq`` counts up from 0."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    sender_id: str
    role: str
    seq: int

    def __post_init__(self):
        check_str("sender_id", self.sender_id)
        if self.role not in ("prefill", "decode"):
            raise ProtocolError(f"field 'role': {self.role!r} not in ('prefill', 'decode')")
        check_int("seq", self.seq, 0, MAX_ADDR)


@dataclasses.dataclass(frozen=True)
class RankWriteDone(Message):
    """A multi-host prefill's node ``node_rank`` (> 0) finished the KV writes of its own shards
    for chunk job ``job`` (node 0 numbered the job): ``ok`` with the payload ``bytes`` and copy
    descriptors ``copies`` it wrote, ``node_bytes[n]`` of the bytes into decode node ``n``
    (one entry for a one-process decode; they sum to ``bytes``), or not, with ``reason``
    (DESIGN.md §6)."""

    TYPE: ClassVar[MessageType] = MessageType.RANK_WRITE_DONE
    job: int
    node_rank: int
    ok: bool
    bytes: int = 0
    copies: int = 0
    reason: str = ""
    node_bytes: tuple[int, ...] = ()

    def __post_init__(self):
        check_int("job", self.job, 1, MAX_ROOM)
        check_int("node_rank", self.node_rank, 1, MAX_SHARDS - 1)
        check_bool("ok", self.ok)
        check_int("bytes", self.bytes, 0, MAX_ADDR)
        check_int("copies", self.copies, 0, MAX_ADDR)
        check_str("reason", self.reason, MAX_REASON, allow_empty=True)
        nb, lo = self.node_bytes, 1 if self.ok else 0
        if isinstance(nb, (str, bytes)) or not isinstance(nb, (list, tuple)) \
                or not lo <= len(nb) <= MAX_SHARDS:
            raise ProtocolError(f"field 'node_bytes': expected {lo}..{MAX_SHARDS} integers")
        nb = tuple(check_int(f"node_bytes[{n}]", b, 0, MAX_ADDR) for n, b in enumerate(nb))
        if nb and sum(nb) != self.bytes:
            raise ProtocolError(f"field 'node_bytes': sums to {sum(nb)}, not bytes "
                                f"({self.bytes})")
        object.__setattr__(self, "node_bytes", nb)


@dataclasses.dataclass(frozen=True)
class DecodeRankInfo(Message):
    """A multi-host decode's node ``node_rank`` (> 0) to node 0: its transfer session
    ``session_id`` and its own KV shards (``kv_layout``, ``kv_buffers`` at their current
    addresses), sent when node 0 asks (``kv_ranks``) and again, with ``generation`` one higher,
    each time its cache moved after a donated step (DESIGN.md §6)."""

    TYPE: ClassVar[MessageType] = MessageType.DECODE_RANK_INFO
    node_rank: int
    session_id: str
    kv_layout: str
    kv_buffers: tuple[KVBufferDesc, ...]
    generation: int

    def __post_init__(self):
        check_int("node_rank", self.node_rank, 1, MAX_SHARDS - 1)
        check_str("session_id", self.session_id)
        if self.kv_layout not in KV_LAYOUTS:
            raise ProtocolError(f"field 'kv_layout': {self.kv_layout!r} not in {KV_LAYOUTS}")
        bufs = check_list("kv_buffers", self.kv_buffers, 1, MAX_BUFFERS, "buffers")
        for i, b in enumerate(bufs):
            if not isinstance(b, KVBufferDesc):
                raise ProtocolError(f"field 'kv_buffers[{i}]': expected KVBufferDesc")
        object.__setattr__(self, "kv_buffers", tuple(bufs))
        check_int("generation", self.generation, 0, MAX_ADDR)

    def to_wire(self) -> dict:
        d = super().to_wire()
        d["kv_buffers"] = [b.to_wire() for b in self.kv_buffers]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "DecodeRankInfo":
        return cls(**dict(d, kv_buffers=kv_buffers_from_wire(d.get("kv_buffers"))))


_MESSAGE_CLASSES: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (RegisterDecode, RegisterResult, TransferRequest, TransferStatus, Abort,
                AbortAck, Heartbeat, RankWriteDone, DecodeRankInfo)
}


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
    check_keys(cls.TYPE.value, body, required, optional)
    try:
        return cls.from_wire(body)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{cls.TYPE.value}: {e}") from None
