"""The data plane of a multi-host PD role: every node registers its own KV shards, and pages
move rank to rank (DESIGN.md §6; sglang-jax #1364: a host exposes only its local shards to the
transfer engine, so each must register its own).

    node 0 (scheduler, bootstrap server, ZMQ)          node R > 0 (``RankSender``)
    PUT /route rank 0: its session, its shards          PUT /route rank R: its session, shards
    a decode registers: the head-slice plan over every node's shards (``RankedLayout``),
                        checked at pairing as for one process (``plan_head_slices``)
    engine thread, per chunk (step socket, in step order after the forward that wrote it):
        kv_peer (once per decode: its layout, the plan's layout)  ---------->  kept
        kv_write(job, src pages, dst pages)  ---------------------------->  waits for its KV,
    worker: writes node 0's shards' copies                                  builds its shards'
            waits for every RankWriteDone(job)  <---- PD control channel --  copies, writes them
            then the metadata row, then Success                             with its own engine

The copies of node R are ``build_copies(plan layout with R's current addresses, ...,
src_shards=R's shards)``: the nodes' copies partition the one plan, so bytes moved = pages x
bytes per page summed over the destination shards, as in one process. A node whose writes
fail or do not report within the transfer timeout fails the room (Failed to the decode after
every node's writes ended; the prefill's pages are released when the room concludes).

A multi-host decode (``DecodeRanks``, ``DecodeRankNode``, the diagram at the end) reports
every node's shards and session to the prefill in ``RegisterDecode``; the prefill writes each
node's shards into that node's session. Both multi-host: ``kv_peer`` carries the decode's
``node_sessions``/``shard_nodes``, every prefill node writes its shards into each decode node
holding those heads (``kv_export.write_nodes``) and reports the bytes per decode node; node 0
writes the metadata row into decode node 0 after every prefill node reported.

Pure Python here; ``RankSender`` and ``DecodeRankNode`` reach JAX only through ``LocalKV`` and
the runner.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from pdjax.pd.bootstrap import PrefillRankInfo, register_prefill_rank
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import DecodeRankInfo, RankWriteDone
from pdjax.pd.wire import KV_LAYOUTS, MAX_BUFFERS, MAX_ROOM, MAX_SHARDS
from pdjax.transfer.engine import Copy, TransferError
from pdjax.transfer.kv_export import (KVLayout, NodeShards, build_copies, node_shards,
                                      write_nodes)

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 3600.0     # a follower registers while node 0 still warms up
MAX_PEERS = 1 << 20
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


# ------------------------------------------------------------------------------ node 0
class RankWrites:
    """Node 0's record of the chunk jobs the other nodes write (``job`` numbers from 1).

    ``new_job`` on the engine thread, ``report`` on the control channel's receiver thread,
    ``wait`` on the transfer worker; every job made is waited for once.
    """

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)
        self._cond = threading.Condition()
        self._jobs: dict[int, dict[int, RankWriteDone]] = {}
        self._next = 0

    def new_job(self) -> int:
        with self._cond:
            self._next = self._next % MAX_ROOM + 1
            self._jobs[self._next] = {}
            return self._next

    def report(self, msg: RankWriteDone) -> bool:
        """Record one node's outcome; False (refused) for an unknown job or node, or a second
        report of the same node."""
        with self._cond:
            got = self._jobs.get(msg.job)
            if got is None or msg.node_rank not in self.ranks or msg.node_rank in got:
                return False
            got[msg.node_rank] = msg
            self._cond.notify_all()
            return True

    def wait(self, job: int, timeout_s: float, lost: Callable[[], str | None] = lambda: None,
             dst_nodes: int = 1) -> tuple[list[int], int, list[str]]:
        """``(bytes per decode node, copies, failures)`` over every node's report of ``job``,
        once all came, ``timeout_s`` passed or ``lost()`` says why the cluster broke (checked
        every ``LOST_POLL_S``); a missing node, or one whose ``node_bytes`` does not name
        ``dst_nodes`` decode nodes, is a failure naming it. Forgets the job."""
        deadline = time.monotonic() + timeout_s
        why = None
        with self._cond:
            while len(self._jobs[job]) < len(self.ranks):
                left = deadline - time.monotonic()
                why = lost()
                if left <= 0 or why is not None:
                    break
                self._cond.wait(min(left, LOST_POLL_S))
            got = self._jobs.pop(job)
        failures = [f"node {m.node_rank}: {m.reason}" for m in got.values() if not m.ok]
        failures += [f"node {m.node_rank}: node_bytes names {len(m.node_bytes)} decode nodes, "
                     f"not {dst_nodes}" for m in got.values()
                     if m.ok and len(m.node_bytes) != dst_nodes]
        failures += [f"node {r}: no report of its KV writes "
                     f"({why or f'within {timeout_s:g} s'})" for r in self.ranks if r not in got]
        ok = [m for m in got.values() if m.ok and len(m.node_bytes) == dst_nodes]
        node_bytes = [sum(m.node_bytes[n] for m in ok) for n in range(dst_nodes)]
        return node_bytes, sum(m.copies for m in ok), failures

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)


class PrefillRanks:
    """Node 0's side of a multi-host prefill: the plan over every node's shards at pairing,
    the ``kv_peer`` / ``kv_write`` commands to the other nodes, and their reports.

    ``cluster``: ``pdjax.distributed.Cluster`` (its ``send`` is engine-thread only);
    ``bootstrap``: the ``BootstrapServer`` the nodes registered with; ``local_kv``: node 0's
    ``LocalKV``; ``reply_endpoint``: node 0's control channel, where reports go.
    """

    def __init__(self, cluster, bootstrap, local_kv, reply_endpoint: str):
        self.cluster = cluster
        self.bootstrap = bootstrap
        self.local_kv = local_kv
        self.reply_endpoint = reply_endpoint
        self.nnodes = cluster.args.nnodes
        self.writes = RankWrites(range(1, self.nnodes))
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[Any, RankedLayout]] = {}     # decode id -> (peer, plan)
        self._announced: dict[str, tuple[Any, int]] = {}          # decode id -> (peer, index)
        self._next_peer = 0

    def plan(self) -> RankedLayout:
        """Every node's shards as registered now; ``ValueError`` while some node is missing."""
        return RankedLayout.from_ranks(rank_layouts(self.bootstrap.registered_ranks(),
                                                    self.nnodes))

    def paired(self, engine_id: str, peer, ranked: RankedLayout) -> None:
        """A decode paired against the plan ``ranked`` (receiver thread)."""
        with self._lock:
            self._plans[engine_id] = (peer, ranked)

    def send_write(self, engine_id: str, src: list[int], dst: list[int]) -> int | None:
        """Engine thread: tell every other node to write its shards of ``src`` pages into the
        decode ``engine_id``'s ``dst`` pages (after announcing that decode once per pairing).
        Returns the job to ``join``, or None when the decode is not paired (the worker then
        fails the room as for one process)."""
        with self._lock:
            entry = self._plans.get(engine_id)
            if entry is None:
                return None
            peer, ranked = entry
            announced = self._announced.get(engine_id)
            if announced is None or announced[0] is not peer:
                self._next_peer = self._next_peer % MAX_PEERS + 1
                announced = self._announced[engine_id] = (peer, self._next_peer)
                send_peer = True
            else:
                send_peer = False
        if send_peer:        # a multi-host decode: every node's session and shards' nodes
            self.cluster.send("kv_peer", peer=announced[1], session=peer.session_id,
                              reply=self.reply_endpoint, src=ranked.to_wire(),
                              dst={"kind": peer.layout.kind,
                                   "buffers": [b.to_wire() for b in peer.layout.buffers]},
                              node_sessions=list(peer.node_sessions),
                              shard_nodes=[list(row) for row in peer.shard_nodes])
        job = self.writes.new_job()
        self.cluster.send("kv_write", job=job, peer=announced[1], src=list(src), dst=list(dst))
        return job

    def join(self, job: int, timeout_s: float,
             dst_nodes: int = 1) -> tuple[list[int], int, list[str]]:
        """``RankWrites.wait`` for ``job``, given up at once when a node went away."""
        return self.writes.wait(job, timeout_s, lost=lambda: self.cluster.lost,
                                dst_nodes=dst_nodes)

    def write(self, engine, engine_id: str, src: Sequence[int], dst: Sequence[int],
              meta: list[Copy], job: int, timeout_s: float) -> tuple[list[int], int]:
        """Transfer worker: write node 0's copies of ``src`` -> ``dst`` with ``engine`` into
        every node of decode ``engine_id`` (``write_nodes``), wait for every other node's
        report of ``job``, then write ``meta`` (the metadata row, or nothing) into decode node
        0's session: the row lands after every prefill node wrote every decode node's KV.
        Returns (bytes of the KV per decode node over every prefill node, node 0 first;
        copies); ``TransferError`` naming each node that failed (the metadata row is then
        never written), ``ValueError`` when the decode is not paired."""
        with self._lock:
            entry = self._plans.get(engine_id)
        if entry is None:            # the other nodes were told to write: wait for them
            self.join(job, timeout_s)
            raise ValueError(f"decode engine {engine_id!r} is not paired")
        peer, ranked = entry
        writes = node_shards(peer.session_id, peer.node_sessions, peer.shard_nodes)
        try:
            own, n_own = write_nodes(engine, ranked.with_local(0, self.local_kv.layout),
                                     peer.layout, writes, src, dst,
                                     src_shards=ranked.shards_of(0))
        finally:          # the other nodes were told to write: wait for them in any case
            others, n_others, failures = self.join(job, timeout_s, dst_nodes=len(writes))
        if failures:
            raise TransferError("; ".join(failures))
        engine.batch_write(peer.session_id, meta)
        return [a + b for a, b in zip(own, others)], n_own + n_others

    def on_done(self, msg: RankWriteDone) -> bool:
        return self.writes.report(msg)


def rank_info(args, node_rank: int, channel, local_kv, engine) -> PrefillRankInfo:
    """One node's ``PUT /route`` body: its control socket, transfer session and own shards."""
    return PrefillRankInfo(
        rank_ip=channel.host, rank_port=channel.port, tp_rank=node_rank, tp_size=args.nnodes,
        page_size=args.page_size, kv_dtype=local_kv.kv_dtype,
        layout_fingerprint=local_kv.fingerprint, session_id=engine.session_id,
        kv_layout=local_kv.layout.kind, kv_buffers=local_kv.layout.buffers)


# ------------------------------------------------------------------------------ node R > 0
def _node_data_plane(host, on_message: Callable, name: str, secret):
    """A follower node's own data plane: its transfer engine (``--disaggregation-transfer-*``,
    at this host's advertised address), a direct ``LocalKV`` over its addressable KV shards,
    and its control ``MessageChannel`` named ``name`` (frames sealed with ``secret``), bound
    to ``args.host``. ``host``: the follower's ``EngineCore``. Returns the three."""
    from pdjax.transfer.channel import MessageChannel, advertise_host
    from pdjax.transfer.engine import create_transfer_engine
    from pdjax.transfer.local_kv import LocalKV
    from pdjax.transfer.role import kv_head_repeat

    args = host.args
    kwargs: dict[str, Any] = {"max_batch": args.disaggregation_transfer_max_batch}
    if args.disaggregation_transfer_backend != "fake" and args.disaggregation_ib_device:
        kwargs["device_name"] = args.disaggregation_ib_device
    engine = create_transfer_engine(args.disaggregation_transfer_backend,
                                    advertise_host(args.host), **kwargs)
    local_kv = LocalKV(host.runner, engine, "direct", -(-host.context_length // args.page_size),
                       head_repeat=kv_head_repeat(host))
    return engine, local_kv, MessageChannel(args.host, on_message, name, secret=secret)


@dataclasses.dataclass
class _Peer:
    session: str                               # decode node 0's
    reply: str
    ranked: RankedLayout
    layout: KVLayout
    writes: list[tuple[str, NodeShards]]       # ``node_shards`` of the decode


class RankSender:
    """Node R > 0 of a multi-host prefill: its own transfer engine and ``LocalKV`` (direct),
    registered with node 0's bootstrap server, and the ``kv_peer`` / ``kv_write`` handlers
    ``Cluster.follow`` calls in step order (``handlers``).

    ``host``: the follower's ``EngineCore`` (``args``, ``runner``, ``model_cfg``,
    ``model_path``, ``context_length``). Every error in a command is reported to node 0 as a
    failed ``RankWriteDone`` (or logged, without a valid job number); none stops the node.
    """

    def __init__(self, host):
        from pdjax.distributed.node import endpoints
        from pdjax.pd.frame_auth import resolve_secret

        args = self.args = host.args
        self.rank = args.node_rank
        self.runner = host.runner
        secret = resolve_secret(args.disaggregation_secret)
        self.engine, self.local_kv, self.channel = _node_data_plane(
            host, self._on_message, f"prefill-node-{self.rank}", secret)
        self.peers: dict[int, _Peer | str] = {}     # index -> peer, or why it is unusable
        self.reply: str | None = None               # node 0's control channel (from kv_peer)
        self._generation = 0        # bumped when the cache moved: older queued copies are void
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="pd-rank-transfer", daemon=True)
        self._worker.start()
        leader_host, _ = endpoints(args.dist_init_addr)
        info = rank_info(args, self.rank, self.channel, self.local_kv, self.engine)
        threading.Thread(target=self._register, args=(leader_host, info, secret),
                         name="pd-rank-register", daemon=True).start()
        logger.info("PD prefill node %d: transfer session %s, %d B per page of its shards",
                    self.rank, self.engine.session_id, self.local_kv.bytes_per_page)

    @property
    def handlers(self) -> dict[str, Any]:
        return {"kv_peer": self.on_peer, "kv_write": self.on_write}

    def _register(self, leader_host: str, info: PrefillRankInfo, secret) -> None:
        try:
            register_prefill_rank(leader_host, self.args.disaggregation_bootstrap_port, info,
                                  timeout_s=REGISTER_TIMEOUT_S, secret=secret)
            logger.info("PD prefill node %d: KV shards registered with %s:%d", self.rank,
                        leader_host, self.args.disaggregation_bootstrap_port)
        except Exception as e:     # node 0 then refuses every pairing, naming this node
            logger.error("PD prefill node %d: could not register its KV shards: %s", self.rank, e)

    def _on_message(self, msg) -> None:
        logger.error("PD prefill node %d: unexpected %s on its control socket", self.rank,
                     type(msg).__name__)

    # -- commands (main thread, in step order) -------------------------------------------
    def on_peer(self, msg: dict) -> None:
        """``kv_peer``: a decode paired with node 0 (its session, layout and the plan)."""
        index = msg.get("peer")
        if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index <= MAX_PEERS:
            logger.error("PD prefill node %d: kv_peer: peer %r is not in [1, %d]", self.rank,
                         index, MAX_PEERS)
            return
        try:
            session, reply = msg.get("session"), msg.get("reply")
            if not isinstance(session, str) or not 0 < len(session) <= 256:
                raise RankError("session: expected a non-empty str")
            if not isinstance(reply, str) or not reply.startswith("tcp://") or len(reply) > 256:
                raise RankError("reply: expected a tcp:// endpoint")
            self.reply = reply
            ranked = RankedLayout.from_wire(msg.get("src"), self.args.nnodes)
            ranked.with_local(self.rank, self.local_kv.layout)     # the plan's heads are ours
            layout = layout_from_wire("dst", msg.get("dst"))
            sessions, owners = decode_nodes_from_wire(session, msg.get("node_sessions", []),
                                                      msg.get("shard_nodes", []), layout)
            self.peers[index] = _Peer(session, reply, ranked, layout,
                                      node_shards(session, sessions, owners))
        except ValueError as e:
            self.peers[index] = f"kv_peer {index} was refused: {e}"
            logger.error("PD prefill node %d: %s", self.rank, self.peers[index])

    def on_write(self, msg: dict) -> None:
        """``kv_write``: wait for this node's KV (the forward that wrote the pages ran before
        this command), build its shards' copies and queue them for the worker."""
        job = msg.get("job")
        if isinstance(job, bool) or not isinstance(job, int) or not 1 <= job <= MAX_ROOM:
            logger.error("PD prefill node %d: kv_write: job %r is not in [1, 2**63)", self.rank,
                         job)
            return
        peer = self.peers.get(msg.get("peer"))
        try:
            if peer is None:
                raise RankError(f"peer: {msg.get('peer')!r} was never announced")
            if isinstance(peer, str):
                raise RankError(peer)
            src, dst = msg.get("src"), msg.get("dst")
            if not isinstance(src, list) or not isinstance(dst, list):
                raise RankError("src, dst: expected page lists")
            import jax

            jax.block_until_ready(self.runner.caches)
            if self.local_kv.check_addresses():
                self._generation += 1      # copies queued before were built for old addresses
            ranked = peer.ranked.with_local(self.rank, self.local_kv.layout)
            mine = peer.ranked.shards_of(self.rank)
            parts = [(session, build_copies(ranked, peer.layout, src, dst, src_shards=mine,
                                            dst_shards=shards) if src else [])
                     for session, shards in peer.writes]     # per decode node, node 0 last
        except (ValueError, TransferError) as e:
            self._reply(peer, job, ok=False, reason=f"kv_write refused: {e}")
            return
        self._jobs.put((job, self._generation, peer, parts))

    # -- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, generation, peer, parts = item
            if generation != self._generation:
                self._reply(peer, job, ok=False, reason=f"node {self.rank}'s KV cache moved "
                                                        "after a donated step")
                continue
            try:
                for session, copies in parts:
                    if copies:
                        self.engine.batch_write(session, copies)
            except (TransferError, ValueError) as e:
                self._reply(peer, job, ok=False, reason=f"KV write to {session} failed: {e}")
                continue
            node_bytes = [sum(c[2] for c in copies) for _, copies in reversed(parts)]
            self._reply(peer, job, ok=True, node_bytes=node_bytes,
                        ncopies=sum(len(copies) for _, copies in parts))

    def _reply(self, peer, job: int, ok: bool, reason: str = "",
               node_bytes: Sequence[int] = (), ncopies: int = 0) -> None:
        reply = peer.reply if isinstance(peer, _Peer) else self.reply
        if not ok:
            logger.error("PD prefill node %d: job %d: %s", self.rank, job, reason)
        if reply is None:       # no kv_peer yet: node 0 times the job out
            return
        self.channel.send(reply, RankWriteDone(job=job, node_rank=self.rank, ok=ok,
                                               bytes=sum(node_bytes), copies=ncopies,
                                               reason=reason[:4000],
                                               node_bytes=tuple(node_bytes)))


# ------------------------------------------------------------------------------ decode
# A multi-host decode (DESIGN.md §6): node 0 runs the scheduler, the metadata rows and the PD
# signalling; every node's KV shards are written by the prefill directly:
#
#     node 0 (DecodeManager, ``DecodeRanks``)           node R > 0 (``DecodeRankNode``)
#     kv_ranks(reply) on the step socket  ------------>  its addresses re-checked, then
#     DecodeRankInfo(session, own shards, gen 0)  <----  reported on the PD control channel
#     RegisterDecode: every node's shards (one ``RankedLayout``), ``node_sessions``,
#                     ``shard_nodes``: the prefill writes each node's shards to its session
#     after every forward: kv_check  ----------------->  its cache moved: re-registered and
#     DecodeRankInfo(gen + 1)  <-----------------------  reported; node 0 then fails the
#                                                        transfers in flight and registers again
#
# Pages are node 0's scheduler's: the cache is one global array sharded by heads, so a page
# id is the same page on every node.
class DecodeRanks:
    """Node 0 of a multi-host decode: the other nodes' sessions and shards.

    ``cluster``: ``pdjax.distributed.Cluster`` (``send`` on the engine thread only). ``report``
    runs on the control channel's receiver thread, ``layout`` on a bootstrap thread.
    """

    def __init__(self, cluster):
        self.cluster = cluster
        self.nnodes = cluster.args.nnodes
        self._cond = threading.Condition()
        self._infos: dict[int, DecodeRankInfo] = {}     # node rank -> its last report
        self._moved = False

    def announce(self, reply_endpoint: str) -> None:
        """Ask every other node for its session and shards (at start-up, after warm-up and
        before the engine thread runs: the step socket has one sender at a time)."""
        self.cluster.send("kv_ranks", reply=reply_endpoint)

    def check(self) -> None:
        """After a forward: every other node re-checks its KV addresses (engine thread)."""
        if self.cluster.lost is None:
            self.cluster.send("kv_check")

    def report(self, msg: DecodeRankInfo) -> str | None:
        """Record one node's ``DecodeRankInfo``; the reason it is refused (a node out of range,
        an older generation than one seen), or None."""
        if not 1 <= msg.node_rank < self.nnodes:
            return f"DecodeRankInfo from node {msg.node_rank}, not in [1, {self.nnodes})"
        with self._cond:
            old = self._infos.get(msg.node_rank)
            if old is not None and msg.generation <= old.generation:
                return (f"DecodeRankInfo of node {msg.node_rank}: generation {msg.generation} "
                        f"is not after {old.generation}")
            self._infos[msg.node_rank] = msg
            if old is not None:
                self._moved = True
            self._cond.notify_all()
        return None

    def state(self) -> list[dict[str, Any]]:
        """The other nodes' last reports, for ``/pd_state``."""
        with self._cond:
            return [{"node_rank": r, "session_id": m.session_id, "generation": m.generation}
                    for r, m in sorted(self._infos.items())]

    def take_moved(self) -> bool:
        """True once after a node reported that its cache moved (engine thread)."""
        with self._cond:
            moved, self._moved = self._moved, False
            return moved

    def layout(self, local: KVLayout, session_id: str,
               timeout_s: float) -> tuple[KVLayout, tuple[str, ...], tuple[tuple[int, ...], ...]]:
        """Every node's shards as one layout (node 0's ``local``), each node's session and the
        node of each shard: ``RegisterDecode``'s ``kv_buffers``, ``node_sessions`` and
        ``shard_nodes``. Waits up to ``timeout_s`` for every node's report; ``ValueError``
        naming the nodes missing, or the field on which the nodes' buffers differ."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._infos) < self.nnodes - 1:
                left = deadline - time.monotonic()
                if left <= 0 or self.cluster.lost is not None:
                    missing = sorted(set(range(1, self.nnodes)) - set(self._infos))
                    raise ValueError(f"kv_buffers: decode node(s) {missing} did not report "
                                     f"their KV shards ({self.cluster.lost or f'{timeout_s:g} s'})")
                self._cond.wait(min(left, LOST_POLL_S))
            infos = dict(self._infos)
        layouts = {0: local, **{r: KVLayout(m.kv_layout, m.kv_buffers) for r, m in infos.items()}}
        ranked = RankedLayout.from_ranks(layouts)
        sessions = (session_id, *(infos[r].session_id for r in range(1, self.nnodes)))
        return ranked.layout, sessions, ranked.owners


class DecodeRankNode:
    """Node R > 0 of a multi-host decode: its own transfer engine and ``LocalKV`` (direct), the
    prefill writes its shards; ``handlers`` for ``Cluster.follow`` (``kv_ranks``,
    ``kv_check``), made in step order. ``host``: the follower's ``EngineCore``."""

    def __init__(self, host):
        from pdjax.pd.frame_auth import resolve_secret

        args = self.args = host.args
        self.rank = args.node_rank
        self.engine, self.local_kv, self.channel = _node_data_plane(
            host, self._on_message, f"decode-node-{self.rank}",
            resolve_secret(args.disaggregation_secret))
        self.reply: str | None = None          # node 0's control channel (from kv_ranks)
        self.generation = 0

    @property
    def handlers(self) -> dict[str, Any]:
        return {"kv_ranks": self.on_ranks, "kv_check": self.on_check}

    def _on_message(self, msg) -> None:
        logger.error("PD decode node %d: unexpected %s on its control socket", self.rank,
                     type(msg).__name__)

    def on_ranks(self, msg: dict) -> None:
        """``kv_ranks``: report this node's session and shards (at their addresses now: the
        warm-up's donated steps ran before) to node 0."""
        reply = msg.get("reply")
        if not isinstance(reply, str) or not reply.startswith("tcp://") or len(reply) > 256:
            logger.error("PD decode node %d: kv_ranks: reply %r is not a tcp:// endpoint",
                         self.rank, reply)
            return
        self.reply = reply
        if self.local_kv.check_addresses():
            self.generation += 1
        self._report()

    def on_check(self, msg: dict) -> None:
        """``kv_check`` (after a forward): a moved cache is re-registered and reported."""
        if self.local_kv.check_addresses():
            self.generation += 1
            self._report()

    def _report(self) -> None:
        if self.reply is None:
            return
        layout = self.local_kv.layout
        self.channel.send(self.reply, DecodeRankInfo(
            node_rank=self.rank, session_id=self.engine.session_id, kv_layout=layout.kind,
            kv_buffers=layout.buffers, generation=self.generation))
        logger.info("PD decode node %d: KV shards reported to node 0 (generation %d)",
                    self.rank, self.generation)
