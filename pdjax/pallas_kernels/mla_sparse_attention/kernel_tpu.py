"""MLA attention (dense or top-k sparse) over the paged latent cache as Pallas TPU kernels.

One program per query token, all heads at once (``[H, Dl + Dr]`` rows: H is 16..128 for the
DeepSeek family, enough rows for the MXU), an online softmax over blocks of ``block_tokens``
cached rows.

    dense:  chunk c = positions [c*B, (c+1)*B): whole pages DMA'd from the pool in HBM
            (``pl.ANY``) into a double-buffered VMEM buffer,
            page_indices[r, c*B/ps + k] --page DMA--> buf[slot, k*ps:(k+1)*ps]
    sparse: rows gathered by XLA, per group of tokens, into a contiguous array,
            rows[t, j] = pool[layer, page_indices[r, i // ps], i % ps],  i = topk[t, j]
            (unselectable entries zero), streamed in [B, D] blocks by the Pallas pipeline;
            blocks past the token's last selectable entry are neither fetched nor computed.

Why the sparse path does not DMA rows itself: Mosaic slices a tiled dimension (a page's token
axis: tiles of 8 rows, 16 for bf16) only at tile boundaries, so a one-row DMA out of a page (or
into row j of a VMEM buffer) does not compile for any TPU ("Offsets along tiled dimensions
must be aligned to tiles"); XLA's gather addresses single rows. Per-token metadata (request,
position) and the page table come by scalar prefetch (dense).

FP8 KV (``fp8_record.Fp8Latent`` in its TPU split: the latent plane ``[.., C']`` e4m3 and the
rope plane ``[.., W]`` bf16 ``[k_pe | scales | 0]``): both planes are DMA'd (dense) or gathered
(sparse) as they are, and dequantized in VMEM:

    scale_full [B, C'] = tail [B, W] @ E [W, C']     E[R + g, c] = 1 where c // 128 == g < G
    row        [B, C' + W] = [ latent * scale_full | tail ]

(the MXU broadcasts each token's scales over their 128 lanes; one nonzero term per output, and
the scales are powers of two, so it is exact). The query is laid out ``[q_l: C' | q_r: W]``
with zeros in the scale and pad lanes, so the tail's scales add nothing to the scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import (
    SCALE_GROUP, Fp8Latent, num_scale_groups)
from pdjax.pallas_kernels.mla_sparse_attention.reference import (
    MASK_VALUE, check_kernel_inputs, kernel_metadata, pad_topk, token_scalars, topk_scan_lengths)
from pdjax.pallas_kernels.mla_sparse_attention.tuning import MlaBlockSizes, get_block_sizes

_LANES = 128
# Gathered top-k rows alive at once (sparse path): DeepSeek-V3.2 groups 64 tokens of 2.25 MiB.
GATHER_BUDGET_BYTES = 256 << 20


def _dense_kernel(
    # Scalar prefetch (SMEM).
    layer_ref,         # [1] int32
    tok_req_ref,       # [T] int32 request of each token (0 for padding)
    tok_pos_ref,       # [T] int32 position of each token (-1 for padding)
    kv_lens_ref,       # [R] int32
    page_indices_ref,  # [R * P] int32, clipped to [0, num_pages)
    q_ref,             # [H, D] VMEM block
    kv_hbm,            # [L, N, page_size, D] HBM (pl.ANY); FP8: the latent plane [.., C']
    *refs,             # FP8: rope_hbm [L, N, ps, W]; o_ref [H, Dl]; buf [2, B, D] (FP8:
                       # [2, B, C'] and rbuf [2, B, W]); sems [2] (FP8: [2, 2]); m_ref,
                       # l_ref [H, 128] f32; acc_ref [H, Dl] f32
    fp8: tuple | None,  # FP8: (kv_lora_rank C, rope_dim R)
    page_size: int,
    pages_per_seq: int,
    sm_scale: float,
    kv_lora_rank: int,
):
    if fp8:
        rope_hbm, o_ref, buf, rbuf, sems, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, buf, sems, m_ref, l_ref, acc_ref = refs
    t = pl.program_id(0)
    block = buf.shape[1]
    layer, req, pos, kv_len = token_scalars(t, layer_ref, tok_req_ref, tok_pos_ref, kv_lens_ref)
    row_base = req * pages_per_seq
    pages_per_block = block // page_size
    used_pages = lax.div(kv_len + page_size - 1, page_size)
    num_chunks = jnp.where(pos >= 0, lax.div(pos + block, block), 0)

    def page_copy(c, slot, k):
        p = c * pages_per_block + k
        page = page_indices_ref[row_base + jnp.minimum(p, pages_per_seq - 1)]
        needed = (p * page_size <= pos) & (p < used_pages)
        dst = pl.ds(pl.multiple_of(k * page_size, page_size), page_size)
        if not fp8:
            return needed, (pltpu.make_async_copy(kv_hbm.at[layer, page], buf.at[slot, dst],
                                                  sems.at[slot]),)
        return needed, (
            pltpu.make_async_copy(kv_hbm.at[layer, page], buf.at[slot, dst], sems.at[0, slot]),
            pltpu.make_async_copy(rope_hbm.at[layer, page], rbuf.at[slot, dst],
                                  sems.at[1, slot]))

    def for_each_page(c, slot, action):
        def body(k, carry):
            needed, copies = page_copy(c, slot, k)

            @pl.when(needed)
            def _():
                for copy in copies:
                    action(copy)
            return carry
        lax.fori_loop(0, pages_per_block, body, 0)

    def compute(c, slot):
        base = c * block
        row = base + lax.broadcasted_iota(jnp.int32, (1, block), 1)
        col = base + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        # Slots past the token's position were not fetched (stale or NaN): zero their values.
        kv = buf[slot]
        if fp8:
            kv = _dequantize(kv, rbuf[slot], *fp8, compute_dtype=q_ref.dtype)
        _online_softmax_step(q_ref[...], kv, (row <= pos) & (row < kv_len),
                             (col <= pos) & (col < kv_len), m_ref, l_ref, acc_ref,
                             sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)

    _init_state(m_ref, l_ref, acc_ref)

    @pl.when(num_chunks > 0)
    def _walk():
        for_each_page(0, 0, lambda cp: cp.start())

        def body(c, carry):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < num_chunks)
            def _():
                for_each_page(c + 1, 1 - slot, lambda cp: cp.start())

            for_each_page(c, slot, lambda cp: cp.wait())
            compute(c, slot)
            return carry

        lax.fori_loop(0, num_chunks, body, 0)

    _write_output(o_ref, l_ref, acc_ref)


def _sparse_kernel(
    num_chunks_ref,    # [G] int32 scalar prefetch: chunks up to the last selectable entry
    q_ref,             # [H, D] VMEM block of token t
    rows_ref,          # [B, D] VMEM block: chunk c of token t's gathered rows (0 if empty)
                       # (FP8: the latent plane's [B, C'])
    *refs,             # FP8: tail_ref [B, W]; mask_ref [1, B] int32 (1 where the entry is
                       # selectable); o_ref [H, Dl]; m_ref, l_ref [H, 128] f32; acc_ref [H, Dl]
    fp8: tuple | None,
    sm_scale: float,
    kv_lora_rank: int,
):
    if fp8:
        tail_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        mask_ref, o_ref, m_ref, l_ref, acc_ref = refs
    t, c = pl.program_id(0), pl.program_id(1)

    @pl.when(c == 0)
    def _():
        _init_state(m_ref, l_ref, acc_ref)

    @pl.when(c < num_chunks_ref[t])
    def _():
        rows = rows_ref[...]
        if fp8:
            rows = _dequantize(rows, tail_ref[...], *fp8, compute_dtype=q_ref.dtype)
        _online_softmax_step(q_ref[...], rows, mask_ref[...] != 0, None, m_ref, l_ref,
                             acc_ref, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        _write_output(o_ref, l_ref, acc_ref)


def _dequantize(latent, tail, kv_lora_rank: int, rope_dim: int, *, compute_dtype):
    """FP8 rows ``latent [B, C']`` e4m3 and ``tail [B, W]`` bf16 ``[k_pe | scales | 0]`` ->
    ``[B, C' + W]`` rows in ``compute_dtype``: the latent times its group's scale (broadcast
    over the group's lanes by a 0/1 matmul, exact for power-of-two scales), the tail as is."""
    width, lanes = tail.shape[1], latent.shape[1]
    src = lax.broadcasted_iota(jnp.int32, (width, lanes), 0)
    col = lax.broadcasted_iota(jnp.int32, (width, lanes), 1)
    groups = num_scale_groups(kv_lora_rank)
    expand = ((src - rope_dim == lax.shift_right_logical(col, SCALE_GROUP.bit_length() - 1))
              & (src >= rope_dim) & (src < rope_dim + groups)).astype(tail.dtype)
    scale = lax.dot_general(tail, expand, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)                  # [B, C']
    lat = (latent.astype(jnp.float32) * scale).astype(compute_dtype)
    return jnp.concatenate([lat, tail.astype(compute_dtype)], axis=1)


def fp8_query(q: jax.Array, kv_cache: Fp8Latent, kv_lora_rank: int) -> jax.Array:
    """``q [T, H, C + R]`` laid out as the dequantized TPU rows: ``[q_l: C' | q_r: W]``, zero
    in the pad lanes and the tail's scale lanes."""
    lanes, width = kv_cache.latent.shape[3], kv_cache.rope.shape[3]
    pad = lambda x, w: jnp.pad(x, ((0, 0), (0, 0), (0, w - x.shape[2])))   # noqa: E731
    return jnp.concatenate([pad(q[..., :kv_lora_rank], lanes),
                            pad(q[..., kv_lora_rank:], width)], axis=2)


def _init_state(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _online_softmax_step(q, kv, mask, col_mask, m_ref, l_ref, acc_ref, *, sm_scale: float,
                         kv_lora_rank: int):
    """One block of the online softmax: ``q [H, D]`` against ``kv [B, D]`` rows, ``mask
    [1, B]`` bool (selectable columns), ``col_mask [B, 1]`` (rows whose values may be read;
    None when every unselectable row is already zero)."""
    num_heads = q.shape[0]
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    if kv.dtype != compute_dtype:
        kv = kv.astype(jnp.float32).astype(compute_dtype)
    v = kv[:, :kv_lora_rank]
    if col_mask is not None:
        v = jnp.where(col_mask, v, jnp.zeros_like(v))
    s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale           # [H, B]
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


def _write_output(o_ref, l_ref, acc_ref):
    l = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def mla_sparse_attention_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    block_sizes: MlaBlockSizes | None = None,
    gather_budget_bytes: int = GATHER_BUDGET_BYTES,
) -> jax.Array:
    """Pallas TPU MLA attention; contract of ``mla_sparse_attention_reference``.

    Args:
      q: ``[T, H, Dl + Dr]`` float32 or bfloat16.
      kv_cache: ``[layers, num_pages, page_size, Dl + Dr]`` float32 or bfloat16 (stays in HBM),
        or an ``Fp8Latent`` in the TPU split (``q`` then ``[T, H, Dl + Dr]`` unpadded).
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      topk_indices: ``[T, K]`` int32 positions (-1 = empty) or None (dense causal).
      sm_scale: softmax scale; kv_lora_rank: value width ``Dl``.
      interpret: False on TPU; True or ``pltpu.InterpretParams`` to run on CPU.
      block_sizes: override of ``tuning.get_block_sizes``.
      gather_budget_bytes: sparse only: the most bytes of gathered rows alive at once; tokens
        go through in groups of a power of two that fit (at least one token).

    Returns:
      ``[T, H, Dl]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: inputs outside the contract, or an illegal block size.
    """
    check_kernel_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        topk_indices, kv_lora_rank)
    del distribution      # one program per token: padding rows have position -1
    fp8 = None
    if isinstance(kv_cache, Fp8Latent):
        if kv_cache.scale is not None:
            raise ValueError("kv_cache: the TPU kernel reads the FP8 record's TPU split (scales "
                             "in the rope plane), not a float32 scale plane")
        fp8 = (kv_lora_rank, q.shape[2] - kv_lora_rank)
        q = fp8_query(q, kv_cache, kv_lora_rank)
    num_tokens, num_heads, dim = q.shape
    lead = kv_cache.latent if fp8 else kv_cache
    _, num_pages, page_size, _ = lead.shape
    pages_per_seq = page_indices.shape[1]
    sparse = topk_indices is not None
    span = topk_indices.shape[1] if sparse else pages_per_seq * page_size
    bs = block_sizes or get_block_sizes("tpu", num_heads=num_heads, dim=dim,
                                        page_size=page_size, span=span)
    if bs.block_tokens % page_size:
        raise ValueError(f"block_tokens ({bs.block_tokens}) must be a multiple of page_size "
                         f"({page_size})")
    req, pos, kv_len, flat_pages, layer_arr = kernel_metadata(
        kv_lens, cu_q_lens, page_indices, layer, num_tokens, num_pages)
    if sparse:
        return _sparse_attention(q, kv_cache, layer_arr, req, pos, kv_len, flat_pages,
                                 topk_indices, pages_per_seq=pages_per_seq,
                                 block=bs.block_tokens, sm_scale=float(sm_scale),
                                 kv_lora_rank=kv_lora_rank, interpret=interpret,
                                 gather_budget_bytes=gather_budget_bytes, fp8=fp8)
    block = bs.block_tokens
    token_block = lambda t, *_: (t, 0, 0)   # noqa: E731
    planes = tuple(x for x in kv_cache if x is not None) if fp8 else (kv_cache,)
    if fp8:
        bufs = [pltpu.VMEM((2, block, p.shape[3]), p.dtype) for p in planes]
        sems = pltpu.SemaphoreType.DMA((2, 2))
    else:
        bufs, sems = [pltpu.VMEM((2, block, dim), kv_cache.dtype)], pltpu.SemaphoreType.DMA((2,))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_tokens,),
        in_specs=[pl.BlockSpec((None, num_heads, dim), token_block)]
        + [pl.BlockSpec(memory_space=pl.ANY)] * len(planes),
        out_specs=pl.BlockSpec((None, num_heads, kv_lora_rank), token_block),
        scratch_shapes=[
            *bufs,
            sems,
            pltpu.VMEM((num_heads, _LANES), jnp.float32),
            pltpu.VMEM((num_heads, _LANES), jnp.float32),
            pltpu.VMEM((num_heads, kv_lora_rank), jnp.float32),
        ],
    )
    kernel = functools.partial(_dense_kernel, page_size=page_size, pages_per_seq=pages_per_seq,
                               sm_scale=float(sm_scale), kv_lora_rank=kv_lora_rank, fp8=fp8)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads, kv_lora_rank), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="mla_dense_attention_tpu",
    )(layer_arr, req, pos, kv_lens, flat_pages, q, *planes)


def _sparse_attention(q, kv_cache, layer_arr, req, pos, kv_len, flat_pages, topk_indices, *,
                      pages_per_seq: int, block: int, sm_scale: float, kv_lora_rank: int,
                      interpret, gather_budget_bytes: int, fp8: tuple | None = None) -> jax.Array:
    """The top-k path: rows gathered by XLA in token groups, then ``_sparse_kernel``.

    Mosaic DMAs slice tiled dimensions only at tile boundaries (8 or 16 rows), and a top-k
    entry is one row of a page, so the kernel cannot fetch it from the paged pool itself.
    XLA's gather can: per group of tokens it gathers their selected rows into a contiguous
    ``[G, K, D]`` array (unselectable entries zeroed, so NaN in unused slots cannot leak), and
    the kernel streams it in ``[block, D]`` blocks through the usual pipeline, skipping the
    blocks past a token's last selectable entry. The groups bound that array to
    ``gather_budget_bytes`` (DeepSeek-V3.2: 2048 x 576 bf16 = 2.25 MiB per token).
    """
    num_tokens, num_heads, dim = q.shape
    planes = (kv_cache.latent, kv_cache.rope) if fp8 else (kv_cache,)
    page_size = planes[0].shape[2]
    span = topk_indices.shape[1]
    if span <= block:           # one chunk: the block is the whole (padded) list
        block = -(-span // 8) * 8
    topk, num_chunks = pad_topk(topk_indices, block)
    width = num_chunks * block
    row_bytes = width * sum(p.shape[3] * p.dtype.itemsize for p in planes)
    group = 1 << max(0, (max(1, gather_budget_bytes // row_bytes)).bit_length() - 1)
    group = min(group, 1 << max(0, (num_tokens - 1).bit_length()))
    num_groups = -(-num_tokens // group)
    pad = num_groups * group - num_tokens
    lengths = topk_scan_lengths(topk, pos, kv_len)

    def padded(x, value):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=value)

    token_block = lambda t, *_: (t, 0, 0)   # noqa: E731
    kernel = functools.partial(_sparse_kernel, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
                               fp8=fp8)
    chunk_index = lambda t, c, n: (t, jnp.minimum(c, jnp.maximum(n[t] - 1, 0)), 0)  # noqa: E731
    attend = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(group, num_chunks),
            in_specs=[
                pl.BlockSpec((None, num_heads, dim), token_block),
                # Past a token's last chunk the block index stays put: no further DMA.
                *[pl.BlockSpec((None, block, p.shape[3]), chunk_index) for p in planes],
                pl.BlockSpec((None, 1, block), lambda t, c, n: (
                    t, 0, jnp.minimum(c, jnp.maximum(n[t] - 1, 0)))),
            ],
            out_specs=pl.BlockSpec((None, num_heads, kv_lora_rank), token_block),
            scratch_shapes=[
                pltpu.VMEM((num_heads, _LANES), jnp.float32),
                pltpu.VMEM((num_heads, _LANES), jnp.float32),
                pltpu.VMEM((num_heads, kv_lora_rank), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((group, num_heads, kv_lora_rank), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="mla_sparse_attention_tpu",
    )

    def one_group(xs):
        q_g, topk_g, req_g, pos_g, kv_len_g, len_g = xs
        ok = (topk_g >= 0) & (topk_g <= pos_g[:, None]) & (topk_g < kv_len_g[:, None])
        safe = jnp.maximum(topk_g, 0)
        slot = req_g[:, None] * pages_per_seq + jnp.minimum(safe // page_size, pages_per_seq - 1)
        rows = [p[layer_arr[0], flat_pages[slot], safe % page_size]               # [G, K', D]
                for p in planes]
        rows = [jnp.where(ok[..., None], r, jnp.zeros((), r.dtype)) for r in rows]
        chunks = lax.div(len_g + block - 1, block)
        return attend(chunks, q_g, *rows, ok.astype(jnp.int32)[:, None, :])

    xs = (padded(q, 0), padded(topk, -1), padded(req, 0), padded(pos, -1), padded(kv_len, 0),
          padded(lengths, 0))
    if num_groups == 1:
        return one_group(xs)[:num_tokens]
    grouped = jax.tree.map(lambda x: x.reshape(num_groups, group, *x.shape[1:]), xs)
    out = lax.map(one_group, grouped)
    return out.reshape(num_groups * group, num_heads, kv_lora_rank)[:num_tokens]
