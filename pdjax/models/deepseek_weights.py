"""The DeepSeek family's weights as its checkpoints ship them: HF tensor names -> stacked
parameter paths (per-expert or fused experts, FP8 block-scaled weights as lazy stacks, the MTP
layer), every path's partition spec, and the TP sizes a checkpoint can take."""

from __future__ import annotations

import logging

import numpy as np
from jax.sharding import PartitionSpec as P

from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import (FP8_DTYPE, SCALE_SUFFIX, LazyStack, check_ue8m0, dequantize,
                              num_blocks)

from pdjax.models.deepseek_params import FP8_MODULES, fp8_params, param_groups
from pdjax.models.moe_ep import EXPERT_WEIGHTS, expert_parallel_config, expert_shards

logger = logging.getLogger(__name__)


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
    """Raises ``ValueError`` when heads or MLP/expert widths do not split over ``tp_size``
    (under EP, ``cfg.ep_size > 1``, the routed experts are ``moe_ep.check_expert_parallel``'s
    to check; the shared experts' width still splits over ``tp_size``)."""
    # DP attention replicates the attention weights: the heads are not split.
    checks = [] if cfg.dp_size > 1 else [("num_attention_heads", cfg.num_heads)]
    if cfg.dense_layers:
        checks.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers and cfg.ep_size == 1:
        checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    elif cfg.moe_layers and cfg.n_shared_experts:
        checks.append(("the shared experts' width (moe_intermediate_size x n_shared_experts)",
                       cfg.moe_intermediate_size * cfg.n_shared_experts))
    for name, value in checks:
        if value % tp_size:
            raise ValueError(f"tp_size: {tp_size} must divide {name} ({value})")
    if tp_size > 1:
        groups = param_groups(cfg)
        B = cfg.weight_block_size
        fp8 = fp8_params(cfg)
        for group, name in (key for key in FP8_MODULES if key in fp8):
            if cfg.ep_size > 1 and group == "moe" and not name.startswith("sh_"):
                continue                    # split by expert (moe_ep.check_expert_parallel)
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


def expert_parallel_run_config(cfg: DeepseekConfig, tp_size: int, ep_size: int,
                               moe_a2a_backend: str = "none") -> DeepseekConfig:
    """The run config of ``cfg`` at TP ``tp_size`` with EP ``ep_size``
    (``moe_ep.expert_parallel_config``, then ``check_tp``); ``ValueError`` naming the field."""
    run_cfg = expert_parallel_config(cfg, tp_size, ep_size, moe_a2a_backend)
    check_tp(run_cfg, tp_size)
    return run_cfg


def expert_parallel_params(params: dict, cfg: DeepseekConfig, run_cfg: DeepseekConfig) -> dict:
    """``params`` of ``cfg`` (stacked, HF expert order) for ``run_cfg``: under EP with
    ``moe_tp_size > 1`` the routed expert stacks (and their FP8 scales, the MTP layer's too)
    in ``moe_ep.expert_shards``'s layout; otherwise ``params`` as they are. Lazy FP8 stacks
    stay lazy."""
    if run_cfg.ep_size == 1 or run_cfg.moe_tp_size == 1:
        return params
    out = dict(params)
    for prefix in ("moe.", "mtp.moe."):
        for name in EXPERT_WEIGHTS:
            width_axis = -2 if name == "w_down" else -1
            for key in (prefix + name, prefix + name + SCALE_SUFFIX):
                if key in out:
                    out[key] = expert_shards(out[key], run_cfg.moe_tp_size, width_axis)
    return out


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
