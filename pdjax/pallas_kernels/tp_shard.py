"""Tensor parallelism around a Pallas kernel call.

XLA cannot partition a Mosaic (TPU) or Triton (GPU) custom call: under a ``tp`` mesh a kernel
whose operands are sharded fails to compile ("Mosaic kernels cannot be automatically
partitioned"). ``tp_map`` runs the kernel once per device with ``jax.shard_map`` over the
``tp`` axis of the mesh being traced under (``jax.set_mesh``, as the model runner's lowerings
do), each device on its own heads: the kernels are per-head, so no collective is needed. With
no mesh, or a ``tp`` axis of one device, the kernel is called as it is.
"""

from __future__ import annotations

from typing import Callable

import jax


def tp_size() -> int:
    """Devices on the ``tp`` axis of the mesh being traced under (1 without one, or inside a
    ``shard_map`` already manual over ``tp``: DP attention's, whose operands are one
    device's and whose kernels run on them as they are)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "tp" not in mesh.axis_names or "tp" in mesh.manual_axes:
        return 1
    return mesh.shape["tp"]


def tp_map(fn: Callable, in_specs, out_specs) -> Callable:
    """``fn`` per ``tp`` shard (``jax.shard_map`` with ``in_specs`` / ``out_specs``, a
    ``PartitionSpec`` per argument / output, ``None`` for a replicated scalar), or ``fn``
    itself without a ``tp`` axis of more than one device."""
    if tp_size() == 1:
        return fn
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                         out_specs=out_specs, check_vma=False)
