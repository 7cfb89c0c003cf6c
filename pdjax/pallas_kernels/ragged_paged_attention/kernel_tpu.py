"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

One kernel instance per ``distribution`` path (decode / prefill / mixed, see ``common.py``),
each with its own block sizes from ``tuning.py``. A program owns one block of ``q_tokens``
query tokens (all query heads) and walks the requests that own those tokens; for each request
it streams the needed KV blocks from the stacked pool, which stays in HBM (``pl.ANY``):

    pool [layers, num_pages, page_size, Hkv * D]  (HBM; KV heads side by side in a row)
      page_indices[s, kb*ppb + i] --DMA--> k_buf[slot, i*page_size:(i+1)*page_size, :]
    k_buf, v_buf [2 slots, kv_tokens, Hkv * D]    (VMEM, double-buffered)
    head h of a block = k_buf[slot, :, h*D:(h+1)*D]

The pool is taken as rows so that a page is whole (16, 128) tiles whenever ``Hkv * D`` is a
multiple of 128. ``[.., page_size, Hkv, D]`` puts (Hkv, D) in the tiled minor dimensions: with
one KV head per shard a tile holds one of its 16 sublanes, in HBM and in the VMEM buffers, and
the real-size compile of Llama-3-70B at TP 8 needed 53 GB of temporaries for it (DESIGN.md §7).

The next (request, KV block) item is prefetched into the other slot while the current one is
computed. Pages past a request's ``kv_lens`` are never fetched; rows of a block that belong to
another request or path are masked and never change the online-softmax state. Metadata
(``kv_lens``, flattened ``page_indices``, ``cu_q_lens``, per-program request ranges) arrives by
scalar prefetch into SMEM.

Decode programs (``q_len == 1`` by contract) compute only the ``G`` query heads of each request's
single row; prefill and mixed programs fold the block to ``[q_tokens * G, D]`` rows per KV head
and mask by row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.pallas_kernels.ragged_paged_attention.common import (
    MASK_VALUE, block_metadata, cdiv, grid_size, run_kernel_paths)
from pdjax.pallas_kernels.ragged_paged_attention.reference import join_kv_heads
from pdjax.pallas_kernels.ragged_paged_attention.tuning import BlockSizes

_LANES = 128


def _to_compute(x: jax.Array, dtype) -> jax.Array:
    if x.dtype == dtype:
        return x
    # Mosaic converts between narrow float types through f32.
    x = x.astype(jnp.float32)
    return x if dtype == jnp.float32 else x.astype(dtype)


def _fold_heads(x: jax.Array) -> jax.Array:
    """``[BQ, G, D] -> [BQ*G, D]`` (row = token * G + head); packed dtypes fold via f32."""
    bq, g, d = x.shape
    if x.dtype != jnp.float32 and g % 2:
        return x.astype(jnp.float32).reshape(bq * g, d).astype(x.dtype)
    return x.reshape(bq * g, d)


def _kernel(
    # Scalar prefetch (SMEM).
    head_ref,          # [3] int32: first_block, num_blocks, layer
    blk_seqs_ref,      # [2 * grid] int32: requests met by each program
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    cu_q_lens_ref,     # [R + 1] int32
    # Inputs.
    q_ref,             # [BQ, Hq, D] VMEM block
    k_hbm_ref,         # [L, N, page_size, Hkv * D] HBM (pl.ANY)
    v_hbm_ref,         # [L, N, page_size, Hkv * D] HBM (pl.ANY)
    # Output.
    o_ref,             # [BQ, Hq, D] VMEM block
    # Scratch.
    k_buf,             # [2, BK, Hkv * D] kv dtype
    v_buf,             # [2, BK, Hkv * D] kv dtype
    sems,              # DMA semaphores [2 slots, 2 (k, v)]
    m_ref,             # decode [Hkv, BQ, G, 128] / else [Hkv, BQ*G, 128] f32 running max
    l_ref,             # same shape, running denominator
    acc_ref,           # decode [Hkv, BQ, G, D] / else [Hkv, BQ*G, D] f32 running numerator
    stage_ref,         # [BQ, Hq, D] f32 output staging
    *,
    decode: bool,
    group: int,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
):
    b = pl.program_id(0)
    q_tokens = q_ref.shape[0]
    head_dim = q_ref.shape[2]
    kv_tokens, num_kv_heads = k_buf.shape[1], k_buf.shape[2] // head_dim
    pages_per_block = kv_tokens // page_size
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    first_block, num_blocks, layer = head_ref[0], head_ref[1], head_ref[2]
    blk_start = (first_block + b) * q_tokens
    blk_end = blk_start + q_tokens
    seq_lo, seq_hi = blk_seqs_ref[2 * b], blk_seqs_ref[2 * b + 1]

    def seq_info(s):
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        kv_len = kv_lens_ref[s]
        # Cache position of token q_start (the KV write of this step is already done).
        return q_start, q_end, kv_len, kv_len - (q_end - q_start)

    def kv_block_range(s):
        """KV blocks ``[kb_lo, kb_hi)`` that the block's rows of request ``s`` can see."""
        q_start, q_end, kv_len, offset = seq_info(s)
        last_pos = jnp.maximum(offset + jnp.minimum(q_end, blk_end) - 1 - q_start, 0)
        used_blocks = lax.div(kv_len + kv_tokens - 1, kv_tokens)
        if sliding_window is None:
            kb_lo = jnp.int32(0)
        else:
            first_pos = offset + jnp.maximum(q_start, blk_start) - q_start
            kb_lo = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), kv_tokens)
        kb_hi = jnp.minimum(lax.div(last_pos, kv_tokens) + 1, used_blocks)
        return kb_lo, jnp.maximum(kb_hi, kb_lo + 1)

    def page_copies(s, kb, slot, i):
        """DMAs of page ``i`` of KV block ``kb`` of request ``s``, and whether it is needed."""
        kv_len = kv_lens_ref[s]
        used_pages = jnp.minimum(lax.div(kv_len + page_size - 1, page_size), pages_per_seq)
        p = kb * pages_per_block + i
        page = page_indices_ref[s * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
        dst = pl.ds(pl.multiple_of(i * page_size, page_size), page_size)
        return (p < used_pages,
                pltpu.make_async_copy(k_hbm_ref.at[layer, page], k_buf.at[slot, dst],
                                      sems.at[slot, 0]),
                pltpu.make_async_copy(v_hbm_ref.at[layer, page], v_buf.at[slot, dst],
                                      sems.at[slot, 1]))

    def for_each_page(s, kb, slot, action):
        def body(i, carry):
            needed, k_copy, v_copy = page_copies(s, kb, slot, i)

            @pl.when(needed)
            def _():
                action(k_copy)
                action(v_copy)
            return carry

        lax.fori_loop(0, pages_per_block, body, 0)

    def start_fetch(s, kb, slot):
        for_each_page(s, kb, slot, lambda c: c.start())

    def wait_fetch(s, kb, slot):
        for_each_page(s, kb, slot, lambda c: c.wait())

    def softmax_step(q, k, v, mask, m_view, l_view, acc_view):
        """One online-softmax update of ``rows`` query rows against ``BK`` keys."""
        rows = q.shape[0]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * score_scale   # [rows, BK]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_view[...][:, :1]                                            # [rows, 1]
        l_prev = l_view[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_view[...] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True),
                                       (rows, _LANES))
        m_view[...] = jnp.broadcast_to(m_new, (rows, _LANES))
        pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        acc_view[...] = alpha * acc_view[...] + pv

    def compute(s, kb, slot):
        q_start, q_end, kv_len, offset = seq_info(s)
        kv_base = kb * kv_tokens
        kv_pos = kv_base + lax.broadcasted_iota(jnp.int32, (1, kv_tokens), 1)     # [1, BK]
        kv_ok_col = (kv_base + lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0)) < kv_len
        if decode:
            row = q_start - blk_start                    # the request's only query row
            pos = offset
            mask = (kv_pos < kv_len) & (kv_pos <= pos)
            if sliding_window is not None:
                mask = mask & (kv_pos > pos - sliding_window)
            mask = jnp.broadcast_to(mask, (group, kv_tokens))
        else:
            # lax.div, not //: floor division of ints lowers through sign(), which Mosaic
            # only lowers with a TPU attached.
            rows = lax.broadcasted_iota(jnp.int32, (q_tokens * group, 1), 0)
            tok = blk_start + lax.div(rows, jnp.int32(group))
            pos = offset + tok - q_start                                          # [rows, 1]
            row_ok = (tok >= q_start) & (tok < q_end)
            mask = row_ok & (kv_pos < kv_len) & (kv_pos <= pos)
            if sliding_window is not None:
                mask = mask & (kv_pos > pos - sliding_window)
        for h in range(num_kv_heads):
            lanes = pl.ds(h * head_dim, head_dim)
            k = _to_compute(k_buf[slot, :, lanes], compute_dtype)                 # [BK, D]
            v = _to_compute(v_buf[slot, :, lanes], compute_dtype)
            # Slots past kv_len may hold NaN (stale or unused pages): 0 * NaN would leak.
            v = jnp.where(kv_ok_col, v, jnp.zeros_like(v))
            heads = pl.ds(h * group, group)
            if decode:
                q = q_ref[row, heads, :]                                         # [G, D]
                views = (m_ref.at[h, row], l_ref.at[h, row], acc_ref.at[h, row])
            else:
                q = _fold_heads(q_ref[:, heads, :])                              # [BQ*G, D]
                views = (m_ref.at[h], l_ref.at[h], acc_ref.at[h])
            softmax_step(q, k, v, mask, *views)

    @pl.when(b < num_blocks)
    def _program():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(seq_lo < seq_hi)
        def _walk():
            kb_lo, kb_hi = kv_block_range(seq_lo)
            start_fetch(seq_lo, kb_lo, 0)

            def body(carry):
                s, kb, kb_end, slot = carry
                seq_done = kb + 1 >= kb_end
                next_s = jnp.where(seq_done, s + 1, s)
                next_lo, next_hi = kv_block_range(jnp.minimum(next_s, seq_hi - 1))
                next_kb = jnp.where(seq_done, next_lo, kb + 1)
                next_end = jnp.where(seq_done, next_hi, kb_end)

                @pl.when(next_s < seq_hi)
                def _():
                    start_fetch(next_s, next_kb, 1 - slot)

                wait_fetch(s, kb, slot)
                compute(s, kb, slot)
                return next_s, next_kb, next_end, 1 - slot

            lax.while_loop(lambda c: c[0] < seq_hi, body, (seq_lo, kb_lo, kb_hi, jnp.int32(0)))

        for h in range(num_kv_heads):
            l = l_ref[h][..., :1]
            out = acc_ref[h] / jnp.where(l > 0.0, l, 1.0)
            if v_scale is not None:
                out = out * v_scale
            if not decode:
                out = out.reshape(q_tokens, group, head_dim)
            stage_ref[:, pl.ds(h * group, group), :] = out
        o_ref[...] = stage_ref[...].astype(o_ref.dtype)


def _call_path(path: str, bs: BlockSizes, q, k_cache, v_cache, layer, kv_lens, page_indices,
               cu_q_lens, distribution, *, sm_scale, sliding_window, soft_cap, k_scale,
               v_scale, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, row = k_cache.shape
    num_kv_heads = row // head_dim
    num_seqs, pages_per_seq = kv_lens.shape[0], page_indices.shape[0] // kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    decode = path == "decode"
    q_tokens, kv_tokens = bs.q_tokens, bs.kv_tokens
    if kv_tokens % page_size:
        raise ValueError(f"kv_tokens ({kv_tokens}) must be a multiple of page_size ({page_size})")
    grid = grid_size(path, num_tokens, num_seqs, q_tokens)
    head, blk_seqs = block_metadata(cu_q_lens, distribution, path, q_tokens=q_tokens,
                                    num_tokens=num_tokens, grid=grid)
    head = head.at[2].set(layer)
    num_q_blocks = cdiv(num_tokens, q_tokens)

    def q_index_map(b, head_ref, *_):
        # Idle programs repeat the last real block: no refetch, and they never write it.
        last = jnp.maximum(head_ref[1] - 1, 0)
        return jnp.minimum(head_ref[0] + jnp.minimum(b, last), num_q_blocks - 1), 0, 0

    rows = (q_tokens, group) if decode else (q_tokens * group,)
    block = pl.BlockSpec((q_tokens, num_q_heads, head_dim), q_index_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(grid,),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block,
        scratch_shapes=[
            pltpu.VMEM((2, kv_tokens, row), k_cache.dtype),
            pltpu.VMEM((2, kv_tokens, row), v_cache.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv_heads, *rows, _LANES), jnp.float32),
            pltpu.VMEM((num_kv_heads, *rows, _LANES), jnp.float32),
            pltpu.VMEM((num_kv_heads, *rows, head_dim), jnp.float32),
            pltpu.VMEM((q_tokens, num_q_heads, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel, decode=decode, group=group, page_size=page_size, pages_per_seq=pages_per_seq,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q.dtype),
        # "arbitrary": idle programs share the last block index, so the grid must not be
        # split across cores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name=f"ragged_paged_attention_tpu_{path}",
    )(head, blk_seqs, kv_lens, page_indices, cu_q_lens, q, k_cache, v_cache)


def ragged_paged_attention_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    block_sizes: dict[str, BlockSizes] | None = None,
) -> jax.Array:
    """Pallas TPU ragged paged attention; same contract as ``ragged_paged_attention_reference``.

    Args:
      q: ``[T, num_q_heads, head_dim]`` float32 or bfloat16.
      k_cache, v_cache: ``[layers, num_pages, page_size, num_kv_heads * head_dim]`` float32,
        bfloat16 or float8_e4m3fn; stay in HBM, pages of ``layer`` are DMA'd. A
        ``[.., num_kv_heads, head_dim]`` cache is taken as rows too, but on TPU that reshape
        is a copy of the whole pool: pass rows.
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      sm_scale, sliding_window, soft_cap: as in the reference (static).
      k_scale, v_scale: static dequantization scales of the cache (fp8 KV), or None.
      interpret: False on TPU; True or ``pltpu.InterpretParams`` to run on CPU.
      block_sizes: path -> ``BlockSizes`` override of the tuning table.

    Returns:
      ``[T, num_q_heads, head_dim]`` in ``q.dtype``; rows past ``cu_q_lens[distribution[2]]``
      are 0.

    Raises:
      ValueError: shapes, dtypes or scales outside the contract.
    """
    k_cache, v_cache = join_kv_heads(k_cache), join_kv_heads(v_cache)
    return run_kernel_paths(
        "tpu", _call_path, q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens,
        distribution, block_sizes=block_sizes, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, interpret=interpret)
