"""Picking TCP ports for servers a process is about to start (tests, benchmarks, launchers).

A port that ``bind(("127.0.0.1", 0))`` returned was free a moment ago, but it comes from the
kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default),
the same range every outgoing connection's local port is drawn from: with many clients
connecting (HTTP polls, ZMQ, the transfer engine), one of them can take it before the server
binds, and the server dies with "Address already in use" (seen with sglang-router's metrics
port). ``free_port`` therefore draws below that range, checks the port on every interface,
and never hands out the same port twice in one process.
"""

from __future__ import annotations

import random
import socket
import threading

_LOW = 20000
_lock = threading.Lock()
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def check_listen_port(field: str, host: str, port: int) -> None:
    """``ValueError`` naming ``field`` when a server could not listen on ``host:port`` now
    (another process holds it); bound as aiohttp binds (``SO_REUSEADDR``), so a port in
    TIME_WAIT passes. Checked before a server loads its model, not minutes later."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{field}: cannot listen on {host}:{port} ({e.strerror})") from None


def free_port(attempts: int = 200) -> int:
    """A TCP port outside the ephemeral range, bindable on every interface now, and not
    returned before by this process. Raises ``RuntimeError`` when ``attempts`` draws found
    none."""
    high = _ephemeral_low()
    low = _LOW if high > _LOW + 1000 else 1024
    with _lock:
        for _ in range(attempts):
            port = random.randrange(low, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) after {attempts} draws")
