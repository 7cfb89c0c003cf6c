"""The model registry: one table from architecture to model family, and no import circle
between the loader and the model families."""

import subprocess
import sys

import pytest

from pdjax.models import registry
from pdjax.models.deepseek import DeepseekForCausalLM
from pdjax.models.llama import LlamaForCausalLM


def test_every_architecture_has_its_family():
    expected = {
        "LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM, "DeepseekV3ForCausalLM": DeepseekForCausalLM,
        "DeepseekV32ForCausalLM": DeepseekForCausalLM, "GlmMoeDsaForCausalLM": DeepseekForCausalLM,
    }
    assert set(registry.supported_architectures()) == set(expected)
    for arch, cls in expected.items():
        assert registry.model_family(arch).model_class is cls


def test_unknown_architecture_lists_every_supported_one():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as e:
        registry.model_family("GPT2LMHeadModel")
    assert "GlmMoeDsaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_registering_a_taken_name_is_refused():
    llama = registry.model_family("LlamaForCausalLM")
    other = registry.ModelFamily(
        name="other", architectures=("MambaForCausalLM", "LlamaForCausalLM"),
        read_config=llama.read_config, stack_params=llama.stack_params,
        run_config=llama.run_config, adapt_params=llama.adapt_params,
        param_specs=llama.param_specs, model_class=llama.model_class)
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already registered"):
        registry.register_model_family(other)
    assert registry.model_family("LlamaForCausalLM") is llama
    assert "MambaForCausalLM" not in registry.supported_architectures()   # nothing half-done


@pytest.mark.parametrize("module", ["pdjax.models.deepseek", "pdjax.models.llama_weights",
                                    "pdjax.models.checkpoint", "pdjax.models.registry",
                                    "pdjax.models.orbax_checkpoint"])
@pytest.mark.slow      # starts a process
def test_model_families_do_not_import_the_loader(module):
    code = f"import sys, {module}; print('pdjax.models.loader' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
