"""HiCache's ``mooncake`` storage backend: the Mooncake store (``mooncake.store.
MooncakeDistributedStore`` of the ``mooncake-transfer-engine`` package; SGLang's
``MooncakeStore`` HiCache backend; DESIGN.md §3, "Storage tier").

A Mooncake store is a ``mooncake_master`` (object metadata, allocation, eviction) and its
clients: each client lends ``global_segment_size`` bytes of its memory to the store and moves
objects over its transfer engine (TCP here, RDMA where there is one). Every server sharing the
master sees every object, so a fleet of prefill servers shares one cache. Objects live in the
segments of the clients alive: a server that stops takes the objects in its segment with it.

Config (``--hicache-storage-backend-extra-config``): ``master_server_address`` (host:port of
the master's RPC), ``metadata_server`` (default ``http://<master host>:8080/metadata``, the
master's own HTTP metadata server, ``mooncake_master --enable_http_metadata_server``),
``local_hostname`` (default: this host's address towards the master), ``global_segment_size``
(default 256 MiB), ``local_buffer_size`` (default 64 MiB), ``protocol`` (default ``tcp``).
Keys are ``pdjax-<page hash hex>``. The client's calls return negative error codes; they
become ``RuntimeError`` (the storage tier logs them and recomputes).
"""

from __future__ import annotations

import socket
from typing import Any

DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_BUFFER_BYTES = 64 << 20


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MooncakeStorage:
    """A client of the Mooncake store at ``cfg["master_server_address"]``. ``RuntimeError``
    when the package is missing, nothing listens at the master's address (checked first: a
    TCP connect, 5 s at most) or the client cannot set up."""

    def __init__(self, cfg: dict[str, Any]):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(f"the mooncake-transfer-engine package is not installed "
                               f"({e})") from e
        master = cfg["master_server_address"]
        host, _, port = master.rpartition(":")
        try:                   # the client's own setup retries for 90 s before it fails
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise RuntimeError(f"no Mooncake master answers at {master} ({e})") from e
        setup = {"local_hostname": cfg.get("local_hostname") or _address_towards(host),
                 "metadata_server": cfg.get("metadata_server") or f"http://{host}:8080/metadata",
                 "global_segment_size": int(cfg.get("global_segment_size", DEFAULT_SEGMENT_BYTES)),
                 "local_buffer_size": int(cfg.get("local_buffer_size", DEFAULT_BUFFER_BYTES)),
                 "protocol": cfg.get("protocol", "tcp"),
                 "master_server_addr": master}
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(setup)
        if rc != 0:
            raise RuntimeError(f"Mooncake store client setup failed (code {rc}) with master "
                               f"{master} and metadata server {setup['metadata_server']}")

    @staticmethod
    def _key(key: bytes) -> str:
        return "pdjax-" + key.hex()

    def exists(self, key: bytes) -> bool:
        rc = self.store.is_exist(self._key(key))
        if rc < 0:
            raise RuntimeError(f"Mooncake is_exist failed (code {rc})")
        return rc == 1

    def get(self, key: bytes) -> bytes | None:
        data = self.store.get(self._key(key))
        return bytes(data) if data else None     # b"": not stored (or not readable)

    def set(self, key: bytes, record: bytes) -> None:
        rc = self.store.put(self._key(key), record)
        if rc != 0:
            raise RuntimeError(f"Mooncake put failed (code {rc})")

    def delete(self, key: bytes) -> None:
        self.store.remove(self._key(key))       # best effort: a leased object stays

    def close(self) -> None:
        self.store.close()
