"""MLA attention (dense or top-k sparse) over the paged latent cache as a Pallas TPU kernel.

One program per query token, all heads at once (``[H, Dl + Dr]`` rows: H is 16..128 for the
DeepSeek family, enough rows for the MXU). The latent pool stays in HBM (``pl.ANY``); the
program gathers its candidate rows ``block_tokens`` at a time into a double-buffered VMEM
buffer and runs an online softmax:

    sparse: topk[t, c*B + j] = position i  --row DMA-->  buf[slot, j]
            pool[layer, page_indices[r, i // page_size], i % page_size]
            (empty / non-causal entries: the row is zero-filled, its score masked)
    dense:  chunk c = positions [c*B, (c+1)*B): whole pages DMA'd,
            page_indices[r, c*B/ps + k] --page DMA--> buf[slot, k*ps:(k+1)*ps]

The top-k list of the token arrives twice, laid out ``[chunks, B]``: in SMEM (scalars for DMA
addresses) and in VMEM (one lane vector per chunk for the score mask). Entries past the last
selectable one are never visited. Per-token metadata (request, position) and the page table
come by scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.pallas_kernels.mla_sparse_attention.reference import (
    MASK_VALUE, check_kernel_inputs, kernel_metadata, pad_topk, topk_scan_lengths)
from pdjax.pallas_kernels.mla_sparse_attention.tuning import MlaBlockSizes, get_block_sizes

_LANES = 128


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,         # [1] int32
    tok_req_ref,       # [T] int32 request of each token (0 for padding)
    tok_pos_ref,       # [T] int32 position of each token (-1 for padding)
    tok_len_ref,       # [T] int32 sparse: top-k entries up to the last selectable one
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    *refs,
    sparse: bool,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
    kv_lora_rank: int,
):
    if sparse:
        (topk_smem,    # [NC, B] int32 SMEM block: top-k positions of this token, by chunk
         topk_vmem,    # [NC, B] int32 VMEM block: the same, one lane vector per chunk
         q_ref,        # [H, D] VMEM block
         kv_hbm,       # [L, N, page_size, D] HBM (pl.ANY)
         o_ref,        # [H, Dl] VMEM block
         buf,          # [2, B, D] kv dtype
         sems,         # DMA semaphores [2]
         m_ref, l_ref,  # [H, 128] f32 running max / denominator
         acc_ref) = refs  # [H, Dl] f32 running numerator
    else:
        q_ref, kv_hbm, o_ref, buf, sems, m_ref, l_ref, acc_ref = refs
    t = pl.program_id(0)
    block = buf.shape[1]
    num_heads = q_ref.shape[0]
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    layer = layer_ref[0]
    req = tok_req_ref[t]
    pos = tok_pos_ref[t]
    kv_len = kv_lens_ref[req]
    row_base = req * pages_per_seq

    if sparse:
        # Entries past the last selectable one (usually the -1 tail) are never fetched.
        num_entries = tok_len_ref[t]
        num_chunks = lax.div(num_entries + block - 1, block)

        def entry_ok(i):
            return (i >= 0) & (i <= pos) & (i < kv_len)

        def row_copy(c, slot, j):
            i = topk_smem[c, j]
            page = page_indices_ref[row_base + jnp.minimum(lax.div(jnp.maximum(i, 0), page_size),
                                                           pages_per_seq - 1)]
            off = lax.rem(jnp.maximum(i, 0), page_size)
            return entry_ok(i), pltpu.make_async_copy(
                kv_hbm.at[layer, page, pl.ds(off, 1)], buf.at[slot, pl.ds(j, 1)], sems.at[slot])

        def rows_in(c):
            return jnp.minimum(num_entries - c * block, block)

        def start_fetch(c, slot):
            # Rows of empty entries stay zero (NaN-free values for p @ v); the store is issued
            # before the DMAs that overwrite the selected rows.
            buf[slot] = jnp.zeros(buf.shape[1:], buf.dtype)

            def body(j, carry):
                ok, copy = row_copy(c, slot, j)

                @pl.when(ok)
                def _():
                    copy.start()
                return carry
            lax.fori_loop(0, rows_in(c), body, 0)

        def wait_fetch(c, slot):
            def body(j, carry):
                ok, copy = row_copy(c, slot, j)

                @pl.when(ok)
                def _():
                    copy.wait()
                return carry
            lax.fori_loop(0, rows_in(c), body, 0)

        def chunk_mask(c):
            idx = topk_vmem[pl.ds(c, 1), :]                                     # [1, B]
            return entry_ok(idx), None
    else:
        pages_per_block = block // page_size
        used_pages = lax.div(kv_len + page_size - 1, page_size)
        num_chunks = jnp.where(pos >= 0, lax.div(pos + block, block), 0)

        def page_copy(c, slot, k):
            p = c * pages_per_block + k
            page = page_indices_ref[row_base + jnp.minimum(p, pages_per_seq - 1)]
            needed = (p * page_size <= pos) & (p < used_pages)
            dst = pl.ds(pl.multiple_of(k * page_size, page_size), page_size)
            return needed, pltpu.make_async_copy(kv_hbm.at[layer, page], buf.at[slot, dst],
                                                 sems.at[slot])

        def for_each_page(c, slot, action):
            def body(k, carry):
                needed, copy = page_copy(c, slot, k)

                @pl.when(needed)
                def _():
                    action(copy)
                return carry
            lax.fori_loop(0, pages_per_block, body, 0)

        def start_fetch(c, slot):
            for_each_page(c, slot, lambda cp: cp.start())

        def wait_fetch(c, slot):
            for_each_page(c, slot, lambda cp: cp.wait())

        def chunk_mask(c):
            base = c * block
            row = base + lax.broadcasted_iota(jnp.int32, (1, block), 1)
            col = base + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
            return (row <= pos) & (row < kv_len), (col <= pos) & (col < kv_len)

    def compute(c, slot):
        mask, col_mask = chunk_mask(c)                                        # [1, B], [B, 1]
        kv = buf[slot]                                                         # [B, D]
        if kv.dtype != compute_dtype:
            kv = kv.astype(jnp.float32).astype(compute_dtype)
        v = kv[:, :kv_lora_rank]
        if col_mask is not None:
            # Slots past the token's position were not fetched (stale or NaN).
            v = jnp.where(col_mask, v, jnp.zeros_like(v))
        q = q_ref[...]
        s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale       # [H, B]
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_ref[...][:, :1]
        l_prev = l_ref[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = jnp.broadcast_to(alpha * l_prev + jnp.sum(p, axis=1, keepdims=True),
                                      (num_heads, _LANES))
        m_ref[...] = jnp.broadcast_to(m_new, (num_heads, _LANES))
        pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = alpha * acc_ref[...] + pv

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(num_chunks > 0)
    def _walk():
        start_fetch(0, 0)

        def body(c, carry):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < num_chunks)
            def _():
                start_fetch(c + 1, 1 - slot)

            wait_fetch(c, slot)
            compute(c, slot)
            return carry

        lax.fori_loop(0, num_chunks, body, 0)

    l = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def mla_sparse_attention_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    block_sizes: MlaBlockSizes | None = None,
) -> jax.Array:
    """Pallas TPU MLA attention; contract of ``mla_sparse_attention_reference``.

    Args:
      q: ``[T, H, Dl + Dr]`` float32 or bfloat16.
      kv_cache: ``[layers, num_pages, page_size, Dl + Dr]`` float32 or bfloat16 (stays in HBM).
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      topk_indices: ``[T, K]`` int32 positions (-1 = empty) or None (dense causal).
      sm_scale: softmax scale; kv_lora_rank: value width ``Dl``.
      interpret: False on TPU; True or ``pltpu.InterpretParams`` to run on CPU.
      block_sizes: override of ``tuning.get_block_sizes``.

    Returns:
      ``[T, H, Dl]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: inputs outside the contract, or an illegal block size.
    """
    check_kernel_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        topk_indices, kv_lora_rank)
    del distribution      # one program per token: padding rows have position -1
    num_tokens, num_heads, dim = q.shape
    _, num_pages, page_size, _ = kv_cache.shape
    pages_per_seq = page_indices.shape[1]
    sparse = topk_indices is not None
    span = topk_indices.shape[1] if sparse else pages_per_seq * page_size
    bs = block_sizes or get_block_sizes("tpu", num_heads=num_heads, dim=dim,
                                        page_size=page_size, span=span)
    block = bs.block_tokens
    if block % page_size:
        raise ValueError(f"block_tokens ({block}) must be a multiple of page_size ({page_size})")
    req, pos, kv_len, flat_pages, layer_arr = kernel_metadata(
        kv_lens, cu_q_lens, page_indices, layer, num_tokens, num_pages)
    num_entries = topk_scan_lengths(topk_indices, pos, kv_len)

    token_block = lambda t, *_: (t, 0, 0)   # noqa: E731
    in_specs, args = [], []
    if sparse:
        topk, num_chunks = pad_topk(topk_indices, block)
        topk = topk.reshape(num_tokens, num_chunks, block)
        in_specs += [pl.BlockSpec((None, num_chunks, block), token_block,
                                  memory_space=pltpu.SMEM),
                     pl.BlockSpec((None, num_chunks, block), token_block)]
        args += [topk, topk]
    in_specs += [pl.BlockSpec((None, num_heads, dim), token_block),
                 pl.BlockSpec(memory_space=pl.ANY)]
    args += [q, kv_cache]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_tokens,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, num_heads, kv_lora_rank), token_block),
        scratch_shapes=[
            pltpu.VMEM((2, block, dim), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((num_heads, _LANES), jnp.float32),
            pltpu.VMEM((num_heads, _LANES), jnp.float32),
            pltpu.VMEM((num_heads, kv_lora_rank), jnp.float32),
        ],
    )
    kernel = functools.partial(_kernel, sparse=sparse, page_size=page_size,
                               pages_per_seq=pages_per_seq, sm_scale=float(sm_scale),
                               kv_lora_rank=kv_lora_rank)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads, kv_lora_rank), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="mla_sparse_attention_tpu" if sparse else "mla_dense_attention_tpu",
    )(layer_arr, req, pos, num_entries, kv_lens, flat_pages, *args)
