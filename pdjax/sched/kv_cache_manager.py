"""The pages of the requests' KV: the page allocator and the prefix cache, and what the
scheduler does with a request's pages (nano-vllm's block manager, vLLM's ``KVCacheManager``;
DESIGN.md §3, "Prefix cache"). Pure Python; never imports JAX.

    request.pages = [cached prefix pages (the prefix cache's, locked) | own pages]

A request's own pages become the prefix cache's when their tokens are computed (``share``,
at scheduling; ``release``, at the end); pages it never computed (a prompt whose KV did not
arrive, rejected drafts) go back to the free list, never into the cache.
"""

from __future__ import annotations

from typing import Iterable

from pdjax.kv.allocator import PageAllocator
from pdjax.kv.prefix_cache import RadixCache
from pdjax.request import PENDING_TOKEN, Request


class KVCacheManager:
    """``num_pages`` pages of ``page_size`` tokens (page 0 is the null page), cached by token
    prefix unless ``disable_radix_cache``."""

    def __init__(self, num_pages: int, page_size: int, disable_radix_cache: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = RadixCache(page_size, self.allocator, enabled=not disable_radix_cache)

    @property
    def num_used_pages(self) -> int:
        """Pages not on the free list (requests' and the prefix cache's)."""
        return self.num_pages - 1 - self.allocator.num_free

    @property
    def null_pages(self) -> frozenset[int]:
        """Pages never handed out (padding writes there): page 0."""
        return frozenset((0,))

    def match_prefix(self, req: Request, max_pages: int):
        """``req``'s cached prefix, at most ``max_pages`` pages: ``(pages, node)`` as
        ``RadixCache.match_prefix`` (DP attention's manager also picks the request's rank)."""
        return self.prefix_cache.match_prefix(req.all_ids, max_pages=max_pages)

    def make_room(self, reqs: list[Request]) -> bool:
        """Evict until ``reqs`` can all grow to hold ``num_tokens`` tokens; False if not."""
        return self.make_free(sum(self.pages_needed(r, r.num_tokens) for r in reqs))

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        """New pages ``req`` needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def same_pool(self, req: Request, reqs: Iterable[Request]) -> list[Request]:
        """Those of ``reqs`` whose pages come from ``req``'s pool (one pool here: all)."""
        return list(reqs)

    def make_free(self, n: int, req: Request | None = None) -> bool:
        """Evict from the prefix cache until ``n`` pages are free; False if impossible.
        ``req``: the request they are for (one pool here: unused)."""
        short = n - self.allocator.num_free
        if short > 0:
            self.prefix_cache.evict(short)
        return self.allocator.num_free >= n

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages to hold ``num_tokens`` tokens; False (no change) if impossible."""
        n = self.pages_needed(req, num_tokens)
        if n == 0:
            return True
        if not self.make_free(n):
            return False
        req.pages.extend(self.allocator.alloc(n))
        return True

    def alloc_free(self, req: Request, n: int) -> bool:
        """Give ``req`` ``n`` more pages from the free list only (no eviction: what a
        speculative draft may take, ``spec_rows``); False (no change) when too few are free.
        Under DP attention the pages come from ``req``'s rank."""
        if n > self.allocator.num_free:
            return False
        if n:
            req.pages.extend(self.allocator.alloc(n))
        return True

    def num_shared_pages(self, req: Request) -> int:
        """How many of ``req.pages`` (from the first) belong to the prefix cache: the path
        its lock holds, the prefix it matched plus the full pages it shared while running."""
        return 0 if req.prefix_node is None else self.prefix_cache.num_path_pages(req.prefix_node)

    def share(self, req: Request, num_tokens: int) -> None:
        """The full pages of ``req``'s first ``num_tokens`` tokens, which this step computes,
        join the prefix cache now: a request admitted later in this step, or after, reuses
        them instead of computing the same prefix again (in-batch prefix sharing; vLLM caches
        a block when it schedules it). A row of the same forward may attend to them: every
        model writes a layer's KV for all the forward's tokens before any token of that layer
        reads the cache (DESIGN.md §3, "Prefix cache")."""
        full = min(num_tokens // self.page_size, len(req.pages))
        if req.prefix_node is None or full <= self.num_shared_pages(req):
            return
        ids = req.all_ids[:full * self.page_size]
        if PENDING_TOKEN in ids:
            return
        node = self.prefix_cache.extend_locked(req.prefix_node, ids, req.pages[:full])
        if node is not None:
            req.prefix_node = node

    def release(self, req: Request) -> None:
        """Return ``req``'s pages: full computed pages into the prefix cache, the rest freed."""
        # Shared pages are the cache's already (a forward launched after their scheduling
        # writes their KV, even when the request is dropped before it reads them).
        full = max(min(req.num_computed_tokens // self.page_size, len(req.pages)),
                   self.num_shared_pages(req))
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        self.prefix_cache.insert(req.all_ids[:full * self.page_size], req.pages[:full])
        if req.pages[full:]:
            self.allocator.free(req.pages[full:])
        req.pages = []

    def truncate(self, req: Request, keep: int) -> int:
        """Free ``req``'s own pages past its first ``keep`` (never a shared one); returns how
        many."""
        keep = max(keep, self.num_shared_pages(req))
        extra = req.pages[keep:]
        if extra:
            del req.pages[keep:]
            self.allocator.free(extra)
        return len(extra)

    def evict_unlocked(self) -> int:
        """Evict every cached page no request holds; returns how many. For a failed step: the
        pages its rows shared at scheduling may never have been written, and once its requests
        are aborted nothing else tells them apart."""
        return self.prefix_cache.evict(self.prefix_cache.num_evictable_pages)

    def check(self, owners: Iterable[Request], other_owned: Iterable[int] = ()) -> None:
        """Raise ``AssertionError`` unless the pages of ``owners`` (their own pages past the
        shared prefix), ``other_owned`` (pages a connector keeps), the prefix cache's and the
        free list partition the pool, counted from each side independently."""
        free = set(self.allocator.free_pages())
        cached = set(self.prefix_cache.cached_pages())
        owned: list[int] = list(other_owned)
        for r in owners:
            k = self.num_shared_pages(r)
            assert k >= r.num_cached_tokens // self.page_size, f"{r.rid}: matched pages not shared"
            assert set(r.pages[:k]) <= cached, f"{r.rid}: prefix pages not in the prefix cache"
            owned += r.pages[k:]
        owned_set = set(owned)
        assert len(owned_set) == len(owned), "a page is owned by two requests"
        assert not (owned_set & cached) and not (owned_set & free) and not (cached & free), \
            "page sets overlap"
        null = self.null_pages
        assert not (null & (owned_set | cached | free)), "a null page escaped"
        total = len(owned_set) + len(cached) + len(free)
        assert owned_set | cached | free == set(range(self.num_pages)) - null, \
            f"pages leaked: {self.num_pages - len(null) - total} missing"
