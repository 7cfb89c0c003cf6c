"""The pages of DP attention's ranks: one allocator whose pages carry a rank, one prefix
cache over them, and which rank a request runs on (DESIGN.md §3, §6). Pure Python; never
imports JAX.

Under DP attention (``--enable-dp-attention --dp-size N``, ``models/dp_attention.py``) each
rank attends over its own KV pages. The scheduler sees one page space of ``dp * Np`` pages
in which page ``g`` is page ``g % Np`` of rank ``g // Np``; each rank's page 0 (global
``r * Np``) is its null page, never handed out::

    global ids:  [ 0 | 1 .. Np-1 ][ Np | Np+1 .. 2Np-1 ] ... [ (dp-1)Np | .. dpNp-1 ]
                   ^  rank 0       ^   rank 1                  ^   rank dp-1
                   null pages (padding of that rank's segment writes there)

A request runs on one rank for as long as it holds pages (``match_prefix`` at admission): the
rank whose cached pages hold the longest prefix of it (prefix-aware), unless that rank has
no free room for the rest while another has room for all of it; else the least loaded
(fewest requests, then fewest used pages; SGLang's DP controller balances the same way). A
cached prefix is used only as far as its pages stay on one rank (paths inserted by requests
of different ranks can meet in the radix tree). A retracted request is assigned again when
readmitted. Eviction is the prefix cache's LRU over all ranks until the rank asked for has
room (it may evict another rank's pages first: they are cache, not requests').
"""

from __future__ import annotations

from typing import Iterable

from pdjax.kv.allocator import PageAllocator, _as_int
from pdjax.kv.prefix_cache import RadixCache
from pdjax.request import Request
from pdjax.sched.kv_cache_manager import KVCacheManager


class RankedPageAllocator:
    """``PageAllocator``'s interface over ``dp_size`` ranks of ``pages_per_rank`` pages
    (global ids, the module docstring's layout); ``alloc`` takes a ``rank``. ``ValueError``
    for ``dp_size`` < 1 or ``pages_per_rank`` < 2."""

    def __init__(self, dp_size: int, pages_per_rank: int):
        dp_size = _as_int(dp_size, "dp_size")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.pages_per_rank = _as_int(pages_per_rank, "pages_per_rank")
        self.ranks = [PageAllocator(pages_per_rank) for _ in range(dp_size)]
        self.num_pages = dp_size * self.pages_per_rank

    def rank_of(self, page: int) -> int:
        return page // self.pages_per_rank

    @property
    def null_pages(self) -> frozenset[int]:
        return frozenset(r * self.pages_per_rank for r in range(self.dp_size))

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.ranks)

    def num_free_on(self, rank: int) -> int:
        return self.ranks[rank].num_free

    def alloc(self, n: int, rank: int = 0) -> list[int] | None:
        """``n`` pages of ``rank`` (global ids; ``PageAllocator.alloc`` there)."""
        local = self.ranks[rank].alloc(n)
        return None if local is None else [rank * self.pages_per_rank + p for p in local]

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` (any ranks') to their free lists; ``ValueError`` and no change
        for a null page, an id out of range, a free page or one listed twice."""
        pages = [_as_int(p, "page") for p in pages]
        if len(set(pages)) != len(pages):
            raise ValueError("pages: a page is listed twice")
        by_rank: dict[int, list[int]] = {}
        for p in pages:
            if not 0 <= p < self.num_pages or p % self.pages_per_rank == 0 or self.is_free(p):
                raise ValueError(f"pages: page {p} is a null page, out of range [0, "
                                 f"{self.num_pages}) or already free")
            by_rank.setdefault(self.rank_of(p), []).append(p % self.pages_per_rank)
        for rank, local in by_rank.items():
            self.ranks[rank].free(local)

    def is_free(self, page: int) -> bool:
        page = _as_int(page, "page")
        return 0 <= page < self.num_pages and self.ranks[self.rank_of(page)].is_free(
            page % self.pages_per_rank)

    def free_pages(self) -> frozenset[int]:
        return frozenset(r * self.pages_per_rank + p for r, a in enumerate(self.ranks)
                         for p in a.free_pages())

    def shuffle(self, seed: int) -> None:
        for r, a in enumerate(self.ranks):
            a.shuffle(seed + r)


class DpKVCacheManager(KVCacheManager):
    """``KVCacheManager`` for ``dp_size`` ranks of ``pages_per_rank`` pages each (the module
    docstring). Every method that takes a request works on its rank's pages."""

    def __init__(self, dp_size: int, pages_per_rank: int, page_size: int,
                 disable_radix_cache: bool = False):
        self.dp_size = dp_size
        self.pages_per_rank = pages_per_rank
        self.page_size = page_size
        self.allocator = RankedPageAllocator(dp_size, pages_per_rank)
        self.num_pages = self.allocator.num_pages
        self.prefix_cache = RadixCache(page_size, self.allocator, enabled=not disable_radix_cache)
        self.request_rank: dict[str, int] = {}      # rid -> rank (set at admission)
        self._holding: dict[str, Request] = {}      # the requests holding pages of their rank

    @property
    def null_pages(self) -> frozenset[int]:
        return self.allocator.null_pages

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.dp_size - self.allocator.num_free

    def rank_of(self, req: Request) -> int:
        """The rank ``req`` runs on (``assign``ed at admission; ``KeyError`` before)."""
        return self.request_rank[req.rid]

    def rank_load(self) -> list[dict]:
        """Per rank (``/get_load``'s ``dp_ranks``, what a router reads): ``{"rank",
        "num_requests", "num_used_pages", "num_free_pages", "num_pinned_pages", "kv_usage"}``:
        the requests holding pages there, its used (cache included) and free pages, the pages
        its requests hold (the prefix pages they share counted once), and those as a share
        of the rank's ``pages_per_rank - 1`` usable pages (``kv_usage`` in [0, 1], as the
        engine's, evictable cache left out)."""
        counts = [0] * self.dp_size
        pinned: list[set[int]] = [set() for _ in range(self.dp_size)]
        for rid, req in self._holding.items():
            rank = self.request_rank[rid]
            counts[rank] += 1
            pinned[rank].update(req.pages)
        usable = self.pages_per_rank - 1
        return [{"rank": r, "num_requests": counts[r],
                 "num_used_pages": usable - self.allocator.num_free_on(r),
                 "num_free_pages": self.allocator.num_free_on(r),
                 "num_pinned_pages": len(pinned[r]), "kv_usage": len(pinned[r]) / usable}
                for r in range(self.dp_size)]

    def least_loaded_rank(self) -> int:
        load = self.rank_load()
        return min(range(self.dp_size),
                   key=lambda r: (load[r]["num_requests"], load[r]["num_used_pages"], r))

    def match_prefix(self, req: Request, max_pages: int):
        """Assign ``req`` its rank (the module docstring) and match its cached prefix there:
        ``(pages, node)`` as ``RadixCache.match_prefix``, every page on the rank."""
        ids = req.all_ids
        pages, node = self.prefix_cache.match_prefix(ids, max_pages=max_pages)
        if pages:
            rank = self.allocator.rank_of(pages[0])
            run = next((i for i, p in enumerate(pages) if self.allocator.rank_of(p) != rank),
                       len(pages))
            if run < len(pages):
                pages, node = self.prefix_cache.match_prefix(ids, max_pages=run)
            # The prefix's rank is full (its free pages cannot take the rest) while another
            # has room for the whole request: compute the prefix again there, not wait.
            whole = -(-req.num_tokens // self.page_size) + 1
            roomy = [r for r in range(self.dp_size)
                     if self.allocator.num_free_on(r) >= whole]
            if self.allocator.num_free_on(rank) < whole - len(pages) and roomy:
                load = self.rank_load()
                rank = min(roomy, key=lambda r: (load[r]["num_requests"],
                                                 load[r]["num_used_pages"], r))
                pages, node = self.prefix_cache.match_prefix(ids, max_pages=0)
        else:
            rank = self.least_loaded_rank()
        self.request_rank[req.rid] = rank
        return pages, node

    def _make_free_on(self, rank: int, n: int) -> bool:
        while self.allocator.num_free_on(rank) < n:
            if not self.prefix_cache.evict(n - self.allocator.num_free_on(rank)):
                return False
        return True

    def same_pool(self, req: Request, reqs: Iterable[Request]) -> list[Request]:
        """Those of ``reqs`` assigned ``req``'s rank (a PD decode's headroom is a rank's)."""
        rank = self.rank_of(req)
        return [r for r in reqs if self.request_rank.get(r.rid) == rank]

    def make_free(self, n: int, req: Request | None = None) -> bool:
        """Evict until ``n`` pages are free on ``req``'s rank (None: anywhere)."""
        if req is None:
            return super().make_free(n)
        return self._make_free_on(self.rank_of(req), n)

    def make_room(self, reqs: list[Request]) -> bool:
        """Room on each rank for its requests among ``reqs`` to hold ``num_tokens`` tokens."""
        need = [0] * self.dp_size
        for r in reqs:
            need[self.rank_of(r)] += self.pages_needed(r, r.num_tokens)
        return all(self._make_free_on(rank, n) for rank, n in enumerate(need) if n)

    def grow(self, req: Request, num_tokens: int) -> bool:
        n = self.pages_needed(req, num_tokens)
        if n == 0:
            return True
        rank = self.rank_of(req)
        if not self._make_free_on(rank, n):
            return False
        req.pages.extend(self.allocator.alloc(n, rank))
        self._holding[req.rid] = req
        return True

    def alloc_free(self, req: Request, n: int) -> bool:
        """``n`` free pages of ``req``'s rank (no eviction; a draft's, ``spec_rows``): the
        verify row attends over its rank's pages only."""
        rank = self.rank_of(req)
        if n > self.allocator.num_free_on(rank):
            return False
        if n:
            req.pages.extend(self.allocator.alloc(n, rank))
        return True

    def release(self, req: Request) -> None:
        super().release(req)
        self.request_rank.pop(req.rid, None)
        self._holding.pop(req.rid, None)
