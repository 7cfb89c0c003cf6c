"""The ``mooncake`` transfer backend, over Mooncake Transfer Engine (DESIGN.md §4).

Setup that worked here: ``initialize(hostname,
"P2PHANDSHAKE", protocol, device_name)`` (never ``initialize_ext``), no etcd; the peer id is
``"hostname:rpc_port"`` with the port read back from ``get_rpc_port()`` (the port in the
hostname is ignored). The ``protocol`` argument does not pick the transport: Mooncake uses RDMA
when it finds HCAs and ``MC_FORCE_TCP`` is unset, TCP otherwise. The target refuses writes
outside its registered memory, so a bad destination fails the write instead of corrupting memory.

CPU install: ``pip install mooncake-transfer-engine-non-cuda`` and
``apt-get install -y libibverbs1`` (the wheel links libibverbs/libnl even when no NIC is used).

Pure Python; never imports JAX.
"""

from __future__ import annotations

import logging

from pdjax.transfer.engine import DEFAULT_MAX_BATCH, TransferEngine, TransferError

logger = logging.getLogger(__name__)

INSTALL_HINT = ("Mooncake is not importable. On CPU hosts: "
                "`pip install mooncake-transfer-engine-non-cuda` and "
                "`apt-get install -y libibverbs1`; on CUDA 12 hosts: "
                "`pip install mooncake-transfer-engine`.")


def _import_mooncake():
    try:
        from mooncake.engine import TransferEngine as _MooncakeEngine
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return _MooncakeEngine


class MooncakeTransferEngine(TransferEngine):
    """Mooncake Transfer Engine with P2P handshake metadata (no etcd).

    ``hostname``: the IP peers reach this engine at (``127.0.0.1`` on one machine).
    ``protocol``: ``tcp`` or ``rdma`` (see the module docstring). ``device_name``: RDMA HCAs to
    use, e.g. ``"mlx5_0,mlx5_1"``; empty for all/TCP. Raises ``ImportError`` with install
    instructions when the wheel or libibverbs is missing, ``TransferError`` when initialization
    fails.

    ``_write_batch`` uses ``batch_transfer_sync_write``, which busy-waits with the GIL released:
    call ``batch_write`` from a worker thread, not from an event loop.
    """

    backend = "mooncake"
    data_plane = "mooncake"

    def __init__(self, hostname: str = "127.0.0.1", *, protocol: str = "tcp",
                 device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                 max_batch: int = DEFAULT_MAX_BATCH, check_sources: bool = True):
        super().__init__(max_batch=max_batch, check_sources=check_sources)
        if not isinstance(hostname, str) or not hostname or hostname == "0.0.0.0":
            raise ValueError(f"hostname: expected a reachable IP or name, got {hostname!r}")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol: {protocol!r} not in ('tcp', 'rdma')")
        if metadata_server != "P2PHANDSHAKE":
            # Anything else is treated as an etcd address and stalls ~5 s when none runs.
            raise ValueError(f"metadata_server: only 'P2PHANDSHAKE' is supported, "
                             f"got {metadata_server!r}")
        engine_cls = _import_mooncake()
        self._engine = engine_cls()
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(f"mooncake initialize({hostname!r}, {protocol!r}) returned {rc}")
        self._session_id = f"{hostname}:{self._engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session_id

    def _register(self, addr: int, length: int) -> None:
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise TransferError(f"mooncake register_memory({addr:#x}, {length}) returned {rc}")

    def _unregister(self, addr: int) -> None:
        rc = self._engine.unregister_memory(addr)
        if rc != 0:
            raise TransferError(f"mooncake unregister_memory({addr:#x}) returned {rc}")

    def _write_batch(self, peer_session_id, srcs, dsts, lens) -> None:
        rc = self._engine.batch_transfer_sync_write(peer_session_id, srcs, dsts, lens)
        if rc != 0:
            raise TransferError(
                f"mooncake write to {peer_session_id} failed (rc={rc}; {len(srcs)} copies, "
                f"{sum(lens)} bytes): peer down, or destination outside its registered memory")

    def _shutdown(self) -> None:
        self._engine = None  # the binding has no explicit close; dropping it stops the engine
