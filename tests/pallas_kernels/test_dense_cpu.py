"""The native CPU matmul over packed weights (``pdjax.pallas_kernels.dense_cpu``) against numpy
in float64 (the packed model forward: tests/models/test_llama_parity.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.pallas_kernels import dense_cpu
from model_utils import require_matmul_kernel
from pdjax.pallas_kernels.dense_cpu import PANEL, pack_weight, packed_matmul


def _oracle(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("k,n", [(8, 8), (64, 24), (100, 25), (576, 1000), (37, 4800)])
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 16, 17, 64, 257])
def test_packed_matmul_matches_float64(m, k, n):
    """Row blocks of every kind (with AVX-512's blocks of at most 9: one block of 1, 3, 7, 8 or
    9 rows, 16 as 8 + 8, 17 as 8 + 9; with 4: 17 as 3 + 3 + 4 + 3 + 4; 64 and 257 as many
    blocks), a last panel of 1-23 columns, and
    a work split of many claims (4,800 columns: 200 panels) equal ``x @ w`` within float32
    rounding of a K-term sum."""
    require_matmul_kernel()
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    got = np.asarray(jax.jit(packed_matmul, static_argnums=2)(x, pack_weight(w), n))
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _oracle(x, w), rtol=0, atol=2e-6 * k ** 0.5 * 8)


@pytest.mark.parametrize("num_rows,m", [(0, 16), (1, 16), (8, 16), (9, 16), (15, 16),
                                        (16, 16), (40, 16), (-3, 16), (5, 5)])
def test_packed_matmul_num_rows_computes_the_first_rows_and_zeros_the_rest(num_rows, m):
    """Only the first ``num_rows`` rows (a step's real tokens; traced, so one executable serves
    every count) are multiplied; the padding rows come back 0 even where ``x`` holds NaN
    there, and counts outside ``[0, M]`` are clamped."""
    require_matmul_kernel()
    rng = np.random.default_rng(num_rows + 100)
    x = rng.standard_normal((m, 64), np.float32)
    w = rng.standard_normal((64, 50), np.float32)
    used = min(max(num_rows, 0), m)
    x[used:] = np.nan
    f = jax.jit(packed_matmul, static_argnums=2)
    got = np.asarray(f(x, pack_weight(w), 50, jnp.int32(num_rows)))
    np.testing.assert_allclose(got[:used], _oracle(x[:used], w), rtol=0, atol=1e-4)
    assert np.array_equal(got[used:], np.zeros((m - used, 50), np.float32))


def test_packed_matmul_bfloat16_weights_leading_axes_and_dtype():
    """bfloat16 weights are widened exactly (the result is the float32 product of the
    bfloat16 values); ``x`` may have leading axes and a bfloat16 dtype, which the result
    keeps."""
    require_matmul_kernel()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 48), np.float32)
    w = jnp.asarray(rng.standard_normal((48, 50), np.float32), jnp.bfloat16)
    got = packed_matmul(jnp.asarray(x), pack_weight(w), 50)
    assert got.shape == (2, 5, 50) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _oracle(x, np.asarray(w, np.float32)),
                               rtol=0, atol=1e-4)
    xb = jnp.asarray(x, jnp.bfloat16)
    got = packed_matmul(xb, pack_weight(w), 50)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               _oracle(np.asarray(xb, np.float32), np.asarray(w, np.float32)),
                               rtol=1e-2, atol=1e-2)


def test_pack_weight_layout_and_round_trip():
    """Panel ``p`` holds columns ``[24p, 24p + 24)`` row by row, the last one zero-padded;
    leading (layer) axes are kept; putting the panels side by side again gives the weight."""
    w = np.arange(3 * 5 * 50, dtype=np.float32).reshape(3, 5, 50)
    packed = np.asarray(pack_weight(jnp.asarray(w)))
    assert packed.shape == (3, 3, 5, PANEL)
    np.testing.assert_array_equal(packed[1, 2, 4, :2], w[1, 4, 48:50])
    np.testing.assert_array_equal(packed[1, 2, :, 2:], 0)
    np.testing.assert_array_equal(packed[2, 1, 3], w[2, 3, 24:48])
    side_by_side = np.moveaxis(packed, -3, -2).reshape(3, 5, 3 * PANEL)
    np.testing.assert_array_equal(side_by_side[..., :50], w)


def test_packed_matmul_is_one_custom_call_and_rejects_bad_weights(monkeypatch):
    """The lowered program calls the kernel once; a weight that is not packed for ``x`` and
    ``n`` is a ValueError naming ``w``; an unavailable kernel is a RuntimeError saying why."""
    require_matmul_kernel()
    x = jnp.ones((4, 16), jnp.float32)
    w = pack_weight(jnp.ones((16, 30), jnp.float32))
    text = jax.jit(packed_matmul, static_argnums=2).lower(x, w, 30).as_text()
    assert text.count(dense_cpu.FFI_TARGET) == 1
    for bad, n in ((w, 49), (w, 24), (w[:, :8], 30), (jnp.ones((16, 30)), 30),
                   (w.astype(jnp.float16), 30)):
        with pytest.raises(ValueError, match="w: a packed"):
            packed_matmul(x, bad, n)
    monkeypatch.setattr(dense_cpu, "matmul_kernel_status", lambda: (False, "no compiler"))
    with pytest.raises(RuntimeError, match="no compiler"):
        packed_matmul(x, w, 30)
