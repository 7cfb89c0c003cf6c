"""A step that copies the KV pool is found from the compiler's buffer assignment
(``runner/pool_copy.py``), and a PD decode never writes into a pool such a step updates."""

import jax
import jax.numpy as jnp
import pytest

from pdjax.engine import Engine
from pdjax.runner.pool_copy import kv_pool_copy

TINY_ARGS = dict(page_size=4, max_total_tokens=2048, chunked_prefill_size=32,
                 max_running_requests=8, context_length=256)
POOL = (2, 64, 4, 32)         # a small float32 [L, N, ps, row] buffer: 32 KiB


def _compiled(fn, donate: bool):
    cache = jax.ShapeDtypeStruct(POOL, jnp.float32)
    page = jax.ShapeDtypeStruct((), jnp.int32)
    row = jax.ShapeDtypeStruct((POOL[-1],), jnp.float32)
    return jax.jit(fn, donate_argnums=(0,) if donate else ()).lower(cache, page, row).compile()


def _write_row(cache, page, row):
    return cache.at[1, page, 0].set(row)


def test_buffer_assignment_tells_an_in_place_update_from_a_copy():
    nbytes = 4 * 2 * 64 * 4 * 32
    assert kv_pool_copy(_compiled(_write_row, donate=True), [nbytes], [4]) is None
    # Not donated: the result is a new buffer.
    why = kv_pool_copy(_compiled(_write_row, donate=False), [nbytes], [4])
    assert why is not None and f"[{nbytes}] B" in why
    # Reading the old page after writing it keeps the old pool alive: a whole copy.
    copying = _compiled(lambda c, p, r: (_write_row(c, p, r), c[1, p].sum()), donate=True)
    assert "outside the donated buffers" in kv_pool_copy(copying, [nbytes], [4])
    # Only values of a buffer's size in some element width: a float32 copy is no copy of a
    # float32 buffer of 8x its bytes, but it is one of a 16-bit buffer of half its bytes.
    assert kv_pool_copy(copying, [8 * nbytes], [4]) is None
    assert "outside the donated buffers" in kv_pool_copy(copying, [nbytes // 2], [2])
    # Temporaries larger than the pool that are not a copy of it (a sorted [160, 160]) are
    # no copy: the size of the temporaries alone would call this one a copy.
    def sorted_scratch(c, p, r):
        m = jnp.sort(jnp.outer(jnp.tile(r, 5), jnp.tile(r, 5)), axis=1)
        return _write_row(c, p, r), m[:, ::7].sum()
    scratch = _compiled(sorted_scratch, donate=True)
    assert scratch.memory_analysis().temp_size_in_bytes > nbytes
    assert kv_pool_copy(scratch, [nbytes], [4]) is None


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints):
    return tiny_checkpoints["llama"]


def test_engine_buckets_update_the_pool_in_place(llama_path):
    """The engine's layout ([L, N, ps, KVH, D] on CPU): no bucket copies the pool, so a PD
    decode may take the direct path. (A DSA model's larger temporaries are no copy either:
    ``test_pd_dsa`` runs its decode direct.)"""
    engine = Engine(model_path=llama_path, progress=False, **TINY_ARGS)
    try:
        runner = engine.core.runner
        assert runner.ready_keys and runner.kv_copying == {}
        runner.require_in_place_kv()
        assert runner.in_place_kv_required
    finally:
        engine.shutdown()


def test_rows_on_cpu_copy_the_pool_and_a_receiving_pool_refuses_them(llama_path, monkeypatch):
    """GQA rows [L, N, ps, KVH * D] on XLA:CPU: the 1-row decode copies the pool into a
    temporary and back (pages a transfer wrote meanwhile came back with their old bytes: PD
    between servers gave wrong tokens). The copy is found, and a receiving pool refuses."""
    import pdjax.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "kv_row_align", lambda platform: 128)
    engine = Engine(model_path=llama_path, progress=False, **TINY_ARGS)
    try:
        runner = engine.core.runner
        assert runner.kv_buffers()[0].ndim == 4                  # rows
        copying = runner.kv_copying
        assert copying and all(k.entry == "decode" for k in copying), copying
        assert all("outside the donated buffers" in why for why in copying.values())
        with pytest.raises(ValueError, match="not updated in place.*decode"):
            runner.require_in_place_kv()
        assert not runner.in_place_kv_required
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_a_narrow_pool_updated_through_a_wide_copy_is_a_copy(dtype):
    """XLA:CPU has no 8- or 16-bit float scatter: it converts the whole pool to a wider type,
    scatters there and converts it back over the pool. Buffer assignment keeps the output in
    the donated buffer, but the wide value is a snapshot: a page a transfer wrote meanwhile
    came back with its old bytes (PD with FP8 KV gave the decode wrong tokens, or 0s, about
    one request in three). The wide copy (twice the bytes here) is found."""
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = 2 * 64 * 4 * 32 * itemsize
    pool = jax.ShapeDtypeStruct(POOL, dtype)
    pages = jax.ShapeDtypeStruct((3,), jnp.int32)
    rows = jax.ShapeDtypeStruct((3, POOL[-1]), jnp.float32)

    def scatter_rows(c, i, r):           # the model's cache write: rows at traced pages
        return c.at[1, i, 0].set(r.astype(c.dtype))
    compiled = jax.jit(scatter_rows, donate_argnums=(0,)).lower(pool, pages, rows).compile()
    why = kv_pool_copy(compiled, [nbytes], [itemsize])
    assert why is not None and "outside the donated buffers" in why, why
    assert f"[{2 * nbytes}] B" in why, why
    # Counted only the same size, as before, the copy went unseen.
    from pdjax.runner.pool_copy import copied_values
    proto = bytes(compiled.memory_analysis().serialized_buffer_assignment_proto)
    assert copied_values(proto, {nbytes}) == []


class _SizesOnly:
    """``memory_analysis()`` as XLA:TPU and XLA:GPU give it: sizes, no buffer assignment."""

    def __init__(self, temp, alias):
        self.stats = type("Stats", (), dict(temp_size_in_bytes=temp, alias_size_in_bytes=alias,
                                            serialized_buffer_assignment_proto=b""))()

    def memory_analysis(self):
        return self.stats


def test_without_a_buffer_assignment_sizes_decide():
    pool = [1 << 30, 1 << 28]                  # a latent and an indexer buffer per chip
    widths = [2, 1]
    assert kv_pool_copy(_SizesOnly(temp=40 << 20, alias=sum(pool)), pool, widths) is None
    assert "likely a copy" in kv_pool_copy(_SizesOnly(temp=1 << 28, alias=sum(pool)), pool,
                                           widths)
    assert "new buffer" in kv_pool_copy(_SizesOnly(temp=0, alias=1 << 30), pool, widths)
