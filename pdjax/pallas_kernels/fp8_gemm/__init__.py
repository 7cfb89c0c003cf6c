"""Block-scaled FP8 GEMM for dense linear layers: ``x [..., K] @ (q [K, N] * scale)`` with
``q`` float8_e4m3fn and one float32 scale per 128 x 128 block (DeepSeek-V3 §3.3; the
``weight_scale_inv`` of FP8 checkpoints, transposed like the weight).

``impl`` as ``grouped_gemm.grouped_matmul``: the reference (``fp8_matmul_reference``:
dequantize to ``x``'s dtype, then one dot; XLA writes the dequantized weight first) or the
Pallas TPU / GPU kernels, which read the float8 tile and widen it in VMEM / registers, so the
weight crosses HBM once in float8. A dense GEMM is the one-group case of the grouped GEMM:
the kernels are ``grouped_gemm``'s, called with one group of all ``M`` rows (its work list is
then just the row tiles). Under tensor parallelism the caller runs them per shard
(``models/linear.linear``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.grouped_gemm import KERNEL_IMPLS, grouped_matmul
from pdjax.pallas_kernels.grouped_gemm.reference import (
    ACT_DTYPES, FP8_BLOCK, FP8_DTYPE, dequantize_blocks, num_blocks)
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl


def check_inputs(x, q, scale_inv, layer=None) -> None:
    """Static checks; ``ValueError`` naming the field."""
    if layer is not None:
        if q.ndim != 3:
            raise ValueError(f"q must be [layers, K, N] with layer, got shape {q.shape}")
        q = jax.ShapeDtypeStruct(q.shape[1:], q.dtype)
    if x.ndim < 1 or x.shape[-1] != (q.shape[0] if q.ndim == 2 else -1):
        raise ValueError(f"x must be [..., K] and q [K, N] with the same K, got x {x.shape}, "
                         f"q {q.shape}")
    if jnp.dtype(x.dtype) not in map(jnp.dtype, ACT_DTYPES):
        raise ValueError(f"x must be float32 or bfloat16, got {jnp.dtype(x.dtype).name}")
    if jnp.dtype(q.dtype) != jnp.dtype(FP8_DTYPE):
        raise ValueError(f"q must be float8_e4m3fn, got {jnp.dtype(q.dtype).name}")
    want = (num_blocks(q.shape[0]), num_blocks(q.shape[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv must be {list(want)} (one per {FP8_BLOCK} x {FP8_BLOCK} "
                         f"block of q), got {list(scale_inv.shape)}")
    if jnp.dtype(scale_inv.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"scale_inv must be float32, got {jnp.dtype(scale_inv.dtype).name}")


def fp8_matmul_reference(x: jax.Array, q: jax.Array, scale_inv: jax.Array,
                         layer=None) -> jax.Array:
    """``x @ dequantize(q, scale_inv)`` with the weight dequantized to ``x``'s dtype
    (``q[layer]`` of a stack when ``layer`` is given)."""
    check_inputs(x, q, scale_inv, layer)
    if layer is not None:
        q = q[layer]
    return x @ dequantize_blocks(q, scale_inv, x.dtype)


def fp8_matmul(x: jax.Array, q: jax.Array, scale_inv: jax.Array, *, layer=None,
               impl: str | None = None, interpret=False) -> jax.Array:
    """``x [..., K] @ W`` -> ``[..., N]`` of ``x``'s dtype, ``W[k, n] = q[k, n] *
    scale_inv[k // 128, n // 128]``.

    Args:
      x: float32 / bfloat16 ``[..., K]``. q: float8_e4m3fn ``[K, N]``.
      scale_inv: float32 ``[ceil(K/128), ceil(N/128)]``.
      layer: int32 scalar (traced) or None: ``q`` is a stack ``[L, K, N]`` and ``q[layer]``
        is used, read in place by the kernels (``grouped_gemm/reference.py``); ``scale_inv``
        is that layer's.
      impl: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"``.
      interpret: kernels only: run through the Pallas interpreter (CPU).

    Raises:
      ValueError: unknown ``impl`` or inputs outside the contract (named field).
    """
    check_inputs(x, q, scale_inv, layer)
    impl = resolve_impl(impl)
    if impl not in KERNEL_IMPLS:
        return fp8_matmul_reference(x, q, scale_inv, layer)
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)
    sizes = jnp.full((1,), rows.shape[0], jnp.int32)
    w = q[None] if layer is None else q[:, None]              # [1, K, N] / [L, 1, K, N]
    out = grouped_matmul(rows, w, sizes, scale_inv[None], layer=layer, impl=impl,
                         interpret=interpret)
    return out.reshape(*lead, q.shape[-1])


__all__ = ["check_inputs", "fp8_matmul", "fp8_matmul_reference"]
