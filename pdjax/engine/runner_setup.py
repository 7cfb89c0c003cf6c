"""The model and its runner, built alike on every node of a server (DESIGN.md §6).

Node 0's ``EngineCore`` builds its tokenizer, scheduler, speculator and KV transfers around
them; a multi-host follower (``pdjax.entrypoints.multihost``) only makes node 0's runner calls
and its own KV shards' transfers, so it builds this and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pdjax.config import ServerArgs
from pdjax.engine.settings import (EngineConfig, check_local_devices, make_buckets,
                                   resolve_engine_config)
from pdjax.engine.speculative import model_kwargs, verify_width
from pdjax.jax_setup import enable_compilation_cache
from pdjax.models.loader import load_model, make_mesh
from pdjax.models.registry import model_family
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.buckets import Buckets


@dataclasses.dataclass
class NodeRunner:
    """One node's model runner and what it was built from.

    ``config``: the resolved settings (``EngineConfig``); ``model_cfg``: the model's config
    (``vocab_size``, ``num_kv_heads``, ...); ``model_path``: the local checkpoint;
    ``context_length``: most tokens one request may hold (the scheduler's
    ``max_request_tokens``); ``buckets``: the shapes the runner compiles. A follower's
    ``NodeRunner`` is the host of its KV shards' transfers (``RankSender``,
    ``DecodeRankNode``)."""

    args: ServerArgs
    config: EngineConfig
    model_path: str
    model_cfg: Any
    context_length: int
    buckets: Buckets
    runner: ModelRunner


def build_runner(args: ServerArgs, *, progress: bool = True, buckets: Buckets | None = None,
                 phase: Callable[[str], None] = lambda name: None) -> NodeRunner:
    """Load ``args``'s model onto the ``tp`` mesh and build its ``ModelRunner`` (KV cache
    allocated, nothing compiled). ``buckets``: the shapes to compile instead of those
    ``make_buckets`` derives; ``ValueError`` when they cannot hold every batch
    (``Buckets.check_serves``). ``phase(name)`` is called after the "backend", "model" and
    "kv_cache" phases (``PhaseTimer``). Multi-host: call ``pdjax.distributed.join`` first
    (before anything asks JAX for its backend; resolving "auto" does)."""
    enable_compilation_cache()
    config = resolve_engine_config(args)
    check_local_devices(args, config.model_cfg)     # before anything loads or allocates
    mesh = make_mesh(args.tp_size)
    phase("backend")
    model_cfg, model = load_model(
        config.model_path, dtype=config.dtype, mesh=mesh, progress=progress,
        load_format=args.load_format, attention_impl=config.attention_impl,
        pallas_interpret=args.pallas_interpret, unroll_layers=config.unroll_layers,
        cpu_matmul_kernel=config.cpu_matmul_kernel, ep_size=args.ep_size,
        moe_a2a_backend=args.moe_a2a_backend, dp_size=args.dp_size,
        **model_kwargs(args, config.model_path))
    phase("model")
    if args.mem_fraction_static is not None:
        args = dataclasses.replace(args, max_total_tokens=_pool_tokens(args, config, model, mesh))
        config = resolve_engine_config(args)        # the scheduler's pages follow the pool
    context_length = config.scheduler.max_request_tokens
    node_buckets = make_buckets(args, context_length, config.attention_impl,
                                model_family(model_cfg.architecture))
    if buckets is not None:
        buckets.check_serves(node_buckets)
        node_buckets = buckets
    runner = ModelRunner(model, mesh, num_pages=args.num_pages, page_size=args.page_size,
                         kv_dtype=config.kv_dtype, buckets=node_buckets,
                         chunk_size=args.chunked_prefill_size,
                         executables_dir=args.aot_executables, verify_width=verify_width(args))
    phase("kv_cache")
    return NodeRunner(args, config, config.model_path, model_cfg, context_length, node_buckets,
                      runner)


def _pool_tokens(args: ServerArgs, config: EngineConfig, model, mesh) -> int:
    """``max_total_tokens`` under ``--mem-fraction-static`` (``engine/kv_budget.py``): what the
    loaded weights leave of that fraction of the first device's memory, in whole pages."""
    import jax
    from flax import nnx

    from pdjax.engine.kv_budget import device_bytes_in_use, tokens_for_fraction
    from pdjax.pallas_kernels.lanes import kv_row_align
    from pdjax.runner import model_runner

    device = mesh.devices.flat[0]
    device_bytes = model_runner.device_memory_bytes(device)
    if device_bytes is None:
        raise ValueError(f"mem_fraction_static: the {device.platform} backend reports no "
                         f"device memory; set --max-total-tokens")
    dp, probe = args.dp_size, 64 * args.dp_size          # pages of the group, to measure
    specs = model.cache_spec(probe // dp, args.page_size, config.kv_dtype,
                             row_align=kv_row_align(device.platform))
    per_device = sum(s.num_layers * s.bytes_per_page_layer * s.num_pages
                     // (args.tp_size if "tp" in tuple(s.partition) else 1) for s in specs)
    used = device_bytes_in_use(jax.tree.leaves(nnx.state(model)), device)
    tokens = tokens_for_fraction(args.mem_fraction_static, device_bytes, used,
                                 per_device / probe, args.page_size, dp)
    print(f"pdjax KV pool: mem_fraction_static {args.mem_fraction_static} of "
          f"{device_bytes / 2**30:,.2f} GiB per device, {used / 2**30:,.3f} GiB of weights: "
          f"{tokens:,} tokens", flush=True)
    return tokens
