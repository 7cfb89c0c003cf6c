"""Llama / Qwen2 / Qwen3 decoder (GQA) as a Flax NNX module over the paged KV cache.

One module serves the three architectures; they differ only in rows of ``ModelConfig``:
Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm on q and k. Layer parameters are stacked
on a leading ``[layers]`` axis and the forward is a ``lax.scan`` over layers that carries the
stacked KV cache (compile time independent of depth; DESIGN.md §2). ``unroll_layers`` trades
that for speed: ``DecoderLayers.unstack`` splits the stacked parameters into one array per
layer and the forward becomes a Python loop over them (MaxText's ``scan_layers=False``). On XLA
CPU a scan copies each layer's weight slice out of the stack before its matmuls (a dynamic
slice feeding a library call cannot be read in place): SmolLM2's 30 layers, 16 decode rows,
118-128 ms a step scanned against 96-108 ms unrolled, for 3-5x the compile time per shape.

Shapes: ``T`` tokens of the flat stream, ``H`` hidden, ``QH``/``KVH`` query/KV heads, ``D`` head
dim, ``F`` MLP width, ``V`` vocabulary, ``L`` layers. Linear weights are stored ``[in, out]``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax.config import ModelConfig
from pdjax.models.attention import AttentionMetadata, paged_attention
from pdjax.models.layers import apply_rope, rms_norm, rope_inv_freq
from pdjax.pallas_kernels.dense_cpu import pack_weight, packed_matmul
from pdjax.pallas_kernels.ragged_paged_attention import TRACED_BOUND_IMPLS


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


# The packed projections of ``pack_for_cpu`` and the weights each one concatenates (along the
# output axis), so that q/k/v and gate/up are one matmul each.
PACKED_GROUPS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
                 "w_down": ("w_down",)}


class DecoderLayers(nnx.Module):
    """All decoder layers, parameters stacked as ``[L, ...]``, applied with ``lax.scan``; after
    ``unstack``, a tuple of ``L`` per-layer arrays each, applied in an unrolled loop. After
    ``pack_for_cpu`` the linear weights are the packed groups of ``PACKED_GROUPS``."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.unrolled = False
        self.packed = False
        self.param_names = tuple(layer_param_shapes(cfg))
        init = nnx.initializers.normal(0.02)
        for name, (shape, _) in layer_param_shapes(cfg).items():
            full = (cfg.num_layers, *shape)
            value = jnp.ones(full, dtype) if name.endswith("norm") else init(rngs.params(), full, dtype)
            setattr(self, name, nnx.Param(value))

    def __call__(self, x, k_cache, v_cache, md: AttentionMetadata, *, attention_impl=None,
                 interpret=False):
        cfg = self.cfg
        T = x.shape[0]
        QH, KVH, D = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq, rope_scale = rope_inv_freq(D, cfg.rope_theta, cfg.rope_params)
        inv_freq = jnp.asarray(inv_freq)
        params = {name: getattr(self, name).get_value() for name in self.param_names}
        shapes = layer_param_shapes(cfg)
        num_real_tokens = md.cu_q_lens[-1]     # the packed matmul skips the padding rows

        def project(h, p, group):
            """``h`` times each weight of ``PACKED_GROUPS[group]``: one matmul each, or one
            fused matmul through the packed group, split along its output axis."""
            members = PACKED_GROUPS[group]
            if not self.packed:
                return [h @ p[n] for n in members]
            widths = [shapes[n][0][-1] for n in members]
            out = packed_matmul(h, p[group], sum(widths), num_rows=num_real_tokens)
            return jnp.split(out, list(itertools.accumulate(widths[:-1])), axis=-1)

        def layer_step(carry, xs):
            x, k_cache, v_cache = carry
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
            attn, k_cache, v_cache = paged_attention(
                q, k, v, k_cache, v_cache, layer, md, sm_scale=D ** -0.5,
                impl=attention_impl, interpret=interpret)
            (out,) = project(attn.reshape(T, QH * D), p, "wo")
            x = x + out
            h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
            gate, up = project(h, p, "w_gate_up")
            (down,) = project(jax.nn.silu(gate) * up, p, "w_down")
            x = x + down
            return (x, k_cache, v_cache), None

        carry = (x, k_cache, v_cache)
        if self.unrolled:
            for i in range(cfg.num_layers):
                carry, _ = layer_step(carry, ({name: w[i] for name, w in params.items()}, i))
            return carry
        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        carry, _ = jax.lax.scan(layer_step, carry, (params, layers))
        return carry

    def unstack(self) -> None:
        """Split every stacked ``[L, ...]`` parameter into a tuple of ``L`` arrays, in place,
        each keeping the stack's sharding of its other axes (the stacked buffers are freed
        once nothing else holds them). Later forwards run the unrolled loop. Idempotent."""
        if self.unrolled:
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
        self.unrolled = True

    def pack_for_cpu(self) -> None:
        """Replace the linear weights by the packed groups of ``PACKED_GROUPS``
        (``dense_cpu.pack_weight`` of the members concatenated along the output axis), in
        place, stacked or per layer as they are; later forwards multiply through
        ``dense_cpu.packed_matmul``. One group at a time, so the peak is the weights plus one
        group. One device only (the packed layout has no TP split). Idempotent."""
        if self.packed:
            return

        def pack_group(members):
            if self.unrolled:
                return tuple(pack_weight(jnp.concatenate(ws, axis=-1)) for ws in zip(*members))
            return pack_weight(jnp.concatenate(members, axis=-1))

        pack = jax.jit(pack_group)
        for group, members in PACKED_GROUPS.items():
            packed = pack([getattr(self, n).get_value() for n in members])
            for n in members:
                delattr(self, n)
            setattr(self, group, nnx.Param(packed))
        linear = {n for members in PACKED_GROUPS.values() for n in members}
        self.param_names = (*(n for n in self.param_names if n not in linear), *PACKED_GROUPS)
        self.packed = True


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM (also Qwen2 and Qwen3) over a paged KV cache.

    ``__call__(input_ids [T] int32, k_cache, v_cache, md, logits_indices [N] int32)`` returns
    ``(logits [N, V] float32, k_cache, v_cache)``; caches are
    ``[L, num_pages, page_size, KVH * D]`` (``gqa_cache_spec``) and come back updated (donate
    them).
    ``unroll_layers``: the engine unstacks the layer parameters before its first forward
    (``DecoderLayers.unstack``; faster steps, longer compiles). ``cpu_matmul_kernel``: the
    engine then packs the linear weights for the native CPU matmul (``pack_for_cpu``).
    """

    # Attention implementations whose cost follows kv_lens, not the page-table width P, so
    # that one pages-per-sequence bucket serves every batch (sched/buckets.py).
    TRACED_PAGES_BOUND_IMPLS = TRACED_BOUND_IMPLS

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_impl: str | None = None, interpret: bool = False,
                 unroll_layers: bool = False, cpu_matmul_kernel: bool = False):
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.interpret = interpret
        self.unroll_layers = unroll_layers
        self.cpu_matmul_kernel = cpu_matmul_kernel
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = DecoderLayers(cfg, dtype=dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def hidden_states(self, input_ids, k_cache, v_cache, md: AttentionMetadata):
        x = self.embed_tokens[...][input_ids]
        return self.layers(x, k_cache, v_cache, md, attention_impl=self.attention_impl,
                           interpret=self.interpret)

    def compute_logits(self, h: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """``h [N, H]`` (pre-norm hidden states) -> logits ``[N, V]`` float32. ``num_rows``
        (int32 scalar, traced; None: all): rows from it on are padding, whose logits the
        packed CPU head leaves 0 instead of computing (the XLA dot computes every row)."""
        h = rms_norm(h, self.norm[...], self.cfg.rms_norm_eps)
        if self.packed:
            return packed_matmul(h, self.lm_head_packed[...], self.cfg.vocab_size,
                                 num_rows=num_rows).astype(jnp.float32)
        w = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return (h @ w).astype(jnp.float32)

    @property
    def packed(self) -> bool:
        """Whether ``pack_for_cpu`` has run (the layers and the LM head pack together)."""
        return self.layers.packed

    def pack_for_cpu(self) -> None:
        """Pack the layers' linear weights (``DecoderLayers.pack_for_cpu``) and the LM head,
        as ``lm_head_packed`` (a tied head is packed from the embedding's transpose, which stays
        for the token lookup; an untied ``lm_head`` is replaced). Idempotent."""
        if self.packed:
            return
        self.layers.pack_for_cpu()
        tied = self.cfg.tie_word_embeddings
        head = self.embed_tokens[...] if tied else self.lm_head[...]
        self.lm_head_packed = nnx.Param(jax.jit(lambda w: pack_weight(w.T if tied else w))(head))
        if not tied:
            del self.lm_head

    def cache_spec(self, num_pages: int, page_size: int, dtype, row_align: int = 1) -> tuple:
        """The paged KV buffers this model reads and writes (``k_cache``, ``v_cache``).
        ``row_align`` is ignored: TP splits a GQA row between heads, so it is not padded
        (``pallas_kernels/lanes.py``)."""
        from pdjax.models.cache_spec import gqa_cache_spec

        del row_align

        cfg = self.cfg
        return gqa_cache_spec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              num_pages=num_pages, page_size=page_size, dtype=dtype)

    def paged_forward(self, input_ids, caches: dict, md: AttentionMetadata):
        """The engine's model interface: ``(hidden [T, H], caches)`` with ``caches`` the dict
        of buffers named by ``cache_spec``."""
        x, k, v = self.hidden_states(input_ids, caches["k_cache"], caches["v_cache"], md)
        return x, {"k_cache": k, "v_cache": v}

    def __call__(self, input_ids, k_cache, v_cache, md: AttentionMetadata, logits_indices):
        x, k_cache, v_cache = self.hidden_states(input_ids, k_cache, v_cache, md)
        return self.compute_logits(x[logits_indices]), k_cache, v_cache


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


def kv_cache_spec() -> P:
    """KV cache rows ``[L, pages, page_size, KVH * D]``: split between KV heads over ``tp``."""
    return P(None, None, None, "tp")
