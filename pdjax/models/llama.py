"""Llama / Qwen2 / Qwen3 decoder (GQA) as a Flax NNX module over the paged KV cache.

One module serves the three architectures; they differ only in rows of ``ModelConfig``:
Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm on q and k. Layer parameters are stacked
on a leading ``[layers]`` axis and the forward is a ``lax.scan`` over layers that carries the
stacked KV cache (compile time independent of depth; DESIGN.md §2). ``unstack_layers`` trades
that for speed: it splits the stacked parameters into one array per layer and the forward becomes a Python loop over them (MaxText's ``scan_layers=False``). On XLA
CPU a scan copies each layer's weight slice out of the stack before its matmuls (a dynamic
slice feeding a library call cannot be read in place): SmolLM2's 30 layers, 16 decode rows,
118-128 ms a step scanned against 96-108 ms unrolled, for 3-5x the compile time per shape.

Shapes: ``T`` tokens of the flat stream, ``H`` hidden, ``QH``/``KVH`` query/KV heads, ``D`` head
dim, ``F`` MLP width, ``V`` vocabulary, ``L`` layers. Linear weights are stored ``[in, out]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.models.attention import AttentionMetadata, paged_attention
from pdjax.models.layers import apply_rope, rms_norm, rope_inv_freq
from pdjax.models.linear import linear, linear_group


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], P]]:
    """Per-layer parameter shapes (without the leading layer axis) and TP partition specs.

    Heads and the MLP width are split over the mesh axis ``"tp"`` (Megatron column/row split).
    """
    H, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    QH, KVH = cfg.num_q_heads, cfg.num_kv_heads
    shapes = {
        "input_norm": ((H,), P()),
        "wq": ((H, QH * D), P(None, "tp")),
        "wk": ((H, KVH * D), P(None, "tp")),
        "wv": ((H, KVH * D), P(None, "tp")),
        "wo": ((QH * D, H), P("tp", None)),
        "post_norm": ((H,), P()),
        "w_gate": ((H, F), P(None, "tp")),
        "w_up": ((H, F), P(None, "tp")),
        "w_down": ((F, H), P("tp", None)),
    }
    if cfg.attention_bias:
        shapes.update(bq=((QH * D,), P("tp")), bk=((KVH * D,), P("tp")), bv=((KVH * D,), P("tp")))
    if cfg.qk_norm:
        shapes.update(q_norm=((D,), P()), k_norm=((D,), P()))
    return shapes


# Linear weights that multiply the same input, by the name of their fused product: a weight
# format may store each group as one weight (one matmul; ``fuse_linear_weights``).
LINEAR_GROUPS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
                 "w_down": ("w_down",)}


def _is_unrolled(value) -> bool:
    """A layer parameter split by ``DecoderLayers.unstack``: a tuple of per-layer arrays."""
    return isinstance(value, tuple)


class DecoderLayers(nnx.Module):
    """All decoder layers, parameters stacked as ``[L, ...]``, applied with ``lax.scan``; after
    ``unstack``, a tuple of ``L`` per-layer arrays each, applied in an unrolled loop. After
    ``fuse_linear_weights`` the linear weights are the fused groups of ``LINEAR_GROUPS``."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.param_names = tuple(layer_param_shapes(cfg))
        init = nnx.initializers.normal(0.02)
        for name, (shape, _) in layer_param_shapes(cfg).items():
            full = (cfg.num_layers, *shape)
            value = jnp.ones(full, dtype) if name.endswith("norm") else init(rngs.params(), full, dtype)
            setattr(self, name, nnx.Param(value))

    def __call__(self, x, k_cache, v_cache, md: AttentionMetadata, *, scales=None):
        """Returns ``(x, k_cache, v_cache)``; with ``scales`` (the ``(k_scale, v_scale)``
        buffers of an FP8 cache, ``fp8_kv``) ``(x, k_cache, v_cache, scales)``. Attention
        runs ``cfg``'s kernel (``attention_impl``, ``pallas_interpret``)."""
        cfg = self.cfg
        T = x.shape[0]
        QH, KVH, D = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq, rope_scale = rope_inv_freq(D, cfg.rope_theta, cfg.rope_params)
        inv_freq = jnp.asarray(inv_freq)
        params = {name: getattr(self, name).get_value() for name in self.param_names}
        num_real_tokens = md.cu_q_lens[-1]     # rows from here on are the bucket's padding

        def project(h, p, group):
            return linear_group(h, p, group, LINEAR_GROUPS[group], num_real_tokens)

        def layer_step(carry, xs):
            x, k_cache, v_cache, scales = carry
            p, layer = xs
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
            q, k, v = project(h, p, "wqkv")
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(T, QH, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
            if cfg.qk_norm:
                q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
            q = apply_rope(q, md.positions, inv_freq, rope_scale)
            k = apply_rope(k, md.positions, inv_freq, rope_scale)
            attn, k_cache, v_cache, *rest = paged_attention(
                cfg, q, k, v, k_cache, v_cache, layer, md, sm_scale=D ** -0.5, scales=scales)
            scales = rest[0] if rest else None
            (out,) = project(attn.reshape(T, QH * D), p, "wo")
            x = x + out
            h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
            gate, up = project(h, p, "w_gate_up")
            (down,) = project(jax.nn.silu(gate) * up, p, "w_down")
            x = x + down
            return (x, k_cache, v_cache, scales), None

        carry = (x, k_cache, v_cache, scales)
        if _is_unrolled(params["input_norm"]):
            for i in range(cfg.num_layers):
                carry, _ = layer_step(carry, ({name: w[i] for name, w in params.items()}, i))
        else:
            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            carry, _ = jax.lax.scan(layer_step, carry, (params, layers))
        return carry if scales is not None else carry[:3]

    def unstack(self) -> None:
        """Split every stacked ``[L, ...]`` parameter into a tuple of ``L`` arrays, in place,
        each keeping the stack's sharding of its other axes (the stacked buffers are freed
        once nothing else holds them). Later forwards run the unrolled loop. Idempotent; run
        it before ``fuse_linear_weights``."""
        if _is_unrolled(self.input_norm.get_value()):
            return

        def per_layer(sharding, ndim):
            if not isinstance(sharding, NamedSharding):
                return sharding
            spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
            return NamedSharding(sharding.mesh, P(*spec[1:]))

        stacked = {name: getattr(self, name).get_value() for name in self.param_names}
        split = jax.jit(  # one executable for every parameter
            lambda st: {n: tuple(a[i] for i in range(a.shape[0])) for n, a in st.items()},
            out_shardings={n: per_layer(a.sharding, a.ndim) for n, a in stacked.items()})
        for name, layers in split(stacked).items():
            getattr(self, name).set_value(layers)

    def fuse_linear_weights(self, fuse) -> None:
        """Replace the members of each ``LINEAR_GROUPS`` group by ``fuse(member weights)``
        (one weight of the group's name, e.g. ``PackedWeight.from_linear``), in place, stacked
        or per layer as they are. One group at a time, so the peak is the weights plus one
        group. Idempotent."""
        if "wq" not in self.param_names:      # fused already
            return
        unrolled = _is_unrolled(self.input_norm.get_value())

        def fuse_group(members):
            if unrolled:
                return tuple(fuse(list(ws)) for ws in zip(*members))
            return fuse(members)

        fuse_jit = jax.jit(fuse_group)
        for group, members in LINEAR_GROUPS.items():
            fused = fuse_jit([getattr(self, n).get_value() for n in members])
            for n in members:
                delattr(self, n)
            setattr(self, group, nnx.Param(fused))
        linears = {n for members in LINEAR_GROUPS.values() for n in members}
        self.param_names = (*(n for n in self.param_names if n not in linears), *LINEAR_GROUPS)


def llama_cache_spec(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                     row_align: int = 1) -> tuple:
    """The paged KV buffers of a model of ``cfg`` (``LlamaForCausalLM.cache_spec``)."""
    from pdjax.models.cache_spec import gqa_cache_spec

    return gqa_cache_spec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages=num_pages,
                          page_size=page_size, dtype=dtype, rows=row_align > 1)


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM (also Qwen2 and Qwen3) over a paged KV cache.

    ``__call__(input_ids [T] int32, k_cache, v_cache, md, logits_indices [N] int32)`` returns
    ``(logits [N, V] float32, k_cache, v_cache)``; caches are
    ``[L, num_pages, page_size, KVH * D]`` (``gqa_cache_spec``) and come back updated (donate
    them). The kernels are ``cfg``'s (``attention_impl``, ``pallas_interpret``: set by the
    loader from the platform profile).
    Weight layouts (chosen by the platform profile after loading, ``models/platform.py``):
    ``unstack_layers`` (faster steps on XLA CPU, longer compiles) and ``fuse_linear_weights``
    (another weight format, e.g. ``linear.PackedWeight``); the forward reads whichever it holds.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = DecoderLayers(cfg, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def hidden_states(self, input_ids, k_cache, v_cache, md: AttentionMetadata, scales=None):
        """``(x [T, H], k_cache, v_cache)``, plus ``scales`` updated when given (the
        ``(k_scale, v_scale)`` buffers of an FP8 cache; ``DecoderLayers``)."""
        x = self.embed_tokens[...][input_ids]
        return self.layers(x, k_cache, v_cache, md, scales=scales)

    def compute_logits(self, h: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """``h [N, H]`` (pre-norm hidden states) -> logits ``[N, V]`` float32. ``num_rows``
        (int32 scalar, traced; None: all): rows from it on are padding, which a packed head
        leaves 0 instead of computing (``linear``). A tied head is the embedding's transpose
        until ``fuse_linear_weights`` gives the model its own ``lm_head``."""
        h = rms_norm(h, self.norm[...], self.cfg.rms_norm_eps)
        w = self.lm_head.get_value() if hasattr(self, "lm_head") else self.embed_tokens[...].T
        return linear(h, w, num_rows).astype(jnp.float32)

    def unstack_layers(self) -> None:
        """One array per layer and an unrolled forward (``DecoderLayers.unstack``)."""
        self.layers.unstack()

    def fuse_linear_weights(self, fuse) -> None:
        """Store the layers' linear weights (``DecoderLayers.fuse_linear_weights``) and the LM
        head as ``fuse`` makes them: ``lm_head = fuse([head])``, a tied head from the
        embedding's transpose (the embedding stays for the token lookup). Idempotent."""
        if "wq" not in self.layers.param_names:      # fused already
            return
        self.layers.fuse_linear_weights(fuse)
        tied = self.cfg.tie_word_embeddings
        head = self.embed_tokens[...] if tied else self.lm_head[...]
        self.lm_head = nnx.Param(jax.jit(lambda w: fuse([w.T if tied else w]))(head))

    def cache_spec(self, num_pages: int, page_size: int, dtype, row_align: int = 1) -> tuple:
        """The paged KV buffers this model reads and writes (``k_cache``, ``v_cache``).
        With ``row_align > 1`` (TPU, ``lanes.kv_row_align``) the caches are rows
        ``[.., KVH * D]`` (whole lanes for head_dim 128; not padded: TP splits a row between
        heads), else ``[.., KVH, D]``."""
        return llama_cache_spec(self.cfg, num_pages, page_size, dtype, row_align)

    def paged_forward(self, input_ids, caches: dict, md: AttentionMetadata):
        """The engine's model interface: ``(hidden [T, H], caches)`` with ``caches`` the dict
        of buffers named by ``cache_spec`` (an FP8 cache: ``k_scale``/``v_scale`` too)."""
        from pdjax.models.cache_spec import GQA_SCALE_BUFFERS

        scales = (tuple(caches[n] for n in GQA_SCALE_BUFFERS)
                  if GQA_SCALE_BUFFERS[0] in caches else None)
        x, k, v, *rest = self.hidden_states(input_ids, caches["k_cache"], caches["v_cache"], md,
                                            scales=scales)
        out = {"k_cache": k, "v_cache": v}
        if rest:
            out.update(zip(GQA_SCALE_BUFFERS, rest[0]))
        return x, out

    def __call__(self, input_ids, k_cache, v_cache, md: AttentionMetadata, logits_indices,
                 scales=None):
        """``(logits, k_cache, v_cache)``, plus the updated ``scales`` when given."""
        x, k_cache, v_cache, *rest = self.hidden_states(input_ids, k_cache, v_cache, md,
                                                        scales=scales)
        return (self.compute_logits(x[logits_indices]), k_cache, v_cache, *rest)


def param_partition_specs(cfg: ModelConfig, tp_size: int) -> dict[str, P]:
    """Partition spec of every top-level parameter path (``"layers.wq"``, ``"embed_tokens"``).

    The vocabulary is split over ``tp`` for the LM head when it divides evenly.
    """
    specs = {f"layers.{name}": P(None, *spec) for name, (_, spec) in layer_param_shapes(cfg).items()}
    specs["embed_tokens"] = P()
    specs["norm"] = P()
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, "tp") if cfg.vocab_size % tp_size == 0 else P()
    return specs


