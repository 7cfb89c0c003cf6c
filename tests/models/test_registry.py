"""The model registry: one table from architecture to model family, and no import circle
between the loader and the model families."""

import dataclasses
import inspect
import subprocess
import sys

import pytest

from pdjax.models import attention, deepseek, dp_attention, llama, moe, moe_ep, registry
from pdjax.models.deepseek import DeepseekForCausalLM
from pdjax.models.llama import LlamaForCausalLM
from pdjax.models.loader import load_model


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


@pytest.mark.parametrize("name", ["llama", "deepseek_v32"])
def test_the_run_config_carries_the_kernel_choice(tiny_checkpoints, name):
    """The kernels are a run choice of the config every layer already receives: the loader
    sets them (from the platform profile), the model holds that config, bad values are
    named."""
    cfg, model = load_model(tiny_checkpoints[name], dtype="float32", progress=False,
                            attention_impl="reference", pallas_interpret=True)
    assert (cfg.attention_impl, cfg.pallas_interpret) == ("reference", True)
    assert model.cfg == cfg
    default, _ = load_model(tiny_checkpoints[name], dtype="float32", progress=False)
    assert (default.attention_impl, default.pallas_interpret) == (None, False)
    assert dataclasses.replace(cfg, attention_impl=None, pallas_interpret=False) == default
    with pytest.raises(ValueError, match="^attention_impl: must be None or a kernel name"):
        dataclasses.replace(cfg, attention_impl=3)
    with pytest.raises(ValueError, match="^pallas_interpret: must be true or false"):
        dataclasses.replace(cfg, pallas_interpret="yes")


def test_no_layer_function_takes_a_kernel_argument():
    """No function or model method of the layer modules takes ``impl`` / ``interpret`` /
    ``attention_impl``: they read the config. Only the private adapters that call the
    grouped GEMM kernel (its own API) pass a resolved ``impl`` on."""
    kernel_adapters = {"pdjax.models.moe._gmm", "pdjax.models.moe._grouped_swiglu_kernel"}
    found = []
    for module in (attention, deepseek, dp_attention, llama, moe, moe_ep):
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            fns = ([obj] if inspect.isfunction(obj) else
                   [f for f in vars(obj).values() if inspect.isfunction(f)]
                   if inspect.isclass(obj) else [])
            for fn in fns:
                name = f"{module.__name__}.{fn.__qualname__}"
                params = set(inspect.signature(fn).parameters)
                if params & {"impl", "interpret", "attention_impl"} and \
                        name not in kernel_adapters:
                    found.append(name)
    assert found == []


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
