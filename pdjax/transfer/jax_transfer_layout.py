"""Where the ``jax`` transfer backend's pool keeps its KV heads (DESIGN.md §4, the ``jax``
backend): the placeholder ``KVLayout`` a pool publishes for the pairing checks, and the
checkpoint KV heads each device holds, over every process (``jax_transfer_kv.JaxLocalKV``
cuts and assembles its head-group units from these).

Shapes: KV buffers ``[layers, num_pages, page_size, *row]``, heads along dimension 3.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.transfer.kv_copies import KVLayout
from pdjax.transfer.kv_export import (HEAD_DIM, _head_axis, _logical_heads, _shard_heads,
                                      _sorted_shards)

# Placeholder shard addresses of the layout peers see (never dereferenced): buffer b, global
# shard s (a process's shards follow the lower ranks') at _FAKE_BASE + b * 2**46 + s * 2**36
# (64 GiB apart, 1,024 shards a buffer, inside the wire's 2**63 range).
_FAKE_BASE = 1 << 52


def descriptor_layout(arrays: Sequence[Any], head_repeat: int, row_heads: Sequence[int],
                      first_shard: int = 0) -> KVLayout:
    """The ``KVLayout`` of ``arrays``' shards in this process, placeholder addresses (one per
    shard, numbered from ``first_shard``)."""
    buffers = []
    for b, (arr, rh) in enumerate(zip(arrays, row_heads)):
        name = f"arrays[{b}]"
        shards = _sorted_shards(arr)
        axis = _head_axis(arr, rh, name)
        heads = tuple(_shard_heads(arr, s, axis, head_repeat, name) for s in shards)
        bytes_per_page = math.prod(shards[0].data.shape[2:]) * arr.dtype.itemsize
        buffers.append(KVBufferDesc(
            shard_addrs=tuple(_FAKE_BASE + (b << 46) + ((first_shard + s) << 36)
                              for s in range(len(shards))),
            num_layers=arr.shape[0], num_pages=arr.shape[1], bytes_per_page=bytes_per_page,
            num_heads=_logical_heads(axis, head_repeat, name), shard_heads=heads,
            head_bytes=bytes_per_page // (arr.shape[2] * heads[0][1])))
    return KVLayout("layer_major", tuple(buffers))


def device_heads(arr: Any, row_heads: int | None, head_repeat: int) -> tuple[dict, int]:
    """``({device: (first, count)} of the checkpoint KV heads each device of ``arr`` holds,
    over every process; elements per head along dimension 3)``; ``(0, 1)`` and the row width
    on every device for a buffer without heads."""
    axis = _head_axis(arr, row_heads, "kv buffer")
    width = arr.shape[HEAD_DIM]
    if axis is None:
        return {d: (0, 1) for d in arr.sharding.device_set}, width
    epu = axis[1]
    out = {}
    for dev, index in arr.sharding.devices_indices_map(arr.shape).items():
        sl = index[HEAD_DIM]
        lo, hi = sl.start or 0, width if sl.stop is None else sl.stop
        first, count = lo // epu, (hi - lo) // epu
        out[dev] = (first // head_repeat, 1) if head_repeat > 1 else (first, count)
    return out, epu
