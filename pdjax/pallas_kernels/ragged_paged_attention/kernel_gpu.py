"""Ragged paged attention as a Pallas GPU kernel, lowered through Triton.

Backend choice: the Triton lowering is picked explicitly with ``pltriton.CompilerParams`` (jax
0.10 defaults Pallas-on-CUDA to Mosaic GPU; jax 0.11 still ships Triton, with a deprecation
warning). Triton's masked pointer loads express the page-table gather directly; the same kernel
runs on CPU under ``interpret=True`` and lowers for ``cuda`` without a GPU.

One kernel instance per ``distribution`` path (``common.py``). Program ``(b, h)`` owns query
block ``first_block + b`` and KV head ``h``; its tile has ``M = q_tokens * group_pad`` rows:

    row m -> token blk_start + m // group_pad,  query head h * G + (m % group_pad)
    (rows with m % group_pad >= G are padding: Triton tiles are powers of two, >= 16 rows)

For each request met by the block it loops over ``kv_tokens``-row KV steps; a step gathers
rows straight from the stacked pool (no copy of the pool):

    k[r, :] = k_cache[layer, page_indices[s, pos_r // page_size], pos_r % page_size, h, :]

masked to ``pos_r < kv_lens[s]`` (so NaN in unused slots is never read), then runs one
online-softmax step with tensor-core dots. An FP8 cache with per-token scales (``fp8_kv``)
gathers each key's K and V scale beside it (``[L, N, ps, Hkv]`` float32): the scores are
multiplied by the K scales, the probabilities by the V scales before the PV dot (the softmax
sum stays unscaled). The decode path is ``q_tokens = 1``: one request
per program. Each program stores its whole tile to a disjoint slice of a per-path output
``[Hkv, num_blocks * M, D]``; the wrapper unpads it and ``merge_paths`` picks each token's row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pdjax.pallas_kernels.triton_call import is_pow2, triton_call
from pdjax.pallas_kernels.ragged_paged_attention.common import (
    MASK_VALUE, block_metadata, cdiv, grid_size, run_kernel_paths)
from pdjax.pallas_kernels.ragged_paged_attention.fp8_kv import check_scale_caches
from pdjax.pallas_kernels.ragged_paged_attention.reference import split_kv_heads
from pdjax.pallas_kernels.ragged_paged_attention.tuning import BlockSizes, gpu_group_pad


def _kernel(
    head_ref,          # [3] int32: first_block, num_blocks, layer
    blk_seqs_ref,      # [2 * grid] int32: requests met by each program
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    cu_q_lens_ref,     # [R + 1] int32
    q_ref,             # [T, Hq, D]
    k_ref,             # [L, N, page_size, Hkv, D]
    v_ref,             # [L, N, page_size, Hkv, D]
    *refs,             # (ks_ref, vs_ref [L, N, page_size, Hkv] float32 when scaled), o_ref
    scaled: bool,
    q_tokens: int,
    group: int,
    group_pad: int,
    kv_tokens: int,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
):
    if scaled:
        ks_ref, vs_ref, o_ref = refs
    else:
        (o_ref,) = refs
    b, h = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = q_ref.shape
    rows = q_tokens * group_pad
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)
    first_block, num_blocks, layer = head_ref[0], head_ref[1], head_ref[2]

    @pl.when(b < num_blocks)
    def _program():
        blk = first_block + b
        blk_start = blk * q_tokens
        blk_end = blk_start + q_tokens
        m_idx = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        g = lax.rem(m_idx, jnp.int32(group_pad))
        tok = blk_start + lax.div(m_idx, jnp.int32(group_pad))                   # [M]
        head = h * group + jnp.minimum(g, group - 1)
        cols = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
        q = q_ref[jnp.minimum(tok, num_tokens - 1)[:, None], head[:, None], cols[None, :]]
        kv_iota = lax.broadcasted_iota(jnp.int32, (kv_tokens,), 0)

        def seq_body(s, carry):
            q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
            kv_len = kv_lens_ref[s]
            offset = kv_len - (q_end - q_start)          # cache position of token q_start
            row_ok = (g < group) & (tok >= q_start) & (tok < q_end)               # [M]
            pos = offset + tok - q_start                                          # [M]
            last_pos = jnp.maximum(offset + jnp.minimum(q_end, blk_end) - 1 - q_start, 0)
            used_blocks = lax.div(kv_len + kv_tokens - 1, jnp.int32(kv_tokens))
            if sliding_window is None:
                kb_lo = jnp.int32(0)
            else:
                first_pos = offset + jnp.maximum(q_start, blk_start) - q_start
                kb_lo = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0),
                                jnp.int32(kv_tokens))
            kb_hi = jnp.minimum(lax.div(last_pos, jnp.int32(kv_tokens)) + 1, used_blocks)

            def kv_body(kb, carry):
                acc, m_i, l_i = carry
                kv_pos = kb * kv_tokens + kv_iota                                 # [BK]
                kv_ok = kv_pos < kv_len
                page_slot = jnp.minimum(lax.div(kv_pos, jnp.int32(page_size)), pages_per_seq - 1)
                pages = page_indices_ref[s * pages_per_seq + page_slot]           # [BK]
                in_page = lax.rem(kv_pos, jnp.int32(page_size))
                idx = (layer, pages[:, None], in_page[:, None], h, cols[None, :])
                load_mask = jnp.broadcast_to(kv_ok[:, None], (kv_tokens, head_dim))
                # Masked-off rows are not read; their values are undefined (no `other`: Triton
                # cannot splat a fill value into fp8), so V is zeroed after the cast and the
                # scores of those columns are replaced below.
                k = pltriton.load(k_ref.at[idx], mask=load_mask).astype(compute_dtype)  # [BK, D]
                v = pltriton.load(v_ref.at[idx], mask=load_mask).astype(compute_dtype)
                v = jnp.where(load_mask, v, jnp.zeros_like(v))
                s_ij = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                       precision=precision,
                                       preferred_element_type=jnp.float32) * score_scale
                if scaled:
                    # Per-token scales; masked-off ones are undefined, so zeroed.
                    sidx = (layer, pages, in_page, h)
                    ks = jnp.where(kv_ok, pltriton.load(ks_ref.at[sidx], mask=kv_ok), 0.0)
                    vs = jnp.where(kv_ok, pltriton.load(vs_ref.at[sidx], mask=kv_ok), 0.0)
                    s_ij = s_ij * ks[None, :]
                if soft_cap is not None:
                    s_ij = soft_cap * jnp.tanh(s_ij / soft_cap)
                mask = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= pos[:, None])
                if sliding_window is not None:
                    mask = mask & (kv_pos[None, :] > pos[:, None] - sliding_window)
                s_ij = jnp.where(mask, s_ij, MASK_VALUE)
                m_new = jnp.maximum(m_i, jnp.max(s_ij, axis=1))
                p = jnp.where(mask, jnp.exp(s_ij - m_new[:, None]), 0.0)
                alpha = jnp.exp(m_i - m_new)
                l_new = alpha * l_i + jnp.sum(p, axis=1)
                pw = p * vs[None, :] if scaled else p
                pv = lax.dot_general(pw.astype(compute_dtype), v,
                                     (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
                return alpha[:, None] * acc + pv, m_new, l_new

            return lax.fori_loop(kb_lo, kb_hi, kv_body, carry)

        init = (jnp.zeros((rows, head_dim), jnp.float32),
                jnp.full((rows,), MASK_VALUE, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, _, l_i = lax.fori_loop(blk_seqs_ref[2 * b], blk_seqs_ref[2 * b + 1], seq_body, init)
        out = acc / jnp.where(l_i > 0.0, l_i, 1.0)[:, None]
        if v_scale is not None:
            out = out * v_scale
        o_ref[h, pl.ds(blk * rows, rows), :] = out.astype(o_ref.dtype)


def _call_path(path: str, bs: BlockSizes, q, k_cache, v_cache, layer, kv_lens, page_indices,
               cu_q_lens, distribution, *, sm_scale, sliding_window, soft_cap, k_scale,
               v_scale, interpret, k_scales=None, v_scales=None):
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // num_seqs
    group = num_q_heads // num_kv_heads
    q_tokens, kv_tokens = bs.q_tokens, bs.kv_tokens
    group_pad = gpu_group_pad(group, q_tokens)
    rows = q_tokens * group_pad
    if not (is_pow2(rows) and is_pow2(kv_tokens) and kv_tokens >= 16):
        raise ValueError(
            f"GPU block sizes must give power-of-two tiles (q_tokens * group_pad = {rows}, "
            f"kv_tokens = {kv_tokens} >= 16)")
    grid = grid_size(path, num_tokens, num_seqs, q_tokens)
    head, blk_seqs = block_metadata(cu_q_lens, distribution, path, q_tokens=q_tokens,
                                    num_tokens=num_tokens, grid=grid)
    head = head.at[2].set(layer)
    num_q_blocks = cdiv(num_tokens, q_tokens)
    kernel = functools.partial(
        _kernel, q_tokens=q_tokens, group=group, group_pad=group_pad, kv_tokens=kv_tokens,
        page_size=page_size, pages_per_seq=pages_per_seq, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        scaled=k_scales is not None)
    scales = () if k_scales is None else (k_scales, v_scales)
    tiles = triton_call(
        kernel, grid=(grid, num_kv_heads), num_inputs=8 + len(scales),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_q_blocks * rows, head_dim), q.dtype),
        block_sizes=bs, interpret=interpret, name=f"ragged_paged_attention_gpu_{path}",
    )(head, blk_seqs, kv_lens, page_indices, cu_q_lens, q, k_cache, v_cache, *scales)
    # [Hkv, blocks * q_tokens, group_pad, D] -> [T, Hkv, G, D] -> [T, Hq, D]
    tiles = tiles.reshape(num_kv_heads, num_q_blocks * q_tokens, group_pad, head_dim)
    tiles = tiles[:, :num_tokens, :group].transpose(1, 0, 2, 3)
    return tiles.reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention_gpu(
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
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    interpret: bool = False,
    block_sizes: dict[str, BlockSizes] | None = None,
) -> jax.Array:
    """Pallas GPU (Triton) ragged paged attention; contract of ``ragged_paged_attention_reference``.

    Args:
      q: ``[T, num_q_heads, head_dim]`` float32 or bfloat16; head_dim a power of two >= 16.
      k_cache, v_cache: ``[layers, num_pages, page_size, num_kv_heads * head_dim]`` (or
        ``[.., num_kv_heads, head_dim]``) float32, bfloat16 or float8_e4m3fn; rows of ``layer``
        are gathered in place.
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      sm_scale, sliding_window, soft_cap: as in the reference (static).
      k_scale, v_scale: static dequantization scales of the cache (fp8 KV), or None.
      k_scales, v_scales: ``[layers, num_pages, page_size, num_kv_heads]`` float32 per-token
        scales of a float8_e4m3fn cache (``fp8_kv``), or None.
      interpret: False on GPU; True runs the kernel on CPU through the Pallas interpreter.
      block_sizes: path -> ``BlockSizes`` override of the tuning table.

    Returns:
      ``[T, num_q_heads, head_dim]`` in ``q.dtype``; rows past ``cu_q_lens[distribution[2]]``
      are 0.

    Raises:
      ValueError: shapes, dtypes or scales outside the contract, or a head_dim / block size
        that Triton cannot tile.
    """
    head_dim = q.shape[-1]
    if not is_pow2(head_dim) or head_dim < 16:
        raise ValueError(
            f"head_dim must be a power of two >= 16 for the GPU kernel, got {head_dim}")
    # The kernel indexes heads as a dimension; row-major, the view costs nothing.
    k_cache, v_cache = split_kv_heads(k_cache, head_dim), split_kv_heads(v_cache, head_dim)
    check_scale_caches(k_cache, k_scales, v_scales)
    extra = {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)
    return run_kernel_paths(
        "gpu", _call_path, q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens,
        distribution, block_sizes=block_sizes, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, interpret=interpret, **extra)
