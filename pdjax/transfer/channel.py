"""ZMQ control channel of one PD server (DESIGN.md §4, plane 2).

Each server binds one PULL socket on a free port (its ``rank_port``) and answers peers through
PUSH sockets, one per peer endpoint, created on first use. Every message is one frame holding
one msgpack map (``pdjax.pd.protocol``); a receiver thread decodes it and hands the typed
message to the role's handler. A frame that does not parse (wrong frame count, bad msgpack,
unknown type, a field out of range) is counted, logged and dropped: the server keeps serving.
With a shared ``secret`` every frame is sealed on send and authenticated before parsing (HMAC,
replay counter, time window; ``frame_auth.FrameAuthenticator``); a frame that fails is counted
by reason (``hmac``, ``replay``, ``stale``) and dropped.

    peer PUSH --frame--> PULL [recv thread] --(auth)--> decode_message --> handler(msg)
                                   '--AuthError / ProtocolError--> rejected += 1, log

Pure Python (pyzmq); never imports JAX.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from typing import Callable

import zmq

from pdjax.pd.frame_auth import (AUTH_PREFIX_BYTES, AuthError, FrameAuthenticator,
                                 FrameSealer)
from pdjax.pd.protocol import Message, decode_message
from pdjax.pd.wire import MAX_FRAME_BYTES, ProtocolError

logger = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000
_POLL_MS = 100


def advertise_host(host: str) -> str:
    """The address peers should use to reach a socket bound on ``host`` (``0.0.0.0`` and
    ``::`` are replaced by this machine's primary IP, falling back to 127.0.0.1)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))        # no packet is sent
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MessageChannel:
    """A bound PULL socket with a receiver thread, plus cached PUSH sockets.

    ``handler(msg)`` runs on the receiver thread for every valid message; it must not block
    for long. With ``handler`` None the socket is bound (``endpoint`` is known) but nothing is
    read until ``start(handler)``: ZMQ queues what arrives, so the owner of the channel can be
    built after it and still miss no message. ``on_reject(reason, kind)`` is called for every dropped frame (``kind``:
    ``malformed``, or the ``AuthError`` reason). ``secret``: seal and authenticate every frame
    (None: plain frames, as before). ``send`` is thread-safe and returns False (logging why)
    when the message could not be queued within ``SEND_TIMEOUT_MS``. Raises
    ``zmq.ZMQError`` if no port can be bound.
    """

    def __init__(self, host: str, handler: Callable[[Message], None] | None, name: str,
                 on_reject: Callable[[str, str], None] | None = None,
                 secret: str | bytes | None = None):
        self.name = name
        self._handler = handler
        self._on_reject = on_reject
        self._sealer = FrameSealer(secret) if secret else None
        self._auth = FrameAuthenticator(secret) if secret else None
        self.rejected_by_kind: collections.Counter = collections.Counter()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + AUTH_PREFIX_BYTES)
        bind_host = "*" if host in ("0.0.0.0", "::", "") else host
        self.port = self._pull.bind_to_random_port(f"tcp://{bind_host}")
        self.host = advertise_host(host)
        self.endpoint = f"tcp://{self.host}:{self.port}"
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self.num_rejected = 0
        self._thread: threading.Thread | None = None
        if handler is not None:
            self.start(handler)

    def start(self, handler: Callable[[Message], None],
              on_reject: Callable[[str, str], None] | None = None) -> None:
        """Start the receiver thread with ``handler`` (and ``on_reject``, when given);
        ``RuntimeError`` when already started."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: the channel's receiver is already running")
        self._handler = handler
        if on_reject is not None:
            self._on_reject = on_reject
        self._thread = threading.Thread(target=self._run, name=f"pd-{self.name}-recv",
                                        daemon=True)
        self._thread.start()

    # -- receiving -------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.error("%s: receive failed: %s", self.name, e)
                continue
            if len(frames) != 1:
                self._reject(f"expected 1 frame, got {len(frames)}")
                continue
            try:
                body = frames[0] if self._auth is None else self._auth.open(frames[0])
            except AuthError as e:
                self._reject(str(e), e.reason)
                continue
            try:
                msg = decode_message(body)
            except ProtocolError as e:
                self._reject(str(e))
                continue
            try:
                self._handler(msg)
            except Exception:       # a handler bug must not kill the channel
                logger.exception("%s: handling %s failed", self.name, type(msg).__name__)

    def _reject(self, reason: str, kind: str = "malformed") -> None:
        self.num_rejected += 1
        self.rejected_by_kind[kind] += 1
        what = "malformed" if kind == "malformed" else f"unauthenticated ({kind})"
        logger.error("%s: rejected a %s control frame: %s", self.name, what, reason)
        if self._on_reject is not None:
            try:
                self._on_reject(reason, kind)
            except Exception:
                logger.exception("%s: on_reject failed", self.name)

    # -- sending ---------------------------------------------------------------------------
    def seal(self, msg: Message) -> bytes:
        """The frame ``send`` puts on the wire for ``msg`` (sealed when a secret is set)."""
        frame = msg.encode()
        return frame if self._sealer is None else self._sealer.seal(frame)

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` for the peer PULL socket at ``endpoint`` (``tcp://host:port``); False
        (logged) when it cannot be queued within ``SEND_TIMEOUT_MS``, e.g. no peer listens
        there any more."""
        with self._send_lock:
            # Sealed under the lock: frames leave in counter order.
            frame = self.seal(msg)
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
                # Queue only on a live connection: to a peer that died (a killed prefill, whose
                # restart listens on a new port) a send fails after SNDTIMEO instead of
                # queueing for a reconnect that never comes (a decode's page list was lost so,
                # and both sides waited out their timeouts).
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame)
                return True
            except zmq.ZMQError as e:
                logger.error("%s: could not send %s to %s: %s", self.name,
                             type(msg).__name__, endpoint, e)
                return False

    def drop_peer(self, endpoint: str) -> None:
        """Close the PUSH socket of a peer that went away (a restarted peer gets a new one)."""
        with self._send_lock:
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close(0)

    def close(self) -> None:
        """Stop the receiver thread and close every socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()
