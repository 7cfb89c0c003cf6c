"""Model registry: Hugging Face architecture name -> the model family that serves it.

    "LlamaForCausalLM"  ─┐
    "Qwen2ForCausalLM"   ├─> family "llama"    -> LlamaForCausalLM     (llama.py, llama_weights.py)
    "Qwen3ForCausalLM"  ─┘
    "DeepseekV3ForCausalLM"  ─┐
    "DeepseekV32ForCausalLM"  ├─> family "deepseek" -> DeepseekForCausalLM (deepseek.py,
    "GlmMoeDsaForCausalLM"   ─┘                          deepseek_weights.py)

A ``ModelFamily`` is the whole recipe the generic loader (``loader.py``) and the Orbax
checkpoints (``orbax_checkpoint.py``) follow, so neither branches on architecture names and no
family module imports the loader:

    config.json ──read_config──> cfg ──run_config(cfg, tp)──> run_cfg
    HF tensors ──stack_params──> params of cfg ──adapt_params──> params of run_cfg
    model_class(run_cfg) placed with param_specs(run_cfg, tp)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

from pdjax.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, read_hf_config
from pdjax.models import deepseek, deepseek_weights, dp_attention, llama, llama_weights
from pdjax.models.deepseek_config import DEEPSEEK_ARCHITECTURES, DeepseekConfig
from pdjax.models.fp8 import quantization_fields
from pdjax.pallas_kernels.ragged_paged_attention import TRACED_BOUND_IMPLS

Params = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """How to build one family of models.

    Attributes:
      name: short family name (``"llama"``, ``"deepseek"``).
      architectures: the HF ``architectures[0]`` names it serves.
      read_config: HF folder -> config (``ValueError`` naming the bad config.json field).
      stack_params: ``(cfg, HF-named float32 tensors, source)`` -> stacked params of ``cfg``.
      run_config: ``(cfg, tp_size)`` -> the config the sharded model runs (``ValueError`` when
        ``tp_size`` does not split it).
      adapt_params: ``(params of cfg, cfg, run_cfg)`` -> params of ``run_cfg``.
      param_specs: ``(run_cfg, tp_size)`` -> partition spec of every parameter path.
      model_class: the NNX module, ``model_class(run_cfg, dtype=..., rngs=..., **kwargs)``.
      expert_parallel: ``(cfg, tp_size, ep_size, moe_a2a_backend)`` -> the run config with
        the routed experts split over ``ep_size`` (``--ep-size``); None: no routed experts.
      dp_attention: ``(cfg, tp_size, dp_size)`` -> the run config with attention run
        data-parallel over ``dp_size`` ranks (``--enable-dp-attention --dp-size``;
        ``dp_attention.py``); None: the family cannot.
      stacked_layers: the family stacks its layers and fuses its linear weights (the platform
        profile's ``layer_stack``: CPU unrolling and the packed matmul).
      cache_spec: ``(run_cfg, num_pages, page_size, dtype, row_align)`` -> the paged KV
        buffers a model of ``run_cfg`` holds (sized at parse time, before any model exists).
      fp8_kv_impls: the ``attention_impl`` values that read the family's FP8 KV cache (None:
        every one).
      traced_pages_bound_impls: the ``attention_impl`` values whose attention bounds a
        sequence's pages by a traced value, so one pages-per-sequence bucket serves every
        length (``make_buckets``); the Pallas kernels take a few.
    """

    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[str], Any]
    stack_params: Callable[[Any, Params, str], Params]
    run_config: Callable[[Any, int], Any]
    adapt_params: Callable[[Params, Any, Any], Params]
    param_specs: Callable[[Any, int], dict]
    model_class: type
    expert_parallel: Callable[[Any, int, int, str], Any] | None = None
    dp_attention: Callable[[Any, int, int], Any] | None = None
    cache_spec: Callable[..., tuple] | None = None
    stacked_layers: bool = False
    fp8_kv_impls: tuple[str, ...] | None = None
    traced_pages_bound_impls: tuple[str, ...] = ()


_REGISTRY: dict[str, ModelFamily] = {}


def register_model_family(family: ModelFamily) -> None:
    """Serve ``family.architectures`` with ``family``; ``ValueError`` when a name already
    belongs to another family."""
    for arch in family.architectures:
        if _REGISTRY.get(arch, family) is not family:
            raise ValueError(f"architecture {arch!r} is already registered "
                             f"(family {_REGISTRY[arch].name!r})")
    for arch in family.architectures:
        _REGISTRY[arch] = family


def model_family(architecture: str) -> ModelFamily:
    """The family of ``architecture``; ``ValueError`` listing the supported names otherwise."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture: {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}") from None


def supported_architectures() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _llama_read_config(path: str) -> ModelConfig:
    """``ModelConfig.from_hf_dir``, refusing a ``quantization_config`` (the Llama family loads
    unquantized weights only): ``ValueError`` naming config.json and the field."""
    cfg = ModelConfig.from_hf_dir(path)
    if read_hf_config(path).get("quantization_config") is not None:
        source = os.path.join(path, "config.json")
        try:
            quantization_fields(read_hf_config(path))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        raise ValueError(f"{source}: quantization_config: FP8 weights are supported for "
                         f"{', '.join(DEEPSEEK_ARCHITECTURES)} only")
    return cfg


def _deepseek_cache_spec(cfg: DeepseekConfig, num_pages: int, page_size: int, dtype,
                         row_align: int = 1) -> tuple:
    return deepseek.deepseek_cache_spec(cfg, num_pages=num_pages, page_size=page_size,
                                        dtype=dtype, row_align=row_align)


def _deepseek_run_config(cfg: DeepseekConfig, tp_size: int) -> DeepseekConfig:
    deepseek_weights.check_tp(cfg, tp_size)
    return cfg


register_model_family(ModelFamily(
    name="llama", architectures=SUPPORTED_ARCHITECTURES, read_config=_llama_read_config,
    stack_params=llama_weights.stack_hf_tensors, run_config=llama_weights.tp_model_config,
    adapt_params=llama_weights.replicate_kv_heads, param_specs=llama.param_partition_specs,
    model_class=llama.LlamaForCausalLM, cache_spec=llama.llama_cache_spec, stacked_layers=True,
    # Their cost follows kv_lens, not the page table's width (sched/buckets.py).
    traced_pages_bound_impls=TRACED_BOUND_IMPLS,
    # The TPU kernel has no layout for the per-token FP8 scales yet (DESIGN.md §5).
    fp8_kv_impls=("reference", "xla", "cpu", "gpu")))
register_model_family(ModelFamily(
    name="deepseek", architectures=DEEPSEEK_ARCHITECTURES, read_config=DeepseekConfig.from_hf_dir,
    stack_params=deepseek_weights.stack_hf_tensors, run_config=_deepseek_run_config,
    adapt_params=deepseek_weights.expert_parallel_params,
    param_specs=deepseek_weights.param_partition_specs,
    model_class=deepseek.DeepseekForCausalLM, cache_spec=_deepseek_cache_spec,
    # The indexer scores every position of the page table (cost grows with the page table's
    # width): no attention path lets one pages-per-sequence bucket serve every batch.
    expert_parallel=deepseek_weights.expert_parallel_run_config,
    dp_attention=dp_attention.dp_attention_config))
