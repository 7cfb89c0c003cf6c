"""MetadataBuffers: a fixed pool of host-memory slots for the prefill -> decode handoff.

DESIGN.md §4 step 5 (SGLang's MetadataBuffers). Prefill writes one row into its own slot
after sampling the first token, then copies the row into the decode's slot with the last KV
chunk. Decode accepts the transfer only if the row's ``bootstrap_room`` equals the request's room
and its ``prompt_digest`` the digest of the request's prompt (the metadata gate; the digest binds
the KV to the prompt, not just to a room a client chose); 0 means "not written", so
rooms start at 1 and a slot is zeroed before it is handed out again (SGLang PR 27374: a stale
room caused false corruption aborts).

Row layout (little-endian, one numpy structured row, padded to a multiple of 64 bytes, the
smallest RDMA write)::

    offset  field                  dtype
    0       bootstrap_room         uint64
    8       output_token_id        int32    first sampled token
    12      cached_tokens          int32    prefill prefix-cache hit tokens
    16      output_token_logprob   float32  logprob of the first token
    20      num_top_logprobs       int32    valid entries below (<= K)
    24      prompt_digest          uint8[16] ``wire.prompt_digest`` of the prompt
    40      top_logprob_ids        int32[K]
    40+4K   top_logprob_vals       float32[K]
    40+8K   padding to bytes_per_slot

K is the largest count that fits the padded row, so ``bytes_per_slot`` alone fixes the layout:
two sides with equal ``bytes_per_slot`` agree on every offset. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import numpy as np

from pdjax.transfer.engine import Copy, TransferEngine

ROW_ALIGN = 64
DIGEST_BYTES = 16
_HEADER_BYTES = 24 + DIGEST_BYTES


def _row_dtype(bytes_per_slot: int) -> tuple[np.dtype, int]:
    k = (bytes_per_slot - _HEADER_BYTES) // 8
    dtype = np.dtype({
        "names": ["bootstrap_room", "output_token_id", "cached_tokens", "output_token_logprob",
                  "num_top_logprobs", "prompt_digest", "top_logprob_ids", "top_logprob_vals"],
        "formats": ["<u8", "<i4", "<i4", "<f4", "<i4", ("u1", (DIGEST_BYTES,)), ("<i4", (k,)),
                    ("<f4", (k,))],
        "offsets": [0, 8, 12, 16, 20, 24, _HEADER_BYTES, _HEADER_BYTES + 4 * k],
        "itemsize": bytes_per_slot,
    })
    return dtype, k


@dataclasses.dataclass(frozen=True)
class MetadataRow:
    """One decoded slot. ``top_logprob_ids``/``top_logprob_vals`` hold ``num_top_logprobs``
    entries (ids are token ids, values natural-log probabilities)."""

    bootstrap_room: int
    output_token_id: int
    cached_tokens: int
    output_token_logprob: float
    top_logprob_ids: tuple[int, ...] = ()
    top_logprob_vals: tuple[float, ...] = ()
    prompt_digest: bytes = bytes(DIGEST_BYTES)


class MetadataBuffers:
    """``num_slots`` rows of ``bytes_per_slot`` bytes in one 64-byte-aligned host buffer.

    ``max_top_logprobs``: the minimum number of top-logprob pairs a row must hold; the row is
    padded to a multiple of 64 bytes and K grows to fill it (see module docstring). The buffer
    never moves, so ``base_addr`` can be registered once. ``alloc``/``free`` are thread-safe.
    Raises ``ValueError`` naming the argument for a bad size, slot or double free.
    """

    def __init__(self, num_slots: int, max_top_logprobs: int = 20):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots: expected an int >= 1, got {num_slots!r}")
        if isinstance(max_top_logprobs, bool) or not isinstance(max_top_logprobs, int) \
                or not 0 <= max_top_logprobs <= 4096:
            raise ValueError(f"max_top_logprobs: expected an int in [0, 4096], "
                             f"got {max_top_logprobs!r}")
        raw = _HEADER_BYTES + 8 * max_top_logprobs
        self.bytes_per_slot = -(-raw // ROW_ALIGN) * ROW_ALIGN
        self.num_slots = num_slots
        self.dtype, self.max_top_logprobs = _row_dtype(self.bytes_per_slot)
        nbytes = num_slots * self.bytes_per_slot
        self._backing = np.zeros(nbytes + ROW_ALIGN, dtype=np.uint8)
        start = (-self._backing.ctypes.data) % ROW_ALIGN
        self._bytes = self._backing[start:start + nbytes]
        self.rows = self._bytes.view(self.dtype)
        self.base_addr = int(self._bytes.ctypes.data)
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self._in_use: set[int] = set()

    # -- pool ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed free slot, or ``None`` if all are in use."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._in_use.add(slot)
        self._zero(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool, zeroing it (its room becomes 0, "unwritten")."""
        self._check_slot(slot)
        with self._lock:
            if slot not in self._in_use:
                raise ValueError(f"slot: {slot} is not allocated (double free?)")
            self._in_use.remove(slot)
            self._zero(slot)
            self._free.append(slot)

    def _zero(self, slot: int) -> None:
        b = slot * self.bytes_per_slot
        self._bytes[b:b + self.bytes_per_slot] = 0

    def _check_slot(self, slot: int, name: str = "slot") -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) \
                or not 0 <= slot < self.num_slots:
            raise ValueError(f"{name}: {slot!r} outside [0, {self.num_slots})")
        return int(slot)

    # -- rows ----------------------------------------------------------------------------------

    def write(self, slot: int, bootstrap_room: int, output_token_id: int, cached_tokens: int = 0,
              output_token_logprob: float = 0.0, top_logprob_ids: Sequence[int] = (),
              top_logprob_vals: Sequence[float] = (),
              prompt_digest: bytes = bytes(DIGEST_BYTES)) -> None:
        """Fill row ``slot`` (prefill side, after the first token is sampled).

        ``bootstrap_room`` in [1, 2**64); ``top_logprob_ids``/``vals`` of equal length
        <= ``max_top_logprobs``; ``prompt_digest``: 16 bytes. Raises ``ValueError`` naming the
        field.
        """
        slot = self._check_slot(slot)
        if isinstance(bootstrap_room, bool) or not 1 <= int(bootstrap_room) < 1 << 64:
            raise ValueError(f"bootstrap_room: {bootstrap_room!r} outside [1, 2**64)")
        if len(top_logprob_ids) != len(top_logprob_vals):
            raise ValueError(f"top_logprob_vals: length {len(top_logprob_vals)} != "
                             f"top_logprob_ids length {len(top_logprob_ids)}")
        if not isinstance(prompt_digest, bytes) or len(prompt_digest) != DIGEST_BYTES:
            raise ValueError(f"prompt_digest: expected {DIGEST_BYTES} bytes, got "
                             f"{prompt_digest!r}")
        n = len(top_logprob_ids)
        if n > self.max_top_logprobs:
            raise ValueError(f"top_logprob_ids: {n} entries exceed max_top_logprobs "
                             f"{self.max_top_logprobs}")
        rows = self.rows
        rows["output_token_id"][slot] = output_token_id
        rows["cached_tokens"][slot] = cached_tokens
        rows["output_token_logprob"][slot] = output_token_logprob
        rows["num_top_logprobs"][slot] = n
        rows["prompt_digest"][slot] = np.frombuffer(prompt_digest, dtype=np.uint8)
        rows["top_logprob_ids"][slot] = 0
        rows["top_logprob_vals"][slot] = 0
        rows["top_logprob_ids"][slot, :n] = np.asarray(top_logprob_ids, dtype=np.int32)
        rows["top_logprob_vals"][slot, :n] = np.asarray(top_logprob_vals, dtype=np.float32)
        # The room goes last: a reader that sees the room sees the rest of the row.
        self.rows["bootstrap_room"][slot] = int(bootstrap_room)

    def room(self, slot: int) -> int:
        """The row's ``bootstrap_room`` (0 = not written); the metadata gate reads this."""
        return int(self.rows["bootstrap_room"][self._check_slot(slot)])

    def read(self, slot: int) -> MetadataRow:
        """Decode row ``slot``. Raises ``ValueError`` if ``num_top_logprobs`` is out of range
        (a corrupt row)."""
        row = self.rows[self._check_slot(slot)]
        n = int(row["num_top_logprobs"])
        if not 0 <= n <= self.max_top_logprobs:
            raise ValueError(f"num_top_logprobs: {n} outside [0, {self.max_top_logprobs}] "
                             f"in slot {slot}")
        return MetadataRow(
            bootstrap_room=int(row["bootstrap_room"]),
            output_token_id=int(row["output_token_id"]),
            cached_tokens=int(row["cached_tokens"]),
            output_token_logprob=float(row["output_token_logprob"]),
            top_logprob_ids=tuple(int(x) for x in row["top_logprob_ids"][:n]),
            top_logprob_vals=tuple(float(x) for x in row["top_logprob_vals"][:n]),
            prompt_digest=row["prompt_digest"].tobytes())

    def slot_addr(self, slot: int) -> int:
        """Address of row ``slot`` (bytes ``[addr, addr + bytes_per_slot)``)."""
        return self.base_addr + self._check_slot(slot) * self.bytes_per_slot

    def copy_to(self, src_slot: int, dst_base_addr: int, dst_slot: int, dst_num_slots: int,
                dst_bytes_per_slot: int) -> Copy:
        """The copy that moves row ``src_slot`` into a peer's slot ``dst_slot``.

        The peer's pool comes from its registration; ``dst_slot`` must be in
        ``[0, dst_num_slots)`` and ``dst_bytes_per_slot`` must equal ours (same row layout).
        Raises ``ValueError`` naming the field.
        """
        src_slot = self._check_slot(src_slot, "src_slot")
        if dst_bytes_per_slot != self.bytes_per_slot:
            raise ValueError(f"dst_bytes_per_slot: {dst_bytes_per_slot} != local "
                             f"{self.bytes_per_slot} (row layouts differ)")
        if isinstance(dst_slot, bool) or not 0 <= dst_slot < dst_num_slots:
            raise ValueError(f"dst_slot: {dst_slot!r} outside [0, {dst_num_slots})")
        return (self.slot_addr(src_slot), int(dst_base_addr) + int(dst_slot) * self.bytes_per_slot,
                self.bytes_per_slot)

    # -- registration --------------------------------------------------------------------------

    def register(self, engine: TransferEngine) -> None:
        """Register the whole pool with ``engine`` (label ``metadata``)."""
        engine.register_memory(self.base_addr, self.nbytes, label="metadata")

    def unregister(self, engine: TransferEngine) -> None:
        engine.unregister_memory(self.base_addr)
