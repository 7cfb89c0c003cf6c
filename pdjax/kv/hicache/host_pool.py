"""The host tier's memory: a pool of KV pages in host RAM and the index of what it holds
(DESIGN.md §3, "Host tier"; SGLang's ``HostKVCache`` and its host radix nodes).

``HostKVPool`` keeps one numpy array per KV buffer of the model's cache in the transfer path's
page format (layer-major ``[layers, num_slots, page_size, ...]``, the arrays
``runner.gather_pages`` returns), so a page moves between the device pool and a host slot as one
gather or scatter. ``HostIndex`` maps page hashes (``page_hash.page_hashes``) to slots, in LRU
order, with pins (a slot being read into the device) and pending writes (a slot reserved, its
bytes still on the way from the device). Pure Python and numpy.

    slots = index entries (readable) + pending writes (reserved) + free      (disjoint)

A path's pages are touched deepest first, so an ancestor page is always more recent than its
descendants and LRU eviction takes a leaf of the prefix tree before the pages it extends.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np


class HostKVPool:
    """``num_slots`` host pages of every KV buffer.

    ``buffer_shapes``: per KV buffer ``(shape, dtype)`` of the device array ``[layers,
    num_pages, page_size, ...]`` (the second axis is replaced by ``num_slots``). ``ValueError``
    for ``num_slots < 1``. Memory is zeroed lazily by the OS (``np.zeros``)."""

    def __init__(self, buffer_shapes: Sequence[tuple[tuple[int, ...], object]], num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = int(num_slots)
        self.buffers = [np.zeros((shape[0], self.num_slots, *shape[2:]), dtype)
                        for shape, dtype in buffer_shapes]
        self.bytes_per_page = page_bytes(buffer_shapes)

    def read(self, slots: Sequence[int]) -> list[np.ndarray]:
        """Copies of ``slots``' pages, ``[layers, len(slots), ...]`` per buffer."""
        idx = np.asarray(slots, np.int64)
        return [b[:, idx] for b in self.buffers]

    def write(self, slots: Sequence[int], parts: Sequence[np.ndarray]) -> None:
        """Store ``parts[k][:, i]`` (as ``read`` returns them; a longer second axis is
        padding) in slot ``slots[i]`` of buffer ``k``."""
        idx = np.asarray(slots, np.int64)
        for b, p in zip(self.buffers, parts):
            b[:, idx] = p[:, :len(idx)]


def page_bytes(buffer_shapes: Sequence[tuple[tuple[int, ...], object]]) -> int:
    """Bytes of one page over every buffer and layer."""
    return sum(shape[0] * math.prod(shape[2:]) * np.dtype(dtype).itemsize
               for shape, dtype in buffer_shapes)


class HostIndex:
    """Page hash -> host slot for ``num_slots`` slots, LRU first (see the module docstring).

    ``match`` / ``slots`` read only readable entries; ``reserve`` takes slots for pages being
    written (evicting unpinned LRU entries), ``commit`` makes them readable, ``cancel`` frees
    them. ``ValueError`` for ``num_slots < 1``."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._entries: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._pending: dict[bytes, int] = {}
        self._pins: collections.Counter[int] = collections.Counter()
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evicted = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Slots holding or about to hold a page."""
        return self.num_slots - len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def is_known(self, h: bytes) -> bool:
        """Whether page ``h`` is held or being written."""
        return h in self._entries or h in self._pending

    def is_pending(self, h: bytes) -> bool:
        """Whether page ``h`` has a slot but its bytes are still on the way."""
        return h in self._pending

    def match(self, hashes: Sequence[bytes], start: int) -> int:
        """How many pages of ``hashes`` from index ``start`` on are held, consecutively."""
        n = 0
        while start + n < len(hashes) and hashes[start + n] in self._entries:
            n += 1
        return n

    def slots(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of held pages ``hashes``; ``KeyError`` for one not held."""
        return [self._entries[h] for h in hashes]

    # ---- use -----------------------------------------------------------------------------
    def touch(self, hashes: Sequence[bytes]) -> None:
        """Make the held pages of a path (``hashes``, first page first) the most recent,
        deepest first so each ancestor ends newer than its descendants."""
        for h in reversed(hashes):
            if h in self._entries:
                self._entries.move_to_end(h)

    def pin(self, slots: Sequence[int]) -> None:
        """Keep ``slots`` from eviction until ``unpin`` (a load reads them)."""
        self._pins.update(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        """Undo one ``pin``; ``ValueError`` for a slot not pinned."""
        if any(self._pins[s] <= 0 for s in slots):
            raise ValueError(f"unpin of unpinned slots {list(slots)}")
        self._pins.subtract(slots)
        self._pins += collections.Counter()          # drop the zero counts

    # ---- writes --------------------------------------------------------------------------
    def reserve(self, hashes: Sequence[bytes]) -> list[int]:
        """A slot for each new page ``hashes`` (none known), taken from the free slots or by
        evicting unpinned LRU entries; fewer (a prefix of them) when no more can be made.
        The pages are pending until ``commit`` or ``cancel``."""
        out = []
        for h in hashes:
            if h in self._entries or h in self._pending:
                raise ValueError("reserve of a page the host tier already knows")
            if not self._free and not self._evict_one():
                break
            slot = self._free.pop()
            self._pending[h] = slot
            out.append(slot)
        return out

    def commit(self, path: Sequence[bytes]) -> None:
        """The pending pages of ``path`` (a prefix's hashes, first page first) have their
        bytes: they become readable, and the path's pages the most recent (deepest first)."""
        for h in reversed(path):
            slot = self._pending.pop(h, None)
            if slot is not None:
                self._entries[h] = slot
            elif h in self._entries:
                self._entries.move_to_end(h)

    def cancel(self, hashes: Sequence[bytes]) -> None:
        """Free the slots of pending pages ``hashes`` (a write that will not land)."""
        for h in hashes:
            slot = self._pending.pop(h, None)
            if slot is not None:
                self._free.append(slot)

    def _evict_one(self) -> bool:
        for h, slot in self._entries.items():
            if slot not in self._pins:
                del self._entries[h]
                self._free.append(slot)
                self.num_evicted += 1
                return True
        return False

    def check(self) -> None:
        """``AssertionError`` unless held, pending and free slots partition the pool (each
        side counted on its own) and pins name held slots."""
        held, pending, free = list(self._entries.values()), list(self._pending.values()), \
            self._free
        every = held + pending + free
        assert len(every) == len(set(every)) == self.num_slots, \
            f"host slots leaked or doubled: {len(set(every))} of {self.num_slots}"
        assert set(self._pins) <= set(held), "a pinned slot holds no page"
