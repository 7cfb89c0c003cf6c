"""MetadataBuffers: row layout, slot pool, zeroing before reuse, peer copies."""

import ctypes

import numpy as np
import pytest

from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.metadata import MetadataBuffers, MetadataRow


def test_row_layout_is_padded_and_aligned():
    m = MetadataBuffers(8, max_top_logprobs=3)
    assert m.bytes_per_slot == 64 and m.max_top_logprobs == 3      # 24 + 16 + 8*3 = 64
    assert m.base_addr % 64 == 0
    assert m.slot_addr(3) == m.base_addr + 3 * 64
    assert m.nbytes == 8 * 64
    m20 = MetadataBuffers(2)
    assert m20.bytes_per_slot == 256 and m20.max_top_logprobs == 27  # 40 + 8*27 = 256
    assert MetadataBuffers(1, 0).bytes_per_slot == 64
    # Equal bytes_per_slot means equal offsets, whatever K was asked for.
    assert MetadataBuffers(1, 4).dtype == MetadataBuffers(1, 5).dtype


def test_write_read_round_trip_and_field_offsets():
    m = MetadataBuffers(4, max_top_logprobs=4)
    slot = m.alloc()
    digest = bytes(range(100, 116))
    m.write(slot, bootstrap_room=(1 << 63) + 5, output_token_id=31999, cached_tokens=48,
            output_token_logprob=-0.25, top_logprob_ids=[7, 8, 9],
            top_logprob_vals=[-0.25, -1.5, -3.0], prompt_digest=digest)
    assert m.read(slot) == MetadataRow((1 << 63) + 5, 31999, 48, -0.25, (7, 8, 9),
                                       (-0.25, -1.5, -3.0), digest)
    assert m.room(slot) == (1 << 63) + 5
    raw = ctypes.string_at(m.slot_addr(slot), m.bytes_per_slot)
    assert int.from_bytes(raw[0:8], "little") == (1 << 63) + 5
    assert int.from_bytes(raw[8:12], "little") == 31999
    assert int.from_bytes(raw[12:16], "little") == 48
    assert np.frombuffer(raw[16:20], "<f4")[0] == -0.25
    assert int.from_bytes(raw[20:24], "little") == 3
    assert raw[24:40] == digest
    assert np.frombuffer(raw[40:52], "<i4").tolist() == [7, 8, 9]


def test_slots_are_zeroed_before_reuse():
    m = MetadataBuffers(2, max_top_logprobs=2)
    a, b = m.alloc(), m.alloc()
    assert (a, b) == (0, 1) and m.alloc() is None and m.num_free == 0
    m.write(a, 11, 5, 1, -1.0, [1, 2], [-1.0, -2.0])
    m.write(b, 12, 6)
    m.free(a)
    assert m.room(a) == 0
    assert not np.frombuffer(ctypes.string_at(m.slot_addr(a), 64), np.uint8).any()
    assert m.room(b) == 12                                   # the neighbour is untouched
    # A late write into a freed slot (e.g. a straggling transfer) is wiped on alloc.
    m.write(a, 99, 1)
    again = m.alloc()
    assert again == a and m.room(again) == 0 and m.read(again).output_token_id == 0
    m.free(b)
    with pytest.raises(ValueError, match="double free"):
        m.free(b)


def test_bad_arguments():
    m = MetadataBuffers(2, 2)
    with pytest.raises(ValueError, match="slot"):
        m.read(2)
    with pytest.raises(ValueError, match="slot"):
        m.write(-1, 5, 1)
    with pytest.raises(ValueError, match="bootstrap_room"):
        m.write(0, 0, 1)
    with pytest.raises(ValueError, match="max_top_logprobs"):
        m.write(0, 5, 1, top_logprob_ids=list(range(6)), top_logprob_vals=[0.0] * 6)
    with pytest.raises(ValueError, match="top_logprob_vals"):
        m.write(0, 5, 1, top_logprob_ids=[1], top_logprob_vals=[])
    with pytest.raises(ValueError, match="num_slots"):
        MetadataBuffers(0)
    m.rows["num_top_logprobs"][1] = 1000                     # a corrupt row
    with pytest.raises(ValueError, match="num_top_logprobs"):
        m.read(1)


def test_copy_to_a_peer_slot():
    src, dst = MetadataBuffers(4, 3), MetadataBuffers(8, 3)
    s = src.alloc()
    src.write(s, 77, 123, 16, -0.5, [1], [-0.5])
    d = 6
    copy = src.copy_to(s, dst.base_addr, d, dst.num_slots, dst.bytes_per_slot)
    assert copy == (src.slot_addr(s), dst.slot_addr(d), 64)
    ctypes.memmove(copy[1], copy[0], copy[2])
    assert dst.read(d) == src.read(s)
    with pytest.raises(ValueError, match="dst_slot"):
        src.copy_to(s, dst.base_addr, 8, dst.num_slots, dst.bytes_per_slot)
    with pytest.raises(ValueError, match="dst_bytes_per_slot"):
        src.copy_to(s, dst.base_addr, 1, dst.num_slots, 128)


def test_register_with_an_engine():
    m = MetadataBuffers(4)
    eng = FakeTransferEngine(check_sources=True)
    m.register(eng)
    (region,) = eng.registered_regions()
    assert (region.addr, region.length, region.label) == (m.base_addr, m.nbytes, "metadata")
    m.unregister(eng)
    assert eng.registered_regions() == []
