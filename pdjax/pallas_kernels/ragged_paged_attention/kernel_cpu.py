"""Decode attention as a native XLA CPU kernel: ``kernel_cpu.cc``, an XLA FFI custom call.

Why: on XLA CPU the jnp decode path (``xla.decode_attention``) first gathers each row's pages
into a contiguous block and then runs small batched dots over it, so every key and value is
written and read again, and the dots run far below the memory's speed; a 16-row SmolLM2 decode
step spent 42 of its 95 ms in attention that way (BENCHMARKS.md). The kernel reads each row's
keys and values once, in place in the stacked paged cache, for all the query heads of a KV head
at a time (DESIGN.md §2).

The source is compiled on first use by ``pdjax.pallas_kernels.cpu_build`` (the host's C++
compiler, ``-march=native``, cached under ``$PDJAX_CACHE_DIR/cpu_kernels/``; ``PDJAX_CPU_KERNEL=0``
turns it off). Where it cannot be built, ``cpu_kernel_status()`` says why and the attention
dispatch (``resolve_impl``) keeps the jnp path.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.pallas_kernels.cpu_build import load_cpu_target

KERNEL_SOURCE = Path(__file__).with_name("kernel_cpu.cc")
FFI_TARGET = "pdjax_paged_decode_attention"
HANDLER_SYMBOL = "PdjaxPagedDecodeAttention"
CACHE_DTYPES = (jnp.float32, jnp.bfloat16)


@functools.cache
def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, why)``: whether the kernel is built, loaded and registered with XLA for
    the CPU platform in this process (once; later calls return the first answer)."""
    return load_cpu_target(KERNEL_SOURCE, FFI_TARGET, HANDLER_SYMBOL)


def cpu_kernel_available() -> bool:
    return cpu_kernel_status()[0]


def supports(q: jax.Array, k_cache: jax.Array, k_scale, v_scale, k_scales=None) -> bool:
    """Whether the kernel takes this query and cache: a float32 or bfloat16 cache without
    per-token scales, or a float8_e4m3fn cache with them (``k_scales``, ``fp8_kv``; a plain
    fp8 cast is left to the jnp path), static scales or None, and a head_dim that is a
    multiple of 8 (its vector width)."""
    fp8 = k_cache.dtype == jnp.float8_e4m3fn
    return (((k_cache.dtype in CACHE_DTYPES and k_scales is None)
             or (fp8 and k_scales is not None)) and q.shape[-1] % 8 == 0
            and all(s is None or isinstance(s, (int, float)) for s in (k_scale, v_scale)))


def decode_attention_cpu(q, k_cache, v_cache, layer, kv_lens, page_indices, num_rows, *,
                         sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                         v_scale=None, k_scales=None, v_scales=None):
    """``xla.decode_attention``'s contract through the native kernel.

    Args:
      q: ``[n, QH, D]`` the decode rows' queries (any float dtype; computed in float32).
      k_cache, v_cache: ``[layers, num_pages, page_size, KVH, D]`` float32 or bfloat16, or
        float8_e4m3fn with ``k_scales``/``v_scales`` ``[layers, num_pages, page_size, KVH]``
        float32 (one scale per token per KV head, ``fp8_kv``).
      layer: int32 scalar; kv_lens ``[R]``, page_indices ``[R, P]`` int32 with ``R >= n``.
      num_rows: int32 scalar: rows ``[0, num_rows)`` are decode rows; the rest give 0.
      sm_scale, sliding_window, soft_cap, k_scale, v_scale: as in the reference (the query sits
        at position ``kv_lens[r] - 1``; scales are static floats or None).

    Returns:
      ``[n, QH, D]`` float32; rows past ``num_rows`` and rows with kv_len 0 are 0.

    Raises:
      RuntimeError: the kernel is not available (``cpu_kernel_status()`` says why).
      ValueError: a cache dtype the kernel does not take.
    """
    ok, why = cpu_kernel_status()
    if not ok:
        raise RuntimeError(f"CPU attention kernel unavailable: {why}")
    if not supports(q, k_cache, k_scale, v_scale, k_scales):
        raise ValueError(f"k_cache/q: the CPU kernel does not take a {k_cache.dtype} cache with "
                         f"q {q.shape} (see kernel_cpu.supports)")
    n = q.shape[0]
    call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    none = jnp.zeros((0,), jnp.float32)
    k_scales = none if k_scales is None else k_scales.astype(jnp.float32)
    v_scales = none if v_scales is None else v_scales.astype(jnp.float32)
    return call(q.astype(jnp.float32), k_cache, v_cache, k_scales, v_scales,
                jnp.asarray(layer, jnp.int32).reshape(()), kv_lens[:n].astype(jnp.int32),
                page_indices[:n].astype(jnp.int32), jnp.asarray(num_rows, jnp.int32).reshape(()),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0),
                k_scale=np.float32(1.0 if k_scale is None else k_scale),
                v_scale=np.float32(1.0 if v_scale is None else v_scale))
