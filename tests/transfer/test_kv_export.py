"""kv_export on real JAX CPU arrays: shard addresses, page addresses, fingerprints, and Mooncake
writes straight into a JAX array's buffer, read back through JAX."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.transfer.kv_copies import (build_copies, plan_head_slices, register_kv_layout,
                                      unregister_kv_layout)
from pdjax.transfer.kv_export import (AddressChange, changed_addresses, export_kv_layout,
                                      kv_layout_fingerprint, shard_addresses)

L, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 3, 24, 4, 2, 8
SHAPE = (L, PAGES, PAGE_SIZE, HEADS, HEAD_DIM)
BPP = PAGE_SIZE * HEADS * HEAD_DIM * 2                     # bf16


def _kv(seed, shape=SHAPE):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def _head_sharded(x, n=2):
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    return jax.device_put(x, NamedSharding(mesh, P(None, None, None, "tp", *[None] * (x.ndim - 4))))


def _rows(x):
    """``[.., heads, head_dim]`` as the engine's GQA rows ``[.., heads * head_dim]``."""
    return x.reshape(*x.shape[:3], -1)


def _assert_pages_copied(srcs, dsts, src_pages, dst_pages):
    """Read through jitted JAX: each ``dsts[i][:, dst_pages]`` equals ``srcs[i][:, src_pages]``
    and every other page of ``dsts[i]`` is still zero."""
    gather = jax.jit(lambda c, idx: c[:, idx])
    for s, d in zip(srcs, dsts, strict=True):
        np.testing.assert_array_equal(np.asarray(gather(d, dst_pages)),
                                      np.asarray(gather(s, src_pages)))
        untouched = np.setdiff1d(np.arange(d.shape[1]), dst_pages)
        assert float(jnp.abs(d[:, untouched].astype(jnp.float32)).sum()) == 0.0


def test_export_single_device_addresses():
    k, v = _kv(0), _kv(1)
    layout = export_kv_layout([k, v])
    assert layout.kind == "layer_major" and layout.num_pages == PAGES
    for arr, desc in zip((k, v), layout.buffers):
        assert desc.shard_addrs == (arr.unsafe_buffer_pointer(),)
        assert (desc.num_layers, desc.num_pages, desc.bytes_per_page) == (L, PAGES, BPP)
    # page_addr points at the bytes of k[l, p] (np.asarray of a CPU array is zero-copy).
    host = np.asarray(k)
    assert host.ctypes.data == k.unsafe_buffer_pointer()
    for layer, page in [(0, 0), (1, 5), (2, PAGES - 1)]:
        addr = layout.page_addr(0, 0, layer, page)
        assert ctypes.string_at(addr, BPP) == host[layer, page].tobytes()
    assert layout.regions() == [(k.unsafe_buffer_pointer(), k.nbytes),
                                (v.unsafe_buffer_pointer(), v.nbytes)]


def test_export_page_major():
    x = _kv(2, (PAGES, L, PAGE_SIZE, HEADS, HEAD_DIM))
    layout = export_kv_layout([x], kind="page_major")
    desc = layout.buffers[0]
    assert (desc.num_layers, desc.num_pages, desc.bytes_per_page) == (L, PAGES, BPP)
    assert ctypes.string_at(layout.page_addr(0, 0, 2, 7), BPP) == np.asarray(x)[7, 2].tobytes()


def test_export_head_sharded_array_has_one_address_per_shard():
    assert len(jax.devices()) >= 2, "tests/conftest.py sets 4 simulated CPU devices"
    x = _head_sharded(_kv(3))
    layout = export_kv_layout([x])
    desc = layout.buffers[0]
    shards = sorted(x.addressable_shards, key=lambda s: s.index[3].start or 0)
    assert desc.shard_addrs == tuple(s.data.unsafe_buffer_pointer() for s in shards)
    assert len(set(desc.shard_addrs)) == 2
    assert desc.bytes_per_page == BPP // 2
    # Shard 1 holds head 1: its page bytes are x[l, p, :, 1:2, :].
    got = ctypes.string_at(layout.page_addr(0, 1, 1, 4), BPP // 2)
    assert got == np.asarray(x)[1, 4, :, 1:2, :].tobytes()


def test_export_waits_for_a_buffer_still_being_computed():
    # A jitted result is handed out before the device has written it; an address taken then
    # and read raw (as the transfer engine reads it) saw allocator garbage (CI, stop 17).
    @jax.jit
    def make(a):
        for _ in range(20):
            a = jnp.tanh(a @ a)
        return a[:128].reshape(L, 16, 16, 2, 64) + 1.0

    a = jnp.full((768, 768), 1e-3, jnp.float32)
    for i in range(8):
        x = make(a + i)
        layout = export_kv_layout([x])
        got = ctypes.string_at(layout.page_addr(0, 0, 1, 4), 16 * 2 * 64 * 4)
        assert got == np.asarray(x)[1, 4].tobytes(), f"iteration {i}"


def test_export_rejects_page_sharding_and_donated_arrays():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    by_pages = jax.device_put(_kv(4), NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(ValueError, match=r"arrays\[0\]: sharded over its layer/page"):
        export_kv_layout([by_pages])
    with pytest.raises(ValueError, match="3 dims"):
        export_kv_layout([jnp.zeros((4, 4))])
    x = _kv(5)
    jax.jit(lambda c: c + 1, donate_argnums=0)(x)
    with pytest.raises(ValueError, match="cannot read its buffer address"):
        export_kv_layout([x])
    with pytest.raises(ValueError, match="kind"):
        export_kv_layout([_kv(6)], kind="token_major")


def test_fingerprint_ignores_pool_size_only():
    base = kv_layout_fingerprint([_kv(0)])
    assert kv_layout_fingerprint([jnp.zeros((L, 7) + SHAPE[2:], jnp.bfloat16)]) == base
    assert kv_layout_fingerprint([_kv(0).astype(jnp.float32)]) != base
    assert kv_layout_fingerprint([jnp.zeros((L, PAGES, 8, HEADS, HEAD_DIM // 2), jnp.bfloat16)]) \
        != base
    assert kv_layout_fingerprint([jnp.zeros((L + 1,) + SHAPE[1:], jnp.bfloat16)]) != base
    assert kv_layout_fingerprint([_kv(0), _kv(1)]) != base
    # TP-independent: a head split pairs, the head mapping is checked by the plan;
    # tp_model_config's replicated heads count as the checkpoint's.
    assert kv_layout_fingerprint([_head_sharded(_kv(0))]) == base
    four = jnp.zeros((L, PAGES, PAGE_SIZE, 2 * HEADS, HEAD_DIM), jnp.bfloat16)
    assert kv_layout_fingerprint([four]) != base
    assert kv_layout_fingerprint([four], head_repeat=2) == base
    # Rows of heads are the same memory, so the same fingerprint; read as one head they differ.
    assert kv_layout_fingerprint([_rows(_kv(0))], row_heads=[HEADS]) == base
    assert kv_layout_fingerprint([_head_sharded(_rows(_kv(0)))], row_heads=[HEADS]) == base
    assert kv_layout_fingerprint([_rows(four)], head_repeat=2, row_heads=[2 * HEADS]) == base
    assert kv_layout_fingerprint([_rows(_kv(0))]) != base
    assert len(base) == 16


def test_changed_addresses_reports_moves():
    k = _kv(0)
    layout = export_kv_layout([k])
    assert changed_addresses([k], layout) == []
    moved = _kv(0) + 0    # a different buffer with the same contents
    assert changed_addresses([moved], layout) == [
        AddressChange(0, 0, k.unsafe_buffer_pointer(), moved.unsafe_buffer_pointer())]
    with pytest.raises(ValueError, match="arrays"):
        changed_addresses([k, k], layout)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "head_sharded"])
def test_mooncake_writes_into_jax_arrays_and_jax_sees_them(mooncake_pair, sharded):
    """Prefill KV (JAX) -> decode KV (JAX) by Mooncake, checked through jitted JAX reads.

    Also pins what this jax version does on CPU: a donated step keeps the buffer address, so
    a second transfer after the step lands in the step's output array.
    """
    a, b = mooncake_pair
    place = _head_sharded if sharded else (lambda x: x)
    src_k, src_v = place(_kv(10)), place(_kv(11))
    dst_k = place(jnp.zeros((L, 40) + SHAPE[2:], jnp.bfloat16))
    dst_v = place(jnp.zeros((L, 40) + SHAPE[2:], jnp.bfloat16))
    src_layout, dst_layout = export_kv_layout([src_k, src_v]), export_kv_layout([dst_k, dst_v])
    register_kv_layout(a, src_layout)
    register_kv_layout(b, dst_layout)
    try:
        src_pages = np.array([3, 4, 5, 9, 1, 20, 21])
        dst_pages = np.array([30, 31, 2, 3, 17, 18, 39])
        copies = build_copies(src_layout, dst_layout, src_pages, dst_pages)
        shards = 2 if sharded else 1
        # runs: (3,30,2) (5,2,1) (9,3,1) (1,17,1) (20,18,1) (21,39,1) -> 6
        assert len(copies) == 6 * L * 2 * shards
        a.batch_write(b.session_id, copies)
        _assert_pages_copied([src_k, src_v], [dst_k, dst_v], src_pages, dst_pages)

        # A donated in-place step on the decode cache (writes the null page only).
        step = jax.jit(lambda c: c.at[:, 0].set(1), donate_argnums=0)
        new_k = step(dst_k)
        assert changed_addresses([new_k, dst_v], dst_layout) == []
        more = build_copies(src_layout, dst_layout, [7], [25])
        a.batch_write(b.session_id, more)
        np.testing.assert_array_equal(np.asarray(new_k[:, 25]), np.asarray(src_k[:, 7]))
        np.testing.assert_array_equal(np.asarray(new_k[:, 30]), np.asarray(src_k[:, 3]))
    finally:
        unregister_kv_layout(a, src_layout)
        unregister_kv_layout(b, dst_layout)


def test_shard_addresses_order_follows_the_global_index():
    x = _head_sharded(_kv(12))
    addrs = shard_addresses(x)
    by_index = {(s.index[3].start or 0): s.data.unsafe_buffer_pointer()
                for s in x.addressable_shards}
    assert addrs == (by_index[0], by_index[1])


def test_export_head_ranges_replication_and_unsharded_rows():
    """Shard head ranges from the sharding; tp_model_config's replicas (head_repeat) name the
    checkpoint's head; a buffer without heads (an MLA latent) is one head on every shard."""
    x = _head_sharded(_kv(13))
    desc = export_kv_layout([x]).buffers[0]
    assert (desc.num_heads, desc.shard_heads, desc.head_bytes) == (2, ((0, 1), (1, 1)),
                                                                    HEAD_DIM * 2)
    assert export_kv_layout([_kv(13)]).buffers[0].shard_heads == ((0, 2),)
    # One checkpoint head repeated twice (KV heads 1 at TP 2): both shards hold head 0.
    rep = _head_sharded(jnp.zeros((L, PAGES, PAGE_SIZE, 2, HEAD_DIM), jnp.bfloat16))
    desc = export_kv_layout([rep], head_repeat=2).buffers[0]
    assert (desc.num_heads, desc.shard_heads) == (1, ((0, 1), (0, 1)))
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    latent = jax.device_put(jnp.zeros((L, PAGES, PAGE_SIZE, 40), jnp.bfloat16),
                            NamedSharding(mesh, P()))
    desc = export_kv_layout([latent]).buffers[0]
    assert (desc.num_heads, desc.shard_heads, desc.head_bytes) == (1, ((0, 1), (0, 1)), 80)
    # MLA rule: a replicated latent pairs across TP sizes as whole pages from one replica.
    single = export_kv_layout([jnp.zeros((L, PAGES, PAGE_SIZE, 40), jnp.bfloat16)])
    assert [[(h.src_shard, h.whole) for h in b] for b in
            plan_head_slices(export_kv_layout([latent]), single)] == [[(0, True)]]
    assert [[(h.src_shard, h.dst_shard, h.whole) for h in b] for b in
            plan_head_slices(single, export_kv_layout([latent]))] == [[(0, 0, True),
                                                                      (0, 1, True)]]
    by_row = jax.device_put(latent, NamedSharding(mesh, P(None, None, None, "tp")))
    with pytest.raises(ValueError, match=r"arrays\[0\]: sharded over dimension 3"):
        export_kv_layout([by_row])
    by_dim = jax.device_put(_kv(14), NamedSharding(mesh, P(None, None, None, None, "tp")))
    with pytest.raises(ValueError, match=r"arrays\[0\]: sharded over dimension 4"):
        export_kv_layout([by_dim])


def test_export_rows_of_heads():
    """GQA rows ``[.., heads * head_dim]`` split between heads describe the same head ranges
    and bytes as ``[.., heads, head_dim]``; a split inside a head or a bad ``row_heads`` is
    refused, naming it."""
    for x, heads in ((_kv(15), None), (_rows(_kv(15)), [HEADS])):
        whole = export_kv_layout([x], row_heads=heads).buffers[0]
        split = export_kv_layout([_head_sharded(x)], row_heads=heads).buffers[0]
        assert (whole.num_heads, whole.shard_heads, whole.head_bytes) == (HEADS, ((0, 2),),
                                                                          HEAD_DIM * 2)
        assert (split.num_heads, split.shard_heads, split.head_bytes) == (HEADS,
                                                                          ((0, 1), (1, 1)),
                                                                          HEAD_DIM * 2)
    rep = _head_sharded(jnp.zeros((L, PAGES, PAGE_SIZE, 2 * HEAD_DIM), jnp.bfloat16))
    desc = export_kv_layout([rep], head_repeat=2, row_heads=[2]).buffers[0]
    assert (desc.num_heads, desc.shard_heads) == (1, ((0, 1), (0, 1)))
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    quarter = jax.device_put(_rows(_kv(16)), NamedSharding(mesh, P(None, None, None, "tp")))
    with pytest.raises(ValueError, match=r"arrays\[0\]: .* splits a head"):
        export_kv_layout([quarter], row_heads=[HEADS])
    with pytest.raises(ValueError, match="row_heads: 3 does not divide"):
        export_kv_layout([_rows(_kv(16))], row_heads=[3])
    with pytest.raises(ValueError, match="row_heads: 1 entries for 2 arrays"):
        export_kv_layout([_kv(16), _kv(17)], row_heads=[HEADS])


@pytest.mark.parametrize("rows", [False, True], ids=["heads", "rows"])
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_mooncake_moves_head_slices_between_tp_sizes(mooncake_pair, src_tp, dst_tp, rows):
    """Prefill TP ``src_tp`` -> decode TP ``dst_tp`` by Mooncake: the decode's arrays, read
    through JAX, equal the prefill's pages; one copy per page, layer, token and head slice.
    The same with the engine's GQA rows ``[.., heads * head_dim]``."""
    a, b = mooncake_pair
    view = _rows if rows else (lambda x: x)
    heads = [HEADS, HEADS] if rows else None
    place = {1: view, 2: lambda x: _head_sharded(view(x))}
    src_k, src_v = place[src_tp](_kv(20)), place[src_tp](_kv(21))
    dst_k = place[dst_tp](jnp.zeros((L, 40) + SHAPE[2:], jnp.bfloat16))
    dst_v = place[dst_tp](jnp.zeros((L, 40) + SHAPE[2:], jnp.bfloat16))
    src_layout = export_kv_layout([src_k, src_v], row_heads=heads)
    dst_layout = export_kv_layout([dst_k, dst_v], row_heads=heads)
    register_kv_layout(a, src_layout)
    register_kv_layout(b, dst_layout)
    try:
        src_pages, dst_pages = np.array([3, 4, 5, 9]), np.array([30, 31, 2, 3])
        copies = build_copies(src_layout, dst_layout, src_pages, dst_pages)
        # 2 buffers x 2 head slices (one per head) x pages x layers x token slots.
        assert len(copies) == 2 * HEADS * len(src_pages) * L * PAGE_SIZE
        assert sum(c[2] for c in copies) == 2 * len(src_pages) * L * BPP
        a.batch_write(b.session_id, copies)
        _assert_pages_copied([src_k, src_v], [dst_k, dst_v], src_pages, dst_pages)
    finally:
        unregister_kv_layout(a, src_layout)
        unregister_kv_layout(b, dst_layout)
