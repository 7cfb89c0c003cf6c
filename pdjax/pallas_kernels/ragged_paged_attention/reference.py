"""Pure-jnp ragged paged attention: the oracle for the Pallas kernels and the CPU path.

The batch contract is the flat token stream of DESIGN.md §2 (the vLLM V1 / ragged paged
attention contract): the new tokens of all requests are concatenated, request ``r`` owns query
rows ``cu_q_lens[r]:cu_q_lens[r+1]`` and, after this step's KV write, ``kv_lens[r]`` cached
tokens held in pages ``page_indices[r, :ceil(kv_lens[r] / page_size)]``.

Token ``t`` of request ``r`` sits at position ``kv_lens[r] - q_len[r] + (t - cu_q_lens[r])``
and attends causally to cache positions ``0..position`` (within ``sliding_window`` if set).

    page_indices[r] = [7, 2, 9, ...]       page_size = 4, kv_lens[r] = 10
    cache positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    pages             ---7--- | ---2--- | ---9---   (slots of page 9 past 9 are unused)

Pages are visited in blocks of ``pages_per_block`` with an online softmax, so memory stays
``O(T * pages_per_block * page_size)`` whatever the context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.ragged_paged_attention.fp8_kv import check_scale_caches, load_kv

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def num_kv_heads_of(k_cache: jax.Array, head_dim: int) -> int:
    """KV heads of a cache in either layout (see ``validate_inputs``)."""
    return k_cache.shape[3] if k_cache.ndim == 5 else k_cache.shape[3] // head_dim


def split_kv_heads(cache: jax.Array, head_dim: int) -> jax.Array:
    """``[L, N, ps, Hkv * D]`` rows as ``[L, N, ps, Hkv, D]`` (the same memory; a free reshape
    of a row-major array); a 5-dim cache is returned as it is. Raises ``ValueError`` when
    ``head_dim`` does not divide the rows."""
    if cache.ndim == 5:
        return cache
    if cache.ndim != 4 or cache.shape[3] % head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) does not fit k_cache {cache.shape}")
    return cache.reshape(*cache.shape[:3], cache.shape[3] // head_dim, head_dim)


def join_kv_heads(cache: jax.Array) -> jax.Array:
    """``[L, N, ps, Hkv, D]`` as rows ``[L, N, ps, Hkv * D]``; a 4-dim cache as it is. (Free on
    a row-major array; on TPU a 5-dim cache's tiled layout is not the rows', so XLA copies.)"""
    if cache.ndim == 4:
        return cache
    return cache.reshape(*cache.shape[:3], cache.shape[3] * cache.shape[4])


def validate_metadata(kv_lens, page_indices, cu_q_lens, distribution) -> None:
    """Static checks of the DESIGN.md §2 metadata every paged kernel takes (this one, the MLA
    attention and the indexer): ``kv_lens [R]``, ``page_indices [R, P]``, ``cu_q_lens [R+1]``,
    ``distribution [3]``, all int32. Raises ``ValueError`` naming the field."""
    num_seqs = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
        raise ValueError(f"page_indices must be [R={num_seqs}, P], got {page_indices.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [R+1={num_seqs + 1}], got {cu_q_lens.shape}")
    if distribution.shape != (3,):
        raise ValueError(f"distribution must be [3], got {distribution.shape}")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("distribution", distribution)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


def validate_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution):
    """Check static shapes and dtypes of the contract; raises ``ValueError`` naming the field.

    The caches come in either of two views of the same memory: the engine's rows
    ``[layers, num_pages, page_size, num_kv_heads * head_dim]`` (KV heads side by side in a
    row: a page is whole (16, 128) TPU tiles whenever ``num_kv_heads * head_dim`` is a
    multiple of 128, DESIGN.md §7), or ``[layers, num_pages, page_size, num_kv_heads,
    head_dim]``."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim not in (4, 5) or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [layers, num_pages, page_size, num_kv_heads * "
            f"head_dim] (or [.., num_kv_heads, head_dim]), got {k_cache.shape} and "
            f"{v_cache.shape}")
    num_q_heads, head_dim = q.shape[1:]
    width = k_cache.shape[4] if k_cache.ndim == 5 else k_cache.shape[3]
    if (k_cache.ndim == 5 and width != head_dim) or width % head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) does not fit k_cache {k_cache.shape}")
    num_kv_heads = num_kv_heads_of(k_cache, head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    validate_metadata(kv_lens, page_indices, cu_q_lens, distribution)


def token_request_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Request index of every query row, ``[T]`` int32; rows past ``cu_q_lens[-1]`` get -1."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    return jnp.where(t < cu_q_lens[-1], req, -1)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Attention of every query row over its request's paged KV cache.

    Args:
      q: ``[T, num_q_heads, head_dim]`` queries (any float dtype), flat token stream.
      k_cache, v_cache: ``[layers, num_pages, page_size, num_kv_heads * head_dim]`` (or
        ``[.., num_kv_heads, head_dim]``, the same memory; ``validate_inputs``); this step's
        new K/V must already be written. Unused pages may hold anything, NaN included.
      layer: int32 scalar, which layer of the caches to read.
      kv_lens: ``[R]`` int32, cached tokens per request after this step (0 for padding rows).
      page_indices: ``[R, P]`` int32 page table.
      cu_q_lens: ``[R+1]`` int32 query start offsets; rows past ``cu_q_lens[R]`` are padding.
      distribution: ``[3]`` int32 ``(decode_end, prefill_end, num_seqs)``; the reference
        treats every row alike and ignores it (the kernels use it to pick a path).
      sm_scale: softmax scale, usually ``head_dim ** -0.5``.
      sliding_window: if set, a query at position p sees keys at positions ``> p - window``.
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
      pages_per_block: pages visited per online-softmax step (default: up to 8).
      k_scale, v_scale: dequantization scales of a quantized (e.g. float8_e4m3fn) cache: the
        stored values are multiplied by them after the cast to float32; None = no scaling.
      k_scales, v_scales: ``[layers, num_pages, page_size, num_kv_heads]`` float32 scales of
        an FP8 cache with real scales (``fp8_kv``), one per token per KV head, or None.

    Returns:
      ``[T, num_q_heads, head_dim]`` in ``q.dtype``; padding rows are 0.
    """
    validate_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution)
    del distribution
    num_tokens, num_q_heads, head_dim = q.shape
    k_cache, v_cache = split_kv_heads(k_cache, head_dim), split_kv_heads(v_cache, head_dim)
    check_scale_caches(k_cache, k_scales, v_scales)
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_indices.shape[1]
    if pages_per_block is None:
        pages_per_block = min(max_pages, 8)
    num_blocks = -(-max_pages // pages_per_block)
    pad = num_blocks * pages_per_block - max_pages
    if pad:
        page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))

    req = token_request_ids(cu_q_lens, num_tokens)
    valid = req >= 0
    req_c = jnp.maximum(req, 0)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    positions = kv_lens[req_c] - q_lens[req_c] + (t - cu_q_lens[req_c])     # [T]
    kv_len_tok = jnp.where(valid, kv_lens[req_c], 0)                          # [T]

    # [T, KVH, G, D] so each KV head's group of query heads is contiguous.
    qf = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    block_tokens = pages_per_block * page_size

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_indices, b * pages_per_block,
                                             pages_per_block, axis=1)[req_c]   # [T, ppb]
        k = load_kv(k_cache, k_scales, k_scale, layer, pages)   # [T, ppb, ps, KVH, D]
        v = load_kv(v_cache, v_scales, v_scale, layer, pages)
        k = k.reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
        v = v.reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
        kv_pos = b * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)    # [S]
        mask = (kv_pos[None, :] <= positions[:, None]) & (kv_pos[None, :] < kv_len_tok[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > positions[:, None] - sliding_window
        # NaN in unused slots must not leak through 0 * NaN.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        s = jnp.einsum("thgd,tshd->thgs", qf, k)                              # [T, KVH, G, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + p.sum(axis=-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("thgs,tshd->thgd", p, v)
        return m_new, l_new, acc_new

    m0 = jnp.full((num_tokens, num_kv_heads, group), _MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32)
    acc0 = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
    if num_blocks == 1:
        m, l, acc = body(0, (m0, l0, acc0))
    else:
        # Visit only the blocks some request reaches: the pages-per-sequence bucket is often
        # several times the longest sequence, and the loop bound may be a traced value.
        needed = (jnp.max(kv_lens) + block_tokens - 1) // block_tokens
        m, l, acc = jax.lax.fori_loop(0, jnp.minimum(needed, num_blocks), body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
