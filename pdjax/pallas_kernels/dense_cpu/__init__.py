"""Dense matmuls as a native XLA CPU kernel over packed weights (``kernel_cpu.cc``).

Why: XLA CPU runs a dot of a few rows (a decode step's projections) on one thread, reading the
weight column by column out of its row-major layout; a 16-row SmolLM2 decode step spent about
50 of its 65 ms in those dots on this project's 2-core machine (BENCHMARKS.md). The kernel reads
a weight packed into panels of ``PANEL`` output columns, each one contiguous stream, and splits
the panels over XLA's intra-op threads, so every core streams its share (DESIGN.md §2).

``pack_weight`` turns a ``[K, N]`` weight (stored ``[in, out]``) into ``[P, K, PANEL]``;
``packed_matmul`` multiplies by it. The linear weights are packed once, after loading, into
``models/linear.PackedWeight`` where the platform profile's ``cpu_matmul_kernel`` resolves true
(``models/platform.py``). The source is built on first use by ``pdjax.pallas_kernels.cpu_build``
(``PDJAX_CPU_KERNEL=0`` turns it off).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.cpu_build import load_cpu_target

KERNEL_SOURCE = Path(__file__).with_name("kernel_cpu.cc")
FFI_TARGET = "pdjax_packed_matmul"
HANDLER_SYMBOL = "PdjaxPackedMatmul"
PANEL = 24                      # output columns per panel (3 vectors of 8 float32)
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)


@functools.cache
def matmul_kernel_status() -> tuple[bool, str]:
    """``(available, why)``: whether the kernel is built, loaded and registered with XLA for
    the CPU platform in this process (once; later calls return the first answer)."""
    return load_cpu_target(KERNEL_SOURCE, FFI_TARGET, HANDLER_SYMBOL)


def pack_weight(w: jax.Array) -> jax.Array:
    """``w [..., K, N]`` -> ``[..., P, K, PANEL]``, ``P = ceil(N / PANEL)``: panel ``p`` holds
    columns ``[PANEL p, PANEL p + PANEL)``, the last one zero-padded. Leading axes (a stack of
    layers) are kept. Same dtype."""
    *lead, K, N = w.shape
    P = -(-N // PANEL)
    pad = [(0, 0)] * (w.ndim - 1) + [(0, P * PANEL - N)]
    w = jnp.pad(w, pad).reshape(*lead, K, P, PANEL)
    return jnp.moveaxis(w, -2, -3)


def packed_matmul(x: jax.Array, w: jax.Array, n: int, num_rows: jax.Array | None = None
                  ) -> jax.Array:
    """``x [..., K] @ W`` for ``W [K, n]`` given packed (``w = pack_weight(W)``,
    ``[P, K, PANEL]``, float32 or bfloat16).

    ``x`` may be any float dtype and have leading axes; it is computed in float32 and the result,
    ``[..., n]``, has ``x``'s dtype. Each output is one float32 sum over K, so it matches
    ``x @ W`` within float32 rounding. ``num_rows`` (an int32 scalar or ``[1]`` array, traced):
    only the first ``num_rows`` rows of ``x`` flattened to ``[M, K]`` are multiplied, the
    others' outputs are 0 (a step's padding tokens, ``cu_q_lens[-1]`` onwards, cost nothing);
    values outside ``[0, M]`` are clamped. None: every row.

    Raises:
      RuntimeError: the kernel is not available (``matmul_kernel_status()`` says why).
      ValueError: ``w`` is not a packed ``[P, K, PANEL]`` float32/bfloat16 weight for ``x`` and
        ``n``.
    """
    ok, why = matmul_kernel_status()
    if not ok:
        raise RuntimeError(f"CPU matmul kernel unavailable: {why}")
    *lead, K = x.shape
    if (w.ndim != 3 or w.shape[1:] != (K, PANEL) or w.dtype not in WEIGHT_DTYPES
            or not (w.shape[0] - 1) * PANEL < n <= w.shape[0] * PANEL):
        raise ValueError(f"w: a packed [P, {K}, {PANEL}] float32/bfloat16 weight for n={n} "
                         f"expected, got {w.dtype} {w.shape}")
    x2 = x.reshape(-1, K).astype(jnp.float32)
    rows = jnp.full((1,), x2.shape[0], jnp.int32) if num_rows is None else \
        jnp.reshape(num_rows, (1,)).astype(jnp.int32)
    call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w, rows).reshape(*lead, n).astype(x.dtype)
