"""HiCache's storage tier (L3): the stored page format and the backend interface
(DESIGN.md §3, "Storage tier"; SGLang's ``--hicache-storage-backend``).

A stored page is one KV page of every buffer and layer, keyed by its chained page hash
(``page_hash.page_hashes``: one key names a whole prefix), so a restarted server, or another
server sharing the store, finds what was computed before. Each record carries a header that
makes a corrupt, truncated, misplaced or foreign record detectable before a byte of it is
served:

    offset  size  field
    0       8     magic b"PDJXKV\\x00\\x01"
    8       16    fingerprint: BLAKE2b-128 of the KV format (see ``kv_fingerprint``)
    24      16    key: the page hash the record was written under
    40      8     payload length in bytes (little-endian uint64)
    48      4     CRC-32 of the payload (zlib.crc32, little-endian uint32)
    52      ...   payload: each buffer's page ``[layers, page_size, ...]`` C-order, in
                  ``cache_specs`` order

``decode_page`` raises ``StoredPageError`` (a ``ValueError``) naming what does not match; the
tier then drops the record and recomputes the page. Pure Python and numpy.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from typing import Any, Protocol, Sequence

import numpy as np

from pdjax.kv.hicache_config import STORAGE_BACKENDS, parse_storage_config  # noqa: F401

MAGIC = b"PDJXKV\x00\x01"
_HEADER = struct.Struct("<8s16s16sQI")
HEADER_BYTES = _HEADER.size          # 52


class StoredPageError(ValueError):
    """A stored record that must not be served (bad magic, other KV format, other key,
    wrong length, checksum mismatch)."""


def kv_fingerprint(model_id: str, page_size: int,
                   buffers: Sequence[tuple[str, tuple[int, ...], Any]]) -> bytes:
    """16 bytes naming the KV format of a stored page: the model's id (``model_id``, e.g. the
    checkpoint folder's name), the page size and each buffer's name, per-page shape
    ``[layers, page_size, ...]`` and dtype (``buffers``: ``(name, device shape [layers,
    num_pages, page_size, ...], dtype)``). A record written under another fingerprint is
    refused."""
    desc = {"model": model_id, "page_size": int(page_size),
            # The dtype's name too: numpy spells every 1-byte float8 "<V1" or the like.
            "buffers": [[name, [int(shape[0]), *map(int, shape[2:])], np.dtype(dtype).str,
                         np.dtype(dtype).name] for name, shape, dtype in buffers]}
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).digest()


class PageCodec:
    """Encodes and decodes one page of the host pool's buffers (``shapes``: per buffer the
    device shape ``[layers, num_pages, page_size, ...]`` and dtype) under ``fingerprint``."""

    def __init__(self, shapes: Sequence[tuple[tuple[int, ...], Any]], fingerprint: bytes):
        if len(fingerprint) != 16:
            raise ValueError(f"fingerprint must be 16 bytes, got {len(fingerprint)}")
        self.fingerprint = fingerprint
        self.page_shapes = [((shape[0], *shape[2:]), np.dtype(dtype)) for shape, dtype in shapes]
        self.sizes = [math.prod(s) * d.itemsize for s, d in self.page_shapes]
        self.payload_bytes = sum(self.sizes)
        self.record_bytes = HEADER_BYTES + self.payload_bytes

    def encode(self, key: bytes, parts: Sequence[np.ndarray]) -> bytes:
        """The record of page ``key`` whose buffers are ``parts`` (``[layers, page_size,
        ...]`` each, the shapes and dtypes of the codec; ``ValueError`` otherwise)."""
        chunks = []
        for p, (shape, dtype) in zip(parts, self.page_shapes, strict=True):
            if p.shape != shape or p.dtype != dtype:
                raise ValueError(f"page part {p.shape} {p.dtype} is not {shape} {dtype}")
            chunks.append(np.ascontiguousarray(p).tobytes())
        payload = b"".join(chunks)
        return _HEADER.pack(MAGIC, self.fingerprint, key, len(payload),
                            zlib.crc32(payload)) + payload

    def decode(self, key: bytes, record: bytes | memoryview) -> list[np.ndarray]:
        """The buffers of page ``key`` from ``record`` (copies). ``StoredPageError`` naming
        the first check that fails."""
        if len(record) < HEADER_BYTES:
            raise StoredPageError(f"truncated header: {len(record)} of {HEADER_BYTES} bytes")
        magic, fp, rkey, length, crc = _HEADER.unpack_from(record, 0)
        if magic != MAGIC:
            raise StoredPageError(f"bad magic {magic!r}")
        if fp != self.fingerprint:
            raise StoredPageError("written for another model or KV format (fingerprint "
                                  f"{fp.hex()}, this server's {self.fingerprint.hex()})")
        if rkey != key:
            raise StoredPageError(f"holds page {rkey.hex()}, not {key.hex()}")
        if length != self.payload_bytes:
            raise StoredPageError(f"payload length {length}, expected {self.payload_bytes}")
        payload = memoryview(record)[HEADER_BYTES:]
        if len(payload) != length:
            raise StoredPageError(f"truncated: {len(payload)} of {length} payload bytes")
        if zlib.crc32(payload) != crc:
            raise StoredPageError("checksum mismatch")
        out, off = [], 0
        for (shape, dtype), size in zip(self.page_shapes, self.sizes):
            out.append(np.frombuffer(payload[off:off + size], dtype).reshape(shape).copy())
            off += size
        return out


class StorageBackend(Protocol):
    """A key -> bytes store behind the host tier (keys: ``storage_tier``'s, 20 bytes). Called on the storage thread only, but for
    ``exists`` (the engine thread, at admission: it must be cheap). Errors are ``OSError``
    or ``RuntimeError``; the tier logs them and recomputes."""

    def exists(self, key: bytes) -> bool:
        """Whether a record is stored under ``key``."""

    def get(self, key: bytes) -> bytes | None:
        """The record under ``key``, None when there is none."""

    def set(self, key: bytes, record: bytes) -> None:
        """Store ``record`` under ``key``, whole or not at all."""

    def delete(self, key: bytes) -> None:
        """Drop the record under ``key`` (a bad one), if any."""

    def close(self) -> None:
        """Release the backend's resources."""


def make_storage_backend(backend: str, cfg: dict[str, Any]) -> StorageBackend:
    """The backend ``backend`` with its checked config (``parse_storage_config``).
    ``OSError`` / ``RuntimeError`` when it cannot start (a folder not writable, no master)."""
    if backend == "file":
        from pdjax.kv.hicache.storage_file import FileStorage
        return FileStorage(cfg["path"])
    from pdjax.kv.hicache.storage_mooncake import MooncakeStorage
    return MooncakeStorage(cfg)
