"""Lightning-indexer scoring kernels against the jnp reference, and the top-k selection.

Same envelope and batches as the MLA kernel tests: NaN in unused pages and in slots past
``kv_lens``; the kernels run interpreted on CPU (the GPU kernel compiled on a GPU host).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import interpret_mode, kernel_device, lowering_context, paged_layout
from pdjax.pallas_kernels.indexer import indexer_scores, indexer_scores_reference, topk_positions
from pdjax.pallas_kernels.indexer.tuning import IndexerBlockSizes, get_block_sizes

pytestmark = [pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.slow]   # slow tier: interpret-mode kernels, TPU/GPU lowering

NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, PAGE_SIZE, NUM_LAYERS = 32, 6, 6, 8, 2
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ + 3
SCALE = 32 ** -0.5

BATCHES = {
    "decode": ([(1, 1), (1, 8), (1, 9), (1, 17), (1, 40), (1, 48)], (6, 6, 6)),
    "prefill": ([(16, 16), (12, 44)], (0, 2, 2)),
    "mixed": ([(1, 20), (1, 33), (8, 16), (5, 5), (7, 40)], (2, 3, 5)),
    "padding": ([(1, 9), (4, 4), (9, 25)], (1, 1, 3)),
}


def make_batch(seqs, distribution, *, heads, dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lay = paged_layout(rng, seqs, num_seqs=NUM_SEQS, num_pages=NUM_PAGES,
                       pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
    keys = rng.standard_normal((NUM_LAYERS, NUM_PAGES, PAGE_SIZE, dim)).astype(np.float32)
    lay.poison(keys)
    q = rng.standard_normal((NUM_TOKENS, heads, dim)).astype(np.float32)
    w = rng.standard_normal((NUM_TOKENS, heads)).astype(np.float32) * heads ** -0.5
    return (jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(keys, dtype), jnp.int32(1),
            jnp.asarray(lay.kv_lens), jnp.asarray(lay.page_indices), jnp.asarray(lay.cu_q_lens),
            jnp.asarray(distribution, jnp.int32))


def kernel_fn(impl, block_sizes=None):
    if impl == "tpu":
        from pdjax.pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu as fn
    else:
        from pdjax.pallas_kernels.indexer.kernel_gpu import indexer_scores_gpu as fn
    return jax.jit(functools.partial(fn, sm_scale=SCALE, interpret=interpret_mode(impl),
                                     block_sizes=block_sizes))


def _assert_scores_equal(out, want, tol, name):
    out, want = np.asarray(out), np.asarray(want)
    assert (np.isneginf(out) == np.isneginf(want)).all(), f"{name}: -inf pattern differs"
    assert not np.isnan(out).any() and not np.isposinf(out).any()
    ok = np.isfinite(want)
    err = float(np.abs(out[ok] - want[ok]).max())
    assert err <= tol, f"{name}: max abs err {err:.3g} > {tol}"


CONFIGS = {
    "h16_d32_f32": (16, 32, jnp.float32, None, 1e-5),
    "h4_d32_f32_small_blocks": (4, 32, jnp.float32, "small", 1e-5),
    "h32_d64_bf16": (32, 64, jnp.bfloat16, None, 3e-2),
}
SMALL = {"tpu": IndexerBlockSizes(16), "gpu": IndexerBlockSizes(16, heads_per_block=16)}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_matches_reference(impl, config):
    heads, dim, dtype, blocks, tol = CONFIGS[config]
    fn = kernel_fn(impl, SMALL[impl] if blocks else None)
    ref = jax.jit(functools.partial(indexer_scores_reference, sm_scale=SCALE, block_tokens=16))
    with kernel_device(impl):
        first = make_batch(*BATCHES["mixed"], heads=heads, dim=dim, dtype=dtype)
        text = fn.lower(*first).as_text(debug_info=True)
        assert set(re.findall(r"(indexer_scores_(?:tpu|gpu))/pallas_call", text)) == {
            f"indexer_scores_{impl}"}
        for seed, (name, (seqs, distribution)) in enumerate(BATCHES.items()):
            args = make_batch(seqs, distribution, heads=heads, dim=dim, dtype=dtype, seed=seed)
            out = fn(*args)
            want = ref(*args)
            assert out.shape == (NUM_TOKENS, PAGES_PER_SEQ * PAGE_SIZE)
            _assert_scores_equal(out, want, tol, name)
            real = int(args[6][distribution[2]])
            assert np.isneginf(np.asarray(out)[real:]).all()     # padding selects nothing
            # Token t of a request sees exactly its causal positions.
            n_ok = np.isfinite(np.asarray(want)[:real]).sum(1)
            assert n_ok.min() >= 1 and n_ok.max() <= max(s[1] for s in seqs)


def test_reference_against_direct_formula_and_topk():
    args = make_batch(*BATCHES["prefill"], heads=4, dim=32, dtype=jnp.float32, seed=5)
    q, w, keys, layer, kv_lens, page_indices, cu_q_lens, _ = args
    scores = np.asarray(indexer_scores_reference(*args, sm_scale=SCALE))
    r, kv_len, t0 = 1, 44, 16
    rows = np.asarray(keys)[1, np.asarray(page_indices)[r]].reshape(-1, 32)[:kv_len]
    for i in range(12):
        pos = kv_len - 12 + i
        s = np.maximum(np.asarray(q)[t0 + i] @ rows[:pos + 1].T * SCALE, 0)    # [Hi, pos+1]
        want = np.asarray(w)[t0 + i] @ s
        np.testing.assert_allclose(scores[t0 + i, :pos + 1], want, atol=1e-5)
        assert np.isneginf(scores[t0 + i, pos + 1:]).all()
    top = np.asarray(topk_positions(jnp.asarray(scores), 8))
    row = scores[t0]                                  # position 32: 33 candidates
    assert sorted(top[t0].tolist()) == sorted(np.argsort(-row)[:8].tolist())
    # A token with fewer candidates than k gets all of them, then -1.
    assert sorted(top[0].tolist()) == [-1] * 7 + [0]
    assert topk_positions(jnp.asarray(scores), 1000).shape == (NUM_TOKENS, 48)


def test_tpu_kernel_race_detector():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from pdjax.pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu

    with kernel_device("tpu"):
        rng = np.random.default_rng(1)
        keys = rng.standard_normal((1, 7, 4, 16)).astype(np.float32)
        keys[:, [0, 6]] = np.nan
        args = (jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32),
                jnp.asarray(rng.standard_normal((5, 2)), jnp.float32), jnp.asarray(keys),
                jnp.int32(0), jnp.array([7, 10], jnp.int32),
                jnp.array([[1, 2, 0], [3, 4, 5]], jnp.int32), jnp.array([0, 1, 4], jnp.int32),
                jnp.array([1, 1, 2], jnp.int32))
        out = indexer_scores_tpu(*args, sm_scale=0.25, block_sizes=IndexerBlockSizes(4),
                                 interpret=pltpu.InterpretParams(detect_races=True))
        assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
        _assert_scores_equal(out, indexer_scores_reference(*args, sm_scale=0.25), 1e-5, "race")


def test_dispatch_and_bad_inputs():
    args = make_batch(*BATCHES["decode"], heads=4, dim=32, dtype=jnp.float32)
    out = indexer_scores(*args, sm_scale=SCALE, impl="reference")
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(indexer_scores_reference(*args, sm_scale=SCALE)))
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(args[0], args[1][:, :3], *args[2:], sm_scale=SCALE)
    with pytest.raises(ValueError, match="k_cache"):
        indexer_scores(args[0], args[1], args[2][..., :16], *args[3:], sm_scale=SCALE)
    with pytest.raises(ValueError, match="kv_lens"):
        indexer_scores(*args[:4], args[4].astype(jnp.float32), *args[5:], sm_scale=SCALE)
    from pdjax.pallas_kernels.indexer.kernel_gpu import indexer_scores_gpu
    with pytest.raises(ValueError, match="power of two"):
        indexer_scores_gpu(args[0][..., :24], args[1], args[2][..., :24], *args[3:],
                           sm_scale=SCALE, interpret=True)
    from pdjax.pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu
    with pytest.raises(ValueError, match="page_size"):
        indexer_scores_tpu(*args, sm_scale=SCALE, block_sizes=IndexerBlockSizes(12),
                           interpret=True)
    assert get_block_sizes("tpu", num_heads=64, head_dim=128, page_size=16,
                           span=8192).block_tokens == 512
    assert get_block_sizes("tpu", num_heads=4, head_dim=32, page_size=8, span=48).block_tokens == 48
    assert get_block_sizes("gpu", num_heads=64, head_dim=128, page_size=16,
                           span=8192).heads_per_block == 64


@pytest.mark.parametrize("impl,platform,custom_call", [
    ("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_kernels_lower_for_deepseek_shapes(impl, platform, custom_call):
    """DeepSeek-V3.2 indexer shapes (64 heads x 128, page 16, bf16 keys) for a decode and a
    prefill bucket; GLM-5's 32 heads too."""
    S = jax.ShapeDtypeStruct
    pool = S((61, 2049, 16, 128), jnp.bfloat16)
    fn = functools.partial(indexer_scores, sm_scale=128 ** -0.5, impl=impl)
    with lowering_context(platform):
        for tokens, rows, pages, heads in ((16, 16, 256, 64), (256, 4, 512, 32)):
            args = (S((tokens, heads, 128), jnp.bfloat16), S((tokens, heads), jnp.float32), pool,
                    S((), jnp.int32), S((rows,), jnp.int32), S((rows, pages), jnp.int32),
                    S((rows + 1,), jnp.int32), S((3,), jnp.int32))
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert text.count(custom_call) == 1, tokens
