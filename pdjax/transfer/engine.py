"""The data-plane interface: one-sided writes of local memory into a peer's registered memory.

A ``TransferEngine`` moves bytes from this process's registered memory to a peer's registered
memory (DESIGN.md §4, plane 3). Callers describe the work as copies ``(src_addr, dst_addr,
length)`` (addresses are raw uint64 pointers, lengths in bytes); ``kv_copies.build_copies``
makes them from page lists. ``batch_write`` is synchronous and cuts the work into batches of at
most ``max_batch`` copies, because Mooncake rejects more than 1024 queued transfers per peer by
default.

Backends are created by name through ``create_transfer_engine``:

    ================== =====================================================================
    ``fake``           copies nothing, counts; warm-up requests (bootstrap host 2.2.2.2)
    ``mooncake``       Mooncake Transfer Engine, P2PHANDSHAKE (no etcd), TCP or RDMA
    ``jax``            pulls over ``jax.experimental.transfer`` (``jax_transfer.py``)
    ================== =====================================================================

``register_backend`` adds one (the tests register a corrupting backend that way); the CLI's
``--disaggregation-transfer-backend`` accepts every registered name.

Pure Python; never imports JAX.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import importlib
import threading
import time
from typing import Callable, Sequence

import numpy as np

Copy = tuple[int, int, int]
"""One copy: ``(src_addr, dst_addr, length)``; addresses are uint64 pointers, length in bytes."""

DEFAULT_MAX_BATCH = 1024
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
_MAX_ADDR = (1 << 64) - 1


class TransferError(RuntimeError):
    """A write failed (peer unreachable, destination outside its registered memory, ...)."""


@dataclasses.dataclass(frozen=True)
class TransferCounters:
    """Cumulative counters of one engine (successful writes only, except ``failures``).

    ``bytes``: payload bytes written; ``copies``: copy descriptors; ``batches``: backend calls;
    ``failures``: ``batch_write`` calls that raised; ``largest_batch``: most copies in one
    backend call (never above ``max_batch``); ``seconds``: wall time inside successful
    ``batch_write`` calls.
    """

    bytes: int = 0
    copies: int = 0
    batches: int = 0
    failures: int = 0
    largest_batch: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Average throughput of successful writes, in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class MemoryRegion:
    """A registered range ``[addr, addr + length)``; ``label`` says what it holds (``kv``, ...)."""

    addr: int
    length: int
    label: str = ""

    @property
    def end(self) -> int:
        return self.addr + self.length


class TransferEngine(abc.ABC):
    """Abstract one-sided write engine; subclasses implement ``_register``, ``_unregister``,
    ``_write_batch`` and ``session_id``.

    Thread-safe: ``batch_write`` may be called from several threads (the backends release the
    GIL while they wait). With ``check_sources`` every source range must lie inside memory
    registered here (Mooncake requires it; checking locally gives a clear error instead of an
    opaque ``rc=-1``).
    """

    backend: str = ""
    # The wire protocol this engine's bytes travel by: two engines pair only when theirs are
    # equal (a registered variant of a backend, e.g. a test's corrupting Mooncake, keeps its
    # parent's); PD's bootstrap info carries it (``pd.bootstrap.check_compatible``).
    data_plane: str = ""

    def __init__(self, *, max_batch: int = DEFAULT_MAX_BATCH, check_sources: bool = True):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self.check_sources = check_sources
        self._lock = threading.Lock()
        self._starts: list[int] = []          # sorted region start addresses
        self._regions: dict[int, MemoryRegion] = {}
        self._counters = TransferCounters()
        self._closed = False

    # -- identity ------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """The id peers use to address this engine (Mooncake: ``"ip:rpc_port"``)."""

    # -- memory registration -------------------------------------------------------------------

    def register_memory(self, addr: int, length: int, label: str = "") -> None:
        """Register ``[addr, addr + length)`` (bytes) as a source and a write target.

        ``label`` tags what the region holds (``kv`` for KV buffers, ``metadata`` for
        MetadataBuffers); the test-only corrupting backend uses it. Raises ``ValueError`` for a
        bad address/length or an overlap with a registered region, ``TransferError`` if the
        backend refuses.
        """
        addr = _check_u64("addr", addr, lo=1)
        length = _check_u64("length", length, lo=1)
        if addr + length - 1 > _MAX_ADDR:
            raise ValueError(f"length: region [{addr:#x}, +{length}) wraps the address space")
        with self._lock:
            self._check_open()
            i = bisect.bisect_right(self._starts, addr)
            for j in (i - 1, i):
                if 0 <= j < len(self._starts):
                    r = self._regions[self._starts[j]]
                    if r.addr < addr + length and addr < r.end:
                        raise ValueError(f"addr: region [{addr:#x}, +{length}) overlaps registered "
                                         f"region [{r.addr:#x}, +{r.length}) ({r.label!r})")
            self._register(addr, length)
            bisect.insort(self._starts, addr)
            self._regions[addr] = MemoryRegion(addr, length, str(label))

    def unregister_memory(self, addr: int) -> None:
        """Unregister the region that starts at ``addr``; ``ValueError`` if none does."""
        with self._lock:
            if addr not in self._regions:
                raise ValueError(f"addr: {addr:#x} is not the start of a registered region")
            self._unregister(addr)
            del self._regions[addr]
            self._starts.remove(addr)

    def registered_regions(self) -> list[MemoryRegion]:
        """The registered regions, sorted by address."""
        with self._lock:
            return [self._regions[a] for a in self._starts]

    def find_region(self, addr: int, length: int = 1) -> MemoryRegion | None:
        """The registered region that contains ``[addr, addr + length)``, or ``None``."""
        with self._lock:
            return self._find_region_locked(addr, length)

    def _find_region_locked(self, addr: int, length: int) -> MemoryRegion | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        r = self._regions[self._starts[i]]
        return r if addr + length <= r.end else None

    # -- writes --------------------------------------------------------------------------------

    def batch_write(self, peer_session_id: str, copies: Sequence[Copy]) -> None:
        """Write every copy ``(src_addr, dst_addr, length)`` to ``peer_session_id``; blocking.

        Cut into backend calls of at most ``max_batch`` copies, issued one after another. On
        return all bytes have landed in the peer's memory. An empty list is a no-op. Raises
        ``ValueError`` for a malformed copy or (with ``check_sources``) a source outside
        registered memory, ``TransferError`` if the backend reports a failure (the copies of
        earlier batches may have landed).
        """
        if not isinstance(peer_session_id, str) or not peer_session_id:
            raise ValueError(f"peer_session_id: expected a non-empty str, got {peer_session_id!r}")
        srcs, dsts, lens = self._validate_copies(copies)
        if not srcs:
            return
        t0 = time.perf_counter()
        largest = 0
        try:
            for start in range(0, len(srcs), self.max_batch):
                stop = start + self.max_batch
                self._write_batch(peer_session_id, srcs[start:stop], dsts[start:stop],
                                  lens[start:stop])
                largest = max(largest, min(stop, len(srcs)) - start)
        except Exception as e:
            with self._lock:
                self._counters = dataclasses.replace(self._counters,
                                                     failures=self._counters.failures + 1)
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"{self.backend} write to {peer_session_id} failed: {e}") from e
        elapsed = time.perf_counter() - t0
        with self._lock:
            c = self._counters
            self._counters = dataclasses.replace(
                c, bytes=c.bytes + sum(lens), copies=c.copies + len(srcs),
                batches=c.batches + -(-len(srcs) // self.max_batch),
                largest_batch=max(c.largest_batch, largest), seconds=c.seconds + elapsed)

    def _validate_copies(self, copies: Sequence[Copy]) -> tuple[list[int], list[int], list[int]]:
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        with self._lock:
            self._check_open()
            for i, c in enumerate(copies):
                if not isinstance(c, (tuple, list)) or len(c) != 3:
                    raise ValueError(f"copies[{i}]: expected (src_addr, dst_addr, length)")
                src = _check_u64(f"copies[{i}].src_addr", c[0], lo=1)
                dst = _check_u64(f"copies[{i}].dst_addr", c[1], lo=1)
                n = _check_u64(f"copies[{i}].length", c[2], lo=1)
                if self.check_sources and self._find_region_locked(src, n) is None:
                    raise ValueError(f"copies[{i}].src_addr: [{src:#x}, +{n}) is not inside "
                                     f"memory registered with this engine")
                srcs.append(src)
                dsts.append(dst)
                lens.append(n)
        return srcs, dsts, lens

    def counters(self) -> TransferCounters:
        """A snapshot of the cumulative counters."""
        with self._lock:
            return self._counters

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister every region and release the backend; idempotent."""
        with self._lock:
            if self._closed:
                return
            for addr in list(self._starts):
                try:
                    self._unregister(addr)
                except TransferError:
                    pass  # closing anyway: the backend is going away with its registrations
            self._starts.clear()
            self._regions.clear()
            self._closed = True
        self._shutdown()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.backend} engine {self.session_id} is closed")

    # -- backend hooks -------------------------------------------------------------------------

    @abc.abstractmethod
    def _register(self, addr: int, length: int) -> None:
        """Backend registration; raise ``TransferError`` on refusal."""

    @abc.abstractmethod
    def _unregister(self, addr: int) -> None:
        """Backend unregistration; raise ``TransferError`` on refusal."""

    @abc.abstractmethod
    def _write_batch(self, peer_session_id: str, srcs: list[int], dsts: list[int],
                     lens: list[int]) -> None:
        """Write one batch (at most ``max_batch`` copies) synchronously; raise on failure."""

    def _shutdown(self) -> None:
        """Release backend resources after all regions are unregistered."""


def _check_u64(name: str, value, lo: int = 0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= _MAX_ADDR:
        raise ValueError(f"{name}: {value} outside [{lo}, 2**64)")
    return value


# ---------------------------------------------------------------------------------------------
# Registry.

_BACKENDS: dict[str, str | Callable[..., TransferEngine]] = {
    "fake": "pdjax.transfer.fake:FakeTransferEngine",
    "mooncake": "pdjax.transfer.mooncake:MooncakeTransferEngine",
    "jax": "pdjax.transfer.jax_transfer:JaxTransferEngine",
}


def register_backend(name: str, factory: str | Callable[..., TransferEngine]) -> None:
    """Add a backend: ``factory`` is a callable or a ``"module:attr"`` string (imported lazily)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    _BACKENDS[name] = factory


def available_backends() -> list[str]:
    """Names accepted by ``create_transfer_engine`` (whether their library imports or not)."""
    return sorted(_BACKENDS)


def create_transfer_engine(backend: str, hostname: str = "127.0.0.1", **kwargs) -> TransferEngine:
    """Create a transfer engine by backend name.

    ``hostname``: the address peers reach this engine at (ignored by ``fake``). ``kwargs`` go to
    the backend (e.g. ``max_batch``, ``protocol``, ``device_name``). Raises ``ValueError`` for
    an unknown backend, ``ImportError`` (with install instructions) when the backend's library
    is missing, ``TransferError`` when it fails to start.
    """
    factory = _BACKENDS.get(backend)
    if factory is None:
        raise ValueError(f"backend: {backend!r} not in {available_backends()}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(hostname=hostname, **kwargs)


def backend_for_bootstrap_host(bootstrap_host: str | None, default_backend: str) -> str:
    """The backend for one request: ``fake`` for the warm-up host 2.2.2.2, else the default."""
    return "fake" if bootstrap_host == FAKE_BOOTSTRAP_HOST else default_backend
