"""What the multi-host PD data planes of both roles share (DESIGN.md §6; sglang-jax #1364: a
host exposes only its local shards to the transfer engine, so each node registers its own).

``RankedLayout``: one KV layout over every node's shards (which node owns which shard), the
head-slice plan's layout at pairing and what travels in the step commands; ``layout_from_wire``
/ ``decode_nodes_from_wire``: those commands' fields, range-checked (``RankError``);
``node_data_plane``: a follower node's own transfer engine, ``LocalKV`` and control channel.
The prefill side is ``prefill_ranks.py`` (node 0's ``PrefillRanks``, node R's ``RankSender``),
the decode side ``decode_ranks.py`` (``DecodeRanks``, ``DecodeRankNode``).

Pure Python; ``node_data_plane`` reaches JAX only through ``LocalKV`` and the runner.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from pdjax.pd.bootstrap import PrefillRankInfo
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.wire import KV_LAYOUTS, MAX_BUFFERS, MAX_SHARDS
from pdjax.transfer.kv_copies import KVLayout

LOST_POLL_S = 0.5               # how often a wait for the other nodes checks the cluster


class RankError(ValueError):
    """A malformed or unusable multi-host transfer command (the text names the field)."""


@dataclasses.dataclass(frozen=True)
class RankedLayout:
    """The KV shards of every node of a multi-host prefill, as one ``KVLayout``.

    ``layout``: every node's shards per buffer, ordered by (first head, node rank, local
    index); its addresses are each node's as registered (a node uses its current ones,
    ``with_local``). ``owners[b][s]``: the node holding shard ``s`` of buffer ``b``;
    ``local[b][s]``: that shard's index in its node's own layout.
    """

    layout: KVLayout
    owners: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks(cls, layouts: dict[int, KVLayout]) -> "RankedLayout":
        """Merge each node's own layout (node rank -> ``KVLayout``). ``ValueError`` naming the
        field when the nodes' buffers differ in kind, count or geometry."""
        if not layouts:
            raise ValueError("kv_buffers: no node registered its KV shards")
        ranks = sorted(layouts)
        first = layouts[ranks[0]]
        buffers, owners, local = [], [], []
        for r in ranks:
            lay = layouts[r]
            if lay.kind != first.kind or len(lay.buffers) != len(first.buffers):
                raise ValueError(f"kv_layout: node {r} has {lay.kind} x {len(lay.buffers)} "
                                 f"buffers, node {ranks[0]} {first.kind} x "
                                 f"{len(first.buffers)}")
        for i, ref in enumerate(first.buffers):
            shards = []
            for r in ranks:
                b = layouts[r].buffers[i]
                for name in ("num_layers", "num_pages", "bytes_per_page", "num_heads",
                             "head_bytes"):
                    if getattr(b, name) != getattr(ref, name):
                        raise ValueError(f"kv_buffers[{i}].{name}: node {r} has "
                                         f"{getattr(b, name)}, node {ranks[0]} "
                                         f"{getattr(ref, name)}")
                shards += [(heads[0], r, j, addr, heads) for j, (addr, heads)
                           in enumerate(zip(b.shard_addrs, b.shard_heads))]
            shards.sort(key=lambda s: s[:3])
            buffers.append(dataclasses.replace(ref, shard_addrs=tuple(s[3] for s in shards),
                                               shard_heads=tuple(s[4] for s in shards)))
            owners.append(tuple(s[1] for s in shards))
            local.append(tuple(s[2] for s in shards))
        return cls(KVLayout(first.kind, tuple(buffers)), tuple(owners), tuple(local))

    def shards_of(self, rank: int) -> tuple[frozenset[int], ...]:
        """Per buffer, the indices of the shards node ``rank`` holds."""
        return tuple(frozenset(s for s, r in enumerate(own) if r == rank) for own in self.owners)

    def with_local(self, rank: int, local: KVLayout) -> KVLayout:
        """``layout`` with node ``rank``'s shards at the addresses of ``local`` (its own layout
        now: a cache that moved is re-registered there). ``ValueError`` when ``local`` holds
        other heads than the plan gives the node."""
        buffers = []
        for i, (b, own, idx) in enumerate(zip(self.layout.buffers, self.owners, self.local)):
            lb = local.buffers[i]
            addrs = list(b.shard_addrs)
            for s, (r, j) in enumerate(zip(own, idx)):
                if r != rank:
                    continue
                if j >= len(lb.shard_addrs) or lb.shard_heads[j] != b.shard_heads[s]:
                    raise ValueError(f"kv_buffers[{i}].shard_heads: node {rank}'s shard {j} "
                                     f"does not hold heads {b.shard_heads[s]}")
                addrs[s] = lb.shard_addrs[j]
            buffers.append(dataclasses.replace(b, shard_addrs=tuple(addrs)))
        return KVLayout(self.layout.kind, tuple(buffers))

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.layout.kind, "buffers": [b.to_wire() for b in self.layout.buffers],
                "owners": [list(o) for o in self.owners], "local": [list(x) for x in self.local]}

    @classmethod
    def from_wire(cls, obj: Any, nnodes: int) -> "RankedLayout":
        """The layout ``to_wire`` wrote; ``RankError`` naming the field, every node rank in
        ``[0, nnodes)``."""
        if not isinstance(obj, dict) or set(obj) != {"kind", "buffers", "owners", "local"}:
            raise RankError("src: expected {kind, buffers, owners, local}")
        layout = layout_from_wire("src", {"kind": obj["kind"], "buffers": obj["buffers"]})
        owners, local = obj["owners"], obj["local"]
        for name, v, hi in (("owners", owners, nnodes), ("local", local, MAX_SHARDS)):
            if not isinstance(v, list) or len(v) != len(layout.buffers):
                raise RankError(f"src.{name}: expected one list per buffer")
            for i, (row, b) in enumerate(zip(v, layout.buffers)):
                if not isinstance(row, list) or len(row) != len(b.shard_addrs) or not all(
                        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < hi
                        for x in row):
                    raise RankError(f"src.{name}[{i}]: expected {len(b.shard_addrs)} integers "
                                    f"in [0, {hi})")
        return cls(layout, tuple(map(tuple, owners)), tuple(map(tuple, local)))


def layout_from_wire(name: str, obj: Any) -> KVLayout:
    """A ``{"kind", "buffers"}`` map as a ``KVLayout``; ``RankError`` naming the field."""
    if not isinstance(obj, dict) or set(obj) != {"kind", "buffers"}:
        raise RankError(f"{name}: expected {{kind, buffers}}")
    bufs = obj["buffers"]
    if obj["kind"] not in KV_LAYOUTS or not isinstance(bufs, list) \
            or not 1 <= len(bufs) <= MAX_BUFFERS:
        raise RankError(f"{name}: kind in {KV_LAYOUTS} and 1..{MAX_BUFFERS} buffers expected")
    try:
        return KVLayout(obj["kind"], tuple(KVBufferDesc.from_wire(f"{name}.buffers[{i}]", b)
                                           for i, b in enumerate(bufs)))
    except ValueError as e:           # ProtocolError is one
        raise RankError(str(e)) from None


def decode_nodes_from_wire(session: str, sessions: Any, owners: Any, layout: KVLayout
                           ) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """``kv_peer``'s ``node_sessions`` / ``shard_nodes`` (``RegisterDecode``'s, mirrored by
    node 0; both empty for a one-process decode) with ``RankError`` naming the field: 2 to
    ``MAX_SHARDS`` sessions, the first ``session`` (decode node 0's), and per buffer of
    ``layout`` one node in ``[0, len(sessions))`` per shard."""
    if sessions == [] and owners == []:
        return (), ()
    if not isinstance(sessions, list) or not 2 <= len(sessions) <= MAX_SHARDS or not all(
            isinstance(sid, str) and 0 < len(sid) <= 256 for sid in sessions):
        raise RankError(f"node_sessions: expected 2..{MAX_SHARDS} session strings")
    if sessions[0] != session:
        raise RankError("node_sessions[0]: not session (decode node 0's)")
    if not isinstance(owners, list) or len(owners) != len(layout.buffers):
        raise RankError(f"shard_nodes: expected one list per buffer ({len(layout.buffers)})")
    for i, (row, b) in enumerate(zip(owners, layout.buffers)):
        if not isinstance(row, list) or len(row) != len(b.shard_addrs) or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < len(sessions)
                for n in row):
            raise RankError(f"shard_nodes[{i}]: expected {len(b.shard_addrs)} integers in "
                            f"[0, {len(sessions)})")
    return tuple(sessions), tuple(map(tuple, owners))


def rank_layouts(infos: Sequence[PrefillRankInfo], nnodes: int) -> dict[int, KVLayout]:
    """Each registered node's own layout (``PUT /route`` bodies); ``ValueError`` naming the
    nodes that have not registered their shards yet."""
    got = {i.tp_rank: KVLayout(i.kv_layout, i.kv_buffers) for i in infos if i.kv_buffers}
    missing = sorted(set(range(nnodes)) - set(got))
    if missing:
        raise ValueError(f"kv_buffers: prefill node(s) {missing} have not registered their KV "
                         f"shards with the bootstrap server yet")
    return got


def node_data_plane(host, name: str, secret):
    """A follower node's own data plane: its transfer engine (``--disaggregation-transfer-*``,
    at this host's advertised address), a direct ``LocalKV`` over its addressable KV shards
    (the ``jax`` backend: a ``JaxLocalKV``, its programs compiled), and its control
    ``MessageChannel`` named ``name`` (frames sealed with ``secret``), bound to ``args.host``
    and not yet reading (``start`` it with the node's handler). ``host``: the follower's
    ``NodeRunner`` (its steps must update the pool in place: ``LocalKV``). Returns the
    three."""
    from pdjax.transfer.channel import MessageChannel
    from pdjax.transfer.local_kv import LocalKV
    from pdjax.transfer.pd_connector import create_role_transfer_engine, kv_head_repeat

    args = host.args
    engine = create_role_transfer_engine(args)
    max_pages = -(-host.context_length // args.page_size)
    if hasattr(engine, "write_pages"):       # the jax backend: its own shards' units
        from pdjax.transfer.jax_transfer_kv import JaxLocalKV
        local_kv = JaxLocalKV(host.runner, engine, max_pages, head_repeat=kv_head_repeat(host))
        local_kv.warmup()           # its own shards only: no collective, any order
    else:
        local_kv = LocalKV(host.runner, engine, "direct", max_pages,
                           head_repeat=kv_head_repeat(host))
    return engine, local_kv, MessageChannel(args.host, None, name, secret=secret)
