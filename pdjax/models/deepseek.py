"""DeepSeek-V3 (MLA + MoE), DeepSeek-V3.2 and GLM-5 (DSA) as one Flax NNX module over a
paged latent cache.

Attention is multi-head latent attention (DeepSeek-V2 §2.1) in its absorbed form for every
token (prefill and decode alike): ``W_UK`` is folded into the query and ``W_UV`` applied after
attention, so the cache holds one row per token per layer,

    latent[layer, page, slot] = [rms_norm(c_kv) (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim)]

and every head attends to it (``pallas_kernels.mla_sparse_attention``). With DSA the lightning
indexer (``pallas_kernels.indexer``) scores the cached tokens with its own key cache
``indexer_k[full_layer, page, slot] = rope(layer_norm(x @ wk))`` and MLA attends only to the
top ``index_topk``; a GLM ``"shared"`` layer reuses the previous full layer's selection.

Layer parameters are stacked: attention over all ``L`` layers, dense MLPs over the dense
layers, MoE over the sparse layers, indexers over the full-indexer layers. The forward is one
``lax.scan`` per run of consecutive layers with the same MLP kind (DeepSeek: a few dense
layers, then MoE), carrying the hidden state, the cache dict and the last top-k selection;
the body indexes the stacks with the layer's slot.

Shapes: ``T`` tokens of the flat stream, ``Hd`` hidden, ``H`` heads, ``C`` kv_lora_rank,
``R`` qk_rope_head_dim, ``N`` qk_nope_head_dim, ``Vd`` v_head_dim, ``E`` routed experts,
``Hi``/``Di`` indexer heads/width. Linear weights are stored ``[in, out]``.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pdjax.models.attention import AttentionMetadata
from pdjax.models.cache_spec import CacheBufferSpec
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import (FP8_DTYPE, SCALE_SUFFIX, LazyStack, check_ue8m0, dequantize,
                              num_blocks)
from pdjax.models.layers import apply_rope, rms_norm, rope_inv_freq
from pdjax.models.linear import Fp8BlockWeight, dense_weight, linear
from pdjax.pallas_kernels.indexer import indexer_scores, topk_positions
from pdjax.pallas_kernels.lanes import aligned_width, pad_last_dim
from pdjax.pallas_kernels.mla_sparse_attention import mla_sparse_attention

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not the config's
INDEXER_NORM_EPS = 1e-6    # the indexer's key LayerNorm

ParamShapes = dict[str, tuple[tuple[int, ...], P]]


# --------------------------------------------------------------------------- parameter layout

def param_groups(cfg: DeepseekConfig) -> dict[str, tuple[int, ParamShapes]]:
    """Stacked parameter groups: name -> (stack length, per-entry shapes and TP specs).

    Heads, MLP widths and expert widths are split over the mesh axis ``"tp"``; the latent
    projections, the router and the indexer are replicated (the latent cache is shared by all
    heads, so every rank keeps it whole).
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
    if cfg.n_shared_experts:
        Fs = Fm * cfg.n_shared_experts
        moe.update(sh_gate=((Hd, Fs), P(None, "tp")), sh_up=((Hd, Fs), P(None, "tp")),
                   sh_down=((Fs, Hd), P("tp", None)))
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


# --------------------------------------------------------------------------- building blocks

def _rope_interleaved(x, positions, inv_freq, scale):
    """DeepSeek's interleaved RoPE: pairs ``(x0, x1), (x2, x3) ...`` share a frequency. The
    result is laid out de-interleaved (evens then odds), exactly as transformers'
    ``apply_rotary_pos_emb_interleave``; q and k get the same layout, so dot products agree."""
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, inv_freq, scale)


def _layer_norm(x, weight, bias, eps):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _swiglu(h, w_gate, w_up, w_down):
    return linear(jax.nn.silu(linear(h, w_gate)) * linear(h, w_up), w_down)


def route(cfg: DeepseekConfig, h: jax.Array, router: jax.Array, router_bias: jax.Array):
    """DeepSeek-V3 grouped top-k routing (noaux_tc).

    Sigmoid scores; the bias-corrected scores pick ``topk_group`` groups (each scored by the sum
    of its top-2 experts) and then ``num_experts_per_tok`` experts inside them; the weights are
    the uncorrected scores of the chosen experts, normalized when ``norm_topk_prob``, times
    ``routed_scaling_factor``.

    Returns ``(experts [T, k] int32, weights [T, k] float32)``.
    """
    E, G = cfg.n_routed_experts, cfg.n_group
    logits = h.astype(jnp.float32) @ router.astype(jnp.float32)                 # [T, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + router_bias.astype(jnp.float32)
    if G > 1:
        grouped = choice.reshape(-1, G, E // G)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                      # [T, G]
        _, groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jax.nn.one_hot(groups, G, dtype=jnp.bool_).any(axis=1)           # [T, G]
        keep = jnp.repeat(keep, E // G, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def moe_forward(cfg: DeepseekConfig, h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Routed experts (grouped matmul with ``lax.ragged_dot`` over token copies sorted by
    expert) plus the shared experts. ``h [T, Hd]`` -> ``[T, Hd]``."""
    T, Hd = h.shape
    k = cfg.num_experts_per_tok
    experts, weights = route(cfg, h, p["router"], p["router_bias"])
    flat = experts.reshape(-1)                                                   # [T*k]
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.zeros((cfg.n_routed_experts,), jnp.int32).at[flat].add(1)
    xs = h[token]                                                                # [T*k, Hd]
    # FP8 experts: the reference path dequantizes this layer's expert stack first.
    gate = jax.lax.ragged_dot(xs, dense_weight(p["w_gate"], xs.dtype), group_sizes)
    up = jax.lax.ragged_dot(xs, dense_weight(p["w_up"], xs.dtype), group_sizes)
    ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, dense_weight(p["w_down"], xs.dtype),
                            group_sizes)                                         # [T*k, Hd]
    ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
    out = jnp.zeros((T, Hd), ys.dtype).at[token].add(ys)
    if cfg.n_shared_experts:
        out = out + _swiglu(h, p["sh_gate"], p["sh_up"], p["sh_down"])
    return out.astype(h.dtype)


def _write_rows(cache: jax.Array, layer, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter ``rows [T, D]`` into ``cache [layers, pages, page_size, W]`` at ``layer``; rows
    narrower than the cache's (``W > D``: lanes padded on TPU, ``pallas_kernels/lanes.py``)
    are written with zeros in the pad."""
    page_size = cache.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    rows = pad_last_dim(rows, cache.shape[-1])
    return cache.at[layer, page, offset].set(rows.astype(cache.dtype))


def _segments(kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs ``(kind, start, end)`` of equal consecutive entries."""
    out = []
    for i, kind in enumerate(kinds):
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], i + 1)
        else:
            out.append((kind, i, i + 1))
    return out


def softmax_scale(cfg: DeepseekConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    scale = cfg.qk_head_dim ** -0.5
    rp = cfg.rope_params
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        factor = float(rp["factor"])
        if factor > 1:
            m = 0.1 * float(rp["mscale_all_dim"]) * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


def decoder_layers(cfg: DeepseekConfig, params: dict, x: jax.Array, caches: dict[str, jax.Array],
                   md: AttentionMetadata, *, attention_impl=None, interpret: bool = False):
    """Run the ``cfg.num_layers`` decoder layers of stacked ``params`` (``param_groups``) on
    ``x [T, Hd]``: one ``lax.scan`` per run of layers with the same MLP kind, carrying the
    hidden state, the cache dict (``"latent"``, and ``"indexer_k"`` with DSA; other buffers
    pass through) and the last top-k selection. Returns ``(x [T, Hd], caches)``."""
    T = x.shape[0]
    inv_freq, rope_scale = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_params)
    inv_freq = jnp.asarray(inv_freq)
    missing = {"latent"} - set(caches)
    if cfg.has_indexer:
        missing |= {"indexer_k"} - set(caches)
    if missing:
        raise ValueError(f"caches is missing buffer(s) {sorted(missing)}; see cache_spec()")

    # Static per-layer tables: slot in the MLP stack and in the indexer stack.
    mlp_slot = np.zeros(cfg.num_layers, np.int32)
    for stack in (cfg.dense_layers, cfg.moe_layers):
        for j, layer in enumerate(stack):
            mlp_slot[layer] = j
    idx_slot = np.zeros(cfg.num_layers, np.int32)
    for j, layer in enumerate(cfg.full_indexer_layers):
        idx_slot[layer] = j
    is_full = np.array([t == "full" for t in cfg.indexer_types])
    mixed_indexer = cfg.has_indexer and not is_full.all()

    if cfg.has_indexer:
        span = md.page_indices.shape[1] * caches["latent"].shape[2]
        topk0 = jnp.full((T, min(cfg.index_topk, span)), -1, jnp.int32)
    else:
        topk0 = None
    step = functools.partial(_decoder_layer, cfg=cfg, impl=attention_impl, interpret=interpret,
                             params=params, md=md, inv_freq=inv_freq, rope_scale=rope_scale,
                             mixed_indexer=mixed_indexer)
    carry = (x, dict(caches), topk0)
    for kind, start, end in _segments(cfg.mlp_layer_types):
        xs = (jnp.arange(start, end, dtype=jnp.int32), jnp.asarray(mlp_slot[start:end]),
              jnp.asarray(idx_slot[start:end]), jnp.asarray(is_full[start:end]))
        carry, _ = jax.lax.scan(functools.partial(step, kind=kind), carry, xs)
    x, caches, _ = carry
    return x, caches


def _decoder_layer(carry, xs, *, cfg, impl, interpret, kind, params, md, inv_freq, rope_scale,
                   mixed_indexer):
    """One decoder layer (``lax.scan`` body of ``decoder_layers``)."""
    x, caches, topk = carry
    layer, mslot, islot, full = xs
    T = x.shape[0]
    H, C, N = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    a = jax.tree.map(lambda w: w[layer], params["attn"])
    rope = _rope_interleaved if cfg.rope_interleave else apply_rope

    h = rms_norm(x, a["input_norm"], cfg.rms_norm_eps)
    q_a = linear(h, a["w_qa"])
    kv_a = linear(h, a["w_kva"])
    if cfg.attention_bias:
        q_a, kv_a = q_a + a["b_qa"], kv_a + a["b_kva"]
    q_resid = rms_norm(q_a, a["q_a_norm"], LATENT_NORM_EPS)                  # [T, q_lora]
    q = linear(q_resid, a["w_qb"]).reshape(T, H, cfg.qk_head_dim)
    q_pe = rope(q[..., N:], md.positions, inv_freq, rope_scale)              # [T, H, R]
    q_lat = jnp.einsum("thn,hnc->thc", q[..., :N], a["w_uk"])               # [T, H, C]
    c_kv = rms_norm(kv_a[:, :C], a["kv_a_norm"], LATENT_NORM_EPS)
    k_pe = rope(kv_a[:, None, C:], md.positions, inv_freq, rope_scale)[:, 0]
    caches = dict(caches)
    caches["latent"] = _write_rows(caches["latent"], layer,
                                   jnp.concatenate([c_kv, k_pe], axis=-1), md.slot_mapping)

    if cfg.has_indexer:
        def full_branch(topk, k_cache):
            return _indexer(cfg, impl, interpret, h, q_resid, params["indexer"], islot, k_cache,
                            md, inv_freq, rope_scale, topk.shape[1])

        if mixed_indexer:
            topk, caches["indexer_k"] = jax.lax.cond(
                full, full_branch, lambda t, c: (t, c), topk, caches["indexer_k"])
        else:
            topk, caches["indexer_k"] = full_branch(topk, caches["indexer_k"])

    out_lat = mla_sparse_attention(
        jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1), caches["latent"],
        layer, md.kv_lens, md.page_indices, md.cu_q_lens, md.distribution, topk,
        sm_scale=softmax_scale(cfg), kv_lora_rank=C, impl=impl,
        interpret=interpret)                                                     # [T, H, C]
    attn = jnp.einsum("thc,hcv->thv", out_lat, a["w_uv"]).reshape(T, H * cfg.v_head_dim)
    attn = linear(attn, a["w_o"])
    if cfg.attention_bias:
        attn = attn + a["b_o"]
    x = x + attn

    h = rms_norm(x, a["post_norm"], cfg.rms_norm_eps)
    m = jax.tree.map(lambda w: w[mslot], params["dense" if kind == "dense" else "moe"])
    if kind == "dense":
        x = x + _swiglu(h, m["w_gate"], m["w_up"], m["w_down"])
    else:
        x = x + moe_forward(cfg, h, m)
    return (x, caches, topk), None


def _indexer(cfg, impl, interpret, h, q_resid, params, islot, k_cache, md, inv_freq, rope_scale, k):
    """Score the cached tokens, write this step's indexer keys first, keep the top ``k``."""
    T = h.shape[0]
    Hi, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    p = jax.tree.map(lambda w: w[islot], params)
    rope = _rope_interleaved if cfg.indexer_rope_interleave else apply_rope
    q = linear(q_resid, p["wq_b"]).reshape(T, Hi, Di)
    key = _layer_norm(linear(h, p["wk"]), p["k_norm_w"], p["k_norm_b"], INDEXER_NORM_EPS)
    # The rotary part comes first in the indexer (unlike MLA's [nope | rope]).
    q = jnp.concatenate([rope(q[..., :R], md.positions, inv_freq, rope_scale), q[..., R:]], -1)
    key = jnp.concatenate([rope(key[:, None, :R], md.positions, inv_freq, rope_scale)[:, 0],
                           key[:, R:]], -1)
    weights = (h.astype(jnp.float32) @ p["w_weights"].astype(jnp.float32)) * Hi ** -0.5
    k_cache = _write_rows(k_cache, islot, key, md.slot_mapping)
    scores = indexer_scores(q, weights, k_cache, islot, md.kv_lens, md.page_indices,
                            md.cu_q_lens, md.distribution, sm_scale=Di ** -0.5,
                            impl=impl, interpret=interpret)
    return topk_positions(scores, k), k_cache


# --------------------------------------------------------------------------- the model

class DeepseekForCausalLM(nnx.Module):
    """MLA + MoE causal LM (DeepSeek-V3, DeepSeek-V3.2, GLM-5) over a paged latent cache.

    ``__call__(input_ids [T] int32, caches, md, logits_indices [N] int32)`` returns
    ``(logits [N, V] float32, caches)``. ``caches`` is a dict with the buffers of
    ``cache_spec`` (``"latent"``, ``"indexer_k"`` with DSA, ``"mtp_hidden"`` with MTP); they
    come back updated (donate them). ``md`` is the flat-stream metadata of DESIGN.md §2.

    Args:
      cfg: the architecture. dtype: parameter dtype (router and indexer weights stay float32).
      attention_impl: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"`` for both
        MLA attention and indexer scoring. interpret: run Pallas kernels interpreted (CPU).
      mtp: build the multi-token prediction module (``self.mtp``, ``DeepseekMTP``; the
        checkpoint's layer ``num_hidden_layers``) and keep every token's normed last hidden
        state in the ``"mtp_hidden"`` cache buffer for it (``--speculative-algorithm mtp``,
        DESIGN.md §3). ``ValueError`` when ``cfg.num_nextn_predict_layers`` is 0.
    """

    # The indexer scores every position of the page table (cost grows with P): no
    # implementation lets one pages-per-sequence bucket serve every batch.
    TRACED_PAGES_BOUND_IMPLS = ()

    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_impl: str | None = None, interpret: bool = False, mtp: bool = False):
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.interpret = interpret
        self.mtp_enabled = bool(mtp)
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        for group, (n, shapes) in param_groups(cfg).items():
            setattr(self, group, _Stack(group, n, shapes, dtype=dtype, rngs=rngs))
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))
        if mtp:
            self.mtp = DeepseekMTP(cfg, dtype=dtype, rngs=rngs)

    # ------------------------------------------------------------------ cache
    def cache_spec(self, num_pages: int, page_size: int, dtype=None,
                   row_align: int = 1) -> tuple[CacheBufferSpec, ...]:
        """The KV buffers this model reads and writes; see ``deepseek_cache_spec``."""
        if dtype is None:
            dtype = self.embed_tokens[...].dtype
        specs = deepseek_cache_spec(self.cfg, num_pages=num_pages, page_size=page_size,
                                    dtype=dtype, row_align=row_align)
        if self.mtp_enabled:
            specs += (CacheBufferSpec("mtp_hidden", (1, num_pages, page_size, aligned_width(
                self.cfg.hidden_size, row_align)), jnp.dtype(dtype)),)
        return specs

    def mtp_cache_spec(self, num_pages: int, page_size: int, dtype=None,
                       row_align: int = 1) -> tuple[CacheBufferSpec, ...]:
        """The MTP layer's own KV buffers (``deepseek_cache_spec`` of its one-layer config:
        ``latent [1, num_pages, page_size, latent]``, ``indexer_k`` with DSA); the MTP
        drafter keeps them in a pool of its own (DESIGN.md §3)."""
        if dtype is None:
            dtype = self.embed_tokens[...].dtype
        return deepseek_cache_spec(self.cfg.mtp_layer_config(), num_pages=num_pages,
                                   page_size=page_size, dtype=dtype, row_align=row_align)

    # ------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: jax.Array, caches: dict[str, jax.Array],
                      md: AttentionMetadata) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``input_ids [T]`` -> (pre-norm hidden states ``[T, Hd]``, updated caches). With
        MTP on (``mtp=True``) the normed hidden state of every token (what the LM head reads)
        is also written to the ``"mtp_hidden"`` buffer at its slot, for the MTP drafter."""
        cfg = self.cfg
        params = {g: getattr(self, g).values(shapes)
                  for g, (_, shapes) in param_groups(cfg).items()}
        x = self.embed_tokens[...][input_ids]
        x, caches = decoder_layers(cfg, params, x, caches, md, attention_impl=self.attention_impl,
                                   interpret=self.interpret)
        if self.mtp_enabled:
            if "mtp_hidden" not in caches:
                raise ValueError("caches is missing buffer(s) ['mtp_hidden']; see cache_spec()")
            caches = dict(caches)
            caches["mtp_hidden"] = _write_rows(
                caches["mtp_hidden"], 0, rms_norm(x, self.norm[...], cfg.rms_norm_eps),
                md.slot_mapping)
        return x, caches

    def paged_forward(self, input_ids: jax.Array, caches: dict[str, jax.Array],
                      md: AttentionMetadata) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The engine's model interface (as ``LlamaForCausalLM.paged_forward``): ``(hidden
        [T, Hd], caches)`` with ``caches`` the dict of buffers named by ``cache_spec``."""
        return self.hidden_states(input_ids, caches, md)

    def compute_logits(self, h: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """``h [N, Hd]`` (pre-norm hidden states) -> logits ``[N, V]`` float32 (every row:
        ``num_rows``, the real ones, is taken for the Llama family's signature; this head
        is an XLA dot)."""
        h = rms_norm(h, self.norm[...], self.cfg.rms_norm_eps)
        w = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return (h @ w).astype(jnp.float32)

    def __call__(self, input_ids, caches: dict[str, jax.Array], md: AttentionMetadata,
                 logits_indices):
        x, caches = self.hidden_states(input_ids, caches, md)
        return self.compute_logits(x[logits_indices]), caches

    # ------------------------------------------------------------------ MTP
    def mtp_forward(self, input_ids: jax.Array, prev_hidden: jax.Array,
                    caches: dict[str, jax.Array], md: AttentionMetadata):
        """One depth of multi-token prediction (DeepSeek-V3 §2.2) over the flat stream.

        Token ``t`` at position ``i`` carries ``input_ids[t]`` = the token at position
        ``i + 1`` and ``prev_hidden[t]`` = the normed last hidden state at position ``i``
        (the target's, or the previous depth's output); its output predicts position
        ``i + 2``::

            h' = eh_proj([enorm(embed(input_ids)) | hnorm(prev_hidden)])   (embedding first)
            h' = decoder layer(h')                   (MLA + MoE/dense, its own KV ``caches``)
            out = shared_head.norm(h')               logits = out @ lm_head (shared)

        ``input_ids [T]`` int32, ``prev_hidden [T, Hd]``, ``caches`` the MTP layer's buffers
        (``mtp_cache_spec``). Returns ``(out [T, Hd], caches)``; ``mtp_logits(out[rows])``
        gives the logits. The embedding and the LM head are the target's (as SGLang's
        ``DeepseekV3ForCausalLMNextN`` shares them)."""
        m = self.mtp
        cfg = m.layer_cfg
        eps = self.cfg.rms_norm_eps
        e = rms_norm(self.embed_tokens[...][input_ids], m.enorm[...], eps)
        h = rms_norm(prev_hidden.astype(e.dtype), m.hnorm[...], eps)
        x = jnp.concatenate([e, h], axis=-1) @ m.eh_proj[...]
        params = {g: getattr(m, g).values(shapes) for g, (_, shapes) in param_groups(cfg).items()}
        x, caches = decoder_layers(cfg, params, x, caches, md, attention_impl=self.attention_impl,
                                   interpret=self.interpret)
        return rms_norm(x, m.norm[...], eps), caches

    def mtp_logits(self, out: jax.Array) -> jax.Array:
        """``out [N, Hd]`` (``mtp_forward``'s, already normed) -> logits ``[N, V]`` float32."""
        w = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return (out @ w).astype(jnp.float32)


class DeepseekMTP(nnx.Module):
    """The parameters of the multi-token prediction module (one depth; HF names
    ``model.layers.{num_hidden_layers}.*``): ``enorm``, ``hnorm`` ``[Hd]``, ``eh_proj``
    ``[2 Hd, Hd]`` (stored ``[in, out]``), one decoder layer stacked as a one-layer model
    (``attn``, ``moe`` or ``dense``, ``indexer`` with DSA; ``layer_cfg``) and ``norm``
    (``shared_head.norm``). ``DeepseekForCausalLM.mtp_forward`` runs it."""

    def __init__(self, cfg: DeepseekConfig, *, dtype, rngs: nnx.Rngs):
        self.layer_cfg = cfg.mtp_layer_config()
        Hd = cfg.hidden_size
        self.enorm = nnx.Param(jnp.ones((Hd,), dtype))
        self.hnorm = nnx.Param(jnp.ones((Hd,), dtype))
        self.eh_proj = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (2 * Hd, Hd), dtype))
        for group, (n, shapes) in param_groups(self.layer_cfg).items():
            setattr(self, group, _Stack(group, n, shapes, dtype=dtype, rngs=rngs))
        self.norm = nnx.Param(jnp.ones((Hd,), dtype))


def deepseek_cache_spec(cfg: DeepseekConfig, *, num_pages: int, page_size: int,
                        dtype=jnp.float32, row_align: int = 1) -> tuple[CacheBufferSpec, ...]:
    """KV buffers of an MLA model, replicated across TP ranks.

    ``latent [L, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` always;
    ``indexer_k [Li, num_pages, page_size, index_head_dim]`` with DSA, where ``Li`` counts the
    ``"full"`` indexer layers (slot ``j`` is the ``j``-th full layer). Rows are padded with
    zero lanes to a multiple of ``row_align`` (``lanes.kv_row_align``: 128 on TPU, so 576-wide
    latent rows are 640). Raises ``ValueError`` for a non-positive ``num_pages``,
    ``page_size`` or ``row_align``.
    """
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
    dtype = jnp.dtype(dtype)
    specs = [CacheBufferSpec("latent", (cfg.num_layers, num_pages, page_size,
                                        aligned_width(cfg.latent_dim, row_align)), dtype)]
    if cfg.has_indexer:
        specs.append(CacheBufferSpec(
            "indexer_k", (len(cfg.full_indexer_layers), num_pages, page_size,
                          aligned_width(cfg.index_head_dim, row_align)), dtype))
    return tuple(specs)


# --------------------------------------------------------------------------- loading

def param_partition_specs(cfg: DeepseekConfig, tp_size: int) -> dict[str, P]:
    """Partition spec of every parameter path (``"attn.w_qb"``, ``"moe.w_gate"``, ...)."""
    specs = {f"{g}.{name}": P(None, *spec)
             for g, (_, shapes) in param_groups(cfg).items() for name, (_, spec) in shapes.items()}
    specs["embed_tokens"] = P()
    specs["norm"] = P()
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, "tp") if cfg.vocab_size % tp_size == 0 else P()
    if cfg.num_nextn_predict_layers:        # used only by a model built with mtp=True
        for g, (_, shapes) in param_groups(cfg.mtp_layer_config()).items():
            specs.update({f"mtp.{g}.{name}": P(None, *spec) for name, (_, spec) in shapes.items()})
        specs.update({f"mtp.{name}": P() for name in ("enorm", "hnorm", "eh_proj", "norm")})
    return specs


def check_tp(cfg: DeepseekConfig, tp_size: int) -> None:
    """Raises ``ValueError`` when heads or MLP/expert widths do not split over ``tp_size``."""
    checks = [("num_attention_heads", cfg.num_heads)]
    if cfg.dense_layers:
        checks.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers:
        checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, value in checks:
        if value % tp_size:
            raise ValueError(f"tp_size ({tp_size}) must divide {name} ({value})")
    if tp_size > 1:
        groups = param_groups(cfg)
        B = cfg.weight_block_size
        fp8 = fp8_params(cfg)
        for group, name in (key for key in FP8_MODULES if key in fp8):
            shape, spec = groups[group][1][name]
            axis = list(spec).index("tp") if "tp" in spec else None
            if axis is not None and (shape[axis] // tp_size) % B:
                side = "output" if axis == len(shape) - 1 else "input"
                raise ValueError(
                    f"tp_size: {tp_size} cuts the FP8 scale blocks of {FP8_MODULES[group, name]}"
                    f": its {shape[axis]} {side} features split into shards of "
                    f"{shape[axis] // tp_size}, not a multiple of the {B}-wide blocks "
                    f"(quantization_config.weight_block_size); use a tp_size whose shards hold "
                    f"whole blocks")


def stack_hf_tensors(cfg: DeepseekConfig, tensors: dict[str, np.ndarray],
                     source: str) -> dict[str, np.ndarray]:
    """HF-named float32 tensors -> our parameter paths, stacked per group.

    Experts may be fused (transformers 5: ``mlp.experts.gate_up_proj [E, 2F, Hd]``,
    ``down_proj [E, Hd, F]``) or per expert (``mlp.experts.{e}.gate_proj.weight`` ...).

    FP8 checkpoints (``cfg.weight_block_size``; ``tensors`` the lazy views of
    ``checkpoint.read_hf_tensors(lazy=True)``): each ``fp8_params`` weight comes as a
    ``LazyStack`` of its float8 ``[in, out]`` views (nothing read yet) plus ``name +
    SCALE_SUFFIX``, the float32 block scales stacked the same way; every other tensor is read
    to float32, an FP8 one (``kv_b_proj``, an MTP ``eh_proj``) dequantized on the host.

    Raises ``ValueError`` naming a missing or mis-shaped tensor: a missing scale, a scale
    whose shape is not the weight's blocks, a non-power-of-two scale under ``ue8m0``, an
    unquantized weight where the config says FP8, or FP8 tensors without a
    ``quantization_config``.
    """
    B = cfg.weight_block_size
    fp8 = fp8_params(cfg)
    if not B:
        scaled = next((k for k, v in tensors.items()
                       if k.endswith("weight_scale_inv") or v.dtype == FP8_DTYPE), None)
        if scaled is not None:
            raise ValueError(f"{source}: FP8 tensor {scaled!r} but config.json has no "
                             "quantization_config (quant_method fp8, weight_block_size "
                             "[128, 128])")

    def raw(name):
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name!r}")
        return tensors[name]

    def scale_of(name, w):
        """The float32 block scales ``[ceil(out/B), ceil(in/B)]`` of FP8 weight ``name``."""
        sname = name + "_scale_inv"
        if sname not in tensors:
            raise ValueError(f"{source}: missing tensor {sname!r} (the block scales of the "
                             f"float8 {name!r})")
        s = np.asarray(tensors[sname], np.float32)
        expect = (num_blocks(w.shape[0], B), num_blocks(w.shape[1], B)) if w.ndim == 2 else None
        if s.shape != expect:
            raise ValueError(f"{source}: tensor {sname!r} has shape {s.shape}, expected "
                             f"{expect}: the {B}x{B} blocks of {name!r} {tuple(w.shape)}")
        if not np.isfinite(s).all():
            raise ValueError(f"{source}: tensor {sname!r} has a scale that is not finite")
        if cfg.scale_fmt == "ue8m0":
            check_ue8m0(s, f"{source}: tensor {sname!r}")
        return s

    def get(name):
        """A float32 host copy (an FP8 tensor dequantized)."""
        w = raw(name)
        if w.dtype == FP8_DTYPE:
            if not B:
                raise ValueError(f"{source}: FP8 tensor {name!r} but config.json has no "
                                 "quantization_config")
            return dequantize(w, scale_of(name, w), B)
        return np.asarray(w, np.float32)

    def lin(group, name, hf):
        """Weight ``hf`` ``[out, in]`` as ours ``[in, out]``: float32, or for an FP8
        parameter ``(float8 view, scales)``, both transposed, no byte read."""
        if (group, name) not in fp8:
            return get(hf).T
        w = raw(hf)
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{source}: tensor {hf!r} is {w.dtype.name}, expected "
                             "float8_e4m3fn with its weight_scale_inv (quantization_config; "
                             "modules_to_not_convert lists the modules kept unquantized)")
        return w.T, scale_of(hf, w).T

    def stacked(items):
        if isinstance(items[0], tuple):
            return LazyStack([q for q, _ in items]), np.stack([sc for _, sc in items])
        return np.stack(items)

    H, N, Vd, C = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Fm = cfg.moe_intermediate_size

    def attn_layer(i):
        pre = f"model.layers.{i}."
        sa = pre + "self_attn."
        kv_b = get(sa + "kv_b_proj.weight").reshape(H, N + Vd, C)
        out = {
            "input_norm": get(pre + "input_layernorm.weight"),
            "w_qa": lin("attn", "w_qa", sa + "q_a_proj.weight"),
            "q_a_norm": get(sa + "q_a_layernorm.weight"),
            "w_qb": lin("attn", "w_qb", sa + "q_b_proj.weight"),
            "w_kva": lin("attn", "w_kva", sa + "kv_a_proj_with_mqa.weight"),
            "kv_a_norm": get(sa + "kv_a_layernorm.weight"),
            "w_uk": kv_b[:, :N, :],
            "w_uv": kv_b[:, N:, :].transpose(0, 2, 1),
            "w_o": lin("attn", "w_o", sa + "o_proj.weight"),
            "post_norm": get(pre + "post_attention_layernorm.weight"),
        }
        if cfg.attention_bias:
            out.update(b_qa=get(sa + "q_a_proj.bias"), b_kva=get(sa + "kv_a_proj_with_mqa.bias"),
                       b_o=get(sa + "o_proj.bias"))
        return out

    def dense_layer(i):
        m = f"model.layers.{i}.mlp."
        return {"w_gate": lin("dense", "w_gate", m + "gate_proj.weight"),
                "w_up": lin("dense", "w_up", m + "up_proj.weight"),
                "w_down": lin("dense", "w_down", m + "down_proj.weight")}

    def moe_layer(i):
        m = f"model.layers.{i}.mlp."
        if m + "experts.gate_up_proj" in tensors:
            if ("moe", "w_gate") in fp8:
                raise ValueError(f"{source}: FP8 experts must be stored per expert "
                                 f"({m}experts.E.gate_proj.weight ...), not fused")
            gate_up = get(m + "experts.gate_up_proj")                           # [E, 2F, Hd]
            w_gate = gate_up[:, :Fm, :].transpose(0, 2, 1)
            w_up = gate_up[:, Fm:, :].transpose(0, 2, 1)
            w_down = get(m + "experts.down_proj").transpose(0, 2, 1)            # [E, F, Hd]
        else:
            e_range = range(cfg.n_routed_experts)
            w_gate, w_up, w_down = (
                stacked([lin("moe", w, f"{m}experts.{e}.{proj}.weight") for e in e_range])
                for w, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                ("w_down", "down_proj")))
        out = {"router": get(m + "gate.weight").T,
               "router_bias": get(m + "gate.e_score_correction_bias"),
               "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
        if cfg.n_shared_experts:
            out.update(sh_gate=lin("moe", "sh_gate", m + "shared_experts.gate_proj.weight"),
                       sh_up=lin("moe", "sh_up", m + "shared_experts.up_proj.weight"),
                       sh_down=lin("moe", "sh_down", m + "shared_experts.down_proj.weight"))
        return out

    def indexer_layer(i):
        ix = f"model.layers.{i}.self_attn.indexer."
        return {"wq_b": lin("indexer", "wq_b", ix + "wq_b.weight"),
                "wk": lin("indexer", "wk", ix + "wk.weight"),
                "k_norm_w": get(ix + "k_norm.weight"), "k_norm_b": get(ix + "k_norm.bias"),
                "w_weights": get(ix + "weights_proj.weight").T}

    out = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = get("lm_head.weight").T
    readers = {"attn": (range(cfg.num_layers), attn_layer),
               "dense": (cfg.dense_layers, dense_layer),
               "moe": (cfg.moe_layers, moe_layer),
               "indexer": (cfg.full_indexer_layers, indexer_layer)}
    for group, (n, shapes) in param_groups(cfg).items():
        layers, read = readers[group]
        per_layer = [read(i) for i in layers]
        for name, (shape, _) in shapes.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            for i, entry in zip(layers, per_layer):
                if _weight_shape(entry[name]) != shape:
                    raise ValueError(f"{source}: layer {i} {group}.{name} has shape "
                                     f"{_weight_shape(entry[name])}, expected {shape}")
            value = stacked([entry[name] for entry in per_layer])
            if isinstance(value, tuple):
                out[f"{group}.{name}"], out[f"{group}.{name}{SCALE_SUFFIX}"] = value
            else:
                out[f"{group}.{name}"] = value
    for key, expect in (("embed_tokens", (cfg.vocab_size, cfg.hidden_size)),
                        ("norm", (cfg.hidden_size,))):
        if out[key].shape != expect:
            raise ValueError(f"{source}: tensor {key} has shape {out[key].shape}, expected {expect}")
    if cfg.num_nextn_predict_layers and f"model.layers.{cfg.num_layers}.eh_proj.weight" in tensors:
        out.update(_mtp_params(cfg, tensors, source, out, {
            "attn": attn_layer, "dense": dense_layer, "moe": moe_layer,
            "indexer": indexer_layer}, get))
    return out


def _weight_shape(value) -> tuple[int, ...]:
    """Shape of a stacked entry: an array's, or an FP8 ``(values, scales)`` pair's values'."""
    return tuple((value[0] if isinstance(value, tuple) else value).shape)


def _mtp_params(cfg: DeepseekConfig, tensors: dict[str, np.ndarray], source: str,
                main: dict[str, np.ndarray], readers, get) -> dict[str, np.ndarray]:
    """The MTP module's parameters (``DeepseekMTP``) from the HF tensors of layer
    ``N = num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the
    decoder layer's usual names, read by the main layers' ``readers``. Its own
    ``embed_tokens`` / ``shared_head.head``, where the checkpoint stores them, are not loaded:
    the target's are used (DeepSeek-V3 shares them; a copy that differs is logged)."""
    N = cfg.num_layers
    pre = f"model.layers.{N}."
    Hd = cfg.hidden_size
    names = {"mtp.enorm": ("enorm.weight", (Hd,)), "mtp.hnorm": ("hnorm.weight", (Hd,)),
             "mtp.norm": ("shared_head.norm.weight", (Hd,)),
             "mtp.eh_proj": ("eh_proj.weight", (Hd, 2 * Hd))}
    out = {}
    for key, (name, expect) in names.items():
        if pre + name not in tensors:
            raise ValueError(f"{source}: missing MTP tensor {pre + name!r}")
        if tensors[pre + name].shape != expect:
            raise ValueError(f"{source}: MTP tensor {pre + name} has shape "
                             f"{tensors[pre + name].shape}, expected {expect}")
        out[key] = get(pre + name)
    out["mtp.eh_proj"] = out["mtp.eh_proj"].T                     # [2 Hd, Hd]: [in, out]
    for own, shared in (("embed_tokens.weight", "embed_tokens"),
                        ("shared_head.head.weight", "lm_head")):
        if pre + own in tensors and shared in main:
            mine = get(pre + own) if shared == "embed_tokens" else get(pre + own).T
            if mine.shape != main[shared].shape or not np.array_equal(mine, main[shared]):
                logger.warning("%s: %s%s differs from the main model's; the MTP layer uses "
                               "the main model's %s", source, pre, own, shared)
    for group, (_, shapes) in param_groups(cfg.mtp_layer_config()).items():
        entry = readers[group](N)
        for name, (shape, _) in shapes.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            if _weight_shape(entry[name]) != shape:
                raise ValueError(f"{source}: MTP layer {N} {group}.{name} has shape "
                                 f"{_weight_shape(entry[name])}, expected {shape}")
            if isinstance(entry[name], tuple):
                out[f"mtp.{group}.{name}"] = LazyStack([entry[name][0]])
                out[f"mtp.{group}.{name}{SCALE_SUFFIX}"] = entry[name][1][None]
            else:
                out[f"mtp.{group}.{name}"] = entry[name][None]
    return out
