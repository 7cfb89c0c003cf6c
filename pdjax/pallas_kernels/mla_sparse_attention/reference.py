"""Pure-jnp MLA attention over the paged latent cache, dense or restricted to top-k tokens.

Multi-head latent attention in its absorbed form (DeepSeek-V2 §2.1, weight absorption): every
query head attends to one shared latent row per cached token,

    q   [T, H, Dl + Dr]   = [q_nope @ W_UK  |  rope(q_rope)]
    row [Dl + Dr]         = [rms_norm(c_kv) |  rope(k_rope)]     (the cache, one per token)
    out [T, H, Dl]        = softmax(q . row * sm_scale) @ row[:Dl]

so K is the whole row and V its first ``kv_lora_rank`` entries (the caller multiplies by W_UV).

Batch contract: the flat token stream of DESIGN.md §2, as ``ragged_paged_attention``. Token
``t`` of request ``r`` sits at position ``p = kv_lens[r] - q_len[r] + (t - cu_q_lens[r])``.

* dense (``topk_indices is None``): it sees cache positions ``0..p`` (DeepSeek-V3);
* sparse: it sees the positions listed in ``topk_indices[t]`` (DSA, DeepSeek-V3.2 / GLM-5),
  restricted to ``0..p``; ``-1`` entries are empty. Positions map to slots through the page
  table:

      position i  ->  page_indices[r, i // page_size],  offset i % page_size

Tokens are visited in blocks of ``block_tokens`` with an online softmax, so memory stays
``O(T * block_tokens * (Dl + Dr))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import (
    Fp8Latent, dequantize_rows, layout_of)
from pdjax.pallas_kernels.ragged_paged_attention.reference import (
    token_request_ids, validate_metadata)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, topk_indices,
                    kv_lora_rank):
    """Static checks of the contract; raises ``ValueError`` naming the field."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, kv_lora_rank + rope_dim], got {q.shape}")
    if isinstance(kv_cache, Fp8Latent):
        if not 0 < kv_lora_rank < q.shape[2]:
            raise ValueError(f"kv_lora_rank must be in [1, {q.shape[2] - 1}], got {kv_lora_rank}")
        layout_of(kv_cache, kv_lora_rank, q.shape[2] - kv_lora_rank)
    elif kv_cache.ndim != 4:
        raise ValueError("kv_cache must be [layers, num_pages, page_size, kv_lora_rank + "
                         f"rope_dim], got {kv_cache.shape}")
    elif kv_cache.shape[3] != q.shape[2]:
        raise ValueError(f"last dim of q ({q.shape[2]}) and kv_cache ({kv_cache.shape[3]}) differ")
    if not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"kv_lora_rank must be in [1, {q.shape[2]}], got {kv_lora_rank}")
    validate_metadata(kv_lens, page_indices, cu_q_lens, distribution)
    if topk_indices is not None:
        if topk_indices.ndim != 2 or topk_indices.shape[0] != q.shape[0]:
            raise ValueError(f"topk_indices must be [T={q.shape[0]}, K], got {topk_indices.shape}")
        if topk_indices.dtype != jnp.int32:
            raise ValueError(f"topk_indices must be int32, got {topk_indices.dtype}")


def token_positions(kv_lens: jax.Array, cu_q_lens: jax.Array, num_tokens: int):
    """Per token: request ``[T]`` (clamped to 0 for padding), position ``[T]`` (-1 for padding
    rows, so they see nothing) and its request's ``kv_len`` ``[T]`` (0 for padding)."""
    req = token_request_ids(cu_q_lens, num_tokens)
    valid = req >= 0
    req_c = jnp.maximum(req, 0)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = kv_lens[req_c] - q_lens[req_c] + (t - cu_q_lens[req_c])
    pos = jnp.where(valid, pos, -1)
    kv_len = jnp.where(valid, kv_lens[req_c], 0)
    return req_c, pos.astype(jnp.int32), kv_len.astype(jnp.int32)


def kernel_metadata(kv_lens: jax.Array, cu_q_lens: jax.Array, page_indices: jax.Array,
                    layer: jax.Array | int, num_tokens: int, num_pages: int):
    """What the MLA and indexer kernels take besides q and the cache: ``req``, ``pos``,
    ``kv_len`` per token (``token_positions``), the page table clamped and flattened
    ``[R * P]`` (an out-of-range index would be an out-of-bounds DMA / load; the reference
    clamps too) and ``layer`` as a ``[1]`` int32 array."""
    req, pos, kv_len = token_positions(kv_lens, cu_q_lens, num_tokens)
    flat_pages = jnp.clip(page_indices, 0, num_pages - 1).reshape(-1)
    return req, pos, kv_len, flat_pages, jnp.asarray(layer, jnp.int32).reshape(1)


def token_scalars(t, layer_ref, tok_req_ref, tok_pos_ref, kv_lens_ref):
    """Inside a kernel: ``(layer, req, pos, kv_len)`` of token ``t``, read from the refs of
    ``kernel_metadata``'s ``layer`` ``[1]``, ``req`` and ``pos`` ``[T]`` and of ``kv_lens``
    ``[R]`` (int32 scalars)."""
    layer = layer_ref[0]
    req = tok_req_ref[t]
    return layer, req, tok_pos_ref[t], kv_lens_ref[req]


def check_kernel_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        topk_indices, kv_lora_rank) -> None:
    """The contract (``validate_inputs``) plus the kernels' dtypes; ``ValueError``."""
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, topk_indices,
                    kv_lora_rank)
    if isinstance(kv_cache, Fp8Latent):       # planes checked by validate_inputs
        if q.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
        return
    if q.dtype not in (jnp.float32, jnp.bfloat16) or kv_cache.dtype not in (jnp.float32,
                                                                               jnp.bfloat16):
        raise ValueError(f"q and kv_cache must be float32 or bfloat16, got {q.dtype}, "
                         f"{kv_cache.dtype}")


def pad_topk(topk_indices: jax.Array, block: int) -> tuple[jax.Array, int]:
    """``[T, K]`` top-k entries padded with -1 to whole blocks of ``block``: ``([T, C * block],
    C)``."""
    span = topk_indices.shape[1]
    num_chunks = -(-span // block)
    if num_chunks * block != span:
        topk_indices = jnp.pad(topk_indices, ((0, 0), (0, num_chunks * block - span)),
                               constant_values=-1)
    return topk_indices, num_chunks


def topk_scan_lengths(topk_indices: jax.Array | None, pos: jax.Array,
                      kv_len: jax.Array) -> jax.Array:
    """``[T]`` int32: 1 + the index of each token's last selectable top-k entry (0 if none), so
    kernels never visit the ``-1`` tail of a short selection. Zeros when ``topk_indices`` is
    None (dense)."""
    if topk_indices is None:
        return jnp.zeros_like(pos)
    ok = (topk_indices >= 0) & (topk_indices <= pos[:, None]) & (topk_indices < kv_len[:, None])
    j = jnp.arange(1, topk_indices.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(ok, j, 0), axis=1).astype(jnp.int32)


def mla_sparse_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    topk_indices: jax.Array | None,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    block_tokens: int = 128,
) -> jax.Array:
    """MLA attention of every query row over its request's paged latent cache.

    Args:
      q: ``[T, H, Dl + Dr]`` absorbed queries (float32 or bfloat16).
      kv_cache: ``[layers, num_pages, page_size, Dl + Dr]`` latent rows, this step's rows
        already written; slots past ``kv_lens`` may hold anything, NaN included. Or an
        ``fp8_record.Fp8Latent`` of the FP8 record's planes (dequantized as gathered).
      layer: int32 scalar, the layer of ``kv_cache`` to read.
      kv_lens: ``[R]`` int32; page_indices: ``[R, P]`` int32; cu_q_lens: ``[R+1]`` int32;
      distribution: ``[3]`` int32 (DESIGN.md §2; every row is treated alike here).
      topk_indices: ``[T, K]`` int32 sequence positions each token may attend to (``-1`` =
        empty; entries past the token's position are ignored), or None for dense causal.
      sm_scale: softmax scale. kv_lora_rank: ``Dl``, the value width.
      block_tokens: cached tokens (or top-k entries) per online-softmax step.

    Returns:
      ``[T, H, Dl]`` in ``q.dtype``; rows that see no token (padding) are 0.
    """
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, topk_indices,
                    kv_lora_rank)
    del distribution
    num_tokens, num_heads, dim = q.shape
    fp8 = isinstance(kv_cache, Fp8Latent)
    page_size = (kv_cache.latent if fp8 else kv_cache).shape[2]
    max_pages = page_indices.shape[1]
    req, pos, kv_len = token_positions(kv_lens, cu_q_lens, num_tokens)

    def rows_at(layer, pages, offsets):
        if not fp8:
            return kv_cache[layer, pages, offsets].astype(jnp.float32)
        scale = None if kv_cache.scale is None else kv_cache.scale[layer, pages, offsets]
        return dequantize_rows(kv_cache.latent[layer, pages, offsets], scale,
                               kv_cache.rope[layer, pages, offsets],
                               kv_lora_rank=kv_lora_rank, rope_dim=dim - kv_lora_rank)

    if topk_indices is None:
        span = max_pages * page_size
    else:
        span = topk_indices.shape[1]
    block = max(1, min(block_tokens, span))
    num_blocks = -(-span // block)
    if topk_indices is not None and num_blocks * block != span:
        topk_indices = jnp.pad(topk_indices, ((0, 0), (0, num_blocks * block - span)),
                               constant_values=-1)
    qf = q.astype(jnp.float32) * sm_scale
    rows_pages = page_indices[req]                                          # [T, P]

    def body(b, carry):
        m, l, acc = carry
        if topk_indices is None:
            idx = b * block + jnp.arange(block, dtype=jnp.int32)[None, :]
            idx = jnp.broadcast_to(idx, (num_tokens, block))
        else:
            idx = jax.lax.dynamic_slice_in_dim(topk_indices, b * block, block, axis=1)
        ok = (idx >= 0) & (idx <= pos[:, None]) & (idx < kv_len[:, None])  # [T, B]
        safe = jnp.maximum(idx, 0)
        page_slot = jnp.minimum(safe // page_size, max_pages - 1)
        pages = jnp.take_along_axis(rows_pages, page_slot, axis=1)          # [T, B]
        kv = rows_at(layer, pages, safe % page_size)                       # [T, B, D]
        kv = jnp.where(ok[..., None], kv, 0.0)        # NaN in unused slots must not leak
        s = jnp.einsum("thd,tbd->thb", qf, kv)
        s = jnp.where(ok[:, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(ok[:, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + p.sum(axis=-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("thb,tbd->thd", p, kv[..., :kv_lora_rank])
        return m_new, l_new, acc_new

    m0 = jnp.full((num_tokens, num_heads), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((num_tokens, num_heads), jnp.float32)
    acc0 = jnp.zeros((num_tokens, num_heads, kv_lora_rank), jnp.float32)
    if num_blocks == 1:
        m, l, acc = body(0, (m0, l0, acc0))
    else:
        m, l, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.astype(q.dtype)
