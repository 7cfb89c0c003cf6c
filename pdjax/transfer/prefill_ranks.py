"""The data plane of a multi-host PD prefill: every node registers its own KV shards, and pages
move rank to rank (DESIGN.md §6; the shared pieces are in ``ranks.py``).

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

A multi-host decode (``decode_ranks.py``) reports
every node's shards and session to the prefill in ``RegisterDecode``; the prefill writes each
node's shards into that node's session. Both multi-host: ``kv_peer`` carries the decode's
``node_sessions``/``shard_nodes``, every prefill node writes its shards into each decode node
holding those heads (``kv_copies.write_nodes``) and reports the bytes per decode node; node 0
writes the metadata row into decode node 0 after every prefill node reported.

With the ``jax`` backend (pull-based, DESIGN.md §4) ``kv_write`` makes node R gather its own
shards (``JaxLocalKV.stage_out``, in step order) and its worker offer them to every decode node
that needs them (``JaxTransferEngine.write_pages``); node 0 offers its own, waits for every
report, then sends the metadata row alone (``send_meta``).

Pure Python here; ``RankSender`` reaches JAX only through ``LocalKV`` and the runner.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from pdjax.pd.bootstrap import PrefillRankInfo, register_prefill_rank
from pdjax.pd.protocol import RankWriteDone
from pdjax.pd.wire import MAX_ROOM, check_int, validate_pages
from pdjax.transfer.engine import Copy, TransferError
from pdjax.transfer.kv_copies import (KVLayout, NodeShards, build_copies, node_shards,
                                      write_nodes)
from pdjax.transfer.ranks import (LOST_POLL_S, RankedLayout, RankError, decode_nodes_from_wire,
                                  layout_from_wire, node_data_plane, rank_layouts)

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 3600.0     # a follower registers while node 0 still warms up
MAX_PEERS = 1 << 20


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

    def send_write(self, engine_id: str, src: list[int], dst: list[int],
                   room: int = 0) -> int | None:
        """Engine thread: tell every other node to write its shards of ``src`` pages into the
        decode ``engine_id``'s ``dst`` pages (after announcing that decode once per pairing;
        ``room``: the chunk's ``bootstrap_room``, which the jax backend's offers carry).
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
        self.cluster.send("kv_write", job=job, peer=announced[1], src=list(src), dst=list(dst),
                          room=int(room))
        return job

    def join(self, job: int, timeout_s: float,
             dst_nodes: int = 1) -> tuple[list[int], int, list[str]]:
        """``RankWrites.wait`` for ``job``, given up at once when a node went away."""
        return self.writes.wait(job, timeout_s, lost=lambda: self.cluster.lost,
                                dst_nodes=dst_nodes)

    def write(self, engine, engine_id: str, src: Sequence[int], dst: Sequence[int],
              meta: list[Copy], job: int, timeout_s: float,
              room: int = 0) -> tuple[list[int], int]:
        """Transfer worker: write node 0's copies of ``src`` -> ``dst`` with ``engine`` into
        every node of decode ``engine_id`` (``write_nodes``), wait for every other node's
        report of ``job``, then write ``meta`` (the metadata row, or nothing) into decode node
        0's session: the row lands after every prefill node wrote every decode node's KV.
        Returns (bytes of the KV per decode node over every prefill node, node 0 first;
        copies); ``TransferError`` naming each node that failed (the metadata row is then
        never written), ``ValueError`` when the decode is not paired (a pull-based pool's
        gathered arrays of ``src`` are dropped then: ``write_pages`` releases them otherwise)."""
        with self._lock:
            entry = self._plans.get(engine_id)
        if entry is None:            # the other nodes were told to write: wait for them
            drop = getattr(self.local_kv, "drop_gathered", None)
            if drop is not None:     # a pull-based pool: node 0's arrays are never offered
                drop(src)
            self.join(job, timeout_s)
            raise ValueError(f"decode engine {engine_id!r} is not paired")
        peer, ranked = entry
        writes = node_shards(peer.session_id, peer.node_sessions, peer.shard_nodes)
        pulled = hasattr(engine, "write_pages")      # the jax backend: offers, then a row
        try:
            if pulled:
                own, n_own = engine.write_pages(self.local_kv, peer, src, dst, [], room)
            else:
                own, n_own = write_nodes(engine, ranked.with_local(0, self.local_kv.layout),
                                         peer.layout, writes, src, dst,
                                         src_shards=ranked.shards_of(0))
        finally:          # the other nodes were told to write: wait for them in any case
            others, n_others, failures = self.join(job, timeout_s, dst_nodes=len(writes))
        if failures:
            raise TransferError("; ".join(failures))
        if pulled:
            engine.send_meta(peer.session_id, meta)
        else:
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
        kv_layout=local_kv.layout.kind, kv_buffers=local_kv.layout.buffers,
        transfer_backend=engine.data_plane)


# ------------------------------------------------------------------------------ node R > 0
@dataclasses.dataclass
class _Peer:
    session: str                               # decode node 0's
    reply: str
    ranked: RankedLayout
    layout: KVLayout
    writes: list[tuple[str, NodeShards]]       # ``node_shards`` of the decode
    node_sessions: tuple[str, ...] = ()        # a multi-host decode's (the jax backend reads
    shard_nodes: tuple[tuple[int, ...], ...] = ()    # them as a ``DecodePeer``'s)

    @property
    def session_id(self) -> str:
        return self.session


class RankSender:
    """Node R > 0 of a multi-host prefill: its own transfer engine and ``LocalKV`` (direct),
    registered with node 0's bootstrap server, and the ``kv_peer`` / ``kv_write`` handlers
    ``Cluster.follow`` calls in step order (``handlers``).

    Parts: ``args`` (``nnodes``, ``node_rank``, ``disaggregation_bootstrap_port``), ``runner``
    (its ``caches``), ``engine``, ``local_kv`` and ``channel`` (its own data plane);
    ``for_host`` builds them for a follower's ``NodeRunner`` and starts the node (``start``:
    the write thread, and the registration with node 0's bootstrap server). Every error in a
    command is reported to node 0 as a failed ``RankWriteDone`` (or logged, without a valid
    job number); none stops the node.
    """

    def __init__(self, args, runner, engine, local_kv, channel):
        self.args, self.rank, self.runner = args, args.node_rank, runner
        self.engine, self.local_kv, self.channel = engine, local_kv, channel
        self.peers: dict[int, _Peer | str] = {}     # index -> peer, or why it is unusable
        self.reply: str | None = None               # node 0's control channel (from kv_peer)
        self._generation = 0        # bumped when the cache moved: older queued copies are void
        self._jobs: queue.Queue = queue.Queue()

    @classmethod
    def for_host(cls, host) -> "RankSender":
        from pdjax.pd.frame_auth import resolve_secret

        args = host.args
        secret = resolve_secret(args.disaggregation_secret)
        engine, local_kv, channel = node_data_plane(
            host, f"prefill-node-{args.node_rank}", secret)
        node = cls(args, host.runner, engine, local_kv, channel)
        channel.start(node._on_message)
        node.start(secret)
        return node

    def start(self, secret) -> None:
        """Start the write thread and register this node's shards with node 0 (on a thread:
        node 0 refuses every pairing, naming this node, until it has them)."""
        from pdjax.distributed.node import endpoints

        threading.Thread(target=self._work, name="pd-rank-transfer", daemon=True).start()
        leader_host, _ = endpoints(self.args.dist_init_addr)
        info = rank_info(self.args, self.rank, self.channel, self.local_kv, self.engine)
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
                                      node_shards(session, sessions, owners), sessions, owners)
        except ValueError as e:
            self.peers[index] = f"kv_peer {index} was refused: {e}"
            logger.error("PD prefill node %d: %s", self.rank, self.peers[index])

    def on_write(self, msg: dict) -> None:
        """``kv_write``: range-check the ``src`` pages against this node's pool and ``dst``
        against the decode's (``validate_pages``, equal lengths), then, direct: wait for this
        node's KV (the forward that wrote the pages ran before this command), build its
        shards' copies and queue them for the worker; ``jax``: gather this node's shards of
        ``src`` now (``stage_out``, step order) and queue the pages for the worker's offers.
        A refused command is a failed ``RankWriteDone`` naming the field."""
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
            # Indices from a socket: range-checked before anything gathers or copies them.
            validate_pages(src, self.local_kv.num_pages, "src_pages")
            validate_pages(dst, peer.layout.num_pages, "dst_pages")
            if len(src) != len(dst):
                raise RankError(f"src_pages, dst_pages: {len(src)} != {len(dst)} pages")
            if getattr(self.local_kv, "mode", "") == "jax":   # gathered now (step order)
                room = check_int("room", msg.get("room", 0), 0, MAX_ROOM)
                self.local_kv.stage_out(src)
                self._jobs.put((job, self._generation, peer, (src, dst, [], room)))
                return
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
            if isinstance(parts, tuple):          # the jax backend: this node's offers
                try:
                    node_bytes, n = self.engine.write_pages(self.local_kv, peer, *parts)
                except (TransferError, ValueError) as e:
                    self._reply(peer, job, ok=False, reason=f"KV offer failed: {e}")
                    continue
                self._reply(peer, job, ok=True, node_bytes=node_bytes, ncopies=n)
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
