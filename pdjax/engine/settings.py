"""The one factory that turns ``ServerArgs`` into what the engine runs with: every "auto" and
every default that depends on the platform or the checkpoint is resolved here, and the
scheduler's ``SchedulerConfig`` is built here (DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from pdjax.config import ServerArgs
from pdjax.models.checkpoint import check_weight_files
from pdjax.models.loader import (checkpoint_config, is_gguf, is_orbax_checkpoint, resolve_dtype,
                                 resolve_model_path, run_config)
from pdjax.models.registry import model_family
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
    all end after one token). ``model_cfg``: the checkpoint's config as written
    (``checkpoint_config``).
    """

    args: ServerArgs
    model_path: str
    dtype: Any
    kv_dtype: Any
    profile: PlatformProfile
    scheduler: SchedulerConfig
    overlap: bool
    model_cfg: Any = None

    @property
    def attention_impl(self) -> str:
        return self.profile.attention_impl

    @property
    def unroll_layers(self) -> bool:
        return self.profile.unroll_layers

    @property
    def cpu_matmul_kernel(self) -> bool:
        return self.profile.cpu_matmul_kernel


def check_checkpoint_paths(args: ServerArgs) -> tuple[str, Any]:
    """Read the config of every checkpoint ``args`` names (metadata only: no tensor, no jax
    device), so that a path that is no checkpoint (a file that is neither a folder nor a
    ``.gguf``, a folder without a readable config.json, an unsupported architecture, a
    corrupt GGUF header) is one error line before the server loads anything; with them, what
    speculation needs of them (an MTP layer; a draft model of the target's vocabulary).

    Returns ``(path, config)`` of ``model_path`` (resolved; ``checkpoint_config``). Raises
    ``ValueError`` naming the field (``model_path``, ``speculative_draft_model_path``,
    ``tokenizer_path``)."""
    paths = {"model_path": args.model_path}
    if args.speculative_draft_model_path:
        paths["speculative_draft_model_path"] = args.speculative_draft_model_path
    read = {}
    for field, path in paths.items():
        try:
            resolved = resolve_model_path(path, args.revision)
            read[field] = resolved, checkpoint_config(resolved)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
    if args.tokenizer_path is not None and not os.path.exists(args.tokenizer_path):
        raise ValueError(f"tokenizer_path: {args.tokenizer_path}: not found")
    path, cfg = read["model_path"]
    if args.speculative_algorithm == "mtp" and getattr(cfg, "num_nextn_predict_layers", 0) < 1:
        raise ValueError(f"speculative_algorithm: 'mtp' needs a DeepSeek-V3 / V3.2 / GLM-5 "
                         f"checkpoint with num_nextn_predict_layers >= 1; {path} has none")
    if "speculative_draft_model_path" in read:
        draft = read["speculative_draft_model_path"][1]
        if draft.vocab_size != cfg.vocab_size:
            raise ValueError(f"speculative_draft_model_path: the draft model's vocabulary "
                             f"({draft.vocab_size}) differs from the target's ({cfg.vocab_size})")
    return path, cfg


def check_serve_files(args: ServerArgs, model_path: str) -> None:
    """What a server reads after the model's config, checked at parse time without loading it
    (``model_path``: resolved): the weight files of every checkpoint with ``load_format``
    ``auto`` (``check_weight_files``), the tokenizer (``check_tokenizer``; node 0's),
    ``aot_executables`` and the HiCache ``file`` store's folder (made if missing, written
    once). Raises ``ValueError`` naming the field."""
    if args.load_format == "auto":
        paths = {"model_path": model_path}
        if args.speculative_draft_model_path:
            paths["speculative_draft_model_path"] = resolve_model_path(
                args.speculative_draft_model_path, args.revision)
        for field, path in paths.items():
            try:
                check_weight_files(path)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
    if args.node_rank == 0:         # a multi-host follower loads no tokenizer
        check_tokenizer(args, model_path)
    check_aot_executables(args)
    if args.hicache_storage_backend == "file":
        from pdjax.kv.hicache_config import parse_storage_config
        from pdjax.paths import writable_folder

        cfg = parse_storage_config("file", args.hicache_storage_backend_extra_config)
        writable_folder("hicache_storage_backend_extra_config", cfg["path"])


def check_local_devices(args: ServerArgs, model_cfg) -> None:
    """The settings resolved for this process's JAX platform (``resolve_engine_config``: an
    attention backend or weight layout it has no kernel for) and ``check_devices`` against its
    devices (starts the backend: a multi-host node joins first): their count and the first
    one's memory (``model_runner.device_memory_bytes``)."""
    from pdjax.runner import model_runner

    resolve_engine_config(args, model_cfg=model_cfg)
    check_devices(args, model_cfg, platform=jax.default_backend(),
                  num_devices=jax.device_count(),
                  device_bytes=model_runner.device_memory_bytes(jax.local_devices()[0]))


def check_tokenizer(args: ServerArgs, model_path: str) -> None:
    """Check the tokenizer the server will load (``--tokenizer-path``, else the checkpoint at
    ``model_path``, already resolved) without transformers: a folder's ``tokenizer.json``
    parses as one (``tokenizers``), its ``tokenizer_config.json`` is a JSON object, or it
    holds a slow tokenizer's files; a GGUF file carries its own. Raises ``ValueError`` naming
    the field (``tokenizer_path`` or ``model_path``) and the file: a broken tokenizer was a
    transformers traceback after the model had loaded."""
    field, path = (("tokenizer_path", args.tokenizer_path) if args.tokenizer_path
                   else ("model_path", model_path))
    if is_gguf(path) or is_orbax_checkpoint(path):
        return                  # the GGUF reader / pdjax.convert own these
    if not os.path.isdir(path):
        raise ValueError(f"{field}: {path}: a tokenizer folder (or a .gguf file), got a file")
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{field}: {config}: cannot read ({e})") from None
    fast = os.path.join(path, "tokenizer.json")
    if os.path.isfile(fast):
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(fast)
        except Exception as e:   # tokenizers raises its own Exception for any bad file
            raise ValueError(f"{field}: {fast}: not a tokenizer ({' '.join(str(e).split())})") \
                from None
        return
    if not any(all(os.path.isfile(os.path.join(path, f)) for f in files)
               for files in _SLOW_TOKENIZER_FILES):
        raise ValueError(f"{field}: {path}: no tokenizer (tokenizer.json, tokenizer.model, or "
                         "vocab.json and merges.txt)")


# The files of a slow tokenizer transformers converts: sentencepiece, byte-level BPE, WordPiece.
_SLOW_TOKENIZER_FILES = (("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


def check_aot_executables(args: ServerArgs) -> None:
    """``ValueError`` naming ``aot_executables`` when it is set and is no folder written by
    ``python -m pdjax.aot --serialize`` (no readable manifest); whether its executables match
    this server's devices is known only later, and logged then."""
    if args.aot_executables is not None:
        from pdjax.runner.executables import read_manifest

        read_manifest(args.aot_executables)


def check_devices(args: ServerArgs, model_cfg, *, platform: str, num_devices: int | None,
                  device_bytes: int | None) -> None:
    """Refuse what the devices cannot serve, from the settings and the checkpoint's config
    alone (nothing built or allocated), so that it is one error line at parse time:

    - ``tp_size`` over ``num_devices`` (None: not known here, e.g. multi-host before joining),
      or one that does not split the model's heads / MLP (the family's ``run_config``), or
      an ``ep_size`` that does not split its routed experts (``loader.run_config``);
    - one device's memory (``device_bytes``; None: not checked) below the weights, the KV pool
      and the buffers of the largest bucket (``runner.step_memory``, lower bounds), naming
      ``max_total_tokens``, ``max_running_requests`` or the setting that sizes a forward's
      tokens (``chunked_prefill_size``, ``max_num_batched_tokens``).

    ``model_cfg``: the checkpoint's config as written (``checkpoint_config``); ``platform``:
    ``"cpu"``, ``"gpu"`` or ``"tpu"``. Raises ``ValueError`` naming the field."""
    if num_devices is not None and not 1 <= args.tp_size <= num_devices:
        raise ValueError(f"tp_size: must be in [1, {num_devices}] (devices available), got "
                         f"{args.tp_size}")
    check_dp_attention_settings(args, platform)
    family = model_family(model_cfg.architecture)
    run_cfg = run_config(family, model_cfg, args.tp_size, args.ep_size, args.moe_a2a_backend,
                         args.dp_size)
    if device_bytes is None:
        return
    from pdjax.pallas_kernels.lanes import kv_row_align
    from pdjax.runner import step_memory
    from pdjax.runner.model_runner import check_pool_bytes

    tp, cache = args.tp_size, args.cache
    dtype = jnp.dtype(resolve_dtype(args.dtype, platform))
    kv_dtype = dtype if cache.kv_cache_dtype == "auto" else _KV_DTYPES[cache.kv_cache_dtype]
    # DP attention: a rank's pool per device (dp_attention.dp_cache_specs)
    specs = family.cache_spec(run_cfg, args.num_pages // args.dp_size, args.page_size,
                              kv_dtype, kv_row_align(platform))
    pool = sum(s.num_layers * s.bytes_per_page_layer * s.num_pages
               // (tp if "tp" in tuple(s.partition) else 1) for s in specs)
    weights = step_memory.weight_bytes(model_cfg, tp, dtype.itemsize)
    if cache.mem_fraction_static is not None:
        # The pool is sized after the weights load (engine/kv_budget.py); refuse here, from
        # the config's weights (a lower bound), a fraction that cannot hold its few pages.
        from pdjax.engine.kv_budget import tokens_for_fraction
        tokens_for_fraction(cache.mem_fraction_static, device_bytes, weights,
                            pool / args.num_pages, args.page_size, args.dp_size)
        return
    check_pool_bytes(pool, args.num_pages, args.page_size, device_bytes)
    rows = args.max_running_requests
    if args.max_num_batched_tokens is not None:
        token_field = "max_num_batched_tokens"
    else:
        token_field = "chunked_prefill_size"
    tokens = getattr(args, token_field)
    if rows >= tokens:          # the largest decode batch is the largest forward
        token_field, tokens = "max_running_requests", rows
    need = step_memory.StepMemory(
        weights=weights, kv_pool=pool,
        rows=step_memory.row_bytes(model_cfg.vocab_size, rows, tp),
        tokens=step_memory.token_bytes(run_cfg, tokens, tp, dtype.itemsize))
    step_memory.check_step_fits(need, device_bytes, max_rows=rows, max_tokens=tokens,
                                token_field=token_field, token_value=getattr(args, token_field))


def check_dp_attention_settings(args: ServerArgs, platform: str | None = None) -> None:
    """``ValueError`` naming the field that DP attention (``dp_size > 1``) is not built
    with yet: draft-model speculative decoding on a PD role (n-gram and MTP are built on
    both roles, colocated every algorithm), a PD role over the ``jax`` transfer
    backend (``auto`` on ``platform`` TPU), the staging path or several hosts, the
    hierarchical cache, the CPU matmul kernel, or a pool of fewer than 2 pages a rank
    (``max_total_tokens``)."""
    dp = args.dp_size
    if dp == 1:
        return
    spec = args.speculative_algorithm
    built = {"colocated": ("ngram", "draft", "mtp"), "decode": ("ngram", "mtp"),
             "prefill": ("ngram", "mtp")}
    if spec is not None and spec not in built.get(args.role, ()):
        # n-gram drafts from the tokens alone; MTP's hidden states travel in mtp_hidden,
        # page-sharded as the latent, so its pages go to / from the rank's shard alike
        # (kv_copies.py); a draft model on a PD role with DP attention is untested
        raise ValueError(f"speculative_algorithm: {spec!r} is not built for a {args.role} "
                         f"with DP attention yet (dp_size {dp}); a PD role with DP "
                         f"attention takes 'ngram' and 'mtp', colocated every algorithm")
    if args.role in ("prefill", "decode"):
        # PD: pages read / written by address in the rank's shards (kv_export, DESIGN §4)
        role = args.role
        backend = args.disaggregation_transfer_backend
        if backend == "auto" and platform is not None:
            backend = "jax" if platform == "tpu" else "mooncake"
        if backend == "jax":
            raise ValueError(f"disaggregation_transfer_backend: {backend!r} is not built for "
                             f"a {role} with DP attention (dp_size {dp}); use mooncake")
        if args.disaggregation_transfer_path == "staging":
            raise ValueError(f"disaggregation_transfer_path: 'staging' is not built for a "
                             f"{role} with DP attention (dp_size {dp}): its pool is "
                             f"page-sharded; use direct")
        if args.nnodes > 1:
            raise ValueError(f"nnodes: a {role} with DP attention (dp_size {dp}) over "
                             f"{args.nnodes} hosts is not built yet")
    if args.cache.enable_hierarchical_cache:
        raise ValueError("enable_hierarchical_cache: not built for DP attention yet")
    if args.cpu_matmul_kernel:
        raise ValueError("cpu_matmul_kernel: the Llama family's; DP attention is MLA's")
    if args.num_pages // dp < 2:
        raise ValueError(f"max_total_tokens: {args.max_total_tokens} tokens give each of the "
                         f"{dp} DP attention ranks fewer than 2 pages of {args.page_size}")


def resolve_engine_config(args: ServerArgs, platform: str | None = None, *,
                          model_cfg=None) -> EngineConfig:
    """Resolve ``args`` (reads the checkpoint's config from its metadata, no tensor) for
    ``platform`` (``"cpu"``, ``"tpu"``, ``"gpu"``; default: the default backend's; the
    abstract engine of ``pdjax.aot`` passes its target's). ``model_cfg``: the checkpoint's
    config when already read (``check_checkpoint_paths``).

    Raises ``ValueError`` for a checkpoint that cannot be read or an attention backend the
    platform has no kernel for."""
    platform = platform or jax.default_backend()
    check_dp_attention_settings(args, platform)
    model_path = resolve_model_path(args.model_path, args.revision)
    model_cfg = model_cfg if model_cfg is not None else checkpoint_config(model_path)
    dtype = resolve_dtype(args.dtype, platform)
    family = model_family(model_cfg.architecture)
    profile = PlatformProfile.resolve(
        platform, attention_backend=args.attention_backend, unroll_layers=args.unroll_layers,
        cpu_matmul_kernel=args.cpu_matmul_kernel, tp_size=args.tp_size, dtype=dtype,
        layer_stack=family.stacked_layers)
    fp8_impls = family.fp8_kv_impls
    if args.cache.kv_cache_dtype == "fp8_e4m3" and fp8_impls is not None \
            and profile.attention_impl not in fp8_impls:
        if args.attention_backend not in (None, "auto"):
            raise ValueError(f"attention_backend: {profile.attention_impl!r} does not read an "
                             f"FP8 KV cache of {model_cfg.architecture} (kv_cache_dtype "
                             f"fp8_e4m3): use one of {', '.join(fp8_impls)}")
        profile = dataclasses.replace(profile, attention_impl="xla")
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
        max_num_batched_tokens=sched.max_num_batched_tokens, target_itl_ms=sched.target_itl_ms,
        num_reserved_decode_tokens=(args.disaggregation.num_reserved_decode_tokens
                                    if args.role == "decode" else 0),
        dp_size=args.dp_size)
    kv_dtype = dtype if cache.kv_cache_dtype == "auto" else _KV_DTYPES[cache.kv_cache_dtype]
    if platform == "cpu" and jnp.dtype(kv_dtype).itemsize < 4:
        # XLA:CPU writes a 16- or 8-bit float buffer by copying it whole (a scatter or a
        # dynamic-update-slice into a 64M-entry bf16 / fp8 array: about 110-150 ms; float32 and
        # uint8: 0.01 ms), so every step copies the KV pool: a format check here, not a speed.
        logger.warning("kv_cache_dtype %s on CPU: XLA:CPU copies a %s KV pool on every write "
                       "(each step costs time proportional to --max-total-tokens); use float32 "
                       "KV for speed on CPU, %s on TPU / GPU", jnp.dtype(kv_dtype).name,
                       jnp.dtype(kv_dtype).name, jnp.dtype(kv_dtype).name)
    return EngineConfig(
        args=args, model_path=model_path, dtype=dtype, kv_dtype=kv_dtype,
        profile=profile, scheduler=scheduler,
        overlap=not sched.disable_overlap_schedule and args.role != "prefill", model_cfg=model_cfg)


def make_buckets(args: ServerArgs, context_length: int, attention_impl: str,
                 family) -> Buckets:
    """The engine's shape buckets (DESIGN.md §2) for requests of up to ``context_length``
    tokens: the jnp attention paths (``family.traced_pages_bound_impls``) need one
    pages-per-sequence bucket, the Pallas kernels a few. ``family``: the ``ModelFamily``."""
    return Buckets.create(
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        max_pages_per_seq=-(-context_length // args.page_size),
        max_num_batched_tokens=args.max_num_batched_tokens,
        traced_pages_bound=attention_impl in family.traced_pages_bound_impls)
