"""Page hashes of a token prefix: the key of the host tier (DESIGN.md §3, "Host tier").

As SGLang's HiCache page hashes (``get_hash_str``: the hash of a page chains the previous
page's hash and the page's tokens), so equal hashes mean equal whole prefixes, not only equal
pages: with ``page_size = 4``,

    tokens   1 2 3 4 | 5 6 7 8 | 9
    hashes   h0      | h1      |          h0 = H(b"" + ids 1..4), h1 = H(h0 + ids 5..8)

The last partial page has no hash (only full pages are cached). ``H`` is BLAKE2b-128 over the
previous digest and the page's token ids as little-endian int32. Pure Python and numpy.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def page_hashes(token_ids: Sequence[int], page_size: int,
                num_pages: int | None = None) -> list[bytes]:
    """The 16-byte chained hash of each of the first ``num_pages`` full pages of
    ``token_ids`` (default: every full page). ``ValueError`` for ``page_size < 1`` or a
    ``num_pages`` past the full pages."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    full = len(token_ids) // page_size
    if num_pages is None:
        num_pages = full
    if not 0 <= num_pages <= full:
        raise ValueError(f"num_pages must be in [0, {full}] (full pages of {len(token_ids)} "
                         f"tokens), got {num_pages}")
    ids = np.asarray(token_ids[:num_pages * page_size], dtype="<i4")
    out: list[bytes] = []
    prev = b""
    for i in range(num_pages):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out
