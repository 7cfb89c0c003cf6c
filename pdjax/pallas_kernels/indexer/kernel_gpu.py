"""Lightning-indexer scoring over the paged key cache as a Pallas GPU kernel (Triton).

Triton is chosen explicitly through ``pltriton.CompilerParams``. Program ``(t, kb)`` scores
token ``t`` against positions ``[kb*B, (kb+1)*B)``: it gathers the key rows through the page
table with masked pointer loads (rows past the token's position are not read),

    k_j = pool[layer, page_indices[r, i_j // page_size], i_j % page_size, :]   i_j = kb*B + j
    s [HB, B] = relu(sm_scale * q [HB, Di] @ k^T)          (HB: heads padded to a power of 2)
    out[t, kb*B + j] = sum_h weights[t, h] * s[h, j]          (padding heads weigh 0)

and stores ``-inf`` where the position is not selectable.

FP8 keys (``Fp8Keys``): the key rows are loaded as float8_e4m3fn and multiplied by their
float32 scale (a ``[B, Di]`` gather of the ``[B, G]`` scales, one per 128 columns) before the
dot: 132 bytes read a token instead of 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pdjax.pallas_kernels.indexer.reference import NEG_INF, Fp8Keys, check_kernel_inputs
from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import SCALE_GROUP
from pdjax.pallas_kernels.indexer.tuning import IndexerBlockSizes, get_block_sizes
from pdjax.pallas_kernels.mla_sparse_attention.reference import kernel_metadata, token_scalars
from pdjax.pallas_kernels.triton_call import is_pow2, triton_call


def _kernel(
    meta_ref,          # [1] int32: layer
    tok_req_ref,       # [T] int32 (0 for padding)
    tok_pos_ref,       # [T] int32 (-1 for padding)
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    q_ref,             # [T, Hi, Di]
    w_ref,             # [T, Hi] float32
    k_ref,             # [L, N, page_size, Di] (FP8: float8_e4m3fn)
    *refs,             # FP8: scale_ref [L, N, page_size, G] float32; o_ref [T, NKB * B] f32
    fp8: bool,
    block: int,
    heads_pad: int,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
):
    if fp8:
        scale_ref, o_ref = refs
    else:
        (o_ref,) = refs
    t, kb = pl.program_id(0), pl.program_id(1)
    _, num_heads, head_dim = q_ref.shape
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    layer, req, pos, kv_len = token_scalars(t, meta_ref, tok_req_ref, tok_pos_ref, kv_lens_ref)

    heads = lax.broadcasted_iota(jnp.int32, (heads_pad,), 0)
    heads_c = jnp.minimum(heads, num_heads - 1)
    cols = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    tok = jnp.full((heads_pad,), t, jnp.int32)
    q = q_ref[tok[:, None], heads_c[:, None], cols[None, :]]                    # [HB, Di]
    w = w_ref[tok, heads_c].astype(jnp.float32)
    w = jnp.where(heads < num_heads, w, 0.0)                                     # [HB]

    i = kb * block + lax.broadcasted_iota(jnp.int32, (block,), 0)                # [B]
    ok = (i <= pos) & (i < kv_len)
    slot = jnp.minimum(lax.div(i, jnp.int32(page_size)), pages_per_seq - 1)
    pages = page_indices_ref[req * pages_per_seq + slot]
    offs = lax.rem(i, jnp.int32(page_size))
    mask = jnp.broadcast_to(ok[:, None], (block, head_dim))
    k = pltriton.load(k_ref.at[layer, pages[:, None], offs[:, None], cols[None, :]],
                      mask=mask)
    if fp8:
        group = lax.div(cols, jnp.int32(SCALE_GROUP))
        scale = pltriton.load(scale_ref.at[layer, pages[:, None], offs[:, None], group[None, :]],
                              mask=mask)                                         # [B, Di]
        k = k.astype(jnp.float32) * scale
    k = k.astype(compute_dtype)
    k = jnp.where(mask, k, jnp.zeros_like(k))                                    # [B, Di]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)                      # [HB, B]
    s = jnp.maximum(s * sm_scale, 0.0)
    score = jnp.sum(w[:, None] * s, axis=0)                                      # [B]
    o_ref[t, pl.ds(kb * block, block)] = jnp.where(ok, score, NEG_INF)


def indexer_scores_gpu(
    q: jax.Array,
    weights: jax.Array,
    k_cache: jax.Array | Fp8Keys,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    block_sizes: IndexerBlockSizes | None = None,
) -> jax.Array:
    """Pallas GPU (Triton) indexer scoring; contract of ``indexer_scores_reference``.

    Args:
      q: ``[T, Hi, Di]`` float32 or bfloat16 (``Di`` a power of two >= 16); weights ``[T, Hi]``.
      k_cache: ``[layers, num_pages, page_size, Di]``, or ``Fp8Keys``.
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      sm_scale: scale inside the relu.
      interpret: False on GPU; True runs the kernel on CPU through the Pallas interpreter.
      block_sizes: override of ``tuning.get_block_sizes``.

    Returns:
      ``[T, P * page_size]`` float32, ``-inf`` where not selectable.

    Raises:
      ValueError: inputs outside the contract or sizes Triton cannot tile.
    """
    check_kernel_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens, distribution)
    del distribution
    num_tokens, num_heads, head_dim = q.shape
    if not is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"index_head_dim must be a power of two >= 16 for the GPU kernel, got "
                         f"{head_dim}")
    planes = tuple(k_cache) if isinstance(k_cache, Fp8Keys) else (k_cache,)
    _, num_pages, page_size, _ = planes[0].shape
    pages_per_seq = page_indices.shape[1]
    span = pages_per_seq * page_size
    bs = block_sizes or get_block_sizes("gpu", num_heads=num_heads, head_dim=head_dim,
                                        page_size=page_size, span=span)
    block, heads_pad = bs.block_tokens, bs.heads_per_block
    if not (is_pow2(block) and block >= 16 and is_pow2(heads_pad)
            and heads_pad >= max(16, num_heads)):
        raise ValueError(f"GPU block sizes must be powers of two >= 16 with heads_per_block >= "
                         f"{num_heads}, got block_tokens={block}, heads_per_block={heads_pad}")
    num_blocks = -(-span // block)
    req, pos, _, flat_pages, meta = kernel_metadata(
        kv_lens, cu_q_lens, page_indices, layer, num_tokens, num_pages)
    kernel = functools.partial(_kernel, block=block, heads_pad=heads_pad, page_size=page_size,
                               pages_per_seq=pages_per_seq, sm_scale=float(sm_scale),
                               fp8=len(planes) == 2)
    out = triton_call(
        kernel, grid=(num_tokens, num_blocks), num_inputs=7 + len(planes),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_blocks * block), jnp.float32),
        block_sizes=bs, interpret=interpret, name="indexer_scores_gpu",
    )(meta, req, pos, kv_lens, flat_pages, q, weights.astype(jnp.float32), *planes)
    return out[:, :span]
