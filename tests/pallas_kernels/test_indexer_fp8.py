"""FP8 indexer keys (DeepSeek-V3.2's indexer cache: e4m3 keys with a float32 scale per 128):
the reference and the GPU kernel score them as the dequantized keys; the TPU kernel refuses
them (the engine keeps them bf16 on TPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import interpret_mode, kernel_device, paged_layout
from pdjax.pallas_kernels.indexer import Fp8Keys, indexer_scores, indexer_scores_reference
from pdjax.pallas_kernels.indexer.tuning import IndexerBlockSizes
from pdjax.pallas_kernels.mla_sparse_attention import fp8_record as rec

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, PAGE_SIZE, NUM_LAYERS = 32, 6, 6, 8, 2
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ + 3


def fp8_batch(*, heads, dim, q_dtype=jnp.float32, seed=0):
    """A mixed batch over FP8 keys (NaN where no request reads) and the same keys
    dequantized to float32."""
    rng = np.random.default_rng(seed)
    seqs, distribution = [(1, 20), (1, 33), (8, 16), (5, 5), (7, 40)], (2, 3, 5)
    lay = paged_layout(rng, seqs, num_seqs=NUM_SEQS, num_pages=NUM_PAGES,
                       pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
    keys = rng.standard_normal((NUM_LAYERS, NUM_PAGES, PAGE_SIZE, dim)).astype(np.float32) * 3
    q8, scale = rec.quantize_groups(jnp.asarray(keys))
    q8, scale = np.array(q8.astype(jnp.float32)), np.array(scale)
    lay.poison(q8)
    lay.poison(scale)
    k = Fp8Keys(jnp.asarray(q8, jnp.float8_e4m3fn), jnp.asarray(scale))
    dense = rec.dequantize_groups(k.keys, k.scale)
    q = rng.standard_normal((NUM_TOKENS, heads, dim)).astype(np.float32)
    w = rng.standard_normal((NUM_TOKENS, heads)).astype(np.float32) * heads ** -0.5
    meta = (jnp.int32(1), jnp.asarray(lay.kv_lens), jnp.asarray(lay.page_indices),
            jnp.asarray(lay.cu_q_lens), jnp.asarray(distribution, jnp.int32))
    return jnp.asarray(q, q_dtype), jnp.asarray(w), k, dense, meta


def _assert_close(out, want, tol):
    out, want = np.asarray(out), np.asarray(want)
    assert (np.isneginf(out) == np.isneginf(want)).all()
    assert not np.isnan(out).any()
    ok = np.isfinite(want)
    assert ok.sum() > 100 and np.abs(want[ok]).max() > 0.1
    assert np.abs(out[ok] - want[ok]).max() <= tol


@pytest.mark.parametrize("dim", [32, 256])
def test_reference_reads_fp8_keys(dim):
    """Scores over ``Fp8Keys`` == scores over the dequantized keys (one and two scale groups);
    and they differ from the unquantized keys' by the quantization only."""
    q, w, k, dense, meta = fp8_batch(heads=4, dim=dim)
    ref = functools.partial(indexer_scores_reference, sm_scale=dim ** -0.5)
    _assert_close(ref(q, w, k, *meta), ref(q, w, dense, *meta), 1e-4)
    out = indexer_scores(q, w, k, *meta, sm_scale=dim ** -0.5, impl="reference")
    _assert_close(out, ref(q, w, dense, *meta), 1e-4)
    bad = Fp8Keys(k.keys, k.scale[..., :0])
    with pytest.raises(ValueError, match="k_cache: FP8 keys"):
        ref(q, w, bad, *meta)


@pytest.mark.slow     # interpret-mode Pallas kernel
def test_gpu_kernel_reads_fp8_keys():
    for q_dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)):
        q, w, k, dense, meta = fp8_batch(heads=4, dim=32, q_dtype=q_dtype)
        from pdjax.pallas_kernels.indexer.kernel_gpu import indexer_scores_gpu
        fn = jax.jit(functools.partial(indexer_scores_gpu, sm_scale=32 ** -0.5,
                                       interpret=interpret_mode("gpu"),
                                       block_sizes=IndexerBlockSizes(16, heads_per_block=16)))
        want = indexer_scores_reference(q.astype(jnp.float32), w, dense, *meta,
                                        sm_scale=32 ** -0.5)
        with kernel_device("gpu"):
            got = fn(q, w, k, *meta)
        _assert_close(got, want, tol)


def test_tpu_kernel_refuses_fp8_keys():
    from pdjax.pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu
    q, w, k, _, meta = fp8_batch(heads=4, dim=32)
    with pytest.raises(ValueError, match="k_cache: the TPU indexer kernel"):
        indexer_scores_tpu(q, w, k, *meta, sm_scale=1.0, interpret=True)
