"""The one factory that turns ``ServerArgs`` into what the engine runs with: every "auto" and
every default that depends on the platform or the checkpoint is resolved here, and the
scheduler's ``SchedulerConfig`` is built here (DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from pdjax.config import ModelConfig, ServerArgs
from pdjax.models.loader import checkpoint_config, resolve_dtype, resolve_model_path
from pdjax.models.platform import PlatformProfile
from pdjax.sched.buckets import Buckets
from pdjax.sched.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

_KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """``ServerArgs`` with nothing left to resolve.

    ``model_path``: a local checkpoint path (a hub id resolved). ``dtype`` / ``kv_dtype``: JAX
    dtypes of the parameters and the KV cache. ``profile``: the platform's attention kernel
    and weight layout, every "auto" resolved (``models/platform.py``; ``attention_impl``,
    ``unroll_layers`` and ``cpu_matmul_kernel`` read it; ``auto`` under ``tp_size > 1``
    never picks the ``cpu`` attention kernel). ``scheduler.max_context_len``:
    ``context_length``, or the model's ``max_position_embeddings``. ``overlap``: overlapped
    scheduling (off with ``disable_overlap_schedule`` and for the prefill role, whose requests
    all end after one token).
    """

    args: ServerArgs
    model_path: str
    dtype: Any
    kv_dtype: Any
    profile: PlatformProfile
    scheduler: SchedulerConfig
    overlap: bool

    @property
    def attention_impl(self) -> str:
        return self.profile.attention_impl

    @property
    def unroll_layers(self) -> bool:
        return self.profile.unroll_layers

    @property
    def cpu_matmul_kernel(self) -> bool:
        return self.profile.cpu_matmul_kernel


def check_checkpoint_paths(args: ServerArgs) -> None:
    """Read the config of every checkpoint ``args`` names (metadata only: no tensor, no jax
    device), so that a path that is no checkpoint (a file that is neither a folder nor a
    ``.gguf``, a folder without a readable config.json, an unsupported architecture, a
    corrupt GGUF header) is one error line before the server loads anything.

    Raises ``ValueError`` naming the field (``model_path``, ``speculative_draft_model_path``,
    ``tokenizer_path``)."""
    paths = {"model_path": args.model_path}
    if args.speculative_draft_model_path:
        paths["speculative_draft_model_path"] = args.speculative_draft_model_path
    for field, path in paths.items():
        try:
            checkpoint_config(resolve_model_path(path, args.revision))
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
    if args.tokenizer_path is not None and not os.path.exists(args.tokenizer_path):
        raise ValueError(f"tokenizer_path: {args.tokenizer_path}: not found")


def resolve_engine_config(args: ServerArgs, platform: str | None = None) -> EngineConfig:
    """Resolve ``args`` (reads the checkpoint's config from its metadata, no tensor) for
    ``platform`` (``"cpu"``, ``"tpu"``, ``"gpu"``; default: the default backend's; the
    abstract engine of ``pdjax.aot`` passes its target's).

    Raises ``ValueError`` for a checkpoint that cannot be read or an attention backend the
    platform has no kernel for."""
    platform = platform or jax.default_backend()
    model_path = resolve_model_path(args.model_path, args.revision)
    model_cfg = checkpoint_config(model_path)
    dtype = resolve_dtype(args.dtype, platform)
    profile = PlatformProfile.resolve(
        platform, attention_backend=args.attention_backend, unroll_layers=args.unroll_layers,
        cpu_matmul_kernel=args.cpu_matmul_kernel, tp_size=args.tp_size, dtype=dtype,
        layer_stack=isinstance(model_cfg, ModelConfig))
    if (profile.attention_impl in ("tpu", "gpu") and not isinstance(model_cfg, ModelConfig)
            and args.cache.kv_cache_dtype == "fp8_e4m3"):
        raise ValueError("kv_cache_dtype: the MLA kernels take a float32 or bfloat16 latent "
                         "cache, not fp8_e4m3")
    model_len = model_cfg.max_position_embeddings
    if args.context_length is not None and args.context_length > model_len:
        # SGLang refuses this unless told to; pdjax serves it (the AOT sweeps size real models
        # past their config's value) and says so: positions past training are the user's risk.
        logger.warning("context_length %d is over the model's max_position_embeddings %d: "
                       "positions past it were never trained", args.context_length, model_len)
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
        profile=profile, scheduler=scheduler,
        overlap=not sched.disable_overlap_schedule and args.role != "prefill")


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
