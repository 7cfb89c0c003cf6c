"""Paged attention for the GQA family over the flat token stream (DESIGN.md §2).

``AttentionMetadata`` carries the per-forward metadata as device arrays; it is a registered
dataclass, so it passes through ``jax.jit`` as a pytree (never a global: under jit a global is a
constant frozen at trace time).
"""

from __future__ import annotations

import dataclasses

import jax

from pdjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Shapes (padded to a bucket): ``positions``/``slot_mapping`` ``[T]``, ``cu_q_lens``
    ``[R+1]``, ``kv_lens`` ``[R]``, ``page_indices`` ``[R, P]``, ``distribution`` ``[3]``; all
    int32. Padding tokens write slot 0 (the null page) and padding requests have kv_len 0.

    ``decode_only`` (static): every row has q_len 1 (the decode entry point), so attention
    paths may leave out the code for longer rows (the xla path then compiles to its decode
    part alone)."""

    positions: jax.Array
    slot_mapping: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    distribution: jax.Array
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))


def write_kv(k_cache: jax.Array, v_cache: jax.Array, layer, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's ``k, v [T, KVH, D]`` into the rows of ``[layers, pages, page_size,
    KVH * D]`` (the cache layout of ``cache_spec.gqa_cache_spec``)."""
    page_size = k_cache.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    rows = k_cache.shape[3:]
    k_cache = k_cache.at[layer, page, offset].set(k.reshape(-1, *rows).astype(k_cache.dtype))
    v_cache = v_cache.at[layer, page, offset].set(v.reshape(-1, *rows).astype(v_cache.dtype))
    return k_cache, v_cache


def paged_attention(q, k, v, k_cache, v_cache, layer, md: AttentionMetadata, *, sm_scale: float,
                    impl: str | None = None, interpret: bool = False):
    """Write ``k, v`` into the caches, then attend; the write precedes every read of the step.

    Returns ``(out [T, QH, D], k_cache, v_cache)``.
    """
    k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping)
    out = ragged_paged_attention(q, k_cache, v_cache, layer, md.kv_lens, md.page_indices,
                                 md.cu_q_lens, md.distribution, sm_scale=sm_scale, impl=impl,
                                 interpret=interpret, decode_only=md.decode_only)
    return out, k_cache, v_cache
