"""Llama / Qwen2 / Qwen3 weights: HF-named tensors (from safetensors or GGUF, see
``checkpoint.py``) -> ``LlamaForCausalLM``'s stacked parameters (``"layers.wq" [L, H, QH*D]``,
...), and the KV-head replication a TP size larger than the KV head count needs. Every missing
or mis-shaped tensor raises ``ValueError`` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.model_config import ModelConfig
from pdjax.models.llama import layer_param_shapes

# HF per-layer tensor name -> (our stacked name, transpose?)
_HF_LAYER_NAMES = {
    "input_layernorm.weight": ("input_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("post_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def _expand_kv_heads(w: np.ndarray, num_kv_heads: int, repeat: int, head_dim: int, axis: int):
    """Repeat each KV head ``repeat`` times along ``axis`` (KV heads replicated across TP)."""
    shape = list(w.shape)
    w = w.reshape(shape[:axis] + [num_kv_heads, head_dim] + shape[axis + 1:])
    w = np.repeat(w, repeat, axis=axis)
    shape[axis] = num_kv_heads * repeat * head_dim
    return w.reshape(shape)


def tp_model_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The config the sharded model runs: KV heads replicated up to ``tp_size`` when fewer.

    Raises ``ValueError`` when heads or the MLP width do not split over ``tp_size``.
    """
    if cfg.num_q_heads % tp_size:
        raise ValueError(f"tp_size: {tp_size} must divide num_attention_heads ({cfg.num_q_heads})")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tp_size: {tp_size} must divide intermediate_size ({cfg.intermediate_size})")
    if cfg.num_kv_heads % tp_size == 0:
        return cfg
    if tp_size % cfg.num_kv_heads:
        raise ValueError(f"tp_size: {tp_size} must divide or be a multiple of "
                         f"num_key_value_heads ({cfg.num_kv_heads})")
    return dataclasses.replace(cfg, num_kv_heads=tp_size)


def stack_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray],
                     source: str) -> dict[str, np.ndarray]:
    """HF-named tensors -> our parameter paths (``"layers.wq"`` stacked ``[L, ...]``) of
    ``cfg`` itself (no KV-head replication: see ``replicate_kv_heads``)."""

    def get(name):
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name!r}")
        return tensors[name]

    out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight").T
    shapes = layer_param_shapes(cfg)
    wanted = {ours: (hf, tr) for hf, (ours, tr) in _HF_LAYER_NAMES.items() if ours in shapes}
    for ours, (hf, transpose) in wanted.items():
        per_layer = []
        for i in range(cfg.num_layers):
            w = get(f"model.layers.{i}.{hf}")
            w = w.T if transpose else w
            if w.shape != shapes[ours][0]:
                raise ValueError(f"{source}: tensor model.layers.{i}.{hf} has shape {w.shape}, "
                                 f"expected {shapes[ours][0]}")
            per_layer.append(w)
        out[f"layers.{ours}"] = np.stack(per_layer)
    for key, expect in (("embed_tokens", (cfg.vocab_size, cfg.hidden_size)),
                        ("norm", (cfg.hidden_size,))):
        if out[key].shape != expect:
            raise ValueError(f"{source}: tensor {key} has shape {out[key].shape}, expected {expect}")
    return out


def replicate_kv_heads(params: dict[str, np.ndarray], cfg: ModelConfig,
                       run_cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Stacked params of ``cfg`` -> those of ``run_cfg`` (``tp_model_config``): each KV head of
    ``layers.wk/wv [L, H, KVH*D]`` and ``layers.bk/bv [L, KVH*D]`` repeated
    ``run_cfg.num_kv_heads // cfg.num_kv_heads`` times. Returns ``params`` itself when the
    two configs agree."""
    repeat = run_cfg.num_kv_heads // cfg.num_kv_heads
    if repeat == 1:
        return params
    out = dict(params)
    for name in ("layers.wk", "layers.wv", "layers.bk", "layers.bv"):
        if name in out:
            w = np.asarray(out[name])
            out[name] = _expand_kv_heads(w, cfg.num_kv_heads, repeat, cfg.head_dim, axis=w.ndim - 1)
    return out
