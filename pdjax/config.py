"""Frozen, validated configuration (DESIGN.md §1).

``ModelConfig`` is built from a Hugging Face ``config.json`` or from GGUF metadata. Every bad
value raises ``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

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
