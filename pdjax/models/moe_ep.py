"""Expert parallelism (EP) for the DeepSeek MoE (``--ep-size``, ``--moe-a2a-backend``).

The routed experts are split over the ``tp`` mesh axis by expert, not by width: the ``tp``
devices are read as an ``(moe_tp, ep)`` grid, device ``d`` = ``t * ep + b``, and device ``d``
holds experts ``[b * El, (b + 1) * El)`` (``El = E / ep``) at width ``Fm / moe_tp``, slice
``t`` (``moe_tp = tp / ep``, the MoE's TP inside an EP group; SGLang's ``--ep-size``, the
``(expert, tensor)`` mesh of sglang-jax's ``EPMoE``). The stored stacks are
``[moe_tp * E, Hd, Fm / moe_tp]`` (``w_down`` ``[moe_tp * E, Fm / moe_tp, Hd]``), entry
``t * E + e`` = expert ``e``'s slice ``t``, sharded ``P("tp")`` on that first axis, so each
device's block is exactly its local experts (``expert_shards``; ``moe_tp = 1``: the HF
``[E, Hd, Fm]`` order). Attention, the router and the shared experts stay as under TP.

Dispatch backends (``A2A_BACKENDS``), both dropless, inside one ``jax.shard_map`` over ``tp``;
every device returns a partial ``[T, Hd]`` and one ``psum`` sums them (the collective plain TP
already ends the MoE with)::

    none    every device has every token (TP attention): it runs the token copies routed to
            its own experts (the others sort last and are not computed) -> psum
    ragged  token chunk b of T/ep goes from devices (t, b) to the owners of its copies'
            experts (lax.ragged_all_to_all, within the devices of slice t), which run them
            and send the rows back; each device weights its chunk's rows -> psum

Under DP attention (``dp_attention.py``) tokens are not replicated: ``ragged`` then sends
from each device's slice of its own rank's tokens to the owners of its copies' experts at
every width slice, with no DP gather (``moe_forward_dp_ragged``).

``ragged_all_to_all`` is not implemented on XLA:CPU (jax-ml/jax#34755): there a padded
``all_to_all`` with the dropless capacity (every copy of a chunk to one peer) stands in, so
the CPU tests run the same dispatch plan. Routing (grouped top-k with
``e_score_correction_bias``) is ``moe.route``'s; the expert compute is ``moe.grouped_swiglu``
over the local experts only. Sources: ``docs/DESIGN.md`` §6; sglang-jax ``EPMoE``,
tpu-inference ``expert_parallel_gmm``, MaxText ``ra2a_and_route`` (``shared/reference/
moe_at_scale.md`` §2b).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec as P

from pdjax.config import MOE_A2A_BACKENDS as A2A_BACKENDS
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import LazyStack
from pdjax.models.linear import fp8_spec
from pdjax.models.moe import grouped_swiglu, route, swiglu

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


# --------------------------------------------------------------------------- configuration

def check_expert_parallel(cfg: DeepseekConfig, tp_size: int, ep_size: int,
                          moe_a2a_backend: str = "none") -> None:
    """``ValueError`` naming the field when ``ep_size`` cannot split ``cfg``'s experts on
    ``tp_size`` devices: ``moe_a2a_backend`` not in ``A2A_BACKENDS``; ``ep_size`` < 1 or not
    dividing ``tp_size``; a model without routed experts (``ep_size > 1``); experts not
    divisible by ``ep_size``; ``moe_intermediate_size`` not divisible by ``tp_size / ep_size``,
    or (FP8) its slices not whole ``weight_block_size`` blocks."""
    if moe_a2a_backend not in A2A_BACKENDS:
        raise ValueError(f"moe_a2a_backend: must be one of {', '.join(A2A_BACKENDS)}; got "
                         f"{moe_a2a_backend!r}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: must be a positive integer, got {ep_size!r}")
    if tp_size % ep_size:
        raise ValueError(f"ep_size: {ep_size} must divide tp_size ({tp_size}): the experts "
                         "are split over the devices of the TP group")
    if ep_size == 1:
        return
    if not cfg.moe_layers or not cfg.n_routed_experts:
        raise ValueError(f"ep_size: {cfg.architecture} has no routed experts (ep_size "
                         f"{ep_size} needs an MoE model)")
    E, Fm, moe_tp = cfg.n_routed_experts, cfg.moe_intermediate_size, tp_size // ep_size
    if E % ep_size:
        raise ValueError(f"ep_size: {ep_size} must divide n_routed_experts ({E})")
    if Fm % moe_tp:
        raise ValueError(f"ep_size: tp_size / ep_size ({moe_tp}) must divide "
                         f"moe_intermediate_size ({Fm})")
    B = cfg.weight_block_size
    if B and moe_tp > 1 and (Fm // moe_tp) % B:
        raise ValueError(f"ep_size: tp_size / ep_size ({moe_tp}) cuts the FP8 scale blocks "
                         f"of the experts: moe_intermediate_size {Fm} splits into "
                         f"{Fm // moe_tp}, not a multiple of {B} (weight_block_size)")


def expert_parallel_config(cfg: DeepseekConfig, tp_size: int, ep_size: int,
                           moe_a2a_backend: str = "none") -> DeepseekConfig:
    """``cfg`` running EP ``ep_size`` on ``tp_size`` devices (``check_expert_parallel``
    first): ``ep_size``, ``moe_tp_size = tp_size / ep_size`` and ``moe_a2a_backend`` set;
    ``ep_size`` 1 returns ``cfg`` unchanged (plain TP)."""
    check_expert_parallel(cfg, tp_size, ep_size, moe_a2a_backend)
    if ep_size == 1:
        return cfg
    return dataclasses.replace(cfg, ep_size=ep_size, moe_tp_size=tp_size // ep_size,
                               moe_a2a_backend=moe_a2a_backend)


def expert_shards(w, moe_tp: int, width_axis: int):
    """A stack of experts ``[..., E, ...]`` (the expert axis third from the end, the width
    ``Fm`` at ``width_axis``, -1 or -2) in the EP layout ``[..., moe_tp * E, ...]``: entry
    ``t * E + e`` = expert ``e``'s width slice ``t`` of ``Fm / moe_tp`` (FP8 block scales
    the same way, in blocks). ``w``: numpy or a ``fp8.LazyStack`` (stays lazy: slices of
    its parts); ``moe_tp`` 1 returns ``w``."""
    if moe_tp == 1:
        return w
    if isinstance(w, LazyStack):
        if w.ndim > 3:                                      # the layer axis
            return LazyStack([expert_shards(p, moe_tp, width_axis) for p in w.parts])
        F = w.shape[width_axis]
        step = F // moe_tp

        def piece(part, t):
            index = [slice(None)] * part.ndim
            index[width_axis] = slice(t * step, (t + 1) * step)
            return part[tuple(index)]

        return LazyStack([piece(part, t) for t in range(moe_tp) for part in w.parts])
    w = np.asarray(w)
    axis = w.ndim + width_axis
    F = w.shape[axis]
    split = w.reshape(*w.shape[:axis], moe_tp, F // moe_tp, *w.shape[axis + 1:])
    split = np.moveaxis(split, axis, w.ndim - 3)            # [..., moe_tp, E, ...]
    return split.reshape(*w.shape[:-3], moe_tp * w.shape[-3], *split.shape[w.ndim - 1:])


# --------------------------------------------------------------------------- forward

def moe_forward_ep(cfg: DeepseekConfig, h: jax.Array, p: dict) -> jax.Array:
    """The MoE layer under EP: ``h [T, Hd]`` (replicated: TP attention) -> ``[T, Hd]``, equal
    to ``moe.moe_forward`` (same routing, same experts, dropless). ``p``: the layer's ``moe``
    params, the expert stacks in the EP layout (``expert_shards``), plain or
    ``Fp8BlockWeight``. Traced under a mesh with a ``tp`` axis of ``ep_size * moe_tp_size``
    devices (the runner's on accelerators), ``ValueError`` for another one; without a mesh
    context (the CPU runner's case) one is made from ``cfg`` and ``ragged`` takes its padded
    stand-in, which runs on every platform. The grouped GEMM (``moe.grouped_swiglu``, with
    ``cfg``'s kernel) runs per device on its local experts."""
    tp = cfg.ep_size * cfg.moe_tp_size
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh, platform = AbstractMesh((tp,), ("tp",)), "cpu"
    else:
        if "tp" not in mesh.axis_names or mesh.shape["tp"] != tp:
            raise ValueError(f"ep_size: the model runs EP {cfg.ep_size} x moe_tp "
                             f"{cfg.moe_tp_size} on {tp} devices, but the mesh is {mesh}")
        platform = mesh.abstract_device.platform
    experts, weights = route(cfg, h, p["router"], p["router_bias"])
    body = _dispatch_ragged if cfg.moe_a2a_backend == "ragged" else _dispatch_none
    gemm = functools.partial(grouped_swiglu, cfg)
    body = functools.partial(body, cfg=cfg, gemm=gemm, padded=platform == "cpu")
    ws = tuple(p[name] for name in EXPERT_WEIGHTS)
    # A kernel-run FP8 layer view (linear.slice_layer) keeps its [L, ...] stack: split axis 1.
    w_specs = tuple(fp8_spec(w, P("tp")) for w in ws)
    with jax.sharding.use_abstract_mesh(mesh):
        out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), w_specs),
                            out_specs=P(), check_vma=False)(h, experts, weights, ws)
    if cfg.n_shared_experts:
        out = out + swiglu(h, p["sh_gate"], p["sh_up"], p["sh_down"])
    return out.astype(h.dtype)


def _local_experts(gemm, xs, key, ws, num_local):
    """``xs [M, Hd]`` rows, ``key [M]`` their local expert (``num_local``: none of this
    device's) -> ``[M, Hd]``: each row through its expert's SwiGLU (``grouped_swiglu`` over
    the rows sorted by expert; the foreign rows sort last and are not computed), 0 for a
    foreign row."""
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((num_local + 1,), jnp.int32).at[key].add(1)[:num_local]
    ys = gemm(xs[order], group_sizes, *ws)
    ys = jnp.zeros_like(ys).at[order].set(ys)
    return jnp.where((key < num_local)[:, None], ys, 0)


def _dispatch_none(h, experts, weights, ws, *, cfg, gemm, padded):
    """One device, backend ``none``: every token copy routed to this device's experts, at
    its width slice; ``psum`` over ``tp``. ``h [T, Hd]``, ``experts``/``weights [T, k]``."""
    del padded
    T, k = experts.shape
    El = cfg.n_routed_experts // cfg.ep_size
    first = (jax.lax.axis_index("tp") % cfg.ep_size) * El
    local = experts.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < El), local, El)
    ys = _local_experts(gemm, jnp.repeat(h, k, axis=0), key, ws, El)              # [T*k, Hd]
    out = (ys.reshape(T, k, -1) * weights[..., None].astype(ys.dtype)).sum(1)
    return jax.lax.psum(out, "tp")


def _dispatch_ragged(h, experts, weights, ws, *, cfg, gemm, padded):
    """One device ``d = t * ep + b``, backend ``ragged``: token chunk ``b`` (``Tc = ceil(T /
    ep)`` tokens) is sent copy by copy to the devices ``t * ep + owner`` of its experts,
    run there, sent back, weighted and summed; ``psum`` over ``tp`` adds the chunks and the
    width slices. ``padded``: the CPU stand-in for ``ragged_all_to_all``."""
    T, k = experts.shape
    E, ep = cfg.n_routed_experts, cfg.ep_size
    El, tp = E // ep, ep * cfg.moe_tp_size
    Tc = -(-T // ep)
    me = jax.lax.axis_index("tp")
    b, t = me % ep, me // ep
    pad = Tc * ep - T
    h_pad = jnp.pad(h, ((0, pad), (0, 0)))
    valid = jnp.arange(Tc * ep) < T
    e_pad = jnp.where(valid[:, None], jnp.pad(experts, ((0, pad), (0, 0))), E)
    w_pad = jnp.pad(weights, ((0, pad), (0, 0)))
    hc = jax.lax.dynamic_slice_in_dim(h_pad, b * Tc, Tc)                    # [Tc, Hd]
    ec = jax.lax.dynamic_slice_in_dim(e_pad, b * Tc, Tc).reshape(-1)        # [M]; E: pad
    wc = jax.lax.dynamic_slice_in_dim(w_pad, b * Tc, Tc)                    # [Tc, k]
    M = Tc * k
    # Copies sorted by expert are sorted by owner; the padding (expert E) sorts last.
    order = jnp.argsort(ec, stable=True)
    ids = ec[order]
    owner = ids // El                                                        # ep: padding
    counts = jnp.zeros((ep + 1,), jnp.int32).at[owner].add(1)[:ep]
    # Peers over the whole tp axis; only those of my width slice t get rows.
    peers = jnp.arange(tp)
    send_sizes = jnp.where(peers // ep == t, counts[peers % ep], 0)         # [tp]
    exchange = _padded_exchange if padded else _ragged_exchange
    xs, rids, back = exchange(hc[order // k], ids, send_sizes, M, E, ep)   # ep senders each
    local = rids - b * El
    key = jnp.where((local >= 0) & (local < El), local, El)
    ys = back(_local_experts(gemm, xs, key, ws, El))                              # [M, Hd]
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(Tc, k, -1)
    chunk = (ys * wc[..., None].astype(ys.dtype)).sum(1)                    # [Tc, Hd]
    out = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((Tc * ep, chunk.shape[-1]), chunk.dtype), chunk, b * Tc, 0)
    return jax.lax.psum(out, "tp")[:T]


# --------------------------------------------------------------------------- DP attention

def moe_forward_dp_ragged(cfg: DeepseekConfig, h_r: jax.Array, p: dict, *, padded: bool,
                          num_tokens: jax.Array | None = None) -> jax.Array:
    """The MoE layer under DP attention with the ``ragged`` backend, on one device inside
    the DP ``shard_map`` (manual over ``tp``; ``dp_attention.py``): ``h_r [Ts, Hd]``, the
    tokens of the device's rank (alike on its ``a = attn_tp_size`` devices) -> the layer's
    output for them ``[Ts, Hd]``, equal to ``moe.moe_forward`` (same routing, dropless)
    on the first ``num_tokens`` (int32 scalar, traced: the rank's real tokens; None: all),
    with no DP gather; the segment's padding rows are not sent (their routed output is 0)::

        device d = rank * a + j: slice j of its rank's tokens, Tc = ceil(Ts / a) rows
        route the slice (moe.route): M = Tc * k copies, sorted by expert (= by owner)
        send every copy to its expert's device at each width slice t < moe_tp
          (t * ep + owner; ragged_all_to_all, on CPU the padded stand-in)
        each device runs the copies of its local experts at its width slice; rows go back
        sum the moe_tp width partials, weight, add the shared experts (replicated in this
          layout, ``param_groups``: run on the slice) -> [Tc, Hd]
        a - 1 collective permutes among the rank's devices assemble [Ts, Hd]

    ``p``: the layer's ``moe`` params as the DP ``shard_map`` hands them in (this device's
    experts in the EP layout, ``expert_shards``; router and shared experts whole).
    ``padded``: the CPU stand-in for ``ragged_all_to_all``. Every device may send to every
    other, so a device receives up to ``tp * M`` rows (the dropless capacity)."""
    Ts, Hd = h_r.shape
    a, ep, moe_tp = cfg.attn_tp_size, cfg.ep_size, cfg.moe_tp_size
    tp, E, k = ep * moe_tp, cfg.n_routed_experts, cfg.num_experts_per_tok
    El = E // ep
    me = jax.lax.axis_index("tp")
    j = me % a
    Tc = -(-Ts // a)
    hc = jax.lax.dynamic_slice_in_dim(jnp.pad(h_r, ((0, Tc * a - Ts), (0, 0))), j * Tc, Tc)
    real = Ts if num_tokens is None else jnp.minimum(num_tokens, Ts)
    valid = j * Tc + jnp.arange(Tc) < real                                    # [Tc]
    experts, weights = route(cfg, hc, p["router"], p["router_bias"])          # [Tc, k]
    ec = jnp.where(valid[:, None], experts, E).reshape(-1)                   # [M]; E: none
    M = Tc * k
    order = jnp.argsort(ec, stable=True)
    ids = ec[order]
    counts = jnp.zeros((ep + 1,), jnp.int32).at[ids // El].add(1)[:ep]      # per owner
    # Block t of the send buffer is the sorted copies again, for the devices of width slice t.
    peers = jnp.arange(tp)
    send_sizes = counts[peers % ep]                                          # [tp]
    in_offsets = (peers // ep) * M + _offsets(counts)[peers % ep]
    rows = jnp.tile(hc[order // k], (moe_tp, 1))                              # [moe_tp*M, Hd]
    exchange = _padded_exchange if padded else _ragged_exchange
    xs, rids, back = exchange(rows, jnp.tile(ids, moe_tp), send_sizes, M, E, tp, in_offsets)
    local = rids - (me % ep) * El
    key = jnp.where((local >= 0) & (local < El), local, El)
    gemm = functools.partial(grouped_swiglu, cfg)
    ys = back(_local_experts(gemm, xs, key, tuple(p[n] for n in EXPERT_WEIGHTS), El))
    ys = ys.reshape(moe_tp, M, Hd).sum(0)                                   # width partials
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(Tc, k, Hd)
    out = (ys * weights[..., None].astype(ys.dtype)).sum(1)                  # [Tc, Hd]
    if cfg.n_shared_experts:
        out = out + swiglu(hc, p["sh_gate"], p["sh_up"], p["sh_down"])
    return _rank_slices(out.astype(h_r.dtype), a, tp)[:Ts]


def _rank_slices(out: jax.Array, a: int, tp: int) -> jax.Array:
    """``out [Tc, Hd]``, slice ``d % a`` of device ``d``'s rank's tokens -> the rank's ``[a
    * Tc, Hd]`` on each of its ``a`` devices: ``a - 1`` collective permutes within the rank
    (``(a - 1) Tc Hd`` received a device; none for ``a`` 1)."""
    if a == 1:
        return out
    j = jax.lax.axis_index("tp") % a
    parts = jnp.zeros((a, *out.shape), out.dtype).at[j].set(out)
    for shift in range(1, a):           # from the rank's device j - shift, to j + shift
        perm = [(d, d - d % a + (d % a + shift) % a) for d in range(tp)]
        parts = parts.at[(j - shift) % a].set(jax.lax.ppermute(out, "tp", perm))
    return parts.reshape(a * out.shape[0], -1)


def _offsets(sizes):
    return jnp.cumsum(sizes) - sizes


def _ragged_exchange(rows, ids, send_sizes, capacity, E, num_senders, in_offsets=None):
    """Dispatch with ``lax.ragged_all_to_all`` (TPU, GPU). Peer ``p``'s rows are ``rows[
    in_offsets[p] : in_offsets[p] + send_sizes[p]]`` of ``rows [N, Hd]`` (``ids [N]`` their
    experts; ``in_offsets`` None: the rows sorted by peer, back to back), ``send_sizes
    [tp]``; ``capacity``: the most rows a sender sends one peer; ``num_senders``: how many
    devices may send to one device. Returns ``(received [R, Hd], their expert ids [R] (E past
    the received rows), back)``, ``R = num_senders * capacity`` (dropless), ``back(ys [R,
    Hd]) -> [N, Hd]`` the combine (0 for a row sent nowhere)."""
    me = jax.lax.axis_index("tp")
    sizes = jax.lax.all_gather(send_sizes, "tp")                            # [sender, receiver]
    recv_sizes = sizes[:, me]
    if in_offsets is None:
        in_offsets = _offsets(send_sizes)
        back_offsets = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]          # in each sender
    else:
        back_offsets = jax.lax.all_gather(in_offsets, "tp")[:, me]
    out_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]                   # in each receiver
    R, N = num_senders * capacity, rows.shape[0]

    def a2a(x, out):
        return jax.lax.ragged_all_to_all(x, out, in_offsets, send_sizes, out_offsets,
                                         recv_sizes, axis_name="tp")

    received = a2a(rows, jnp.zeros((R, rows.shape[1]), rows.dtype))
    rids = a2a(ids[:, None], jnp.full((R, 1), E, ids.dtype))[:, 0]
    recv_offsets = _offsets(recv_sizes)

    def back(ys):
        return jax.lax.ragged_all_to_all(ys, jnp.zeros((N, ys.shape[1]), ys.dtype),
                                         recv_offsets, recv_sizes, back_offsets, send_sizes,
                                         axis_name="tp")

    return received, rids, back


def _padded_exchange(rows, ids, send_sizes, capacity, E, num_senders, in_offsets=None):
    """``_ragged_exchange``'s contract with ``lax.all_to_all`` of ``[tp, capacity, Hd]``
    buffers (each peer's rows padded to the dropless capacity; ``R = tp * capacity``): the
    XLA:CPU stand-in."""
    del num_senders
    tp, N = send_sizes.shape[0], rows.shape[0]
    if in_offsets is None:
        in_offsets = _offsets(send_sizes)
    slot = jnp.arange(capacity)
    sent = slot[None, :] < send_sizes[:, None]                              # [tp, capacity]
    src = jnp.where(sent, in_offsets[:, None] + slot[None, :], N)          # N: nothing
    buf = jnp.take(rows, src, axis=0, mode="fill", fill_value=0)
    idb = jnp.where(sent, ids[jnp.minimum(src, N - 1)], E)
    received = jax.lax.all_to_all(buf, "tp", 0, 0, tiled=False)
    rids = jax.lax.all_to_all(idb, "tp", 0, 0, tiled=False)

    def back(ys):
        ys = jax.lax.all_to_all(ys.reshape(tp, capacity, -1), "tp", 0, 0, tiled=False)
        return jnp.zeros((N, ys.shape[-1]), ys.dtype).at[src.reshape(-1)].set(
            ys.reshape(tp * capacity, -1), mode="drop")

    return received.reshape(tp * capacity, -1), rids.reshape(tp * capacity), back
