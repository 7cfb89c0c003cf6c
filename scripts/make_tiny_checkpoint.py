#!/usr/bin/env python
"""Write tiny random Hugging Face checkpoints (config.json + safetensors + tokenizer) for tests.

Each checkpoint is made by transformers itself (``from_config`` + ``save_pretrained``), so it is
an independent oracle for pdjax's models. A small byte-level BPE tokenizer (vocab 512, ChatML
template) is trained with the ``tokenizers`` library and saved beside each model.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--only NAME] [--only NAME ...]

Writes OUT_DIR/NAME/ for every NAME in ``CONFIGS``; existing complete folders are kept.

transformers' DeepSeek-V3 family makes no multi-token prediction (MTP) layer, so for the
checkpoints in ``MTP_CHECKPOINTS`` this script adds one itself (``add_mtp_layer``): random
tensors of layer ``num_hidden_layers`` under the HF names (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, the decoder layer's names), in a second file ``model-mtp.safetensors``
beside the untouched ``model.safetensors``, an index JSON naming both, and
``num_nextn_predict_layers: 1`` in config.json. A folder made before this is upgraded in
place (its other tensors keep their bytes).

The checkpoints in ``FP8_CHECKPOINTS`` are then rewritten as FP8 checkpoints ship
(``quantize_checkpoint``): every linear weight that DeepSeek-V3.2 / GLM-5 quantize is float8
e4m3 with a float32 ``weight_scale_inv`` per 128 x 128 block (dims of 192 make partial edge
blocks), the other tensors bfloat16, ``quantization_config`` in config.json.
``write_dequantized`` writes their float32 twin (config without ``quantization_config``),
transformers' oracle on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)

# MLA family (DeepSeek-V3 / V3.2 / GLM-5); MLA needs as many KV heads as heads in transformers.
_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=128, mscale=1.0,
                                 mscale_all_dim=0.8, beta_fast=32, beta_slow=1))
_DSA = dict(index_topk=32, index_head_dim=32, index_n_heads=4)
_DSA_LONG = dict(index_topk=16, index_head_dim=32, index_n_heads=16)
_GLM_TYPES = ["full", "shared", "full"]
# FP8 MLA: hidden and q_lora 192 (a 128-block and a partial 64 one); the widths TP splits
# (heads x head dims, intermediate sizes) are 256 so TP 2 shards hold whole 128-blocks.
_MLA_FP8 = dict(_MLA, hidden_size=192, intermediate_size=256, moe_intermediate_size=256,
                q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
                head_dim=64)

# name -> (transformers config class name, overrides, save kwargs)
CONFIGS: dict[str, tuple[str, dict, dict]] = {
    # GQA 4/2, untied, llama3 rope scaling, weights split in shards with an index JSON.
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0,
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position_embeddings=64)),
              dict(max_shard_size="100KB")),
    # MHA-ish tied embeddings, plain rope; 3 layers; fewer KV heads (1) than test TP sizes.
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1,
                   num_hidden_layers=3, rope_theta=10000.0), {}),
    # qkv bias, tied, yarn rope scaling.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0,
              rope_scaling=dict(rope_type="yarn", factor=4.0,
                                original_max_position_embeddings=128)), {}),
    # q/k norm, untied, head_dim != hidden/heads.
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32,
              rope_theta=1000000.0), {}),
    # MLA + MoE: 3 layers (1 dense, 2 MoE), 8 experts in 4 groups (top-2 groups, top-2
    # experts), a shared expert, interleaved MLA RoPE with DeepSeek-style YaRN.
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA), {}),
    # DSA with 4 indexer heads: parity only on prompts shorter than index_topk (ties at 0).
    "deepseek_v32": ("DeepseekV32Config", dict(_MLA, **_DSA), {}),
    # DSA with 16 indexer heads and a small index_topk: long prompts exercise top-k.
    "deepseek_v32_long": ("DeepseekV32Config", dict(_MLA, **_DSA_LONG), {}),
    # GLM-5: interleaved indexer RoPE, layer 1 reuses layer 0's top-k ("shared").
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(_MLA, **_DSA, indexer_types=_GLM_TYPES), {}),
    "glm_moe_dsa_long": ("GlmMoeDsaConfig", dict(_MLA, **_DSA_LONG, indexer_types=_GLM_TYPES),
                         {}),
    # FP8 block-scaled (FP8_CHECKPOINTS): DeepSeek-V3.2 with ue8m0 scales, GLM-5 with float ones.
    "deepseek_v32_fp8": ("DeepseekV32Config", dict(_MLA_FP8, **_DSA), {}),
    "glm_moe_dsa_fp8": ("GlmMoeDsaConfig", dict(_MLA_FP8, **_DSA, indexer_types=_GLM_TYPES), {}),
}

# FP8 checkpoints -> scale_fmt (None: any float32 scale; "ue8m0": powers of two).
FP8_CHECKPOINTS: dict[str, str | None] = {"deepseek_v32_fp8": "ue8m0", "glm_moe_dsa_fp8": None}
# The weights FP8 DeepSeek-V3.2 / GLM-5 checkpoints quantize (everything else stays bf16).
_FP8_WEIGHT = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|"
                         r"up_proj|down_proj|indexer\.wq_b|indexer\.wk)\.weight$")

# Checkpoints that get an MTP layer -> whether it stores its own copies of the embedding and
# the LM head (DeepSeek-V3's files do; both equal the main model's) or none (shared).
MTP_CHECKPOINTS: dict[str, bool] = {"deepseek_v32": True, "glm_moe_dsa": False}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little robot who liked to count pages of memory.",
    "Prefill computes the prompt; decode generates one token at a time.",
    "Hello world! Bonjour le monde. Hola mundo. 你好，世界。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: <>{}[]()!?.,;:'\"",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def config_kwargs(name: str) -> tuple[str, dict]:
    """``(transformers config class name, keyword arguments)`` of checkpoint ``name``."""
    cls_name, overrides, _ = CONFIGS[name]
    return cls_name, {**_COMMON, **overrides}


def make_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_checkpoint(name: str, out_root: str, seed: int = 0) -> str:
    import torch
    import transformers

    cls_name, overrides, save_kwargs = CONFIGS[name]
    out_dir = os.path.join(out_root, name)
    done = os.path.join(out_dir, "DONE")
    if os.path.exists(done):
        with open(done) as f:
            marker = json.load(f)
        if name in MTP_CHECKPOINTS and not marker.get("mtp"):
            add_mtp_layer(out_dir, own_copies=MTP_CHECKPOINTS[name], seed=seed)
            with open(done, "w") as f:
                json.dump({**marker, "mtp": 1}, f)
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Random init uses std 0.02: scale up so logits are far from uniform (a real oracle).
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(4.0)
        # MoE routing bias (zeros at init): random, so that the correction is exercised.
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.2)
    model.save_pretrained(out_dir, **save_kwargs)
    make_tokenizer(out_dir)
    if name in FP8_CHECKPOINTS:
        quantize_checkpoint(out_dir, FP8_CHECKPOINTS[name])
    marker = {"name": name}
    if name in MTP_CHECKPOINTS:
        add_mtp_layer(out_dir, own_copies=MTP_CHECKPOINTS[name], seed=seed)
        marker["mtp"] = 1
    with open(done, "w") as f:
        json.dump(marker, f)
    return out_dir


def add_mtp_layer(out_dir: str, *, own_copies: bool, seed: int = 0) -> None:
    """Add a random MTP layer (HF layer index ``N = num_hidden_layers``) to the single-file
    checkpoint in ``out_dir``: the decoder layer has the tensors (and shapes) of layer
    ``N - 1``, drawn anew; ``enorm`` / ``hnorm`` / ``shared_head.norm`` are ``1 + 0.2 n`` (not
    ones, so a swapped norm shows), ``eh_proj`` is ``[Hd, 2 Hd]``. ``own_copies``: also store
    ``embed_tokens`` and ``shared_head.head`` (copies of the main model's). Deterministic in
    ``seed``; ``model.safetensors`` is not rewritten."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    n, hd = cfg["num_hidden_layers"], cfg["hidden_size"]
    main = load_file(os.path.join(out_dir, "model.safetensors"))
    rng = np.random.default_rng(1000 + seed)
    prev, pre = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {}
    for key in sorted(main):
        if not key.startswith(prev):
            continue
        shape = main[key].shape
        if key.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif key.endswith("bias"):
            value = 0.2 * rng.random(shape)
        else:
            value = 0.08 * rng.standard_normal(shape)
        mtp[pre + key[len(prev):]] = value.astype(np.float32)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[pre + name] = (1.0 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    mtp[pre + "eh_proj.weight"] = (0.08 * rng.standard_normal((hd, 2 * hd))).astype(np.float32)
    if own_copies:
        mtp[pre + "embed_tokens.weight"] = main["model.embed_tokens.weight"].copy()
        mtp[pre + "shared_head.head.weight"] = main["lm_head.weight"].copy()
    save_file(mtp, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model.safetensors" for k in main}
    weight_map.update({k: "model-mtp.safetensors" for k in mtp})
    total = sum(v.nbytes for v in main.values()) + sum(v.nbytes for v in mtp.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


_ST_NAMES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}


def write_safetensors(file: str, tensors: dict) -> None:
    """Write numpy ``tensors`` (float32, ``ml_dtypes`` bfloat16 or float8_e4m3fn) as one
    safetensors file: 8-byte little-endian header length, JSON header, data (written here
    because ``safetensors.numpy`` has no float8)."""
    import numpy as np

    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        blob = a.tobytes()
        header[name] = {"dtype": _ST_NAMES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def quantize_checkpoint(out_dir: str, scale_fmt: str | None) -> None:
    """Rewrite the float32 single-file checkpoint in ``out_dir`` as an FP8 block-scaled one:
    each ``_FP8_WEIGHT`` tensor float8 e4m3 + ``weight_scale_inv`` float32 ``[ceil(out/128),
    ceil(in/128)]`` (``pdjax.models.fp8.quantize``; powers of two with ``ue8m0``), the other
    tensors bfloat16 (the router's correction bias float32), and ``quantization_config`` in
    config.json."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file

    from pdjax.models.fp8 import quantize

    file = os.path.join(out_dir, "model.safetensors")
    out = {}
    for key, value in load_file(file).items():
        if _FP8_WEIGHT.search(key) and value.ndim == 2:
            out[key], out[key + "_scale_inv"] = quantize(value, ue8m0=scale_fmt == "ue8m0")
        elif key.endswith("e_score_correction_bias"):
            out[key] = value.astype(np.float32)
        else:
            out[key] = value.astype(ml_dtypes.bfloat16)
    write_safetensors(file, out)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    if scale_fmt:
        cfg["quantization_config"]["scale_fmt"] = scale_fmt
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def write_dequantized(src: str, dst: str) -> str:
    """The float32 twin of the FP8 checkpoint ``src`` in ``dst`` (every FP8 weight times its
    block scales, other tensors widened; config.json without ``quantization_config``), for
    transformers to load as the oracle. Returns ``dst``."""
    import numpy as np
    from safetensors.numpy import save_file

    from pdjax.models.checkpoint import read_safetensors_lazy
    from pdjax.models.fp8 import FP8_DTYPE, dequantize

    os.makedirs(dst, exist_ok=True)
    tensors = read_safetensors_lazy(os.path.join(src, "model.safetensors"))
    out = {}
    for key, value in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        out[key] = (dequantize(value, tensors[key + "_scale_inv"]) if value.dtype == FP8_DTYPE
                    else np.asarray(value, np.float32))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return dst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    # one name per --only (repeat it): a list option would swallow OUT_DIR after it
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS), default=None,
                        metavar="NAME", help="make only this checkpoint (repeatable)")
    args = parser.parse_args(argv)
    for name in args.only or sorted(CONFIGS):
        print(make_checkpoint(name, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
