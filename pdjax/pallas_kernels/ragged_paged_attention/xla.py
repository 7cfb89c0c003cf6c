"""Ragged paged attention in plain jnp/XLA over per-request blocks: the CPU path and the
fallback on every backend (``impl="xla"``).

Same contract as ``reference.py`` (DESIGN.md §2), different cost. The reference gathers a
request's pages once per query token, so a prefill chunk of ``q`` tokens at context ``S`` costs
``q`` gathers of ``S`` keys and ``q`` tiny ``[G, D] x [D, S]`` matmuls. Here the rows split by
``distribution = (i, j, k)``:

    requests   [0 ...... i)               [i ........................ k)        [k .. R)
    path        decode (q_len 1)           prefill chunks and other rows          padding
    how         `decode_attention` on the  query tiles of `q_block` tokens of     nothing
                first min(T, R) tokens     one request, each against its pages

    flat tokens | d0 d1 d2 | c0 ....................... c255 | e0 ... e40 | pad ...
    tiles                  |  tile 0       |  tile 1         | tile 0     |

Each request takes long tiles (128 rows over 512-token KV blocks) when its chunk and context
are both long, short ones (32 rows over 64-token blocks) otherwise (table below). Each tile
reads its request's pages in KV blocks of ``kv_pages_per_block`` pages (one gather per block,
shared by the tile's rows) and does one ``[q_block * G, D] x [D, kv_block]`` matmul
per KV head with an online softmax. All three loops (requests, tiles of a request, KV blocks
up to the tile's last position) are ``fori_loop``s with traced bounds, so the cost is about
``q_len x kv_len`` per request (half of it skipped by causality) and neither the token bucket
nor the pages-per-sequence bucket adds work. For a decode row one tile would waste
``q_block - 1`` rows, so decode rows take their own path (``decode_attention``): one gather per
row per KV block of ``DECODE_KV_BLOCK_TOKENS``. Up to ``DECODE_FOLD_MAX_KV_HEADS`` KV heads the
block is read in the cache's token-major layout with the KV heads folded into the key axis, so
that both products are one batched dot per block (``[QH, D] x [D, S * KVH]`` per row) with no
transpose; the query heads' scores against other KV heads' keys are masked out (``KVH`` times
the products' flops, small next to the gather's memory traffic for few KV heads). Beyond it
the block is transposed head-major once and both products are batched over (row, KV head)
(``[G, D] x [D, S]``): exact flops for one copy of the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.ragged_paged_attention import kernel_cpu
from pdjax.pallas_kernels.ragged_paged_attention.fp8_kv import check_scale_caches, load_kv
from pdjax.pallas_kernels.ragged_paged_attention.reference import (
    _MASK_VALUE, split_kv_heads, validate_inputs)

# Two tilings, chosen per request (measured on XLA CPU, one SmolLM2 layer, 9 query / 3 KV
# heads of 64; ms): long tiles win only for a long chunk over a long context, short ones
# everywhere else, by far when a step holds many short rows (in-batch prefix sharing).
#                         256 @ ctx 2000   64 x4 @ ctx 1000   32 x8 @ ctx 64   256 fresh
#   long  (128, 512)           24.8             24.6              25.0           4.8
#   short (32, 64)             36.8             10.7               1.2           1.8
DEFAULT_Q_BLOCK = 128        # query rows per long tile (a 256-token chunk is two tiles)
DEFAULT_KV_BLOCK_TOKENS = 512
LONG_TILE_MIN_KV = 1024      # long tiles for q_len >= DEFAULT_Q_BLOCK at kv_len >= this
SHORT_Q_BLOCK = 32
SHORT_KV_BLOCK_TOKENS = 64
SMALL_BUCKET_TOKENS = 16     # token buckets up to this use short tiles of half the bucket
# Decode rows: KV blocks of 64 tokens (attention alone, 16 rows at a 300-token context, 30
# layers: 39-41 ms, against 44-45 ms for 32 or 128 tokens, 62 ms for 256 and 50-52 ms through
# the reference: the gather of a block is the cost, and a smaller block overshoots kv_len less).
DECODE_KV_BLOCK_TOKENS = 64
# Above it the folded products' waste (x KVH) outgrows the transpose it saves: Llama-3-8B's
# heads (32 query, 8 KV, 128 wide), 8 rows at a 300-token context, one layer: 3.6 ms head-major
# against 8.0 ms through the per-token reference; SmolLM2's (9, 3, 64), 16 rows: folded
# 1.2-1.5 ms, head-major 1.2-1.3 ms (within the noise).
DECODE_FOLD_MAX_KV_HEADS = 4
# Under native_decode, streams of at most this many tokens go through the native kernel whole,
# every token a decode row of its own over its request's pages (``token_rows``). Each token
# then reads its context once (from cache, for the tokens after the first), so the cost is
# linear in the tokens: 8 decode rows and 8 prompt tokens at a 2,000-token context, one
# SmolLM2 layer, 0.70 ms against 1.44 through the tiles; with 1 prompt token 0.24 against 1.16;
# 8 + 16 in the 32-token bucket 1.48 against 3.00.
NATIVE_TOKEN_ROWS_MAX = 32


def decode_attention(q, k_cache, v_cache, layer, kv_lens, page_indices, num_rows, *, sm_scale,
                     sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
                     k_scales=None, v_scales=None, pages_per_block=None):
    """Attention of decode rows: token ``r`` is the only query of request ``r``; KV heads
    folded into the key axis up to ``DECODE_FOLD_MAX_KV_HEADS`` of them, head-major blocks
    beyond (module docstring).

    Args:
      q: ``[n, QH, D]`` the decode rows' queries (``n <= R``).
      k_cache, v_cache, layer, kv_lens ``[R]``, page_indices ``[R, P]``: as in the reference.
      num_rows: int32 scalar: rows ``[0, num_rows)`` are decode rows; the rest give 0.
      sm_scale, sliding_window, soft_cap, k_scale, v_scale, k_scales, v_scales: as in the
        reference (the query sits at position ``kv_lens[r] - 1``).
      pages_per_block: pages per KV block (static; default ``DECODE_KV_BLOCK_TOKENS``' worth).

    Returns:
      ``[n, QH, D]`` float32; rows past ``num_rows`` and rows with kv_len 0 are 0.

    The fold merges the KV-head axis into the key axis: under tensor parallelism (KV heads
    sharded by GSPMD) the reshape crosses the sharded axis and XLA resolves it with
    communication; results stay exact, the speed of that case was not measured.
    """
    n, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    max_pages = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    if pages_per_block is None:
        pages_per_block = max(1, DECODE_KV_BLOCK_TOKENS // page_size)
    pages_per_block = min(pages_per_block, max_pages)
    table, num_blocks = _pad_to_blocks(page_indices[:n], pages_per_block)
    block = pages_per_block * page_size
    kv_len = jnp.where(jnp.arange(n) < num_rows, kv_lens[:n], 0)              # [n]
    qf = q.astype(jnp.float32) * sm_scale                                      # [n, QH, D]
    fold = num_kv_heads <= DECODE_FOLD_MAX_KV_HEADS
    if fold:
        # Key axis j = token * KVH + kv head (the cache's own order); query head i = h * G + g.
        key_token = jnp.arange(block * num_kv_heads, dtype=jnp.int32) // num_kv_heads
        own_head = ((jnp.arange(num_q_heads) // group)[:, None]
                    == (jnp.arange(block * num_kv_heads) % num_kv_heads)[None, :])  # [QH, S*KVH]
        stats = (n, num_q_heads)
    else:
        qf = qf.reshape(n, num_kv_heads, group, head_dim)                      # [n, KVH, G, D]
        key_token = jnp.arange(block, dtype=jnp.int32)
        stats = (n, num_kv_heads, group)

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, b * pages_per_block, pages_per_block, 1)
        k = load_kv(k_cache, k_scales, k_scale, layer, pages)                  # [n, Pb, ps, KVH, D]
        v = load_kv(v_cache, v_scales, v_scale, layer, pages)
        pos = b * block + key_token                                            # [S*KVH] or [S]
        seen = pos[None, :] < kv_len[:, None]                                  # [n, S*KVH] or [n, S]
        if sliding_window is not None:
            seen &= pos[None, :] > kv_len[:, None] - 1 - sliding_window
        if fold:
            k = k.reshape(n, block * num_kv_heads, head_dim)
            v = v.reshape(n, block * num_kv_heads, head_dim)
            # Unseen slots may hold NaN: 0 * NaN must not reach acc.
            v = jnp.where(seen[..., None], v, 0.0)
            mask = seen[:, None, :] & own_head[None]                           # [n, QH, S*KVH]
            s = jnp.einsum("nqd,njd->nqj", qf, k)
            return _softmax_step(s, mask, m, l, acc,
                                 lambda p: jnp.einsum("nqj,njd->nqd", p, v), soft_cap)
        k = k.reshape(n, block, num_kv_heads, head_dim).transpose(0, 2, 1, 3)  # [n, KVH, S, D]
        v = v.reshape(n, block, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = jnp.where(seen[:, None, :, None], v, 0.0)
        s = jnp.einsum("nhgd,nhsd->nhgs", qf, k)                               # [n, KVH, G, S]
        return _softmax_step(s, seen[:, None, None, :], m, l, acc,
                             lambda p: jnp.einsum("nhgs,nhsd->nhgd", p, v), soft_cap)

    init = (jnp.full(stats, _MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, head_dim), jnp.float32))
    longest = jnp.max(kv_len)
    lo = 0 if sliding_window is None else jnp.maximum(
        jnp.min(jnp.where(kv_len > 0, kv_len, longest)) - sliding_window, 0) // block
    hi = jnp.minimum((longest + block - 1) // block, num_blocks)
    _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(n, num_q_heads, head_dim)


def ragged_paged_attention_xla(
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
    q_block: int | None = None,
    kv_pages_per_block: int | None = None,
    decode_pages_per_block: int | None = None,
    decode_only: bool = False,
    native_decode: bool = False,
) -> jax.Array:
    """Attention of every query row over its request's paged KV, per-request blocks.

    Args:
      q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens: as in
        ``ragged_paged_attention_reference`` (shapes ``[T, QH, D]``, ``[layers, num_pages,
        page_size, KVH * D]`` (or ``[.., KVH, D]``) twice, int32 scalar, ``[R]``, ``[R, P]``,
        ``[R+1]``).
      distribution: ``[3]`` int32 ``(decode_end, prefill_end, num_seqs)``: rows
        ``[0:decode_end)`` must have q_len 1; rows ``[decode_end:num_seqs)`` may have any q_len;
        rows from ``num_seqs`` on are padding and give 0.
      sm_scale, sliding_window, soft_cap, k_scale, v_scale, k_scales, v_scales: as in the
        reference (``k_scales``/``v_scales``: per-token scales of an FP8 cache, ``fp8_kv``).
      q_block, kv_pages_per_block: query rows per tile and pages per KV block (static). When
        either is given, every request takes those tiles (the other defaulting to 128 rows /
        512 tokens' worth, at most P). By default each request picks (``lax.cond``) long tiles
        (128 rows, 512 tokens) when its q_len is >= 128 and its kv_len >= 1024, short ones
        (32 rows, or ``T // 2`` for ``T <= 16``; 64 tokens) otherwise.
      decode_pages_per_block: pages per KV block of the decode rows (static; default
        ``DECODE_KV_BLOCK_TOKENS``' worth, at most P).
      decode_only: static promise that every row has q_len 1: only the decode part is built
        (half the compile time of both parts).
      native_decode: static: the decode rows go through the native CPU kernel
        (``kernel_cpu.decode_attention_cpu``, the ``"cpu"`` implementation) when it takes this
        cache; the other rows keep the jnp tiles, except in a stream of at most
        ``NATIVE_TOKEN_ROWS_MAX`` tokens, where every token is a kernel row (``token_rows``).

    Returns:
      ``[T, QH, D]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: inputs outside the contract (named field), or a non-positive block size.
    """
    validate_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution)
    k_cache, v_cache = split_kv_heads(k_cache, q.shape[2]), split_kv_heads(v_cache, q.shape[2])
    check_scale_caches(k_cache, k_scales, v_scales)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                k_scale=k_scale, v_scale=v_scale, k_scales=k_scales, v_scales=v_scales)
    num_seqs_pad = page_indices.shape[0]
    num_decode = min(q.shape[0], num_seqs_pad)

    def decode_rows(num_rows):
        """``[num_decode, QH, D]`` float32 of the first ``num_rows`` tokens (decode rows)."""
        if native_decode and kernel_cpu.supports(q, k_cache, k_scale, v_scale, k_scales):
            return kernel_cpu.decode_attention_cpu(q[:num_decode], k_cache, v_cache, layer,
                                                   kv_lens, page_indices, num_rows, **opts)
        return decode_attention(q[:num_decode], k_cache, v_cache, layer, kv_lens, page_indices,
                                num_rows, pages_per_block=decode_pages_per_block, **opts)

    if (native_decode and q.shape[0] <= NATIVE_TOKEN_ROWS_MAX and not decode_only
            and kernel_cpu.supports(q, k_cache, k_scale, v_scale, k_scales)):
        tok_kv_lens, tok_pages = token_rows(kv_lens, page_indices, cu_q_lens, distribution,
                                            q.shape[0])
        return kernel_cpu.decode_attention_cpu(q, k_cache, v_cache, layer, tok_kv_lens,
                                               tok_pages, q.shape[0], **opts).astype(q.dtype)
    if decode_only:
        # Every row has q_len 1: token r is request r's, up to the stream's end.
        out = decode_rows(cu_q_lens[-1])
        out = jnp.pad(out, ((0, q.shape[0] - num_decode), (0, 0), (0, 0)))
        return out.astype(q.dtype)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    max_pages = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    for name, v in (("q_block", q_block), ("kv_pages_per_block", kv_pages_per_block)):
        if v is not None and v < 1:
            raise ValueError(f"{name} ({v}) must be >= 1")
    decode_end = jnp.clip(distribution[0], 0, num_seqs_pad)
    num_seqs = jnp.clip(distribution[2], decode_end, num_seqs_pad)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    qf = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    tiled = dict(qf=qf, k_cache=k_cache, v_cache=v_cache, layer=layer, kv_lens=kv_lens,
                 page_indices=page_indices, cu_q_lens=cu_q_lens, q_lens=q_lens,
                 sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                 v_scale=v_scale, k_scales=k_scales, v_scales=v_scales)

    def kv_pages(tokens):
        return max(1, min(max_pages, tokens // page_size))

    if q_block is not None or kv_pages_per_block is not None:
        q_block = min(num_tokens, q_block or DEFAULT_Q_BLOCK)
        kv_pages_per_block = kv_pages_per_block or kv_pages(DEFAULT_KV_BLOCK_TOKENS)
        request_step = _tiles(q_block, kv_pages_per_block, **tiled)
    else:
        # In the smallest buckets a mixed step's decode rows lead the stream and leave a chunk
        # of at most about half of it: a full-width tile would spend half its rows on them.
        short_q = max(1, num_tokens // 2) if num_tokens <= SMALL_BUCKET_TOKENS \
            else min(num_tokens, SHORT_Q_BLOCK)
        short_step = _tiles(short_q, kv_pages(SHORT_KV_BLOCK_TOKENS), **tiled)
        if num_tokens < DEFAULT_Q_BLOCK:
            request_step = short_step
        else:
            long_step = _tiles(DEFAULT_Q_BLOCK, kv_pages(DEFAULT_KV_BLOCK_TOKENS), **tiled)

            def request_step(r, out):
                long = (q_lens[r] >= DEFAULT_Q_BLOCK) & (kv_lens[r] >= LONG_TILE_MIN_KV)
                return jax.lax.cond(long, long_step, short_step, r, out)

    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = jax.lax.fori_loop(decode_end, num_seqs, request_step, out)

    # Decode rows: requests [0, decode_end) own tokens [0, decode_end) (q_len 1 each).
    out_decode = decode_rows(cu_q_lens[decode_end])
    own = (jnp.arange(num_decode) < cu_q_lens[decode_end])[:, None, None]
    out = out.at[:num_decode].set(jnp.where(own, out_decode, out[:num_decode]))
    return out.astype(q.dtype)


def token_rows(kv_lens, page_indices, cu_q_lens, distribution, num_tokens: int):
    """Every token of the flat stream as a decode row of its own: ``(kv_lens [T], pages
    [T, P])`` int32, token ``t`` of row ``r`` at position ``p = kv_lens[r] - q_len[r] + i`` (the
    reference's causal rule) getting kv_len ``p + 1`` and row ``r``'s page table. Tokens past
    the last row of ``distribution`` (padding) get kv_len 0, which the kernel answers with 0."""
    num_seqs = jnp.clip(distribution[2], 0, page_indices.shape[0])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all") - 1, 0,
                   page_indices.shape[0] - 1).astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    position = kv_lens[row] - q_lens[row] + (t - cu_q_lens[row])
    valid = (t < cu_q_lens[num_seqs]) & (row < num_seqs)
    return jnp.where(valid, position + 1, 0).astype(jnp.int32), page_indices[row]


def _tiles(q_block, kv_pages_per_block, *, qf, k_cache, v_cache, layer, kv_lens, page_indices,
           cu_q_lens, q_lens, sliding_window, soft_cap, k_scale, v_scale, k_scales, v_scales):
    """``request_step(r, out)``: request ``r``'s rows in query tiles of ``q_block`` tokens,
    each over KV blocks of ``kv_pages_per_block`` pages (online softmax), written into
    ``out [T, QH, D]`` float32. ``qf`` is the scaled query ``[T, KVH, G, D]`` float32."""
    num_tokens, num_kv_heads, group, head_dim = qf.shape
    page_size = k_cache.shape[2]
    page_indices, num_kv_blocks = _pad_to_blocks(page_indices, kv_pages_per_block)
    kv_block = kv_pages_per_block * page_size
    rows = group * q_block

    def kv_step(r, q_tile, pos, row_ok):
        """Online-softmax step over KV block ``b`` of request ``r`` for one tile."""
        def body(b, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(page_indices[r], b * kv_pages_per_block,
                                                 kv_pages_per_block)
            k = load_kv(k_cache, k_scales, k_scale, layer, pages).reshape(
                kv_block, num_kv_heads, head_dim)
            v = load_kv(v_cache, v_scales, v_scale, layer, pages).reshape(
                kv_block, num_kv_heads, head_dim)
            kv_pos = b * kv_block + jnp.arange(kv_block, dtype=jnp.int32)        # [S]
            # Slots past kv_len (NaN allowed there) must not leak through 0 * NaN.
            v = jnp.where((kv_pos < kv_lens[r])[:, None, None], v, 0.0)
            mask = (kv_pos[None, :] <= pos[:, None]) & row_ok[:, None]            # [Bq, S]
            if sliding_window is not None:
                mask &= kv_pos[None, :] > pos[:, None] - sliding_window
            mask = jnp.tile(mask, (group, 1))                                    # [G*Bq, S]
            # K and V head-major once per block: both products are then plain batched
            # [G*Bq, D] x [D, S] dots per KV head (XLA CPU runs them 1.2-1.4x faster than
            # the same einsums on the token-major layout).
            k = k.transpose(1, 0, 2)                                             # [KVH, S, D]
            v = v.transpose(1, 0, 2)
            s = jnp.einsum("hmd,hsd->hms", q_tile, k)                            # [KVH, G*Bq, S]
            return _softmax_step(s, mask, m, l, acc,
                                 lambda p: jnp.einsum("hms,hsd->hmd", p, v), soft_cap)
        return body

    def tile_step(r, out, u):
        """Tile ``u`` of request ``r``: rows ``[t0, t0 + q_block)`` clipped to the request."""
        start, q_len, kv_len = cu_q_lens[r], q_lens[r], kv_lens[r]
        t0 = start + u * q_block
        t1 = jnp.minimum(t0 + q_block, start + q_len)
        # A tile near the end of the stream slides back to fit; rows before t0 are left alone.
        ws = jnp.clip(t0, 0, num_tokens - q_block)
        t = ws + jnp.arange(q_block, dtype=jnp.int32)
        row_ok = (t >= t0) & (t < t1)
        pos = kv_len - q_len + (t - start)                                         # [Bq]
        q_tile = jax.lax.dynamic_slice_in_dim(qf, ws, q_block)                   # [Bq, KVH, G, D]
        # GQA folded into the rows: row g * Bq + i is query head g of the group, token i.
        q_tile = q_tile.transpose(1, 2, 0, 3).reshape(num_kv_heads, rows, head_dim)
        first_pos = kv_len - q_len + (t0 - start)
        last_pos = kv_len - q_len + (t1 - 1 - start)
        lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        hi = jnp.clip(last_pos // kv_block + 1, 0, num_kv_blocks)
        init = (jnp.full((num_kv_heads, rows), _MASK_VALUE, jnp.float32),
                jnp.zeros((num_kv_heads, rows), jnp.float32),
                jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))
        _, l, acc = jax.lax.fori_loop(lo // kv_block, hi, kv_step(r, q_tile, pos, row_ok), init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]                             # [KVH, G*Bq, D]
        o = o.reshape(num_kv_heads, group, q_block, head_dim)
        o = o.transpose(2, 0, 1, 3).reshape(q_block, num_kv_heads * group, head_dim)
        old = jax.lax.dynamic_slice_in_dim(out, ws, q_block)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(row_ok[:, None, None], o, old), ws, axis=0)

    def request_step(r, out):
        num_tiles = (q_lens[r] + q_block - 1) // q_block
        return jax.lax.fori_loop(0, num_tiles, lambda u, o: tile_step(r, o, u), out)

    return request_step


def _softmax_step(s, mask, m, l, acc, weighted_values, soft_cap):
    """One online-softmax step over a block of keys: scores ``s [..., S]`` (counted where
    ``mask``), running max ``m`` and sum ``l [...]`` and output ``acc [..., D]``;
    ``weighted_values(p)`` is the probabilities ``p [..., S]`` times the block's values.
    Returns the new ``(m, l, acc)``."""
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + weighted_values(p)


def _pad_to_blocks(table, pages_per_block):
    """``table [R, P]`` padded with page 0 to whole blocks of ``pages_per_block`` pages;
    returns it and the number of blocks."""
    num_blocks = -(-table.shape[1] // pages_per_block)
    pad = num_blocks * pages_per_block - table.shape[1]
    return (jnp.pad(table, ((0, 0), (0, pad))) if pad else table), num_blocks
