"""KV buffer descriptions as they travel in the PD control messages and the bootstrap
(DESIGN.md §4, data plane): where each shard of one KV buffer lives and how its pages and KV
heads are laid out, range-checked on construction. Pure Python; never imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdjax.pd.wire import (MAX_ADDR, MAX_BUFFERS, MAX_BYTES_PER_PAGE, MAX_HEADS, MAX_LAYERS,
                           MAX_PAGES, MAX_SHARDS, ProtocolError, check_int, check_keys,
                           check_list)


@dataclasses.dataclass(frozen=True)
class KVBufferDesc:
    """One KV buffer (one kind, e.g. K or V, all layers) as seen by the transfer engine.

    ``shard_addrs``: base address of each addressable shard, in shard order (one per device for a
    sharded array). Layer-major layout: the shard holds ``[num_layers, num_pages, page bytes]``
    contiguously, so page ``p`` of layer ``l`` starts at
    ``base + (l * num_pages + p) * bytes_per_page``. Page-major layout swaps the two leading
    dimensions. Units: bytes; addresses are uint64.

    Heads (PD between different TP sizes, DESIGN.md §4): the buffer holds ``num_heads`` logical
    KV heads (the checkpoint's, before any replication); shard ``i`` holds heads
    ``[start, start + count)`` for ``(start, count) = shard_heads[i]``, and one page of one
    layer of a shard is ``[page_size, count, head_bytes]`` row-major::

        token t, local head j  ->  offset (t * count + j) * head_bytes

    A buffer that is not head-sharded (an MLA latent, an indexer key cache) is one head
    (``num_heads = 1``) held by every shard. Defaults (also for fields left out on the wire):
    one head held by every shard, one piece per page (``head_bytes = bytes_per_page``). Every
    shard holds the same head count.

    Page-sharded (DP attention, DESIGN.md §6): with ``dp_size`` > 1 the page space of
    ``num_pages`` pages is ``dp_size`` ranks of ``shard_num_pages = num_pages / dp_size``
    pages; shard ``i`` holds only rank ``shard_ranks[i]``'s pages, global page ``g`` at local
    page ``g % shard_num_pages`` of the shards of rank ``g // shard_num_pages`` (several
    shards of one rank are copies). Every rank has a shard. Left out on the wire when
    ``dp_size`` is 1 (every shard holds every page).
    """

    shard_addrs: tuple[int, ...]
    num_layers: int
    num_pages: int
    bytes_per_page: int
    num_heads: int = 1
    shard_heads: tuple[tuple[int, int], ...] = ()
    head_bytes: int = 0
    dp_size: int = 1
    shard_ranks: tuple[int, ...] = ()

    def __post_init__(self):
        addrs = check_list("shard_addrs", self.shard_addrs, 1, MAX_SHARDS, "shards")
        object.__setattr__(self, "shard_addrs", tuple(
            check_int(f"shard_addrs[{i}]", a, 1, MAX_ADDR) for i, a in enumerate(addrs)))
        check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        check_int("num_pages", self.num_pages, 2, MAX_PAGES)
        check_int("bytes_per_page", self.bytes_per_page, 1, MAX_BYTES_PER_PAGE)
        check_int("num_heads", self.num_heads, 1, MAX_HEADS)
        heads = self.shard_heads
        if not heads:
            heads = ((0, self.num_heads),) * len(addrs)
        if isinstance(heads, (str, bytes)) or not isinstance(heads, (list, tuple)) \
                or len(heads) != len(addrs):
            raise ProtocolError(f"field 'shard_heads': expected one [start, count] per shard "
                                f"({len(addrs)})")
        checked = []
        for i, h in enumerate(heads):
            if not isinstance(h, (list, tuple)) or len(h) != 2:
                raise ProtocolError(f"field 'shard_heads[{i}]': expected [start, count]")
            start = check_int(f"shard_heads[{i}].start", h[0], 0, self.num_heads - 1)
            count = check_int(f"shard_heads[{i}].count", h[1], 1, self.num_heads - start)
            checked.append((start, count))
        if len({c for _, c in checked}) != 1:
            raise ProtocolError(f"field 'shard_heads': shards hold different head counts "
                                f"{[c for _, c in checked]}")
        object.__setattr__(self, "shard_heads", tuple(checked))
        count = checked[0][1]
        head_bytes = self.head_bytes or self.bytes_per_page // count
        check_int("head_bytes", head_bytes, 1, self.bytes_per_page)
        if self.bytes_per_page % (count * head_bytes):
            raise ProtocolError(f"field 'head_bytes': bytes_per_page {self.bytes_per_page} is "
                                f"not a whole number of tokens of {count} heads x {head_bytes} B")
        object.__setattr__(self, "head_bytes", head_bytes)
        dp = check_int("dp_size", self.dp_size, 1, MAX_SHARDS)
        if dp == 1 and not any(self.shard_ranks or ()):
            object.__setattr__(self, "shard_ranks", ())   # kept empty: replace() may reshard
            return
        ranks = self.shard_ranks or (0,) * len(addrs)
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple)) \
                or len(ranks) != len(addrs):
            raise ProtocolError(f"field 'shard_ranks': expected one rank per shard "
                                f"({len(addrs)})")
        ranks = tuple(check_int(f"shard_ranks[{i}]", r, 0, dp - 1) for i, r in enumerate(ranks))
        if self.num_pages % dp or self.num_pages // dp < 2:
            raise ProtocolError(f"field 'num_pages': {self.num_pages} pages are not {dp} "
                                f"ranks of >= 2 pages (dp_size)")
        if set(ranks) != set(range(dp)):
            raise ProtocolError(f"field 'shard_ranks': {list(ranks)} leaves a rank of "
                                f"dp_size {dp} without a shard")
        object.__setattr__(self, "shard_ranks", ranks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The DP rank of each shard (all 0 without DP)."""
        return self.shard_ranks or (0,) * len(self.shard_addrs)

    @property
    def shard_num_pages(self) -> int:
        """Pages one shard holds: ``num_pages``, or a rank's under DP attention."""
        return self.num_pages // self.dp_size

    @property
    def heads_per_shard(self) -> int:
        return self.shard_heads[0][1]

    @property
    def tokens_per_page(self) -> int:
        """Token slots in one page (the page size, when ``head_bytes`` is one head's row)."""
        return self.bytes_per_page // (self.heads_per_shard * self.head_bytes)

    def to_wire(self) -> dict:
        return {"shard_addrs": list(self.shard_addrs), "num_layers": self.num_layers,
                "num_pages": self.num_pages, "bytes_per_page": self.bytes_per_page,
                "num_heads": self.num_heads, "shard_heads": [list(h) for h in self.shard_heads],
                "head_bytes": self.head_bytes,
                **({"dp_size": self.dp_size, "shard_ranks": list(self.shard_ranks)}
                   if self.dp_size > 1 else {})}

    @classmethod
    def from_wire(cls, name: str, d: Any) -> "KVBufferDesc":
        if not isinstance(d, dict):
            raise ProtocolError(f"field {name!r}: expected a map")
        check_keys(name, d, {"shard_addrs", "num_layers", "num_pages", "bytes_per_page"},
                    optional={"num_heads", "shard_heads", "head_bytes", "dp_size",
                              "shard_ranks"})
        heads = d.get("shard_heads", [])
        if not isinstance(heads, list):
            raise ProtocolError(f"{name}: field 'shard_heads': expected a list")
        if not isinstance(d.get("shard_ranks", []), list):
            raise ProtocolError(f"{name}: field 'shard_ranks': expected a list")
        try:
            return cls(**dict(d, shard_heads=tuple(
                tuple(h) if isinstance(h, list) else h for h in heads),
                shard_ranks=tuple(d.get("shard_ranks", ()))))
        except ProtocolError as e:
            raise ProtocolError(f"{name}: {e}") from None


def kv_buffers_from_wire(bufs: Any) -> tuple[KVBufferDesc, ...]:
    """The ``kv_buffers`` field of a message: 1..``MAX_BUFFERS`` ``KVBufferDesc`` maps, each
    range-checked; ``ProtocolError`` naming the field."""
    if not isinstance(bufs, list) or not 1 <= len(bufs) <= MAX_BUFFERS:
        raise ProtocolError(f"field 'kv_buffers': expected a list of 1..{MAX_BUFFERS} maps")
    return tuple(KVBufferDesc.from_wire(f"kv_buffers[{i}]", b) for i, b in enumerate(bufs))
