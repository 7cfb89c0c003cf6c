"""Placing checkpoint arrays into an NNX model's parameters, sharded over a mesh."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def place_params(make_model: Callable[[], nnx.Module], params: dict[str, np.ndarray],
                 specs: dict[str, PartitionSpec], mesh: Mesh) -> nnx.Module:
    """Build ``make_model()`` abstractly (no allocation) and fill every parameter from
    ``params`` (keyed by dotted path, e.g. ``"layers.wq"``), cast to the parameter's dtype and
    placed with ``NamedSharding(mesh, specs[path])``.

    Raises ``ValueError`` naming the parameter when ``params`` lacks it or its shape differs.
    """
    graphdef, state = nnx.split(nnx.eval_shape(make_model))
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        key = ".".join(str(p) for p in path)
        if key not in params:
            raise ValueError(f"checkpoint has no tensor for parameter {key!r}")
        abstract = var.get_value()
        value = np.asarray(params[key])
        if value.shape != abstract.shape:
            raise ValueError(f"parameter {key!r}: shape {value.shape}, expected {abstract.shape}")
        sharding = NamedSharding(mesh, specs[key])
        var.set_value(jax.device_put(jnp.asarray(value, dtype=abstract.dtype), sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
