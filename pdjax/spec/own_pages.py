"""What the drafters that keep KV of their own share (``draft_model.py``: a separate draft
model; ``mtp.py``: the target's MTP layer): each request's page list in the drafter's own pool,
grown before a forward and cut back when the target rejected drafts (DESIGN.md §3,
"Speculative decoding"), the chunked extend forwards that catch a request up, and the chain of
their draft forwards, whose tokens stay on the device until one read at the end.

A request's pages cover its positions ``0 .. n-1`` (``ceil(n / page_size)`` pages); rolling
back to ``n`` positions moves a counter and frees only the whole pages past it, the slots of
the kept last page are overwritten later (no copy).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from pdjax.kv.allocator import PageAllocator
from pdjax.spec.drafter import Drafter


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reserve_pages(allocator: PageAllocator, pages: list[int], num_positions: int,
                  page_size: int, rank: int | None = None) -> bool:
    """Grow ``pages`` (in place) to cover positions ``< num_positions``; False, with nothing
    taken, when ``allocator`` is short. ``rank``: take them from that rank of a
    ``RankedPageAllocator`` (DP attention)."""
    need = cdiv(num_positions, page_size) - len(pages)
    if need <= 0:
        return True
    got = allocator.alloc(need) if rank is None else allocator.alloc(need, rank)
    if got is None:
        return False
    pages.extend(got)
    return True


def truncate_pages(allocator: PageAllocator, pages: list[int], num_positions: int,
                   page_size: int) -> None:
    """Keep the pages of positions ``< num_positions`` in ``pages`` (in place); the whole
    pages past them go back to ``allocator``."""
    keep = cdiv(max(num_positions, 0), page_size)
    allocator.free(pages[keep:])
    del pages[keep:]


def read_token(host: dict, src: tuple) -> int:
    """The token at ``src = (device tokens, ..., row)``; each array is fetched once (``host``:
    ``id(array) -> numpy``)."""
    tokens, row = src[0], src[-1]
    got = host.get(id(tokens))
    if got is None:
        got = host[id(tokens)] = np.asarray(tokens)
    return int(got[row])


def feed_in_chunks(num_left: list[int], chunk_size: int, max_rows: int, max_tokens: int,
                   extend: Callable[[list[tuple[int, int]]], list]) -> list:
    """Feed each request the tokens it has left, in extend forwards of chunks; where each
    request's first draft lies.

    ``num_left[n]`` (tokens, each >= 1): what request ``n`` still has to feed. A forward takes
    at most one chunk per request (its chunks run in order, in successive forwards), at most
    ``chunk_size`` tokens each, ``max_rows`` chunks and ``max_tokens`` tokens in all.
    ``extend(chunks)``: one extend forward of ``chunks``, ``(n, size)`` pairs ordered as
    ``build_flat_batch`` wants (decode-length chunks first, then full ones, then the rest),
    feeding request ``n`` its next ``size`` tokens; returns per chunk where the output of its
    last token lies. Returns that of each request's last chunk, in request order.
    """
    left = list(num_left)
    first: list = [None] * len(left)
    pending = list(range(len(left)))        # requests with tokens left to feed
    while pending:
        chunks, later, budget = [], [], max_tokens
        for n in pending:
            size = min(left[n], chunk_size, budget)
            if size <= 0 or len(chunks) == max_rows:
                later.append(n)
            else:
                chunks.append((n, size))
                budget -= size
        chunks.sort(key=lambda c: (c[1] != 1, c[1] != chunk_size))
        for (n, size), src in zip(chunks, extend(chunks)):
            left[n] -= size
            if left[n] == 0:
                first[n] = src
            else:
                later.append(n)
        pending = sorted(later)
    return first


def chain_drafts(first: list, num_drafts: list[int],
                 decode: Callable[[list[int], int, list], list]) -> list[list[int]]:
    """The drafts of the live requests, chained on the device and read once at the end.

    ``first[n]``: where live request ``n``'s first draft lies (``(device tokens, ..., row)``,
    from the drafter's extend forward); ``num_drafts[n]``: how many it wants.
    ``decode(run, j, prev)``: one batched decode forward of draft ``j`` for the requests
    ``run`` (indices into ``first``), each taking its input token on the device from its
    source in ``prev`` (draft ``j - 1``); returns their sources, in ``run`` order. Returns
    each request's draft ids.
    """
    srcs = [[src] for src in first]
    for j in range(1, max(num_drafts, default=0)):
        run = [n for n, k in enumerate(num_drafts) if k > j]
        for n, src in zip(run, decode(run, j, [srcs[n][-1] for n in run])):
            srcs[n].append(src)
    host: dict[int, np.ndarray] = {}
    return [[read_token(host, src) for src in chain] for chain in srcs]


class OwnPoolDrafter(Drafter):
    """Base of the drafters with a KV pool of their own: subclasses set ``allocator`` (a
    ``PageAllocator``), ``page_size`` and ``_state`` (rid -> a state with a ``pages`` list)."""

    allocator: PageAllocator
    page_size: int
    _state: dict

    def release(self, rid: str) -> None:
        st = self._state.pop(rid, None)
        if st is not None:
            self.allocator.free(st.pages)

    def _reserve(self, st, num_positions: int) -> bool:
        """Pages for positions ``< num_positions``; False (nothing taken) if the pool is short."""
        return reserve_pages(self.allocator, st.pages, num_positions, self.page_size)
