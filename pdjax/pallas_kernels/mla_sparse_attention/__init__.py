"""MLA attention over the paged latent cache (dense, or DSA top-k sparse): one dispatch over
the reference and the Pallas TPU and GPU kernels.

The contract (absorbed MLA, DESIGN.md §2 metadata, top-k positions) is documented in
``reference.py``. ``impl`` follows ``ragged_paged_attention.resolve_impl``: ``None``/``"auto"``
picks by platform, ``"reference"``, ``"tpu"`` or ``"gpu"`` force a path; ``"xla"`` and
``"cpu"`` (the CPU paths of GQA attention) run the reference here. The kernel modules are imported on first use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pdjax.pallas_kernels.lanes import pad_query_to_rows
from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import Fp8Latent
from pdjax.pallas_kernels.tp_shard import tp_map
from pdjax.pallas_kernels.mla_sparse_attention.reference import mla_sparse_attention_reference
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl


def mla_sparse_attention(
    q: jax.Array,
    kv_cache: jax.Array | Fp8Latent,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    impl: str | None = None,
    interpret=False,
) -> jax.Array:
    """Absorbed MLA attention of every query row over its request's paged latent cache.

    Args:
      q: ``[T, H, kv_lora_rank + rope_dim]`` float32 or bfloat16.
      kv_cache: ``[layers, num_pages, page_size, W]``, ``W = kv_lora_rank + rope_dim`` or
        wider (rows padded with zero lanes on TPU, ``pallas_kernels/lanes.py``: the query is
        padded to match), this step's rows already written. Or an ``Fp8Latent``: the planes
        of the FP8 record (``fp8_record.py``; ``q`` stays ``[T, H, Dl + Dr]``), dequantized
        as read by every path.
      layer: int32 scalar; kv_lens ``[R]``, page_indices ``[R, P]``, cu_q_lens ``[R+1]``,
        distribution ``[3]``: DESIGN.md §2 metadata (int32).
      topk_indices: ``[T, K]`` int32 sequence positions per token (``-1`` = empty), or None
        for dense causal attention.
      sm_scale: softmax scale. kv_lora_rank: value width (the first entries of each row).
      impl: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"``.
      interpret: kernels only: run through the Pallas interpreter (CPU).

    Returns:
      ``[T, H, kv_lora_rank]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: unknown ``impl`` or inputs outside the contract (named field).
    """
    impl = resolve_impl(impl)
    if not isinstance(kv_cache, Fp8Latent):
        q = pad_query_to_rows(q, kv_cache)
    args = (q, kv_cache, layer, kv_lens, page_indices, cu_q_lens, distribution, topk_indices)
    kwargs = dict(sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    if impl in ("reference", "xla", "cpu"):   # no jnp path or CPU kernel of its own
        return mla_sparse_attention_reference(*args, **kwargs)
    if impl == "tpu":
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_tpu import (
            mla_sparse_attention_tpu as kernel)
    else:
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_gpu import (
            mla_sparse_attention_gpu as kernel)
    # Under TP each device runs the kernel on its heads over the replicated latent cache.
    heads = P(None, "tp", None)
    run = tp_map(lambda *a: kernel(*a, **kwargs, interpret=interpret),
                 in_specs=(heads, P(), P(), P(), P(), P(), P(), None if topk_indices is None
                           else P()), out_specs=heads)
    return run(q, kv_cache, jnp.asarray(layer, jnp.int32), *args[3:])


__all__ = ["mla_sparse_attention", "mla_sparse_attention_reference"]
