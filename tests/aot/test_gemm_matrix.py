"""The GEMM rows of the AOT kernel matrix (``pdjax.aot.gemm_cases``): the cases and their
per-device shapes are plain Python; the compile for an H200 runs where the CUDA plugin is
installed (``.venv-cuda``, as tests/pallas_kernels/test_gpu_compile.py), else it skips::

    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. \\
        .venv-cuda/bin/python -m pytest tests/aot/test_gemm_matrix.py
"""

import math

import jax.numpy as jnp
import pytest

from pdjax.aot import gemm_cases as gc
from pdjax.aot import kernel_matrix as km
from pdjax.aot.targets import cuda_plugin_missing, gpu_environment


def _case(kernel, model, dtype, bucket):
    return next(c for c in gc.gemm_cases(km.BUCKETS) if c.kernel == kernel
                and c.shape.model == model and c.kv_dtype == dtype and c.bucket.name == bucket)


def test_cases_cover_the_real_moe_layouts():
    cases = gc.gemm_cases(km.BUCKETS)
    # 3 layouts x 2 buckets x 2 weight dtypes of gmm + 2 layouts with dense linears x 2 buckets.
    assert len(cases) == 3 * 2 * 2 + 2 * 2 == 16
    assert len({c.label for c in cases}) == 16
    assert {c.kernel for c in gc.gemm_cases(km.BUCKETS, kernels=["fp8_gemm"])} == {"fp8_gemm"}
    assert {c.shape.model for c in gc.gemm_cases(km.BUCKETS, models=["deepseek-v3.2"])} == {
        "deepseek-v3.2", "deepseek-v3.2/ep8"}
    # DeepSeek-V3.2's extend bucket at TP 8: 16,384 routed rows, 256 experts of F = 256.
    _, args = gc.case_function(_case("gmm", "deepseek-v3.2", "float8_e4m3fn", "mixed"), "gpu")
    assert [a[0] for a in args] == [(16384, 7168), (256,), (256, 7168, 256), (256, 56, 2),
                                    (256, 7168, 256), (256, 56, 2), (256, 256, 7168),
                                    (256, 2, 56)]
    assert jnp.dtype(args[2][1]) == jnp.float8_e4m3fn
    # EP 8: 32 whole experts.
    _, args = gc.case_function(_case("gmm", "deepseek-v3.2/ep8", "bfloat16", "decode"), "tpu")
    assert [a[0] for a in args] == [(1024, 7168), (32,), (32, 7168, 2048), (32, 7168, 2048),
                                    (32, 2048, 7168)]
    # The FP8 dense linears: q_b_proj at TP 8 is 1536 -> 16 heads x 192.
    _, args = gc.case_function(_case("fp8_gemm", "deepseek-v3.2", "float8_e4m3fn", "decode"),
                               "gpu")
    assert len(args) == 3 * 8 and args[7][0] == (1536, 3072) and args[8][0] == (12, 24)
    with pytest.raises(ValueError, match="kernel must be one of"):
        gc.case_function(km.KernelCase("gemm", cases[0].shape, "bfloat16", 0, km.BUCKETS[0]),
                         "gpu")


@pytest.mark.slow
def test_extend_gmm_compiles_for_h200_without_a_dense_operand():
    gpu_environment()
    missing = cuda_plugin_missing()
    if missing is not None:
        pytest.skip(f"CUDA plugin missing ({missing})")
    from pdjax.aot.targets import gpu_target
    target = gpu_target("h200", num_gpus=1)
    case = _case("gmm", "deepseek-v3.2", "float8_e4m3fn", "mixed")
    result = km.run_case(case, target)
    assert result.ok and result.kernel_calls == 3, result.error
    # XLA's ragged_dot builds [experts, rows, hidden]: 256 x 16384 x 7168 x 2 B = 56 GiB.
    dense_operand = 256 * 16384 * 7168 * 2
    assert 0 < result.temp_bytes < dense_operand / 1000
    assert result.temp_bytes <= 2 * 16384 * 256 * 2 + (1 << 20)     # gate and up outputs
    assert math.isfinite(result.compile_s)


@pytest.mark.slow
def test_a_layer_of_the_stack_is_not_copied_on_h200():
    """The expert stack [L, E, K, N] with the layer index: no copy of the layer (448 MiB at
    DeepSeek-V3.2's TP-8 gate shape) before the kernel, as a slice passed to it would be."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    gpu_environment()
    missing = cuda_plugin_missing()
    if missing is not None:
        pytest.skip(f"CUDA plugin missing ({missing})")
    from pdjax.aot.targets import gpu_target
    from pdjax.pallas_kernels.grouped_gemm import grouped_matmul
    target = gpu_target("h200", num_gpus=1)
    sharding = NamedSharding(Mesh(target.devices[:1], ("tp",)), P())
    S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = (S((1024, 7168), jnp.bfloat16), S((256,), jnp.int32),
            S((4, 256, 7168, 256), jnp.float8_e4m3fn), S((256, 56, 2), jnp.float32),
            S((), jnp.int32))
    layer_bytes = 256 * 7168 * 256
    temps = {}
    for name, fn in (("view", lambda x, g, q, s, i: grouped_matmul(x, q, g, s, layer=i,
                                                                     impl="gpu")),
                     ("slice", lambda x, g, q, s, i: grouped_matmul(x, q[i], g, s,
                                                                      impl="gpu"))):
        with target.device_context():
            compiled = jax.jit(fn).trace(*args).lower().compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["slice"] >= layer_bytes > 50 * temps["view"], temps
