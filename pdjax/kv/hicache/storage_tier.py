"""HiCache's storage tier (L3) behind the host tier: its thread, its writes and prefetches
(DESIGN.md §3, "Storage tier"; SGLang's HiCache storage write-through and prefetch).

    write     the host tier's copy thread stored pages in host slots -> ``submit_write``
              (the pages' bytes, copied) -> storage thread: skip keys stored already, encode
              (``PageCodec``: header, checksum), ``backend.set``. Never on the request path;
              past ``max_pending_write_bytes`` of queued pages (256 MiB: four of the host
              tier's largest copies) new writes are dropped (counted).
    prefetch  admission found the next page past the host hit in the store (``exists``, one
              cheap call on the engine thread) -> ``submit_prefetch`` -> storage thread reads
              the pages from there on until the first miss or bad record (a bad one is
              logged, counted, deleted: it is recomputed and written again), stacks them
              ``[layers, n, ...]`` per buffer -> ``Prefetched`` in ``results`` -> the engine
              thread (``HiCacheWorker.poll``) puts them in host slots; the request, asked
              again, finds them on the host and loads them like any host hit.

Backend keys are the page hash behind 4 bytes of the KV format's fingerprint (servers of other
models sharing the store use other keys); the record's header still names the whole
fingerprint and the page hash, so a record under a wrong key is refused.

Backend errors (a removed folder, a master gone) are logged (at most one warning a minute
per kind) and counted: a read error is a miss, a write error a page not stored; nothing
reaches a request. After an error the store is left alone for ``RETRY_AFTER_S`` (lookups
answer "not stored", writes are dropped): a backend whose calls time out (a Mooncake client
whose master is gone waits seconds per call) does not slow admission down.

Pure Python and numpy; the thread holds the queues, not the tier.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np

from pdjax.kv.hicache.storage import PageCodec, StorageBackend, StoredPageError

logger = logging.getLogger(__name__)

WARN_EVERY_S = 60.0
RETRY_AFTER_S = 10.0
_PREFETCH, _WRITE = 0, 1            # queue priorities: a waiting request's read goes first


@dataclasses.dataclass
class StorageStats:
    """The storage tier's counters (``/get_load``, ``/metrics``)."""

    read_pages: int = 0           # pages prefetched from the store (each a host-tier page)
    written_pages: int = 0
    corrupt_pages: int = 0        # records refused by ``PageCodec.decode``
    errors: int = 0               # backend errors (reads and writes)
    writes_dropped: int = 0       # pages not queued: too many writes pending
    read_seconds: float = 0.0
    write_seconds: float = 0.0


@dataclasses.dataclass
class Prefetched:
    """Pages ``path[start:start + n]`` read from the store for request ``rid``: ``parts``
    per buffer ``[layers, n, ...]`` (n may be 0: nothing usable)."""

    rid: str
    path: list[bytes]
    start: int
    parts: list[np.ndarray]
    num_pages: int


class _Warner:
    """Logs a warning per ``kind`` at most every ``WARN_EVERY_S`` seconds."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._last[kind] = now
        logger.warning("HiCache storage tier: " + msg, *args)


def _run(tasks: queue.PriorityQueue) -> None:
    """The storage thread: run tasks in priority order; None ends it."""
    while True:
        _, _, task = tasks.get()
        if task is None:
            return
        task()
        del task


class StorageTier:
    """``backend`` behind the host tier, records made by ``codec`` (see the module docstring).
    ``wake()`` is called when a prefetch finished (the engine should poll)."""

    def __init__(self, backend: StorageBackend, codec: PageCodec,
                 max_pending_write_bytes: int = 256 << 20):
        self.backend, self.codec = backend, codec
        # Backend keys: the first 4 bytes of the KV format's fingerprint, then the page hash,
        # so servers of different models (or KV formats) sharing a store keep apart.
        self._ns = codec.fingerprint[:4]
        self.stats = StorageStats()
        self.metrics = None           # HiCacheMetrics (HiCacheRole.attach_metrics)
        self.max_pending_write_pages = max(1, max_pending_write_bytes // codec.payload_bytes)
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.wake: list[Callable[[], None]] = [lambda: None]
        self._warn = _Warner()
        self._seq = itertools.count()
        self._tasks: queue.PriorityQueue = queue.PriorityQueue()
        self._lock = threading.Lock()
        self._pending_write_pages = 0
        self._prefetches = 0          # submitted, result not yet taken by the engine thread
        self._down_until = 0.0        # monotonic time before which the backend is not called
        self._thread = threading.Thread(target=_run, args=(self._tasks,), daemon=True,
                                        name="pdjax-hicache-storage")
        self._thread.start()
        weakref.finalize(self, self._tasks.put, (2, -1, None))

    # ---- the engine thread -------------------------------------------------------------------
    def exists(self, key: bytes) -> bool:
        """Whether the store holds ``key`` (False on a backend error, logged)."""
        if self.is_down:
            return False
        try:
            return bool(self.backend.exists(self._ns + key))
        except Exception as e:        # a storage fault is a miss
            self._error("exists", "lookup failed (%r); recomputing", e)
            return False

    @property
    def is_down(self) -> bool:
        """Whether a backend error came less than ``RETRY_AFTER_S`` ago."""
        return time.monotonic() < self._down_until

    def submit_prefetch(self, rid: str, path: Sequence[bytes], start: int) -> None:
        """Read pages ``path[start:]`` for ``rid`` in the background (see the module
        docstring); the result arrives in ``results``."""
        self._prefetches += 1
        path = list(path)
        self._tasks.put((_PREFETCH, next(self._seq),
                         lambda: self._prefetch(rid, path, start)))

    def take_results(self) -> list[Prefetched]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                self._prefetches -= len(out)
                return out

    @property
    def num_prefetching(self) -> int:
        return self._prefetches

    # ---- the host tier's copy thread ----------------------------------------------------------
    def submit_write(self, keys: Sequence[bytes], parts: Sequence[np.ndarray]) -> None:
        """Store pages ``keys[i]`` = ``parts[k][:, i]`` per buffer (the host slots' bytes,
        copied here); dropped, counted, past ``max_pending_write_pages`` pending (the bytes
        limit over a page's)."""
        n = len(keys)
        if self.is_down:
            self.stats.writes_dropped += n
            self._fault("dropped", n)
            return
        with self._lock:
            if self._pending_write_pages + n > self.max_pending_write_pages:
                self.stats.writes_dropped += n
                self._fault("dropped", n)
                self._warn("backlog", "%d page writes pending; dropping new ones",
                           self._pending_write_pages)
                return
            self._pending_write_pages += n
        pages = [[np.array(p[:, i]) for p in parts] for i in range(n)]
        keys = list(keys)
        self._tasks.put((_WRITE, next(self._seq), lambda: self._write(keys, pages)))

    # ---- the storage thread ----------------------------------------------------------------
    def _write(self, keys: list[bytes], pages: list[list[np.ndarray]]) -> None:
        t0 = time.perf_counter()
        written = 0
        try:
            for key, page in zip(keys, pages):
                try:
                    if self.backend.exists(self._ns + key):
                        continue
                    self.backend.set(self._ns + key, self.codec.encode(key, page))
                    written += 1
                except Exception as e:
                    self._error("write", "write failed (%r); the page is not stored", e)
                    break                 # the rest would wait for the same fault
        finally:
            with self._lock:
                self._pending_write_pages -= len(keys)
            seconds = time.perf_counter() - t0
            self.stats.written_pages += written
            self.stats.write_seconds += seconds
            if self.metrics is not None:
                self.metrics.on_storage_write(written, seconds)

    def _prefetch(self, rid: str, path: list[bytes], start: int) -> None:
        t0 = time.perf_counter()
        pages: list[list[np.ndarray]] = []
        try:
            for key in path[start:]:
                try:
                    record = self.backend.get(self._ns + key)
                except Exception as e:
                    self._error("read", "read failed (%r); recomputing", e)
                    break
                if record is None:
                    break
                try:
                    pages.append(self.codec.decode(key, record))
                except StoredPageError as e:
                    self.stats.corrupt_pages += 1
                    self._fault("corrupt")
                    self._warn("corrupt", "page %s refused (%s); recomputing it", key.hex(), e)
                    try:
                        self.backend.delete(self._ns + key)
                    except Exception:
                        pass
                    break
            parts = ([np.stack([pg[k] for pg in pages], axis=1)
                      for k in range(len(self.codec.page_shapes))] if pages else [])
        except Exception as e:          # not expected: the request recomputes
            self._error("prefetch", "prefetch failed (%r); recomputing", e)
            pages, parts = [], []
        seconds = time.perf_counter() - t0
        self.stats.read_seconds += seconds
        self.stats.read_pages += len(pages)
        if self.metrics is not None:
            self.metrics.on_storage_prefetch(seconds)
        self.results.put(Prefetched(rid, path[:start + len(pages)], start, parts, len(pages)))
        try:
            self.wake[0]()
        except Exception:
            logger.exception("HiCache storage tier: waking the engine failed")

    def _error(self, kind: str, msg: str, e: BaseException) -> None:
        """A backend error: counted, logged, the backend left alone for a while."""
        self.stats.errors += 1
        self._down_until = time.monotonic() + RETRY_AFTER_S
        self._fault("error")
        self._warn(kind, msg, e)

    def _fault(self, kind: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.on_storage_fault(kind, n)

    # ---- both --------------------------------------------------------------------------------
    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every task queued so far has run (tests, shutdown)."""
        done = threading.Event()
        self._tasks.put((3, next(self._seq), done.set))
        if not done.wait(timeout):
            raise TimeoutError("HiCache storage tier: tasks still running")

    def close(self) -> None:
        """Run the tasks queued so far, stop the thread, close the backend."""
        self._tasks.put((4, next(self._seq), None))
        self._thread.join(timeout=30)
        try:
            self.backend.close()
        except Exception:
            logger.exception("HiCache storage tier: closing the backend failed")
