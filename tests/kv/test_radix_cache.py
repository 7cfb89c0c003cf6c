"""RadixCache over full pages: matching, ownership on insert, locking, LRU eviction, errors."""

import pytest

from pdjax.kv.allocator import PageAllocator
from pdjax.kv.prefix_cache import RadixCache

PS = 4


def make(num_pages=32, enabled=True):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(PS, alloc, enabled=enabled)


def toks(*runs):
    """toks((1, 8), (20, 22)) -> [1..8, 20..22]: inclusive ranges, concatenated."""
    out = []
    for lo, hi in runs:
        out.extend(range(lo, hi + 1))
    return out


def check_tree(cache):
    """Structural invariants, counted by walking the tree (not from the cache's counters)."""
    n_pages = n_unlocked = 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node
            assert child.page_keys[0] == key
            assert len(child.pages) == len(child.page_keys) >= 1
            assert all(len(k) == PS for k in child.page_keys)
            assert child.lock_ref >= 0
            if node is not cache.root:
                assert node.lock_ref >= child.lock_ref
            n_pages += len(child.pages)
            n_unlocked += len(child.pages) if child.lock_ref == 0 else 0
            stack.append(child)
    assert cache.num_cached_pages == n_pages == len(cache.cached_pages())
    assert cache.num_evictable_pages == n_unlocked


def test_match_on_empty_and_insert_then_match():
    alloc, cache = make()
    assert cache.match_prefix(toks((1, 20))) == ([], cache.root)
    pages = alloc.alloc(3)
    cache.insert(toks((1, 12)), pages)
    assert cache.cached_pages() == frozenset(pages) and alloc.num_free == 28
    got, node = cache.match_prefix(toks((1, 14)))          # partial last page not matched
    assert got == [1, 2, 3] and node.pages == [1, 2, 3]
    got, node = cache.match_prefix(toks((1, 11)))          # only 2 full pages in the query
    assert got == [1, 2] and node.pages == [1, 2]           # edge split at the match end
    assert node.children[(9, 10, 11, 12)].pages == [3]
    got, _ = cache.match_prefix(toks((1, 4), (50, 60)))
    assert got == [1]
    assert cache.match_prefix([9, 9, 9, 9])[0] == []
    assert cache.match_prefix(toks((1, 3)))[0] == []        # shorter than a page
    check_tree(cache)


def test_max_pages_caps_the_match():
    alloc, cache = make()
    cache.insert(toks((1, 12)), alloc.alloc(3))
    prompt = toks((1, 12))
    # (len - 1) // page_size leaves at least one prompt token to compute.
    got, node = cache.match_prefix(prompt, max_pages=(len(prompt) - 1) // PS)
    assert got == [1, 2] and node.pages == [1, 2]
    assert cache.match_prefix(prompt, max_pages=0) == ([], cache.root)
    assert cache.match_prefix(prompt, max_pages=10)[0] == [1, 2, 3]
    with pytest.raises(ValueError, match="max_pages"):
        cache.match_prefix(prompt, max_pages=-1)


def test_insert_frees_duplicate_pages_but_keeps_the_same_page_ids():
    alloc, cache = make()
    a = alloc.alloc(3)                                      # [1, 2, 3]
    cache.insert(toks((1, 12)), a)
    # Another request computed the same first two pages itself, then diverged.
    b = alloc.alloc(3)                                      # [4, 5, 6]
    cache.insert(toks((1, 8), (100, 103)), b)
    assert alloc.is_free(4) and alloc.is_free(5) and not alloc.is_free(6)
    assert cache.cached_pages() == frozenset({1, 2, 3, 6})
    assert cache.match_prefix(toks((1, 8), (100, 103)))[0] == [1, 2, 6]
    # A request that matched pages [1, 2] gives the same ids back: nothing is freed.
    c = alloc.alloc(2)
    assert c == [4, 5]
    cache.insert(toks((1, 8), (200, 207)), [1, 2] + c)
    assert not alloc.is_free(1) and not alloc.is_free(2)
    assert cache.cached_pages() == frozenset({1, 2, 3, 6, 4, 5})
    assert cache.match_prefix(toks((1, 8), (200, 207)))[0] == [1, 2, 4, 5]
    # Inserting an already cached sequence with the same pages changes nothing.
    free_before = alloc.free_pages()
    cache.insert(toks((1, 12)), [1, 2, 3])
    assert alloc.free_pages() == free_before and cache.num_cached_pages == 6
    # Extra tokens past the last full page are ignored.
    cache.insert(toks((1, 14)), [1, 2, 3])
    assert cache.num_cached_pages == 6
    check_tree(cache)


def test_lru_eviction_order():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))             # A: [1, 2], time 1
    cache.insert(toks((101, 108)), alloc.alloc(2))         # B: [3, 4], time 2
    cache.insert(toks((201, 208)), alloc.alloc(2))         # C: [5, 6], time 3
    cache.match_prefix(toks((1, 8)))                         # touch A: B is now the oldest
    assert cache.evict(2) == 2
    assert cache.cached_pages() == frozenset({1, 2, 5, 6}) and alloc.is_free(3) and alloc.is_free(4)
    assert cache.evict(2) == 2                               # then C
    assert cache.cached_pages() == frozenset({1, 2})
    check_tree(cache)


def test_partial_eviction_takes_the_tail_of_a_leaf():
    alloc, cache = make()
    cache.insert(toks((1, 12)), alloc.alloc(3))
    assert cache.evict(1) == 1
    assert alloc.is_free(3) and cache.cached_pages() == frozenset({1, 2})
    assert cache.match_prefix(toks((1, 12)))[0] == [1, 2]
    assert cache.evict(0) == 0
    assert cache.evict(100) == 2 and cache.num_cached_pages == 0
    assert alloc.num_free == 31
    check_tree(cache)


def test_eviction_goes_leaf_first_up_a_shared_prefix():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))             # shared prefix [1, 2]
    cache.insert(toks((1, 8), (50, 53)), [1, 2] + alloc.alloc(1))     # leaf [3]
    cache.insert(toks((1, 8), (60, 63)), [1, 2] + alloc.alloc(1))     # leaf [4]
    assert cache.evict(1) == 1 and alloc.is_free(3)         # oldest leaf first
    assert cache.evict(2) == 2 and alloc.is_free(4) and alloc.is_free(2)  # 4, then prefix tail
    assert cache.cached_pages() == frozenset({1})
    check_tree(cache)


def test_locked_nodes_are_never_evicted():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))             # [1, 2]
    cache.insert(toks((1, 8), (50, 57)), [1, 2] + alloc.alloc(2))     # [3, 4] under it
    cache.insert(toks((101, 104)), alloc.alloc(1))         # [5]
    pages, node = cache.match_prefix(toks((1, 6)))          # locks only page 1's edge
    assert pages == [1]
    cache.lock(node)
    assert cache.num_evictable_pages == 4
    assert cache.evict(100) == 4
    assert cache.cached_pages() == frozenset({1})
    assert cache.num_evictable_pages == 0 and cache.evict(5) == 0
    check_tree(cache)
    cache.lock(node)                                         # two holders
    cache.unlock(node)
    assert cache.evict(1) == 0
    cache.unlock(node)
    assert cache.num_evictable_pages == 1 and cache.evict(1) == 1
    assert alloc.num_free == 31


def test_lock_survives_a_later_split_of_its_edge():
    alloc, cache = make()
    cache.insert(toks((1, 12)), alloc.alloc(3))
    pages, node = cache.match_prefix(toks((1, 12)))
    cache.lock(node)
    cache.match_prefix(toks((1, 4)))                         # splits the locked edge
    cache.insert(toks((1, 4), (70, 73)), [1] + alloc.alloc(1))
    check_tree(cache)
    assert cache.num_evictable_pages == 1
    assert cache.evict(10) == 1                              # only page 4, the new unlocked leaf
    cache.unlock(node)
    check_tree(cache)
    assert cache.num_evictable_pages == 3 and cache.evict(10) == 3


def test_lock_errors():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))
    pages, node = cache.match_prefix(toks((1, 8)))
    with pytest.raises(ValueError, match="unlock of an unlocked node"):
        cache.unlock(node)
    cache.lock(cache.root)                                   # root: no-op
    cache.unlock(cache.root)
    cache.evict(2)
    with pytest.raises(ValueError, match="not in the cache"):
        cache.lock(node)
    # A node whose tail was evicted is detached too (its surviving head is a new node).
    cache.insert(toks((1, 8)), alloc.alloc(2))
    _, node = cache.match_prefix(toks((1, 8)))
    assert cache.evict(1) == 1
    with pytest.raises(ValueError, match="not in the cache"):
        cache.lock(node)
    check_tree(cache)


def test_insert_errors_change_nothing():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))             # [1, 2]
    held = alloc.alloc(3)                                    # [3, 4, 5]
    state = (cache.cached_pages(), alloc.free_pages())
    with pytest.raises(ValueError, match="expected len"):
        cache.insert(toks((1, 12)), held[:2])
    with pytest.raises(ValueError, match="expected len"):
        cache.insert(toks((1, 7)), held[:2])                 # 7 tokens: one full page
    with pytest.raises(ValueError, match="duplicate"):
        cache.insert(toks((1, 12)), [3, 4, 3])
    with pytest.raises(ValueError, match="already cached at another position"):
        cache.insert(toks((1, 4), (20, 27)), [3, 1, 4])     # page 1 is cached at position 0
    with pytest.raises(ValueError, match="free in the allocator"):
        cache.insert(toks((1, 4), (20, 27)), [3, 4, 9])
    with pytest.raises(ValueError, match="out of range"):
        cache.insert(toks((20, 23)), [0])
    with pytest.raises(ValueError, match="out of range"):
        cache.insert(toks((20, 23)), [32])
    assert (cache.cached_pages(), alloc.free_pages()) == state
    check_tree(cache)


def test_disabled_cache_caches_nothing():
    alloc, cache = make(enabled=False)
    pages = alloc.alloc(3)
    cache.insert(toks((1, 12)), pages)
    assert alloc.num_free == 31 and cache.num_cached_pages == 0
    assert cache.cached_pages() == frozenset()
    assert cache.match_prefix(toks((1, 12))) == ([], cache.root)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.evict(4) == 0 and cache.reset() is True
    with pytest.raises(ValueError, match="expected len"):
        cache.insert(toks((1, 12)), [1])


def test_reset():
    alloc, cache = make()
    cache.insert(toks((1, 8)), alloc.alloc(2))
    cache.insert(toks((101, 104)), alloc.alloc(1))
    _, node = cache.match_prefix(toks((101, 104)))
    cache.lock(node)
    assert cache.reset() is False
    assert cache.cached_pages() == frozenset({1, 2, 3}) and alloc.num_free == 28
    cache.unlock(node)
    root = cache.root
    cache.lock(root)                         # a request that matched nothing holds the root
    assert cache.reset() is True
    assert cache.root is root
    cache.unlock(root)
    assert cache.cached_pages() == frozenset() and alloc.num_free == 31
    assert cache.match_prefix(toks((1, 8))) == ([], cache.root)
    with pytest.raises(ValueError, match="not in the cache"):
        cache.lock(node)
    with pytest.raises(ValueError):
        RadixCache(0, alloc)


def test_extend_locked_shares_a_running_requests_pages_and_moves_its_lock():
    alloc, cache = make()
    a = alloc.alloc(3)
    # No match yet: the request holds the root; its first two full pages join the tree.
    leaf = cache.extend_locked(cache.root, toks((1, 8)), a[:2])
    assert leaf.pages == a[:2] and leaf.lock_ref == 1
    assert cache.num_evictable_pages == 0 and cache.evict(5) == 0
    # One more page computed: the lock moves from the old end to the new one.
    leaf2 = cache.extend_locked(leaf, toks((1, 12)), a)
    assert leaf2.pages == [a[2]] and leaf2.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.match_prefix(toks((1, 13)))[0] == a
    assert (cache.num_path_pages(leaf2), cache.num_path_pages(cache.root)) == (3, 0)
    # Nothing new to share.
    assert cache.extend_locked(leaf2, toks((1, 12)), a) is None
    cache.unlock(leaf2)
    assert cache.num_evictable_pages == 3
    check_tree(cache)


def test_extend_locked_leaves_pages_that_another_request_computed_too():
    alloc, cache = make()
    first, second = alloc.alloc(2), alloc.alloc(2)
    leaf = cache.extend_locked(cache.root, toks((1, 8)), first)
    # `second` computed the same tokens without matching them: its pages stay its own.
    assert cache.extend_locked(cache.root, toks((1, 8)), second) is None
    assert cache.match_prefix(toks((1, 9)))[0] == first
    assert not any(alloc.is_free(p) for p in second)
    cache.unlock(leaf)
    check_tree(cache)


def test_extend_locked_errors_change_nothing():
    alloc, cache = make()
    a = alloc.alloc(2)
    leaf = cache.extend_locked(cache.root, toks((1, 8)), a)
    b = alloc.alloc(2)
    with pytest.raises(ValueError, match="is not the head"):
        cache.extend_locked(leaf, toks((1, 8), (9, 12)), b + [alloc.alloc(1)[0]])
    with pytest.raises(ValueError, match="full pages"):
        cache.extend_locked(leaf, toks((1, 12)), a)
    assert cache.match_prefix(toks((1, 13)))[0] == a and leaf.lock_ref == 1
    _, off_tree = make()
    with pytest.raises(ValueError, match="not in the cache"):
        cache.extend_locked(off_tree.root.__class__(99, None, [], [], 0), toks((1, 4)), [9])
    _, disabled = make(enabled=False)
    assert disabled.extend_locked(disabled.root, toks((1, 4)), [3]) is None
    check_tree(cache)
