"""A model's configuration as pdjax reads it (DESIGN.md §1): ``ModelConfig`` (the Llama family)
built from a Hugging Face ``config.json`` or GGUF metadata, and the typed readers of
``config.json`` fields the families share (``hf_int``, ``hf_float``, ...; every bad value is a
``ValueError`` naming the field). Pure Python."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _freeze(d: dict | None):
    """A dict as a sorted tuple of ``(key, value)`` pairs (hashable); ``None`` when empty."""
    return None if not d else tuple(sorted(d.items()))


def check_positive_ints(obj, names) -> None:
    """``ValueError`` naming the first field of ``names`` that is not an integer >= 1 (a bool
    is not one)."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")


# The numbers each RoPE scaling reads (``models/layers.rope_inv_freq``).
_ROPE_REQUIRED = {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings")}
_ROPE_OPTIONAL = ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")


def check_rope_type(rope_scaling: tuple | None, allowed: tuple[str, ...]) -> None:
    """``ValueError`` unless the ``rope_type`` of ``rope_scaling`` (sorted ``(key, value)``
    pairs; ``None`` or no ``rope_type`` is ``"default"``) is one of ``allowed`` and every
    number that type reads is there and a number (``rope_scaling.factor: ...``)."""
    params = dict(rope_scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type not in allowed:
        raise ValueError(f"rope_scaling.rope_type: must be one of {allowed}, got {rope_type!r}")
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if params.get(key) is None:
            raise ValueError(f"rope_scaling.{key}: required by rope_type {rope_type!r}")
    for key in _ROPE_REQUIRED.get(rope_type, ()) + _ROPE_OPTIONAL:
        v = params.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"rope_scaling.{key}: expected a number, got {v!r}")


def check_kernel_choice(obj) -> None:
    """``ValueError`` naming the field unless ``obj.attention_impl`` is None (the platform's
    default) or a kernel name, and ``obj.pallas_interpret`` a bool: the kernel choice a model
    config carries (``ModelConfig``, ``DeepseekConfig``; the names are checked where they
    resolve, ``ragged_paged_attention.resolve_impl``)."""
    impl = obj.attention_impl
    if impl is not None and (not isinstance(impl, str) or not impl):
        raise ValueError(f"attention_impl: must be None or a kernel name, got {impl!r}")
    if not isinstance(obj.pallas_interpret, bool):
        raise ValueError(f"pallas_interpret: must be true or false, got {obj.pallas_interpret!r}")


def hf_architecture(cfg: dict[str, Any], source: str) -> str:
    """The first of ``architectures`` in a transformers ``config.json`` dict; ``ValueError``
    naming ``source`` when the list is missing or empty."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{source}: missing 'architectures'")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError(f"{source}: architectures: expected a list of names, got {archs!r}")
    return archs[0]


def read_hf_config(path: str) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder as a dict; raises ``ValueError`` when missing or
    malformed."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{cfg_path}: file not found")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{cfg_path}: malformed JSON ({e})") from None
    except OSError as e:              # unreadable (permissions, an I/O error)
        raise ValueError(f"{cfg_path}: cannot read ({e.strerror})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: a JSON object of settings, got a JSON "
                         f"{type(cfg).__name__}")
    return cfg


_REQUIRED = object()


def _int_value(key: str, v) -> int:
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        raise ValueError(f"{key}: expected an integer, got {v!r}")
    return int(v)


def hf_int(cfg: dict[str, Any], key: str, default=_REQUIRED) -> int:
    """``cfg[key]`` of a ``config.json`` dict as an int (a JSON integer, or a float with an
    integral value such as ``4096.0``); ``default`` when it is missing or null. Raises
    ``KeyError(key)`` when it is missing without a default, ``ValueError`` ``"KEY: expected
    an integer, got V"`` for any other value (a string, a bool, ``3.5``)."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    return _int_value(key, v)


def hf_float(cfg: dict[str, Any], key: str, default: float) -> float:
    """``cfg[key]`` as a float (a JSON number), ``default`` when missing or null; ``ValueError``
    ``"KEY: expected a number, got V"`` otherwise."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key}: expected a number, got {v!r}")
    return float(v)


def hf_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """``cfg[key]`` as a bool (JSON ``true``/``false``), ``default`` when missing or null;
    ``ValueError`` ``"KEY: expected true or false, got V"`` otherwise (``"false"`` is not
    taken for true)."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key}: expected true or false, got {v!r}")
    return v


def hf_str_list(cfg: dict[str, Any], key: str) -> list[str] | None:
    """``cfg[key]`` as a list of strings, None when missing or null; ``ValueError`` otherwise."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise ValueError(f"{key}: expected a list of strings, got {v!r}")
    return v


def hf_common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of a transformers ``config.json`` that every supported architecture reads the
    same way, under the names of ``ModelConfig`` and ``DeepseekConfig``: RoPE (transformers 5
    ``rope_parameters``, or the legacy ``rope_theta`` + ``rope_scaling`` with ``type``; plain
    RoPE is ``rope_scaling=None``), norm epsilon, context, tied embeddings, BOS/EOS, activation.
    Raises ``KeyError`` for a missing field and ``ValueError`` naming the field of a value of
    the wrong type (``hf_int``, ``hf_float``, ``hf_bool``; the callers name the file).
    """
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key}: expected an object, got {rope!r}")
    rope = dict(rope)
    theta = hf_float(rope, "rope_theta", hf_float(cfg, "rope_theta", 10000.0))
    rope.pop("rope_theta", None)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("partial_rotary_factor", None)
    if rope.get("rope_type", "default") == "default":
        rope = {}
    if any(isinstance(v, (dict, list)) for v in rope.values()):
        raise ValueError(f"{key}: expected an object of numbers, got {cfg[key]!r}")
    eos = cfg.get("eos_token_id")
    eos = (tuple(_int_value("eos_token_id", e) for e in eos) if isinstance(eos, list)
           else (() if eos is None else (_int_value("eos_token_id", eos),)))
    return dict(
        rms_norm_eps=hf_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=_freeze(rope),
        max_position_embeddings=hf_int(cfg, "max_position_embeddings", 4096),
        tie_word_embeddings=hf_bool(cfg, "tie_word_embeddings", False),
        bos_token_id=hf_int(cfg, "bos_token_id", None),
        eos_token_ids=eos,
        hidden_act=cfg.get("hidden_act", "silu"),
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static, hashable description of a decoder-only transformer (GQA family).

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable) with ``rope_type``
    one of ``ROPE_TYPES``; ``None`` means plain RoPE. ``attention_impl`` / ``pallas_interpret``:
    the kernels the model runs, a run choice (not read from ``config.json``): the loader sets
    them from the platform profile (``models/platform.py``); None is the platform's default.
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
    attention_impl: str | None = None
    pallas_interpret: bool = False

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size",
                                   "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                                   "max_position_embeddings"))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads: {self.num_q_heads} must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: must be 'silu', got {self.hidden_act!r}")
        check_rope_type(self.rope_scaling, ROPE_TYPES)
        check_kernel_choice(self)

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a transformers ``config.json`` dict (transformers 4 or 5 field names).

        Raises ``ValueError`` starting with ``source`` and naming the field that is missing,
        of the wrong type (``hidden_size: expected an integer, got 'big'``) or out of range."""
        arch = hf_architecture(cfg, source)
        try:
            hidden = hf_int(cfg, "hidden_size")
            heads = hf_int(cfg, "num_attention_heads")
            return cls(
                architecture=arch,
                vocab_size=hf_int(cfg, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=hf_int(cfg, "intermediate_size"),
                num_layers=hf_int(cfg, "num_hidden_layers"),
                num_q_heads=heads,
                num_kv_heads=hf_int(cfg, "num_key_value_heads", 0) or heads,
                head_dim=hf_int(cfg, "head_dim", 0) or (hidden // heads if heads > 0 else 0),
                attention_bias=(arch == "Qwen2ForCausalLM"
                                or hf_bool(cfg, "attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                **hf_common_fields(cfg),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        return cls.from_hf_dict(read_hf_config(path), source=os.path.join(path, "config.json"))

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
