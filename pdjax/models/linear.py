"""One linear layer, three weight formats: a plain ``[in, out]`` array, a ``PackedWeight`` for
the native CPU matmul (``pallas_kernels/dense_cpu``), or an ``Fp8BlockWeight`` (float8 e4m3
with a float32 scale per 128 x 128 block, as FP8 checkpoints ship; ``models/fp8.py``). Models call ``linear`` (or
``linear_group``) and never ask which format they hold; the platform profile
(``models/platform.py``) chooses the format once, after loading (DESIGN.md §2, dense layers
on CPU).

A packed weight may fuse several weights that multiply the same input (q/k/v; gate/up) into
one matmul whose output is the members' outputs side by side::

    wq [K, Nq] ┐                                     ┌ panel 0: columns [0, 24)
    wk [K, Nk] ├ concatenated ─> [K, Nq+Nk+Nv] ─────>┤ ...                      [P, K, 24]
    wv [K, Nv] ┘                                     └ panel P-1: zero-padded
    linear(x, w) [T, Nq+Nk+Nv] ─ split at Nq, Nq+Nk ─> q, k, v

Shapes: ``x [..., K]``; a plain weight ``[K, N]``; ``PackedWeight.panels [..., P, K, PANEL]``
(leading axes: a stack of layers, sliced away by the layer scan).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.dense_cpu import pack_weight, packed_matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A ``[K, N]`` linear weight in the panel layout of ``dense_cpu.pack_weight``, possibly
    several weights of one input fused along the output axis.

    ``panels``: ``[..., P, K, PANEL]`` float32 or bfloat16 (the only pytree leaf, so a layer
    scan or a per-layer tuple holds it like an array). ``widths``: the output width of each
    fused weight, in order (static); ``N = sum(widths)``.
    """

    panels: jax.Array
    widths: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_linear(cls, weights: Sequence[jax.Array]) -> PackedWeight:
        """Pack ``weights`` (each ``[..., K, N_i]``, same leading axes and K) as one fused
        weight. Traceable (callers pack under ``jax.jit``)."""
        widths = tuple(int(w.shape[-1]) for w in weights)
        return cls(pack_weight(jnp.concatenate(list(weights), axis=-1)), widths)

    @property
    def out_features(self) -> int:
        return sum(self.widths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight:
    """A ``[K, N]`` linear weight (or a stack ``[..., K, N]``: layers, experts) as float8 e4m3
    values and one float32 scale per ``block_size`` x ``block_size`` block (edge blocks
    partial): ``W[k, n] = q[k, n] * scale_inv[k // B, n // B]``.

    ``q``: ``[..., K, N]`` float8_e4m3fn. ``scale_inv``: ``[..., ceil(K/B), ceil(N/B)]``
    float32 (the checkpoint's ``weight_scale_inv``, transposed like the weight). Both are
    pytree leaves, so a layer scan slices them together. ``dequantize`` is the reference path
    (DESIGN.md §2, FP8 weights): XLA does not fuse it into the matmul, so it writes the
    dequantized weight of the one layer (or expert stack) being run, never the whole model's.
    """

    q: jax.Array
    scale_inv: jax.Array
    block_size: int = dataclasses.field(default=128, metadata=dict(static=True))
    # How ``linear`` multiplies it (static; ``with_fp8_kernel`` sets them at trace time):
    # ``impl`` "tpu" / "gpu" runs the block-scaled Pallas GEMM (``pallas_kernels/fp8_gemm``),
    # anything else the reference; ``tp_dim`` (-2: K, -1: N, None: replicated) is the axis
    # split over the mesh's "tp" devices, so the kernel runs per shard.
    impl: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))
    tp_dim: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # A layer view (``slice_layer``): int32 scalar; ``q`` is then the whole stack ``[L, ...]``
    # and ``scale_inv`` this layer's, so the kernel reads the layer in place (a slice passed
    # to a custom call is copied first: 1.3 GiB a device for DeepSeek-V3.2's FP8 experts).
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[1:] if self.layer is not None else self.q.shape)

    def dequantize(self, dtype) -> jax.Array:
        """``[..., K, N]`` of ``dtype``: ``q * scale_inv`` per block, computed in float32."""
        B = self.block_size
        q = self.q if self.layer is None else self.q[self.layer]
        K, N = q.shape[-2:]
        s = jnp.repeat(jnp.repeat(self.scale_inv.astype(jnp.float32), B, axis=-2), B, axis=-1)
        return (q.astype(jnp.float32) * s[..., :K, :N]).astype(dtype)


def with_fp8_kernel(params: Mapping, groups: Mapping, impl: str | None,
                    interpret: bool = False) -> dict:
    """``params`` (group -> name -> value) with every ``Fp8BlockWeight`` set to run through
    the block-scaled GEMM of ``impl`` (resolved: ``"tpu"`` / ``"gpu"`` the Pallas kernels,
    anything else the reference). ``groups``: group -> ``(stack length, {name: (shape,
    PartitionSpec)})`` (``deepseek_params.param_groups``), whose spec says which of the
    weight's last two axes is split over ``"tp"``. Other values are returned as they are."""
    from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl
    impl = resolve_impl(impl)
    out = {}
    for group, values in params.items():
        shapes = groups.get(group, (0, {}))[1]
        if not isinstance(values, Mapping):
            out[group] = values
            continue
        out[group] = dict(values)
        for name, w in values.items():
            if isinstance(w, Fp8BlockWeight) and name in shapes:
                spec = tuple(shapes[name][1]) + (None,) * len(shapes[name][0])
                spec = spec[:len(shapes[name][0])][-2:]
                tp_dim = -2 if spec[0] == "tp" else -1 if spec[1] == "tp" else None
                out[group][name] = dataclasses.replace(w, impl=impl, interpret=interpret,
                                                       tp_dim=tp_dim)
    return out


def slice_layer(values: Mapping, index: jax.Array) -> dict:
    """Entry ``index`` of each stacked value of ``values`` (name -> value; a layer scan's
    body), but an ``Fp8BlockWeight`` that ``with_fp8_kernel`` gave a kernel becomes a layer
    view: its scales sliced, its float8 stack kept whole with ``layer = index``, which the
    kernels read in place. ``index``: int32 scalar (traced)."""
    out = {}
    for name, w in values.items():
        if isinstance(w, Fp8BlockWeight) and w.impl in _KERNEL_IMPLS and w.layer is None:
            out[name] = dataclasses.replace(w, scale_inv=w.scale_inv[index], layer=index)
        else:
            out[name] = jax.tree.map(lambda a: a[index], w)
    return out


def fp8_spec(w, spec):
    """The ``shard_map`` spec (a pytree prefix) of ``w`` for ``spec``, the partition spec of
    its ``[..., K, N]`` value: ``spec`` itself, or for a layer view the stack's (one more
    leading axis), the scales' and a replicated layer index."""
    from jax.sharding import PartitionSpec as P
    if isinstance(w, Fp8BlockWeight) and w.layer is not None:
        return dataclasses.replace(w, q=P(None, *spec), scale_inv=spec, layer=P())
    return spec


_KERNEL_IMPLS = ("tpu", "gpu")


def _fp8_kernel_linear(x: jax.Array, w: Fp8BlockWeight) -> jax.Array:
    """``x @ w`` through ``fp8_gemm.fp8_matmul``, per "tp" shard where the mesh splits ``w``
    (column-parallel: output split; row-parallel: partial sums added with ``psum``)."""
    from jax.sharding import PartitionSpec as P

    from pdjax.pallas_kernels.fp8_gemm import fp8_matmul
    from pdjax.pallas_kernels.tp_shard import tp_size

    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)

    def local(rows, w):
        out = fp8_matmul(rows, w.q, w.scale_inv, layer=w.layer, impl=w.impl,
                         interpret=w.interpret)
        return jax.lax.psum(out, "tp") if w.tp_dim == -2 else out

    mesh = jax.sharding.get_abstract_mesh()
    if tp_size() == 1 or "tp" in mesh.manual_axes:
        # One device, or already inside a shard_map over "tp": the shapes are this shard's.
        out = fp8_matmul(rows, w.q, w.scale_inv, layer=w.layer, impl=w.impl,
                         interpret=w.interpret)
    else:
        x_spec, w_spec, out_spec = {-2: (P(None, "tp"), P("tp", None), P()),
                                    -1: (P(), P(None, "tp"), P(None, "tp")),
                                    None: (P(), P(), P())}[w.tp_dim]
        out = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, fp8_spec(w, w_spec)),
                            out_specs=out_spec, check_vma=False)(rows, w)
    return out.reshape(*lead, out.shape[-1])


def dense_weight(w, dtype) -> jax.Array:
    """``w`` as a plain array: an ``Fp8BlockWeight`` dequantized to ``dtype``, an array as it
    is (for the ops that take weights ``linear`` does not: ``lax.ragged_dot``, einsums)."""
    return w.dequantize(dtype) if isinstance(w, Fp8BlockWeight) else w


def linear(x: jax.Array, w, num_rows: jax.Array | None = None) -> jax.Array:
    """``x [..., K] @ w`` -> ``[..., N]`` for a plain ``[K, N]`` array, a ``PackedWeight`` or an
    ``Fp8BlockWeight`` (dequantized to ``x``'s dtype first, the reference path; or, once
    ``with_fp8_kernel`` chose a TPU / GPU kernel, the block-scaled Pallas GEMM).

    ``num_rows`` (int32 scalar, traced; None: all): rows of ``x`` flattened to ``[M, K]`` from
    it on are padding. The packed matmul skips them (their outputs are 0); a plain dot computes
    them (XLA has no cheaper way), so callers must not read padding rows. The packed output
    has ``x``'s dtype, computed in float32 (``dense_cpu.packed_matmul``)."""
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w.panels, w.out_features, num_rows=num_rows)
    if isinstance(w, Fp8BlockWeight) and w.impl in _KERNEL_IMPLS:
        return _fp8_kernel_linear(x, w)
    return x @ dense_weight(w, x.dtype)


def linear_group(x: jax.Array, params: Mapping, group: str, members: Sequence[str],
                 num_rows: jax.Array | None = None) -> list[jax.Array]:
    """``x`` times each weight named in ``members`` (weights of the same input), one output
    each. Where the weight format fused them, ``params[group]`` is one ``PackedWeight``: one
    matmul, split along its output axis; otherwise one ``linear`` per member."""
    fused = params.get(group)
    if isinstance(fused, PackedWeight):
        out = linear(x, fused, num_rows)
        return jnp.split(out, list(itertools.accumulate(fused.widths[:-1])), axis=-1)
    return [linear(x, params[name], num_rows) for name in members]
