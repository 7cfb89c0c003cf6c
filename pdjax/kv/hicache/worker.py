"""The host tier's ``KVTransferWorker`` and its connection (DESIGN.md §3, "Host tier").

The engine thread calls ``start(meta)`` after a step and ``poll()`` before the next one; the
host-side copies run on the worker's copy thread, so the engine thread spends on a write one
gather dispatch and an asynchronous device->host copy, on a load one scatter dispatch. Each
device copy is one jitted gather or scatter of a page bucket (``transfer.local_kv.
page_buckets``, compiled in ``warmup``: nothing compiles on the request path):

    write  start: device pages --gather_pages--> device arrays --copy_to_host_async-->
           copy thread: np.asarray (waits for the copy) -> host slots
           poll: ``HostIndex.commit`` (the pages become readable)
    load   copy thread: host slots -> padded [layers, bucket, ...] numpy parts
           poll: the request still waits for it? -> scatter_pages (donated; ordered before
           every later forward by the cache it donates) and ``finished_recving`` now; it was
           aborted meanwhile (its pages may be another request's now) -> dropped, unpinned

``build_host_tier(host)`` makes the connector, this worker and ``HiCacheRole`` (the
``/get_load`` counters), sized from ``--hicache-size`` or ``--hicache-ratio``, with the storage
tier of ``--hicache-storage-backend`` (``storage_tier``; L3) when one is set: the copy thread
hands it every write's pages once they are in host slots, and ``poll`` puts the pages it
prefetched into host slots.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from pdjax.engine_roles import NullRole
from pdjax.kv.hicache.connector import HiCacheConnector, HiCacheMeta, HiCacheStats, LoadJob, \
    WriteJob
from pdjax.kv.hicache.host_pool import HostIndex, HostKVPool, page_bytes
from pdjax.kv.hicache.metrics import HiCacheMetrics
from pdjax.kv.hicache.storage import PageCodec, kv_fingerprint, make_storage_backend, \
    parse_storage_config
from pdjax.kv.hicache.storage_tier import StorageTier
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.transfer.local_kv import page_buckets
from pdjax.transfer.worker import KVTransferWorker

logger = logging.getLogger(__name__)

GIB = 1 << 30
COPY_MAX_BYTES = 64 << 20       # most bytes one gather or scatter moves


@dataclasses.dataclass
class _LoadRead:
    """The copy thread read ``job``'s slots: ``chunks`` of (padded page ids, padded parts)."""

    job: LoadJob
    chunks: list[tuple[np.ndarray, list[np.ndarray]]]


@dataclasses.dataclass
class _Written:
    """The copy thread stored ``jobs``' pages in their slots."""

    jobs: list[WriteJob]


@dataclasses.dataclass
class _Failed:
    """A copy raised ``error``: ``poll`` unpins the load's slots or cancels the writes'
    pending pages, then raises it on the engine thread (the step fails)."""

    error: BaseException
    load: LoadJob | None = None
    writes: list[WriteJob] = dataclasses.field(default_factory=list)


def _copy_loop(tasks: queue.SimpleQueue, results: queue.SimpleQueue,
               wake: list[Callable[[], None]]) -> None:
    """The copy thread: run each task, post its result (or ``_Failed``), wake the engine;
    None ends it."""
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            result = task()
        except BaseException as e:       # handed to the engine thread
            result = _Failed(e)
        del task                         # its closure may hold the worker
        results.put(result)
        try:
            wake[0]()
        except Exception:                # the engine polls every step anyway
            logger.exception("host KV tier: waking the engine failed")


class HiCacheWorker(KVTransferWorker):
    """Moves pages between ``runner``'s KV cache and ``pool`` (see the module docstring).

    ``is_waiting(req)``: whether ``req`` still waits for its load (the connector's).
    ``max_pages``: most pages one device copy carries; larger plans are cut into copies of the
    largest bucket."""

    def __init__(self, runner, pool: HostKVPool, index: HostIndex, stats: HiCacheStats,
                 max_pages: int, is_waiting: Callable[[Any], bool],
                 storage: StorageTier | None = None,
                 prefetch_done: Callable[[str], None] = lambda rid: None):
        self.runner = runner
        self.storage = storage
        self.prefetch_done = prefetch_done
        self.pool = pool
        self.index = index
        self.stats = stats
        self.is_waiting = is_waiting
        self.buckets = page_buckets(max(1, max_pages))
        self.metrics: HiCacheMetrics | None = None     # set by HiCacheRole.attach_metrics
        self._recving: set[str] = set()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0           # tasks queued whose results are not handled yet
        self._wake: list[Callable[[], None]] = [lambda: None]
        # The thread holds the queues, not the worker: an engine dropped without close()
        # (the offline Engine's shutdown) frees the host pool, and the thread ends.
        self._thread = threading.Thread(target=_copy_loop, name="pdjax-hicache-copy",
                                        args=(self._tasks, self._results, self._wake),
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._tasks.put, None)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called when a copy finished (the engine should poll)."""
        self._wake[0] = wake
        if self.storage is not None:
            self.storage.wake[0] = wake

    # ---- page buckets ------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = self.buckets[-1]
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    def _padded(self, pages: Sequence[int]) -> np.ndarray:
        idx = np.zeros(self._bucket(len(pages)), np.int32)   # padding: the null page 0
        idx[:len(pages)] = pages
        return idx

    def _gather(self, idx: np.ndarray) -> list:
        out = self.runner.jits.gather_pages(self.runner.caches, idx)
        return [out[s.name] for s in self.runner.cache_specs]

    def warmup(self) -> None:
        """Compile the gather and the scatter of every page bucket (they move the null page
        only)."""
        for b in self.buckets:
            idx = np.zeros(b, np.int32)
            self.runner.scatter_pages(idx, [np.asarray(p) for p in self._gather(idx)])

    # ---- the copy thread's tasks -------------------------------------------------------------
    def _submit(self, task: Callable[[], Any]) -> None:
        self._in_flight += 1
        t0 = time.perf_counter()
        self._tasks.put(lambda: (t0, task()))

    def _read_load(self, job: LoadJob) -> _LoadRead | _Failed:
        try:
            return self._read_load_parts(job)
        except Exception as e:
            return _Failed(e, load=job)

    def _read_load_parts(self, job: LoadJob) -> _LoadRead:
        parts = self.pool.read(job.slots)
        chunks = []
        for lo, hi in self._chunks(len(job.pages)):
            idx = self._padded(job.pages[lo:hi])
            padded = []
            for p in parts:
                buf = np.zeros((p.shape[0], len(idx), *p.shape[2:]), p.dtype)
                buf[:, :hi - lo] = p[:, lo:hi]
                padded.append(buf)
            chunks.append((idx, padded))
        return _LoadRead(job, chunks)

    def _store(self, chunks: list[tuple[list, list[int], list[bytes]]],
               jobs: list[WriteJob]) -> _Written | _Failed:
        try:
            for arrays, slots, keys in chunks:
                parts = [np.asarray(a) for a in arrays]
                self.pool.write(slots, parts)
                if self.storage is not None:      # write-through to L3, on its own thread
                    self.storage.submit_write(keys, parts)
        except Exception as e:
            return _Failed(e, writes=jobs)
        return _Written(jobs)

    # ---- the engine's calls ------------------------------------------------------------------
    def start(self, meta: HiCacheMeta) -> None:
        for job in meta.loads:
            self._submit(lambda job=job: self._read_load(job))
        if meta.writes:
            pages = [p for w in meta.writes for p in w.pages]
            slots = [s for w in meta.writes for s in w.slots]
            keys = [w.path[i] for w in meta.writes for i in w.new]
            chunks = []
            for lo, hi in self._chunks(len(pages)):
                arrays = self._gather(self._padded(pages[lo:hi]))
                for a in arrays:
                    a.copy_to_host_async()
                chunks.append((arrays, slots[lo:hi], keys[lo:hi]))
            jobs = list(meta.writes)
            self._submit(lambda: self._store(chunks, jobs))

    def _handle(self, timed) -> None:
        self._in_flight -= 1
        if isinstance(timed, _Failed):           # the task itself raised (not expected)
            raise RuntimeError(f"host KV tier copy failed: {timed.error!r}") from timed.error
        t0, result = timed
        seconds = time.perf_counter() - t0
        if isinstance(result, _Failed):
            if result.load is not None:
                self.index.unpin(result.load.slots)
            for job in result.writes:
                self.index.cancel([job.path[i] for i in job.new])
            raise RuntimeError(f"host KV tier copy failed: {result.error!r}") from result.error
        if isinstance(result, _Written):
            for job in result.jobs:
                self.index.commit(job.path)
                self.stats.written_pages += len(job.new)
            if self.metrics is not None:
                self.metrics.on_write(sum(len(j.new) for j in result.jobs), seconds)
            return
        job = result.job
        self.index.unpin(job.slots)
        if not self.is_waiting(job.req):         # aborted while its slots were read
            self.stats.load_jobs_dropped += 1
            return
        for idx, parts in result.chunks:
            self.runner.scatter_pages(idx, parts)
        self._recving.add(job.req.rid)
        self.stats.loaded_pages += len(job.pages)
        if self.metrics is not None:
            self.metrics.on_load(len(job.pages), seconds)

    def _handle_ready(self) -> None:
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return
            self._handle(result)

    def _put_prefetched(self) -> None:
        """Put the pages the storage tier read into host slots (engine thread): the pages
        the host does not know get slots (their path touched first, so the prefix's own
        host pages are not the ones evicted) and are committed at once."""
        for got in self.storage.take_results():
            try:
                if got.num_pages:
                    self.index.touch(got.path)
                    new = [i for i in range(got.num_pages)
                           if not self.index.is_known(got.path[got.start + i])]
                    slots = self.index.reserve([got.path[got.start + i] for i in new])
                    if slots:
                        cols = np.asarray(new[:len(slots)], np.int64)
                        self.pool.write(slots, [p[:, cols] for p in got.parts])
                        # Only these pages: another page of the path may be a pending write.
                        self.index.commit([got.path[got.start + i] for i in new[:len(slots)]])
                        self.index.touch(got.path)
                        self.stats.storage_hit_pages += len(slots)
                        if self.metrics is not None:
                            self.metrics.on_storage_read(len(slots))
            finally:
                self.prefetch_done(got.rid)

    def poll(self) -> KVConnectorOutput:
        self._handle_ready()
        if self.storage is not None:
            self._put_prefetched()
        done, self._recving = KVConnectorOutput(finished_recving=self._recving), set()
        return done

    def has_work(self) -> bool:
        return bool(self._recving) or not self._results.empty() or (
            self.storage is not None and not self.storage.results.empty())

    @property
    def num_in_flight(self) -> int:
        """Copies started whose results the engine thread has not handled yet."""
        return self._in_flight

    def flush(self) -> None:
        """Wait for every copy in flight and handle it (a load's request is then reported
        at the next ``poll``): admission waiting for a page on its way to the host, tests."""
        while self._in_flight:
            try:
                result = self._results.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("host KV tier: the copy thread is gone") from None
                continue
            self._handle(result)

    def close(self) -> None:
        """Stop the copy thread once the copies queued before have run; commit the writes
        they stored."""
        self._tasks.put(None)
        self._thread.join(timeout=10)
        try:
            self._handle_ready()
        except RuntimeError:
            pass
        if self.storage is not None:       # its queued writes are stored first
            self.storage.close()


class HiCacheRole(NullRole):
    """The colocated role with the host tier's ``/get_load`` fields."""

    def __init__(self, worker: HiCacheWorker, page_size: int):
        self.worker, self.index, self.pool = worker, worker.index, worker.pool
        self.stats, self.page_size = worker.stats, page_size

    def set_wake(self, wake: Callable[[], None]) -> None:
        self.worker.set_wake(wake)

    def attach_metrics(self, metrics: Any) -> None:
        """Register the host tier's metrics (``pdjax.kv.hicache.metrics``) on the server's."""
        storage = self.worker.storage
        self.worker.metrics = HiCacheMetrics(metrics, self.page_size, self.pool.bytes_per_page,
                                             lambda: self.index.num_used, self.index.num_slots,
                                             storage=storage is not None)
        if storage is not None:
            storage.metrics = self.worker.metrics

    def load(self) -> dict[str, Any]:
        s, bpp = self.stats, self.pool.bytes_per_page
        return {"hicache_host_pages_used": self.index.num_used,
                "hicache_host_pages_total": self.index.num_slots,
                "hicache_host_pages_pinned": self.index.num_pinned,
                "hicache_bytes_per_page": bpp,
                "hicache_hit_tokens": s.loaded_pages * self.page_size,
                "hicache_loaded_bytes": s.loaded_pages * bpp,
                "hicache_written_bytes": s.written_pages * bpp,
                "hicache_evicted_pages": self.index.num_evicted,
                **self._storage_load()}

    def _storage_load(self) -> dict[str, Any]:
        storage = self.worker.storage
        if storage is None:
            return {}
        st, bpp = storage.stats, self.pool.bytes_per_page
        return {"hicache_storage_hit_tokens": self.stats.storage_hit_pages * self.page_size,
                "hicache_storage_read_bytes": self.stats.storage_hit_pages * bpp,
                "hicache_storage_written_pages": st.written_pages,
                "hicache_storage_written_bytes": st.written_pages * bpp,
                "hicache_storage_corrupt_pages": st.corrupt_pages,
                "hicache_storage_errors": st.errors,
                "hicache_storage_writes_dropped": st.writes_dropped,
                "hicache_storage_read_seconds": round(st.read_seconds, 6),
                "hicache_storage_write_seconds": round(st.write_seconds, 6)}


def copy_pages_limit(bytes_per_page: int) -> int:
    """The most pages one copy moves: the largest power of two (a page bucket) whose pages
    fit ``COPY_MAX_BYTES``, at least 1."""
    fit = max(1, COPY_MAX_BYTES // bytes_per_page)
    return 1 << (fit.bit_length() - 1)


def host_pool_slots(args, device_pages: int, bytes_per_page: int) -> int:
    """Host pages of ``--hicache-size`` GiB (when > 0) or ``--hicache-ratio`` times the
    device pool's ``device_pages``. ``ValueError`` naming the setting when that is no page,
    or more than the machine's physical memory."""
    if args.hicache_size > 0:
        name, slots = "hicache_size", args.hicache_size * GIB // bytes_per_page
    else:
        name, slots = "hicache_ratio", int(args.hicache_ratio * device_pages)
    if slots < 1:
        raise ValueError(f"{name}: the host KV pool holds no page of {bytes_per_page} bytes")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    if ram and slots * bytes_per_page > ram:
        raise ValueError(f"{name}: a host KV pool of {slots} pages x {bytes_per_page} bytes "
                         f"({slots * bytes_per_page / GIB:.1f} GiB) is more than this "
                         f"machine's {ram / GIB:.1f} GiB of memory")
    return slots


def build_host_tier(host) -> tuple[HiCacheConnector, HiCacheWorker, HiCacheRole]:
    """The host tier of engine ``host`` (a ``RoleHost``): its connector, its worker (warmed
    up: every page bucket's gather and scatter compiled) and its role. ``ValueError`` from
    ``host_pool_slots``."""
    runner, args = host.runner, host.args
    shapes = [(tuple(s.shape), np.dtype(s.dtype)) for s in runner.cache_specs]
    bpp = page_bytes(shapes)
    device_pages = host.kv.num_pages - 1
    slots = host_pool_slots(args, device_pages, bpp)
    pool = HostKVPool(shapes, slots)
    index = HostIndex(slots)
    ps = args.page_size
    connector = HiCacheConnector(host.kv, index, ps, args.hicache_write_policy)
    # A copy's device buffer stays small whatever the context: at most a request's pages
    # and COPY_MAX_BYTES (larger plans are cut into several copies).
    max_pages = min(-(-host.context_length // ps), copy_pages_limit(bpp))
    storage = build_storage_tier(host, shapes)
    connector.storage = storage
    worker = HiCacheWorker(runner, pool, index, connector.stats, max_pages,
                           connector.is_waiting, storage, connector.prefetch_done)
    worker.warmup()
    connector.wait_for_writes = worker.flush
    if args.hicache_write_policy == "write_back":
        connector.write_now = worker.start
        host.kv.prefix_cache.on_evict = connector.on_device_evict
    logger.info("HiCache host tier: %d pages (%.2f GiB) behind %d device pages",
                slots, slots * bpp / GIB, device_pages)
    return connector, worker, HiCacheRole(worker, ps)


def build_storage_tier(host, shapes) -> StorageTier | None:
    """The storage tier (L3) of ``--hicache-storage-backend`` (None without one): its
    backend and its records' codec, fingerprinted by the model id (the extra config's
    ``"model_id"``, default the checkpoint folder's name), the page size and the KV buffers.
    ``ValueError`` naming the setting when the backend cannot start."""
    args = host.args
    backend_name = getattr(args, "hicache_storage_backend", None)
    if backend_name is None:
        return None
    cfg = parse_storage_config(backend_name, args.hicache_storage_backend_extra_config)
    model_id = cfg.get("model_id") or os.path.basename(os.path.normpath(host.model_path))
    fp = kv_fingerprint(model_id, args.page_size,
                        [(s.name, tuple(s.shape), s.dtype) for s in host.runner.cache_specs])
    try:
        backend = make_storage_backend(backend_name, cfg)
    except (OSError, RuntimeError, ImportError) as e:
        raise ValueError(f"hicache_storage_backend: {backend_name!r} could not start: "
                         f"{e}") from e
    codec = PageCodec(shapes, fp)
    logger.info("HiCache storage tier: %s backend, records of %d bytes, KV format %s",
                backend_name, codec.record_bytes, fp.hex())
    return StorageTier(backend, codec)
