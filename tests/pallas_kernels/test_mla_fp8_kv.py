"""The FP8 latent KV record of MLA (``fp8_record.py``): the 656-byte record, its round trip
error bound, and MLA attention over it (reference and Pallas kernels) against attention over
the dequantized rows."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import interpret_mode, kernel_device, paged_layout
from pdjax.models.deepseek import deepseek_cache_spec
from pdjax.models.loader import checkpoint_config
from pdjax.pallas_kernels.mla_sparse_attention import (
    mla_sparse_attention, mla_sparse_attention_reference)
from pdjax.pallas_kernels.mla_sparse_attention import fp8_record as rec
from pdjax.pallas_kernels.mla_sparse_attention.tuning import MlaBlockSizes

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, PAGE_SIZE, NUM_LAYERS = 32, 6, 6, 8, 2
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ + 3
TOPK, SCALE = 24, 0.15
CHECKPOINTS = pathlib.Path(__file__).parents[1] / ".checkpoints"


def test_record_is_656_bytes_for_deepseek():
    """DeepSeek-V3.2 (C 512, R 64): 512 e4m3 + 4 float32 scales + 64 bf16 = 656 bytes per token
    per layer on GPU/CPU; the TPU split is whole lanes (512 + 128 bf16 = 768)."""
    gpu = rec.Fp8LatentLayout(512, 64)
    assert gpu.planes() == (("latent", 512, jnp.dtype(jnp.float8_e4m3fn)),
                            ("latent_scale", 4, jnp.dtype(jnp.float32)),
                            ("latent_rope", 64, jnp.dtype(jnp.bfloat16)))
    assert gpu.bytes_per_token() == 656
    tpu = rec.Fp8LatentLayout(512, 64, 128)
    assert [p[:2] for p in tpu.planes()] == [("latent", 512), ("latent_rope", 128)]
    assert tpu.bytes_per_token() == 768
    with pytest.raises(ValueError, match="row_align"):
        rec.Fp8LatentLayout(512, 64, 8)


def test_cache_spec_page_bytes_follow_the_record():
    """The cache spec's per-page bytes (what PD moves) are the record's: 656 x page_size x
    layers for the latent planes."""
    cfg = dataclasses.replace(checkpoint_config(str(CHECKPOINTS / "deepseek_v3")), kv_lora_rank=512,
                              qk_rope_head_dim=64)
    assert not cfg.has_indexer and cfg.num_layers == 3
    specs = deepseek_cache_spec(cfg, num_pages=10, page_size=64, dtype=jnp.float8_e4m3fn)
    assert [s.name for s in specs] == ["latent", "latent_scale", "latent_rope"]
    assert sum(s.bytes_per_page for s in specs) == 3 * 64 * 656
    bf16 = deepseek_cache_spec(cfg, num_pages=10, page_size=64, dtype=jnp.bfloat16)
    assert sum(s.bytes_per_page for s in bf16) == 3 * 64 * 576 * 2
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        deepseek_cache_spec(cfg, num_pages=10, page_size=64, dtype=jnp.int8)


@pytest.mark.parametrize("width", [512, 32, 200])
def test_quantize_round_trip_error_bound(width):
    """Per value ``|x - dq(q(x))| <= |x| 2^-4 + scale 2^-10``; scales are powers of two with
    ``amax / scale`` in (224, 448]; a zero group has scale 1 and round-trips exactly."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, width)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 12, (64, 1))).astype(np.float32)   # rows of many ranges
    x[3] = 0.0
    q, scale = rec.quantize_groups(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (64, -(-width // 128))
    s = np.asarray(scale)
    assert np.all(np.log2(s) == np.round(np.log2(s)))                   # UE8M0
    got = np.asarray(rec.dequantize_groups(q, scale))
    full = np.repeat(s, 128, axis=1)[:, :width]
    assert np.all(np.abs(got - x) <= np.abs(x) * 2.0 ** -4 + full * 2.0 ** -10)
    assert not got[3].any() and np.all(s[3] == 1.0)
    amax = np.abs(np.pad(x, ((0, 0), (0, s.shape[1] * 128 - width)))).reshape(64, -1, 128).max(-1)
    ratio = amax[amax > 0] / s[amax > 0]
    assert ratio.max() <= 448 and ratio.min() > 224
    # Error is really there (not a bf16 pass-through): e4m3's 3 mantissa bits.
    assert np.abs(got - x).max() > np.abs(x).max() * 2.0 ** -8


@pytest.mark.parametrize("row_align", [1, 128])
def test_rows_round_trip_both_layouts(row_align):
    """``quantize_rows`` then ``dequantize_rows`` (GPU record and TPU split) give the same
    numbers: the scales survive the bf16 rope plane exactly."""
    rng = np.random.default_rng(1)
    layout = rec.Fp8LatentLayout(64, 32, row_align)
    c_kv = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32) * 3
    k_pe = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    rows = rec.quantize_rows(layout, c_kv, k_pe)
    assert {k: (v.shape[1], v.dtype) for k, v in rows.items()} == {
        name: (w, d) for name, w, d in layout.planes()}
    got = rec.dequantize_rows(rows["latent"], rows.get("latent_scale"), rows["latent_rope"],
                              kv_lora_rank=64, rope_dim=32)
    want = jnp.concatenate([rec.dequantize_groups(*rec.quantize_groups(c_kv)),
                            k_pe.astype(jnp.bfloat16).astype(jnp.float32)], -1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    err = np.abs(np.asarray(got[:, :64]) - np.asarray(c_kv))
    assert err.max() <= np.abs(np.asarray(c_kv)).max() * 2.0 ** -4


# --------------------------------------------------------------------------- attention

def fp8_batch(*, heads, lora, rope, row_align, sparse, seed=0, q_dtype=jnp.float32):
    """A mixed batch over an FP8 latent cache written with ``write_rows`` (NaN planes where
    no request reads) and the same cache dequantized to float32 rows."""
    rng = np.random.default_rng(seed)
    seqs, distribution = [(1, 20), (1, 33), (8, 16), (5, 5), (7, 40)], (2, 3, 5)
    lay = paged_layout(rng, seqs, num_seqs=NUM_SEQS, num_pages=NUM_PAGES,
                       pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
    layout = rec.Fp8LatentLayout(lora, rope, row_align)
    n = NUM_LAYERS * NUM_PAGES * PAGE_SIZE
    rows = rng.standard_normal((n, lora + rope)).astype(np.float32) * 2
    planes = rec.quantize_rows(layout, jnp.asarray(rows[:, :lora]), jnp.asarray(rows[:, lora:]))
    caches = {}
    for name, value in planes.items():
        a = np.array(value.astype(jnp.float32)).reshape(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, -1)
        lay.poison(a)
        caches[name] = jnp.asarray(a, value.dtype)
    kv = rec.latent_view(caches)
    dense = rec.dequantize_rows(kv.latent, kv.scale, kv.rope, kv_lora_rank=lora, rope_dim=rope)
    q = rng.standard_normal((NUM_TOKENS, heads, lora + rope)).astype(np.float32)
    topk = None
    if sparse:
        topk = np.full((NUM_TOKENS, TOPK), -1, np.int32)
        for r in range(len(seqs)):
            for t in range(lay.cu_q_lens[r], lay.cu_q_lens[r + 1]):
                picks = rng.permutation(lay.kv_lens[r])[:TOPK - 3]
                topk[t] = rng.permutation(np.concatenate([picks, [-1] * (TOPK - len(picks))]))
        topk = jnp.asarray(topk)
    meta = (jnp.int32(1), jnp.asarray(lay.kv_lens), jnp.asarray(lay.page_indices),
            jnp.asarray(lay.cu_q_lens), jnp.asarray(distribution, jnp.int32), topk)
    return jnp.asarray(q, q_dtype), kv, dense, meta, int(lay.cu_q_lens[distribution[2]])


@pytest.mark.parametrize("row_align", [1, 128])
@pytest.mark.parametrize("sparse", [False, True])
def test_reference_reads_the_record(row_align, sparse):
    """The reference over the FP8 planes == the reference over the dequantized float32 rows
    (NaN in unused slots does not leak)."""
    q, kv, dense, meta, real = fp8_batch(heads=4, lora=32, rope=16, row_align=row_align,
                                         sparse=sparse)
    ref = functools.partial(mla_sparse_attention_reference, sm_scale=SCALE, kv_lora_rank=32,
                            block_tokens=16)
    got = np.asarray(ref(q, kv, *meta))
    want = np.asarray(ref(q, dense, *meta))
    assert np.isfinite(got).all() and np.abs(got[:real]).max() > 0.05
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The dispatcher takes the planes too (no query padding for them).
    out = mla_sparse_attention(q, kv, *meta, sm_scale=SCALE, kv_lora_rank=32, impl="reference")
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_reference_refuses_planes_of_another_shape():
    q, kv, _, meta, _ = fp8_batch(heads=4, lora=32, rope=16, row_align=1, sparse=False)
    bad = kv._replace(scale=kv.scale.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="kv_cache.latent_scale"):
        mla_sparse_attention_reference(q, bad, *meta, sm_scale=SCALE, kv_lora_rank=32)
    with pytest.raises(ValueError, match="kv_cache.latent: expected .* 40"):
        mla_sparse_attention_reference(q, kv, *meta, sm_scale=SCALE, kv_lora_rank=40)


def kernel(impl, lora, small):
    if impl == "tpu":
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_tpu import (
            mla_sparse_attention_tpu as fn)
        blocks = MlaBlockSizes(8) if small else None
    else:
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_gpu import (
            mla_sparse_attention_gpu as fn)
        blocks = MlaBlockSizes(16, heads_per_block=16) if small else None
    return jax.jit(functools.partial(fn, sm_scale=SCALE, kv_lora_rank=lora,
                                     interpret=interpret_mode(impl), block_sizes=blocks))


@pytest.mark.slow     # interpret-mode Pallas kernels
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernels_read_the_record(impl, sparse):
    """The GPU kernel over the 656-byte record's planes and the TPU kernel over the TPU split
    match the reference over the dequantized rows (float32 queries: 1e-4; bf16: 3e-2), with
    several blocks per token (small blocks) and NaN where no request reads."""
    row_align = 128 if impl == "tpu" else 1
    for q_dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
        q, kv, dense, meta, real = fp8_batch(heads=4, lora=32, rope=16, row_align=row_align,
                                             sparse=sparse, q_dtype=q_dtype)
        want = np.asarray(mla_sparse_attention_reference(
            q.astype(jnp.float32), dense, *meta, sm_scale=SCALE, kv_lora_rank=32))
        with kernel_device(impl):
            got = np.asarray(kernel(impl, 32, q_dtype == jnp.float32)(q, kv, *meta)
                             .astype(jnp.float32))
        assert got.shape == (NUM_TOKENS, 4, 32) and np.isfinite(got).all()
        err = float(np.abs(got - want).max())
        assert err <= tol, f"{impl} {q_dtype.__name__}: max abs err {err:.3g}"
        assert not got[real:].any() and np.abs(got[:real]).max() > 0.05


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernels_refuse_the_other_platforms_layout(impl):
    row_align = 1 if impl == "tpu" else 128
    q, kv, _, meta, _ = fp8_batch(heads=4, lora=32, rope=16, row_align=row_align, sparse=False)
    with pytest.raises(ValueError, match="kv_cache: the (TPU|GPU) kernel reads"):
        kernel(impl, 32, False)(q, kv, *meta)
