"""A registered decode engine as the prefill sees it: where its KV pool and metadata slots
are, and whether its KV layout pairs with this prefill's (DESIGN.md §4, pairing). Kept beside
the data plane (``kv_export``, ``local_kv``) rather than with the pure room records of
``pdjax.pd.rooms``, because pairing reads the local KV buffers."""

from __future__ import annotations

import dataclasses

from pdjax.pd.protocol import RegisterDecode
from pdjax.transfer.kv_copies import KVLayout, NodeShards, node_shards
from pdjax.transfer.local_kv import LocalKV


@dataclasses.dataclass
class DecodePeer:
    """A registered decode engine: where its KV pool and metadata slots are.

    ``node_sessions``/``shard_nodes``: a multi-host decode's transfer session per node and the
    node of each shard of ``layout`` (``RegisterDecode``); empty for one process.
    """

    engine_id: str
    reply_endpoint: str
    session_id: str
    layout: KVLayout
    metadata_addr: int
    metadata_num_slots: int
    metadata_bytes_per_slot: int
    node_sessions: tuple[str, ...] = ()
    shard_nodes: tuple[tuple[int, ...], ...] = ()

    def node_writes(self) -> list[tuple[str, NodeShards]]:
        """``node_shards`` of this decode: per node its session and shards, node 0 last."""
        return node_shards(self.session_id, self.node_sessions, self.shard_nodes)

    @classmethod
    def from_registration(cls, msg: RegisterDecode, local_kv: LocalKV, page_size: int,
                          metadata_bytes_per_slot: int,
                          src_layout: KVLayout | None = None) -> "DecodePeer":
        """The peer a ``RegisterDecode`` describes, if it pairs with this prefill's KV
        (``local_kv``, ``page_size``; ``src_layout``: the shards of every node of a multi-host
        prefill, default ``local_kv.layout``) and metadata rows; ``ValueError`` ("prefill
        refuses to pair: ...", every mismatch named) otherwise."""
        problems = []
        ours = {"page_size": page_size, "kv_dtype": local_kv.kv_dtype,
                "layout_fingerprint": local_kv.fingerprint, "kv_layout": local_kv.layout.kind,
                "metadata_bytes_per_slot": metadata_bytes_per_slot}
        for name, value in ours.items():
            if getattr(msg, name) != value:
                problems.append(f"{name}: prefill {value!r} != decode {getattr(msg, name)!r}")
        layout = None
        if not problems:
            try:
                layout = KVLayout(msg.kv_layout, msg.kv_buffers)
                (src_layout or local_kv.layout).check_compatible(layout)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("prefill refuses to pair: " + "; ".join(problems))
        return cls(msg.decode_engine_id, msg.reply_endpoint, msg.engine_session_id, layout,
                   msg.metadata_addr, msg.metadata_num_slots, msg.metadata_bytes_per_slot,
                   msg.node_sessions, msg.shard_nodes)
