"""Lightning-indexer scoring (DSA) over the paged indexer key cache: one dispatch over the
reference and the Pallas TPU and GPU kernels, plus the top-k selection.

The contract is documented in ``reference.py``. ``impl`` follows
``ragged_paged_attention.resolve_impl`` (``None``/``"auto"`` by platform, or ``"reference"``,
``"tpu"``, ``"gpu"``; ``"xla"`` and ``"cpu"``, the CPU paths of GQA attention, run the
reference). The top-k itself is ``lax.top_k`` outside the kernels
(``topk_positions``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pdjax.pallas_kernels.tp_shard import tp_map
from pdjax.pallas_kernels.indexer.reference import (
    Fp8Keys, indexer_scores_reference, key_view, topk_positions)
from pdjax.pallas_kernels.lanes import pad_query_to_rows
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl


def indexer_scores(
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
    impl: str | None = None,
    interpret=False,
) -> jax.Array:
    """Index scores ``[T, P * page_size]`` float32 of every token over its request's positions.

    Args:
      q: ``[T, index_n_heads, index_head_dim]`` (RoPE applied); weights: ``[T, index_n_heads]``
        (``weights_proj(x) * n_heads ** -0.5``).
      k_cache: ``[layers, num_pages, page_size, W]``, ``W = index_head_dim`` or wider (rows
        padded with zero lanes on TPU, ``pallas_kernels/lanes.py``), this step's keys written;
        or ``Fp8Keys`` (FP8 keys and their float32 scale per 128: the reference and the GPU
        kernel).
      layer, kv_lens, page_indices, cu_q_lens, distribution: DESIGN.md §2 metadata (int32).
      sm_scale: scale inside the relu (``index_head_dim ** -0.5``).
      impl: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"``.
      interpret: kernels only: run through the Pallas interpreter (CPU).

    Returns:
      Column ``i`` is position ``i``; ``-inf`` past the token's position or ``kv_lens``.

    Raises:
      ValueError: unknown ``impl`` or inputs outside the contract (named field).
    """
    impl = resolve_impl(impl)
    if not isinstance(k_cache, Fp8Keys):
        q = pad_query_to_rows(q, k_cache)
    args = (q, weights, k_cache, layer, kv_lens, page_indices, cu_q_lens, distribution)
    if impl in ("reference", "xla", "cpu"):   # no jnp path or CPU kernel of its own
        return indexer_scores_reference(*args, sm_scale=sm_scale)
    if impl == "tpu":
        from pdjax.pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu as kernel
    else:
        from pdjax.pallas_kernels.indexer.kernel_gpu import indexer_scores_gpu as kernel
    # The indexer is replicated under TP: every device scores every head (tp_shard.py).
    run = tp_map(lambda *a: kernel(*a, sm_scale=sm_scale, interpret=interpret),
                 in_specs=(P(),) * 8, out_specs=P())
    return run(q, weights, k_cache, jnp.asarray(layer, jnp.int32), *args[4:])


__all__ = ["Fp8Keys", "indexer_scores", "indexer_scores_reference", "key_view",
           "topk_positions"]
