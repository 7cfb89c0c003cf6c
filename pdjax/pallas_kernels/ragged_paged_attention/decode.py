"""Decode attention in plain jnp/XLA: every row has one query token (the decode entry point).

Same contract as ``reference.py`` restricted to q_len 1 rows, different cost on XLA CPU. The
reference computes scores and outputs with ``einsum``s batched over tokens and KV heads
(``thgd,tshd->thgs``): XLA CPU turns each into a transpose of the gathered K (or V) block into a
dot-friendly layout, then a batch of ``[G, D] x [D, S]`` matmuls of a few rows each. Here both
contractions are multiply-and-reduce over the gathered block as it lies in the cache
(``[T, S, KVH, D]``, ``D`` minor), which XLA fuses with the gather: each K/V element is read
once and nothing is transposed. With G (query heads per KV head) a few rows, a matmul has no
reuse to exploit anyway. The online softmax over KV blocks of ``pages_per_block`` pages, up to
the longest row's last block (a traced bound), is the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.ragged_paged_attention.reference import _MASK_VALUE, validate_inputs

DEFAULT_PAGES_PER_BLOCK = 8


def ragged_paged_attention_decode(
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
    pages_per_block: int | None = None,
) -> jax.Array:
    """Attention of decode rows (q_len 1 each) over their paged KV.

    Args:
      q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, distribution, sm_scale,
        sliding_window, soft_cap, k_scale, v_scale: as in ``ragged_paged_attention_reference``
        (shapes ``[T, QH, D]``, ``[layers, num_pages, page_size, KVH, D]`` twice, int32 scalar,
        ``[R]``, ``[R, P]``, ``[R+1]``, ``[3]``), with every row of ``q_len > 0`` a decode row:
        token ``t`` is the query of row ``t`` (``cu_q_lens[r] = r`` up to the last such row).
        ``distribution`` is not read.
      pages_per_block: pages per online-softmax step (static; default up to 8).

    Returns:
      ``[T, QH, D]`` in ``q.dtype``; tokens past ``cu_q_lens[R]`` or ``min(T, R)``, and rows of
      kv_len 0, are 0.

    Raises:
      ValueError: inputs outside the contract (named field), or ``pages_per_block < 1``.
    """
    validate_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_pages = page_indices.shape
    group = num_q_heads // num_kv_heads
    ppb = min(max_pages, DEFAULT_PAGES_PER_BLOCK) if pages_per_block is None else pages_per_block
    if ppb < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {ppb}")
    n = min(num_tokens, num_seqs)              # tokens that can be decode queries
    num_blocks = -(-max_pages // ppb)
    pad = num_blocks * ppb - max_pages
    pages_all = page_indices[:n]
    if pad:
        pages_all = jnp.pad(pages_all, ((0, 0), (0, pad)))
    t = jnp.arange(n, dtype=jnp.int32)
    lens = jnp.where(t < cu_q_lens[num_seqs], kv_lens[:n], 0)              # [n]
    pos = lens - 1                                                         # query positions
    qf = (q[:n].astype(jnp.float32) * sm_scale).reshape(n, num_kv_heads, group, head_dim)
    block_tokens = ppb * page_size

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(pages_all, b * ppb, ppb, axis=1)      # [n, ppb]
        k = k_cache[layer, pages].astype(jnp.float32).reshape(n, block_tokens, num_kv_heads,
                                                               head_dim)
        v = v_cache[layer, pages].astype(jnp.float32).reshape(n, block_tokens, num_kv_heads,
                                                               head_dim)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        kv_pos = b * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)       # [S]
        mask = kv_pos[None, :] < lens[:, None]                                     # [n, S]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos[:, None] - sliding_window
        mask = mask[:, :, None, None]
        s = jnp.sum(qf[:, None] * k[:, :, :, None, :], axis=-1)                   # [n, S, KVH, G]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))                                      # [n, KVH, G]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        # NaN in unused slots must not leak through 0 * NaN.
        v = jnp.where(mask, v, 0.0)
        pv = jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1)                   # [n, KVH, G, D]
        return m_new, alpha * l + p.sum(axis=1), alpha[..., None] * acc + pv

    init = (jnp.full((n, num_kv_heads, group), _MASK_VALUE, jnp.float32),
            jnp.zeros((n, num_kv_heads, group), jnp.float32),
            jnp.zeros((n, num_kv_heads, group, head_dim), jnp.float32))
    lo = 0
    if sliding_window is not None:       # blocks wholly before every row's window are skipped
        first = jnp.min(jnp.where(lens > 0, jnp.maximum(pos - sliding_window + 1, 0), 1 << 30))
        lo = jnp.minimum(first // block_tokens, num_blocks)
    needed = (jnp.max(lens) + block_tokens - 1) // block_tokens
    _, l, acc = jax.lax.fori_loop(lo, jnp.minimum(needed, num_blocks), body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(n, num_q_heads, head_dim)
    if n < num_tokens:
        out = jnp.pad(out, ((0, num_tokens - n), (0, 0), (0, 0)))
    return out.astype(q.dtype)
