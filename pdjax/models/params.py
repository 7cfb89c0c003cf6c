"""Placing checkpoint arrays into an NNX model's parameters, sharded over a mesh."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pdjax.models.fp8 import LazyStack


def _split_abstract(make_model: Callable[[], nnx.Module]):
    graphdef, state = nnx.split(nnx.eval_shape(make_model))
    return graphdef, dict(nnx.to_flat_state(state))


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def abstract_params(make_model: Callable[[], nnx.Module]) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of every parameter of ``make_model()`` by dotted path (``"layers.wq"``),
    found without allocating the model."""
    _, flat = _split_abstract(make_model)
    return {_key(path): jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype)
            for path, var in flat.items()}


def abstract_model(model: nnx.Module, specs: dict[str, PartitionSpec], mesh: Mesh):
    """``(graphdef, state)`` of an abstract ``model`` (``nnx.eval_shape``: nothing allocated)
    with every parameter a ``jax.ShapeDtypeStruct`` carrying ``NamedSharding(mesh,
    specs[path])``, ready to be traced and compiled for ``mesh``'s devices, compile-only ones
    included (``pdjax.aot``)."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                           sharding=NamedSharding(mesh, specs[_key(path)])))
    return graphdef, nnx.from_flat_state(flat)


def random_params(make_model: Callable[[], nnx.Module], specs: dict[str, PartitionSpec],
                  mesh: Mesh) -> dict[str, jax.Array]:
    """Every parameter of ``make_model()`` as the model's own initializers make it (Llama:
    normal(0.02) weights, ones for the norms), created on the devices of ``mesh`` with
    ``NamedSharding(mesh, specs[path])``: nothing goes through the host, so a 16 GB model costs
    no host memory. Keyed by dotted path, ready for ``place_params``. Deterministic: the same
    ``make_model`` (its ``nnx.Rngs`` seed) gives the same values on every call and process.
    Used by ``load_format="dummy"`` (``loader.load_dummy_model``)."""
    keys = abstract_params(make_model)
    shardings = {key: NamedSharding(mesh, specs[key]) for key in keys}

    def create():
        _, state = nnx.split(make_model())
        return {_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}

    return jax.jit(create, out_shardings=shardings)()


def place_params(make_model: Callable[[], nnx.Module], params: Mapping[str, np.ndarray | jax.Array],
                 specs: dict[str, PartitionSpec], mesh: Mesh) -> nnx.Module:
    """Build ``make_model()`` abstractly (no allocation) and fill every parameter from
    ``params`` (keyed by dotted path, e.g. ``"layers.wq"``), cast to the parameter's dtype and
    placed with ``NamedSharding(mesh, specs[path])``. A value that is already a ``jax.Array``
    with that sharding and dtype (e.g. restored shard by shard from an Orbax checkpoint) is
    used as it is, without a trip through the host. On a mesh over several processes each
    process places only its own devices' shards (``jax.make_array_from_callback``), and a
    ``fp8.LazyStack`` (memory-mapped FP8 weights) is read shard by shard on any mesh.

    Raises ``ValueError`` naming the parameter when ``params`` lacks it or its shape differs.
    """
    graphdef, flat = _split_abstract(make_model)
    for path, var in flat.items():
        key = _key(path)
        if key not in params:
            raise ValueError(f"checkpoint has no tensor for parameter {key!r}")
        abstract = var.get_value()
        value = params[key]
        if tuple(value.shape) != tuple(abstract.shape):
            raise ValueError(f"parameter {key!r}: shape {tuple(value.shape)}, expected {abstract.shape}")
        sharding = NamedSharding(mesh, specs[key])
        if isinstance(value, LazyStack):
            # Each device reads only its own shard of the memory-mapped weights.
            value = jax.make_array_from_callback(
                value.shape, sharding,
                lambda i, v=value, dt=abstract.dtype: v[i].astype(dt, copy=False))
        elif not (isinstance(value, jax.Array) and value.dtype == abstract.dtype
                and value.sharding.is_equivalent_to(sharding, value.ndim)):
            if sharding.is_fully_addressable:
                value = jax.device_put(jnp.asarray(np.asarray(value), dtype=abstract.dtype),
                                       sharding)
            else:       # multi-host: this process places only the shards of its own devices
                host = np.asarray(value).astype(abstract.dtype)
                value = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
