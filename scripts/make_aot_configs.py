#!/usr/bin/env python
"""Write the config.json files ``python -m pdjax.aot`` sizes models from (no weights, no hub).

    python scripts/make_aot_configs.py [OUT_DIR]      (default: pdjax/aot/configs)

Each folder holds one config.json written by transformers' own config class, so the fields are
the ones the real checkpoints carry: the DeepSeek-V3.2 and GLM-5 classes' defaults are those
models' published configs; Llama-3 and Qwen3 are given their published sizes here. The tiny
ones are ``scripts/make_tiny_checkpoint.py``'s test models (CI compiles them for TPU).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
               eos_token_id=128001,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192))
_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, head_dim=128, bos_token_id=151643, eos_token_id=151645)

# name -> (transformers config class, overrides)
REAL = {
    "llama-3-8b": ("LlamaConfig", dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=8)),
    "llama-3-70b": ("LlamaConfig", dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, num_attention_heads=64,
                                        num_key_value_heads=8)),
    "qwen3-8b": ("Qwen3Config", dict(_QWEN3, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32,
                                     num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen3-32b": ("Qwen3Config", dict(_QWEN3, hidden_size=5120, intermediate_size=25600,
                                      num_hidden_layers=64, num_attention_heads=64,
                                      num_key_value_heads=8, tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config", dict(max_position_embeddings=163840)),
    "deepseek-v3.2": ("DeepseekV32Config", {}),
    "glm-5": ("GlmMoeDsaConfig", {}),
}
TINY = {"tiny-llama": "llama", "tiny-qwen3": "qwen3", "tiny-deepseek-v3.2": "deepseek_v32",
        "tiny-glm-5": "glm_moe_dsa"}


def main() -> None:
    import transformers

    import make_tiny_checkpoint as tiny

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "pdjax", "aot", "configs"))
    out_root = parser.parse_args().out_dir
    configs = {name: (cls, kw) for name, (cls, kw) in REAL.items()}
    for name, tiny_name in TINY.items():
        configs[name] = tiny.config_kwargs(tiny_name)
    for name, (cls, kw) in configs.items():
        cfg = getattr(transformers, cls)(**kw)
        cfg.architectures = [cls.replace("Config", "ForCausalLM")]
        os.makedirs(os.path.join(out_root, name), exist_ok=True)
        cfg.to_json_file(os.path.join(out_root, name, "config.json"), use_diff=False)
        print(name, cls)


if __name__ == "__main__":
    main()
