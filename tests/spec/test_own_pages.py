"""A drafter's own pages: grown to cover positions, cut back to whole pages, all or nothing."""

from pdjax.kv.allocator import PageAllocator
from pdjax.spec.own_pages import common_prefix, reserve_pages, truncate_pages


def test_reserve_and_truncate_cover_exactly_the_positions():
    alloc = PageAllocator(9)                     # page 0 is the null page: 8 usable
    free0 = alloc.num_free
    pages: list[int] = []
    assert reserve_pages(alloc, pages, 9, page_size=4) and len(pages) == 3
    assert reserve_pages(alloc, pages, 12, page_size=4) and len(pages) == 3   # still covered
    assert 0 not in pages and alloc.num_free == free0 - 3
    truncate_pages(alloc, pages, 5, page_size=4)      # positions 0..4: pages 0 and 1 kept
    assert len(pages) == 2 and alloc.num_free == free0 - 2
    other: list[int] = []
    assert not reserve_pages(alloc, other, 4 * (free0 - 1), page_size=4)    # one page short
    assert other == [] and alloc.num_free == free0 - 2                     # nothing taken
    truncate_pages(alloc, pages, -3, page_size=4)
    assert pages == [] and alloc.num_free == free0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7, 8], [7, 8]) == 2
