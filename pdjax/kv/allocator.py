"""KV page allocator: a free list over the pages of the paged KV pool (DESIGN.md §3).

Pure Python; never imports JAX. Page 0 is the reserved null page: padded tokens write their KV
there (DESIGN.md §2), so it is never handed out.

    pool:  [ 0 | 1 | 2 | 3 | ... | num_pages-1 ]
             ^   '-- allocatable: pages 1 .. num_pages-1 --'
             null page (padding writes)

Allocation takes the lowest-ranked free pages. In a fresh pool the rank of a page is its id, so
requests get low, contiguous runs (PD transfers merge contiguous runs into one copy each).
``shuffle`` replaces the ranks with a random permutation, which keeps the pool fragmented for
good: tests use it to prove that nothing relies on contiguity.
"""

from __future__ import annotations

import heapq
import operator
import random
from typing import Iterable


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


class PageAllocator:
    """Free list over pages ``1 .. num_pages-1``; page 0 is the reserved null page.

    ``alloc`` is all-or-nothing and returns page ids (python ints) in allocation order; ``free``
    validates the whole argument before changing anything. Both are O(n log num_pages).

    Raises ``ValueError`` if ``num_pages`` is not an integer >= 2.
    """

    def __init__(self, num_pages: int):
        num_pages = _as_int(num_pages, "num_pages")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        # rank[page] orders the free list; page_at_rank inverts it. The heap holds ranks.
        self._rank = list(range(num_pages))
        self._page_at_rank = list(range(num_pages))
        self._heap = list(range(1, num_pages))      # a sorted list is a valid heap
        self._is_free = bytearray([0] + [1] * (num_pages - 1))

    @property
    def num_free(self) -> int:
        """Number of pages in the free list."""
        return len(self._heap)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages (lowest rank first); ``None`` and no change if fewer are free.

        Raises ``ValueError`` if ``n`` is not an integer >= 0.
        """
        n = _as_int(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._heap):
            return None
        pages = []
        for _ in range(n):
            page = self._page_at_rank[heapq.heappop(self._heap)]
            self._is_free[page] = 0
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the free list.

        Raises ``ValueError`` (and changes nothing) if any page is 0, outside
        ``[1, num_pages)``, already free, or listed twice.
        """
        pages = [_as_int(p, "page") for p in pages]
        seen = set()
        for p in pages:
            if p == 0:
                raise ValueError("page 0 is the reserved null page and cannot be freed")
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} out of range [1, {self.num_pages})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
            heapq.heappush(self._heap, self._rank[p])

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is in the free list (False for page 0 and out-of-range ids)."""
        page = _as_int(page, "page")
        return 0 < page < self.num_pages and bool(self._is_free[page])

    def free_pages(self) -> frozenset[int]:
        """The pages in the free list, read from the heap itself (for invariant checks)."""
        return frozenset(self._page_at_rank[r] for r in self._heap)

    def shuffle(self, seed: int) -> None:
        """Give pages 1.. a random allocation order (seeded), now and after later frees."""
        order = list(range(1, self.num_pages))
        random.Random(seed).shuffle(order)
        for rank, page in enumerate(order, start=1):
            self._rank[page] = rank
            self._page_at_rank[rank] = page
        self._heap = [self._rank[p] for p in range(1, self.num_pages) if self._is_free[p]]
        heapq.heapify(self._heap)
