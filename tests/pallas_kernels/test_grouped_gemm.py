"""The grouped GEMM (MoE experts) and the block-scaled FP8 GEMM kernels against their jnp
references and an independent numpy formula: uneven groups (empty experts, every row on one
expert, rows past the groups), partial edge blocks, tiles shared by several groups, FP8
weights with 128 x 128 scales; the kernels run interpreted on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import interpret_mode, kernel_device, lowering_context
from pdjax.models.fp8 import dequantize, quantize
from pdjax.pallas_kernels.fp8_gemm import fp8_matmul, fp8_matmul_reference
from pdjax.pallas_kernels.grouped_gemm import (
    group_metadata, grouped_matmul, grouped_matmul_reference)
from pdjax.pallas_kernels.grouped_gemm.tuning import GmmTiles, get_tiles

pytestmark = [pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.slow]   # slow tier: interpret-mode kernels, TPU/GPU lowering


def _numpy_grouped(x, w, sizes):
    """out[r] = x[r] @ w[g(r)] in float64, rows past the groups 0."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n] @ w[g]
        start += n
    return out


def _fp8_stack(rng, G, K, N):
    """(q [G, K, N] float8, scale [G, ceil(K/128), ceil(N/128)], dequantized float32)."""
    pairs = [quantize(rng.standard_normal((K, N)).astype(np.float32) * (g + 1))
             for g in range(G)]
    q = np.stack([p[0] for p in pairs])
    s = np.stack([p[1] for p in pairs])
    return jnp.asarray(q), jnp.asarray(s), np.stack([dequantize(a, b) for a, b in pairs])


CASES = {      # name: (M, K, N, group sizes)
    "uneven": (37, 200, 150, [10, 0, 20, 5]),            # rows 35, 36 in no group
    "one_expert": (40, 256, 128, [0, 0, 40, 0]),
    "empty_first_last": (33, 136, 260, [0, 17, 16, 0]),
    "decode_like": (24, 128, 256, [3, 0, 1, 1, 4, 0, 7, 2]),
    "no_rows": (16, 128, 128, [0, 0, 0]),
}
# Small tiles so groups share row tiles and the reduction and columns take several steps.
TILES = {"gpu": GmmTiles(tile_m=16, tile_k=32, tile_n=32),
         "tpu": GmmTiles(tile_m=8, tile_k=128, tile_n=128)}


def _tiles(impl, K, N):
    if impl == "tpu" and (K % 128 or N % 128):
        return GmmTiles(tile_m=8, tile_k=K if K % 128 else 128, tile_n=N if N % 128 else 128)
    return TILES[impl]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16w", "fp8w"])
def test_kernel_matches_reference(impl, case, fp8):
    from pdjax.pallas_kernels.grouped_gemm.kernel_gpu import grouped_matmul_gpu
    from pdjax.pallas_kernels.grouped_gemm.kernel_tpu import grouped_matmul_tpu

    M, K, N, sizes = CASES[case]
    rng = np.random.default_rng(len(case))
    G = len(sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    if fp8:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        q, s, wf = _fp8_stack(rng, G, K, N)
        args, tol = (x, q, gs, s), 2e-2
    else:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        wf = rng.standard_normal((G, K, N)).astype(np.float32)
        args, tol = (x, jnp.asarray(wf), gs), 1e-4
    kernel = {"tpu": grouped_matmul_tpu, "gpu": grouped_matmul_gpu}[impl]
    with kernel_device(impl):
        out = np.asarray(kernel(*args, interpret=interpret_mode(impl),
                                tiles=_tiles(impl, K, N)), np.float64)
        ref = np.asarray(grouped_matmul_reference(*args), np.float64)
    want = _numpy_grouped(np.asarray(x, np.float32), wf, sizes)
    scale = np.abs(want).max() + 1
    assert out.shape == (M, N)
    assert np.abs(out - ref).max() <= tol * scale, case
    assert np.abs(out - want).max() <= tol * scale, case
    assert not out[sum(sizes):].any()                       # rows in no group are 0
    assert np.isfinite(out).all()


def test_default_tiles_and_dispatch():
    """The dispatch with the platform tiles (one row tile per group and more), and the
    reference path, on a case whose groups cross the GPU's 64-row tiles."""
    rng = np.random.default_rng(3)
    sizes = [70, 0, 1, 57]
    x = jnp.asarray(rng.standard_normal((130, 96)), jnp.float32)
    w = rng.standard_normal((4, 96, 80)).astype(np.float32)
    want = _numpy_grouped(x, w, sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    for impl in ("reference", "tpu", "gpu"):
        with kernel_device(impl):
            out = grouped_matmul(x, jnp.asarray(w), gs, impl=impl,
                                 interpret=interpret_mode(impl))
        assert np.abs(np.asarray(out) - want).max() < 1e-3, impl


def test_tpu_kernel_race_detector():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from pdjax.pallas_kernels.grouped_gemm.kernel_tpu import grouped_matmul_tpu

    rng = np.random.default_rng(5)
    q, s, wf = _fp8_stack(rng, 3, 256, 128)
    x = jnp.asarray(rng.standard_normal((20, 256)), jnp.float32)
    sizes = [7, 0, 11]
    with kernel_device("tpu"):
        out = grouped_matmul_tpu(x, q, jnp.asarray(sizes, jnp.int32), s,
                                 tiles=GmmTiles(tile_m=8, tile_k=256, tile_n=128),
                                 interpret=pltpu.InterpretParams(detect_races=True))
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    assert np.abs(np.asarray(out) - _numpy_grouped(x, wf, sizes)).max() < 1e-3


def test_group_metadata_is_the_work_list():
    """The module docstring's example: tm = 5, sizes [6, 3, 3, 0] over 15 rows."""
    g, tile, start, end, count = (np.asarray(a) for a in group_metadata(
        jnp.array([6, 3, 3, 0], jnp.int32), 15, 5))
    assert count.tolist() == [5]
    assert g[:5].tolist() == [0, 0, 1, 2, 2] and tile[:5].tolist() == [0, 1, 1, 1, 2]
    assert start.tolist() == [0, 6, 9, 12] and end.tolist() == [6, 9, 12, 12]
    assert len(g) == 3 + 4 - 1
    # Past the count the last item repeats (no new block fetched on TPU).
    assert g[5:].tolist() == [2] and tile[5:].tolist() == [2]
    # Sizes past M are cut at M; negative sizes count as 0.
    g, tile, start, end, count = (np.asarray(a) for a in group_metadata(
        jnp.array([-3, 4, 30], jnp.int32), 10, 4))
    assert end.tolist() == [0, 4, 10] and count.tolist() == [3]
    assert tile[:3].tolist() == [0, 1, 2]


def test_bad_inputs_are_clear_errors():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    q = jnp.zeros((2, 256, 128), jnp.float8_e4m3fn)
    s = jnp.ones((2, 2, 1), jnp.float32)
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="w_scale: a float8_e4m3fn w needs"):
        grouped_matmul(x, q, gs, impl="reference")
    with pytest.raises(ValueError, match=r"w_scale must be \[2, 2, 1\]"):
        grouped_matmul(x, q, gs, s[:, :1], impl="reference")
    with pytest.raises(ValueError, match="w_scale must be float32"):
        grouped_matmul(x, q, gs, s.astype(jnp.bfloat16), impl="reference")
    with pytest.raises(ValueError, match="group_sizes must be \\[2\\]"):
        grouped_matmul(x, q, gs[:1], s, impl="reference")
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        grouped_matmul(x, q, gs.astype(jnp.float32), s, impl="reference")
    with pytest.raises(ValueError, match="w's K"):
        grouped_matmul(x[:, :128], q, gs, s, impl="reference")
    with pytest.raises(ValueError, match="w's dtype"):
        grouped_matmul(x, jnp.zeros((2, 256, 128), jnp.float32), gs, impl="reference")
    with pytest.raises(ValueError, match="w_scale: given for a bfloat16 w"):
        grouped_matmul(x, q.astype(jnp.bfloat16), gs, s, impl="reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(x, q, gs, s, impl="cuda")
    from pdjax.pallas_kernels.grouped_gemm.kernel_gpu import grouped_matmul_gpu
    from pdjax.pallas_kernels.grouped_gemm.kernel_tpu import grouped_matmul_tpu
    with pytest.raises(ValueError, match="tiles.tile_m must be a power of two"):
        grouped_matmul_gpu(x, q, gs, s, tiles=GmmTiles(24, 32, 32), interpret=True)
    with pytest.raises(ValueError, match="must divide the FP8 scale block"):
        grouped_matmul_gpu(x, q, gs, s, tiles=GmmTiles(16, 256, 32), interpret=True)
    with pytest.raises(ValueError, match="tiles.tile_k must be K"):
        grouped_matmul_tpu(x, q, gs, s, tiles=GmmTiles(8, 192, 128), interpret=True)
    with pytest.raises(ValueError, match="tiles.tile_m must be a multiple of 8"):
        grouped_matmul_tpu(x, q, gs, s, tiles=GmmTiles(12, 128, 128), interpret=True)
    with pytest.raises(ValueError, match="GmmTiles.tile_n must be a positive int"):
        GmmTiles(8, 128, 0)
    # Real DeepSeek-V3.2 expert shapes at TP 8: whole-block TPU tiles, 128-wide GPU tiles.
    # Row tiles follow the rows an expert gets: 64 in the extend step, 4 in a decode step.
    assert get_tiles("tpu", num_rows=16384, k=7168, n=256, fp8=True,
                     num_groups=256) == GmmTiles(128, 1024, 256)
    assert get_tiles("tpu", num_rows=1024, k=7168, n=256, fp8=True, num_groups=256).tile_m == 16
    assert get_tiles("gpu", num_rows=16384, k=7168, n=256, fp8=True, num_groups=256) == \
        GmmTiles(64, 128, 128, num_warps=4, num_stages=3)
    assert get_tiles("gpu", num_rows=1024, k=256, n=7168, fp8=True, num_groups=256).tile_m == 16


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_fp8_dense_gemm_matches_reference(impl):
    """x [2, 5, K] (leading axes kept) times a [K, N] float8 weight with partial edge blocks."""
    rng = np.random.default_rng(7)
    wf = rng.standard_normal((200, 300)).astype(np.float32)
    q, s = quantize(wf, ue8m0=True)
    x = jnp.asarray(rng.standard_normal((2, 5, 200)), jnp.float32)
    with kernel_device(impl):
        out = fp8_matmul(x, jnp.asarray(q), jnp.asarray(s), impl=impl,
                         interpret=interpret_mode(impl))
        ref = fp8_matmul_reference(x, jnp.asarray(q), jnp.asarray(s))
    want = np.asarray(x, np.float64) @ dequantize(q, s).astype(np.float64)
    assert out.shape == (2, 5, 300)
    assert np.abs(np.asarray(out) - want).max() < 1e-3
    assert np.abs(np.asarray(ref) - want).max() < 1e-3
    with pytest.raises(ValueError, match=r"scale_inv must be \[2, 3\]"):
        fp8_matmul(x, jnp.asarray(q), jnp.asarray(s)[:, :2])
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        fp8_matmul(x, jnp.asarray(wf), jnp.asarray(s))


@pytest.mark.parametrize("impl,platform,custom_call", [
    ("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_kernels_lower_at_deepseek_shapes(impl, platform, custom_call):
    """DeepSeek-V3.2's per-device experts at TP 8 (7168 -> 256 -> 7168, 256 experts, FP8)
    for a 2,048-token extend (16,384 routed rows); the dense FP8 GEMM of q_b_proj."""
    S = jax.ShapeDtypeStruct
    with lowering_context(platform):
        for K, N in ((7168, 256), (256, 7168)):
            args = (S((16384, K), jnp.bfloat16), S((256, K, N), jnp.float8_e4m3fn),
                    S((256,), jnp.int32), S((256, K // 128, N // 128), jnp.float32))
            fn = functools.partial(grouped_matmul, impl=impl)
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert text.count(custom_call) == 1
        args = (S((128, 1536), jnp.bfloat16), S((1536, 3072), jnp.float8_e4m3fn),
                S((12, 24), jnp.float32))
        text = jax.jit(functools.partial(fp8_matmul, impl=impl)).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()
        assert text.count(custom_call) == 1


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_layer_of_a_stack_is_read_in_place(impl):
    """``layer``: the kernels take the whole stack [L, G, K, N] and the layer index (the
    layer scan's), and equal the reference on ``w[layer]``; the dense FP8 GEMM too."""
    rng = np.random.default_rng(11)
    L, sizes = 3, [4, 0, 9]
    stacks = [_fp8_stack(rng, 3, 256, 128) for _ in range(L)]
    q = jnp.stack([s[0] for s in stacks])
    x = jnp.asarray(rng.standard_normal((15, 256)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    for layer in (0, 2):
        with kernel_device(impl):
            out = jax.jit(functools.partial(grouped_matmul, impl=impl,
                                            interpret=interpret_mode(impl)))(
                x, q, gs, stacks[layer][1], layer=jnp.int32(layer))
        want = _numpy_grouped(x, stacks[layer][2], sizes)
        assert np.abs(np.asarray(out) - want).max() < 1e-3, layer
        ref = grouped_matmul_reference(x, q, gs, stacks[layer][1], layer=jnp.int32(layer))
        assert np.abs(np.asarray(ref) - want).max() < 1e-3
    with kernel_device(impl):
        dense = fp8_matmul(x, q[:, 1], stacks[1][1][1], layer=jnp.int32(1), impl=impl,
                           interpret=interpret_mode(impl))
    want = np.asarray(x, np.float64) @ stacks[1][2][1]
    assert np.abs(np.asarray(dense) - want).max() < 1e-3
    with pytest.raises(ValueError, match=r"w must be \[layers, groups, K, N\] with layer"):
        grouped_matmul(x, q[0], gs, stacks[0][1], layer=jnp.int32(0), impl="reference")
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        grouped_matmul(x, q, gs, stacks[0][1], layer=jnp.zeros(2, jnp.int32), impl="reference")
