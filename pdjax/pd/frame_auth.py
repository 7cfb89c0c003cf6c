"""Authentication of PD control frames with a shared secret (DESIGN.md §4).

Pure Python; never imports JAX.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time

from pdjax.pd.wire import ProtocolError

# Frame authentication. A sealed frame is
#
#     offset 0   sender id   16 bytes   random per sending channel
#            16  counter     uint64 LE  strictly increasing per sender
#            24  unix time   float64 LE seconds, when sealed
#            32  tag         32 bytes   HMAC-SHA256(secret, bytes 0..31 + body)
#            64  body        one msgpack message (``Message.encode``)
#
# The receiver checks the tag before it parses anything, then refuses a counter not above the
# last one it accepted from that sender (a replay) and a time outside the window (an old frame
# replayed to a receiver that forgot the sender, e.g. after a restart).

SECRET_ENV = "PDJAX_DISAGGREGATION_SECRET"
AUTH_HEADER = struct.Struct("<16sQd")
AUTH_TAG_BYTES = 32
AUTH_PREFIX_BYTES = AUTH_HEADER.size + AUTH_TAG_BYTES
AUTH_WINDOW_S = 60.0
_MAX_SENDERS = 4096


class AuthError(ProtocolError):
    """A frame that fails authentication; ``reason`` is ``hmac``, ``replay`` or ``stale``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def resolve_secret(configured: str | None) -> str | None:
    """The shared secret: ``--disaggregation-secret``, else ``$PDJAX_DISAGGREGATION_SECRET``,
    else None (unauthenticated control plane)."""
    return configured or os.environ.get(SECRET_ENV) or None


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key of a shared secret (UTF-8 bytes). ``ValueError`` for an empty secret."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("disaggregation_secret: must not be empty")
    return key


def _auth_tag(key: bytes, header: bytes, body: bytes) -> bytes:
    return hmac.new(key, header + body, hashlib.sha256).digest()


class FrameSealer:
    """Seals outgoing frames with one sender id and a counter (thread-safe)."""

    def __init__(self, secret: str | bytes, clock=time.time):
        self._key = secret_key(secret)
        self._clock = clock
        self.sender_id = os.urandom(16)
        self._counter = 0
        self._lock = threading.Lock()

    def seal(self, body: bytes) -> bytes:
        with self._lock:
            self._counter += 1
            header = AUTH_HEADER.pack(self.sender_id, self._counter, float(self._clock()))
        return header + _auth_tag(self._key, header, body) + body


class FrameAuthenticator:
    """Checks sealed frames: tag, then replay and time window. Thread-safe.

    ``open(frame)`` returns the body, or raises ``AuthError`` (``reason`` hmac | replay |
    stale). ``window_s``: the most a frame's time may differ from this clock (seconds).
    """

    def __init__(self, secret: str | bytes, window_s: float = AUTH_WINDOW_S, clock=time.time):
        self._key = secret_key(secret)
        self.window_s = window_s
        self._clock = clock
        self._last: dict[bytes, tuple[int, float]] = {}     # sender -> (counter, time)
        self._lock = threading.Lock()

    def open(self, frame: bytes) -> bytes:
        frame = bytes(frame)
        if len(frame) < AUTH_PREFIX_BYTES:
            raise AuthError("hmac", f"frame: {len(frame)} bytes, shorter than the "
                                    f"{AUTH_PREFIX_BYTES}-byte authentication prefix")
        header, tag = frame[:AUTH_HEADER.size], frame[AUTH_HEADER.size:AUTH_PREFIX_BYTES]
        body = frame[AUTH_PREFIX_BYTES:]
        if not hmac.compare_digest(tag, _auth_tag(self._key, header, body)):
            raise AuthError("hmac", "frame: HMAC mismatch (wrong secret or tampered frame)")
        sender, counter, sent_s = AUTH_HEADER.unpack(header)
        now = self._clock()
        if not abs(now - sent_s) <= self.window_s:
            raise AuthError("stale", f"frame: sealed {now - sent_s:.1f} s ago, outside the "
                                     f"{self.window_s:g} s window")
        with self._lock:
            last = self._last.get(sender)
            if last is not None and counter <= last[0]:
                raise AuthError("replay", f"frame: counter {counter} of sender "
                                          f"{sender.hex()[:8]} already seen (replay)")
            if last is None and len(self._last) >= _MAX_SENDERS:
                # Senders silent for longer than the window can only send fresh frames.
                self._last = {k: v for k, v in self._last.items()
                              if now - v[1] <= self.window_s}
            self._last[sender] = (counter, now)
        return body
