"""Limits and field checks of the PD control protocol (``protocol.py``'s messages use them).

Every check raises ``ProtocolError`` (a ``ValueError``) naming the field; ``bool`` is never
accepted as an int. Page lists travel as packed little-endian uint32 bytes. Pure Python
(numpy); never imports JAX.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Sequence

import numpy as np

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

ENDPOINT_RE = re.compile(r"^tcp://[A-Za-z0-9_.:\[\]-]+:([0-9]{1,5})$")


class ProtocolError(ValueError):
    """A frame or field that breaks the protocol; the message names the offending field."""


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"field {name!r}: expected int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ProtocolError(f"field {name!r}: {value} outside [{lo}, {hi}]")
    return value


def check_str(name: str, value: Any, max_len: int = MAX_STR, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"field {name!r}: expected str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ProtocolError(f"field {name!r}: must not be empty")
    if len(value) > max_len:
        raise ProtocolError(f"field {name!r}: length {len(value)} exceeds {max_len}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name!r}: expected bool, got {type(value).__name__}")
    return value


def check_digest(name: str, value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != PROMPT_DIGEST_BYTES:
        raise ProtocolError(f"field {name!r}: expected {PROMPT_DIGEST_BYTES} bytes, got "
                            f"{type(value).__name__} of length "
                            f"{len(value) if isinstance(value, (bytes, str)) else '-'}")
    return value


def check_room(name: str, value: Any) -> int:
    return check_int(name, value, 1, MAX_ROOM)


def check_endpoint(name: str, value: Any) -> str:
    value = check_str(name, value)
    m = ENDPOINT_RE.match(value)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise ProtocolError(f"field {name!r}: {value!r} is not a 'tcp://host:port' endpoint")
    return value


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """What identifies a prompt across servers: BLAKE2b (16 bytes) of its token ids as
    little-endian int32. The decode sends it with its page list, the prefill refuses a room whose
    prompt differs, and the metadata row carries it back."""
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
    naming ``name`` for a non-integer (or ``bool``) entry, an index out of range, or a duplicate (two source
    pages written into one destination page would corrupt it).
    """
    if isinstance(indices, (list, tuple)) and any(isinstance(p, bool) for p in indices):
        # np.asarray([3, True]) is an int array: a bool is refused before it becomes page 1.
        raise ProtocolError(f"field {name!r}: page indices must be integers, got a bool")
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


def pack_pages(pages: Sequence[int]) -> bytes:
    return np.asarray(pages, dtype="<u4").tobytes()


def unpack_pages(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, (bytes, bytearray)):
        raise ProtocolError(f"field {name!r}: expected packed uint32 bytes, "
                            f"got {type(value).__name__}")
    if len(value) % 4:
        raise ProtocolError(f"field {name!r}: byte length {len(value)} is not a multiple of 4")
    return np.frombuffer(value, dtype="<u4")


def check_pages(name: str, value: Any) -> tuple[int, ...]:
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
    return tuple(check_int(f"{name}[{i}]", p, 0, MAX_PAGES) for i, p in enumerate(value))


def check_keys(where: str, d: dict, allowed: set[str], optional: set[str] = frozenset()) -> None:
    """``d``'s keys are strings, every one of ``allowed`` and none outside ``allowed`` and
    ``optional``; ``ProtocolError`` naming ``where`` and the field otherwise."""
    for k in d:
        if not isinstance(k, str):
            raise ProtocolError(f"{where}: non-string key {k!r}")
    unknown = sorted(set(d) - allowed - optional)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown}")
    missing = sorted(allowed - set(d))
    if missing:
        raise ProtocolError(f"field {missing[0]!r}: missing in {where}")


def check_list(name: str, value: Any, lo: int, hi: int, items: str) -> tuple:
    """``value`` as a tuple: a list or tuple (not a str or bytes) of ``lo``..``hi`` ``items``
    (a plural noun for the message); ``ProtocolError`` naming the field otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ProtocolError(f"field {name!r}: expected a list of {items}")
    if not lo <= len(value) <= hi:
        raise ProtocolError(f"field {name!r}: {len(value)} {items} outside [{lo}, {hi}]")
    return tuple(value)
