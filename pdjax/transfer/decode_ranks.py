"""A multi-host decode (DESIGN.md §6): node 0 runs the scheduler, the metadata rows and the PD
signalling; every node's KV shards are written by the prefill directly:

    node 0 (DecodeConnector, ``DecodeRanks``)         node R > 0 (``DecodeRankNode``)
    kv_ranks(reply) on the step socket  ------------>  its addresses re-checked, then
    DecodeRankInfo(session, own shards, gen 0)  <----  reported on the PD control channel
    RegisterDecode: every node's shards (one ``RankedLayout``), ``node_sessions``,
                    ``shard_nodes``: the prefill writes each node's shards to its session
    after every forward: kv_check  ----------------->  its cache moved: re-registered and
    DecodeRankInfo(gen + 1)  <-----------------------  reported; node 0 then fails the
                                                       transfers in flight and registers again

Pages are node 0's scheduler's: the cache is one global array sharded by heads, so a page
id is the same page on every node.

With the ``jax`` backend (pull-based, DESIGN.md §4) the prefill offers each node its units at
that node's own offer socket (its session); node 0's metadata gate sends ``kv_stage_in(pages)``
(``kv_drop`` for a failed room) before its own scatter, so every node scatters its pulled units
at the same step boundary (``DecodeRanks.attach``, ``DecodeRankNode.on_stage_in``).

Pure Python here; ``DecodeRankNode`` reaches JAX only through ``LocalKV`` and the runner.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdjax.pd.protocol import DecodeRankInfo, ProtocolError
from pdjax.pd.wire import MAX_ROOM, check_int, validate_pages
from pdjax.transfer.kv_copies import KVLayout
from pdjax.transfer.ranks import LOST_POLL_S, RankedLayout, node_data_plane

logger = logging.getLogger(__name__)


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

    def attach(self, local_kv) -> None:
        """Node 0's pool: a pull-based one (the jax backend) has every other node scatter its
        own pulled units at the same step boundary (``kv_stage_in``) or drop them
        (``kv_drop``), sent on the step socket before node 0's own (engine thread)."""
        if getattr(local_kv, "mode", "") == "jax":
            local_kv.mirror = self._mirror

    def _mirror(self, op: str, **fields) -> None:
        """Send ``op`` to every other node; with a node gone, a ``kv_stage_in`` raises
        ``ValueError`` (the room fails: its KV cannot be whole) and a ``kv_drop`` is skipped."""
        lost = self.cluster.lost
        if lost is None:
            try:
                self.cluster.send(op, **fields)
                return
            except RuntimeError as e:
                lost = str(e)
        if op == "kv_stage_in":
            raise ValueError(f"the other decode nodes cannot scatter their KV ({lost})")
        logger.warning("PD decode: %s not sent to the other nodes (%s)", op, lost)

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
    """Node R > 0 of a multi-host decode (node rank ``rank``): its own transfer ``engine`` and
    ``LocalKV`` (direct), into which the prefill writes its shards, and its control
    ``channel``; ``handlers`` for ``Cluster.follow`` (``kv_ranks``, ``kv_check``), made in step
    order. ``for_host`` builds the real parts of a follower's ``NodeRunner``."""

    def __init__(self, rank: int, engine, local_kv, channel):
        self.rank, self.engine, self.local_kv, self.channel = rank, engine, local_kv, channel
        self.reply: str | None = None          # node 0's control channel (from kv_ranks)
        self.generation = 0

    @classmethod
    def for_host(cls, host) -> "DecodeRankNode":
        from pdjax.pd.frame_auth import resolve_secret

        args = host.args
        engine, local_kv, channel = node_data_plane(
            host, f"decode-node-{args.node_rank}",
            resolve_secret(args.disaggregation_secret))
        node = cls(args.node_rank, engine, local_kv, channel)
        channel.start(node._on_message)
        return node

    @property
    def handlers(self) -> dict[str, Any]:
        out = {"kv_ranks": self.on_ranks, "kv_check": self.on_check}
        if getattr(self.local_kv, "mode", "") == "jax":
            out.update(kv_stage_in=self.on_stage_in, kv_drop=self.on_drop)
        return out

    def _pages(self, msg: dict) -> list[int]:
        """The ``pages`` of a ``kv_stage_in`` / ``kv_drop``: ``ProtocolError`` (a
        ``ValueError``) naming the field unless a list of distinct ids in ``[1, num_pages)``."""
        pages = msg.get("pages")
        if not isinstance(pages, list):
            raise ProtocolError(f"field 'pages': expected a page list, got "
                                f"{type(pages).__name__}")
        validate_pages(pages, self.local_kv.num_pages, "pages")
        return pages

    def on_stage_in(self, msg: dict) -> None:
        """``kv_stage_in`` (jax backend; node 0's metadata gate, a step boundary): scatter this
        node's pulled units of the room's pages, as node 0 does with its own. Node 0 has
        already scattered its shards and decodes next, so a scatter that does not happen here
        (pages refused, a unit missing, a JAX runtime error) would leave this node's heads of
        those pages stale: wrong tokens with no error. Any failure is therefore fatal to the
        node (``on_broken``: it exits, node 0 marks it lost, fails its requests in flight and
        reports 503 naming it, DESIGN.md §6)."""
        try:
            pages = self._pages(msg)
            # the pulled chunks of that bootstrap_room only (a message without one: any room)
            room = check_int("room", msg["room"], 0, MAX_ROOM) if "room" in msg else None
            self.local_kv.stage_in(pages, room=room)
        except Exception as e:      # noqa: BLE001 (any failure leaves the heads stale)
            self.on_broken(f"PD decode node {self.rank}: kv_stage_in of pages "
                           f"{str(msg.get('pages'))[:200]} failed ({type(e).__name__}: {e}); "
                           "its KV heads of those pages would be stale; exiting")

    def on_drop(self, msg: dict) -> None:
        """``kv_drop`` (jax backend): node 0 failed the room; forget its pulled units (a bad
        page list is logged: nothing is scattered, so nothing goes stale)."""
        try:
            self.local_kv.drop_arrived(self._pages(msg))
        except ValueError as e:
            logger.error("PD decode node %d: kv_drop: %s", self.rank, e)

    @staticmethod
    def on_broken(reason: str) -> None:
        """This node's KV shards can no longer be trusted: leave the process (exit 1) so node
        0 sees the node gone. Replaced by tests."""
        from pdjax.distributed.node import exit_now

        exit_now(1, reason)

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
