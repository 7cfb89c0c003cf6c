"""Ragged paged attention: one dispatch over the jnp paths and the Pallas TPU and GPU kernels.

All implementations share the batch contract of DESIGN.md §2 (documented in ``reference.py``).
``impl`` picks one: ``None``/``"auto"`` follows the default backend's platform (cpu -> cpu, or
xla where the native kernel cannot be built; tpu -> tpu, gpu -> gpu); the others force a path,
e.g. a kernel in interpret mode on CPU (``impl="tpu", interpret=True``). ``"xla"`` (``xla.py``,
per-request blocks) is the fallback on any backend; ``"cpu"`` is the same with the decode rows
through the native CPU kernel (``kernel_cpu.cc``, one device only); ``"reference"`` (per-token
gathers) is the kernels' oracle.
The kernel modules are imported on first use, so importing this package only needs jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pdjax.pallas_kernels.tp_shard import tp_map
from pdjax.pallas_kernels.ragged_paged_attention.kernel_cpu import (
    cpu_kernel_available, cpu_kernel_status)
from pdjax.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference)
from pdjax.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

ATTENTION_IMPLS = ("auto", "reference", "xla", "cpu", "tpu", "gpu")
# Implementations whose cost follows the traced kv_lens, not the pages-per-sequence shape.
TRACED_BOUND_IMPLS = ("reference", "xla", "cpu")
# Implementations that run as one program over the whole cache: no sharding rule of their own,
# so a tensor-parallel engine takes the jnp path instead (engine/settings.py).
SINGLE_DEVICE_IMPLS = ("cpu",)

_PLATFORM_IMPL = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


def resolve_impl(impl: str | None, platform: str | None = None) -> str:
    """Concrete implementation name for ``impl``: ``"reference"``, ``"xla"``, ``"cpu"``,
    ``"tpu"`` or ``"gpu"``.

    ``None`` and ``"auto"`` map ``platform`` (default: the default backend's,
    ``jax.default_backend()``; ``pdjax.aot`` passes its target's); on the CPU that is ``"cpu"``
    where the native kernel builds and loads (``kernel_cpu``), else ``"xla"``. An explicit
    ``"cpu"`` that cannot be built is an error.

    Raises:
      ValueError: ``impl`` is not one of ``ATTENTION_IMPLS``, or auto meets an unknown platform.
    """
    if impl is None:
        impl = "auto"
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS} or None, got {impl!r}")
    if impl == "cpu" and not cpu_kernel_available():
        raise ValueError(f"impl='cpu': the native CPU kernel is unavailable "
                         f"({cpu_kernel_status()[1]})")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    if platform not in _PLATFORM_IMPL:
        raise ValueError(f"impl='auto' has no attention kernel for platform {platform!r}; "
                         f"pass impl explicitly (one of {ATTENTION_IMPLS})")
    impl = _PLATFORM_IMPL[platform]
    if impl == "cpu" and not cpu_kernel_available():
        return "xla"
    return impl


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    impl: str | None = None,
    interpret=False,
    decode_only: bool = False,
) -> jax.Array:
    """Attention of every query row of the flat token stream over its request's paged KV.

    Args:
      q: ``[T, num_q_heads, head_dim]`` float32 or bfloat16.
      k_cache, v_cache: ``[layers, num_pages, page_size, num_kv_heads * head_dim]`` (the
        engine's layout: KV heads side by side in a row, DESIGN.md §2), this step's K/V already
        written; float32, bfloat16 or float8_e4m3fn (kernels). ``[.., num_kv_heads,
        head_dim]`` is the same memory and is accepted too (a copy on TPU).
      layer: int32 scalar, the layer of the stacked caches to read.
      kv_lens: ``[R]`` int32; page_indices: ``[R, P]`` int32; cu_q_lens: ``[R+1]`` int32;
      distribution: ``[3]`` int32 ``(decode_end, prefill_end, num_seqs)`` (DESIGN.md §2).
      sm_scale: softmax scale. sliding_window: keys at positions ``> p - window`` only.
      soft_cap: scores become ``soft_cap * tanh(s / soft_cap)``.
      k_scale, v_scale: static float dequantization scales of a quantized cache, or None.
      k_scales, v_scales: ``[layers, num_pages, page_size, num_kv_heads]`` float32, one scale
        per token per KV head of a float8_e4m3fn cache (``fp8_kv``, written by the model's KV
        write), or None. The reference, the xla / cpu paths and the GPU kernel read them;
        the TPU kernel does not yet and refuses them (ValueError) rather than read unscaled
        values.
      impl: one of ``ATTENTION_IMPLS`` or None (auto).
      interpret: kernels only: True runs them through the Pallas interpreter (CPU); the TPU
        kernel also accepts a ``pltpu.InterpretParams``. Ignored by the reference.
      decode_only: static promise that every row has q_len 1 (the decode entry point); the
        xla path then compiles its decode part alone. The other paths ignore it.

    Returns:
      ``[T, num_q_heads, head_dim]`` in ``q.dtype``; padding rows are 0.

    Raises:
      ValueError: unknown ``impl``, or inputs outside the contract (named field).
    """
    impl = resolve_impl(impl)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    args = (q, k_cache, v_cache, layer, kv_lens, page_indices, cu_q_lens, distribution)
    scales = dict(k_scales=k_scales, v_scales=v_scales)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kwargs, **scales)
    if impl in ("xla", "cpu"):
        return ragged_paged_attention_xla(*args, **kwargs, **scales, decode_only=decode_only,
                                          native_decode=impl == "cpu")
    scaled = k_scales is not None or v_scales is not None
    if scaled and impl == "tpu":
        raise ValueError(f"k_scales/v_scales: the {impl} kernel does not read an FP8 cache with "
                         f"per-token scales yet; use impl='xla' (or --attention-backend xla)")
    if impl == "tpu":
        from pdjax.pallas_kernels.ragged_paged_attention.kernel_tpu import (
            ragged_paged_attention_tpu as kernel)
    else:
        from pdjax.pallas_kernels.ragged_paged_attention.kernel_gpu import (
            ragged_paged_attention_gpu as kernel)
    # Under TP each device runs the kernel on its query heads and KV heads (tp_shard.py).
    heads, cache = P(None, "tp", None), P(None, None, None, "tp", *[None] * (k_cache.ndim - 4))
    in_specs = (heads, cache, cache, P(), P(), P(), P(), P())
    if not scaled:
        run = tp_map(functools.partial(kernel, **kwargs, interpret=interpret),
                     in_specs=in_specs, out_specs=heads)
        return run(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), *args[4:])

    def scaled_kernel(*a):
        return kernel(*a[:8], **kwargs, interpret=interpret, k_scales=a[8], v_scales=a[9])

    scale = P(None, None, None, "tp")      # [L, N, ps, KVH]: split with the heads
    run = tp_map(scaled_kernel, in_specs=(*in_specs, scale, scale), out_specs=heads)
    return run(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), *args[4:], k_scales,
               v_scales)


__all__ = ["ATTENTION_IMPLS", "TRACED_BOUND_IMPLS", "ragged_paged_attention",
           "ragged_paged_attention_reference", "ragged_paged_attention_xla", "resolve_impl"]
