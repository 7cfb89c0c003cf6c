"""Per-token rows of a page-sharded DP attention buffer, written and read at each rank's own
slots (DESIGN.md §3 "Speculative decoding", §6): the target's ``"mtp_hidden"`` buffer under
DP attention, which the MTP drafter reads.

A DP buffer is ``[L, tp * Np, page_size, W]`` sharded ``PAGE_SPEC`` (``dp_attention.py``):
device ``d`` holds ``Np`` pages, its rank's pool (rank ``d // attn_tp``; a rank of
``attn_tp > 1`` devices keeps a copy on each). The flat token stream is ``dp`` segments of
``Ts`` tokens, and slots are a rank's own (``slot_mapping [dp, Ts]``, page 0 its null page)::

    rows [dp * Ts, D]  --write-->  device d: rows[r * Ts:(r + 1) * Ts] at slot_mapping[r]
                                   of its own Np pages   (r = d // attn_tp; no collective)
    device d: its pages at slot_mapping[r] -> [Ts, W]  --DP gather-->  [dp * Ts, W]  (read)

Both run in a ``shard_map`` over ``tp``, so a device touches only its own pages; the read
costs one ``all_gather`` of ``[Ts, W]``, as a layer's DP gather.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, PartitionSpec as P

from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.dp_attention import PAGE_SPEC, _gather_ranks
from pdjax.pallas_kernels.lanes import pad_last_dim


def _tp_mesh(cfg: DeepseekConfig):
    """The mesh being traced under (a ``tp`` axis of ``dp * attn_tp`` devices; ``ValueError``
    for another), or one made from ``cfg`` when there is none (the CPU runner's case)."""
    tp = cfg.dp_size * cfg.attn_tp_size
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return AbstractMesh((tp,), ("tp",))
    if "tp" not in mesh.axis_names or mesh.shape["tp"] != tp:
        raise ValueError(f"dp_size: DP attention {cfg.dp_size} x attn_tp {cfg.attn_tp_size} "
                         f"runs on {tp} devices, but the mesh is {mesh}")
    return mesh


def _check_slots(cfg: DeepseekConfig, slot_mapping: jax.Array) -> int:
    if slot_mapping.ndim != 2 or slot_mapping.shape[0] != cfg.dp_size:
        raise ValueError(f"slot_mapping: [dp={cfg.dp_size}, Ts] rank-local slots, got shape "
                         f"{slot_mapping.shape}")
    return slot_mapping.shape[1]


def dp_write_rows(cfg: DeepseekConfig, buffer: jax.Array, layer: int, rows: jax.Array,
                  slot_mapping: jax.Array) -> jax.Array:
    """Write ``rows [dp * Ts, D]`` (rank ``r``'s tokens at ``[r * Ts, (r + 1) * Ts)``) into
    layer ``layer`` of the DP ``buffer [L, tp * Np, page_size, W]`` (``W >= D``: the pad lanes
    get zeros) at rank-local ``slot_mapping [dp, Ts]`` int32, on every device of each rank.
    Returns the buffer (sharded as it came). ``ValueError`` for a ``slot_mapping`` without the
    ``[dp]`` axis or a mesh of another size."""
    Ts = _check_slots(cfg, slot_mapping)
    a = cfg.attn_tp_size
    mesh = _tp_mesh(cfg)

    def body(buf, rows, slots):
        rank = jax.lax.axis_index("tp") // a
        r = jax.lax.dynamic_slice_in_dim(rows, rank * Ts, Ts)
        s = slots[rank]
        ps = buf.shape[2]
        return buf.at[layer, s // ps, s % ps].set(pad_last_dim(r, buf.shape[-1]).astype(buf.dtype))

    with jax.sharding.use_abstract_mesh(mesh):
        return jax.shard_map(body, mesh=mesh, in_specs=(PAGE_SPEC, P(), P()),
                             out_specs=PAGE_SPEC, check_vma=False)(buffer, rows, slot_mapping)


def dp_read_rows(cfg: DeepseekConfig, buffer: jax.Array, layer: int,
                 slot_mapping: jax.Array) -> jax.Array:
    """The rows of layer ``layer`` of the DP ``buffer [L, tp * Np, page_size, W]`` at rank-local
    ``slot_mapping [dp, Ts]`` int32: ``[dp * Ts, W]``, rank ``r``'s at ``[r * Ts, (r + 1) *
    Ts)``, replicated. ``ValueError`` as ``dp_write_rows``."""
    _check_slots(cfg, slot_mapping)
    a = cfg.attn_tp_size
    mesh = _tp_mesh(cfg)

    def body(buf, slots):
        s = slots[jax.lax.axis_index("tp") // a]
        ps = buf.shape[2]
        return _gather_ranks(buf[layer, s // ps, s % ps], a)

    with jax.sharding.use_abstract_mesh(mesh):
        return jax.shard_map(body, mesh=mesh, in_specs=(PAGE_SPEC, P()), out_specs=P(),
                             check_vma=False)(buffer, slot_mapping)
