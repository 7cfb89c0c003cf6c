"""DP attention for the MLA family (``--enable-dp-attention --dp-size N``; DESIGN.md §6).

Under plain TP every device holds the whole latent KV of every request (MLA has one KV
"head"), so the pool does not grow with the devices. With DP attention the ``tp`` devices
are read as ``dp_size`` ranks of ``attn_tp_size = tp / dp`` devices, device ``d`` in rank
``d // attn_tp_size``; each rank runs attention and the DSA indexer on its own requests
with the whole attention weights (replicated), against its own KV pages; the MLPs (dense,
shared and routed experts) stay split over all ``tp`` devices as under TP or EP (SGLang's
``dp_attention.py``: scatter, local attention, ``dp_gather``, MoE, ``dp_scatter``)::

    tokens  [dp * Ts]   rank r's padded segment at [r * Ts, (r + 1) * Ts); an idle rank's
                        segment is all padding (it writes the null page, attends to nothing)
    per layer, on device d of rank r = d // attn_tp_size:
      x_r [Ts, Hd] --attention + indexer (rank r's metadata, rank r's pages)--> x_r
      h_r = post_norm(x_r)
      all_gather over tp -> [tp, Ts, Hd] -> one copy per rank -> h [dp * Ts, Hd]  (DP gather)
      MLP on every token, this device's width slice / local experts -> partial [dp * Ts, Hd]
      psum_scatter over tp (rank r's segment to each of its devices) -> [Ts, Hd]   (DP scatter)
      x_r += that

The KV buffers are ``[L, tp * Np, page_size, W]`` sharded ``P(None, "tp")`` on the page
axis: each device holds ``Np`` pages, its rank's pool (``attn_tp_size > 1``: each device of
a rank a copy of it, written alike). Page ids in the metadata are a rank's own, ``0 ..
Np - 1``, page 0 its null page. The metadata is ``AttentionMetadata`` with a leading ``[dp]``
axis on every array (``sched/dp_batch.py`` builds it). With ``attn_tp_size > 1`` the devices
of a rank compute its attention redundantly (the attention weights are not split within a
rank): the KV per device is a rank's, as SGLang's MLA DP attention has it.

MoE dispatch under DP attention, by ``moe_a2a_backend``:

- ``none``: the gather scheme above. Every device sees every rank's tokens after the DP
  gather and runs the copies routed to its own experts (EP) or its width slice of every
  expert (TP); the DP scatter sums the partials.
- ``ragged`` (EP): no DP gather in the MoE layers. Each device routes its slice of its
  rank's tokens and sends the copies to their experts' devices with ``ragged_all_to_all``
  (``moe_ep.moe_forward_dp_ragged``); the shared experts are replicated (``param_groups``)
  and run on the device's slice, as SGLang runs them with DeepEP; the rank's slices are
  put together by collective permutes. The dense layers keep the DP gather and scatter
  (their weights stay split over ``tp``, SGLang's default ``--moe-dense-tp-size``).

Sources: ``shared/reference/
moe_at_scale.md`` §2c (sglang-jax ``[dp_size, per_dp_bs]`` metadata, tpu-inference's
``attn_dp`` axis), §3 (SGLang).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P

from pdjax.models.attention import AttentionMetadata
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.deepseek_params import param_groups
from pdjax.models.linear import Fp8BlockWeight
from pdjax.models.moe import grouped_swiglu, moe_forward, route, swiglu
from pdjax.models.moe_ep import EXPERT_WEIGHTS, _local_experts, moe_forward_dp_ragged

PAGE_SPEC = P(None, "tp")      # a KV buffer [L, tp * Np, ...]: Np pages per device


def check_dp_attention(cfg: DeepseekConfig, tp_size: int, dp_size: int) -> None:
    """``ValueError`` naming the field when ``cfg`` (its EP already set) cannot run DP
    attention ``dp_size`` on ``tp_size`` devices: ``dp_size`` < 1 or not dividing
    ``tp_size``."""
    del cfg             # every MoE layout and dispatch backend runs under DP attention
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: must be a positive integer, got {dp_size!r}")
    if tp_size % dp_size:
        raise ValueError(f"dp_size: {dp_size} must divide tp_size ({tp_size}): the DP "
                         "attention ranks split the devices of the TP group")


def dp_attention_config(cfg: DeepseekConfig, tp_size: int, dp_size: int) -> DeepseekConfig:
    """``cfg`` running DP attention ``dp_size`` on ``tp_size`` devices
    (``check_dp_attention`` first): ``dp_size`` and ``attn_tp_size = tp_size / dp_size``
    set; ``dp_size`` 1 returns ``cfg`` unchanged."""
    check_dp_attention(cfg, tp_size, dp_size)
    if dp_size == 1:
        return cfg
    return dataclasses.replace(cfg, dp_size=dp_size, attn_tp_size=tp_size // dp_size)


def dp_cache_specs(specs: tuple, cfg: DeepseekConfig) -> tuple:
    """The ``CacheBufferSpec``s of one rank's pool (``[L, Np, ps, W]``, replicated) as the
    DP pool: ``[L, tp * Np, ps, W]`` sharded ``PAGE_SPEC`` (``Np`` pages a device)."""
    tp = cfg.dp_size * cfg.attn_tp_size
    return tuple(dataclasses.replace(s, shape=(s.shape[0], tp * s.shape[1], *s.shape[2:]),
                                     partition=PAGE_SPEC) for s in specs)


def _param_specs(cfg: DeepseekConfig, params: dict) -> dict:
    """``shard_map`` specs of the stacked ``params`` (group -> name -> value), from
    ``param_groups``: ``P(None, *spec)`` (the layer axis first); an ``Fp8BlockWeight``'s
    scales as its values."""
    groups = param_groups(cfg)
    out = {}
    for group, values in params.items():
        shapes = groups[group][1]
        out[group] = {}
        for name, value in values.items():
            spec = P(None, *shapes[name][1])
            out[group][name] = (dataclasses.replace(value, q=spec, scale_inv=spec)
                                if isinstance(value, Fp8BlockWeight) else spec)
    return out


def dp_decoder_layers(cfg: DeepseekConfig, params: dict, x: jax.Array,
                      caches: dict[str, jax.Array], md: AttentionMetadata, *,
                      rank_layers: Callable):
    """``rank_layers`` (``deepseek.decoder_layers``, passed in: the model module imports this
    one) under DP attention (the module docstring's step).

    ``x [dp * Ts, Hd]``: rank ``r``'s tokens at ``[r * Ts, (r + 1) * Ts)``. ``caches``:
    ``[L, tp * Np, ...]`` buffers (``dp_cache_specs``). ``md``: every array with a leading
    ``[dp]`` axis (``positions [dp, Ts]``, ``page_indices [dp, R, P]``, ...; page ids a
    rank's own). ``params``: stacked as ``param_groups(cfg)`` lays them out (plain or
    ``Fp8BlockWeight``). Returns ``(x [dp * Ts, Hd], caches)``. Traced under a mesh with a
    ``tp`` axis of ``dp_size * attn_tp_size`` devices (``ValueError`` for another one), or
    without a mesh (the CPU runner's case: one is made from ``cfg``)."""
    dp, a = cfg.dp_size, cfg.attn_tp_size
    tp = dp * a
    mesh = jax.sharding.get_abstract_mesh()
    # ragged dispatch: its padded all_to_all stand-in on XLA:CPU (moe_ep.py)
    padded = mesh.empty or mesh.abstract_device.platform == "cpu"
    if mesh.empty:
        mesh = AbstractMesh((tp,), ("tp",))
    elif "tp" not in mesh.axis_names or mesh.shape["tp"] != tp:
        raise ValueError(f"dp_size: the model runs DP attention {dp} x attn_tp {a} on {tp} "
                         f"devices, but the mesh is {mesh}")
    if x.shape[0] % dp:
        raise ValueError(f"x: {x.shape[0]} tokens do not split into {dp} rank segments")
    if md.positions.ndim != 2 or md.positions.shape[0] != dp:
        raise ValueError(f"md: DP attention metadata has a leading [dp={dp}] axis; got "
                         f"positions of shape {md.positions.shape}")
    Ts = x.shape[0] // dp
    mlp = functools.partial(_dp_mlp, cfg=cfg, padded=padded)

    def body(x, caches, md, params):
        rank = jax.lax.axis_index("tp") // a
        x_r = jax.lax.dynamic_slice_in_dim(x, rank * Ts, Ts)
        md_r = jax.tree.map(lambda v: v[rank], md)
        # rows from cu_q_lens[-1] on are the segment's padding: ragged does not send them
        x_r, caches = rank_layers(cfg, params, x_r, caches, md_r,
                                  mlp=functools.partial(mlp, num_tokens=md_r.cu_q_lens[-1]))
        return _gather_ranks(x_r, a), caches

    cache_specs = {name: PAGE_SPEC for name in caches}
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.shard_map(body, mesh=mesh,
                             in_specs=(P(), cache_specs, P(), _param_specs(cfg, params)),
                             out_specs=(P(), cache_specs), check_vma=False)(x, caches, md, params)


def _gather_ranks(x_r, a):
    """The DP gather: ``x_r [Ts, ...]`` of every device -> ``[dp * Ts, ...]``, one copy per
    rank (the first of its ``a`` devices)."""
    xs = jax.lax.all_gather(x_r, "tp")[::a]                                  # [dp, Ts, ...]
    return xs.reshape(-1, *x_r.shape[1:])


def _dp_mlp(kind, h_r, m, *, cfg, padded, num_tokens):
    """The MLP of one layer on device ``d`` under DP attention: ``h_r [Ts, Hd]`` (rank
    ``d // attn_tp_size``'s tokens) -> the MLP output for them ``[Ts, Hd]``, computed over
    every rank's tokens (DP gather), this device's share summed with ``psum_scatter``; an
    MoE layer with the ``ragged`` backend from the rank's own ``num_tokens`` real tokens
    instead (``moe_ep.moe_forward_dp_ragged``; ``padded``: its CPU stand-in)."""
    if kind == "sparse" and cfg.moe_a2a_backend == "ragged":
        return moe_forward_dp_ragged(cfg, h_r, m, padded=padded, num_tokens=num_tokens)
    dp, a = cfg.dp_size, cfg.attn_tp_size
    Ts = h_r.shape[0]
    h = _gather_ranks(h_r, a)                                                # [dp * Ts, Hd]
    if kind == "dense":
        y = swiglu(h, m["w_gate"], m["w_up"], m["w_down"])
    elif cfg.ep_size > 1:
        y = _ep_partial(cfg, h, m)
    else:       # experts split by width: moe_forward on this device's slices is its partial
        y = moe_forward(cfg, h, m)
    y = jnp.repeat(y.reshape(dp, Ts, -1), a, axis=0)                         # [tp, Ts, Hd]
    return jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=False).astype(h_r.dtype)


def _ep_partial(cfg, h, m):
    """This device's part of the MoE under EP (``moe_ep``'s ``none`` dispatch without its
    ``psum``): the token copies of ``h [T, Hd]`` routed to its local experts, plus its width
    slice of the shared experts. Returns ``[T, Hd]``."""
    T = h.shape[0]
    experts, weights = route(cfg, h, m["router"], m["router_bias"])
    k = experts.shape[1]
    El = cfg.n_routed_experts // cfg.ep_size
    first = (jax.lax.axis_index("tp") % cfg.ep_size) * El
    local = experts.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < El), local, El)
    gemm = functools.partial(grouped_swiglu, cfg)
    ys = _local_experts(gemm, jnp.repeat(h, k, axis=0), key,
                        tuple(m[n] for n in EXPERT_WEIGHTS), El)                  # [T*k, Hd]
    out = (ys.reshape(T, k, -1) * weights[..., None].astype(ys.dtype)).sum(1)
    if cfg.n_shared_experts:
        out = out + swiglu(h, m["sh_gate"], m["sh_up"], m["sh_down"])
    return out


def dp_collective_bytes(cfg: DeepseekConfig, tokens_per_rank: int, itemsize: int) -> int:
    """Bytes each device receives in one forward's DP gathers and scatters: per gathered
    layer one ``all_gather`` of ``[Ts, Hd]`` and one ``psum_scatter`` of ``[tp, Ts, Hd]``
    over the ``tp`` devices (ring algorithms: ``(tp - 1) * Ts * Hd`` elements each), plus the
    final gather of the hidden states: ``(2 Lg + 1) (tp - 1) Ts Hd itemsize``, ``Lg`` every
    layer (backend ``none``) or the dense layers only (``ragged``: an MoE layer instead puts
    its rank's slices together, ``(a - 1) ceil(Ts / a) Hd`` with ``a = attn_tp_size``; its
    dispatch and combine are not counted here). ``tokens_per_rank``: the bucket's padded
    segment ``Ts``; ``itemsize``: bytes of the activations' dtype."""
    tp, a = cfg.dp_size * cfg.attn_tp_size, cfg.attn_tp_size
    Ts, Hd = tokens_per_rank, cfg.hidden_size
    if cfg.moe_a2a_backend != "ragged":
        return (2 * cfg.num_layers + 1) * (tp - 1) * Ts * Hd * itemsize
    gathered = (2 * len(cfg.dense_layers) + 1) * (tp - 1) * Ts
    slices = len(cfg.moe_layers) * (a - 1) * -(-Ts // a)
    return (gathered + slices) * Hd * itemsize
