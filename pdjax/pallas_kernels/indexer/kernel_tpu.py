"""Lightning-indexer scoring over the paged key cache as a Pallas TPU kernel.

Grid ``(T, S / B)``: program ``(t, kb)`` scores query token ``t`` against positions
``[kb*B, (kb+1)*B)`` of its request. The key pool stays in HBM (``pl.ANY``); the program DMAs
the pages it needs (those starting at or before the token's position) into VMEM:

    page_indices[r, kb*B/ps + k]  --DMA-->  buf[k*ps:(k+1)*ps, :]       buf [B, Di]
    s [Hi, B] = relu(sm_scale * q [Hi, Di] @ buf^T)
    out[t, kb*B:(kb+1)*B] = weights [1, Hi] @ s           (-inf past the position)

Blocks entirely past the token's position fetch nothing and write ``-inf``. Per-token request
and position and the page table arrive by scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.pallas_kernels.indexer.reference import NEG_INF, Fp8Keys, check_kernel_inputs
from pdjax.pallas_kernels.indexer.tuning import IndexerBlockSizes, get_block_sizes
from pdjax.pallas_kernels.mla_sparse_attention.reference import kernel_metadata, token_scalars


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,         # [1] int32
    tok_req_ref,       # [T] int32 (0 for padding)
    tok_pos_ref,       # [T] int32 (-1 for padding)
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    # Inputs.
    q_ref,             # [Hi, Di] VMEM block of token t
    w_ref,             # [1, Hi] VMEM block of token t
    k_hbm,             # [L, N, page_size, Di] HBM (pl.ANY)
    # Output.
    o_ref,             # [1, B] VMEM block
    # Scratch.
    buf,               # [B, Di] key dtype
    sem,               # DMA semaphore
    *,
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
):
    t, kb = pl.program_id(0), pl.program_id(1)
    block = buf.shape[0]
    pages_per_block = block // page_size
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    layer, req, pos, kv_len = token_scalars(t, layer_ref, tok_req_ref, tok_pos_ref, kv_lens_ref)
    base = kb * block

    def for_each_page(action):
        def body(k, carry):
            p = kb * pages_per_block + k
            page = page_indices_ref[req * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            dst = pl.ds(pl.multiple_of(k * page_size, page_size), page_size)
            copy = pltpu.make_async_copy(k_hbm.at[layer, page], buf.at[dst], sem)

            @pl.when((p * page_size <= pos) & (p < pages_per_seq))
            def _():
                action(copy)
            return carry
        lax.fori_loop(0, pages_per_block, body, 0)

    @pl.when(base <= pos)
    def _score():
        for_each_page(lambda c: c.start())
        for_each_page(lambda c: c.wait())
        k = buf[...]
        if k.dtype != compute_dtype:
            k = k.astype(jnp.float32).astype(compute_dtype)
        s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)                 # [Hi, B]
        s = jnp.maximum(s * sm_scale, 0.0)
        w = w_ref[...].astype(jnp.float32)                                      # [1, Hi]
        score = lax.dot_general(w, s, (((1,), (0,)), ((), ())),
                                precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)              # [1, B]
        i = base + lax.broadcasted_iota(jnp.int32, (1, block), 1)
        # Unfetched rows may hold NaN; where() replaces whole columns.
        o_ref[...] = jnp.where((i <= pos) & (i < kv_len), score, NEG_INF)

    @pl.when(base > pos)
    def _skip():
        o_ref[...] = jnp.full(o_ref.shape, NEG_INF, jnp.float32)


def indexer_scores_tpu(
    q: jax.Array,
    weights: jax.Array,
    k_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    interpret: bool | pltpu.InterpretParams = False,
    block_sizes: IndexerBlockSizes | None = None,
) -> jax.Array:
    """Pallas TPU indexer scoring; contract of ``indexer_scores_reference``.

    Args:
      q: ``[T, Hi, Di]`` float32 or bfloat16; weights: ``[T, Hi]``.
      k_cache: ``[layers, num_pages, page_size, Di]`` float32 or bfloat16 (stays in HBM).
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      sm_scale: scale inside the relu.
      interpret: False on TPU; True or ``pltpu.InterpretParams`` to run on CPU.
      block_sizes: override of ``tuning.get_block_sizes``.

    Returns:
      ``[T, P * page_size]`` float32, ``-inf`` where not selectable.

    Raises:
      ValueError: inputs outside the contract, an illegal block size, or ``Fp8Keys`` (on TPU
        the engine keeps the indexer keys bf16: a float32 scale per token would take a
        128-lane row of its own, more than the FP8 saves).
    """
    if isinstance(k_cache, Fp8Keys):
        raise ValueError("k_cache: the TPU indexer kernel reads bfloat16/float32 keys, not "
                         "FP8 keys (the engine keeps them bf16 on TPU)")
    check_kernel_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens, distribution)
    del distribution
    num_tokens, num_heads, head_dim = q.shape
    _, num_pages, page_size, _ = k_cache.shape
    pages_per_seq = page_indices.shape[1]
    span = pages_per_seq * page_size
    bs = block_sizes or get_block_sizes("tpu", num_heads=num_heads, head_dim=head_dim,
                                        page_size=page_size, span=span)
    block = bs.block_tokens
    num_blocks = -(-span // block)
    if block % page_size:
        raise ValueError(f"block_tokens ({block}) must be a multiple of page_size ({page_size})")
    req, pos, _, flat_pages, layer_arr = kernel_metadata(
        kv_lens, cu_q_lens, page_indices, layer, num_tokens, num_pages)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_tokens, num_blocks),
        in_specs=[pl.BlockSpec((None, num_heads, head_dim), lambda t, kb, *_: (t, 0, 0)),
                  pl.BlockSpec((None, 1, num_heads), lambda t, kb, *_: (t, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        # One [1, B] row per (token, block): full-dimension blocks for any B.
        out_specs=pl.BlockSpec((None, 1, block),
                               lambda t, kb, *_: (t * num_blocks + kb, 0, 0)),
        scratch_shapes=[pltpu.VMEM((block, head_dim), k_cache.dtype),
                        pltpu.SemaphoreType.DMA(())],
    )
    kernel = functools.partial(_kernel, page_size=page_size, pages_per_seq=pages_per_seq,
                               sm_scale=float(sm_scale))
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens * num_blocks, 1, block), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="indexer_scores_tpu",
    )(layer_arr, req, pos, kv_lens, flat_pages, q,
      weights.reshape(num_tokens, 1, num_heads), k_cache)
    return out.reshape(num_tokens, num_blocks * block)[:, :span]
