"""The one factory that turns ``ServerArgs`` into what the engine runs with: every "auto" and
every default that depends on the platform or the checkpoint is resolved here, and the
scheduler's ``SchedulerConfig`` is built here (DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pdjax.config import ModelConfig, ServerArgs
from pdjax.models.loader import checkpoint_config, resolve_dtype, resolve_model_path
from pdjax.pallas_kernels.dense_cpu import WEIGHT_DTYPES, matmul_kernel_status
from pdjax.pallas_kernels.ragged_paged_attention import SINGLE_DEVICE_IMPLS, resolve_impl
from pdjax.sched.buckets import Buckets
from pdjax.sched.scheduler import SchedulerConfig

_KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """``ServerArgs`` with nothing left to resolve.

    ``model_path``: a local checkpoint path (a hub id resolved). ``dtype`` / ``kv_dtype``: JAX
    dtypes of the parameters and the KV cache. ``attention_impl``: ``reference``, ``xla``,
    ``cpu``, ``tpu`` or ``gpu`` (``auto`` under ``tp_size > 1`` never picks ``cpu``).
    ``scheduler.max_context_len``: ``context_length``, or the model's
    ``max_position_embeddings``. ``overlap``: overlapped scheduling (off with
    ``disable_overlap_schedule`` and for the prefill role, whose requests all end after one
    token). ``unroll_layers``: ``args.unroll_layers`` with auto resolved (``_unroll_layers``).
    ``cpu_matmul_kernel``: ``args.cpu_matmul_kernel`` resolved (``_cpu_matmul_kernel``).
    """

    args: ServerArgs
    model_path: str
    dtype: Any
    kv_dtype: Any
    attention_impl: str
    scheduler: SchedulerConfig
    overlap: bool
    unroll_layers: bool
    cpu_matmul_kernel: bool


def _attention_impl(args: ServerArgs, platform: str) -> str:
    """``args.attention_backend`` resolved; a single-device kernel is not picked for a TP mesh
    (auto falls back to ``xla``; asked for by name it is an error)."""
    impl = resolve_impl(args.attention_backend, platform)
    if impl in SINGLE_DEVICE_IMPLS and args.tp_size > 1:
        if args.attention_backend not in (None, "auto"):
            raise ValueError(f"attention_backend {impl!r} runs on one device; tp_size is "
                             f"{args.tp_size} (use 'xla' or 'auto')")
        return "xla"
    return impl


def _unroll_layers(args: ServerArgs, model_cfg, platform: str) -> bool:
    """``args.unroll_layers``; auto (None): the Llama family (its ``ModelConfig``) on the CPU
    backend, where its scan copies each layer's weights (DESIGN.md §2)."""
    if args.unroll_layers is not None:
        return args.unroll_layers
    return platform == "cpu" and isinstance(model_cfg, ModelConfig)


def _cpu_matmul_kernel(args: ServerArgs, model_cfg, dtype, platform: str) -> bool:
    """``args.cpu_matmul_kernel``; auto (None): on for the Llama family on the CPU backend
    with ``tp_size`` 1 and float32 or bfloat16 weights, where the kernel builds. Asked for
    where it cannot run, a ``ValueError`` that names the field and says why."""
    if args.cpu_matmul_kernel is False:
        return False                  # nothing to check, and no kernel to build
    why = None
    if platform != "cpu":
        why = f"the backend is {platform}, not cpu"
    elif not isinstance(model_cfg, ModelConfig):
        why = "only Llama-family models pack their weights"
    elif args.tp_size > 1:
        why = f"it runs on one device; tp_size is {args.tp_size}"
    elif jnp.dtype(dtype) not in map(jnp.dtype, WEIGHT_DTYPES):
        why = f"dtype {jnp.dtype(dtype).name} is not float32 or bfloat16"
    elif not matmul_kernel_status()[0]:
        why = f"the kernel is unavailable ({matmul_kernel_status()[1]})"
    if why is not None and args.cpu_matmul_kernel:
        raise ValueError(f"cpu_matmul_kernel: {why}")
    return why is None


def resolve_engine_config(args: ServerArgs, platform: str | None = None) -> EngineConfig:
    """Resolve ``args`` (reads the checkpoint's config from its metadata, no tensor) for
    ``platform`` (``"cpu"``, ``"tpu"``, ``"gpu"``; default: the default backend's; the
    abstract engine of ``pdjax.aot`` passes its target's).

    Raises ``ValueError`` for a checkpoint that cannot be read or an attention backend the
    platform has no kernel for."""
    platform = platform or jax.default_backend()
    model_path = resolve_model_path(args.model_path, args.revision)
    model_cfg = checkpoint_config(model_path)
    attention_impl = _attention_impl(args, platform)
    if (attention_impl in ("tpu", "gpu") and not isinstance(model_cfg, ModelConfig)
            and args.cache.kv_cache_dtype == "fp8_e4m3"):
        raise ValueError("kv_cache_dtype: the MLA kernels take a float32 or bfloat16 latent "
                         "cache, not fp8_e4m3")
    model_len = model_cfg.max_position_embeddings
    dtype = resolve_dtype(args.dtype, platform)
    sched, cache = args.scheduler, args.cache
    scheduler = SchedulerConfig(
        num_pages=cache.num_pages, page_size=cache.page_size,
        max_running_requests=sched.max_running_requests,
        chunked_prefill_size=sched.chunked_prefill_size,
        max_prefill_tokens=sched.max_prefill_tokens,
        enable_mixed_chunk=sched.enable_mixed_chunk,
        disable_radix_cache=cache.disable_radix_cache,
        max_context_len=args.context_length or model_len,
        page_aligned_chunks=args.role == "prefill",
        max_num_batched_tokens=sched.max_num_batched_tokens, target_itl_ms=sched.target_itl_ms)
    return EngineConfig(
        args=args, model_path=model_path, dtype=dtype,
        kv_dtype=dtype if cache.kv_cache_dtype == "auto" else _KV_DTYPES[cache.kv_cache_dtype],
        attention_impl=attention_impl,
        scheduler=scheduler,
        overlap=not sched.disable_overlap_schedule and args.role != "prefill",
        unroll_layers=_unroll_layers(args, model_cfg, platform),
        cpu_matmul_kernel=_cpu_matmul_kernel(args, model_cfg, dtype, platform))


def make_buckets(args: ServerArgs, context_length: int, attention_impl: str,
                 model) -> Buckets:
    """The engine's shape buckets (DESIGN.md §2) for requests of up to ``context_length``
    tokens: the jnp attention paths (``model.TRACED_PAGES_BOUND_IMPLS``) need one
    pages-per-sequence bucket, the Pallas kernels a few. ``model``: the model or its class."""
    return Buckets.create(
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        max_pages_per_seq=-(-context_length // args.page_size),
        max_num_batched_tokens=args.max_num_batched_tokens,
        traced_pages_bound=attention_impl in getattr(model, "TRACED_PAGES_BOUND_IMPLS", ()))
