"""What the drafters that keep KV of their own share (``draft_model.py``: a separate draft
model; ``mtp.py``: the target's MTP layer): each request's page list in the drafter's own pool,
grown before a forward and cut back when the target rejected drafts (DESIGN.md §3,
"Speculative decoding"), and the host reads of the tokens their chained forwards left on the
device.

A request's pages cover its positions ``0 .. n-1`` (``ceil(n / page_size)`` pages); rolling
back to ``n`` positions moves a counter and frees only the whole pages past it, the slots of
the kept last page are overwritten later (no copy).
"""

from __future__ import annotations

import numpy as np

from pdjax.kv.allocator import PageAllocator


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
                  page_size: int) -> bool:
    """Grow ``pages`` (in place) to cover positions ``< num_positions``; False, with nothing
    taken, when ``allocator`` is short."""
    need = cdiv(num_positions, page_size) - len(pages)
    if need <= 0:
        return True
    got = allocator.alloc(need)
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
    """The token at ``src = (device tokens, row)``; each array is fetched once (``host``:
    ``id(array) -> numpy``)."""
    tokens, row = src
    got = host.get(id(tokens))
    if got is None:
        got = host[id(tokens)] = np.asarray(tokens)
    return int(got[row])
