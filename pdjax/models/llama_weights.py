"""Llama / Qwen2 / Qwen3 weights: HF-named tensors (from safetensors or GGUF, see
``checkpoint.py``) -> ``LlamaForCausalLM``'s stacked parameters, placed on the mesh with their
TP partition specs. Every missing or mis-shaped tensor raises ``ValueError`` naming the file
and the tensor.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pdjax.config import ModelConfig
from pdjax.models.checkpoint import (is_gguf, make_mesh, read_gguf, read_hf_tensors,
                                     resolve_dtype, resolve_model_path)
from pdjax.models.llama import LlamaForCausalLM, layer_param_shapes, param_partition_specs
from pdjax.models.params import place_params

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
        raise ValueError(f"tp_size ({tp_size}) must divide num_attention_heads ({cfg.num_q_heads})")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide intermediate_size ({cfg.intermediate_size})")
    if cfg.num_kv_heads % tp_size == 0:
        return cfg
    if tp_size % cfg.num_kv_heads:
        raise ValueError(f"tp_size ({tp_size}) must divide or be a multiple of "
                         f"num_key_value_heads ({cfg.num_kv_heads})")
    return dataclasses.replace(cfg, num_kv_heads=tp_size)


def stack_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], run_cfg: ModelConfig,
                     source: str) -> dict[str, np.ndarray]:
    """HF-named tensors -> our parameter paths (``"layers.wq"`` stacked ``[L, ...]``)."""

    def get(name):
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name!r}")
        return tensors[name]

    out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight").T
    repeat = run_cfg.num_kv_heads // cfg.num_kv_heads
    shapes = layer_param_shapes(run_cfg)
    wanted = {ours: (hf, tr) for hf, (ours, tr) in _HF_LAYER_NAMES.items() if ours in shapes}
    for ours, (hf, transpose) in wanted.items():
        per_layer = []
        for i in range(cfg.num_layers):
            w = get(f"model.layers.{i}.{hf}")
            w = w.T if transpose else w
            if repeat > 1 and ours in ("wk", "wv", "bk", "bv"):
                w = _expand_kv_heads(w, cfg.num_kv_heads, repeat, cfg.head_dim, axis=w.ndim - 1)
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


def build_model(cfg: ModelConfig, params: dict[str, np.ndarray], mesh: Mesh, dtype,
                **model_kwargs) -> LlamaForCausalLM:
    """Place ``params`` on ``mesh`` with their partition specs and wrap them in the module."""
    specs = param_partition_specs(cfg, mesh.shape["tp"])
    return place_params(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), **model_kwargs),
                        params, specs, mesh)


def load_checkpoint(model_path: str | None, progress: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray], str]:
    """Config and HF-named float32 tensors of a checkpoint; returns ``(cfg, tensors, source)``."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        cfg, tensors = read_gguf(path, progress)
        return cfg, tensors, path
    if not os.path.isdir(path):
        raise ValueError(f"{path}: model path is neither a directory nor a .gguf file")
    cfg = ModelConfig.from_hf_dir(path)
    return cfg, read_hf_tensors(path, progress), path


def load_llama_model(path: str, *, dtype="auto", mesh: Mesh | None = None,
                     progress: bool = True, **model_kwargs) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Load a Llama-family checkpoint (HF folder or GGUF file) onto ``mesh`` (default: one
    device). Returns ``(run_cfg, model)``; ``run_cfg`` may differ from the checkpoint's config
    in ``num_kv_heads`` when TP replicates KV heads (see ``tp_model_config``)."""
    mesh = mesh if mesh is not None else make_mesh(1)
    cfg, tensors, source = load_checkpoint(path, progress)
    run_cfg = tp_model_config(cfg, mesh.shape["tp"])
    params = stack_hf_tensors(cfg, tensors, run_cfg, source)
    return run_cfg, build_model(run_cfg, params, mesh, resolve_dtype(dtype), **model_kwargs)
