"""KV buffers by address: export JAX arrays' shard pointers, and turn page lists into copies.

DESIGN.md §4 (data plane) and reference/sglang_pd_notes.md §7. A KV buffer is one JAX array per
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

Only ``export_kv_layout``, ``shard_addresses``, ``kv_layout_fingerprint`` and
``changed_addresses`` touch JAX arrays, and they import nothing from JAX themselves (they use the
array's methods), so the grouping and copy building can be used by pure-Python code.

A sharded array has one buffer per addressable device; shards are ordered by the global index
they hold (then device id), so shard i of the prefill pairs with shard i of the decode when both
use the same mesh. Only the trailing (head) dimensions may be sharded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

import numpy as np

from pdjax.transfer.engine import Copy, TransferEngine
from pdjax.transfer.protocol import KV_LAYOUTS, KVBufferDesc, validate_pages


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
        if self.kind == "layer_major":
            index = layer * b.num_pages + page
        else:
            index = page * b.num_layers + layer
        return b.shard_addrs[shard] + index * b.bytes_per_page

    def total_bytes(self) -> int:
        """Bytes of all buffers and shards together."""
        return sum(len(b.shard_addrs) * b.num_layers * b.num_pages * b.bytes_per_page
                   for b in self.buffers)

    def regions(self) -> list[tuple[int, int]]:
        """``(addr, length)`` of every shard buffer, for ``TransferEngine.register_memory``."""
        return [(a, b.num_layers * b.num_pages * b.bytes_per_page)
                for b in self.buffers for a in b.shard_addrs]

    def check_compatible(self, other: "KVLayout") -> None:
        """Raise ``ValueError`` naming the field if pages of ``self`` cannot be copied to ``other``.

        The layout kind, number of buffers, and per buffer the shard count, num_layers and
        bytes_per_page must be equal; num_pages may differ (each side sizes its own pool).
        """
        if self.kind != other.kind:
            raise ValueError(f"kv_layout: {self.kind!r} != {other.kind!r}")
        if len(self.buffers) != len(other.buffers):
            raise ValueError(f"kv_buffers: {len(self.buffers)} buffers != {len(other.buffers)}")
        for i, (a, b) in enumerate(zip(self.buffers, other.buffers)):
            for name in ("num_layers", "bytes_per_page"):
                if getattr(a, name) != getattr(b, name):
                    raise ValueError(f"kv_buffers[{i}].{name}: {getattr(a, name)} != "
                                     f"{getattr(b, name)}")
            if len(a.shard_addrs) != len(b.shard_addrs):
                raise ValueError(f"kv_buffers[{i}].shard_addrs: {len(a.shard_addrs)} shards != "
                                 f"{len(b.shard_addrs)}")


def register_kv_layout(engine: TransferEngine, layout: KVLayout, label: str = "kv") -> None:
    """Register every shard buffer of ``layout`` with ``engine`` under ``label``.

    The label ``kv`` is what the test-only ``mooncake-corrupt`` backend looks for. On an error
    the regions registered so far are unregistered again before the error propagates.
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
                 dst_pages: Sequence[int] | np.ndarray) -> list[Copy]:
    """Copies ``(src_addr, dst_addr, length)`` that move ``src_pages`` into ``dst_pages``.

    One copy per contiguous run per layer per shard per buffer (layer_major), or per run per
    shard per buffer (page_major, the run covers all layers). Order: buffer, shard, layer, run.
    Total bytes = pages x bytes_per_page x layers x shards, summed over buffers.

    Raises ``ProtocolError`` (a ``ValueError``) when a page is outside ``[1, num_pages)`` of its
    side (dst pages are checked against the registered decode pool) or repeats, and
    ``ValueError`` for unequal list lengths or incompatible layouts.
    """
    src_layout.check_compatible(dst_layout)
    src = validate_pages(src_pages, src_layout.num_pages, "src_pages")
    dst = validate_pages(dst_pages, dst_layout.num_pages, "dst_pages")
    runs = group_contiguous_runs(src, dst)
    if not runs:
        return []
    run_arr = np.asarray(runs, dtype=np.int64)  # [R, 3]
    src_start, dst_start, run_len = run_arr[:, 0], run_arr[:, 1], run_arr[:, 2]
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    for sb, db in zip(src_layout.buffers, dst_layout.buffers):
        bpp = sb.bytes_per_page
        if src_layout.kind == "layer_major":
            layers = np.arange(sb.num_layers, dtype=np.int64)[:, None]          # [L, 1]
            src_off = (layers * sb.num_pages + src_start[None, :]) * bpp        # [L, R]
            dst_off = (layers * db.num_pages + dst_start[None, :]) * bpp
            length = np.broadcast_to(run_len[None, :] * bpp, src_off.shape)
        else:
            page_bytes = sb.num_layers * bpp
            src_off, dst_off = src_start * page_bytes, dst_start * page_bytes    # [R]
            length = run_len * page_bytes
        for s_addr, d_addr in zip(sb.shard_addrs, db.shard_addrs):
            srcs.append((src_off + s_addr).reshape(-1))
            dsts.append((dst_off + d_addr).reshape(-1))
            lens.append(np.asarray(length).reshape(-1))
    # uint64 arithmetic would be exact too, but int64 covers user-space addresses (< 2**63).
    return list(zip(np.concatenate(srcs).tolist(), np.concatenate(dsts).tolist(),
                    np.concatenate(lens).tolist()))


# ---------------------------------------------------------------------------------------------
# JAX arrays -> addresses. These use only methods of the arrays passed in.


def _sorted_shards(array: Any) -> list[Any]:
    def key(shard):
        starts = tuple(0 if s.start is None else s.start for s in shard.index)
        return starts, shard.device.id
    return sorted(array.addressable_shards, key=key)


def _check_row_major(array: Any, name: str) -> None:
    fmt = getattr(array, "format", None)
    layout = getattr(fmt, "layout", None)
    if layout is None:
        return  # this jax version does not expose layouts; the default is row-major
    m2m = tuple(getattr(layout, "major_to_minor", ()))
    tiling = tuple(getattr(layout, "tiling", ()) or ())
    if m2m != tuple(range(array.ndim)) or tiling:
        raise ValueError(f"{name}: device layout {layout} is not plain row-major; pages are not "
                         f"addressable by offset (use the staging path)")


def shard_addresses(array: Any) -> tuple[int, ...]:
    """Base address of each addressable shard's buffer, in shard order (see module docstring).

    Raises ``ValueError`` if the array was deleted or donated.
    """
    try:
        return tuple(int(s.data.unsafe_buffer_pointer()) for s in _sorted_shards(array))
    except RuntimeError as e:  # JaxRuntimeError: "Buffer has been deleted or donated"
        raise ValueError(f"array: cannot read its buffer address ({e})") from e


def export_kv_layout(arrays: Sequence[Any], kind: str = "layer_major") -> KVLayout:
    """Describe JAX KV arrays by address: ``KVLayout`` with one ``KVBufferDesc`` per array.

    ``arrays[i]``: a JAX array shaped ``[num_layers, num_pages, page_size, ...]``
    (``layer_major``) or ``[num_pages, num_layers, ...]`` (``page_major``), any dtype, row-major
    on its device, sharded (if at all) only over dimensions 2 and up. Register
    ``layout.regions()`` with the transfer engine afterwards. Raises ``ValueError`` naming the
    array for a bad rank, a page/layer-sharded array, a non-row-major device layout, or a
    deleted/donated array.
    """
    if kind not in KV_LAYOUTS:
        raise ValueError(f"kind: {kind!r} not in {KV_LAYOUTS}")
    if not arrays:
        raise ValueError("arrays: at least one KV array is required")
    buffers = []
    for i, arr in enumerate(arrays):
        name = f"arrays[{i}]"
        if arr.ndim < 3:
            raise ValueError(f"{name}: expected [layers, pages, page_size, ...] (>= 3 dims), "
                             f"got shape {arr.shape}")
        addrs = shard_addresses(arr)  # first: raises ValueError for a deleted/donated array
        shards = _sorted_shards(arr)
        for s in shards:
            if tuple(s.data.shape[:2]) != tuple(arr.shape[:2]):
                raise ValueError(f"{name}: sharded over its layer/page dimensions "
                                 f"(shard {s.data.shape} of {arr.shape}); shard heads only")
        _check_row_major(shards[0].data, name)
        num_layers, num_pages = (arr.shape[0], arr.shape[1]) if kind == "layer_major" \
            else (arr.shape[1], arr.shape[0])
        bytes_per_page = math.prod(shards[0].data.shape[2:]) * arr.dtype.itemsize
        buffers.append(KVBufferDesc(shard_addrs=addrs, num_layers=num_layers,
                                    num_pages=num_pages, bytes_per_page=bytes_per_page))
    return KVLayout(kind=kind, buffers=tuple(buffers))


def kv_layout_fingerprint(arrays: Sequence[Any], kind: str = "layer_major") -> str:
    """A short hex digest of everything two sides must share to copy pages byte for byte.

    Covers the layout kind and, per array, the shape without the page dimension, the dtype and
    the per-shard shapes (so different head splits differ). Pool sizes (num_pages) are left
    out: prefill and decode size their pools independently.
    """
    if kind not in KV_LAYOUTS:
        raise ValueError(f"kind: {kind!r} not in {KV_LAYOUTS}")
    page_dim = 1 if kind == "layer_major" else 0
    parts = [kind]
    for arr in arrays:
        shape = [d for j, d in enumerate(arr.shape) if j != page_dim]
        shard_shapes = [[d for j, d in enumerate(s.data.shape) if j != page_dim]
                        for s in _sorted_shards(arr)]
        parts.append(f"{shape}|{np.dtype(arr.dtype).name}|{shard_shapes}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class AddressChange:
    """A shard buffer whose address differs from the registered one."""

    buffer: int
    shard: int
    old_addr: int
    new_addr: int


def changed_addresses(arrays: Sequence[Any], layout: KVLayout) -> list[AddressChange]:
    """Compare the arrays' current shard addresses with ``layout``; empty list = nothing moved.

    XLA does not promise that a donated buffer keeps its address (DESIGN.md §4): call this
    after every donated step with the *new* arrays; on a change, re-register and fail the
    transfers in flight. Raises ``ValueError`` if the buffer count differs or an array was
    deleted/donated (pass the step's outputs, not its donated inputs).
    """
    if len(arrays) != len(layout.buffers):
        raise ValueError(f"arrays: {len(arrays)} arrays != {len(layout.buffers)} buffers")
    changes = []
    for i, (arr, desc) in enumerate(zip(arrays, layout.buffers)):
        now = shard_addresses(arr)
        if len(now) != len(desc.shard_addrs):
            raise ValueError(f"arrays[{i}]: {len(now)} shards != {len(desc.shard_addrs)}")
        changes += [AddressChange(i, s, old, new)
                    for s, (old, new) in enumerate(zip(desc.shard_addrs, now)) if old != new]
    return changes
