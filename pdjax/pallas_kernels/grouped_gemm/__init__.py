"""Grouped matmul (the MoE's routed experts): one dispatch over the jnp reference and the
Pallas TPU and GPU kernels, for bfloat16 / float32 weights and FP8 block-scaled ones.

The contract is documented in ``reference.py``. ``impl`` follows
``ragged_paged_attention.resolve_impl`` (``None``/``"auto"`` by platform, or ``"reference"``,
``"tpu"``, ``"gpu"``; ``"xla"`` and ``"cpu"``, the CPU paths of attention, run the
reference). The kernels are custom calls without a sharding rule: under tensor parallelism the
caller runs them per shard (``models/moe.grouped_swiglu``).
"""

from __future__ import annotations

import jax

from pdjax.pallas_kernels.grouped_gemm.reference import (
    check_inputs, dequantize_blocks, group_metadata, grouped_matmul_reference)
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl

KERNEL_IMPLS = ("tpu", "gpu")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   w_scale: jax.Array | None = None, *, layer=None, impl: str | None = None,
                   interpret=False) -> jax.Array:
    """``out [M, N]`` with ``out[r] = x[r] @ W[group of r]``, 0 past ``sum(group_sizes)``.

    Args:
      x: ``[M, K]`` float32 / bfloat16, rows sorted by group.
      w: ``[G, K, N]`` of x's dtype, or float8_e4m3fn with
        ``w_scale [G, ceil(K/128), ceil(N/128)]`` float32 (``W = w * scale`` per block).
      group_sizes: ``[G]`` int32 (traced).
      layer: int32 scalar (traced) or None: ``w`` is a stack ``[L, G, K, N]`` and ``w[layer]``
        is used, read in place by the kernels (``reference.py``); ``w_scale`` is that layer's.
      impl: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"``.
      interpret: kernels only: run through the Pallas interpreter (CPU).

    Returns:
      ``[M, N]`` of x's dtype, accumulated in float32.

    Raises:
      ValueError: unknown ``impl`` or inputs outside the contract (named field).
    """
    impl = resolve_impl(impl)
    if impl not in KERNEL_IMPLS:
        return grouped_matmul_reference(x, w, group_sizes, w_scale, layer=layer)
    if impl == "tpu":
        from pdjax.pallas_kernels.grouped_gemm.kernel_tpu import grouped_matmul_tpu as kernel
    else:
        from pdjax.pallas_kernels.grouped_gemm.kernel_gpu import grouped_matmul_gpu as kernel
    return kernel(x, w, group_sizes, w_scale, layer=layer, interpret=interpret)


__all__ = ["KERNEL_IMPLS", "check_inputs", "dequantize_blocks", "group_metadata",
           "grouped_matmul", "grouped_matmul_reference"]
