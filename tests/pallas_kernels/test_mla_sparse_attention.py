"""MLA attention kernels (dense and DSA top-k sparse) against the jnp reference.

On CPU both Pallas kernels run in interpret mode; on a GPU host the GPU kernel runs compiled
and the TPU kernel stays interpreted on the CPU device. Each configuration compiles once for a
fixed envelope and is fed several batches (decode, prefill, mixed, padding); unused pages and
slots past ``kv_lens`` hold NaN, and top-k lists mix selectable positions, positions past the
token (ignored) and ``-1`` holes.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import interpret_mode, kernel_device, lowering_context, paged_layout
from pdjax.pallas_kernels.mla_sparse_attention import (
    mla_sparse_attention, mla_sparse_attention_reference)
from pdjax.pallas_kernels.mla_sparse_attention.reference import token_positions
from pdjax.pallas_kernels.mla_sparse_attention.tuning import MlaBlockSizes, get_block_sizes

pytestmark = [pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.slow]   # slow tier: interpret-mode kernels, TPU/GPU lowering

NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, PAGE_SIZE, NUM_LAYERS = 32, 6, 6, 8, 2
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ + 3
TOPK = 24
SCALE = 0.15

# name -> ((q_len, kv_len) per request, distribution).
BATCHES = {
    "decode": ([(1, 1), (1, 8), (1, 9), (1, 17), (1, 40), (1, 48)], (6, 6, 6)),
    "prefill": ([(16, 16), (12, 44)], (0, 2, 2)),
    "mixed": ([(1, 20), (1, 33), (8, 16), (5, 5), (7, 40)], (2, 3, 5)),
    "padding": ([(1, 9), (4, 4), (9, 25)], (1, 1, 3)),
}


def make_batch(seqs, distribution, *, heads, lora, rope, dtype, sparse, seed=0):
    rng = np.random.default_rng(seed)
    lay = paged_layout(rng, seqs, num_seqs=NUM_SEQS, num_pages=NUM_PAGES,
                       pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
    kv_lens, cu_q_lens = lay.kv_lens, lay.cu_q_lens
    cache = rng.standard_normal((NUM_LAYERS, NUM_PAGES, PAGE_SIZE, lora + rope)).astype(np.float32)
    lay.poison(cache)
    q = rng.standard_normal((NUM_TOKENS, heads, lora + rope)).astype(np.float32)
    topk = None
    if sparse:
        topk = np.full((NUM_TOKENS, TOPK), -1, np.int32)
        for r in range(len(seqs)):
            for t in range(cu_q_lens[r], cu_q_lens[r + 1]):
                picks = rng.permutation(kv_lens[r])[:TOPK - 3]     # some are past the token
                row = np.concatenate([picks, [-1] * (TOPK - len(picks))])
                topk[t] = rng.permutation(row)                      # -1 holes anywhere
        topk = jnp.asarray(topk)
    return (jnp.asarray(q, dtype), jnp.asarray(cache, dtype), jnp.int32(1),
            jnp.asarray(kv_lens), jnp.asarray(lay.page_indices), jnp.asarray(cu_q_lens),
            jnp.asarray(distribution, jnp.int32), topk)


@dataclasses.dataclass(frozen=True)
class Config:
    heads: int
    lora: int
    rope: int
    dtype: object
    sparse: bool
    small_blocks: bool = False

    @property
    def tol(self):
        return 1e-5 if self.dtype == jnp.float32 else 2e-2


CONFIGS = {
    "sparse_f32": Config(16, 32, 16, jnp.float32, True),
    "sparse_f32_small_blocks": Config(4, 32, 16, jnp.float32, True, small_blocks=True),
    "dense_f32_small_blocks": Config(16, 32, 16, jnp.float32, False, small_blocks=True),
    "dense_bf16": Config(8, 64, 32, jnp.bfloat16, False),
    "sparse_bf16": Config(8, 64, 32, jnp.bfloat16, True, small_blocks=True),
}
# Small blocks: several chunks per token (double buffering, chunks straddling pages).
SMALL = {"tpu": MlaBlockSizes(8), "gpu": MlaBlockSizes(16, heads_per_block=16)}


def kernel_fn(impl, cfg: Config):
    if impl == "tpu":
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_tpu import (
            mla_sparse_attention_tpu as fn)
    else:
        from pdjax.pallas_kernels.mla_sparse_attention.kernel_gpu import (
            mla_sparse_attention_gpu as fn)
    return jax.jit(functools.partial(
        fn, sm_scale=SCALE, kv_lora_rank=cfg.lora, interpret=interpret_mode(impl),
        block_sizes=SMALL[impl] if cfg.small_blocks else None))


def lowered_kernels(fn, args) -> set[str]:
    text = fn.lower(*args).as_text(debug_info=True)
    return set(re.findall(r"(mla_(?:sparse|dense)_attention_(?:tpu|gpu))/pallas_call", text))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_matches_reference(impl, config):
    cfg = CONFIGS[config]
    fn = kernel_fn(impl, cfg)
    ref = jax.jit(functools.partial(mla_sparse_attention_reference, sm_scale=SCALE,
                                    kv_lora_rank=cfg.lora, block_tokens=16))
    shapes = dict(heads=cfg.heads, lora=cfg.lora, rope=cfg.rope, dtype=cfg.dtype,
                  sparse=cfg.sparse)
    with kernel_device(impl):
        first = make_batch(*BATCHES["mixed"], **shapes)
        mode = "sparse" if cfg.sparse else "dense"
        assert lowered_kernels(fn, first) == {f"mla_{mode}_attention_{impl}"}
        for seed, (name, (seqs, distribution)) in enumerate(BATCHES.items()):
            args = make_batch(seqs, distribution, seed=seed, **shapes)
            out = np.asarray(fn(*args).astype(jnp.float32))
            want = np.asarray(ref(*args).astype(jnp.float32))
            real = int(args[5][distribution[2]])
            assert out.shape == (NUM_TOKENS, cfg.heads, cfg.lora)
            assert np.isfinite(want).all() and np.isfinite(out).all(), name
            err = float(np.abs(out - want).max())
            assert err <= cfg.tol, f"{name}: max abs err {err:.3g} > {cfg.tol}"
            assert not out[real:].any()                     # padding rows are exactly 0
            assert np.abs(out[:real]).max() > 0.05


def test_reference_matches_dense_softmax_and_topk_restriction():
    """The reference against a direct gather + softmax on one request, and the sparse mode
    with every position listed equals the dense mode."""
    args = make_batch(*BATCHES["prefill"], heads=4, lora=32, rope=16, dtype=jnp.float32,
                      sparse=False, seed=9)
    q, cache, layer, kv_lens, page_indices, cu_q_lens, distribution, _ = args
    dense = mla_sparse_attention_reference(*args[:7], None, sm_scale=SCALE, kv_lora_rank=32)
    r, kv_len = 1, 44
    rows = np.asarray(cache)[1, np.asarray(page_indices)[r]].reshape(-1, 48)[:kv_len]
    t0 = int(cu_q_lens[r])
    for i in range(12):
        pos = kv_len - 12 + i
        s = np.asarray(q)[t0 + i] @ rows[:pos + 1].T * SCALE
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ rows[:pos + 1, :32]
        np.testing.assert_allclose(np.asarray(dense)[t0 + i], want, atol=1e-5)
    everything = jnp.tile(jnp.arange(48, dtype=jnp.int32)[::-1], (NUM_TOKENS, 1))
    sparse = mla_sparse_attention_reference(*args[:7], everything, sm_scale=SCALE,
                                            kv_lora_rank=32)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), atol=1e-5)


def test_tpu_kernel_race_detector():
    """``InterpretParams(detect_races=True)`` on tiny shapes, sparse and dense, several chunks."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from pdjax.pallas_kernels.mla_sparse_attention.kernel_tpu import mla_sparse_attention_tpu

    with kernel_device("tpu"):
        rng = np.random.default_rng(3)
        kv_lens = np.array([7, 10], np.int32)
        page_indices = np.array([[1, 2, 0], [3, 4, 5]], np.int32)
        cu_q_lens = np.array([0, 1, 3], np.int32)          # a decode row, a 2-token chunk
        cache = rng.standard_normal((1, 7, 4, 24)).astype(np.float32)
        cache[:, [0, 6]] = np.nan
        topk = np.array([[6, -1, 0, 3, 2, -1], [9, 1, -1, 8, 4, 7], [0, 8, 2, 5, -1, -1],
                         [-1] * 6], np.int32)
        args = (jnp.asarray(rng.standard_normal((4, 2, 24)), jnp.float32), jnp.asarray(cache),
                jnp.int32(0), jnp.asarray(kv_lens), jnp.asarray(page_indices),
                jnp.asarray(cu_q_lens), jnp.array([1, 1, 2], jnp.int32))
        for tk in (jnp.asarray(topk), None):
            out = mla_sparse_attention_tpu(
                *args, tk, sm_scale=0.3, kv_lora_rank=16, block_sizes=MlaBlockSizes(4),
                interpret=pltpu.InterpretParams(detect_races=True))
            assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
            want = mla_sparse_attention_reference(*args, tk, sm_scale=0.3, kv_lora_rank=16)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)


def test_dispatch_and_bad_inputs():
    args = make_batch(*BATCHES["decode"], heads=4, lora=32, rope=16, dtype=jnp.float32,
                      sparse=True)
    out = mla_sparse_attention(*args, sm_scale=SCALE, kv_lora_rank=32, impl="reference")
    want = mla_sparse_attention_reference(*args, sm_scale=SCALE, kv_lora_rank=32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    with pytest.raises(ValueError, match="impl"):
        mla_sparse_attention(*args, sm_scale=SCALE, kv_lora_rank=32, impl="cuda")
    with pytest.raises(ValueError, match="topk_indices"):
        mla_sparse_attention(*args[:7], args[7][:3], sm_scale=SCALE, kv_lora_rank=32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_sparse_attention(*args, sm_scale=SCALE, kv_lora_rank=64)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_sparse_attention(args[0], args[1][..., :40], *args[2:], sm_scale=SCALE,
                             kv_lora_rank=32)
    from pdjax.pallas_kernels.mla_sparse_attention.kernel_gpu import mla_sparse_attention_gpu
    with pytest.raises(ValueError, match="power of two"):
        mla_sparse_attention_gpu(*args, sm_scale=SCALE, kv_lora_rank=24, interpret=True)
    from pdjax.pallas_kernels.mla_sparse_attention.kernel_tpu import mla_sparse_attention_tpu
    with pytest.raises(ValueError, match="page_size"):
        mla_sparse_attention_tpu(*args, sm_scale=SCALE, kv_lora_rank=32, interpret=True,
                                 block_sizes=MlaBlockSizes(12))


def test_block_size_rules():
    tpu = get_block_sizes("tpu", num_heads=128, dim=576, page_size=16, span=2048)
    assert tpu.block_tokens % 16 == 0 and tpu.block_tokens >= 16
    gpu = get_block_sizes("gpu", num_heads=128, dim=576, page_size=16, span=2048)
    assert gpu.heads_per_block == 64 and gpu.block_tokens == 32
    small = get_block_sizes("gpu", num_heads=4, dim=48, page_size=4, span=8)
    assert small.heads_per_block == 16 and small.block_tokens == 16
    with pytest.raises(ValueError, match="backend"):
        get_block_sizes("cpu", num_heads=4, dim=48, page_size=4, span=8)
    with pytest.raises(ValueError, match="block_tokens"):
        MlaBlockSizes(0)


@pytest.mark.parametrize("impl,platform,custom_call", [
    ("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_kernels_lower_for_deepseek_shapes(impl, platform, custom_call):
    """DeepSeek-V3.2 / GLM-5 attention shapes (128 heads, 512 + 64 latent, top-2048, page 16,
    bf16) lower for decode and prefill buckets, sparse and dense."""
    S = jax.ShapeDtypeStruct
    pool = S((61, 2049, 16, 576), jnp.bfloat16)
    fn = functools.partial(mla_sparse_attention, sm_scale=0.1, kv_lora_rank=512, impl=impl)
    with lowering_context(platform):
        for tokens, rows, pages in ((16, 16, 256), (256, 4, 512)):
            base = (S((tokens, 128, 576), jnp.bfloat16), pool, S((), jnp.int32),
                    S((rows,), jnp.int32), S((rows, pages), jnp.int32), S((rows + 1,), jnp.int32),
                    S((3,), jnp.int32))
            for topk in (S((tokens, 2048), jnp.int32), None):
                text = jax.jit(fn).trace(*base, topk).lower(
                    lowering_platforms=(platform,)).as_text()
                assert text.count(custom_call) == 1, (tokens, topk is None)


def test_token_positions_padding():
    req, pos, kv_len = token_positions(jnp.array([5, 3, 0], jnp.int32),
                                       jnp.array([0, 1, 4, 4], jnp.int32), 6)
    assert req.tolist() == [0, 1, 1, 1, 0, 0]
    assert pos.tolist() == [4, 0, 1, 2, -1, -1] and kv_len.tolist() == [5, 3, 3, 3, 0, 0]
