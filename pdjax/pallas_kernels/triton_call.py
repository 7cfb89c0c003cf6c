"""The ``pallas_call`` the Pallas GPU kernels share (ragged paged attention, MLA attention,
the indexer, the grouped GEMM).

Each takes its operands whole in global memory (``pl.ANY``): a program gathers the rows of the
pages it needs with masked ``pltriton.load``s, so there are no block specs to tile. Triton is
chosen explicitly through ``pltriton.CompilerParams`` (jax 0.10's default ``cuda`` lowering of
Pallas is Mosaic GPU, DESIGN.md §5), with the tuning table's ``num_warps`` and ``num_stages``.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def is_pow2(x: int) -> bool:
    """Triton tiles are powers of two."""
    return x > 0 and x & (x - 1) == 0


def triton_call(kernel, *, grid: tuple[int, ...], num_inputs: int,
                out_shape: jax.ShapeDtypeStruct, block_sizes, interpret, name: str):
    """``pl.pallas_call`` of ``kernel`` over ``grid`` with ``num_inputs`` operands and the output
    all in global memory. ``block_sizes`` carries ``num_warps`` and ``num_stages``;
    ``interpret=True`` runs it on CPU through the Pallas interpreter. Returns the callable."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[any_spec] * num_inputs,
        out_specs=any_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=block_sizes.num_warps,
                                                num_stages=block_sizes.num_stages),
        interpret=interpret,
        name=name,
    )
