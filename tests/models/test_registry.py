"""The model registry: one table from architecture to family loader, and no import circle
between the loader and the model families."""

import subprocess
import sys

import pytest

from pdjax.models import registry
from pdjax.models.deepseek import load_deepseek_model
from pdjax.models.llama_weights import load_llama_model


def test_every_architecture_has_its_family_loader():
    expected = {
        "LlamaForCausalLM": load_llama_model, "Qwen2ForCausalLM": load_llama_model,
        "Qwen3ForCausalLM": load_llama_model, "DeepseekV3ForCausalLM": load_deepseek_model,
        "DeepseekV32ForCausalLM": load_deepseek_model, "GlmMoeDsaForCausalLM": load_deepseek_model,
    }
    assert set(registry.supported_architectures()) == set(expected)
    for arch, loader in expected.items():
        assert registry.model_loader(arch) is loader


def test_unknown_architecture_lists_every_supported_one():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as e:
        registry.model_loader("GPT2LMHeadModel")
    assert "GlmMoeDsaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already registered"):
        registry.register_model(["LlamaForCausalLM"], load_deepseek_model)
    assert registry.model_loader("LlamaForCausalLM") is load_llama_model


@pytest.mark.parametrize("module", ["pdjax.models.deepseek", "pdjax.models.llama_weights",
                                    "pdjax.models.checkpoint"])
def test_model_families_do_not_import_the_loader(module):
    code = f"import sys, {module}; print('pdjax.models.loader' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
