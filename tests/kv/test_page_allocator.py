"""PageAllocator: order, all-or-nothing allocation, validated frees, shuffled pools."""

import subprocess
import sys

import pytest

from pdjax.kv.allocator import PageAllocator


def test_fresh_pool_hands_out_low_contiguous_pages():
    a = PageAllocator(10)
    assert a.num_pages == 10 and a.num_free == 9
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(2) == [4, 5]
    assert a.alloc(0) == []
    assert a.num_free == 4
    assert a.free_pages() == frozenset({6, 7, 8, 9})
    a.free([2, 1])
    # Freed low pages come back first, in id order.
    assert a.alloc(3) == [1, 2, 6]


def test_alloc_is_all_or_nothing():
    a = PageAllocator(5)
    assert a.alloc(5) is None          # only 4 allocatable pages
    assert a.num_free == 4 and a.free_pages() == frozenset({1, 2, 3, 4})
    assert a.alloc(4) == [1, 2, 3, 4]
    assert a.alloc(1) is None
    assert a.num_free == 0 and a.free_pages() == frozenset()


def test_bad_arguments():
    for bad in (1, 0, -3, True, 2.0, "4"):
        with pytest.raises(ValueError, match="num_pages"):
            PageAllocator(bad)
    a = PageAllocator(6)
    with pytest.raises(ValueError, match="n must be >= 0"):
        a.alloc(-1)
    with pytest.raises(ValueError, match="n must be an integer"):
        a.alloc(1.5)


def test_free_errors_change_nothing():
    a = PageAllocator(6)
    assert a.alloc(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="page 0"):
        a.free([1, 0])
    with pytest.raises(ValueError, match="out of range"):
        a.free([1, 6])
    with pytest.raises(ValueError, match="out of range"):
        a.free([-1])
    with pytest.raises(ValueError, match="double free of page 4"):
        a.free([1, 4])                  # 4 was never allocated
    with pytest.raises(ValueError, match="double free of page 2"):
        a.free([2, 3, 2])               # listed twice in one call
    with pytest.raises(ValueError, match="page must be an integer"):
        a.free([True])
    # None of the failed calls freed page 1, 2 or 3.
    assert a.free_pages() == frozenset({4, 5}) and a.num_free == 2
    a.free([1, 2, 3])
    with pytest.raises(ValueError, match="double free of page 1"):
        a.free([1])
    assert a.free_pages() == frozenset({1, 2, 3, 4, 5})


def test_is_free():
    a = PageAllocator(4)
    assert a.alloc(1) == [1]
    assert [a.is_free(p) for p in (0, 1, 2, 3, 4, -1)] == [False, False, True, True, False, False]


def test_shuffle_fragments_the_pool_deterministically():
    def order(seed):
        a = PageAllocator(65)
        a.shuffle(seed)
        return a.alloc(64)

    o1, o2, o3 = order(1), order(1), order(2)
    assert o1 == o2 and o1 != o3
    assert sorted(o1) == list(range(1, 65))
    assert o1 != sorted(o1)


def test_shuffled_order_survives_frees_and_keeps_allocated_pages_out():
    a = PageAllocator(33)
    held = a.alloc(5)
    assert held == [1, 2, 3, 4, 5]
    a.shuffle(7)
    # Allocated pages stay allocated; the free list is the same set in a new order.
    assert a.free_pages() == frozenset(range(6, 33)) and a.num_free == 27
    first = a.alloc(27)
    assert set(first) == set(range(6, 33)) and first != sorted(first)
    a.free(first + held)
    again = a.alloc(32)
    ref = PageAllocator(33)
    ref.shuffle(7)
    assert again == ref.alloc(32)       # the order is the seed's, whatever was freed when


def test_numpy_style_ints_accepted():
    class Idx:                          # any object with __index__, like numpy integers
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    a = PageAllocator(4)
    assert a.alloc(Idx(2)) == [1, 2]
    a.free([Idx(1)])
    assert a.free_pages() == frozenset({1, 3})


@pytest.mark.slow      # starts a process
def test_kv_bookkeeping_never_imports_jax():
    code = ("import sys, pdjax.kv.allocator, pdjax.kv.prefix_cache; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
