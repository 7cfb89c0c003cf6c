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
    assert kv_pool_copy(_compiled(_write_row, donate=True), [nbytes]) is None
    # Not donated: the result is a new buffer.
    why = kv_pool_copy(_compiled(_write_row, donate=False), [nbytes])
    assert why is not None and f"[{nbytes}] B" in why
    # Reading the old page after writing it keeps the old pool alive: a whole copy.
    copying = _compiled(lambda c, p, r: (_write_row(c, p, r), c[1, p].sum()), donate=True)
    assert "outside the donated buffers" in kv_pool_copy(copying, [nbytes])
    assert kv_pool_copy(copying, [2 * nbytes]) is None      # only values of a buffer's size
    # Temporaries larger than the pool that are not a copy of it (a sorted [160, 160]) are
    # no copy: the size of the temporaries alone would call this one a copy.
    def sorted_scratch(c, p, r):
        m = jnp.sort(jnp.outer(jnp.tile(r, 5), jnp.tile(r, 5)), axis=1)
        return _write_row(c, p, r), m[:, ::7].sum()
    scratch = _compiled(sorted_scratch, donate=True)
    assert scratch.memory_analysis().temp_size_in_bytes > nbytes
    assert kv_pool_copy(scratch, [nbytes]) is None


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


class _SizesOnly:
    """``memory_analysis()`` as XLA:TPU and XLA:GPU give it: sizes, no buffer assignment."""

    def __init__(self, temp, alias):
        self.stats = type("Stats", (), dict(temp_size_in_bytes=temp, alias_size_in_bytes=alias,
                                            serialized_buffer_assignment_proto=b""))()

    def memory_analysis(self):
        return self.stats


def test_without_a_buffer_assignment_sizes_decide():
    pool = [1 << 30, 1 << 28]                  # a latent and an indexer buffer per chip
    assert kv_pool_copy(_SizesOnly(temp=40 << 20, alias=sum(pool)), pool) is None
    assert "likely a copy" in kv_pool_copy(_SizesOnly(temp=1 << 28, alias=sum(pool)), pool)
    assert "new buffer" in kv_pool_copy(_SizesOnly(temp=0, alias=1 << 30), pool)
