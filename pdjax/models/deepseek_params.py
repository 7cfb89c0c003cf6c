"""The parameter layout of the DeepSeek family (DeepSeek-V3 / V3.2, GLM-5): the stacked groups
(attention over every layer, dense MLPs, MoE, indexers), their shapes and TP specs, which of
them are FP8 with block scales, and the NNX module that holds one group."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import FP8_DTYPE, SCALE_SUFFIX, num_blocks
from pdjax.models.linear import Fp8BlockWeight

ParamShapes = dict[str, tuple[tuple[int, ...], P]]


def param_groups(cfg: DeepseekConfig) -> dict[str, tuple[int, ParamShapes]]:
    """Stacked parameter groups: name -> (stack length, per-entry shapes and TP specs).

    Heads, MLP widths and expert widths are split over the mesh axis ``"tp"``; the latent
    projections, the router and the indexer are replicated (the latent cache is shared by all
    heads, so every rank keeps it whole). With ``cfg.ep_size > 1`` the routed experts are
    split by expert instead (``moe_ep.py``: ``[moe_tp_size * E, ...]`` stacks over ``"tp"``).
    With ``cfg.dp_size > 1`` (DP attention, ``dp_attention.py``) the attention weights are
    replicated on every device, and with the ``ragged`` backend the shared experts too.
    """
    Hd, H, C, R = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn: ParamShapes = {
        "input_norm": ((Hd,), P()),
        "w_qa": ((Hd, cfg.q_lora_rank), P()),
        "q_a_norm": ((cfg.q_lora_rank,), P()),
        "w_qb": ((cfg.q_lora_rank, H * cfg.qk_head_dim), P(None, "tp")),
        "w_kva": ((Hd, C + R), P()),
        "kv_a_norm": ((C,), P()),
        "w_uk": ((H, cfg.qk_nope_head_dim, C), P("tp", None, None)),
        "w_uv": ((H, C, cfg.v_head_dim), P("tp", None, None)),
        "w_o": ((H * cfg.v_head_dim, Hd), P("tp", None)),
        "post_norm": ((Hd,), P()),
    }
    if cfg.attention_bias:
        attn.update(b_qa=((cfg.q_lora_rank,), P()), b_kva=((C + R,), P()), b_o=((Hd,), P()))
    if cfg.dp_size > 1:       # DP attention: every rank runs whole attention (dp_attention.py)
        attn = {name: (shape, P()) for name, (shape, _) in attn.items()}
    F, Fm = cfg.intermediate_size, cfg.moe_intermediate_size
    dense: ParamShapes = {
        "w_gate": ((Hd, F), P(None, "tp")),
        "w_up": ((Hd, F), P(None, "tp")),
        "w_down": ((F, Hd), P("tp", None)),
    }
    E = cfg.n_routed_experts
    moe: ParamShapes = {
        "router": ((Hd, E), P()),
        "router_bias": ((E,), P()),
        "w_gate": ((E, Hd, Fm), P(None, None, "tp")),
        "w_up": ((E, Hd, Fm), P(None, None, "tp")),
        "w_down": ((E, Fm, Hd), P(None, "tp", None)),
    }
    if cfg.ep_size > 1:       # EP: split by expert (entry t * E + e: expert e's slice t)
        S, Fs = cfg.moe_tp_size * E, Fm // cfg.moe_tp_size
        moe.update(w_gate=((S, Hd, Fs), P("tp", None, None)),
                   w_up=((S, Hd, Fs), P("tp", None, None)),
                   w_down=((S, Fs, Hd), P("tp", None, None)))
    if cfg.n_shared_experts:
        Fs = Fm * cfg.n_shared_experts
        moe.update(sh_gate=((Hd, Fs), P(None, "tp")), sh_up=((Hd, Fs), P(None, "tp")),
                   sh_down=((Fs, Hd), P("tp", None)))
        if cfg.dp_size > 1 and cfg.moe_a2a_backend == "ragged":
            # each device runs them on its own tokens (moe_ep.moe_forward_dp_ragged)
            moe.update({n: (shape, P()) for n, (shape, _) in moe.items()
                        if n.startswith("sh_")})
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    indexer: ParamShapes = {
        "wq_b": ((cfg.q_lora_rank, Hi * Di), P()),
        "wk": ((Hd, Di), P()),
        "k_norm_w": ((Di,), P()),
        "k_norm_b": ((Di,), P()),
        "w_weights": ((Hd, Hi), P()),
    }
    groups = {"attn": (cfg.num_layers, attn), "dense": (len(cfg.dense_layers), dense),
              "moe": (len(cfg.moe_layers), moe),
              "indexer": (len(cfg.full_indexer_layers), indexer)}
    for group, name in fp8_params(cfg):
        shape, spec = groups[group][1][name]
        scale = (*shape[:-2], num_blocks(shape[-2], cfg.weight_block_size),
                 num_blocks(shape[-1], cfg.weight_block_size))
        groups[group][1][name + SCALE_SUFFIX] = (scale, spec)
    return {k: v for k, v in groups.items() if v[0] > 0}


# The linear weights FP8 checkpoints quantize -> their HF module under ``model.layers.{i}.``
# (``{e}``: the expert). kv_b_proj is quantized too, but it is split into the absorbed
# ``w_uk`` / ``w_uv`` and dequantized once on the host (as SGLang's w_kc / w_vc); norms, the
# router, the indexer's weights_proj, embeddings and the LM head are not quantized.
FP8_MODULES: dict[tuple[str, str], str] = {
    ("attn", "w_qa"): "self_attn.q_a_proj", ("attn", "w_qb"): "self_attn.q_b_proj",
    ("attn", "w_kva"): "self_attn.kv_a_proj_with_mqa", ("attn", "w_o"): "self_attn.o_proj",
    ("dense", "w_gate"): "mlp.gate_proj", ("dense", "w_up"): "mlp.up_proj",
    ("dense", "w_down"): "mlp.down_proj",
    ("moe", "w_gate"): "mlp.experts.{e}.gate_proj", ("moe", "w_up"): "mlp.experts.{e}.up_proj",
    ("moe", "w_down"): "mlp.experts.{e}.down_proj",
    ("moe", "sh_gate"): "mlp.shared_experts.gate_proj",
    ("moe", "sh_up"): "mlp.shared_experts.up_proj",
    ("moe", "sh_down"): "mlp.shared_experts.down_proj",
    ("indexer", "wq_b"): "self_attn.indexer.wq_b", ("indexer", "wk"): "self_attn.indexer.wk",
}


def _group_layers(cfg: DeepseekConfig, group: str) -> tuple[int, ...]:
    return {"attn": tuple(range(cfg.num_layers)), "dense": cfg.dense_layers,
            "moe": cfg.moe_layers, "indexer": cfg.full_indexer_layers}[group]


def fp8_params(cfg: DeepseekConfig) -> set[tuple[str, str]]:
    """The ``(group, name)`` parameters held as ``Fp8BlockWeight`` (float8 + ``name`` +
    ``SCALE_SUFFIX`` block scales): none without ``weight_block_size``; else every
    ``FP8_MODULES`` entry of a group the model has, less those ``modules_to_not_convert``
    names (substrings of the module name, as transformers matches them). ``ValueError`` when
    it leaves a weight unquantized in some layers only (one format per stacked parameter)."""
    if not cfg.weight_block_size:
        return set()
    out = set()
    for (group, name), module in FP8_MODULES.items():
        layers = _group_layers(cfg, group)
        if not layers or (group == "moe" and name.startswith("sh_") and not cfg.n_shared_experts):
            continue
        skipped = [any(m in f"model.layers.{i}.{module.format(e=0)}"
                       for m in cfg.modules_to_not_convert) for i in layers]
        if any(skipped) and not all(skipped):
            raise ValueError(f"quantization_config.modules_to_not_convert: {module} is left "
                             "unquantized in some layers only; pdjax needs one format per "
                             "weight across layers")
        if not any(skipped):
            out.add((group, name))
    return out


# Kept in float32 whatever the model dtype (transformers' _keep_in_fp32_modules).
_FP32_PARAMS = {("moe", "router"), ("moe", "router_bias"), ("indexer", "w_weights")}


class _Stack(nnx.Module):
    """One parameter group, every entry stacked ``[n, ...]``."""

    def __init__(self, group: str, n: int, shapes: ParamShapes, *, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        for name, (shape, _) in shapes.items():
            dt = jnp.float32 if (group, name) in _FP32_PARAMS else dtype
            full = (n, *shape)
            if name + SCALE_SUFFIX in shapes:           # FP8 values (made in float32, cast)
                value = init(rngs.params(), full, jnp.float32).astype(FP8_DTYPE)
            elif name.endswith(SCALE_SUFFIX):
                value = jnp.ones(full, jnp.float32)
            elif name.endswith("norm") or name == "k_norm_w":
                value = jnp.ones(full, dt)
            elif name in ("router_bias", "k_norm_b") or name.startswith("b_"):
                value = jnp.zeros(full, dt)
            else:
                value = init(rngs.params(), full, dt)
            setattr(self, name, nnx.Param(value))

    def values(self, shapes: ParamShapes) -> dict:
        """name -> stacked array, or ``Fp8BlockWeight`` pairing an FP8 weight with its
        ``SCALE_SUFFIX`` scales (the scales get no entry of their own)."""
        out = {}
        for name in shapes:
            if name.endswith(SCALE_SUFFIX):
                continue
            value = getattr(self, name)[...]
            if name + SCALE_SUFFIX in shapes:
                value = Fp8BlockWeight(value, getattr(self, name + SCALE_SUFFIX)[...])
            out[name] = value
        return out
