"""The host tier's pure parts: chained page hashes, the host pool, the LRU index with pins and
pending writes, and the prefix cache's read-only ``cached_pages_of`` (DESIGN.md §3,
"Host tier")."""

import numpy as np
import pytest

from pdjax.kv.allocator import PageAllocator
from pdjax.kv.hicache.host_pool import HostIndex, HostKVPool, page_bytes
from pdjax.kv.hicache.page_hash import page_hashes
from pdjax.kv.prefix_cache import RadixCache


def test_a_page_hash_chains_the_prefix_before_it():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and all(len(h) == 16 for h in a)       # the partial page has none
    b = page_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]                 # same tokens in page 1, another prefix: another hash
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 1) == a[:1]
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[1] != a[1]
    with pytest.raises(ValueError, match=r"num_pages must be in \[0, 2\]"):
        page_hashes([1] * 9, 4, 3)


def test_host_pool_round_trips_pages_in_the_transfer_format():
    shapes = [((2, 9, 4, 6), np.float32), ((2, 9, 4, 3), np.float16)]
    pool = HostKVPool(shapes, 5)
    assert pool.bytes_per_page == page_bytes(shapes) == 2 * 4 * 6 * 4 + 2 * 4 * 3 * 2
    assert [b.shape for b in pool.buffers] == [(2, 5, 4, 6), (2, 5, 4, 3)]
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((2, 4, 4, 6)).astype(np.float32),     # 3 pages + padding
             rng.standard_normal((2, 4, 4, 3)).astype(np.float16)]
    pool.write([4, 0, 2], parts)
    got = pool.read([2, 4])
    np.testing.assert_array_equal(got[0], parts[0][:, [2, 0]])
    np.testing.assert_array_equal(got[1], parts[1][:, [2, 0]])
    got[0][:] = 0                                   # a copy: the pool keeps its bytes
    np.testing.assert_array_equal(pool.read([4])[0][:, 0], parts[0][:, 0])


def _path(n, tag=0):
    return page_hashes([tag] * 4 + list(range(4 * (n - 1))), 4)


def test_index_match_reserve_commit_and_lru_takes_leaves_first():
    idx = HostIndex(4)
    p = _path(3)
    slots = idx.reserve(p)
    assert len(slots) == 3 and idx.match(p, 0) == 0      # pending: not readable yet
    assert idx.is_known(p[2]) and idx.num_used == 3
    idx.commit(p)
    assert idx.match(p, 0) == 3 and idx.match(p, 1) == 2 and idx.slots(p) == slots
    q = _path(2, tag=7)                                   # another prefix: 2 pages, 1 free slot
    got = idx.reserve(q)
    assert len(got) == 2 and idx.num_evicted == 1
    assert idx.match(p, 0) == 2                           # p's deepest page went, not its head
    idx.commit(q)
    idx.check()
    idx.touch(p[:2])                                      # p now more recent than q
    idx.reserve(_path(1, tag=9))
    assert idx.match(q, 0) == 1 and idx.match(p, 0) == 2  # q's leaf was the LRU page
    idx.check()


def test_pinned_pages_are_not_evicted_and_cancel_frees_slots():
    idx = HostIndex(2)
    p = _path(2)
    assert len(idx.reserve(p)) == 2
    idx.commit(p)
    idx.pin(idx.slots(p))
    assert idx.reserve(_path(1, tag=3)) == [] and idx.num_pinned == 2   # nothing evictable
    idx.unpin(idx.slots(p))
    with pytest.raises(ValueError, match="unpin of unpinned"):
        idx.unpin(idx.slots(p)[:1])
    q = _path(1, tag=3)
    assert len(idx.reserve(q)) == 1
    idx.cancel(q)
    assert not idx.is_known(q[0]) and idx.num_used == 1
    idx.check()
    with pytest.raises(ValueError, match="already knows"):
        idx.reserve(p[:1])


def test_cached_pages_of_reads_without_touching_the_lru():
    cache = RadixCache(4, PageAllocator(16))
    a = list(range(1, 13))                      # 3 pages
    pages = cache.allocator.alloc(3)
    cache.insert(a, pages)
    b = [50, 51, 52, 53]
    cache.insert(b, cache.allocator.alloc(1))
    assert cache.cached_pages_of(a + [1, 2]) == pages
    assert cache.cached_pages_of(a[:8] + [0, 0, 0, 0]) == pages[:2]
    assert cache.cached_pages_of([7, 7, 7, 7]) == []
    cache.cached_pages_of(a)                    # no touch: a stays the LRU leaf
    assert cache.evict(1) == 1 and cache.cached_pages_of(a) == pages[:2]
    assert RadixCache(4, PageAllocator(4), enabled=False).cached_pages_of(a) == []
