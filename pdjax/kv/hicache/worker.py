"""The host tier's ``KVTransferWorker`` and its connection (DESIGN.md §3, "Host tier").

The engine thread calls ``start(meta)`` after a step and ``poll()`` before the next one; each
copy is one jitted gather or scatter of a page bucket (``transfer.local_kv.page_buckets``,
compiled in ``warmup``: nothing compiles on the request path):

    load   host slots --numpy copy--> [layers, bucket, ...] --scatter_pages (donated)--> device
           pages; dispatched at ``start`` and ordered before every later forward by the cache
           it donates, so the request is reported in ``finished_recving`` at the next ``poll``
    write  device pages --gather_pages--> device arrays --copy_to_host_async--> (the step goes
           on) ... ``poll`` finds them ready -> host slots -> ``HostIndex.commit``

``start`` never waits for the device: a write costs the engine one gather dispatch and an
asynchronous device->host copy; a load one host copy, a host->device transfer and a scatter
dispatch. ``build_host_tier(host)`` makes the connector, this worker and ``HiCacheRole`` (the
``/get_load`` counters), sized from ``--hicache-size`` or ``--hicache-ratio``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np

from pdjax.engine_roles import NullRole
from pdjax.kv.hicache.connector import HiCacheConnector, HiCacheMeta, HiCacheStats, WriteJob
from pdjax.kv.hicache.host_pool import HostIndex, HostKVPool, page_bytes
from pdjax.sched.kv_connector import KVConnectorOutput
from pdjax.transfer.local_kv import page_buckets
from pdjax.transfer.worker import KVTransferWorker

logger = logging.getLogger(__name__)

GIB = 1 << 30


class HiCacheWorker(KVTransferWorker):
    """Moves pages between ``runner``'s KV cache and ``pool`` (see the module docstring).

    ``max_pages``: most pages one copy carries; larger plans are cut into copies of the
    largest bucket."""

    def __init__(self, runner, pool: HostKVPool, index: HostIndex, stats: HiCacheStats,
                 max_pages: int):
        self.runner = runner
        self.pool = pool
        self.index = index
        self.stats = stats
        self.buckets = page_buckets(max(1, max_pages))
        self._recving: set[str] = set()
        # (chunks [(device arrays, slots)], write jobs) per start, oldest first
        self._writes: list[tuple[list[tuple[list, list[int]]], list[WriteJob]]] = []

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _chunks(self, n: int):
        step = self.buckets[-1]
        return [(i, min(n, i + step)) for i in range(0, n, step)]

    def _padded(self, pages: Sequence[int]) -> np.ndarray:
        idx = np.zeros(self._bucket(len(pages)), np.int32)   # padding: the null page 0
        idx[:len(pages)] = pages
        return idx

    def warmup(self) -> None:
        """Compile the gather and the scatter of every page bucket (they move the null page
        only)."""
        for b in self.buckets:
            idx = np.zeros(b, np.int32)
            parts = self._gather(idx)
            self.runner.scatter_pages(idx, [np.asarray(p) for p in parts])

    def _gather(self, idx: np.ndarray) -> list:
        out = self.runner.jits.gather_pages(self.runner.caches, idx)
        return [out[s.name] for s in self.runner.cache_specs]

    # ---- the engine's calls ----------------------------------------------------------------
    def start(self, meta: HiCacheMeta) -> None:
        for job in meta.loads:
            parts = self.pool.read(job.slots)
            self.index.unpin(job.slots)
            for lo, hi in self._chunks(len(job.pages)):
                idx = self._padded(job.pages[lo:hi])
                padded = []
                for p in parts:
                    buf = np.zeros((p.shape[0], len(idx), *p.shape[2:]), p.dtype)
                    buf[:, :hi - lo] = p[:, lo:hi]
                    padded.append(buf)
                self.runner.scatter_pages(idx, padded)
            self._recving.add(job.req.rid)
            self.stats.loaded_pages += len(job.pages)
        if meta.writes:
            pages = [p for w in meta.writes for p in w.pages]
            slots = [s for w in meta.writes for s in w.slots]
            chunks = []
            for lo, hi in self._chunks(len(pages)):
                arrays = self._gather(self._padded(pages[lo:hi]))
                for a in arrays:
                    a.copy_to_host_async()
                chunks.append((arrays, slots[lo:hi]))
            self._writes.append((chunks, meta.writes))

    def poll(self) -> KVConnectorOutput:
        while self._writes and all(a.is_ready() for arrays, _ in self._writes[0][0]
                                   for a in arrays):
            chunks, jobs = self._writes.pop(0)
            for arrays, slots in chunks:
                self.pool.write(slots, [np.asarray(a) for a in arrays])
            for job in jobs:
                self.index.commit(job.path)
                self.stats.written_pages += len(job.new)
        done, self._recving = KVConnectorOutput(finished_recving=self._recving), set()
        return done

    def has_work(self) -> bool:
        return bool(self._recving or self._writes)

    def flush(self) -> None:
        """Wait for every write in flight and commit it (shutdown, tests of the index)."""
        for chunks, _ in self._writes:
            for arrays, _ in chunks:
                for a in arrays:
                    a.block_until_ready()
        recving, self._recving = self._recving, set()
        self.poll()
        self._recving = recving

    def close(self) -> None:
        for _, jobs in self._writes:
            for job in jobs:
                self.index.cancel([job.path[i] for i in job.new])
        self._writes = []


class HiCacheRole(NullRole):
    """The colocated role with the host tier's ``/get_load`` fields."""

    def __init__(self, index: HostIndex, pool: HostKVPool, stats: HiCacheStats,
                 page_size: int):
        self.index, self.pool, self.stats, self.page_size = index, pool, stats, page_size

    def load(self) -> dict[str, Any]:
        s, bpp = self.stats, self.pool.bytes_per_page
        return {"hicache_host_pages_used": self.index.num_used,
                "hicache_host_pages_total": self.index.num_slots,
                "hicache_host_pages_pinned": self.index.num_pinned,
                "hicache_bytes_per_page": bpp,
                "hicache_hit_tokens": s.loaded_pages * self.page_size,
                "hicache_loaded_bytes": s.loaded_pages * bpp,
                "hicache_written_bytes": s.written_pages * bpp,
                "hicache_evicted_pages": self.index.num_evicted}


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
    device_pages = host.scheduler.config.num_pages - 1
    slots = host_pool_slots(args, device_pages, bpp)
    pool = HostKVPool(shapes, slots)
    index = HostIndex(slots)
    ps = args.page_size
    connector = HiCacheConnector(host.scheduler, index, ps)
    max_pages = -(-host.context_length // ps)
    worker = HiCacheWorker(runner, pool, index, connector.stats, max_pages)
    worker.warmup()
    connector.wait_for_writes = worker.flush
    logger.info("HiCache host tier: %d pages (%.2f GiB) behind %d device pages",
                slots, slots * bpp / GIB, device_pages)
    return connector, worker, HiCacheRole(index, pool, connector.stats, ps)
