"""The ``jax`` PD data plane: pulls over ``jax.experimental.transfer`` (DESIGN.md §4).

Pull-based, as vLLM tpu-inference's ``TPUConnector`` and sglang-jax's ``jax_transfer`` backend
are (``../shared/reference/tpu_data_plane.md``): the prefill offers compact device arrays
under a fresh id, the decode pulls them in its own sharding (head-group units between
different TP sizes, ``JaxLocalKV.units_for``). It is a ``TransferEngine`` so that
the rest of the PD plumbing (registration, page lists, status, aborts, metrics) stays the
Mooncake path's; only the chunk write differs (``write_pages``, which the prefill's transfer
worker calls instead of address copies), and the decode's pool takes the pulled rows at a
step boundary (``JaxLocalKV.stage_in``).

Per process: one transfer server, sized explicitly (``transfer_size_mib`` x
``parallel_copies`` x 3 of host memory; the library's default pins 6 GiB), and one control
socket (ZMQ ROUTER) for offers; ``session_id`` is that socket's ``host:port`` (a decode
registers it with the prefill as it registers its Mooncake session), ``transfer_address`` the
server's.

One chunk (prefill transfer thread -> decode pull thread)::

    prefill: parts = the chunk's gathered arrays (JaxLocalKV.stage_out, engine thread)
             uuid = fresh 62-bit id (one per attempt: an entry can be pulled once)
             server.await_pull(uuid, parts, timeout=deadline + slack)   # memory backstop
             Offer{uuid, transfer address, layout descriptor, room, dst pages, metadata row}
                      ------------------------------------------------->  decode control thread
                                                                          -> pull worker:
                                                                          check the descriptor
                                                                          (refused: no pull)
                                                                          conn.pull(uuid, specs)
                                                                          wait is_ready() until
                                                                          its own deadline
                                                                          (expired: poison the
                                                                          connection, drop it)
                                                                          metadata row -> slot
                                                                   put_units(room, dst, units)
             <--------------------------- Ack{ok | error} ----------------
    prefill: drops its references; on an error or no ack by the deadline it resets its pull
             table (one offer in flight per process, so nothing else is in it) and raises
             ``TransferError``: the room fails with the reason, as a failed Mooncake write.

A chunk goes as one offer per decode node that needs units this process holds
(``JaxLocalKV.routes``; one for a one-process decode), node 0 last with the metadata row; over
several prefill processes each offers its own units and node 0 sends the row alone after every
node reported (``send_meta``, ``transfer/prefill_ranks.py``; DESIGN.md §6).

The library's own timeouts are swept lazily on the server and a pull from a dead address never
times out (the reference note's scenarios 16-20), so both deadlines here are pdjax's own.
The metadata row's bytes ride in the offer and land in the decode's registered metadata slot
before the ack, so the prefill's Success status still follows its row, as with Mooncake.
With ``--disaggregation-secret`` every offer is sealed as the ZMQ control frames are
(``pd.frame_auth``: HMAC-SHA256, a counter, a time window) and a decode refuses one that does
not open; without it offers are unauthenticated, as the control channel is. Either way the
decode writes only inside its registered metadata region and checks every descriptor.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import datetime
import logging
import secrets
import threading
import time
from typing import Any, Sequence

from pdjax.pd.frame_auth import AuthError, FrameAuthenticator, FrameSealer
from pdjax.pd.wire import MAX_ROOM, check_int
from pdjax.transfer.engine import TransferEngine, TransferError

logger = logging.getLogger(__name__)

OFFER_VERSION = 2        # 2: ``room`` (the chunk is (room, dst pages) on the decode)
MAX_OFFER_BYTES = 1 << 20


class JaxTransferEngine(TransferEngine):
    """A ``jax.experimental.transfer`` server plus its offer socket (module docstring).

    Args:
      hostname: the address peers reach this process at (both sockets bind to it).
      max_batch: accepted for the registry's signature (no copy batches here).
      transfer_size_mib, parallel_copies, channels: the transfer server's chunk size (MiB),
        parallel copies and TCP bulk channels; host memory = ``transfer_size_mib x
        parallel_copies x 3`` MiB (default 96 MiB).
      pull_timeout_s: the decode's deadline for one pull, seconds; the prefill waits that plus
        ``ack_slack_s`` for the ack.
      secret: the PD shared secret (``--disaggregation-secret``): offers sealed and checked.
    Raises ``ValueError`` for a bad size or timeout, ``TransferError`` when a socket or the
    server cannot start.
    """

    backend = "jax"
    data_plane = "jax"

    def __init__(self, hostname: str = "127.0.0.1", *, max_batch: int = 1024,
                 transfer_size_mib: int = 16, parallel_copies: int = 2, channels: int = 1,
                 pull_timeout_s: float = 60.0, ack_slack_s: float = 10.0,
                 pull_workers: int = 4, secret: str | None = None, **_ignored):
        super().__init__(max_batch=max_batch, check_sources=True)
        for name, v in (("transfer_size_mib", transfer_size_mib),
                        ("parallel_copies", parallel_copies), ("channels", channels),
                        ("pull_workers", pull_workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        for name, v in (("pull_timeout_s", pull_timeout_s), ("ack_slack_s", ack_slack_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {v!r}")
        import jax
        import zmq
        from jax.experimental import transfer

        self.pull_timeout_s, self.ack_slack_s = float(pull_timeout_s), float(ack_slack_s)
        # With a shared secret every offer is sealed (HMAC, counter, time) as the ZMQ control
        # frames are, and a decode opens it before it reads a field.
        self._sealer = FrameSealer(secret) if secret else None
        self._auth = FrameAuthenticator(secret) if secret else None
        self.num_auth_rejected = 0
        self.host_memory_bytes = (transfer_size_mib << 20) * parallel_copies * 3
        try:
            self._server = transfer.start_transfer_server(
                jax.local_devices()[0].client, f"{hostname}:0", [f"{hostname}:0"] * channels,
                max_num_parallel_copies=parallel_copies, transfer_size=transfer_size_mib << 20)
        except Exception as e:
            raise TransferError(f"jax transfer server on {hostname} did not start: {e}") from e
        self.transfer_address = self._server.address()
        self._zmq = zmq.Context.instance()
        self._router = self._zmq.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            port = self._router.bind_to_random_port(f"tcp://{hostname}")
        except zmq.ZMQError as e:
            raise TransferError(f"jax offer socket on {hostname}: {e}") from e
        self._session = f"{hostname}:{port}"
        self._kv = None
        self._conns: dict[str, Any] = {}
        self._conn_lock = threading.Lock()
        self._offer_lock = threading.Lock()      # one offer in flight per process
        # Pull workers hand their acks to the offer thread over inproc PUSH sockets (one per
        # worker thread: ZMQ sockets are not thread-safe), which wake its poll at once.
        self._reply_addr = f"inproc://pd-jax-replies-{id(self):x}"
        self._reply_pull = self._zmq.socket(zmq.PULL)
        self._reply_pull.bind(self._reply_addr)
        self._tls = threading.local()
        self._push_socks: list = []
        self._pool = concurrent.futures.ThreadPoolExecutor(pull_workers,
                                                           thread_name_prefix="pd-jax-pull")
        self._stop = threading.Event()
        self.num_pull_timeouts = 0
        self.num_refused_offers = 0
        self._thread = threading.Thread(target=self._serve, name="pd-jax-offers", daemon=True)
        self._thread.start()
        logger.info("jax transfer: server %s (%d MiB host memory), offers on %s",
                    self.transfer_address, self.host_memory_bytes >> 20, self._session)

    @property
    def session_id(self) -> str:
        return self._session

    def attach_kv(self, kv) -> None:
        """The ``JaxLocalKV`` whose arrays this engine offers and into which it pulls."""
        self._kv = kv

    # -- TransferEngine hooks ------------------------------------------------------------
    def _register(self, addr: int, length: int) -> None:
        pass          # nothing is written by address; regions are kept for the checks

    def _unregister(self, addr: int) -> None:
        pass

    def _write_batch(self, peer_session_id, srcs, dsts, lens) -> None:
        raise TransferError("jax backend: no one-sided writes (pull-based; write_pages)")

    def _shutdown(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._router.close(0)
        with self._conn_lock:
            socks, self._push_socks = self._push_socks, []
        for sock in socks:
            sock.close(0)
        self._reply_pull.close(0)

    # -- prefill: offer a chunk ----------------------------------------------------------
    def write_pages(self, local_kv, peer, src: Sequence[int], dst: Sequence[int],
                    meta: Sequence[tuple[int, int, int]],
                    room: int = 0) -> tuple[list[int], int]:
        """Offer the arrays ``local_kv.stage_out(src)`` gathered to the decode ``peer`` (a
        ``DecodePeer``: ``session_id``, ``layout``, and a multi-host decode's
        ``node_sessions`` / ``shard_nodes``) for its pages ``dst``: one offer per decode node
        that needs units this process holds (``local_kv.routes``), node 0 last with the
        metadata row copies ``meta`` (``(src_addr, dst_addr, length)``: the bytes travel in
        the offer); ``room``: the chunk's ``bootstrap_room`` (the decode joins a chunk's
        offers by room and pages); blocks until each is acked. Returns ``(bytes per decode node, node 0
        first; arrays)``: the bytes the decode's shards received from this process
        (``len(dst)`` x their bytes per page, as Mooncake counts them) and the arrays pulled
        (head-group units). Raises ``TransferError`` (a decode node refused, failed or did
        not ack within ``pull_timeout_s + ack_slack_s``) or ``ValueError`` (nothing gathered
        for ``src``, a metadata source outside registered memory). The arrays are taken from
        ``local_kv`` first and released on every exit, so none outlives a failed offer."""
        parts = local_kv.take_gathered(src) if len(src) else None
        try:
            rows = self._meta_rows(meta)
            units, routes = local_kv.routes(peer.layout, peer.session_id,
                                            getattr(peer, "node_sessions", ()),
                                            getattr(peer, "shard_nodes", ()))
            node_bytes, arrays = [0] * len(routes), 0
            for i, (node, session, which, per_page) in enumerate(routes):
                last_rows = rows if i == len(routes) - 1 else []
                if parts is None or not any(which):
                    if last_rows:
                        self._offer(session, None, None, 0, dst, last_rows, 0, room)
                    continue
                bucket = int(parts[0].shape[1])
                sub = local_kv.offer_units(parts, units, which)
                nbytes = len(dst) * per_page
                self._offer(session, sub, local_kv.offer_descriptor(bucket, units, which),
                            bucket, dst, last_rows, nbytes, room)
                node_bytes[node], arrays = nbytes, arrays + len(sub)
            return node_bytes, arrays
        finally:
            # A raised error's traceback keeps this frame alive: drop the arrays here.
            parts = sub = None

    def send_meta(self, session: str, meta: Sequence[tuple[int, int, int]]) -> None:
        """Write the metadata row copies ``meta`` into the decode ``session`` (an offer with no
        arrays): a multi-host prefill's node 0 sends it after every node's KV was pulled.
        ``TransferError`` / ``ValueError`` as ``write_pages``."""
        rows = self._meta_rows(meta)
        if rows:
            self._offer(session, None, None, 0, [], rows, 0)

    def _meta_rows(self, meta: Sequence[tuple[int, int, int]]) -> list:
        rows = []
        for i, (s, d, n) in enumerate(meta):
            if self.find_region(s, n) is None:
                raise ValueError(f"meta[{i}].src_addr: [{s:#x}, +{n}) is not registered")
            rows.append([int(d), ctypes.string_at(s, n)])
        return rows

    def _offer(self, session: str, parts: list | None, buffers: list | None, bucket: int,
               dst: Sequence[int], rows: list, nbytes: int, room: int = 0) -> None:
        """One offer to the decode ``session``: ``parts`` (None: the metadata ``rows`` alone)
        under a fresh uuid, held until its ack; ``TransferError`` on a refusal or no ack."""
        uuid = secrets.randbits(62) | 1 if parts else 0
        offer = {"v": OFFER_VERSION, "uuid": uuid, "address": self.transfer_address,
                 "dst": [int(p) for p in dst], "bucket": bucket, "buffers": buffers,
                 "meta": rows, "room": int(room)}
        wait_s = self.pull_timeout_s + self.ack_slack_s
        t0 = time.perf_counter()
        with self._offer_lock:
            if parts:
                backstop = datetime.datetime.now() + datetime.timedelta(seconds=wait_s + 5)
                self._server.await_pull(uuid, parts, timeout=backstop)
            try:
                reply = self._request(session, offer, wait_s)
                if not reply.get("ok"):
                    raise TransferError(f"jax pull by decode {session} failed: "
                                        f"{reply.get('error', 'no reason')}")
            except BaseException:
                if parts:
                    self._server._reset_rendevous_table()     # frees the offered arrays
                self._count(failed=True)
                raise
        self._count(nbytes=nbytes, copies=len(parts or ()), seconds=time.perf_counter() - t0)

    def _request(self, session: str, offer: dict, wait_s: float) -> dict:
        import msgpack
        import zmq

        sock = self._zmq.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{session}")
            data = msgpack.packb(offer, use_bin_type=True)
            sock.send(self._sealer.seal(data) if self._sealer is not None else data)
            if not sock.poll(int(wait_s * 1000)):
                raise TransferError(f"jax transfer: decode {session} did not ack the pull of "
                                    f"{len(offer['dst'])} pages within {wait_s:.0f} s")
            reply = msgpack.unpackb(sock.recv(), raw=False)
        finally:
            sock.close(0)
        if not isinstance(reply, dict):
            raise TransferError(f"jax transfer: malformed ack from decode {session}")
        return reply

    def _count(self, nbytes: int = 0, copies: int = 0, seconds: float = 0.0,
               failed: bool = False) -> None:
        with self._lock:
            c = self._counters
            self._counters = dataclasses.replace(
                c, bytes=c.bytes + nbytes, copies=c.copies + copies,
                batches=c.batches + (0 if failed else 1), failures=c.failures + int(failed),
                largest_batch=max(c.largest_batch, copies), seconds=c.seconds + seconds)

    # -- decode: serve offers ------------------------------------------------------------
    def _serve(self) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._reply_pull, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._reply_pull in ready:
                while True:
                    try:
                        ident, body = self._reply_pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._router.send_multipart([ident, b"", body])
            if self._router not in ready:
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) > MAX_OFFER_BYTES:
                logger.error("jax transfer: malformed offer frame dropped")
                continue
            body = frames[2]
            if self._auth is not None:
                try:
                    body = self._auth.open(body)
                except AuthError as e:
                    self.num_auth_rejected += 1
                    logger.error("jax transfer: offer refused: %s", e)
                    self._reply(frames[0], {"ok": False, "error": f"offer refused: {e}"})
                    continue
            try:
                offer = msgpack.unpackb(body, raw=False)
            except Exception:
                offer = None
            if not isinstance(offer, dict):
                self._reply(frames[0], {"ok": False, "error": "malformed offer"})
                continue
            self._pool.submit(self._pull_offer, frames[0], offer)

    def _reply(self, ident: bytes, body: dict) -> None:
        """Queue ``body`` for the offer thread to send to ``ident`` (any thread)."""
        import msgpack
        import zmq

        sock = getattr(self._tls, "push", None)
        if sock is None:
            sock = self._tls.push = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._reply_addr)
            with self._conn_lock:
                self._push_socks.append(sock)
        sock.send_multipart([ident, msgpack.packb(body)])

    def _pull_offer(self, ident: bytes, offer: dict) -> None:
        try:
            nbytes = self._pull(offer)
            body = {"ok": True, "bytes": nbytes}
        except Exception as e:       # refused or failed: the prefill fails the room
            logger.warning("jax transfer: offer not pulled: %s", e)
            body = {"ok": False, "error": str(e)[:2000]}
        self._reply(ident, body)

    def _pull(self, offer: dict) -> int:
        kv = self._kv
        if kv is None:
            raise TransferError("this server has no KV pool for the jax backend")
        if offer.get("v") != OFFER_VERSION:
            raise ValueError(f"offer version: prefill {offer.get('v')!r} != decode "
                             f"{OFFER_VERSION}")
        uuid, address, bucket = offer.get("uuid"), offer.get("address"), offer.get("bucket")
        dst, room = offer.get("dst"), offer.get("room")
        if not isinstance(uuid, int) or not isinstance(address, str) \
                or not isinstance(bucket, int) or not isinstance(dst, list) \
                or not all(isinstance(p, int) for p in dst):
            raise ValueError("offer: uuid, address, bucket or dst missing or mistyped")
        check_int("room", room, 0, MAX_ROOM)
        rows = offer.get("meta") or []
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], int)
                    and isinstance(row[1], bytes)):
                raise ValueError(f"offer meta[{i}]: expected [dst_addr, bytes]")
            r = self.find_region(row[0], max(1, len(row[1])))
            if r is None or r.label != "metadata":
                raise ValueError(f"offer meta[{i}]: destination outside the metadata rows")
        if offer.get("buffers") is None:           # the metadata row alone (multi-host)
            for dst_addr, data in rows:
                ctypes.memmove(dst_addr, data, len(data))
            return 0
        try:
            units, which = kv.check_offer(offer.get("buffers"), dst, bucket)
            kv.check_join(room, dst, units, bucket)
        except ValueError:
            self.num_refused_offers += 1
            raise
        t0 = time.perf_counter()
        conn = self._connection(address)
        parts = conn.pull(uuid, kv.pull_specs(bucket, units, which))
        deadline = time.monotonic() + self.pull_timeout_s
        while not all(p.is_ready() for p in parts):
            if time.monotonic() > deadline or self._stop.is_set():
                self.num_pull_timeouts += 1
                self._drop_connection(address, conn)
                raise TransferError(f"jax pull of {len(dst)} pages from {address} timed out "
                                    f"after {self.pull_timeout_s:.0f} s (connection reset)")
            time.sleep(0.0005)
        try:
            for p in parts:
                p.block_until_ready()       # an error array raises here
        except Exception as e:
            self._drop_connection(address, conn)
            raise TransferError(f"jax pull from {address} failed: {e}") from e
        for dst_addr, data in rows:
            ctypes.memmove(dst_addr, data, len(data))
        kv.put_units(dst, units, which, parts, room=room, bucket=bucket)
        nbytes = kv.received_bytes(units, which, len(dst))
        self._count(nbytes=nbytes, copies=len(parts), seconds=time.perf_counter() - t0)
        return nbytes

    def _connection(self, address: str):
        with self._conn_lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self._server.connect(address)
            return conn

    def _drop_connection(self, address: str, conn) -> None:
        """Fail what is pending on ``conn`` and forget it: the next pull reconnects."""
        with self._conn_lock:
            if self._conns.get(address) is conn:
                del self._conns[address]
        try:
            conn._poison_connection()
        except Exception:
            pass
