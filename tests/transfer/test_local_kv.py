"""``LocalKV`` (``pdjax/transfer/local_kv.py``) without processes: the staging path's round
trip through registered mirrors and the direct path's addresses; a pool goes direct only where
every compiled step updates it in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pdjax.models.loader import make_mesh
from pdjax.sched.buckets import BucketKey
from pdjax.transfer.fake import FakeTransferEngine
from pdjax.transfer.local_kv import LocalKV
from pd_fakes import KVRunner as _Runner

PS = 4


def test_staging_path_round_trip_and_direct_addresses():
    shape = (2, 9, PS, 2, 8)                       # [layers, pages, page_size, heads, dim]
    src, dst = _Runner(shape), _Runner(shape)
    dst.caches = {s.name: jnp.zeros(s.shape) for s in dst.cache_specs}
    engine = FakeTransferEngine()
    out = LocalKV(src, engine, "staging", max_pages_per_seq=4)
    into = LocalKV(dst, FakeTransferEngine(), "staging", max_pages_per_seq=4)
    assert out.mode == into.mode == "staging"
    # The mirrors are rows of 2 heads: a staging side pairs with a direct side head by head.
    assert [(d.num_heads, d.head_bytes) for d in out.layout.buffers] == [(2, 8 * 4)] * 2
    assert out.bytes_per_page == 2 * 2 * PS * 2 * 8 * 4 and out.num_layer_buffers == 4
    out.warmup()
    into.warmup()
    pages_src, pages_dst = [3, 5, 6], [8, 1, 2]
    out.stage_out(pages_src)
    # What the transfer engine would do: copy page by page between the registered mirrors.
    for m_src, m_dst in zip(out.mirrors, into.mirrors):
        m_dst[:, pages_dst] = m_src[:, pages_src]
    into.stage_in(pages_dst)
    for name in ("k_cache", "v_cache"):
        a, b = src.caches[name], dst.caches[name]
        np.testing.assert_array_equal(np.asarray(b)[:, pages_dst], np.asarray(a)[:, pages_src])
        untouched = [p for p in range(1, 9) if p not in pages_dst]
        assert not np.asarray(b)[:, untouched].any()
    # The registered regions are the mirrors, labelled "kv".
    regions = {r.addr: r for r in engine.registered_regions()}
    assert {int(m.ctypes.data) for m in out.mirrors} <= set(regions)
    assert all(regions[int(m.ctypes.data)].label == "kv" for m in out.mirrors)
    direct = LocalKV(_Runner(shape), FakeTransferEngine(), "auto")
    assert direct.mode == "direct" and not direct.check_addresses()
    with pytest.raises(ValueError, match="transfer path"):
        LocalKV(_Runner(shape), FakeTransferEngine(), "rdma")


def test_a_pool_peers_touch_takes_the_direct_path_only_where_steps_update_it_in_place():
    """Pages a peer writes during a step that copies the pool are lost, and pages a peer reads
    during a step that uses the pool as scratch are garbage (``runner/pool_copy``): a pool goes
    direct only when no bucket copies it, on the decode and on the prefill alike (a prefill
    sends a chunk while the next one computes: with FP8 KV on CPU the decode got wrong tokens
    or 0s when the prefill's pool went direct)."""
    shape = (2, 9, PS, 2, 8)
    clean = _Runner(shape)
    assert LocalKV(clean, FakeTransferEngine(), "auto").mode == "direct"
    assert clean.in_place_kv_required
    copying = _Runner(shape)
    copying.kv_copying = {BucketKey("decode", 1, 1, 64): "2630280 B of temporaries"}
    with pytest.raises(ValueError, match=r"not updated in place by 1 bucket.*decode"):
        LocalKV(copying, FakeTransferEngine(), "direct")
    staged = LocalKV(copying, FakeTransferEngine(), "auto")
    assert staged.mode == "staging" and not copying.in_place_kv_required
    # Two shards cannot stage: the error says why direct was refused.
    two = _Runner(shape)
    two.kv_copying = dict(copying.kv_copying)
    heads = NamedSharding(make_mesh(2), PartitionSpec(None, None, None, "tp", None))
    two.caches = {k: jax.device_put(v, heads) for k, v in two.caches.items()}
    assert len(two.caches["k_cache"].addressable_shards) == 2
    with pytest.raises(ValueError, match="one shard.*not updated in place"):
        LocalKV(two, FakeTransferEngine(), "auto")


