"""Model registry: Hugging Face architecture name -> the function that loads that family.

    "LlamaForCausalLM"  ─┐
    "Qwen2ForCausalLM"   ├─> llama_weights.load_llama_model  -> LlamaForCausalLM
    "Qwen3ForCausalLM"  ─┘
    "DeepseekV3ForCausalLM"  ─┐
    "DeepseekV32ForCausalLM"  ├─> deepseek.load_deepseek_model -> DeepseekForCausalLM
    "GlmMoeDsaForCausalLM"   ─┘

A family module registers nothing itself and imports nothing above ``checkpoint.py``; this
table is the one place that knows every family (so ``loader.py`` never branches on names).
"""

from __future__ import annotations

from typing import Callable

from pdjax.config import SUPPORTED_ARCHITECTURES
from pdjax.models.deepseek import load_deepseek_model
from pdjax.models.deepseek_config import DEEPSEEK_ARCHITECTURES
from pdjax.models.llama_weights import load_llama_model

# load(path, *, dtype, mesh, progress, **model_kwargs) -> (run_cfg, model)
ModelLoader = Callable[..., tuple]

_REGISTRY: dict[str, ModelLoader] = {}


def register_model(architectures, loader: ModelLoader) -> None:
    """Make ``loader`` the loader of every name in ``architectures``; ``ValueError`` when a
    name already has another loader."""
    for arch in architectures:
        if _REGISTRY.get(arch, loader) is not loader:
            raise ValueError(f"architecture {arch!r} is already registered")
        _REGISTRY[arch] = loader


def model_loader(architecture: str) -> ModelLoader:
    """The loader of ``architecture``; ``ValueError`` listing the supported names otherwise."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}") from None


def supported_architectures() -> tuple[str, ...]:
    return tuple(_REGISTRY)


register_model(SUPPORTED_ARCHITECTURES, load_llama_model)
register_model(DEEPSEEK_ARCHITECTURES, load_deepseek_model)
