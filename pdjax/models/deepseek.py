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

from pdjax.models.attention import AttentionMetadata
from pdjax.models.cache_spec import CacheBufferSpec
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.layers import apply_rope, rms_norm, rope_inv_freq
from pdjax.models.linear import linear, slice_layer, with_fp8_kernel
from pdjax.pallas_kernels.indexer import indexer_scores, key_view, topk_positions
from pdjax.pallas_kernels.lanes import aligned_width, pad_last_dim
from pdjax.pallas_kernels.mla_sparse_attention import mla_sparse_attention
from pdjax.pallas_kernels.mla_sparse_attention import fp8_record
from pdjax.models.deepseek_params import _Stack, param_groups
from pdjax.models.moe import moe_forward, swiglu
from pdjax.models.moe_ep import moe_forward_ep
from pdjax.models.dp_attention import dp_cache_specs, dp_decoder_layers
from pdjax.models.dp_rows import dp_write_rows

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not the config's
INDEXER_NORM_EPS = 1e-6    # the indexer's key LayerNorm


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
                   md: AttentionMetadata, *, mlp=None):
    """Run the ``cfg.num_layers`` decoder layers of stacked ``params`` (``param_groups``) on
    ``x [T, Hd]``: one ``lax.scan`` per run of layers with the same MLP kind, carrying the
    hidden state, the cache dict (``"latent"``, and ``"indexer_k"`` with DSA; other buffers
    pass through) and the last top-k selection. Returns ``(x [T, Hd], caches)``. The kernels
    are ``cfg``'s (``attention_impl``, ``pallas_interpret``).
    ``mlp``: ``(kind, h [T, Hd], layer params) -> [T, Hd]`` in place of the layer's own MLP
    (DP attention's, ``dp_attention.py``); None: the dense / MoE / EP MLP below."""
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
    # FP8 linears run the block-scaled Pallas GEMM where the attention kernels are Pallas.
    params = with_fp8_kernel(params, param_groups(cfg), cfg.attention_impl, cfg.pallas_interpret)
    step = functools.partial(_decoder_layer, cfg=cfg, params=params, md=md, inv_freq=inv_freq,
                             rope_scale=rope_scale, mixed_indexer=mixed_indexer, mlp=mlp)
    carry = (x, dict(caches), topk0)
    for kind, start, end in _segments(cfg.mlp_layer_types):
        xs = (jnp.arange(start, end, dtype=jnp.int32), jnp.asarray(mlp_slot[start:end]),
              jnp.asarray(idx_slot[start:end]), jnp.asarray(is_full[start:end]))
        carry, _ = jax.lax.scan(functools.partial(step, kind=kind), carry, xs)
    x, caches, _ = carry
    return x, caches


def _decoder_layer(carry, xs, *, cfg, kind, params, md, inv_freq, rope_scale, mixed_indexer,
                   mlp=None):
    """One decoder layer (``lax.scan`` body of ``decoder_layers``)."""
    x, caches, topk = carry
    layer, mslot, islot, full = xs
    T = x.shape[0]
    H, C, N = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    # slice_layer: kernel-run FP8 weights stay stacked, read in place (linear.py).
    a = slice_layer(params["attn"], layer)
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
    if fp8_record.is_fp8_latent(caches):
        layout = fp8_record.Fp8LatentLayout(C, cfg.qk_rope_head_dim,
                                            1 if "latent_scale" in caches else
                                            fp8_record.TPU_LANES)
        caches = fp8_record.write_rows(caches, layout, layer, c_kv, k_pe, md.slot_mapping)
    else:
        caches["latent"] = _write_rows(caches["latent"], layer,
                                       jnp.concatenate([c_kv, k_pe], axis=-1), md.slot_mapping)

    if cfg.has_indexer:
        names = [n for n in ("indexer_k", "indexer_k_scale") if n in caches]

        def full_branch(topk, k_planes):
            return _indexer(cfg, h, q_resid, params["indexer"], islot,
                            dict(zip(names, k_planes)), md, inv_freq, rope_scale, topk.shape[1])

        k_planes = tuple(caches[n] for n in names)
        if mixed_indexer:
            topk, k_planes = jax.lax.cond(full, full_branch, lambda t, c: (t, c), topk,
                                          k_planes)
        else:
            topk, k_planes = full_branch(topk, k_planes)
        caches.update(zip(names, k_planes))

    out_lat = mla_sparse_attention(
        jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1),
        fp8_record.latent_view(caches),
        layer, md.kv_lens, md.page_indices, md.cu_q_lens, md.distribution, topk,
        sm_scale=softmax_scale(cfg), kv_lora_rank=C, impl=cfg.attention_impl,
        interpret=cfg.pallas_interpret)                                          # [T, H, C]
    attn = jnp.einsum("thc,hcv->thv", out_lat, a["w_uv"]).reshape(T, H * cfg.v_head_dim)
    attn = linear(attn, a["w_o"])
    if cfg.attention_bias:
        attn = attn + a["b_o"]
    x = x + attn

    h = rms_norm(x, a["post_norm"], cfg.rms_norm_eps)
    group = params["dense" if kind == "dense" else "moe"]
    m = slice_layer(group, mslot)   # EP too: moe_ep's shard_map splits a layer view's stack
    if mlp is not None:
        x = x + mlp(kind, h, m)
    elif kind == "dense":
        x = x + swiglu(h, m["w_gate"], m["w_up"], m["w_down"])
    elif cfg.ep_size > 1:       # experts split by expert over the TP devices (moe_ep.py)
        x = x + moe_forward_ep(cfg, h, m)
    else:
        x = x + moe_forward(cfg, h, m)
    return (x, caches, topk), None


def _indexer(cfg, h, q_resid, params, islot, k_planes, md, inv_freq, rope_scale, k):
    """Score the cached tokens, write this step's indexer keys first, keep the top ``k``.
    ``k_planes``: ``{"indexer_k": ...}``, plus ``"indexer_k_scale"`` for FP8 keys (quantized
    per 128 as written). Returns ``(top-k [T, k], the planes as a tuple, in order)``."""
    T = h.shape[0]
    Hi, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    p = slice_layer(params, islot)
    rope = _rope_interleaved if cfg.indexer_rope_interleave else apply_rope
    q = linear(q_resid, p["wq_b"]).reshape(T, Hi, Di)
    key = _layer_norm(linear(h, p["wk"]), p["k_norm_w"], p["k_norm_b"], INDEXER_NORM_EPS)
    # The rotary part comes first in the indexer (unlike MLA's [nope | rope]).
    q = jnp.concatenate([rope(q[..., :R], md.positions, inv_freq, rope_scale), q[..., R:]], -1)
    key = jnp.concatenate([rope(key[:, None, :R], md.positions, inv_freq, rope_scale)[:, 0],
                           key[:, R:]], -1)
    weights = (h.astype(jnp.float32) @ p["w_weights"].astype(jnp.float32)) * Hi ** -0.5
    k_planes = dict(k_planes)
    if "indexer_k_scale" in k_planes:
        key, scale = fp8_record.quantize_groups(key)
        k_planes["indexer_k_scale"] = _write_rows(k_planes["indexer_k_scale"], islot, scale,
                                                  md.slot_mapping)
    k_planes["indexer_k"] = _write_rows(k_planes["indexer_k"], islot, key, md.slot_mapping)
    scores = indexer_scores(q, weights, key_view(k_planes), islot, md.kv_lens,
                            md.page_indices, md.cu_q_lens, md.distribution, sm_scale=Di ** -0.5,
                            impl=cfg.attention_impl, interpret=cfg.pallas_interpret)
    return topk_positions(scores, k), tuple(k_planes.values())


# --------------------------------------------------------------------------- the model

class DeepseekForCausalLM(nnx.Module):
    """MLA + MoE causal LM (DeepSeek-V3, DeepSeek-V3.2, GLM-5) over a paged latent cache.

    ``__call__(input_ids [T] int32, caches, md, logits_indices [N] int32)`` returns
    ``(logits [N, V] float32, caches)``. ``caches`` is a dict with the buffers of
    ``cache_spec`` (``"latent"``, ``"indexer_k"`` with DSA, ``"mtp_hidden"`` with MTP); they
    come back updated (donate them). ``md`` is the flat-stream metadata of DESIGN.md §2.

    Args:
      cfg: the architecture and the run's choices: EP, DP attention and the kernels
        (``cfg.attention_impl``: ``None``/``"auto"``, ``"reference"``, ``"tpu"`` or ``"gpu"``
        for MLA attention, indexer scoring and the grouped / FP8 GEMMs;
        ``cfg.pallas_interpret``: run Pallas kernels interpreted, CPU).
      dtype: parameter dtype (router and indexer weights stay float32).
      mtp: build the multi-token prediction module (``self.mtp``, ``DeepseekMTP``; the
        checkpoint's layer ``num_hidden_layers``) and keep every token's normed last hidden
        state in the ``"mtp_hidden"`` cache buffer for it (``--speculative-algorithm mtp``,
        DESIGN.md §3). ``ValueError`` when ``cfg.num_nextn_predict_layers`` is 0.
    """

    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 mtp: bool = False):
        self.cfg = cfg
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
        if self.mtp_enabled:      # hidden states: never FP8 (the KV dtype may be)
            hidden_dtype = (self.embed_tokens[...].dtype if jnp.dtype(dtype).itemsize == 1
                            else dtype)
            hidden = (CacheBufferSpec("mtp_hidden", (1, num_pages, page_size, aligned_width(
                self.cfg.hidden_size, row_align)), jnp.dtype(hidden_dtype)),)
            # DP attention: page-sharded as the latent, a rank's tokens on its devices
            specs += dp_cache_specs(hidden, self.cfg) if self.cfg.dp_size > 1 else hidden
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
        # DP attention: md has a [dp] axis, each rank its own segment of input_ids
        if cfg.dp_size > 1:
            x, caches = dp_decoder_layers(cfg, params, x, caches, md, rank_layers=decoder_layers)
        else:
            x, caches = decoder_layers(cfg, params, x, caches, md)
        if self.mtp_enabled:
            if "mtp_hidden" not in caches:
                raise ValueError("caches is missing buffer(s) ['mtp_hidden']; see cache_spec()")
            caches = dict(caches)
            normed = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
            if cfg.dp_size > 1:     # rank-local slots: each rank writes its own pages
                caches["mtp_hidden"] = dp_write_rows(cfg, caches["mtp_hidden"], 0, normed,
                                                     md.slot_mapping)
            else:
                caches["mtp_hidden"] = _write_rows(caches["mtp_hidden"], 0, normed,
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
        ``DeepseekV3ForCausalLMNextN`` shares them). Under DP attention the stream is the
        ranks' segments and ``md`` has a leading ``[dp]`` axis, as ``hidden_states``'s; the
        layer's buffers are page-sharded (``dp_attention.dp_decoder_layers``)."""
        m = self.mtp
        cfg = m.layer_cfg
        eps = self.cfg.rms_norm_eps
        e = rms_norm(self.embed_tokens[...][input_ids], m.enorm[...], eps)
        h = rms_norm(prev_hidden.astype(e.dtype), m.hnorm[...], eps)
        x = jnp.concatenate([e, h], axis=-1) @ m.eh_proj[...]
        params = {g: getattr(m, g).values(shapes) for g, (_, shapes) in param_groups(cfg).items()}
        if cfg.dp_size > 1:     # DP attention: the layer runs as the target's layers do
            x, caches = dp_decoder_layers(cfg, params, x, caches, md, rank_layers=decoder_layers)
        else:
            x, caches = decoder_layers(cfg, params, x, caches, md)
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
    """KV buffers of an MLA model, replicated across TP ranks; under DP attention
    (``cfg.dp_size > 1``) ``num_pages`` is one rank's pool and the buffers hold ``tp *
    num_pages`` pages sharded by page (``dp_attention.dp_cache_specs``).

    ``latent [L, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` always;
    ``indexer_k [Li, num_pages, page_size, index_head_dim]`` with DSA, where ``Li`` counts the
    ``"full"`` indexer layers (slot ``j`` is the ``j``-th full layer). Rows are padded with
    zero lanes to a multiple of ``row_align`` (``lanes.kv_row_align``: 128 on TPU, so 576-wide
    latent rows are 640). Raises ``ValueError`` for a non-positive ``num_pages``,
    ``page_size`` or ``row_align``.

    ``dtype`` float8_e4m3fn (``--kv-cache-dtype fp8_e4m3``): the latent is the FP8 record of
    ``pallas_kernels/mla_sparse_attention/fp8_record.py`` in its planes (``"latent"`` FP8,
    ``"latent_scale"`` float32, ``"latent_rope"`` bfloat16: 656 bytes per token per layer for
    DeepSeek; on TPU the scales ride in the rope plane's pad lanes). The DSA indexer keys are
    FP8 too on GPU/CPU (``row_align`` 1): ``"indexer_k"`` float8_e4m3fn and
    ``"indexer_k_scale"`` ``[Li, N, ps, ceil(Di / 128)]`` float32 (132 bytes a token for Di
    128); on TPU they stay bfloat16 (a float32 scale would need a 128-lane row of its own).
    """
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
    dtype = jnp.dtype(dtype)
    fp8_keys = dtype == jnp.dtype(fp8_record.FP8_DTYPE) and row_align == 1
    if dtype == jnp.dtype(fp8_record.FP8_DTYPE):
        layout = fp8_record.Fp8LatentLayout(cfg.kv_lora_rank, cfg.qk_rope_head_dim, row_align)
        specs = [CacheBufferSpec(name, (cfg.num_layers, num_pages, page_size, width), d)
                 for name, width, d in layout.planes()]
        dtype = jnp.dtype(jnp.bfloat16)
    elif dtype.itemsize == 1:
        raise ValueError(f"dtype: a 1-byte KV cache must be float8_e4m3fn, got {dtype}")
    else:
        specs = [CacheBufferSpec("latent", (cfg.num_layers, num_pages, page_size,
                                            aligned_width(cfg.latent_dim, row_align)), dtype)]
    if cfg.has_indexer and fp8_keys:
        lead = (len(cfg.full_indexer_layers), num_pages, page_size)
        specs += [CacheBufferSpec("indexer_k", lead + (cfg.index_head_dim,),
                                  jnp.dtype(fp8_record.FP8_DTYPE)),
                  CacheBufferSpec("indexer_k_scale",
                                  lead + (fp8_record.num_scale_groups(cfg.index_head_dim),),
                                  jnp.dtype(fp8_record.SCALE_DTYPE))]
    elif cfg.has_indexer:
        specs.append(CacheBufferSpec(
            "indexer_k", (len(cfg.full_indexer_layers), num_pages, page_size,
                          aligned_width(cfg.index_head_dim, row_align)), dtype))
    return dp_cache_specs(tuple(specs), cfg) if cfg.dp_size > 1 else tuple(specs)
