"""One linear over two weight formats (``pdjax/models/linear.py``) and the platform profile that
picks the format (``pdjax/models/platform.py``); the whole packed model against XLA's dots is
tests/models/test_llama_parity.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_utils import require_matmul_kernel
from pdjax.models.linear import PackedWeight, linear, linear_group
from pdjax.models.platform import PlatformProfile
from pdjax.pallas_kernels.dense_cpu import PANEL

K = 40
WIDTHS = (5, 30, 7)          # 42 columns: two panels, the second 18 columns of padding


def _weights(seed=0, lead=()):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((*lead, K, n), np.float32)) for n in WIDTHS]


def _x(rows, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, K), np.float32))


def test_a_plain_weight_is_the_dot_and_ignores_num_rows():
    (w, *_), x = _weights(), _x(5)
    want = np.asarray(x @ w)
    np.testing.assert_array_equal(np.asarray(linear(x, w)), want)
    np.testing.assert_array_equal(np.asarray(linear(x, w, jnp.int32(2))), want)
    outs = linear_group(x, {"a": w, "b": w}, "ab", ("a", "b"))
    assert len(outs) == 2 and all(np.array_equal(np.asarray(o), want) for o in outs)


def test_a_packed_group_is_one_matmul_split_into_its_members():
    require_matmul_kernel()
    ws, x = _weights(), _x(5)
    packed = PackedWeight.from_linear(ws)
    assert packed.widths == WIDTHS and packed.out_features == 42
    assert packed.panels.shape == (2, K, PANEL)
    assert jax.tree.leaves(packed) == [packed.panels]        # widths are static
    fused = linear_group(x, {"abc": packed}, "abc", ("a", "b", "c"))
    plain = linear_group(x, dict(zip("abc", ws)), "abc", ("a", "b", "c"))
    assert [o.shape for o in fused] == [(5, n) for n in WIDTHS]
    for got, want in zip(fused, plain):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    # Rows from num_rows on are the bucket's padding: the packed matmul leaves them 0.
    out = np.asarray(linear(x, packed, jnp.int32(2)))
    np.testing.assert_allclose(out[:2], np.asarray(x[:2] @ jnp.concatenate(ws, -1)),
                               rtol=0, atol=1e-5)
    np.testing.assert_array_equal(out[2:], 0)


def test_a_stacked_packed_weight_is_sliced_per_layer_by_a_scan():
    """Packed from ``[L, K, N]`` stacks, the panels keep the layer axis, and ``lax.scan``
    hands each step its layer's ``PackedWeight`` (the scanned Llama forward)."""
    require_matmul_kernel()
    ws, x = _weights(2, lead=(3,)), _x(4)
    packed = PackedWeight.from_linear(ws)
    assert packed.panels.shape == (3, 2, K, PANEL)

    def step(carry, w):
        return carry, linear(x, w)

    _, per_layer = jax.lax.scan(step, 0, packed)
    want = np.asarray(jnp.einsum("tk,lkn->ltn", x, jnp.concatenate(ws, -1)))
    np.testing.assert_allclose(np.asarray(per_layer), want, rtol=0, atol=1e-5)


def test_the_profile_is_resolved_and_checked():
    tpu = PlatformProfile.resolve("tpu")
    assert (tpu.attention_impl, tpu.unroll_layers, tpu.cpu_matmul_kernel) == ("tpu", False, False)
    scanned = PlatformProfile.resolve("cpu", layer_stack=False)
    assert not scanned.unroll_layers and not scanned.cpu_matmul_kernel
    with pytest.raises(ValueError, match="cpu_matmul_kernel: the backend is gpu"):
        PlatformProfile.resolve("gpu", cpu_matmul_kernel=True)
    with pytest.raises(ValueError, match="^attention_impl: must be a resolved"):
        PlatformProfile("cpu", "auto")
    with pytest.raises(ValueError, match="^unroll_layers: must be true or false"):
        PlatformProfile("cpu", "xla", unroll_layers=1)
