"""Frozen, validated configuration of the MLA family: DeepSeek-V3, DeepSeek-V3.2 and GLM-5.

One dataclass covers the three Hugging Face architectures (the oracle is transformers 5.24's
``deepseek_v3``, ``deepseek_v32`` and ``glm_moe_dsa`` folders):

| architecture              | MLA RoPE          | indexer (DSA)                 | indexer RoPE       |
|---------------------------|-------------------|-------------------------------|--------------------|
| ``DeepseekV3ForCausalLM`` | ``rope_interleave`` | none (dense MLA)            | -                  |
| ``DeepseekV32ForCausalLM``| interleaved       | every layer ``"full"``        | rotate-half        |
| ``GlmMoeDsaForCausalLM``  | interleaved       | ``indexer_types`` full/shared | interleaved        |

A ``"shared"`` layer has no indexer: it reuses the top-k selection of the previous ``"full"``
layer (GLM-5). Every bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pdjax.model_config import (check_kernel_choice, check_positive_ints, check_rope_type,
                                hf_architecture, hf_bool, hf_common_fields, hf_float, hf_int,
                                hf_str_list, read_hf_config)
from pdjax.models.fp8 import FP8_BLOCK_SIZE, quantization_fields

DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
INDEXER_TYPES = ("none", "full", "shared")
MLP_TYPES = ("dense", "sparse")
_ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Static, hashable description of an MLA + MoE decoder (optionally with DSA).

    Shapes it implies: latent KV per token per layer ``kv_lora_rank + qk_rope_head_dim``;
    indexer key per token per ``"full"`` layer ``index_head_dim``. ``mlp_layer_types[i]`` is
    ``"dense"`` (SwiGLU of ``intermediate_size``) or ``"sparse"`` (MoE); ``indexer_types[i]`` is
    one of ``INDEXER_TYPES``. ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs.
    ``weight_block_size`` / ``scale_fmt`` / ``modules_to_not_convert``: the FP8 block-scaled
    weights of ``quantization_config`` (``models/fp8.quantization_fields``; 0: unquantized).
    ``ep_size`` / ``moe_tp_size`` / ``moe_a2a_backend``: the expert parallelism of a run
    (``moe_ep.expert_parallel_config``; ``ep_size`` 1: the experts split by width over TP).
    ``dp_size`` / ``attn_tp_size``: DP attention (``dp_attention.dp_attention_config``;
    ``dp_size`` 1: attention split by heads over TP). ``attention_impl`` /
    ``pallas_interpret``: the kernels of MLA attention, the indexer, the grouped GEMM and the
    FP8 GEMMs (as ``ModelConfig``'s: set by the loader from the platform profile).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_rope_interleave: bool = False
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0
    weight_block_size: int = 0                  # FP8 block-scaled weights (models/fp8.py); 0: none
    scale_fmt: str | None = None
    modules_to_not_convert: tuple[str, ...] = ()
    # Expert parallelism the model runs (models/moe_ep.py; set by expert_parallel_config, not
    # read from config.json): ep_size 1 is plain TP.
    ep_size: int = 1
    moe_tp_size: int = 1
    moe_a2a_backend: str = "none"
    # DP attention the model runs (models/dp_attention.py; set by dp_attention_config):
    # dp_size ranks of attn_tp_size devices each; dp_size 1 is attention under TP.
    dp_size: int = 1
    attn_tp_size: int = 1
    # The kernels the model runs (set by the loader, models/loader.py, from the platform
    # profile; None: the platform's default, ragged_paged_attention.resolve_impl).
    attention_impl: str | None = None
    pallas_interpret: bool = False

    def __post_init__(self):
        if self.architecture not in DEEPSEEK_ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not an MLA architecture; "
                             f"supported: {', '.join(DEEPSEEK_ARCHITECTURES)}")
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                   "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                   "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"))
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got "
                             f"{self.num_nextn_predict_layers!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if len(self.mlp_layer_types) != self.num_layers or any(
                t not in MLP_TYPES for t in self.mlp_layer_types):
            raise ValueError(f"mlp_layer_types must list {self.num_layers} entries from "
                             f"{MLP_TYPES}, got {self.mlp_layer_types!r}")
        if len(self.indexer_types) != self.num_layers or any(
                t not in INDEXER_TYPES for t in self.indexer_types):
            raise ValueError(f"indexer_types must list {self.num_layers} entries from "
                             f"{INDEXER_TYPES}, got {self.indexer_types!r}")
        if "sparse" in self.mlp_layer_types:
            check_positive_ints(self, ("moe_intermediate_size", "n_routed_experts",
                                       "num_experts_per_tok", "n_group", "topk_group"))
            if self.n_shared_experts < 0:
                raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts "
                                 f"({self.n_routed_experts})")
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ValueError("grouped routing scores each group by its top-2 experts: "
                                 f"n_routed_experts / n_group must be >= 2, got {per_group}")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                                 f"experts of topk_group ({self.topk_group}) groups")
        if self.has_indexer:
            check_positive_ints(self, ("index_topk", "index_head_dim", "index_n_heads"))
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(f"index_head_dim ({self.index_head_dim}) must be >= "
                                 f"qk_rope_head_dim ({self.qk_rope_head_dim})")
            first = next(t for t in self.indexer_types if t != "none")
            if first != "full":
                raise ValueError("indexer_types: the first indexed layer must be 'full' (a "
                                 "'shared' layer reuses the previous full layer's top-k)")
            if "none" in self.indexer_types:
                raise ValueError("indexer_types: mixing 'none' with indexed layers is not supported")
        check_rope_type(self.rope_scaling, _ROPE_TYPES)
        if self.weight_block_size not in (0, FP8_BLOCK_SIZE):
            raise ValueError(f"weight_block_size must be 0 (no FP8) or {FP8_BLOCK_SIZE}, got "
                             f"{self.weight_block_size!r}")
        check_kernel_choice(self)

    # ------------------------------------------------------------------ derived
    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def has_indexer(self) -> bool:
        return any(t != "none" for t in self.indexer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Layers that run their own indexer (and own a slice of the indexer key cache)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

    def mtp_layer_config(self) -> "DeepseekConfig":
        """The decoder layer of the multi-token prediction module (DeepSeek-V3 §2.2; HF layer
        index ``num_layers``) as a one-layer config: its MLP is of the last layer's kind
        (MoE for DeepSeek-V3 and GLM-5, whose dense layers are the first few), and with DSA it
        runs its own ``"full"`` indexer (there is no earlier layer whose top-k it could
        reuse). ``ValueError`` when the checkpoint has no MTP layer."""
        if self.num_nextn_predict_layers < 1:
            raise ValueError("speculative_algorithm 'mtp' needs a checkpoint with "
                             "num_nextn_predict_layers >= 1 in its config.json")
        return dataclasses.replace(
            self, num_layers=1, mlp_layer_types=self.mlp_layer_types[-1:],
            indexer_types=("full",) if self.has_indexer else ("none",),
            num_nextn_predict_layers=0)

    # Names shared with ``ModelConfig`` so generic code (runner, server) can read them.
    @property
    def num_q_heads(self) -> int:
        return self.num_heads

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "DeepseekConfig":
        """Build from a transformers ``config.json`` dict (``rope_parameters`` of transformers 5
        or the legacy ``rope_theta`` + ``rope_scaling``). Raises ``ValueError`` naming a
        missing or bad field."""
        arch = hf_architecture(cfg, source)
        try:
            num_layers = hf_int(cfg, "num_hidden_layers")
            mlp_types = hf_str_list(cfg, "mlp_layer_types")
            if mlp_types is None:
                # An explicit null is no dense layer (as before); a missing key DeepSeek-V3's 3.
                n_dense = min(hf_int(cfg, "first_k_dense_replace",
                                     0 if "first_k_dense_replace" in cfg else 3), num_layers)
                mlp_types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
            if arch == "DeepseekV3ForCausalLM":
                indexer_types = ["none"] * num_layers
            elif arch == "DeepseekV32ForCausalLM":
                indexer_types = ["full"] * num_layers
            else:
                indexer_types = _glm_indexer_types(cfg, num_layers)
            has_idx = arch != "DeepseekV3ForCausalLM"
            return cls(
                architecture=arch,
                vocab_size=hf_int(cfg, "vocab_size"),
                hidden_size=hf_int(cfg, "hidden_size"),
                intermediate_size=hf_int(cfg, "intermediate_size"),
                moe_intermediate_size=hf_int(cfg, "moe_intermediate_size", 0),
                num_layers=num_layers,
                num_heads=hf_int(cfg, "num_attention_heads"),
                q_lora_rank=_required_int(cfg, "q_lora_rank", source),
                kv_lora_rank=hf_int(cfg, "kv_lora_rank"),
                qk_nope_head_dim=hf_int(cfg, "qk_nope_head_dim"),
                qk_rope_head_dim=hf_int(cfg, "qk_rope_head_dim"),
                v_head_dim=hf_int(cfg, "v_head_dim"),
                n_routed_experts=hf_int(cfg, "n_routed_experts", 0),
                n_shared_experts=hf_int(cfg, "n_shared_experts", 0),
                num_experts_per_tok=hf_int(cfg, "num_experts_per_tok", 0),
                n_group=hf_int(cfg, "n_group", 1) or 1,
                topk_group=hf_int(cfg, "topk_group", 1) or 1,
                routed_scaling_factor=hf_float(cfg, "routed_scaling_factor", 1.0),
                norm_topk_prob=hf_bool(cfg, "norm_topk_prob", True),
                mlp_layer_types=tuple(mlp_types),
                indexer_types=tuple(indexer_types),
                index_topk=hf_int(cfg, "index_topk", 0) if has_idx else 0,
                index_head_dim=hf_int(cfg, "index_head_dim", 0) if has_idx else 0,
                index_n_heads=hf_int(cfg, "index_n_heads", 0) if has_idx else 0,
                indexer_rope_interleave=arch == "GlmMoeDsaForCausalLM",
                rope_interleave=(hf_bool(cfg, "rope_interleave", True)
                                 if arch == "DeepseekV3ForCausalLM" else True),
                attention_bias=hf_bool(cfg, "attention_bias", False),
                num_nextn_predict_layers=hf_int(cfg, "num_nextn_predict_layers", 0),
                **hf_common_fields(cfg),
                **quantization_fields(cfg),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if str(e).startswith(source):
                raise
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_hf_dir(cls, path: str) -> "DeepseekConfig":
        return cls.from_hf_dict(read_hf_config(path), source=os.path.join(path, "config.json"))


def _required_int(cfg: dict, name: str, source: str) -> int:
    if cfg.get(name) is None:
        raise ValueError(f"{source}: {name} is required (the q_lora-less MLA variant is not "
                         "supported)")
    return hf_int(cfg, name)


def _glm_indexer_types(cfg: dict, num_layers: int) -> list[str]:
    """GLM-5's per-layer indexer schedule, in transformers' order of precedence:
    ``indexer_types``, then ``index_topk_pattern`` (``"FSS..."``), then
    ``index_topk_freq`` / ``index_skip_topk_offset``."""
    types = hf_str_list(cfg, "indexer_types")
    if types is None:
        pattern = cfg.get("index_topk_pattern")
        if isinstance(pattern, str):
            if set(pattern) - set("FS"):
                raise ValueError(f"index_topk_pattern: expected letters F and S, got {pattern!r}")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif pattern is not None:
            types = hf_str_list(cfg, "index_topk_pattern")
        else:
            freq = max(hf_int(cfg, "index_topk_freq", 1), 1)
            offset = hf_int(cfg, "index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                     for i in range(num_layers)]
    return list(types)
