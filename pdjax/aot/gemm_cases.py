"""The GEMM kernels' rows of the AOT kernel matrix (``kernel_matrix``): the MoE's grouped GEMM
(``pallas_kernels/grouped_gemm``) and the dense block-scaled FP8 GEMM
(``pallas_kernels/fp8_gemm``) at the per-device shapes of real DeepSeek-V3.2 and GLM-5.

A case is a ``kernel_matrix.KernelCase`` whose ``shape`` is a ``GemmShape``, ``kv_dtype`` the
weight dtype (``bfloat16`` or ``float8_e4m3fn``) and ``page_size`` 0 (no cache):

* ``gmm``: the routed experts of one MoE layer, gate / up ``[M, H] x [E, H, F]`` and down
  ``[M, F] x [E, F, H]`` for the ``M = tokens x experts_per_token`` routed rows of a bucket
  (three custom calls). TP 8 holds all 256 experts at ``F = 2048 / 8``; EP 8 holds 32 whole
  experts. The compiled temp is the proof that no ``[E, M, H]`` operand exists: XLA's
  ``ragged_dot`` needs 56 GiB at the DeepSeek-V3.2 extend bucket (BENCHMARKS.md).
* ``fp8_gemm``: the FP8 dense linears of one layer at TP 8 (``DENSE_LINEARS``: MLA's
  projections, the shared expert, the indexer's), one custom call each.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pdjax.aot.kernel_case import KernelCase


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """Per-device GEMM shapes of one model at one parallel layout.

    ``tp`` / ``ep``: tensor / expert parallel degrees (``ep`` divides the experts, ``tp / ep``
    splits each expert's ``moe_intermediate``; ``model`` ends in ``/ep8`` when ``ep`` > 1, so the
    table tells the layouts apart). ``dense``: ``(name, K, N)`` of each FP8 dense
    linear on one device. ``family`` is ``"gemm"`` (the attention shapes' field)."""

    model: str
    tp: int
    ep: int
    hidden: int
    moe_intermediate: int
    experts: int
    experts_per_token: int
    dense: tuple[tuple[str, int, int], ...] = ()
    family: str = "gemm"

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def local_intermediate(self) -> int:
        return self.moe_intermediate // (self.tp // self.ep)


def _dense(hidden, q_lora, heads, nope, rope, v, index_heads, shared, tp):
    """The FP8 dense linears at TP ``tp`` (config.json values; head and MLP widths split)."""
    return (("q_a_proj", hidden, q_lora), ("kv_a_proj", hidden, 512 + rope),
            ("q_b_proj", q_lora, heads * (nope + rope) // tp),
            ("o_proj", heads * v // tp, hidden),
            ("shared_gate", hidden, shared // tp), ("shared_down", shared // tp, hidden),
            ("indexer_wq_b", q_lora, index_heads * 128), ("indexer_wk", hidden, 128))


_DSV32 = dict(hidden=7168, moe_intermediate=2048, experts=256, experts_per_token=8)
_GLM5 = dict(hidden=6144, moe_intermediate=2048, experts=256, experts_per_token=8)
GEMM_SHAPES = (
    GemmShape("deepseek-v3.2", 8, 1, **_DSV32,
              dense=_dense(7168, 1536, 128, 128, 64, 128, 64, 2048, 8)),
    GemmShape("deepseek-v3.2/ep8", 8, 8, **_DSV32),
    GemmShape("glm-5", 8, 1, **_GLM5, dense=_dense(6144, 2048, 64, 192, 64, 256, 32, 2048, 8)),
)
GEMM_KERNELS = ("gmm", "fp8_gemm")
WEIGHT_DTYPES = ("bfloat16", "float8_e4m3fn")


def gemm_cases(buckets, kernels=None, models=None) -> list:
    """``gmm`` for every shape x weight dtype x bucket; ``fp8_gemm`` for every shape with dense
    linears x bucket. ``kernels`` / ``models`` filter by name."""
    cases = []
    for shape in GEMM_SHAPES:
        if models and shape.model.split("/")[0] not in models:
            continue
        for bucket in buckets:
            cases += [KernelCase("gmm", shape, dt, 0, bucket) for dt in WEIGHT_DTYPES]
            if shape.dense:
                cases.append(KernelCase("fp8_gemm", shape, "float8_e4m3fn", 0, bucket))
    return [c for c in cases if kernels is None or c.kernel in set(kernels)]


def _weight_args(shape_kn, groups, dtype):
    import jax.numpy as jnp
    K, N = shape_kn
    lead = () if groups is None else (groups,)
    if jnp.dtype(dtype).itemsize == 2:
        return [((*lead, K, N), jnp.dtype(dtype))]
    return [((*lead, K, N), jnp.float8_e4m3fn),
            ((*lead, -(-K // 128), -(-N // 128)), jnp.float32)]


def case_function(case, platform: str) -> tuple[Callable, list[tuple]]:
    """The jittable function of a GEMM case and its ``(shape, dtype)`` arguments."""
    import jax
    import jax.numpy as jnp

    s, t = case.shape, case.bucket.num_tokens
    fp8 = jnp.dtype(case.kv_dtype).itemsize == 1
    if case.kernel == "gmm":
        from pdjax.pallas_kernels.grouped_gemm import grouped_matmul
        E, H, F = s.local_experts, s.hidden, s.local_intermediate
        M = t * s.experts_per_token
        per = 2 if fp8 else 1

        def experts(x, group_sizes, *w):
            gate, up, down = (w[i * per:(i + 1) * per] for i in range(3))
            g = grouped_matmul(x, gate[0], group_sizes, *gate[1:], impl=platform)
            u = grouped_matmul(x, up[0], group_sizes, *up[1:], impl=platform)
            return grouped_matmul(jax.nn.silu(g) * u, down[0], group_sizes, *down[1:],
                                  impl=platform)

        args = [((M, H), jnp.bfloat16), ((E,), jnp.int32)]
        for kn in ((H, F), (H, F), (F, H)):
            args += _weight_args(kn, E, case.kv_dtype)
        return experts, args
    if case.kernel == "fp8_gemm":
        from pdjax.pallas_kernels.fp8_gemm import fp8_matmul

        def linears(*a):
            return tuple(fp8_matmul(a[3 * i], a[3 * i + 1], a[3 * i + 2], impl=platform)
                         for i in range(len(s.dense)))

        args = []
        for _, K, N in s.dense:
            args += [((t, K), jnp.bfloat16), *_weight_args((K, N), None, case.kv_dtype)]
        return linears, args
    raise ValueError(f"kernel must be one of {GEMM_KERNELS}, got {case.kernel!r}")
