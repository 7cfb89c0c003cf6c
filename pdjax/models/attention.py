"""Paged attention for the GQA family over the flat token stream (DESIGN.md §2).

``AttentionMetadata`` carries the per-forward metadata as device arrays; it is a registered
dataclass, so it passes through ``jax.jit`` as a pytree (never a global: under jit a global is a
constant frozen at trace time).
"""

from __future__ import annotations

import dataclasses

import jax

from pdjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pdjax.pallas_kernels.ragged_paged_attention.fp8_kv import quantize_kv


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
             slot_mapping: jax.Array, scales: tuple[jax.Array, jax.Array] | None = None):
    """Scatter this step's ``k, v [T, KVH, D]`` into the rows of ``[layers, pages, page_size,
    KVH * D]`` (or ``[.., KVH, D]``; the cache layout of ``cache_spec.gqa_cache_spec``).

    ``scales``: ``(k_scale, v_scale)`` ``[layers, pages, page_size, KVH]`` float32 of a
    float8_e4m3fn cache (``fp8_kv``): each token's head is quantized with its own scale
    (amax / 448) and the scale written beside it. Returns ``(k_cache, v_cache)``, plus the
    updated ``scales`` when given."""
    page_size = k_cache.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    rows = k_cache.shape[3:]
    if scales is not None:
        (k, k_s), (v, v_s) = quantize_kv(k), quantize_kv(v)
        scales = (scales[0].at[layer, page, offset].set(k_s),
                  scales[1].at[layer, page, offset].set(v_s))
    k_cache = k_cache.at[layer, page, offset].set(k.reshape(-1, *rows).astype(k_cache.dtype))
    v_cache = v_cache.at[layer, page, offset].set(v.reshape(-1, *rows).astype(v_cache.dtype))
    if scales is None:
        return k_cache, v_cache
    return k_cache, v_cache, scales


def paged_attention(cfg, q, k, v, k_cache, v_cache, layer, md: AttentionMetadata, *,
                    sm_scale: float, scales: tuple[jax.Array, jax.Array] | None = None):
    """Write ``k, v`` into the caches, then attend; the write precedes every read of the step.

    ``cfg``: the model's config (``ModelConfig``), whose ``attention_impl`` /
    ``pallas_interpret`` choose the kernel (``ragged_paged_attention``'s ``impl`` /
    ``interpret``).

    ``scales``: the ``(k_scale, v_scale)`` buffers of an FP8 cache with real scales
    (``write_kv``), or None. Returns ``(out [T, QH, D], k_cache, v_cache)``, plus the updated
    ``scales`` when given.
    """
    written = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping, scales)
    k_cache, v_cache = written[:2]
    scales = written[2] if scales is not None else None
    out = ragged_paged_attention(q, k_cache, v_cache, layer, md.kv_lens, md.page_indices,
                                 md.cu_q_lens, md.distribution, sm_scale=sm_scale,
                                 impl=cfg.attention_impl, interpret=cfg.pallas_interpret,
                                 decode_only=md.decode_only,
                                 k_scales=None if scales is None else scales[0],
                                 v_scales=None if scales is None else scales[1])
    if scales is None:
        return out, k_cache, v_cache
    return out, k_cache, v_cache, scales
