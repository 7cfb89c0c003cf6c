"""The ``jax`` transfer backend's own device programs (DESIGN.md §4, the ``jax`` backend):
the decode's padding mask, and every program the backend adds to the runner's gather and
scatter, lowered for AOT compiles. Split from ``jax_transfer_kv.py`` (the pool), which jits
``pad_mask``.

Shapes: compact chunk arrays ``[layers, bucket, page_size, *row]``.
"""

from __future__ import annotations

from typing import Any, Sequence


def pad_mask(parts: Sequence[Any], n) -> list:
    """Compact arrays ``[layers, bucket, ...]`` with rows ``>= n`` (an int32 scalar) of the
    page axis set to zero: the decode's padding rows, which it scatters into the null page."""
    import jax.numpy as jnp

    def one(p):
        keep = (jnp.arange(p.shape[1]) < n).reshape(1, -1, *([1] * (p.ndim - 2)))
        return jnp.where(keep, p, jnp.zeros((), p.dtype))
    return [one(p) for p in parts]


def lower_transfer_programs(caches: dict, bucket: int, units: int) -> list[tuple[str, Any]]:
    """The device programs this backend adds to the runner's ``gather_pages`` and
    ``scatter_pages``, lowered for AOT compiles (``scripts/aot_jax_transfer.py``):
    ``(name, jax.stages.Lowered)`` for the decode's padding mask over every buffer of a
    ``bucket``-page chunk in the pool's sharding, and, for the first buffer whose row splits
    into ``units`` head-group units (> 1), the prefill's slice of one unit out of a device's
    shard and the decode's concatenation of one device's units. ``caches``: ``{name:
    jax.ShapeDtypeStruct}`` of the pool, with shardings."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    parts = [S((c.shape[0], bucket, *c.shape[2:]), c.dtype, sharding=c.sharding)
             for c in caches.values()]
    out = [(f"jax_pad_mask n={bucket}",
            jax.jit(pad_mask).trace(parts, jax.ShapeDtypeStruct((), jnp.int32)).lower())]
    for name, p in zip(caches, parts):
        if units <= 1 or p.shape[3] % units:
            continue
        dev = jax.sharding.SingleDeviceSharding(next(iter(p.sharding.device_set)))
        shards = len(p.sharding.device_set) if p.sharding.shard_shape(p.shape)[3] < \
            p.shape[3] else 1
        width = p.shape[3] // units
        shard = S((*p.shape[:3], p.shape[3] // shards, *p.shape[4:]), p.dtype, sharding=dev)
        unit = S((*p.shape[:3], width, *p.shape[4:]), p.dtype, sharding=dev)
        if shard.shape[3] > width:
            out.append((f"jax_unit_slice {name} n={bucket}",
                        jax.jit(lambda x: x[:, :, :, :width]).trace(shard).lower()))
        per_device = max(1, units // len(p.sharding.device_set))
        if per_device > 1:
            out.append((f"jax_unit_concat {name} n={bucket}", jax.jit(
                lambda *us: jnp.concatenate(us, axis=3)).trace(*[unit] * per_device).lower()))
        break
    return out
