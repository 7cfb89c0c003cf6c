"""MLA attention (dense or top-k sparse) over the paged latent cache as a Pallas GPU kernel.

Lowered through Triton, chosen explicitly with ``pltriton.CompilerParams`` (as the ragged paged
attention GPU kernel). Program ``(t, hb)`` owns query token ``t`` and heads
``[hb * BH, (hb + 1) * BH)`` (BH a power of two >= 16 for tensor-core dots; heads past H are
padding rows). It walks the token's candidates ``B`` at a time and gathers their latent rows
straight from the pool with masked pointer loads:

    i = topk[t, c*B + j]  (sparse)   or   c*B + j  (dense, up to the token's position)
    row_j = pool[layer, page_indices[r, i // page_size], i % page_size, :]

The row is loaded in two power-of-two pieces, latent ``[:Dl]`` and rope ``[Dl:]`` (Triton
tiles are powers of two; 512 + 64 for DeepSeek). Each program stores its ``[BH, Dl]`` tile to
a disjoint slice of ``[T, NHB * BH, Dl]``; the wrapper drops the padding heads.

FP8 KV (``fp8_record.Fp8Latent``, the 656-byte record's planes): the latent piece is loaded as
float8_e4m3fn and multiplied by its group's float32 scale (a ``[B, Dl]`` gather of the ``[B, G]``
scales, one per 128 columns), the rope piece from the bf16 plane; the dots then run in the
query's dtype as for a bf16 cache. The pool is read at 656 bytes per token instead of 1152.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pdjax.pallas_kernels.triton_call import is_pow2, triton_call
from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import SCALE_GROUP, Fp8Latent
from pdjax.pallas_kernels.mla_sparse_attention.reference import (
    MASK_VALUE, check_kernel_inputs, kernel_metadata, pad_topk, token_scalars, topk_scan_lengths)
from pdjax.pallas_kernels.mla_sparse_attention.tuning import MlaBlockSizes, get_block_sizes


def _kernel(
    meta_ref,          # [1] int32: layer
    tok_req_ref,       # [T] int32 request of each token (0 for padding)
    tok_pos_ref,       # [T] int32 position (-1 for padding)
    tok_len_ref,       # [T] int32 sparse: top-k entries up to the last selectable one
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    topk_ref,          # [T, Kp] int32 (sparse) / [1, 1] unused (dense)
    q_ref,             # [T, H, Dl + Dr]
    kv_ref,            # [L, N, page_size, Dl + Dr]  (FP8: the latent plane [.., Dl] e4m3)
    *refs,             # FP8: scale [L, N, ps, G] f32, rope [L, N, ps, Dr] bf16; then
                       # o_ref [T, NHB * BH, Dl]
    fp8: bool,
    sparse: bool,
    num_chunks: int,
    block: int,
    heads_per_block: int,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
    kv_lora_rank: int,
):
    if fp8:
        scale_ref, rope_ref, o_ref = refs
    else:
        (o_ref,) = refs
    t, hb = pl.program_id(0), pl.program_id(1)
    _, num_heads, dim = q_ref.shape
    rope_dim = dim - kv_lora_rank
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    layer, req, pos, kv_len = token_scalars(t, meta_ref, tok_req_ref, tok_pos_ref, kv_lens_ref)

    heads = hb * heads_per_block + lax.broadcasted_iota(jnp.int32, (heads_per_block,), 0)
    heads_c = jnp.minimum(heads, num_heads - 1)[:, None]
    cols_l = lax.broadcasted_iota(jnp.int32, (kv_lora_rank,), 0)
    cols_r = kv_lora_rank + lax.broadcasted_iota(jnp.int32, (rope_dim,), 0)
    tok = jnp.full((heads_per_block, 1), t, jnp.int32)
    q_l = q_ref[tok, heads_c, cols_l[None, :]]                                  # [BH, Dl]
    q_r = q_ref[tok, heads_c, cols_r[None, :]]                                  # [BH, Dr]
    iota = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def chunk(c, carry):
        acc, m_i, l_i = carry
        if sparse:
            idx = topk_ref[t, pl.ds(c * block, block)]                          # [B]
        else:
            idx = c * block + iota
        ok = (idx >= 0) & (idx <= pos) & (idx < kv_len)
        safe = jnp.maximum(idx, 0)
        slot = jnp.minimum(lax.div(safe, jnp.int32(page_size)), pages_per_seq - 1)
        pages = page_indices_ref[req * pages_per_seq + slot]                    # [B]
        offs = lax.rem(safe, jnp.int32(page_size))
        # Masked rows are not read (their value is undefined): zero them after the cast.
        mask_l = jnp.broadcast_to(ok[:, None], (block, kv_lora_rank))
        mask_r = jnp.broadcast_to(ok[:, None], (block, rope_dim))
        at = (layer, pages[:, None], offs[:, None])
        if fp8:
            kv_l = pltriton.load(kv_ref.at[(*at, cols_l[None, :])], mask=mask_l)
            group = lax.div(cols_l, jnp.int32(SCALE_GROUP))
            scale = pltriton.load(scale_ref.at[(*at, group[None, :])], mask=mask_l)  # [B, Dl]
            # Exact in the compute dtype: e4m3 values and power-of-two scales fit bf16.
            kv_l = kv_l.astype(compute_dtype) * scale.astype(compute_dtype)
            kv_r = pltriton.load(rope_ref.at[(*at, (cols_r - kv_lora_rank)[None, :])],
                                 mask=mask_r).astype(compute_dtype)             # [B, Dr]
        else:
            kv_l = pltriton.load(kv_ref.at[(*at, cols_l[None, :])],
                                 mask=mask_l).astype(compute_dtype)             # [B, Dl]
            kv_r = pltriton.load(kv_ref.at[(*at, cols_r[None, :])],
                                 mask=mask_r).astype(compute_dtype)             # [B, Dr]
        kv_l = jnp.where(mask_l, kv_l, jnp.zeros_like(kv_l))
        kv_r = jnp.where(mask_r, kv_r, jnp.zeros_like(kv_r))
        dims = (((1,), (1,)), ((), ()))
        s = (lax.dot_general(q_l, kv_l, dims, precision=precision,
                             preferred_element_type=jnp.float32)
             + lax.dot_general(q_r, kv_r, dims, precision=precision,
                               preferred_element_type=jnp.float32)) * sm_scale    # [BH, B]
        s = jnp.where(ok[None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m_i - m_new)
        l_new = alpha * l_i + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(compute_dtype), kv_l, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l_new

    if sparse:
        n = jnp.minimum(lax.div(tok_len_ref[t] + block - 1, jnp.int32(block)), num_chunks)
    else:
        n = jnp.where(pos >= 0, lax.div(pos + block, jnp.int32(block)), 0)
    init = (jnp.zeros((heads_per_block, kv_lora_rank), jnp.float32),
            jnp.full((heads_per_block,), MASK_VALUE, jnp.float32),
            jnp.zeros((heads_per_block,), jnp.float32))
    acc, _, l_i = lax.fori_loop(0, n, chunk, init)
    out = acc / jnp.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ref[t, pl.ds(hb * heads_per_block, heads_per_block), :] = out.astype(o_ref.dtype)


def mla_sparse_attention_gpu(
    q: jax.Array,
    kv_cache: jax.Array | Fp8Latent,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    topk_indices: jax.Array | None,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    interpret: bool = False,
    block_sizes: MlaBlockSizes | None = None,
) -> jax.Array:
    """Pallas GPU (Triton) MLA attention; contract of ``mla_sparse_attention_reference``.

    Args:
      q: ``[T, H, Dl + Dr]`` float32 or bfloat16; ``Dl`` and ``Dr`` powers of two >= 16.
      kv_cache: ``[layers, num_pages, page_size, Dl + Dr]`` float32 or bfloat16, or an
        ``Fp8Latent`` in the GPU record (its ``scale`` plane float32; not the TPU split).
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      topk_indices: ``[T, K]`` int32 positions (-1 = empty) or None (dense causal).
      sm_scale: softmax scale; kv_lora_rank: value width ``Dl``.
      interpret: False on GPU; True runs the kernel on CPU through the Pallas interpreter.
      block_sizes: override of ``tuning.get_block_sizes``.

    Returns:
      ``[T, H, Dl]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: inputs outside the contract, or widths Triton cannot tile.
    """
    check_kernel_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        topk_indices, kv_lora_rank)
    del distribution
    fp8 = isinstance(kv_cache, Fp8Latent)
    if fp8 and kv_cache.scale is None:
        raise ValueError("kv_cache: the GPU kernel reads the 656-byte record (a float32 "
                         "scale plane), not the TPU split")
    planes = tuple(kv_cache) if fp8 else (kv_cache,)
    num_tokens, num_heads, dim = q.shape
    _, num_pages, page_size, _ = planes[0].shape
    rope_dim = dim - kv_lora_rank
    for name, v in (("kv_lora_rank", kv_lora_rank), ("rope dim", rope_dim)):
        if not is_pow2(v) or v < 16:
            raise ValueError(f"{name} must be a power of two >= 16 for the GPU kernel, got {v}")
    pages_per_seq = page_indices.shape[1]
    sparse = topk_indices is not None
    span = topk_indices.shape[1] if sparse else pages_per_seq * page_size
    bs = block_sizes or get_block_sizes("gpu", num_heads=num_heads, dim=dim,
                                        page_size=page_size, span=span)
    block, bh = bs.block_tokens, bs.heads_per_block
    if not (is_pow2(block) and block >= 16 and is_pow2(bh) and bh >= 16):
        raise ValueError(f"GPU block sizes must be powers of two >= 16, got block_tokens="
                         f"{block}, heads_per_block={bh}")
    if sparse:
        topk, num_chunks = pad_topk(topk_indices, block)
    else:
        topk, num_chunks = jnp.zeros((1, 1), jnp.int32), -(-span // block)
    req, pos, kv_len, flat_pages, meta = kernel_metadata(
        kv_lens, cu_q_lens, page_indices, layer, num_tokens, num_pages)
    num_entries = topk_scan_lengths(topk_indices, pos, kv_len)
    num_head_blocks = -(-num_heads // bh)
    kernel = functools.partial(
        _kernel, sparse=sparse, num_chunks=num_chunks, block=block, heads_per_block=bh,
        page_size=page_size, pages_per_seq=pages_per_seq, sm_scale=float(sm_scale),
        kv_lora_rank=kv_lora_rank, fp8=fp8)
    out = triton_call(
        kernel, grid=(num_tokens, num_head_blocks), num_inputs=8 + len(planes),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_head_blocks * bh, kv_lora_rank), q.dtype),
        block_sizes=bs, interpret=interpret,
        name="mla_sparse_attention_gpu" if sparse else "mla_dense_attention_gpu",
    )(meta, req, pos, num_entries, kv_lens, flat_pages, topk, q, *planes)
    return out[:, :num_heads]
