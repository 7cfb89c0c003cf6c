"""The DeepSeek-V3 mixture of experts: grouped top-k routing (noaux_tc) and the routed plus
shared experts of one MoE layer (a grouped GEMM over token copies sorted by expert: the Pallas
kernel on TPU / GPU, ``lax.ragged_dot`` otherwise)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.linear import Fp8BlockWeight, dense_weight, fp8_spec, linear
from pdjax.pallas_kernels.grouped_gemm import KERNEL_IMPLS, grouped_matmul
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl
from pdjax.pallas_kernels.tp_shard import tp_size


def swiglu(h, w_gate, w_up, w_down):
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


def grouped_swiglu(cfg: DeepseekConfig, xs: jax.Array, group_sizes: jax.Array, w_gate, w_up,
                   w_down) -> jax.Array:
    """The routed experts' SwiGLU MLP over token rows sorted by expert (a grouped GEMM).

    ``xs [M, H]``: rows sorted by expert, the first ``group_sizes[0]`` rows for expert 0, the
    next ``group_sizes[1]`` for expert 1, and so on. ``group_sizes [E]`` int32 (traced; rows
    from ``sum(group_sizes)`` on belong to no expert and come back 0). ``w_gate``, ``w_up``:
    ``[E, H, F]``; ``w_down``: ``[E, F, H]``; plain arrays or ``Fp8BlockWeight`` stacks
    (or their layer views, ``linear.slice_layer``).
    Returns ``ys [M, H]`` of ``xs``'s dtype:
    ``ys[r] = (silu(xs[r] @ w_gate[e]) * (xs[r] @ w_up[e])) @ w_down[e]`` for the expert ``e``
    of row ``r``.

    Expert parallelism calls this with the local experts only (``E`` of this device).
    The kernel is ``cfg``'s choice (``cfg.attention_impl``, resolved as
    ``ragged_paged_attention.resolve_impl``): ``"tpu"`` / ``"gpu"`` run the Pallas grouped
    GEMM (``pallas_kernels/grouped_gemm``: only the rows routed to each expert are read, FP8
    tiles widened in the kernel); the others the reference, ``lax.ragged_dot`` with FP8
    stacks dequantized first (DESIGN.md §2, §5). ``cfg.pallas_interpret``: run the Pallas
    kernel interpreted (CPU tests).

    Tensor parallelism: with the weights split over the mesh's ``"tp"`` axis as
    ``param_groups`` lays them out (gate / up by F, down by F), the kernel runs per shard and
    the partial sums are added (``psum``); inside a ``shard_map`` already manual over
    ``"tp"``, the weights are this shard's and ``ys`` is its partial sum, as ragged_dot's is.
    """
    impl = resolve_impl(cfg.attention_impl)
    if impl in KERNEL_IMPLS:
        return _grouped_swiglu_kernel(xs, group_sizes, w_gate, w_up, w_down, impl,
                                      cfg.pallas_interpret)
    gate = jax.lax.ragged_dot(xs, dense_weight(w_gate, xs.dtype), group_sizes)
    up = jax.lax.ragged_dot(xs, dense_weight(w_up, xs.dtype), group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, dense_weight(w_down, xs.dtype),
                              group_sizes)


def _gmm(x, w, group_sizes, impl, interpret):
    if isinstance(w, Fp8BlockWeight):       # a layer view reads its layer from the stack
        return grouped_matmul(x, w.q, group_sizes, w.scale_inv, layer=w.layer, impl=impl,
                              interpret=interpret)
    return grouped_matmul(x, w.astype(x.dtype), group_sizes, impl=impl, interpret=interpret)


def _grouped_swiglu_kernel(xs, group_sizes, w_gate, w_up, w_down, impl, interpret):
    def local(xs, group_sizes, w_gate, w_up, w_down):
        gate = _gmm(xs, w_gate, group_sizes, impl, interpret)
        up = _gmm(xs, w_up, group_sizes, impl, interpret)
        return _gmm(jax.nn.silu(gate) * up, w_down, group_sizes, impl, interpret)

    mesh = jax.sharding.get_abstract_mesh()
    if tp_size() == 1 or "tp" in mesh.manual_axes:
        return local(xs, group_sizes, w_gate, w_up, w_down)
    split_f, split_k = P(None, None, "tp"), P(None, "tp", None)
    specs = (fp8_spec(w_gate, split_f), fp8_spec(w_up, split_f), fp8_spec(w_down, split_k))
    return jax.shard_map(lambda *a: jax.lax.psum(local(*a), "tp"), mesh=mesh,
                         in_specs=(P(), P(), *specs), out_specs=P(),
                         check_vma=False)(xs, group_sizes, w_gate, w_up, w_down)


def moe_forward(cfg: DeepseekConfig, h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Routed experts (``grouped_swiglu`` over token copies sorted by expert, with ``cfg``'s
    kernel) plus the shared experts. ``h [T, Hd]`` -> ``[T, Hd]``."""
    T, Hd = h.shape
    k = cfg.num_experts_per_tok
    experts, weights = route(cfg, h, p["router"], p["router_bias"])
    flat = experts.reshape(-1)                                                   # [T*k]
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.zeros((cfg.n_routed_experts,), jnp.int32).at[flat].add(1)
    xs = h[token]                                                                # [T*k, Hd]
    ys = grouped_swiglu(cfg, xs, group_sizes, p["w_gate"], p["w_up"], p["w_down"])  # [T*k, Hd]
    ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
    out = jnp.zeros((T, Hd), ys.dtype).at[token].add(ys)
    if cfg.n_shared_experts:
        out = out + swiglu(h, p["sh_gate"], p["sh_up"], p["sh_down"])
    return out.astype(h.dtype)
