"""Grouped matmul as a Pallas GPU kernel (Triton), bfloat16 / float32 or FP8 block-scaled
weights; contract in ``reference.py``.

Triton is chosen explicitly (``triton_call``, as the attention kernels). Program ``(i, j)``
takes work item ``i`` of ``group_metadata`` -- group ``g``, row tile ``t`` -- and output
columns ``[j*tn, (j+1)*tn)``:

    rows  = t*tm + [0, tm)                 only rows in [group_start[g], group_end[g]) load/store
    acc [tm, tn] f32 = sum over k tiles of  x[rows, k:k+tk] @ w[g, k:k+tk, cols]  (* scale)
    out[rows, cols] = acc                  masked store: a tile shared by two groups gets
                                           disjoint rows from each group's program

FP8: the weight tile loads as float8_e4m3fn and widens to ``x``'s dtype in registers; the
tile lies in one 128 x 128 scale block, so its scale multiplies the tile's partial product
(DeepGEMM's order). Items past the real count exit at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pdjax.pallas_kernels.grouped_gemm.reference import (
    FP8_BLOCK, check_inputs, group_metadata, zero_unrouted)
from pdjax.pallas_kernels.grouped_gemm.tuning import GmmTiles, get_tiles
from pdjax.pallas_kernels.triton_call import is_pow2, triton_call


def _kernel(
    group_ref,   # [I] int32: the item's group
    tile_ref,    # [I] int32: the item's row tile
    start_ref,   # [G] int32: first row of each group
    end_ref,     # [G] int32: one past its last row
    count_ref,   # [1] int32: real items
    layer_ref,   # [1] int32: the layer of the stack
    x_ref,       # [Mp, K]   (Mp: M padded to whole row tiles)
    w_ref,       # [L, G, K, N] x's dtype or float8_e4m3fn (L = 1 without a stack)
    *rest,       # (scale_ref [G, ceil(K/128), ceil(N/128)] float32,) o_ref [Mp, Np]
    tm: int,
    tk: int,
    tn: int,
    fp8: bool,
):
    scale_ref, o_ref = rest if fp8 else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    _, _, K, N = w_ref.shape
    compute_dtype = x_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    @pl.when(i < count_ref[0])
    def _():
        g, layer = group_ref[i], layer_ref[0]
        rows = tile_ref[i] * tm + lax.broadcasted_iota(jnp.int32, (tm,), 0)
        row_ok = (rows >= start_ref[g]) & (rows < end_ref[g])
        cols = j * tn + lax.broadcasted_iota(jnp.int32, (tn,), 0)
        col_ok = cols < N

        def body(kk, acc):
            ks = kk * tk + lax.broadcasted_iota(jnp.int32, (tk,), 0)
            k_ok = ks < K
            x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]],
                              mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [tm, tk]
            w_ok = k_ok[:, None] & col_ok[None, :]
            # No fill value for the float8 load (Triton cannot cast one to it): mask after.
            w = pltriton.load(w_ref.at[layer, g, ks[:, None], cols[None, :]], mask=w_ok)
            w = jnp.where(w_ok, w.astype(compute_dtype), 0)                    # [tk, tn]
            part = lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                   precision=precision,
                                   preferred_element_type=jnp.float32)          # [tm, tn]
            if fp8:
                part = part * scale_ref[g, (kk * tk) // FP8_BLOCK, (j * tn) // FP8_BLOCK]
            return acc + part

        acc = lax.fori_loop(0, pl.cdiv(K, tk), body, jnp.zeros((tm, tn), jnp.float32))
        pltriton.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                       mask=jnp.broadcast_to(row_ok[:, None], (tm, tn)))


def grouped_matmul_gpu(x, w, group_sizes, w_scale=None, *, block_size: int = FP8_BLOCK,
                       layer=None, interpret: bool = False,
                       tiles: GmmTiles | None = None) -> jax.Array:
    """Pallas GPU (Triton) grouped matmul; contract of ``grouped_matmul_reference``.

    Args:
      x: ``[M, K]`` float32 / bfloat16, rows sorted by group. w: ``[G, K, N]`` of x's dtype,
        or float8_e4m3fn with ``w_scale [G, ceil(K/128), ceil(N/128)]`` float32.
      group_sizes: ``[G]`` int32 (traced).
      layer: int32 scalar: ``w`` is ``[L, G, K, N]`` and ``w[layer]`` is used (read in place).
      interpret: run on CPU through the Pallas interpreter. tiles: override of ``get_tiles``.

    Returns:
      ``[M, N]`` of x's dtype; rows from ``sum(group_sizes)`` on are 0.

    Raises:
      ValueError: inputs outside the contract (``check_inputs``) or tiles Triton cannot take.
    """
    check_inputs(x, w, group_sizes, w_scale, block_size, layer)
    if layer is None:
        w, layer = w[None], 0
    M, K = x.shape
    G, _, N = w.shape[1:]
    fp8 = w_scale is not None
    t = tiles or get_tiles("gpu", num_rows=M, k=K, n=N, fp8=fp8,
                           num_groups=G)
    for name in ("tile_m", "tile_k", "tile_n"):
        if not is_pow2(getattr(t, name)) or getattr(t, name) < 16:
            raise ValueError(f"tiles.{name} must be a power of two >= 16 for the GPU kernel, "
                             f"got {getattr(t, name)}")
    if fp8 and (FP8_BLOCK % t.tile_k or FP8_BLOCK % t.tile_n):
        raise ValueError(f"tiles.tile_k ({t.tile_k}) and tile_n ({t.tile_n}) must divide the "
                         f"FP8 scale block ({FP8_BLOCK})")
    tm, tk, tn = t.tile_m, t.tile_k, t.tile_n
    Mp, Np = pl.cdiv(M, tm) * tm, pl.cdiv(N, tn) * tn
    if Mp != M:            # whole row tiles: every store lands inside the output
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    meta = group_metadata(group_sizes, M, tm)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    operands = (*meta, layer, x, w) + ((w_scale,) if fp8 else ())
    kernel = functools.partial(_kernel, tm=tm, tk=tk, tn=tn, fp8=fp8)
    out = triton_call(
        kernel, grid=(meta[0].shape[0], Np // tn), num_inputs=len(operands),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), x.dtype), block_sizes=t,
        interpret=interpret, name="grouped_matmul_gpu",
    )(*operands)
    return zero_unrouted(out[:M, :N], group_sizes)
