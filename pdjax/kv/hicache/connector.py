"""The host tier's ``KVConnector``: what the scheduler asks of it, and the plan it hands the
worker (DESIGN.md §3, "Host tier"; §4 for the calls).

    admission      get_num_new_matched_tokens(req, local)  pages past the device hit that the
                   host holds, whole pages, one prompt token left (the index's ``match``)
                   update_state_after_alloc(req, n)        pin their slots, plan the load into
                                                           the pages just allocated
    a finish       request_finished(req) -> False          remember its tokens (write-through);
                                                           an abort while loading drops the load
    after a step   build_meta(batch)                       the loads, and the writes: every
                   prefix the step computed (its prefill rows) or finished, cut to the pages
                   the device prefix cache holds for it now, minus those the host knows

With a storage tier (L3, ``storage_tier``) admission also asks the store for the page past
the host hit: when it holds it, the store's pages are prefetched into host slots first (the
answer is None, "ask again", meanwhile; others are admitted) and then load like host pages.

Write-through copies a page to the host once it is computed and cached on the device, so a
page the device evicts later is on the host already (SGLang's ``write_through``). The other
write policies (``--hicache-write-policy``, SGLang's):

    write_through_selective  as write_through, but only pages some request has found in the
                             device prefix cache (hit at least once, so used at least twice):
                             a prompt seen once costs no host copy
    write_back               no copy until the device evicts a page: the prefix cache's
                             ``on_evict`` (``on_device_evict`` here) plans the write and the
                             worker dispatches its gather at once, before the evicted pages can
                             be handed to a request and written by a later forward (device
                             order); pages still on the device at shutdown are not copied The device
pages of a write are read from the prefix cache when the plan is made (``cached_pages_of``): a
page in the cache then holds its prefix's KV, written by a forward dispatched before the gather
that copies it (device order), and no request can be handed it before the next ``schedule``.
Pure Python.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Callable

from pdjax.kv.hicache.host_pool import HostIndex
from pdjax.kv.hicache.page_hash import page_hashes
from pdjax.request import PENDING_TOKEN
from pdjax.sched.kv_connector import KVConnectorOutput

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

if TYPE_CHECKING:      # annotations only
    from pdjax.request import Request
    from pdjax.sched.kv_cache_manager import KVCacheManager
    from pdjax.sched.scheduled_batch import ScheduledBatch
    from pdjax.kv.hicache.storage_tier import StorageTier


@dataclasses.dataclass
class LoadJob:
    """Host slots ``slots[i]`` -> device page ``pages[i]`` for ``req`` (waiting for its KV)."""

    req: Request
    pages: list[int]
    slots: list[int]


@dataclasses.dataclass
class WriteJob:
    """Device pages ``pages[i]`` -> host slots ``slots[i]``, the pages ``new`` (indices into
    ``path``) of the prefix whose page hashes are ``path``."""

    path: list[bytes]
    new: list[int]
    pages: list[int]
    slots: list[int]


@dataclasses.dataclass
class HiCacheMeta:
    """One step's plan for ``HiCacheWorker.start``."""

    loads: list[LoadJob]
    writes: list[WriteJob]


@dataclasses.dataclass
class HiCacheStats:
    """Counters of ``/get_load`` (``HiCacheRole.load``)."""

    loaded_pages: int = 0
    written_pages: int = 0
    load_jobs_dropped: int = 0   # loads planned for a request that left before they started
    storage_hit_pages: int = 0   # pages the storage tier (L3) put on the host for a request


class HiCacheConnector:
    """The host tier as the scheduler's ``KVConnector`` (see the module docstring).

    ``kv``: the engine's pages (``KVCacheManager``; its prefix cache is read); ``index``: the
    host pool's ``HostIndex``."""

    def __init__(self, kv: KVCacheManager, index: HostIndex, page_size: int,
                 write_policy: str = "write_through"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: {write_policy!r} not in {WRITE_POLICIES}")
        self.kv = kv
        self.index = index
        self.write_policy = write_policy
        # write_through_selective: page hash -> device prefix hits (bounded, oldest dropped).
        self._hits: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._hits_limit = max(1024, 4 * index.num_slots)
        self._counted: set[str] = set()        # requests whose device hit was counted
        # write_back: the worker's ``start`` (set by ``build_host_tier``), called with a plan
        # of evicted pages while the scheduler evicts them.
        self.write_now: Callable[[HiCacheMeta], None] | None = None
        # Requests whose load is planned or running, until their KV arrives or they end (the
        # scheduler asks ``request_finished`` of a request aborted while its KV arrives).
        self._loading: dict[str, Request] = {}
        self.page_size = page_size
        self.stats = HiCacheStats()
        self._loads: list[LoadJob] = []
        self._finished: list[list[int]] = []
        # The worker's ``flush``: commits the writes in flight (set by ``build_host_tier``).
        self.wait_for_writes: Callable[[], None] | None = None
        # The storage tier (L3, ``storage_tier.StorageTier``), when one is configured, and the
        # queued requests whose prefetch from it is running ("pending"), or whose store was
        # asked ("done": its pages are on the host, or it had none; not asked again).
        self.storage: StorageTier | None = None
        self._prefetch: dict[str, str] = {}

    # ---- admission -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        ps = self.page_size
        max_pages = (req.num_prompt_tokens - 1) // ps       # one prompt token to compute
        first = num_computed_tokens // ps
        count = self.write_policy == "write_through_selective" and req.rid not in self._counted
        if first >= max_pages and not count:
            return 0
        hashes = page_hashes(req.prompt_ids, ps, max_pages)
        if count:                               # admission may ask again: count once
            self._counted.add(req.rid)
            self._count_hits(hashes[:first])
        if first >= max_pages:
            return 0
        n = self.index.match(hashes, first)
        if first + n < max_pages and self.index.is_pending(hashes[first + n]) \
                and self.wait_for_writes is not None:
            # The next page is on its way to the host (the device evicted it since): wait for
            # the copy rather than recompute it.
            self.wait_for_writes()
            n = self.index.match(hashes, first)
        if self.storage is not None and first + n < max_pages \
                and not self._storage_done(req, hashes, first + n):
            return None                     # its next pages come from the store: ask again
        return n * ps

    def _storage_done(self, req: Request, hashes: list[bytes], start: int) -> bool:
        """Whether ``req``'s admission need not wait for the store: nothing stored past the
        host hit (page ``start``), or its prefetch is done. Starts the prefetch otherwise."""
        state = self._prefetch.get(req.rid)
        if state == "done":
            return True
        if state == "pending":
            return False
        if not self.storage.exists(hashes[start]):
            self._prefetch[req.rid] = "done"    # asked once (admission may be retried)
            return True
        self._prefetch[req.rid] = "pending"
        self.storage.submit_prefetch(req.rid, hashes, start)
        return False

    def prefetch_done(self, rid: str) -> None:
        """The store's pages for ``rid`` are on the host now (or were not usable)."""
        if rid in self._prefetch:
            self._prefetch[rid] = "done"

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        self._prefetch.pop(req.rid, None)
        if not num_external_tokens:
            return
        ps = self.page_size
        n = num_external_tokens // ps
        first = len(req.pages) - n
        hashes = page_hashes(req.prompt_ids, ps, first + n)
        slots = self.index.slots(hashes[first:])     # matched in this same schedule()
        self.index.pin(slots)
        self.index.touch(hashes)
        self._loads.append(LoadJob(req, req.pages[first:], slots))
        self._loading[req.rid] = req

    def is_waiting(self, req: Request) -> bool:
        """Whether ``req`` still waits for its KV (not aborted since its load was planned)."""
        return self._loading.get(req.rid) is req

    # ---- finish and step -----------------------------------------------------------------
    def request_finished(self, req: Request) -> bool:
        self._loading.pop(req.rid, None)
        self._prefetch.pop(req.rid, None)
        self._counted.discard(req.rid)
        self._finished.append(req.all_ids)
        return False

    def _count_hits(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hits[h] = self._hits.get(h, 0) + 1
            self._hits.move_to_end(h)
        while len(self._hits) > self._hits_limit:
            self._hits.popitem(last=False)

    def on_device_evict(self, token_ids: list[int], pages: list[int]) -> None:
        """write_back: the device prefix cache evicts ``pages``, the KV of the last
        ``len(pages)`` full pages of prefix ``token_ids``; those the host does not know yet are
        copied out now (``write_now``: the gather is dispatched before this returns)."""
        if self.write_policy != "write_back" or self.write_now is None or not pages:
            return
        total = len(token_ids) // self.page_size
        path = page_hashes(token_ids, self.page_size, total)
        first = total - len(pages)
        new = [i for i in range(first, total) if not self.index.is_known(path[i])]
        if not new:
            return
        slots = self.index.reserve([path[i] for i in new])
        if not slots:
            return
        new = new[:len(slots)]
        self.write_now(HiCacheMeta([], [WriteJob(path[:new[-1] + 1], new,
                                                 [pages[i - first] for i in new], slots)]))

    def build_meta(self, batch: ScheduledBatch | None) -> HiCacheMeta | None:
        loads = []
        for job in self._loads:
            if self.is_waiting(job.req):
                loads.append(job)
            else:                           # aborted before its load started
                self.index.unpin(job.slots)
                self.stats.load_jobs_dropped += 1
        self._loads = []
        prefixes, self._finished = self._finished, []
        if batch is not None:
            prefixes += [row.req.all_ids for row in batch.rows
                         if not row.is_decode and not row.is_verify]
        if self.write_policy == "write_back":
            prefixes = []                       # written when the device evicts them
        writes = [w for ids in prefixes if (w := self._plan_write(ids)) is not None]
        return HiCacheMeta(loads, writes) if loads or writes else None

    def _plan_write(self, ids: list[int]) -> WriteJob | None:
        """The pages of prefix ``ids`` the device caches and the host does not know yet."""
        if PENDING_TOKEN in ids:
            ids = ids[:ids.index(PENDING_TOKEN)]
        pages = self.kv.prefix_cache.cached_pages_of(ids)
        if not pages:
            return None
        path = page_hashes(ids, self.page_size, len(pages))
        self.index.touch(path)              # kept while slots are made for the rest
        new = [i for i, h in enumerate(path) if not self.index.is_known(h)]
        if self.write_policy == "write_through_selective":
            new = [i for i in new if self._hits.get(path[i], 0) >= 1]
        if not new:
            return None
        slots = self.index.reserve([path[i] for i in new])
        if not slots:
            return None
        new = new[:len(slots)]
        return WriteJob(path[:new[-1] + 1], new, [pages[i] for i in new], slots)

    def update(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._loading.pop(rid, None)

    def owned_pages(self) -> list[int]:
        return []
