"""Grouped matmul over rows sorted by group (the routed experts of an MoE): the contract, its
input checks, the pure-jnp reference and the tile-to-group map the kernels share.

Contract::

    x [M, K]          rows sorted by group: group 0's group_sizes[0] rows first, then group 1's
    w [G, K, N]       one weight per group: bfloat16 / float32, or float8_e4m3fn with
    w_scale [G, ceil(K/B), ceil(N/B)] float32   one scale per B x B block (edge blocks partial):
                      W[g, k, n] = w[g, k, n] * w_scale[g, k // B, n // B]   (B = 128)
    group_sizes [G] int32 (traced)

    out[r] = x[r] @ W[g(r)]            for the group g(r) of row r
    out[r] = 0                         for rows from sum(group_sizes) on (no group)

``out`` is ``[M, N]`` of ``x``'s dtype, accumulated in float32. With ``layer`` (an int32
scalar, traced) ``w`` is a stack ``[L, G, K, N]`` of every layer's weights and the call uses
``w[layer]`` (``w_scale`` is that layer's): the kernels read the layer's tiles straight from
the stack, where a slice taken before a custom call would be copied whole first (XLA cannot
pass a dynamic slice into one; a layer of DeepSeek-V3.2's FP8 experts is 1.3 GiB a device at
TP 8). Negative sizes count as 0 and
rows past ``M`` are dropped (the sizes are traced, so they cannot be checked).

The kernels walk ``(group, row tile)`` pairs, as megablox's ``gmm`` does (its
``make_group_metadata``): with row tiles of ``tm`` rows, a group whose rows are ``[s, e)``
touches tiles ``s // tm .. (e - 1) // tm``, and a tile shared by two groups is visited once for
each, each visit writing only its group's rows::

    rows   |g0 g0 g0 g0 g0|g0 g1 g1 g1 g2|g2 g2 .. ..|      tm = 5, group_sizes = [6, 3, 3, 0]
    items   (g0,t0) (g0,t1) (g1,t1) (g2,t1) (g2,t2)        5 items <= tiles + G - 1

so each weight is read once per tile of its rows, and no ``[G, M, K]`` operand exists (XLA's
lowering of ``lax.ragged_dot`` on GPU builds one, DESIGN.md §5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 128
FP8_DTYPE = jnp.float8_e4m3fn
ACT_DTYPES = (jnp.float32, jnp.bfloat16)


def num_blocks(n: int, block: int = FP8_BLOCK) -> int:
    return -(-n // block)


def check_inputs(x, w, group_sizes, w_scale=None, block_size: int = FP8_BLOCK,
                 layer=None) -> None:
    """Static checks of the contract; raises ``ValueError`` naming the field."""
    if layer is not None:
        if w.ndim != 4:
            raise ValueError(f"w must be [layers, groups, K, N] with layer, got shape {w.shape}")
        if getattr(layer, "shape", ()) != () or not jnp.issubdtype(
                getattr(layer, "dtype", jnp.int32), jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got {layer!r}")
        w = jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in map(jnp.dtype, ACT_DTYPES):
        raise ValueError(f"x must be float32 or bfloat16, got {jnp.dtype(x.dtype).name}")
    if w.ndim != 3:
        raise ValueError(f"w must be [groups, K, N], got shape {w.shape}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w's K ({w.shape[1]}) differs from x's ({x.shape[1]})")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must be [{w.shape[0]}] (one per group of w), got "
                         f"shape {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32, got {jnp.dtype(group_sizes.dtype).name}")
    if jnp.dtype(w.dtype) == jnp.dtype(FP8_DTYPE):
        if w_scale is None:
            raise ValueError("w_scale: a float8_e4m3fn w needs its block scales")
        if block_size != FP8_BLOCK:
            raise ValueError(f"block_size must be {FP8_BLOCK}, got {block_size}")
        _, K, N = w.shape
        want = (w.shape[0], num_blocks(K, block_size), num_blocks(N, block_size))
        if tuple(w_scale.shape) != want:
            raise ValueError(f"w_scale must be {list(want)} (one per {block_size} x "
                             f"{block_size} block of w), got {list(w_scale.shape)}")
        if jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"w_scale must be float32, got {jnp.dtype(w_scale.dtype).name}")
    else:
        if w_scale is not None:
            raise ValueError(f"w_scale: given for a {jnp.dtype(w.dtype).name} w (scales go "
                             "with float8_e4m3fn weights only)")
        if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"w's dtype ({jnp.dtype(w.dtype).name}) must be x's "
                             f"({jnp.dtype(x.dtype).name}) or float8_e4m3fn")


def dequantize_blocks(w, w_scale, dtype, block_size: int = FP8_BLOCK) -> jax.Array:
    """``w [..., K, N] * w_scale [..., ceil(K/B), ceil(N/B)]`` per block, in float32, cast
    to ``dtype``."""
    K, N = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(w_scale.astype(jnp.float32), block_size, axis=-2),
                   block_size, axis=-1)[..., :K, :N]
    return (w.astype(jnp.float32) * s).astype(dtype)


def grouped_matmul_reference(x, w, group_sizes, w_scale=None, *,
                             block_size: int = FP8_BLOCK, layer=None) -> jax.Array:
    """The contract (module docstring) with ``lax.ragged_dot``, an FP8 ``w`` dequantized to
    ``x``'s dtype first. ``[M, N]`` of ``x``'s dtype. Raises ``ValueError`` (``check_inputs``).
    """
    check_inputs(x, w, group_sizes, w_scale, block_size, layer)
    if layer is not None:
        w = w[layer]
    if w_scale is not None:
        w = dequantize_blocks(w, w_scale, x.dtype, block_size)
    sizes = jnp.maximum(group_sizes, 0)
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def num_items(num_rows: int, num_groups: int, tile_rows: int) -> int:
    """Static upper bound on the ``(group, row tile)`` pairs: ``tiles + groups - 1``."""
    return -(-num_rows // tile_rows) + num_groups - 1


def group_metadata(group_sizes: jax.Array, num_rows: int, tile_rows: int):
    """The kernels' work list (module docstring diagram), traced.

    Returns ``(item_group [I], item_tile [I], group_start [G], group_end [G], count [1])``,
    int32, ``I = num_items(num_rows, G, tile_rows)``: item ``i < count`` multiplies the rows
    ``[group_start[g], group_end[g])`` of row tile ``item_tile[i]`` by group ``g =
    item_group[i]``'s weight. Items past ``count`` repeat the last real one (a TPU pipeline
    then fetches nothing new for them) and must compute nothing. Items are ordered by group
    and then tile, so a tile's visits are consecutive.
    """
    G = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    cum = jnp.cumsum(sizes)
    end = jnp.minimum(cum, num_rows)
    start = jnp.minimum(cum - sizes, num_rows)
    nonempty = end > start
    first = start // tile_rows
    count = jnp.where(nonempty, (end - 1) // tile_rows - first + 1, 0)
    item_end = jnp.cumsum(count)
    total = item_end[-1]
    i = jnp.arange(num_items(num_rows, G, tile_rows), dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(item_end, i, side="right", method="compare_all"), G - 1)
    g = g.astype(jnp.int32)
    tile = first[g] + i - (item_end[g] - count[g])
    last = jnp.maximum(total - 1, 0)
    valid = i < total
    g = jnp.where(valid, g, g[last])
    tiles = -(-num_rows // tile_rows)
    tile = jnp.clip(jnp.where(valid, tile, tile[last]), 0, tiles - 1).astype(jnp.int32)
    return g, tile, start.astype(jnp.int32), end.astype(jnp.int32), total.reshape(1)


def zero_unrouted(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``out [M, N]`` with the rows from ``sum(group_sizes)`` on set to 0 (the kernels leave
    them unwritten)."""
    total = jnp.sum(jnp.maximum(group_sizes, 0))
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < total, out, jnp.zeros((), out.dtype))
