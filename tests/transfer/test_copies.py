"""Page-run grouping and copy building (pure Python + numpy; bytes moved with ctypes.memmove)."""

import ctypes

import numpy as np
import pytest

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import ProtocolError
from pdjax.transfer.kv_copies import KVLayout, build_copies, group_contiguous_runs


def test_group_runs_examples():
    assert group_contiguous_runs([], []) == []
    assert group_contiguous_runs([4], [9]) == [(4, 9, 1)]
    assert group_contiguous_runs([7, 8, 9, 3, 4, 5], [20, 21, 22, 11, 30, 31]) == \
        [(7, 20, 3), (3, 11, 1), (4, 30, 2)]
    # Breaks on the destination side alone, and on the source side alone.
    assert group_contiguous_runs([1, 2, 3, 4], [5, 6, 8, 9]) == [(1, 5, 2), (3, 8, 2)]
    assert group_contiguous_runs([1, 2, 4, 5], [5, 6, 7, 8]) == [(1, 5, 2), (4, 7, 2)]
    # A descending list is all single-page runs.
    assert group_contiguous_runs([3, 2, 1], [1, 2, 3]) == [(3, 1, 1), (2, 2, 1), (1, 3, 1)]
    with pytest.raises(ValueError, match="dst_pages"):
        group_contiguous_runs([1, 2], [1])


def test_group_runs_matches_a_plain_loop_on_random_lists():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 200))
        src = rng.permutation(np.arange(1, 400))[:n]
        src[: n // 2] = np.sort(src[: n // 2])   # half sorted: long runs appear too
        dst = rng.permutation(np.arange(1, 400))[:n]
        dst[: n // 3] = np.arange(50, 50 + n // 3)
        expected, i = [], 0
        while i < n:
            j = i
            while j + 1 < n and src[j + 1] == src[j] + 1 and dst[j + 1] == dst[j] + 1:
                j += 1
            expected.append((int(src[i]), int(dst[i]), j - i + 1))
            i = j + 1
        assert group_contiguous_runs(src, dst) == expected


class _Pool:
    """A numpy-backed KV pool: ``buffers`` arrays of [L, P, bytes_per_page] (or [P, L, ...])."""

    def __init__(self, kind, num_buffers, num_layers, num_pages, bytes_per_page, shards, fill):
        shape = (num_layers, num_pages) if kind == "layer_major" else (num_pages, num_layers)
        self.kind = kind
        self.arrays = [[np.zeros(shape + (bytes_per_page,), np.uint8) for _ in range(shards)]
                       for _ in range(num_buffers)]
        rng = np.random.default_rng(num_pages)
        if fill:
            for bufs in self.arrays:
                for a in bufs:
                    a[...] = rng.integers(1, 256, a.shape, dtype=np.uint8)
        self.layout = KVLayout(kind, tuple(
            KVBufferDesc(tuple(a.ctypes.data for a in bufs), num_layers, num_pages,
                         bytes_per_page) for bufs in self.arrays))

    def page(self, b, s, layer, page):
        a = self.arrays[b][s]
        return a[layer, page] if self.kind == "layer_major" else a[page, layer]


@pytest.mark.parametrize("kind", ["layer_major", "page_major"])
def test_shuffled_pages_copy_counts_bytes_and_contents(kind):
    L, B, S, BPP = 3, 2, 2, 48
    src = _Pool(kind, B, L, 40, BPP, S, fill=True)
    dst = _Pool(kind, B, L, 64, BPP, S, fill=False)   # pools of different sizes pair fine
    rng = np.random.default_rng(7)
    n = 25

    def page_list(pool_pages, stretches):
        fixed = [p for lo, hi in stretches for p in range(lo, hi)]
        rest = rng.permutation(sorted(set(range(1, pool_pages)) - set(fixed)))
        return np.concatenate([fixed, rest[: n - len(fixed)]]).astype(np.int64)

    # Two stretches contiguous on both sides, then a shuffled (fragmented) tail.
    src_pages = page_list(40, [(1, 6), (30, 37)])
    dst_pages = page_list(64, [(10, 15), (50, 57)])
    assert len(set(src_pages)) == n and len(set(dst_pages)) == n

    runs = group_contiguous_runs(src_pages, dst_pages)
    copies = build_copies(src.layout, dst.layout, src_pages, dst_pages)
    per_run = L if kind == "layer_major" else 1
    assert len(copies) == len(runs) * per_run * B * S
    assert len(runs) < n                              # the stretches merged
    assert sum(c[2] for c in copies) == n * BPP * L * B * S
    for s_addr, d_addr, length in copies:
        ctypes.memmove(d_addr, s_addr, length)
    for b in range(B):
        for s in range(S):
            for layer in range(L):
                written = set()
                for sp, dp in zip(src_pages, dst_pages):
                    np.testing.assert_array_equal(dst.page(b, s, layer, dp),
                                                  src.page(b, s, layer, sp))
                    written.add(int(dp))
                for p in set(range(64)) - written:
                    assert not dst.page(b, s, layer, p).any()


def test_layer_major_copy_addresses():
    lay_src = KVLayout("layer_major", (KVBufferDesc((1000,), 2, 10, 8),))
    lay_dst = KVLayout("layer_major", (KVBufferDesc((50000,), 2, 20, 8),))
    copies = build_copies(lay_src, lay_dst, [3, 4, 7], [11, 12, 2])
    assert copies == [
        (1000 + 3 * 8, 50000 + 11 * 8, 16), (1000 + 7 * 8, 50000 + 2 * 8, 8),          # layer 0
        (1000 + (10 + 3) * 8, 50000 + (20 + 11) * 8, 16),                               # layer 1
        (1000 + (10 + 7) * 8, 50000 + (20 + 2) * 8, 8),
    ]
    assert lay_dst.page_addr(0, 0, 1, 2) == 50000 + (20 + 2) * 8


def test_dst_pages_are_range_checked_against_the_registered_pool():
    src = KVLayout("layer_major", (KVBufferDesc((4096,), 2, 100, 64),))
    dst = KVLayout("layer_major", (KVBufferDesc((1 << 30,), 2, 10, 64),))
    with pytest.raises(ProtocolError, match=r"'dst_pages': page index 10 outside \[1, 10\)"):
        build_copies(src, dst, [1, 2], [9, 10])
    with pytest.raises(ProtocolError, match="'dst_pages': page index 0"):
        build_copies(src, dst, [1, 2], [0, 1])
    with pytest.raises(ProtocolError, match="'dst_pages': duplicate"):
        build_copies(src, dst, [1, 2], [3, 3])
    with pytest.raises(ProtocolError, match="'src_pages': page index 100"):
        build_copies(src, dst, [100], [3])
    with pytest.raises(ValueError, match="dst_pages: length"):
        build_copies(src, dst, [1, 2], [3])
    assert build_copies(src, dst, [], []) == []


def test_incompatible_layouts_are_refused():
    a = KVLayout("layer_major", (KVBufferDesc((4096,), 2, 10, 64),))
    with pytest.raises(ValueError, match="bytes_per_page"):
        build_copies(a, KVLayout("layer_major", (KVBufferDesc((4096,), 2, 10, 32),)), [1], [1])
    with pytest.raises(ValueError, match="num_layers"):
        build_copies(a, KVLayout("layer_major", (KVBufferDesc((4096,), 3, 10, 64),)), [1], [1])
    with pytest.raises(ValueError, match="kv_layout"):
        build_copies(a, KVLayout("page_major", (KVBufferDesc((4096,), 2, 10, 64),)), [1], [1])
    with pytest.raises(ValueError, match="num_heads"):
        build_copies(a, KVLayout("layer_major", (KVBufferDesc((4096, 8192), 2, 10, 64,
                                                              num_heads=2,
                                                              shard_heads=((0, 1), (1, 1))),)),
                     [1], [1])
    with pytest.raises(ValueError, match="num_pages differs"):
        KVLayout("layer_major", (KVBufferDesc((4096,), 2, 10, 64),
                                 KVBufferDesc((9999,), 2, 11, 64)))


def test_regions_cover_each_shard():
    lay = KVLayout("layer_major", (KVBufferDesc((4096, 1 << 20), 2, 10, 64),
                                   KVBufferDesc((1 << 22,), 3, 10, 32)))
    assert lay.regions() == [(4096, 1280), (1 << 20, 1280), (1 << 22, 960)]
    assert lay.total_bytes() == 1280 * 2 + 960


def test_register_kv_layout_labels_and_rolls_back():
    from pdjax.transfer.fake import FakeTransferEngine
    from pdjax.transfer.kv_copies import register_kv_layout, unregister_kv_layout

    eng = FakeTransferEngine(check_sources=True)
    lay = KVLayout("layer_major", (KVBufferDesc((4096, 1 << 20), 2, 10, 64),))
    register_kv_layout(eng, lay)
    assert [(r.addr, r.length, r.label) for r in eng.registered_regions()] == [
        (4096, 1280, "kv"), (1 << 20, 1280, "kv")]
    unregister_kv_layout(eng, lay)
    assert eng.registered_regions() == []
    # The second shard overlaps the first: nothing stays registered.
    bad = KVLayout("layer_major", (KVBufferDesc((4096, 4096 + 640), 2, 10, 64),))
    with pytest.raises(ValueError, match="overlaps"):
        register_kv_layout(eng, bad)
    assert eng.registered_regions() == []
