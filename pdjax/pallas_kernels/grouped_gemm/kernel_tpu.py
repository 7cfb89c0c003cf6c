"""Grouped matmul as a Pallas TPU kernel (Mosaic), bfloat16 / float32 or FP8 block-scaled
weights; contract in ``reference.py``.

Grid ``(N / tn, I, K / tk)`` over output column tiles, work items of ``group_metadata``
(scalar-prefetched) and reduction tiles. Item ``i`` (group ``g``, row tile ``t``) pipelines

    x   block [tm, tk]   at (t, k)          w block [tk, tn] at (g, k, n)
    acc [tm, tn] f32 += x @ w               (FP8: per 128-row slice of the tile,
                                             (x @ q_slice) * scale_row [1, tn])
    out block [tm, tn] at (t, n): rows of group g <- acc, the others kept

A tile's items are consecutive, so its output block stays in VMEM across the groups that
share it and is written back once (megablox ``gmm``'s scheme). Items past the real count
repeat the last one's blocks (no new DMA) and compute nothing.

FP8 scales travel per column, ``[G, ceil(K/128), 1, N]`` (each block's scale repeated over its
128 columns, 1/32 of the fp8 bytes), so a ``[tk/128, 1, tn]`` block is lane-dense. On TPU
v5e / v6e the MXU has no float8 mode: the weight tile widens to bfloat16 in VMEM, so FP8 halves
the weight bytes in HBM and the bytes read, not the multiply time (DESIGN.md §5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.pallas_kernels.grouped_gemm.reference import (
    FP8_BLOCK, check_inputs, group_metadata, zero_unrouted)
from pdjax.pallas_kernels.grouped_gemm.tuning import GmmTiles, get_tiles


def _kernel(
    # Scalar prefetch (SMEM).
    group_ref,   # [I] int32: the item's group
    tile_ref,    # [I] int32: the item's row tile
    start_ref,   # [G] int32: first row of each group
    end_ref,     # [G] int32: one past its last row
    count_ref,   # [1] int32: real items
    layer_ref,   # [1] int32: the layer of the stack
    # Inputs.
    x_ref,       # [tm, tk] block of x
    w_ref,       # [tk, tn] block of w[layer, g]
    *rest,       # (scale_ref [tk/128 (ceil), 1, tn] f32,) o_ref [tm, tn], acc_ref [tm, tn] f32
    fp8: bool,
):
    scale_ref, o_ref, acc_ref = rest if fp8 else (None, *rest)
    i, k = pl.program_id(1), pl.program_id(2)
    tm, tk = x_ref.shape
    compute_dtype = x_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i < count_ref[0])
    def _accumulate():
        x = x_ref[...]
        if not fp8:
            acc_ref[...] += dot(x, w_ref[...])
            return
        for b in range(pl.cdiv(tk, FP8_BLOCK)):          # one scale row per 128-row slice
            rows = slice(b * FP8_BLOCK, min((b + 1) * FP8_BLOCK, tk))
            q = w_ref[rows, :].astype(jnp.float32).astype(compute_dtype)
            acc_ref[...] += dot(x[:, rows], q) * scale_ref[b]

    @pl.when((k == pl.num_programs(2) - 1) & (i < count_ref[0]))
    def _store():
        g = group_ref[i]
        rows = tile_ref[i] * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (rows >= start_ref[g]) & (rows < end_ref[g])
        o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), o_ref[...])


def grouped_matmul_tpu(x, w, group_sizes, w_scale=None, *, block_size: int = FP8_BLOCK,
                       layer=None, interpret: bool | pltpu.InterpretParams = False,
                       tiles: GmmTiles | None = None) -> jax.Array:
    """Pallas TPU grouped matmul; contract of ``grouped_matmul_reference``.

    Args:
      x: ``[M, K]`` float32 / bfloat16, rows sorted by group. w: ``[G, K, N]`` of x's dtype,
        or float8_e4m3fn with ``w_scale [G, ceil(K/128), ceil(N/128)]`` float32.
      group_sizes: ``[G]`` int32 (traced).
      layer: int32 scalar: ``w`` is ``[L, G, K, N]`` and ``w[layer]`` is used (its blocks DMA'd
        from the stack).
      interpret: False on TPU; True or ``pltpu.InterpretParams`` to run on CPU.
      tiles: override of ``get_tiles``.

    Returns:
      ``[M, N]`` of x's dtype; rows from ``sum(group_sizes)`` on are 0.

    Raises:
      ValueError: inputs outside the contract (``check_inputs``) or illegal tiles.
    """
    check_inputs(x, w, group_sizes, w_scale, block_size, layer)
    if layer is None:
        w, layer = w[None], 0
    M, K = x.shape
    G, _, N = w.shape[1:]
    fp8 = w_scale is not None
    t = tiles or get_tiles("tpu", num_rows=M, k=K, n=N, fp8=fp8,
                           num_groups=G)
    tm, tk, tn = t.tile_m, t.tile_k, t.tile_n
    if tm % 8:
        raise ValueError(f"tiles.tile_m must be a multiple of 8, got {tm}")
    if tn != N and (tn % 128 or N % tn):
        raise ValueError(f"tiles.tile_n must be N ({N}) or a multiple of 128 dividing it, "
                         f"got {tn}")
    if tk != K and (tk % 128 or K % tk):
        raise ValueError(f"tiles.tile_k must be K ({K}) or a multiple of 128 dividing it, "
                         f"got {tk}")
    Mp = pl.cdiv(M, tm) * tm
    if Mp != M:
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    meta = group_metadata(group_sizes, M, tm)
    in_specs = [pl.BlockSpec((tm, tk), lambda n, i, k, grp, tile, *_: (tile[i], k)),
                pl.BlockSpec((None, None, tk, tn),
                             lambda n, i, k, grp, tile, start, end, count, lay:
                             (lay[0], grp[i], k, n))]
    operands = [x, w]
    if fp8:
        kb = pl.cdiv(tk, FP8_BLOCK)
        # Per-column scales [G, Kb, 1, N]: lane-dense blocks (module docstring).
        cols = jnp.repeat(w_scale, FP8_BLOCK, axis=2)[:, :, None, :N]
        in_specs.append(pl.BlockSpec((None, kb, None, tn),
                                     lambda n, i, k, grp, tile, *_: (grp[i], k, 0, n)))
        operands.append(cols)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(N // tn, meta[0].shape[0], K // tk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda n, i, k, grp, tile, *_: (tile[i], n)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, fp8=fp8),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_tpu",
    )(*meta, jnp.asarray(layer, jnp.int32).reshape(1), *operands)
    return zero_unrouted(out[:M], group_sizes)
