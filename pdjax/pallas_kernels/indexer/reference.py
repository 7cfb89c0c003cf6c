"""Pure-jnp lightning-indexer scoring over the paged indexer key cache (DSA).

DeepSeek Sparse Attention (DeepSeek-V3.2 §2.1; transformers' ``DeepseekV32Indexer``) scores
every cached token ``i`` for query token ``t`` with a few small heads:

    score[t, i] = sum_h  weights[t, h] * relu(sm_scale * q[t, h, :] . k[i, :])

where ``k`` is the layer's indexer key (one head, ``index_head_dim`` wide) and ``weights`` is
``weights_proj(x) * n_heads ** -0.5`` (computed by the caller). The top ``index_topk`` tokens
per query then restrict MLA attention (``mla_sparse_attention``).

The batch contract is the flat token stream of DESIGN.md §2: token ``t`` of request ``r`` sits
at position ``p = kv_lens[r] - q_len[r] + (t - cu_q_lens[r])`` and may select positions
``0..p``. Scores are returned over the request's page-table span, position ``i`` in column
``i``:

    columns  0 .. P * page_size - 1  of row t  =  positions of request r (page_indices[r])
    column i = -inf  when  i > p  or  i >= kv_lens[r]  (and for padding rows)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import NamedTuple

from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import (
    FP8_DTYPE, SCALE_DTYPE, dequantize_groups, num_scale_groups)
from pdjax.pallas_kernels.mla_sparse_attention.reference import token_positions
from pdjax.pallas_kernels.ragged_paged_attention.reference import validate_metadata

NEG_INF = float("-inf")


class Fp8Keys(NamedTuple):
    """FP8 indexer keys (``--kv-cache-dtype fp8_e4m3`` on GPU/CPU, DeepSeek-V3.2's indexer
    cache): ``keys [L, N, page_size, Di]`` float8_e4m3fn and ``scale [L, N, page_size,
    ceil(Di / 128)]`` float32, one power-of-two scale per 128 values (``fp8_record``); 132
    bytes a token for ``Di`` 128 (bf16: 256)."""

    keys: jax.Array
    scale: jax.Array


def key_view(caches: dict):
    """The indexer key cache as the scorers take it: ``"indexer_k"``, or ``Fp8Keys`` of it
    and ``"indexer_k_scale"``."""
    if "indexer_k_scale" in caches:
        return Fp8Keys(caches["indexer_k"], caches["indexer_k_scale"])
    return caches["indexer_k"]


def validate_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens, distribution):
    """Static checks of the contract; raises ``ValueError`` naming the field."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, index_n_heads, index_head_dim], got {q.shape}")
    if weights.shape != q.shape[:2]:
        raise ValueError(f"weights must be [T, index_n_heads] = {q.shape[:2]}, got {weights.shape}")
    if isinstance(k_cache, Fp8Keys):
        keys, scale = k_cache
        groups = num_scale_groups(q.shape[2])
        if keys.dtype != FP8_DTYPE or scale.dtype != SCALE_DTYPE or scale.ndim != 4 or (
                scale.shape != keys.shape[:3] + (groups,)):
            raise ValueError(f"k_cache: FP8 keys must be float8_e4m3fn [L, N, ps, Di] with "
                             f"float32 scales [L, N, ps, {groups}], got {keys.dtype} "
                             f"{keys.shape}, {scale.dtype} {scale.shape}")
        k_cache = keys
    if k_cache.ndim != 4 or k_cache.shape[3] != q.shape[2]:
        raise ValueError("k_cache must be [layers, num_pages, page_size, index_head_dim="
                         f"{q.shape[2]}], got {k_cache.shape}")
    validate_metadata(kv_lens, page_indices, cu_q_lens, distribution)


def check_kernel_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens,
                        distribution) -> None:
    """The contract (``validate_inputs``) plus the kernels' q dtype; ``ValueError``."""
    validate_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens, distribution)
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")


def indexer_scores_reference(
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
    block_tokens: int = 128,
) -> jax.Array:
    """Index scores of every query row over its request's cached positions.

    Args:
      q: ``[T, Hi, Di]`` indexer queries (RoPE applied), float32 or bfloat16.
      weights: ``[T, Hi]`` per-head weights (already scaled by ``Hi ** -0.5``).
      k_cache: ``[layers, num_pages, page_size, Di]`` indexer keys, this step's keys written;
        slots past ``kv_lens`` may hold anything, NaN included. Or ``Fp8Keys`` (dequantized
        as gathered).
      layer: int32 scalar, the layer of ``k_cache`` to read.
      kv_lens: ``[R]``; page_indices: ``[R, P]``; cu_q_lens: ``[R+1]``; distribution: ``[3]``
        (all int32; DESIGN.md §2).
      sm_scale: scale inside the relu (``Di ** -0.5``).
      block_tokens: positions scored per step (bounds memory at ``T * Hi * block_tokens``).

    Returns:
      ``[T, P * page_size]`` float32; ``-inf`` at positions the token may not select.
    """
    validate_inputs(q, weights, k_cache, kv_lens, page_indices, cu_q_lens, distribution)
    del distribution
    num_tokens = q.shape[0]
    fp8 = isinstance(k_cache, Fp8Keys)
    page_size = (k_cache.keys if fp8 else k_cache).shape[2]
    max_pages = page_indices.shape[1]
    span = max_pages * page_size
    req, pos, kv_len = token_positions(kv_lens, cu_q_lens, num_tokens)
    pages_per_block = max(1, min(max(block_tokens // page_size, 1), max_pages))
    num_blocks = -(-max_pages // pages_per_block)
    rows_pages = page_indices[req]                                         # [T, P]
    if num_blocks * pages_per_block != max_pages:
        rows_pages = jnp.pad(rows_pages, ((0, 0), (0, num_blocks * pages_per_block - max_pages)))
    block = pages_per_block * page_size
    qf = q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)

    def score_block(b):
        pages = jax.lax.dynamic_slice_in_dim(rows_pages, b * pages_per_block, pages_per_block,
                                             axis=1)                       # [T, ppb]
        if fp8:
            k = dequantize_groups(k_cache.keys[layer, pages], k_cache.scale[layer, pages])
        else:
            k = k_cache[layer, pages].astype(jnp.float32)
        k = k.reshape(num_tokens, block, -1)
        s = jax.nn.relu(jnp.einsum("thd,tsd->ths", qf, k) * sm_scale)
        s = jnp.einsum("th,ths->ts", wf, s)
        i = b * block + jnp.arange(block, dtype=jnp.int32)[None, :]
        ok = (i <= pos[:, None]) & (i < kv_len[:, None])
        return jnp.where(ok, s, NEG_INF)                                    # [T, block]

    if num_blocks == 1:
        out = score_block(0)
    else:
        out = jax.lax.map(score_block, jnp.arange(num_blocks, dtype=jnp.int32))
        out = out.transpose(1, 0, 2).reshape(num_tokens, num_blocks * block)
    return out[:, :span]


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """The ``k`` best positions per row of ``scores [T, S]`` as ``[T, min(k, S)]`` int32,
    ``-1`` where fewer than ``k`` positions are selectable (score ``-inf``).

    Ties are broken by ``lax.top_k`` (lowest index first), which need not match
    ``torch.topk``; only the selected set matters to the attention.
    """
    k = min(int(k), scores.shape[1])
    values, idx = jax.lax.top_k(scores, k)
    return jnp.where(values > NEG_INF, idx, -1).astype(jnp.int32)
