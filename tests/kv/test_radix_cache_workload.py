"""The scheduler's use of PageAllocator + RadixCache, walked step by step and at random.

Admission: ``match_prefix(prompt, max_pages=(len(prompt) - 1) // page_size)``, ``lock(node)``,
evict when short, allocate the rest. Finish: ``unlock(node)``, ``insert`` the full pages, free
the partial last page. After every operation the pages are counted from three independent sides
(the tree walk, the requests' own lists, the allocator's heap): disjoint, and together the pool.
"""

import dataclasses
import random

import pytest

from pdjax.kv.allocator import PageAllocator
from pdjax.kv.prefix_cache import RadixCache

PS = 4


@dataclasses.dataclass
class Req:
    prompt: list
    output: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)
    node: object = None
    num_matched: int = 0            # leading pages borrowed (locked) from the cache

    @property
    def all_ids(self):
        return self.prompt + self.output

    @property
    def owned(self):
        return self.pages[self.num_matched:]


def cdiv(a, b):
    return -(-a // b)


class Sim:
    """A toy scheduler around the allocator and cache; ``kv[page]`` is what the page holds."""

    def __init__(self, num_pages, enabled=True, shuffle_seed=None):
        self.alloc = PageAllocator(num_pages)
        if shuffle_seed is not None:
            self.alloc.shuffle(shuffle_seed)
        self.cache = RadixCache(PS, self.alloc, enabled=enabled)
        self.live: list[Req] = []
        self.kv: dict[int, tuple] = {}
        self.stats = dict(admitted=0, rejected=0, matched_pages=0, duplicates_freed=0,
                          evicted=0, finished=0, resets=0)

    def _take(self, n):
        if self.alloc.num_free < n:
            self.stats["evicted"] += self.cache.evict(n - self.alloc.num_free)
        return self.alloc.alloc(n)

    def _write_kv(self, req, first_page):
        ids = req.all_ids
        for i in range(first_page, len(req.pages)):
            self.kv[req.pages[i]] = tuple(ids[i * PS:(i + 1) * PS])

    def admit(self, prompt) -> Req | None:
        pages, node = self.cache.match_prefix(prompt, max_pages=(len(prompt) - 1) // PS)
        assert len(pages) * PS < len(prompt)
        for i, p in enumerate(pages):           # a hit must hold exactly this prompt's KV
            assert self.kv[p] == tuple(prompt[i * PS:(i + 1) * PS])
        self.cache.lock(node)
        new = self._take(cdiv(len(prompt), PS) - len(pages))
        if new is None:
            self.cache.unlock(node)
            self.stats["rejected"] += 1
            return None
        req = Req(list(prompt), pages=pages + new, node=node, num_matched=len(pages))
        self._write_kv(req, len(pages))
        self.live.append(req)
        self.stats["admitted"] += 1
        self.stats["matched_pages"] += len(pages)
        return req

    def decode(self, req, token) -> bool:
        req.output.append(token)
        if req.num_matched + len(req.owned) < cdiv(len(req.all_ids), PS):
            page = self._take(1)
            if page is None:
                req.output.pop()
                return False
            req.pages += page
        self._write_kv(req, len(req.pages) - 1)
        return True

    def finish(self, req):
        self.live.remove(req)
        self.cache.unlock(req.node)
        full = len(req.all_ids) // PS
        free_before = self.alloc.num_free
        self.cache.insert(req.all_ids[:full * PS], req.pages[:full])
        self.stats["duplicates_freed"] += self.alloc.num_free - free_before
        self.alloc.free(req.pages[full:])
        self.stats["finished"] += 1

    def check(self):
        num_pages = self.alloc.num_pages
        cached = self.cache.cached_pages()
        free = self.alloc.free_pages()
        owned = [p for r in self.live for p in r.owned]
        owned_set = set(owned)
        assert len(owned_set) == len(owned), "two requests own the same page"
        assert not cached & free and not cached & owned_set and not free & owned_set
        assert cached | free | owned_set == set(range(1, num_pages))
        assert len(cached) + len(free) + len(owned) == num_pages - 1
        assert self.alloc.num_free == len(free)
        assert self.cache.num_cached_pages == len(cached)
        if not self.cache.enabled:
            assert not cached
        # Borrowed prefixes stay cached and are exactly the locked pages.
        borrowed = {p for r in self.live for p in r.pages[:r.num_matched]}
        assert borrowed <= cached
        assert self.cache.num_cached_pages - self.cache.num_evictable_pages == len(borrowed)
        for r in self.live:
            assert len(r.pages) == cdiv(len(r.all_ids), PS)
            for i, p in enumerate(r.pages):
                assert self.kv[p] == tuple(r.all_ids[i * PS:(i + 1) * PS])


def test_scheduler_walk():
    sim = Sim(16)
    alloc, cache = sim.alloc, sim.cache
    # R1: cold cache. 10 prompt tokens -> 3 pages; the 13th token needs a 4th page.
    r1 = sim.admit(list(range(1, 11)))
    assert (r1.pages, r1.num_matched, r1.node) == ([1, 2, 3], 0, cache.root)
    for t in (11, 12, 13):
        assert sim.decode(r1, t)
    assert r1.pages == [1, 2, 3, 4]
    sim.check()
    sim.finish(r1)                       # pages 1-3 (tokens 1..12) cached, page 4 freed
    assert cache.cached_pages() == frozenset({1, 2, 3}) and alloc.is_free(4)
    sim.check()
    # R2: prompt = tokens 1..12, three full pages, but one token must stay to compute, so only
    # two pages match and the third is recomputed into a fresh page, a duplicate at finish.
    r2 = sim.admit(list(range(1, 13)))
    assert (r2.pages, r2.num_matched) == ([1, 2, 4], 2)
    assert r2.node.pages == [2] or r2.node.pages == [1, 2]
    assert cache.num_evictable_pages == 1                    # page 3 only
    assert sim.decode(r2, 99) and r2.pages == [1, 2, 4, 5]
    sim.check()
    sim.finish(r2)
    assert alloc.is_free(4) and alloc.is_free(5) and sim.stats["duplicates_freed"] == 1
    assert cache.cached_pages() == frozenset({1, 2, 3})
    sim.check()
    # R3: 56 new tokens need 14 pages, 12 are free: the 2 LRU cached pages (3, then 2) go.
    r3 = sim.admit(list(range(100, 156)))
    assert sim.stats["evicted"] == 2
    assert cache.cached_pages() == frozenset({1})
    assert sorted(r3.pages) == list(range(2, 16)) and r3.num_matched == 0
    sim.check()
    # R4 matches page 1 and locks it, so it cannot be evicted for R4's second page: rejected,
    # and the unlock leaves page 1 cached and evictable again.
    assert sim.admit([1, 2, 3, 4, 5, 6, 7]) is None
    assert sim.stats["rejected"] == 1 and sim.stats["evicted"] == 2
    assert cache.cached_pages() == frozenset({1}) and cache.num_evictable_pages == 1
    sim.check()
    sim.finish(r3)
    assert cache.num_cached_pages == 15 and alloc.num_free == 0      # R3's 14 pages + page 1
    sim.check()


def random_prompt(rng, history):
    if history and rng.random() < 0.2:
        return list(rng.choice(history))                     # exact repeat
    system = [[7] * PS * 2, [8, 9] * PS, []][rng.randrange(3)]
    if history and rng.random() < 0.3:
        base = rng.choice(history)
        system = base[:rng.randrange(len(base) + 1)]         # shared prefix of any length
    tail = [rng.randrange(3) for _ in range(rng.randrange(0, 3 * PS))]
    prompt = (system + tail) or [1]
    if rng.random() < 0.3:                                   # land on a page boundary
        prompt = prompt[:max(PS, len(prompt) // PS * PS)] or [1]
    return prompt


def run_workload(seed, enabled=True, num_ops=400):
    rng = random.Random(seed)
    sim = Sim(rng.choice([12, 24, 48]), enabled=enabled,
              shuffle_seed=seed if seed % 2 else None)
    history = []
    sim.check()
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.35 or not sim.live:
            prompt = random_prompt(rng, history)
            history.append(prompt)
            sim.admit(prompt)
        elif op < 0.75:
            req = rng.choice(sim.live)
            if not sim.decode(req, rng.randrange(3)):
                sim.finish(req)                              # out of pages: stop it
        elif op < 0.92:
            sim.finish(rng.choice(sim.live))                 # random finish order
        elif op < 0.98:
            want = rng.randrange(6)
            expect = min(want, sim.cache.num_evictable_pages)
            got = sim.cache.evict(want)
            assert got == expect
            sim.stats["evicted"] += got
        else:
            can = not any(r.num_matched for r in sim.live)
            assert sim.cache.reset() is can
            sim.stats["resets"] += can
        sim.check()
    while sim.live:
        sim.finish(sim.live[0])
        sim.check()
    assert sim.cache.num_evictable_pages == sim.cache.num_cached_pages
    num_cached = sim.cache.num_cached_pages
    assert sim.cache.evict(sim.alloc.num_pages) == num_cached
    assert sim.cache.num_cached_pages == 0
    assert sim.alloc.free_pages() == frozenset(range(1, sim.alloc.num_pages))
    return sim.stats


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_the_pool_whole(seed):
    stats = run_workload(seed)
    assert stats["admitted"] > 50 and stats["finished"] == stats["admitted"]


def test_random_workload_exercises_hits_duplicates_and_eviction():
    totals = {}
    for seed in range(12, 18):
        for k, v in run_workload(seed).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["matched_pages"] > 100
    assert totals["duplicates_freed"] > 10
    assert totals["evicted"] > 50
    assert totals["rejected"] > 0 and totals["resets"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_with_cache_disabled(seed):
    stats = run_workload(seed, enabled=False)
    assert stats["admitted"] > 50 and stats["matched_pages"] == 0
    assert stats["evicted"] == 0
