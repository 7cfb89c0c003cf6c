"""KV copy planning: where each page of each KV buffer lives on one side (``KVLayout``), and
the copies ``(src_addr, dst_addr, length)`` that move a list of pages between two sides.

DESIGN.md §4 (data plane). A KV buffer is one array per
kind (K, V, a latent cache, an indexer key cache ...), stacked over layers. Two layouts:

    layer_major  [num_layers, num_pages, page_size, ...]   (what the scan over layers carries)
    page_major   [num_pages, num_layers, page_size, ...]

``bytes_per_page`` is the size of one page of one layer (``prod(shape[2:]) * itemsize``).
Address of page p of layer l in one shard (base = the shard's buffer pointer)::

    layer_major: base + (l * num_pages + p) * bytes_per_page
    page_major:  base + (p * num_layers + l) * bytes_per_page

A run of pages that is consecutive on both sides is one copy per layer (layer_major) or one copy
for all layers (page_major). A run breaks where either side jumps::

    src pages   7  8  9 | 3 |  4  5
    dst pages  20 21 22 |11 | 30 31      -> runs (7, 20, 3), (3, 11, 1), (4, 30, 2)

Different TP sizes (DESIGN.md §4): every shard says which logical KV heads it holds
(``KVBufferDesc.shard_heads``), and ``plan_head_slices`` maps each destination shard's heads
onto source shards as head slices. A slice that is a whole shard on both sides copies page
runs as above; any other slice is strided inside a page (``[page_size, heads, head_bytes]``)
and costs one copy per (page, layer, token slot)::

    prefill TP 2 (1 head/shard)        decode TP 1 (2 heads)
    shard 0: t0[h0] t1[h0] ...   --->   shard 0: t0[h0 h1] t1[h0 h1] ...
    shard 1: t0[h1] t1[h1] ...   --->            ^ one copy of head_bytes per token and slice

Replicated heads (``tp_model_config`` when TP > KV heads, and MLA/indexer buffers, which are
one head on every shard) are read from one source shard and written to every destination
shard that holds them, so bytes moved = pages x bytes_per_page summed over the destination
shards.

DP attention (DESIGN.md §6): a decode's buffers may be sharded by page instead
(``KVBufferDesc.dp_size`` ranks of ``Np`` pages, ``export_kv_layout(dp_size=...)``). Global
page ``g`` then lives at local page ``g % Np`` of the shards of rank ``g // Np`` only, so a
prefill (not page-sharded, any TP) writes each page into its rank's shards alone::

    prefill TP 1 (all pages)          decode TP 4, DP 4 (Np = 8)
    src page 3  --------------------> dst page 10 = rank 1, local 2 -> shard 1 only
    src page 4  --------------------> dst page 27 = rank 3, local 3 -> shard 3 only

A page-sharded source (a prefill with DP attention) is read the same way: a page from one
shard of its rank, at its local page, into every destination shard that holds it. Only
buffers of one head (MLA latent, indexer keys) may be page-sharded on either side.

The layouts themselves come from JAX arrays through ``pdjax.transfer.kv_export``; this module
is pure Python and numpy (it never sees an array, only addresses).
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

import numpy as np

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.wire import KV_LAYOUTS, ProtocolError, validate_pages
from pdjax.transfer.engine import Copy, TransferEngine


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Where every page of every KV buffer lives, on one side (one process).

    ``kind``: ``layer_major`` | ``page_major``; ``buffers``: one ``KVBufferDesc`` per buffer
    (per-shard base addresses, num_layers, num_pages, bytes_per_page). All buffers share one
    page index space, so their ``num_pages`` must be equal. Raises ``ValueError`` otherwise.
    """

    kind: str
    buffers: tuple[KVBufferDesc, ...]

    def __post_init__(self):
        if self.kind not in KV_LAYOUTS:
            raise ValueError(f"kind: {self.kind!r} not in {KV_LAYOUTS}")
        object.__setattr__(self, "buffers", tuple(self.buffers))
        if not self.buffers:
            raise ValueError("buffers: at least one KV buffer is required")
        pages = {b.num_pages for b in self.buffers}
        if len(pages) != 1:
            raise ValueError(f"buffers: num_pages differs between buffers: {sorted(pages)}")

    @property
    def num_pages(self) -> int:
        """Pages in the pool (page 0 is the null page)."""
        return self.buffers[0].num_pages

    def page_addr(self, buffer: int, shard: int, layer: int, page: int) -> int:
        """Address of page ``page`` of layer ``layer`` in shard ``shard`` of buffer ``buffer``."""
        b = self.buffers[buffer]
        if not 0 <= layer < b.num_layers:
            raise ValueError(f"layer: {layer} outside [0, {b.num_layers})")
        if not 0 <= page < b.num_pages:
            raise ValueError(f"page: {page} outside [0, {b.num_pages})")
        np_ = b.shard_num_pages
        if b.dp_size > 1:
            if b.ranks[shard] != page // np_:
                raise ValueError(f"page: {page} is rank {page // np_}'s; shard {shard} holds "
                                 f"rank {b.ranks[shard]}'s")
            page %= np_
        if self.kind == "layer_major":
            index = layer * np_ + page
        else:
            index = page * b.num_layers + layer
        return b.shard_addrs[shard] + index * b.bytes_per_page

    def total_bytes(self) -> int:
        """Bytes of all buffers and shards together."""
        return sum(len(b.shard_addrs) * b.num_layers * b.shard_num_pages * b.bytes_per_page
                   for b in self.buffers)

    def regions(self) -> list[tuple[int, int]]:
        """``(addr, length)`` of every shard buffer, for ``TransferEngine.register_memory``."""
        return [(a, b.num_layers * b.shard_num_pages * b.bytes_per_page)
                for b in self.buffers for a in b.shard_addrs]

    def check_compatible(self, other: "KVLayout") -> None:
        """Raise ``ValueError`` naming the field if pages of ``self`` cannot be copied to ``other``.

        The layout kind, number of buffers, and per buffer num_layers, num_heads and the bytes
        of one page of one head must be equal, and every head a shard of ``other`` holds must be
        held by some shard of ``self`` (``plan_head_slices``); num_pages may differ (each side
        sizes its own pool) and so may the TP size.
        """
        plan_head_slices(self, other)


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """``num_heads`` consecutive heads copied from one source shard into one destination shard.

    ``src_head``/``dst_head``: the first head's slot inside its shard (0-based, local).
    ``whole``: the slice is the entire page on both sides (a plain page-run copy).
    """

    src_shard: int
    dst_shard: int
    src_head: int
    dst_head: int
    num_heads: int
    whole: bool


def plan_head_slices(src: KVLayout, dst: KVLayout) -> list[list[HeadSlice]]:
    """Per buffer, the head slices that fill every destination shard from the source shards.

    For each destination shard and each logical head it holds, the source is the shard
    ``dst_shard % n`` among the ``n`` source shards holding that head (spreads reads over
    replicas); consecutive heads from one source shard at consecutive slots merge into one
    slice. Raises ``ValueError`` naming the field when the layouts cannot be mapped: a
    different kind, buffer count, num_layers, num_heads, bytes per head-page, or a head no
    source shard holds; a page-sharded source (DP attention) or a page-sharded destination
    of more than one head per shard.
    """
    if src.kind != dst.kind:
        raise ValueError(f"kv_layout: {src.kind!r} != {dst.kind!r}")
    if len(src.buffers) != len(dst.buffers):
        raise ValueError(f"kv_buffers: {len(src.buffers)} buffers != {len(dst.buffers)}")
    plan = []
    for i, (a, b) in enumerate(zip(src.buffers, dst.buffers)):
        if (a.dp_size > 1 or b.dp_size > 1) and (b.num_heads != 1 or a.num_heads != 1):
            raise ValueError(f"kv_buffers[{i}].num_heads: page-sharded buffers (DP attention: "
                             f"source dp_size {a.dp_size}, destination dp_size {b.dp_size}) "
                             f"must be of one head (MLA); source {a.num_heads}, destination "
                             f"{b.num_heads}")
        names = ["num_layers", "num_heads", "head_bytes", "tokens_per_page"]
        if a.heads_per_shard == b.heads_per_shard:
            names.insert(2, "bytes_per_page")
        for name in names:
            if getattr(a, name) != getattr(b, name):
                raise ValueError(f"kv_buffers[{i}].{name}: {getattr(a, name)} != "
                                 f"{getattr(b, name)}")
        holders: dict[int, list[int]] = {}
        for s, (start, count) in enumerate(a.shard_heads):
            for h in range(start, start + count):
                holders.setdefault(h, []).append(s)
        slices: list[HeadSlice] = []
        for d, (start, count) in enumerate(b.shard_heads):
            cur = None
            for j, h in enumerate(range(start, start + count)):
                if h not in holders:
                    raise ValueError(f"kv_buffers[{i}].shard_heads: destination shard {d} "
                                     f"holds head {h}, which no source shard holds")
                s = holders[h][d % len(holders[h])]
                slot = h - a.shard_heads[s][0]
                if cur is not None and cur[0] == s and cur[1] + cur[3] == slot:
                    cur[3] += 1
                    continue
                if cur is not None:
                    slices.append(_slice(cur, d, a, b))
                cur = [s, slot, j, 1]
            slices.append(_slice(cur, d, a, b))
        plan.append(slices)
    return plan


def _slice(cur: list[int], d: int, a: KVBufferDesc, b: KVBufferDesc) -> HeadSlice:
    s, src_head, dst_head, n = cur
    whole = n == a.heads_per_shard == b.heads_per_shard
    return HeadSlice(s, d, src_head, dst_head, n, whole)


def register_kv_layout(engine: TransferEngine, layout: KVLayout, label: str = "kv") -> None:
    """Register every shard buffer of ``layout`` with ``engine`` under ``label``.

    The label ``kv`` tells KV regions from others (the tests' corrupting backend looks for
    it). On an error the regions registered so far are unregistered again before the error
    propagates.
    """
    done = []
    try:
        for addr, length in layout.regions():
            engine.register_memory(addr, length, label=label)
            done.append(addr)
    except BaseException:
        for addr in done:
            engine.unregister_memory(addr)
        raise


def unregister_kv_layout(engine: TransferEngine, layout: KVLayout) -> None:
    """Undo ``register_kv_layout`` (e.g. before re-registering after an address change)."""
    for addr, _ in layout.regions():
        engine.unregister_memory(addr)


# ---------------------------------------------------------------------------------------------
# Page runs and copies (pure Python + numpy).


def group_contiguous_runs(src_pages: Sequence[int] | np.ndarray,
                          dst_pages: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """Cut two equal-length page lists into runs consecutive on both sides.

    Returns ``[(src_start, dst_start, run_len), ...]`` in list order; ``sum(run_len) ==
    len(src_pages)``. A run breaks wherever ``src[i+1] != src[i] + 1`` or ``dst[i+1] !=
    dst[i] + 1`` (SGLang's ``group_concurrent_contiguous``). Raises ``ValueError`` if the lengths
    differ.
    """
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"dst_pages: length {dst.size} != src_pages length {src.size}")
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lens = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lens.tolist()))


def build_copies(src_layout: KVLayout, dst_layout: KVLayout,
                 src_pages: Sequence[int] | np.ndarray,
                 dst_pages: Sequence[int] | np.ndarray,
                 src_shards: Sequence[Collection[int]] | None = None,
                 dst_shards: Sequence[Collection[int]] | None = None) -> list[Copy]:
    """Copies ``(src_addr, dst_addr, length)`` that move ``src_pages`` into ``dst_pages``.

    Per buffer and head slice (``plan_head_slices``): a whole-shard slice is one copy per
    contiguous run per layer (layer_major) or per run (page_major, the run covers all
    layers); any other slice is one copy of ``num_heads * head_bytes`` per page, layer and
    token slot. Order: buffer, slice, then layer, run/page, token. Total bytes = pages x
    bytes_per_page x layers summed over the destination shards, per buffer.

    ``src_shards`` (per buffer, source shard indices): keep only the slices read from those
    shards; a multi-host prefill's node builds the copies of its own shards this way from the
    plan over every node's shards (``transfer/ranks.py``), so the nodes' copies partition the
    plan's. ``dst_shards`` likewise keeps the slices written into those destination shards:
    a prefill writing to a multi-host decode sends each node's shards to that node's session.

    A page-sharded destination (DP attention, the module docstring) gets each page in the
    shards of its rank only, at its local page; bytes then sum over those shards.

    Raises ``ProtocolError`` (a ``ValueError``) when a page is outside ``[1, num_pages)`` of its
    side (dst pages are checked against the registered decode pool), is a DP rank's null page,
    or repeats, and ``ValueError`` for unequal list lengths or layouts that cannot be mapped.
    """
    plan = plan_head_slices(src_layout, dst_layout)
    src = validate_pages(src_pages, src_layout.num_pages, "src_pages")
    dst = validate_pages(dst_pages, dst_layout.num_pages, "dst_pages")
    if any(b.dp_size > 1 for b in (*src_layout.buffers, *dst_layout.buffers)):
        return _ranked_copies(src_layout, dst_layout, plan, src, dst, src_shards, dst_shards)
    runs = group_contiguous_runs(src, dst)
    if not runs:
        return []
    run_arr = np.asarray(runs, dtype=np.int64)  # [R, 3]
    src_start, dst_start, run_len = run_arr[:, 0], run_arr[:, 1], run_arr[:, 2]
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    for i, (sb, db, slices) in enumerate(zip(src_layout.buffers, dst_layout.buffers, plan)):
        for sl in slices:
            if src_shards is not None and sl.src_shard not in src_shards[i]:
                continue
            if dst_shards is not None and sl.dst_shard not in dst_shards[i]:
                continue
            s_addr, d_addr = sb.shard_addrs[sl.src_shard], db.shard_addrs[sl.dst_shard]
            if sl.whole:
                s_off, d_off, length = _run_offsets(src_layout.kind, sb, db, src_start,
                                                    dst_start, run_len)
            else:
                s_off, d_off, length = _token_offsets(src_layout.kind, sb, db, src, dst, sl)
            srcs.append((s_off + s_addr).reshape(-1))
            dsts.append((d_off + d_addr).reshape(-1))
            lens.append(np.broadcast_to(length, s_off.shape).reshape(-1))
    if not srcs:
        return []
    # uint64 arithmetic would be exact too, but int64 covers user-space addresses (< 2**63).
    return list(zip(np.concatenate(srcs).tolist(), np.concatenate(dsts).tolist(),
                    np.concatenate(lens).tolist()))


def check_rank_pages(layout: KVLayout, pages: np.ndarray, field: str = "dst_pages") -> None:
    """``ProtocolError`` naming ``field`` when ``pages`` (in range) hold a DP rank's null
    page (local page 0 of a page-sharded ``layout``); nothing for a layout without DP."""
    np_ = layout.buffers[0].shard_num_pages
    if layout.buffers[0].dp_size > 1:
        pages = np.asarray(pages, np.int64)
        null = pages % np_ == 0
        if null.any():
            raise ProtocolError(f"field {field!r}: page {int(pages[null][0])} is the null "
                                f"page of DP rank {int(pages[null][0]) // np_}")


def _ranked_copies(src_layout: KVLayout, dst_layout: KVLayout, plan: list[list[HeadSlice]],
                   src: np.ndarray, dst: np.ndarray,
                   src_shards: Sequence[Collection[int]] | None,
                   dst_shards: Sequence[Collection[int]] | None) -> list[Copy]:
    """``build_copies`` where either side is page-sharded (one-head buffers, whole pages).
    Per buffer and destination shard: the pages it holds (its rank's, or all), each read at
    its local page from one source shard holding it (of the source page's rank when the
    source is page-sharded, replica ``dst_shard % n`` as ``plan_head_slices``), cut into
    runs of (source local page, destination local page) per source shard."""
    check_rank_pages(src_layout, src, "src_pages")
    check_rank_pages(dst_layout, dst)
    out: list[Copy] = []
    for i, (sb, db, slices) in enumerate(zip(src_layout.buffers, dst_layout.buffers, plan)):
        s_np, d_np = sb.shard_num_pages, db.shard_num_pages
        s_rank, s_local = (src // s_np, src % s_np) if sb.dp_size > 1 \
            else (np.zeros_like(src), src)
        d_rank, d_local = (dst // d_np, dst % d_np) if db.dp_size > 1 \
            else (np.zeros_like(dst), dst)
        holders = [[k for k, r in enumerate(sb.ranks) if r == rank]
                   for rank in range(sb.dp_size)]
        for d in range(len(db.shard_addrs)):
            if dst_shards is not None and d not in dst_shards[i]:
                continue
            mine = d_rank == db.ranks[d]
            # the source shard of each page: one holder of its rank's pages
            s_shard = np.asarray([holders[r][d % len(holders[r])] for r in range(sb.dp_size)],
                                 np.int64)[s_rank]
            for k in np.unique(s_shard[mine]).tolist():
                if src_shards is not None and k not in src_shards[i]:
                    continue
                sel = mine & (s_shard == k)
                runs = group_contiguous_runs(s_local[sel], d_local[sel])
                arr = np.asarray(runs, dtype=np.int64)
                s_off, d_off, length = _run_offsets(src_layout.kind, sb, db, arr[:, 0],
                                                    arr[:, 1], arr[:, 2])
                out += zip((s_off + sb.shard_addrs[k]).reshape(-1).tolist(),
                           (d_off + db.shard_addrs[d]).reshape(-1).tolist(),
                           np.broadcast_to(length, s_off.shape).reshape(-1).tolist())
    return out


NodeShards = tuple[frozenset[int], ...] | None


def node_shards(session_id: str, node_sessions: Sequence[str],
                shard_nodes: Sequence[Sequence[int]]) -> list[tuple[str, NodeShards]]:
    """Where a decode's KV goes: ``(session, per buffer the destination shards that node
    holds)`` per decode node, node 0 (the metadata rows' node) last; ``[(session_id, None)]``
    (every shard) for a one-process decode (``node_sessions`` empty). ``shard_nodes[b][s]``:
    the node of shard ``s`` of buffer ``b`` (``RegisterDecode``, DESIGN.md §6)."""
    if not node_sessions:
        return [(session_id, None)]
    return [(sid, tuple(frozenset(s for s, owner in enumerate(row) if owner == n)
                        for row in shard_nodes))
            for n, sid in reversed(list(enumerate(node_sessions)))]


def write_nodes(engine: TransferEngine, src_layout: KVLayout, dst_layout: KVLayout,
                writes: Sequence[tuple[str, NodeShards]], src_pages: Sequence[int],
                dst_pages: Sequence[int], src_shards: Sequence[Collection[int]] | None = None,
                meta: Sequence[Copy] = ()) -> tuple[list[int], int]:
    """Write ``src_pages`` -> ``dst_pages`` into every decode node of ``writes``
    (``node_shards``), each node's destination shards into its own session, one
    ``batch_write`` per node in that order; ``meta`` (the metadata row) goes with the last
    write (node 0's). ``src_shards`` as for ``build_copies`` (a multi-host prefill's node
    writes only its own shards). Returns (payload bytes per decode node in node order, node 0
    first; copies). ``TransferError`` from the engine, ``ValueError`` from ``build_copies``."""
    node_bytes, n_copies = [], 0
    for i, (session, shards) in enumerate(writes):
        copies = build_copies(src_layout, dst_layout, src_pages, dst_pages,
                              src_shards=src_shards, dst_shards=shards) if len(src_pages) else []
        payload = copies + (list(meta) if i == len(writes) - 1 else [])
        if payload:
            engine.batch_write(session, payload)
        node_bytes.append(sum(length for _, _, length in copies))
        n_copies += len(copies)
    return node_bytes[::-1], n_copies


def _run_offsets(kind, sb, db, src_start, dst_start, run_len):
    """Byte offsets inside the shards of whole-page runs: ``[L, R]`` or ``[R]``."""
    bpp = sb.bytes_per_page
    if kind == "layer_major":
        layers = np.arange(sb.num_layers, dtype=np.int64)[:, None]          # [L, 1]
        return ((layers * sb.shard_num_pages + src_start[None, :]) * bpp,    # [L, R]
                (layers * db.shard_num_pages + dst_start[None, :]) * bpp,
                run_len[None, :] * bpp)
    page_bytes = sb.num_layers * bpp
    return src_start * page_bytes, dst_start * page_bytes, run_len * page_bytes   # [R]


def _token_offsets(kind, sb, db, src, dst, sl):
    """Byte offsets of a strided head slice: ``[L, pages, tokens]`` (see the module diagram)."""
    layers = np.arange(sb.num_layers, dtype=np.int64)[:, None, None]       # [L, 1, 1]
    tokens = np.arange(sb.tokens_per_page, dtype=np.int64)[None, None, :]  # [1, 1, T]
    offs = []
    for desc, pages, head in ((sb, src, sl.src_head), (db, dst, sl.dst_head)):
        p = np.asarray(pages, np.int64)[None, :, None]                       # [1, N, 1]
        index = layers * desc.num_pages + p if kind == "layer_major" \
            else p * desc.num_layers + layers
        token_bytes = desc.heads_per_shard * desc.head_bytes
        offs.append(index * desc.bytes_per_page + tokens * token_bytes + head * desc.head_bytes)
    return offs[0], offs[1], np.int64(sl.num_heads * sb.head_bytes)
