"""PD between different TP sizes: head ranges per shard, the head-slice plan, and the copies it
builds (pure Python + numpy; bytes moved with ctypes.memmove, checked against numpy slicing)."""

import ctypes

import msgpack
import numpy as np
import pytest

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import ProtocolError, RegisterDecode, decode_message
from pdjax.transfer.kv_copies import HeadSlice, KVLayout, build_copies, plan_head_slices

L, PAGES, PS, D = 2, 12, 4, 3          # layers, pool pages, page_size, head_dim (bytes: uint8)


class _TPPool:
    """One KV kind ``[L, PAGES, PS, H, D]`` (uint8) split over ``tp`` shards by heads, with
    ``tp_model_config``'s replication when ``tp > H`` (each shard then holds one head)."""

    def __init__(self, heads: int, tp: int, kind: str = "layer_major", fill: bool = True,
                 num_pages: int = PAGES, seed: int = 0):
        self.heads, self.tp, self.kind = heads, tp, kind
        rng = np.random.default_rng(seed)
        full = rng.integers(1, 256, (L, num_pages, PS, heads, D), dtype=np.uint8) if fill \
            else np.zeros((L, num_pages, PS, heads, D), np.uint8)
        if tp > heads:
            ranges = [(s // (tp // heads), 1) for s in range(tp)]
        else:
            ranges = [(s * heads // tp, heads // tp) for s in range(tp)]
        self.shards = []
        for start, count in ranges:
            part = np.ascontiguousarray(full[:, :, :, start:start + count])
            if kind == "page_major":
                part = np.ascontiguousarray(part.transpose(1, 0, 2, 3, 4))
            self.shards.append(part)
        self.desc = KVBufferDesc(tuple(a.ctypes.data for a in self.shards), L, num_pages,
                                 PS * ranges[0][1] * D, num_heads=heads,
                                 shard_heads=tuple(ranges), head_bytes=D)
        self.layout = KVLayout(kind, (self.desc,))
        self.ranges = ranges

    def head(self, shard: int, page: int, h: int) -> np.ndarray:
        """``[L, PS, D]`` of logical head ``h`` in ``page`` of one shard."""
        a = self.shards[shard]
        a = a if self.kind == "layer_major" else a.transpose(1, 0, 2, 3, 4)
        start, _ = self.ranges[shard]
        return a[:, page, :, h - start]


@pytest.mark.parametrize("kind", ["layer_major", "page_major"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [
    (2, 2, 1), (2, 1, 2), (2, 1, 1), (2, 2, 2), (4, 4, 2), (4, 2, 4), (1, 1, 2), (1, 2, 1),
    (2, 1, 4), (2, 4, 2)])
def test_head_slices_move_every_head_of_every_page(kind, heads, src_tp, dst_tp):
    src = _TPPool(heads, src_tp, kind, fill=True)
    dst = _TPPool(heads, dst_tp, kind, fill=False, num_pages=PAGES + 5)
    src_pages = [3, 4, 5, 9, 1]
    dst_pages = [7, 8, 9, 2, 14]
    copies = build_copies(src.layout, dst.layout, src_pages, dst_pages)
    for s_addr, d_addr, length in copies:
        ctypes.memmove(d_addr, s_addr, length)
    for d, (start, count) in enumerate(dst.ranges):
        for h in range(start, start + count):
            s = next(i for i, (a, c) in enumerate(src.ranges) if a <= h < a + c)
            for sp, dp in zip(src_pages, dst_pages):
                np.testing.assert_array_equal(dst.head(d, dp, h), src.head(s, sp, h))
    untouched = set(range(PAGES + 5)) - set(dst_pages)
    for shard in dst.shards:
        pages = shard if kind == "layer_major" else shard.transpose(1, 0, 2, 3, 4)
        assert not pages[:, sorted(untouched)].any()
    # Bytes: pages x bytes_per_page x layers over the destination shards.
    assert sum(c[2] for c in copies) == len(src_pages) * dst.desc.bytes_per_page * L * dst_tp


def test_plan_for_the_tiny_llama_pairs():
    """KV heads 2: TP 2 -> TP 1 reads head 0 from shard 0 and head 1 from shard 1 into one
    shard (strided); TP 1 -> TP 2 cuts one shard into two; equal splits copy whole pages."""
    tp1, tp2 = _TPPool(2, 1).layout, _TPPool(2, 2).layout
    assert plan_head_slices(tp2, tp1) == [[HeadSlice(0, 0, 0, 0, 1, False),
                                           HeadSlice(1, 0, 0, 1, 1, False)]]
    assert plan_head_slices(tp1, tp2) == [[HeadSlice(0, 0, 0, 0, 1, False),
                                           HeadSlice(0, 1, 1, 0, 1, False)]]
    assert plan_head_slices(tp2, tp2) == [[HeadSlice(0, 0, 0, 0, 1, True),
                                           HeadSlice(1, 1, 0, 0, 1, True)]]
    # Copy ops: whole slices are one per run per layer; strided ones one per page, layer, token.
    pages_src, pages_dst = [1, 2, 3, 7], [4, 5, 6, 9]                 # 2 runs, 4 pages
    assert len(build_copies(tp2, tp2, pages_src, pages_dst)) == 2 * 2 * L
    assert len(build_copies(tp2, tp1, pages_src, pages_dst)) == 2 * 4 * L * PS
    assert len(build_copies(tp1, tp2, pages_src, pages_dst)) == 2 * 4 * L * PS


def test_replicated_heads_read_each_replica_once_and_fill_every_copy():
    """One KV head at TP 2 (``tp_model_config`` replicates it; an MLA latent is the same
    shape of rule): the TP 1 decode reads shard 0; a TP 2 decode is written on both shards,
    each from its own source replica, as whole pages."""
    one, two = _TPPool(1, 1).layout, _TPPool(1, 2).layout
    assert plan_head_slices(two, one) == [[HeadSlice(0, 0, 0, 0, 1, True)]]
    assert plan_head_slices(one, two) == [[HeadSlice(0, 0, 0, 0, 1, True),
                                           HeadSlice(0, 1, 0, 0, 1, True)]]
    assert plan_head_slices(two, two) == [[HeadSlice(0, 0, 0, 0, 1, True),
                                           HeadSlice(1, 1, 0, 0, 1, True)]]
    # KV heads 2 at TP 4 (each head twice) -> TP 2: shard d reads the replica d % 2 of its head.
    assert plan_head_slices(_TPPool(2, 4).layout, _TPPool(2, 2).layout) == [
        [HeadSlice(0, 0, 0, 0, 1, True), HeadSlice(3, 1, 0, 0, 1, True)]]


def test_layouts_that_cannot_be_mapped_fail_at_planning():
    tp1 = _TPPool(2, 1).layout
    with pytest.raises(ValueError, match="num_heads: 2 != 4"):
        plan_head_slices(tp1, _TPPool(4, 2).layout)
    other_dim = KVLayout("layer_major", (KVBufferDesc((4096,), L, PAGES, PS * 2 * 4, num_heads=2,
                                                      head_bytes=4),))
    with pytest.raises(ValueError, match="bytes_per_page: 24 != 32"):
        plan_head_slices(tp1, other_dim)
    with pytest.raises(ValueError, match="head_bytes: 3 != 4"):
        plan_head_slices(_TPPool(2, 2).layout, other_dim)
    # A source that holds only head 0 (half a pool) cannot fill a decode that needs head 1.
    half = KVLayout("layer_major", (KVBufferDesc((4096,), L, PAGES, PS * D, num_heads=2,
                                                 shard_heads=((0, 1),), head_bytes=D),))
    with pytest.raises(ValueError, match="destination shard 0 holds head 1, which no source"):
        plan_head_slices(half, tp1)
    with pytest.raises(ValueError, match="kv_layout"):
        plan_head_slices(tp1, _TPPool(2, 1, kind="page_major").layout)


def test_head_fields_are_validated_and_round_trip():
    desc = _TPPool(2, 2).desc
    back = KVBufferDesc.from_wire("kv_buffers[0]", msgpack.unpackb(msgpack.packb(desc.to_wire())))
    assert back == desc and back.shard_heads == ((0, 1), (1, 1)) and back.tokens_per_page == PS
    msg = RegisterDecode(decode_engine_id="d", reply_endpoint="tcp://127.0.0.1:5000",
                         engine_session_id="127.0.0.1:1", tp_rank=0, tp_size=1,
                         kv_buffers=(desc,), kv_layout="layer_major", metadata_addr=1 << 20,
                         metadata_bytes_per_slot=192, metadata_num_slots=8, page_size=PS,
                         kv_dtype="uint8", layout_fingerprint="ab")
    assert decode_message(msg.encode()).kv_buffers == (desc,)
    base = desc.to_wire()
    for over, field in [
            ({"shard_heads": [[0, 1]]}, "one [start, count] per shard"),
            ({"shard_heads": [[0, 1], [2, 1]]}, "shard_heads[1].start"),
            ({"shard_heads": [[0, 1], [1, 2]]}, "shard_heads[1].count"),
            ({"shard_heads": [[0, 2], [1, 1]]}, "different head counts"),
            ({"shard_heads": [[0, 1], 7]}, "shard_heads[1]"),
            ({"shard_heads": "x"}, "shard_heads"),
            ({"num_heads": 0}, "num_heads"),
            ({"head_bytes": 5}, "head_bytes")]:
        with pytest.raises(ProtocolError, match=field.replace("[", r"\[")):
            KVBufferDesc.from_wire("kv_buffers[0]", dict(base, **over))
