"""The host tier's worker over a fake runner (numpy pages, no JAX): writes land in the host
slots and become readable at ``poll``, loads scatter into the device pages and report the
request, a load of an aborted request is dropped, and a failed copy frees what it held before
the error reaches the engine thread (DESIGN.md §3, "Host tier")."""

import types

import numpy as np
import pytest

from pdjax.kv.hicache.connector import HiCacheMeta, HiCacheStats, LoadJob, WriteJob
from pdjax.kv.hicache.host_pool import HostIndex, HostKVPool
from pdjax.kv.hicache.page_hash import page_hashes
from pdjax.kv.hicache.worker import HiCacheWorker

SHAPE = (2, 10, 4, 3)          # [layers, device pages, page_size, row]


class FakeDeviceArray:
    """What the worker uses of a jax.Array: the async host copy and readiness."""

    def __init__(self, value, fail=False):
        self.value, self.fail, self.copied = value, fail, False

    def copy_to_host_async(self):
        self.copied = True

    def is_ready(self):
        return True

    def __array__(self, dtype=None, copy=None):
        if self.fail:
            raise OSError("device lost")
        return self.value


class FakeRunner:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.caches = {"k": rng.standard_normal(SHAPE).astype(np.float32),
                       "v": rng.standard_normal(SHAPE).astype(np.float32)}
        self.cache_specs = (types.SimpleNamespace(name="k"), types.SimpleNamespace(name="v"))
        self.fail_gather = False
        self.jits = types.SimpleNamespace(gather_pages=self._gather)

    def _gather(self, caches, idx):
        return {k: FakeDeviceArray(v[:, idx].copy(), self.fail_gather) for k, v in caches.items()}

    def scatter_pages(self, idx, parts):
        for s, p in zip(self.cache_specs, parts):
            self.caches[s.name][:, idx] = p


def _worker(waiting=lambda req: True):
    runner = FakeRunner()
    pool = HostKVPool([(SHAPE, np.float32)] * 2, 6)
    index = HostIndex(6)
    worker = HiCacheWorker(runner, pool, index, HiCacheStats(), max_pages=2, is_waiting=waiting)
    return runner, pool, index, worker


def _write(index, pages):
    path = page_hashes(list(range(4 * len(pages))), 4)
    slots = index.reserve(path)
    return WriteJob(path, list(range(len(pages))), list(pages), slots)


def test_a_write_then_a_load_moves_the_page_bytes_both_ways():
    runner, pool, index, worker = _worker()
    job = _write(index, [3, 7, 5])              # 3 pages: two copies of the 2-page bucket
    worker.start(HiCacheMeta([], [job]))
    want = {k: v[:, [3, 7, 5]].copy() for k, v in runner.caches.items()}
    worker.flush()
    assert index.match(job.path, 0) == 3 and worker.stats.written_pages == 3
    np.testing.assert_array_equal(pool.read(job.slots)[0], want["k"])

    req = types.SimpleNamespace(rid="r")
    index.pin(job.slots)
    worker.start(HiCacheMeta([LoadJob(req, [1, 2, 9], job.slots)], []))
    worker.flush()
    out = worker.poll()
    assert out.finished_recving == {"r"} and index.num_pinned == 0
    np.testing.assert_array_equal(runner.caches["k"][:, [1, 2, 9]], want["k"])
    np.testing.assert_array_equal(runner.caches["v"][:, [1, 2, 9]], want["v"])
    index.check()


def test_a_load_of_an_aborted_request_is_not_scattered():
    runner, pool, index, worker = _worker(waiting=lambda req: False)
    job = _write(index, [4])
    worker.start(HiCacheMeta([], [job]))
    worker.flush()
    before = runner.caches["k"].copy()
    index.pin(job.slots)
    worker.start(HiCacheMeta([LoadJob(types.SimpleNamespace(rid="gone"), [8], job.slots)], []))
    worker.flush()
    assert worker.poll().finished_recving == set() and worker.stats.load_jobs_dropped == 1
    np.testing.assert_array_equal(runner.caches["k"], before)
    assert index.num_pinned == 0


def test_a_failed_copy_frees_its_slots_and_pins_then_raises():
    runner, pool, index, worker = _worker()
    runner.fail_gather = True
    job = _write(index, [2, 3])
    worker.start(HiCacheMeta([], [job]))
    with pytest.raises(RuntimeError, match="host KV tier copy failed: OSError"):
        worker.flush()
    assert not index.is_known(job.path[0]) and index.num_used == 0
    index.check()

    runner.fail_gather = False
    job = _write(index, [2])
    worker.start(HiCacheMeta([], [job]))
    worker.flush()
    index.pin(job.slots)
    pool.read = lambda slots: (_ for _ in ()).throw(MemoryError("host"))
    worker.start(HiCacheMeta([LoadJob(types.SimpleNamespace(rid="r"), [1], job.slots)], []))
    with pytest.raises(RuntimeError, match="MemoryError"):
        worker.flush()
    assert index.num_pinned == 0 and worker.num_in_flight == 0
    worker.close()
    assert not worker._thread.is_alive()


def test_metrics_count_hits_bytes_and_copy_seconds():
    from prometheus_client import generate_latest

    from pdjax.kv.hicache.worker import HiCacheRole
    from pdjax.metrics import Metrics

    runner, pool, index, worker = _worker()
    role = HiCacheRole(worker, 4)
    metrics = Metrics()
    role.attach_metrics(metrics)
    job = _write(index, [3, 7])
    worker.start(HiCacheMeta([], [job]))
    worker.flush()
    index.pin(job.slots)
    worker.start(HiCacheMeta([LoadJob(types.SimpleNamespace(rid="r"), [1], job.slots[:1])], []))
    index.unpin(job.slots[1:])
    worker.flush()
    text = generate_latest(metrics.registry).decode()
    bpp = pool.bytes_per_page
    assert f"pdjax:hicache_written_bytes_total {2 * bpp}.0" in text
    assert f"pdjax:hicache_loaded_bytes_total {bpp}.0" in text
    assert "pdjax:hicache_hit_tokens_total 4.0" in text
    assert "pdjax:hicache_load_seconds_count 1.0" in text
    assert "pdjax:hicache_write_seconds_count 1.0" in text
    assert "pdjax:hicache_host_pages_used 2.0" in text
    assert "pdjax:hicache_host_pages_total 6.0" in text
    load = role.load()
    assert (load["hicache_hit_tokens"], load["hicache_loaded_bytes"],
            load["hicache_written_bytes"]) == (4, bpp, 2 * bpp)


def test_no_copy_moves_more_than_64_mib_whatever_the_context():
    from pdjax.kv.hicache.worker import COPY_MAX_BYTES, copy_pages_limit
    from pdjax.transfer.local_kv import page_buckets

    assert COPY_MAX_BYTES == 64 << 20
    # SmolLM2-135M float32: 737,280 bytes a page -> 91 fit, the bucket is 64 pages.
    assert copy_pages_limit(737_280) == 64
    assert copy_pages_limit(8192) == 8192 and copy_pages_limit(1 << 30) == 1
    for bpp in (737_280, 2 << 20, 3 << 20, 8192):
        largest = page_buckets(min(128_000 // 16, copy_pages_limit(bpp)))[-1]
        assert largest * bpp <= COPY_MAX_BYTES


def test_waiting_on_a_stopped_copy_thread_raises_instead_of_hanging():
    runner, pool, index, worker = _worker()
    worker.close()
    worker.start(HiCacheMeta([], [_write(index, [2])]))
    with pytest.raises(RuntimeError, match="the copy thread is gone"):
        worker.flush()
