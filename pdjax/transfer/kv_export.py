"""KV buffers by address: JAX arrays' shard pointers exported as a ``KVLayout``
(``pdjax.transfer.kv_copies``, where the copies between two layouts are planned), a layout's
fingerprint, and the check that a donated step kept the addresses. DESIGN.md §4 (data plane).

A KV array is ``[num_layers, num_pages, page_size, heads, head_dim]`` or ``[.., heads *
head_dim]`` (``layer_major``; ``page_major`` swaps the first two dimensions). A sharded array
has one buffer per addressable device; shards are ordered by the global index they hold (then
device id). Only the head dimension (dim 3) may be sharded: heads ``[.., heads, head_dim]``, or
rows of ``row_heads`` heads ``[.., heads * head_dim]`` (GQA's cache), split between heads; or,
with DP attention (DESIGN.md §6), the page dimension (``export_kv_layout(dp_size=...)``).

These functions use only the methods of the arrays passed in and import nothing from JAX, so
the transfer package loads without JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

import numpy as np

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.wire import KV_LAYOUTS
from pdjax.transfer.kv_copies import KVLayout


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

    Waits for the array first: an asynchronous dispatch may hand out a buffer whose bytes are not
    written yet, and a raw reader (the transfer engine) would copy whatever the allocator left
    there. Raises ``ValueError`` if the array was deleted or donated.
    """
    try:
        array.block_until_ready()
        return tuple(int(s.data.unsafe_buffer_pointer()) for s in _sorted_shards(array))
    except RuntimeError as e:  # JaxRuntimeError: "Buffer has been deleted or donated"
        raise ValueError(f"array: cannot read its buffer address ({e})") from e


HEAD_DIM = 3     # [layers, pages, page_size, heads, head_dim] or [.., heads * head_dim]


def _head_axis(arr: Any, row_heads: int | None, name: str) -> tuple[int, int] | None:
    """``(physical heads, elements per head along dimension 3)`` of an array with heads, or None
    for a buffer of one head (replicated): ``[.., heads, head_dim]`` has ``(shape[3], 1)``, rows
    ``[.., heads * head_dim]`` with ``row_heads`` heads ``(row_heads, head_dim)``."""
    if arr.ndim > HEAD_DIM + 1:
        return arr.shape[HEAD_DIM], 1
    if row_heads is None or row_heads == 1 or arr.ndim <= HEAD_DIM:
        return None
    if isinstance(row_heads, bool) or not isinstance(row_heads, int) or row_heads < 1 \
            or arr.shape[HEAD_DIM] % row_heads:
        raise ValueError(f"row_heads: {row_heads!r} does not divide the {arr.shape[HEAD_DIM]}-wide "
                         f"rows of {name}")
    return row_heads, arr.shape[HEAD_DIM] // row_heads


def _logical_heads(axis: tuple[int, int] | None, head_repeat: int, name: str) -> int:
    """KV heads of the checkpoint behind an array: 1 for a buffer without heads."""
    if axis is None:
        return 1
    if isinstance(head_repeat, bool) or not isinstance(head_repeat, int) or head_repeat < 1 \
            or axis[0] % head_repeat:
        raise ValueError(f"head_repeat: {head_repeat!r} does not divide the {axis[0]} "
                         f"KV heads of {name}")
    return axis[0] // head_repeat


def _shard_heads(arr: Any, shard: Any, axis: tuple[int, int] | None, head_repeat: int,
                 name: str) -> tuple[int, int]:
    """``(start, count)`` of the logical heads one shard holds (``tp_model_config`` replicates
    each head ``head_repeat`` times, so physical head ``j`` is logical head
    ``j // head_repeat``). Raises ``ValueError`` for a split a head range cannot describe."""
    for dim in range(2, arr.ndim):
        whole = shard.data.shape[dim] == arr.shape[dim]
        if not whole and (dim != HEAD_DIM or axis is None):
            raise ValueError(f"{name}: sharded over dimension {dim} (shard {shard.data.shape} "
                             f"of {arr.shape}); only KV heads (dimension {HEAD_DIM} of "
                             f"[layers, pages, page_size, heads(, head_dim)]) may be sharded; "
                             f"replicate buffers without heads")
    if axis is None:
        return 0, 1
    unit = axis[1]
    sl = shard.index[HEAD_DIM]
    lo = 0 if sl.start is None else sl.start
    hi = arr.shape[HEAD_DIM] if sl.stop is None else sl.stop
    if lo % unit or hi % unit:
        raise ValueError(f"{name}: shard {shard.data.shape} of {arr.shape} splits a head "
                         f"({unit} elements)")
    lo, count = lo // unit, (hi - lo) // unit
    if head_repeat > 1:
        if count != 1:
            raise ValueError(f"{name}: a shard with {count} replicated heads "
                             f"(head_repeat {head_repeat}) has no head range")
        return lo // head_repeat, 1
    return lo, count


def _row_heads_of(row_heads: Sequence[int] | None, count: int) -> list[int | None]:
    if row_heads is None:
        return [None] * count
    if len(row_heads) != count:
        raise ValueError(f"row_heads: {len(row_heads)} entries for {count} arrays")
    return list(row_heads)


def export_kv_layout(arrays: Sequence[Any], kind: str = "layer_major",
                     head_repeat: int = 1, row_heads: Sequence[int] | None = None,
                     dp_size: int = 1) -> KVLayout:
    """Describe JAX KV arrays by address: ``KVLayout`` with one ``KVBufferDesc`` per array.

    ``arrays[i]``: a JAX array shaped ``[num_layers, num_pages, page_size, heads, head_dim]``
    or ``[num_layers, num_pages, page_size, row]`` (``layer_major``; ``page_major`` swaps the
    first two), any dtype, row-major on its device, sharded (if at all) only over the heads
    (dimension 3). A row holds ``row_heads[i]`` heads side by side (GQA's
    ``[.., heads * head_dim]``, ``CacheBufferSpec.row_heads``); a row of one head (the default)
    is one head on every shard. ``head_repeat``: how often ``tp_model_config`` repeated each KV
    head (1 = none). ``dp_size`` > 1 (DP attention, ``models/dp_attention.py``): the arrays
    are ``[L, T * Np, ...]`` sharded over the pages, ``Np`` a device, ``T / dp_size`` devices
    a rank; the layout's page space is ``dp_size * Np`` pages (the scheduler's,
    ``DpKVCacheManager``) and shard ``k`` holds rank ``k // (T / dp_size)``'s. Register
    ``layout.regions()`` with the transfer engine afterwards. Raises ``ValueError`` naming
    the array for a bad rank, a split other than between heads (or pages with ``dp_size`` >
    1), a non-row-major device layout, or a deleted/donated array.
    """
    if kind not in KV_LAYOUTS:
        raise ValueError(f"kind: {kind!r} not in {KV_LAYOUTS}")
    if not arrays:
        raise ValueError("arrays: at least one KV array is required")
    buffers = []
    for i, (arr, rh) in enumerate(zip(arrays, _row_heads_of(row_heads, len(arrays)))):
        name = f"arrays[{i}]"
        if arr.ndim < 3:
            raise ValueError(f"{name}: expected [layers, pages, page_size, ...] (>= 3 dims), "
                             f"got shape {arr.shape}")
        addrs = shard_addresses(arr)  # first: raises ValueError for a deleted/donated array
        shards = _sorted_shards(arr)
        page_dim = 1 if kind == "layer_major" else 0
        ranks = _page_ranks(arr, shards, page_dim, dp_size, name)
        for s in shards:
            if any(s.data.shape[d] != arr.shape[d] for d in (0, 1)
                   if not (dp_size > 1 and d == page_dim)):
                raise ValueError(f"{name}: sharded over its layer/page dimensions "
                                 f"(shard {s.data.shape} of {arr.shape}); shard heads only")
        axis = _head_axis(arr, rh, name)
        num_heads = _logical_heads(axis, head_repeat, name)
        heads = tuple(_shard_heads(arr, s, axis, head_repeat, name) for s in shards)
        _check_row_major(shards[0].data, name)
        num_layers = arr.shape[1 - page_dim]
        num_pages = shards[0].data.shape[page_dim] * dp_size
        bytes_per_page = math.prod(shards[0].data.shape[2:]) * arr.dtype.itemsize
        head_bytes = bytes_per_page // (arr.shape[2] * heads[0][1])
        buffers.append(KVBufferDesc(shard_addrs=addrs, num_layers=num_layers,
                                    num_pages=num_pages, bytes_per_page=bytes_per_page,
                                    num_heads=num_heads, shard_heads=heads,
                                    head_bytes=head_bytes, dp_size=dp_size,
                                    shard_ranks=ranks))
    return KVLayout(kind=kind, buffers=tuple(buffers))


def _page_ranks(arr: Any, shards: list[Any], page_dim: int, dp_size: int,
                name: str) -> tuple[int, ...]:
    """The DP rank of each shard of a page-sharded array (``export_kv_layout``); ``()`` for
    ``dp_size`` 1. ``ValueError`` when the pages are not split evenly over a multiple of
    ``dp_size`` devices."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: expected a positive integer, got {dp_size!r}")
    if dp_size == 1:
        return ()
    per = shards[0].data.shape[page_dim]
    devices = arr.shape[page_dim] // per
    if any(s.data.shape[page_dim] != per for s in shards) or arr.shape[page_dim] % per \
            or devices % dp_size:
        raise ValueError(f"{name}: pages {arr.shape[page_dim]} are not split evenly over a "
                         f"multiple of dp_size {dp_size} devices (shard {shards[0].data.shape})")
    attn_tp = devices // dp_size
    starts = [0 if s.index[page_dim].start is None else s.index[page_dim].start
              for s in shards]
    return tuple((start // per) // attn_tp for start in starts)


def kv_layout_fingerprint(arrays: Sequence[Any], kind: str = "layer_major",
                          head_repeat: int = 1, row_heads: Sequence[int] | None = None) -> str:
    """A short hex digest of the KV cache two sides must share to pair, whatever their TP.

    Covers the layout kind and, per array, the shape without the page dimension with the
    *logical* KV head count (before ``tp_model_config``'s replication), and the dtype; rows of
    ``row_heads`` heads count as ``[.., heads, head_dim]``. Pool sizes (num_pages) and the head
    split over shards are left out: each side sizes its own pool, and ``plan_head_slices`` maps
    the head ranges at pairing time.
    """
    if kind not in KV_LAYOUTS:
        raise ValueError(f"kind: {kind!r} not in {KV_LAYOUTS}")
    page_dim = 1 if kind == "layer_major" else 0
    parts = [kind]
    for i, (arr, rh) in enumerate(zip(arrays, _row_heads_of(row_heads, len(arrays)))):
        name = f"arrays[{i}]"
        shape = list(arr.shape)
        axis = _head_axis(arr, rh, name)
        if axis is not None:
            # Rows of heads read as [.., heads, head_dim]: the same memory, the same fingerprint.
            shape[HEAD_DIM:] = [_logical_heads(axis, head_repeat, name),
                                *(shape[HEAD_DIM + 1:] or [axis[1]])]
        shape = [d for j, d in enumerate(shape) if j != page_dim]
        parts.append(f"{shape}|{np.dtype(arr.dtype).name}")
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
