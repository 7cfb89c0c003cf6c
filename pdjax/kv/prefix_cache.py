"""Radix prefix cache over full KV pages (DESIGN.md §3; SGLang's ``RadixCache``, paged).

Pure Python; never imports JAX. Each edge of the tree holds a run of full pages: its key is the
run's token ids, one tuple of ``page_size`` ids per page, and its value the page ids that hold
their KV. A partial last page is never cached. With ``page_size = 4``:

    root
     '-- [(1,2,3,4), (5,6,7,8)] pages [7, 3]         prompt A = 1..8, 9, 10
          |-- [(9,10,11,12)]    pages [12]           prompt B = 1..12, 13
          '-- [(9,9,9,9)]       pages [5]

    match_prefix(1..8 + 9,10,11,12 + 13) -> pages [7, 3, 12], node of page 12

A request holding a prefix locks its node: lock counts go up on every node of the path
root..node, and a node with a count is never evicted. Eviction takes unlocked leaves in LRU
order (every node a ``match_prefix`` or ``insert`` passes through is touched); a leaf longer
than what is still needed gives up only its tail pages, so ``evict(n)`` frees exactly
``min(n, num_evictable_pages)`` pages.

Ownership: the tree owns the pages in it; ``insert`` takes ownership of a finished request's
full pages and hands back to the allocator the ones whose prefix was already cached (unless they
are the very pages in the tree, which is the case for the prefix the request matched).
``extend_locked`` takes a running request's newly computed full pages (at scheduling: in-batch
prefix sharing) and moves the request's lock to their node.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Callable, Iterator, Sequence

from pdjax.kv.allocator import PageAllocator


class Node:
    """One edge of the radix tree: ``page_keys[i]`` is the token tuple held by ``pages[i]``.

    ``lock_ref`` counts requests whose locked path passes through this node; ``parent`` is
    ``None`` for the root and for nodes that were evicted or flushed.
    """

    __slots__ = ("id", "parent", "children", "page_keys", "pages", "lock_ref", "last_access")

    def __init__(self, node_id: int, parent: "Node | None", page_keys: list[tuple],
                 pages: list[int], last_access: int):
        self.id = node_id
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.page_keys = page_keys
        self.pages = pages
        self.lock_ref = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return (f"Node(id={self.id}, pages={self.pages}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class RadixCache:
    """Prefix cache over full pages of ``page_size`` tokens, drawing on ``allocator``.

    With ``enabled=False`` (``--disable-radix-cache``) nothing is cached: ``match_prefix``
    returns ``([], root)``, ``insert`` gives every page back, ``evict`` frees nothing.
    Raises ``ValueError`` if ``page_size`` is not an integer >= 1.
    """

    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = bool(enabled)
        self._ids = itertools.count()
        self._clock = 0
        self.root = Node(next(self._ids), None, [], [], 0)
        self._num_cached = 0
        self._num_locked = 0                # pages in nodes with lock_ref > 0
        self._pages_in_tree: set[int] = set()
        # Called as on_evict(token_ids, pages) just before evicted pages go back to the
        # allocator: ``token_ids`` the whole prefix root..leaf (full pages), ``pages`` the
        # KV pages of its last ``len(pages)`` pages (HiCache's write_back copies them out).
        self.on_evict: Callable[[list[int], list[int]], None] | None = None

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def num_evictable_pages(self) -> int:
        """Pages in unlocked nodes: all of them can be evicted (leaves first)."""
        return self._num_cached - self._num_locked

    def cached_pages(self) -> frozenset[int]:
        """Every page held by the tree, collected by walking it (for invariant checks)."""
        return frozenset(p for node in self._nodes() for p in node.pages)

    def match_prefix(self, token_ids: Sequence[int],
                     max_pages: int | None = None) -> tuple[list[int], Node]:
        """Longest cached prefix of ``token_ids`` in full pages, at most ``max_pages`` of them.

        Returns the matched page ids in position order (``len * page_size`` tokens) and the node
        where the match ends (``root`` if none); a match ending inside an edge splits it, so the
        node covers exactly the matched pages. Touches the LRU time of the path. Callers that
        must leave one token to compute pass ``max_pages = (len(token_ids) - 1) // page_size``.
        Raises ``ValueError`` if ``max_pages`` is negative.
        """
        num_pages = len(token_ids) // self.page_size
        if max_pages is not None:
            max_pages = operator.index(max_pages)
            if max_pages < 0:
                raise ValueError(f"max_pages must be >= 0, got {max_pages}")
            num_pages = min(num_pages, max_pages)
        if not self.enabled:
            return [], self.root
        node, pages = self._descend(token_ids, num_pages)
        return pages, node

    def cached_pages_of(self, token_ids: Sequence[int]) -> list[int]:
        """The page ids caching the longest prefix of ``token_ids`` in full pages, read-only:
        no split, no LRU touch (the host tier, ``pdjax.kv.hicache``, asks which pages to copy
        without changing what is evicted first). ``[]`` when disabled."""
        if not self.enabled:
            return []
        return self._peek(token_ids, len(token_ids) // self.page_size)

    def num_path_pages(self, node: Node) -> int:
        """Pages on the path root..``node`` (0 for the root); ``ValueError`` if ``node`` is no
        longer in the tree."""
        return sum(len(n.pages) for n in self._path(node))

    # ---- locking -------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Add a reference on every node of the path root..``node`` (no-op for the root).

        Raises ``ValueError`` if ``node`` is no longer in the tree (evicted or flushed).
        """
        path = self._path(node)
        for n in path:
            if n.lock_ref == 0:
                self._num_locked += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        """Drop a reference taken by ``lock``; the pages become evictable at count 0.

        Raises ``ValueError`` (and changes nothing) if a count on the path would go below 0 or
        ``node`` is not in the tree.
        """
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError(f"unlock of an unlocked node {node!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_locked -= len(n.pages)

    # ---- insert / evict / reset ----------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Hand a request's full pages to the cache; tokens past the last full page are ignored.

        ``pages[i]`` holds the KV of ``token_ids[i*page_size:(i+1)*page_size]``. Pages whose
        prefix is already cached under other page ids go back to the allocator; the rest join
        the tree as a new leaf. Raises ``ValueError`` (and changes nothing) if
        ``len(pages) != len(token_ids) // page_size``, a page is listed twice, is out of range,
        is free in the allocator, or is already in the tree at another position.
        """
        num_pages = len(token_ids) // self.page_size
        pages = [operator.index(p) for p in pages]
        if len(pages) != num_pages:
            raise ValueError(
                f"pages: expected len(token_ids) // page_size = {num_pages} full pages, "
                f"got {len(pages)}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages: duplicate page ids in {pages}")
        if not self.enabled:
            self.allocator.free(pages)
            return
        cached = self._peek(token_ids, num_pages)
        for i, p in enumerate(pages):
            if i < len(cached) and p == cached[i]:
                continue
            if not 0 < p < self.allocator.num_pages:
                raise ValueError(f"pages: page {p} out of range [1, {self.allocator.num_pages})")
            if p in self._pages_in_tree:
                raise ValueError(f"pages: page {p} is already cached at another position")
            if self.allocator.is_free(p):
                raise ValueError(f"pages: page {p} is free in the allocator")
        duplicates = [p for p, c in zip(pages, cached) if p != c]
        self.allocator.free(duplicates)
        node, matched = self._descend(token_ids, num_pages)
        if len(matched) < num_pages:
            leaf = Node(next(self._ids), node, self._page_keys(token_ids, len(matched), num_pages),
                        pages[len(matched):], self._clock)
            node.children[leaf.page_keys[0]] = leaf
            self._num_cached += len(leaf.pages)
            self._pages_in_tree.update(leaf.pages)

    def extend_locked(self, node: Node, token_ids: Sequence[int],
                      pages: Sequence[int]) -> Node | None:
        """Share a running request's newly computed full pages (SGLang's
        ``cache_unfinished_req``; vLLM caches a block when it schedules it).

        ``pages[i]`` holds ``token_ids[i*page_size:(i+1)*page_size]``; the caller holds a lock on
        ``node``, whose path root..``node`` must cache exactly the first pages of ``pages``. The
        pages after them join the tree as a leaf under ``node``, the caller's lock moves to that
        leaf, and the leaf is returned. Returns None (nothing changes) when the cache is
        disabled, there is nothing new, or other page ids already hold part of the new range
        (another request computed the same tokens: the caller keeps its pages and hands them
        to ``insert`` when it ends). Raises ``ValueError`` if ``node`` is not in the tree or its
        path is not the head of ``pages``, or for the page errors ``insert`` raises.
        """
        path = self._path(node)
        num_pages = len(token_ids) // self.page_size
        if len(pages) != num_pages:
            raise ValueError(
                f"pages: expected len(token_ids) // page_size = {num_pages} full pages, "
                f"got {len(pages)}")
        if not self.enabled:
            return None
        held = sum(len(n.pages) for n in path)
        cached = self._peek(token_ids, num_pages)
        if len(cached) < held or list(pages[:held]) != cached[:held]:
            raise ValueError(f"pages: the path of {node!r} is not the head of {list(pages)}")
        if len(cached) > held or held == num_pages:
            return None
        self.insert(token_ids, pages)
        leaf, _ = self._descend(token_ids, num_pages)
        self.lock(leaf)
        self.unlock(node)
        return leaf

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages, least recently used leaves first.

        Returns the number freed: ``min(num_pages, num_evictable_pages)``.
        Raises ``ValueError`` if ``num_pages`` is negative.
        """
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - freed
            if len(leaf.pages) > need:
                # Keep the head of the edge: the leaf object becomes its last `need` pages.
                self._split(leaf, len(leaf.pages) - need)
            parent = leaf.parent
            if self.on_evict is not None:
                path = self._path(leaf)[::-1]          # root's child .. leaf
                self.on_evict([t for n in path for key in n.page_keys for t in key],
                              list(leaf.pages))
            freed += self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self) -> bool:
        """Flush the cache, giving every page back; ``False`` and no change if any is locked."""
        if self._num_locked:
            return False
        nodes = list(self._nodes())
        pages = [p for n in nodes for p in n.pages]
        self.allocator.free(pages)
        for n in nodes:
            n.parent = None
        self.root.children = {}             # the root object stays: requests may hold it
        self._num_cached = 0
        self._pages_in_tree.clear()
        return True

    # ---- internals -----------------------------------------------------------------------

    def _page_keys(self, token_ids: Sequence[int], start: int, stop: int) -> list[tuple]:
        ps = self.page_size
        return [tuple(token_ids[i * ps:(i + 1) * ps]) for i in range(start, stop)]

    def _nodes(self) -> Iterator[Node]:
        """All nodes but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _path(self, node: Node) -> list[Node]:
        """Nodes from ``node`` up to (not including) the root; ValueError if detached."""
        path = []
        n = node
        while n is not self.root:
            if n is None or n.parent is None:
                raise ValueError(f"{node!r} is not in the cache (evicted or flushed)")
            path.append(n)
            n = n.parent
        return path

    def _peek(self, token_ids: Sequence[int], num_pages: int) -> list[int]:
        """Cached page ids of the longest prefix of the first ``num_pages`` pages; read-only."""
        keys = self._page_keys(token_ids, 0, num_pages)
        pages: list[int] = []
        node = self.root
        while len(pages) < num_pages:
            child = node.children.get(keys[len(pages)])
            if child is None:
                break
            for key, page in zip(child.page_keys, child.pages):
                if len(pages) == num_pages or keys[len(pages)] != key:
                    return pages
                pages.append(page)
            node = child
        return pages

    def _descend(self, token_ids: Sequence[int], num_pages: int) -> tuple[Node, list[int]]:
        """Walk the longest cached prefix, splitting the last edge at the match end and
        touching every node passed. Returns the last node and the matched pages."""
        keys = self._page_keys(token_ids, 0, num_pages)
        self._clock += 1
        node = self.root
        pages: list[int] = []
        while len(pages) < num_pages:
            child = node.children.get(keys[len(pages)])
            if child is None:
                break
            j = 1
            while (j < len(child.page_keys) and len(pages) + j < num_pages
                   and child.page_keys[j] == keys[len(pages) + j]):
                j += 1
            if j < len(child.page_keys):
                child = self._split(child, j)
            child.last_access = self._clock
            pages.extend(child.pages)
            node = child
        return node, pages

    def _split(self, node: Node, j: int) -> Node:
        """Cut ``node``'s edge after ``j`` pages; returns the new head node.

        ``node`` keeps the tail (so a caller holding it still covers the same path) and the
        head inherits its lock count and LRU time; page counters do not change.
        """
        head = Node(next(self._ids), node.parent, node.page_keys[:j], node.pages[:j],
                    node.last_access)
        head.lock_ref = node.lock_ref
        node.parent.children[head.page_keys[0]] = head
        node.page_keys = node.page_keys[j:]
        node.pages = node.pages[j:]
        node.parent = head
        head.children[node.page_keys[0]] = node
        return head

    def _remove_leaf(self, leaf: Node) -> int:
        del leaf.parent.children[leaf.page_keys[0]]
        leaf.parent = None
        self.allocator.free(leaf.pages)
        self._pages_in_tree.difference_update(leaf.pages)
        self._num_cached -= len(leaf.pages)
        return len(leaf.pages)
