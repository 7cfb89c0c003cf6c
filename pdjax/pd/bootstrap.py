"""Bootstrap plane: the prefill's HTTP directory of its ranks, and the client side.

DESIGN.md §4 plane 1 (SGLang's bootstrap server and its routes). The prefill server runs one
``BootstrapServer`` (aiohttp, on its own event loop in a daemon thread, default port 8998):

    PUT /route    a prefill rank registers: rank_ip, rank_port (its ZMQ PULL port), tp_rank,
                  tp_size, page_size, kv_dtype, layout_fingerprint, protocol_version, and
                  optionally its transfer session_id, kv_layout and kv_buffers (each node of
                  a multi-host prefill registers its own shards, DESIGN.md §6) (JSON); 200, or 400 (bad field) / 409 (disagrees with the ranks already registered);
                  with a shared secret, 401 unless ``Authorization: Bearer <secret>``
    GET /route    the topology (``PrefillServerInfo`` JSON); 503 until all tp_size ranks are
                  registered; ``?tp_rank=N`` returns that rank only (404 if unknown)
    GET /health   200 "OK" (decode's heartbeat)

The decode side calls ``fetch_prefill_info`` (polls through 503s until a deadline) and then
``check_compatible``, which refuses to pair on a page size, KV dtype, layout or protocol
mismatch with a clear ``IncompatiblePeerError`` instead of a hang (SGLang PR 14474).
The clients are synchronous (urllib, proxies disabled) so the engine loop thread can call them.
Pure Python; never imports JAX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from aiohttp import web

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import PROTOCOL_VERSION
from pdjax.pd.wire import KV_LAYOUTS, MAX_BUFFERS, MAX_PAGE_SIZE

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
_MAX_TP = 1024
_MAX_BODY = 64 << 10


class BootstrapError(RuntimeError):
    """The bootstrap server could not be reached or did not become ready in time."""


class IncompatiblePeerError(ValueError):
    """Prefill and decode disagree on page size, KV dtype, KV layout or protocol version."""


def _field(d: dict, name: str, kind: type, lo: int | None = None, hi: int | None = None,
           max_len: int = 256) -> Any:
    if name not in d:
        raise ValueError(f"field {name!r}: missing")
    v = d[name]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"field {name!r}: expected an int in [{lo}, {hi}], got {v!r}")
    elif not isinstance(v, str) or not v or len(v) > max_len:
        raise ValueError(f"field {name!r}: expected a non-empty str (<= {max_len} chars), "
                         f"got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class PrefillRankInfo:
    """One prefill rank's registration (the PUT /route body).

    ``rank_ip``/``rank_port``: where its ZMQ PULL socket listens (a decode talks to rank 0's
    only); ``tp_rank`` in ``[0, tp_size)``
    (a multi-host prefill registers one rank per node: ``tp_rank`` = node rank, ``tp_size`` =
    nodes); ``page_size`` in tokens; ``kv_dtype`` (e.g. ``bfloat16``); ``layout_fingerprint``
    from ``kv_export.kv_layout_fingerprint``. Optional, the rank's own data plane (sglang-jax
    #1364: a host exposes only its local shards): ``session_id`` (its transfer engine's peer
    id), ``kv_layout`` and ``kv_buffers`` (``KVBufferDesc`` per buffer: its addressable shards'
    addresses and KV head ranges), ``transfer_backend`` (its data plane, e.g. ``mooncake`` or
    ``jax``; "" unknown). Raises ``ValueError`` naming the field.
    """

    rank_ip: str
    rank_port: int
    tp_rank: int
    tp_size: int
    page_size: int
    kv_dtype: str
    layout_fingerprint: str
    protocol_version: int = PROTOCOL_VERSION
    session_id: str = ""
    kv_layout: str = ""
    kv_buffers: tuple[KVBufferDesc, ...] = ()
    transfer_backend: str = ""

    def __post_init__(self):
        self._validated(self.to_json())

    @classmethod
    def from_json(cls, d: Any) -> "PrefillRankInfo":
        """Parse a PUT /route body; ``ValueError`` naming the field (unknown fields rejected)."""
        return cls(**cls._validated(d))

    @classmethod
    def _validated(cls, d: Any) -> dict:
        if not isinstance(d, dict):
            raise ValueError("body: expected a JSON object")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"body: unknown field(s) {unknown}")
        d = dict(d)
        d.setdefault("protocol_version", PROTOCOL_VERSION)
        tp_size = _field(d, "tp_size", int, 1, _MAX_TP)
        return dict(
            rank_ip=_field(d, "rank_ip", str), rank_port=_field(d, "rank_port", int, 1, 65535),
            tp_rank=_field(d, "tp_rank", int, 0, tp_size - 1), tp_size=tp_size,
            page_size=_field(d, "page_size", int, 1, MAX_PAGE_SIZE),
            kv_dtype=_field(d, "kv_dtype", str, max_len=32),
            layout_fingerprint=_field(d, "layout_fingerprint", str),
            protocol_version=_field(d, "protocol_version", int, 0, 1 << 16),
            **cls._data_plane(d))

    @staticmethod
    def _data_plane(d: dict) -> dict:
        """The optional ``session_id`` / ``kv_layout`` / ``kv_buffers``, checked."""
        out = {"session_id": d.get("session_id", ""), "kv_layout": d.get("kv_layout", ""),
               "kv_buffers": d.get("kv_buffers", []),
               "transfer_backend": d.get("transfer_backend", "")}
        if not isinstance(out["session_id"], str) or len(out["session_id"]) > 256:
            raise ValueError("field 'session_id': expected a str of at most 256 chars")
        if not isinstance(out["transfer_backend"], str) or len(out["transfer_backend"]) > 32:
            raise ValueError("field 'transfer_backend': expected a str of at most 32 chars")
        bufs = out["kv_buffers"]
        if not isinstance(bufs, (list, tuple)) or len(bufs) > MAX_BUFFERS:
            raise ValueError(f"field 'kv_buffers': expected a list of at most {MAX_BUFFERS}")
        if bufs and out["kv_layout"] not in KV_LAYOUTS:
            raise ValueError(f"field 'kv_layout': {out['kv_layout']!r} not in {KV_LAYOUTS}")
        out["kv_buffers"] = tuple(
            b if isinstance(b, KVBufferDesc) else KVBufferDesc.from_wire(f"kv_buffers[{i}]", b)
            for i, b in enumerate(bufs))
        return out

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kv_buffers"] = [b.to_wire() for b in self.kv_buffers]
        return d


# Fields every rank of one prefill server must agree on.
_SHARED_FIELDS = ("tp_size", "page_size", "kv_dtype", "layout_fingerprint", "protocol_version",
                  "transfer_backend")


@dataclasses.dataclass(frozen=True)
class PrefillServerInfo:
    """The GET /route answer: the shared parameters and every rank, sorted by ``tp_rank``."""

    tp_size: int
    page_size: int
    kv_dtype: str
    layout_fingerprint: str
    protocol_version: int
    ranks: tuple[PrefillRankInfo, ...]
    transfer_backend: str = ""

    def rank(self, tp_rank: int) -> PrefillRankInfo:
        """The rank with ``tp_rank``; ``ValueError`` if absent."""
        for r in self.ranks:
            if r.tp_rank == tp_rank:
                return r
        raise ValueError(f"tp_rank: {tp_rank} not in the prefill topology")

    def to_json(self) -> dict:
        d = {name: getattr(self, name) for name in _SHARED_FIELDS}
        d["ranks"] = [r.to_json() for r in self.ranks]
        return d

    @classmethod
    def from_json(cls, d: Any) -> "PrefillServerInfo":
        """Parse and validate; ``ValueError`` naming the field (ranks must be 0..tp_size-1 and
        agree with the shared fields)."""
        if not isinstance(d, dict) or not isinstance(d.get("ranks"), list):
            raise ValueError("body: expected an object with a 'ranks' list")
        ranks = tuple(sorted((PrefillRankInfo.from_json(r) for r in d["ranks"]),
                             key=lambda r: r.tp_rank))
        shared = {name: d.get(name, "" if name == "transfer_backend" else None)
                  for name in _SHARED_FIELDS}
        _field(shared, "tp_size", int, 1, _MAX_TP)
        if [r.tp_rank for r in ranks] != list(range(shared["tp_size"])):
            raise ValueError(f"field 'ranks': tp ranks {[r.tp_rank for r in ranks]} do not "
                             f"cover tp_size {shared['tp_size']}")
        for r in ranks:
            for name in _SHARED_FIELDS:
                if getattr(r, name) != shared[name]:
                    raise ValueError(f"field {name!r}: rank {r.tp_rank} has "
                                     f"{getattr(r, name)!r}, server has {shared[name]!r}")
        return cls(ranks=ranks, **shared)


def check_compatible(info: PrefillServerInfo, *, page_size: int, kv_dtype: str,
                     layout_fingerprint: str, transfer_backend: str = "") -> None:
    """Raise ``IncompatiblePeerError`` naming every field where decode and prefill differ.

    Checked: protocol version, page size, KV dtype, KV layout fingerprint and, where both
    sides name it (and neither is ``fake``, which moves no bytes), the transfer backend. A mismatch must stop the pairing: copying pages
    between different layouts would silently corrupt the KV, and two data planes never meet
    (a jax prefill's offers wait for pulls a Mooncake decode never makes).
    """
    ours = {"protocol_version": PROTOCOL_VERSION, "page_size": page_size, "kv_dtype": kv_dtype,
            "layout_fingerprint": layout_fingerprint}
    if transfer_backend and info.transfer_backend \
            and "fake" not in (transfer_backend, info.transfer_backend):
        ours["transfer_backend"] = transfer_backend
    diffs = [f"{name}: prefill {getattr(info, name)!r} != decode {value!r}"
             for name, value in ours.items() if getattr(info, name) != value]
    if diffs:
        raise IncompatiblePeerError("prefill and decode servers cannot pair: " + "; ".join(diffs))


# ---------------------------------------------------------------------------------------------
# Server.


class BootstrapServer:
    """The prefill's bootstrap HTTP server, on its own event loop in a daemon thread.

    ``port=0`` binds a free port; ``start()`` returns the bound port. ``stop()`` is idempotent.
    ``start()`` raises ``OSError`` if the port cannot be bound. ``secret``: writes (PUT /route)
    need ``Authorization: Bearer <secret>``; refused ones are counted in ``num_unauthorized``
    and reported to ``on_unauthorized()``.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_BOOTSTRAP_PORT,
                 secret: str | None = None, on_unauthorized=None):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
        self.host = host
        self.port = port
        self._secret = f"Bearer {secret}".encode() if secret else None
        self._on_unauthorized = on_unauthorized
        self.num_unauthorized = 0
        self._ranks: dict[int, PrefillRankInfo] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- state ---------------------------------------------------------------------------------

    def registered_ranks(self) -> list[PrefillRankInfo]:
        with self._lock:
            return [self._ranks[k] for k in sorted(self._ranks)]

    def server_info(self) -> PrefillServerInfo | None:
        """The topology once all ``tp_size`` ranks are registered, else ``None``."""
        with self._lock:
            ranks = [self._ranks[k] for k in sorted(self._ranks)]
        if not ranks or len(ranks) != ranks[0].tp_size:
            return None
        first = ranks[0]
        return PrefillServerInfo(ranks=tuple(ranks),
                                 **{n: getattr(first, n) for n in _SHARED_FIELDS})

    def add_rank(self, info: PrefillRankInfo) -> None:
        """Register (or re-register, e.g. after a restart) one rank. ``ValueError`` if it
        disagrees with the ranks already registered on a shared field."""
        with self._lock:
            for other in self._ranks.values():
                if other.tp_rank == info.tp_rank:
                    continue
                for name in _SHARED_FIELDS:
                    if getattr(other, name) != getattr(info, name):
                        raise ValueError(f"field {name!r}: {getattr(info, name)!r} differs from "
                                         f"rank {other.tp_rank}'s {getattr(other, name)!r}")
            self._ranks[info.tp_rank] = info
        logger.info("bootstrap: prefill rank %d/%d registered at %s:%d", info.tp_rank,
                    info.tp_size, info.rank_ip, info.rank_port)

    # -- HTTP handlers -------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if self._secret is None:
            return True
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, self._secret):
            return True
        self.num_unauthorized += 1
        logger.error("bootstrap: refused an unauthenticated %s %s from %s", request.method,
                     request.path, request.remote)
        if self._on_unauthorized is not None:
            self._on_unauthorized()
        return False

    async def _put_route(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401, text="unauthorized: a valid disaggregation secret "
                                                 "is required to register a prefill rank")
        try:
            body = await request.read()
            if len(body) > _MAX_BODY:
                raise ValueError(f"body: {len(body)} bytes exceeds {_MAX_BODY}")
            info = PrefillRankInfo.from_json(json.loads(body))
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            return web.Response(status=400, text=f"invalid registration: {e}")
        try:
            self.add_rank(info)
        except ValueError as e:
            return web.Response(status=409, text=f"conflicting registration: {e}")
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        info = self.server_info()
        if info is None:
            got = [r.tp_rank for r in self.registered_ranks()]
            return web.Response(status=503, text=f"prefill ranks not all registered "
                                                 f"(registered tp ranks: {got})")
        if "tp_rank" in request.query:
            try:
                return web.json_response(info.rank(int(request.query["tp_rank"])).to_json())
            except ValueError as e:
                return web.Response(status=404, text=str(e))
        return web.json_response(info.to_json())

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> int:
        """Start serving in a daemon thread; return the bound port."""
        if self._thread is not None:
            return self.port
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="pd-bootstrap", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise BootstrapError(f"bootstrap server did not start within {timeout_s} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_route("PUT", "/route", self._put_route)
        app.router.add_route("GET", "/route", self._get_route)
        app.router.add_route("GET", "/health", self._health)
        runner = web.AppRunner(app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
            self._loop = loop
        except BaseException as e:  # reported to start()
            self._error = e
            loop.run_until_complete(runner.cleanup())
            loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and join the thread."""
        if self._thread is None:
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._thread = None
        self._loop = None

    def __enter__(self) -> "BootstrapServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# Clients (synchronous).

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _url(host: str, port: int, path: str) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def _http(method: str, url: str, body: dict | None, timeout_s: float,
          secret: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def register_prefill_rank(host: str, port: int, info: PrefillRankInfo,
                          timeout_s: float = 30.0, secret: str | None = None) -> None:
    """PUT ``info`` to the bootstrap server at ``host:port``, retrying until ``timeout_s``;
    ``secret``: the shared disaggregation secret (sent as a bearer token).

    Connection errors and 5xx answers are retried with backoff (0.05 s doubling to 1 s);
    a 4xx answer (bad or conflicting registration) raises ``ValueError`` with the server's
    reason at once; running out of time raises ``BootstrapError``.
    """
    deadline = time.monotonic() + timeout_s
    delay, last = 0.05, "no attempt"
    url = _url(host, port, "/route")
    while True:
        remaining = deadline - time.monotonic()
        try:
            status, text = _http("PUT", url, info.to_json(), max(0.1, min(5.0, remaining)),
                                 secret)
            if status == 200:
                return
            if 400 <= status < 500:
                raise ValueError(f"bootstrap {url} refused rank {info.tp_rank}: "
                                 f"{status} {text.decode(errors='replace')}")
            last = f"HTTP {status}"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() + delay > deadline:
            raise BootstrapError(f"could not register prefill rank {info.tp_rank} at {url} "
                                 f"within {timeout_s} s (last error: {last})")
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def fetch_prefill_info(host: str, port: int, timeout_s: float = 30.0,
                       poll_interval_s: float = 0.1) -> PrefillServerInfo:
    """GET the prefill topology from ``host:port``, polling through 503s and refused connections.

    Returns the validated ``PrefillServerInfo``. Raises ``BootstrapError`` if it is not ready
    within ``timeout_s`` (the message says whether the server was unreachable or still waiting
    for ranks) or answers something malformed.
    """
    deadline = time.monotonic() + timeout_s
    url = _url(host, port, "/route")
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            status, text = _http("GET", url, None, max(0.1, min(5.0, remaining)))
            if status == 200:
                try:
                    return PrefillServerInfo.from_json(json.loads(text))
                except ValueError as e:
                    raise BootstrapError(f"malformed topology from {url}: {e}") from e
            last = f"HTTP {status} {text.decode(errors='replace')[:200]}"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() + poll_interval_s > deadline:
            raise BootstrapError(f"prefill bootstrap server {url} not ready within {timeout_s} s "
                                 f"(last answer: {last})")
        time.sleep(poll_interval_s)


def check_bootstrap_health(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """One GET /health; True on 200. Never raises for network errors (a heartbeat probe)."""
    try:
        status, _ = _http("GET", _url(host, port, "/health"), None, timeout_s)
    except OSError:
        return False
    return status == 200
