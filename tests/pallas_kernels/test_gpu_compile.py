"""The Pallas GPU kernels compile for H100 and H200 (Triton and ptxas, no GPU or driver).

Lowering for ``cuda`` (the other kernel tests) does not run Triton; a compile against a
compile-only device of ``pdjax.aot.targets.gpu_target`` does, with the target's shared memory
and register limits. These tests need the CUDA plugin (``jax[cuda12]``, its own virtualenv);
where it is missing they skip, but for the checks of the target list and the case matrix,
which are plain Python::

    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. \\
        .venv-cuda/bin/python -m pytest tests/pallas_kernels/test_gpu_compile.py

``PDJAX_GPU_COMPILE_ALL=1`` compiles the whole ``pdjax.aot.kernel_matrix`` matrix (192 cases
per GPU, a few minutes) instead of the representative subset.
"""

import dataclasses
import math
import os

import jax
import numpy as np
import pytest

from pdjax.aot import kernel_matrix as km
from pdjax.aot.targets import cuda_plugin_missing, gpu_environment, gpu_target, gpu_target_names

gpu_environment()     # before any backend starts: no device is looked for, no driver checked
CUDA_MISSING = cuda_plugin_missing()
needs_cuda = pytest.mark.skipif(CUDA_MISSING is not None,
                                reason=f"CUDA plugin missing ({CUDA_MISSING})")
TRITON_CALL = km.KERNEL_CALLS["gpu"]


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """A compile-only executable must come from the compiler, not from the suite's cache."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture(scope="module", params=["h100", "h200"])
def target(request):
    if CUDA_MISSING is not None:
        pytest.skip(f"CUDA plugin missing ({CUDA_MISSING})")
    return gpu_target(request.param)


def _shape(model: str, tp: int) -> km.AttentionShape:
    return next(s for s in km.MODEL_SHAPES if s.model == model and s.tp == tp)


def _case(kernel, model, tp, kv_dtype, page_size, bucket) -> km.KernelCase:
    return km.KernelCase(kernel, _shape(model, tp), kv_dtype, page_size,
                         next(b for b in km.BUCKETS if b.name == bucket))


def test_target_names_and_unknown_name():
    assert gpu_target_names() == ("h100", "h200")
    with pytest.raises(ValueError, match=r"gpu: unknown GPU target 'a100'.*h100, h200"):
        gpu_target("a100")
    with pytest.raises(ValueError, match="num_gpus"):
        gpu_target("h200", num_gpus=9)


def test_missing_plugin_is_a_clear_error():
    if CUDA_MISSING is None:
        pytest.skip("the CUDA plugin is installed here")
    with pytest.raises(ValueError, match=r"gpu: compiling for h200 needs the CUDA plugin.*"
                                         r"jax\[cuda12\]"):
        gpu_target("h200")


def test_matrix_covers_the_supported_models():
    cases = km.kernel_cases()
    # 4 GQA shapes x 3 pages x 2 buckets x 2 dtypes + 4 MLA shapes x 3 pages x 2 buckets x 3
    # kernels x 2 KV dtypes (bf16, the FP8 record / FP8 indexer keys).
    assert len(cases) == 4 * 3 * 2 * 2 + 4 * 3 * 2 * 3 * 2 == 192
    rpa = {(c.shape.num_q_heads, c.shape.num_kv_heads, c.shape.head_dim)
           for c in cases if c.kernel == "rpa"}
    assert rpa == {(32, 8, 128), (8, 1, 128), (16, 2, 128), (9, 3, 64)}
    assert {c.kv_dtype for c in cases if c.kernel == "rpa"} == {"bfloat16", "float8_e4m3fn"}
    assert {c.page_size for c in cases} == {16, 32, 64}
    mla = {(c.kernel, c.shape.model, c.shape.num_q_heads) for c in cases
           if c.shape.family == "mla"}
    assert mla == {(k, m, h) for k in ("mla_dense", "mla_sparse", "indexer")
                   for m, h in (("deepseek-v3.2", 128), ("deepseek-v3.2", 16), ("glm-5", 64),
                                ("glm-5", 8))}
    assert {(c.shape.index_heads, c.shape.index_topk) for c in cases
            if c.kernel == "indexer"} == {(64, 2048), (32, 2048)}
    assert {c.kv_dtype for c in cases if c.shape.family == "mla"} == {"bfloat16",
                                                                       "float8_e4m3fn"}
    assert len({c.label for c in cases}) == 192


@needs_cuda
@pytest.mark.parametrize("name,kind", [("h100", "NVIDIA H100 80GB HBM3"),
                                       ("h200", "NVIDIA H200")])
def test_gpu_target_gives_compile_only_devices(name, kind):
    t = gpu_target(name)
    assert (t.name, t.platform, t.chip, len(t.devices)) == (name, "gpu", name, 8)
    assert t.device_kind == kind
    assert [d.id for d in t.devices] == list(range(8))
    assert len(gpu_target(name, num_gpus=1).devices) == 1


def _argument_bytes(case: km.KernelCase) -> int:
    """Bytes of the arguments the compiled program keeps: all of them, but for ``distribution``
    (``[3]`` int32) in the MLA and indexer kernels, which do not read it (jit drops it)."""
    _, args = km.case_function(case, "gpu")
    total = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in args)
    return total - (0 if case.kernel == "rpa" else 3 * 4)


# Representative cases: every GQA shape (group 4, 8, 8 and 3 with head_dim 64), both KV dtypes,
# every page size, both buckets; MLA dense and sparse at 128 and 16 heads; the indexer + top-k.
# Kernel custom calls per case: ragged attention runs its decode, prefill and mixed kernels.
SUBSET = [
    (_case("rpa", "llama3-8b", 1, "bfloat16", 16, "decode"), 3),
    (_case("rpa", "llama3-8b", 1, "float8_e4m3fn", 64, "mixed"), 3),
    (_case("rpa", "llama3-70b", 8, "float8_e4m3fn", 32, "decode"), 3),
    (_case("rpa", "qwen3-32b", 4, "bfloat16", 64, "mixed"), 3),
    (_case("rpa", "smollm2-135m", 1, "bfloat16", 16, "mixed"), 3),
    (_case("rpa", "smollm2-135m", 1, "float8_e4m3fn", 64, "decode"), 3),
    (_case("mla_dense", "deepseek-v3.2", 1, "bfloat16", 64, "decode"), 1),
    (_case("mla_sparse", "deepseek-v3.2", 1, "bfloat16", 64, "mixed"), 1),
    (_case("mla_sparse", "deepseek-v3.2", 8, "bfloat16", 16, "decode"), 1),
    (_case("mla_dense", "deepseek-v3.2", 8, "bfloat16", 32, "mixed"), 1),
    (_case("indexer", "deepseek-v3.2", 1, "bfloat16", 64, "mixed"), 1),
    (_case("mla_sparse", "glm-5", 8, "bfloat16", 64, "mixed"), 1),
    (_case("indexer", "glm-5", 1, "bfloat16", 16, "decode"), 1),
    # FP8 KV: the 656-byte record's planes and the FP8 indexer keys with their scales.
    (_case("mla_sparse", "deepseek-v3.2", 8, "float8_e4m3fn", 64, "mixed"), 1),
    (_case("mla_dense", "deepseek-v3.2", 1, "float8_e4m3fn", 16, "decode"), 1),
    (_case("indexer", "deepseek-v3.2", 1, "float8_e4m3fn", 64, "mixed"), 1),
]


@pytest.mark.parametrize("case,calls", SUBSET, ids=[c.label.replace(" ", "-") for c, _ in SUBSET])
def test_kernel_compiles(target, case, calls):
    compiled = km.compile_case(case, target)
    hlo = compiled.as_text()
    assert hlo.count(TRITON_CALL) == calls
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == _argument_bytes(case)
    assert mem.temp_size_in_bytes > 0


def test_run_case_reports_a_pass_and_a_rejected_kernel(target):
    ok = km.run_case(SUBSET[0][0], target)
    assert (ok.ok, ok.kernel_calls, ok.error) == (True, 3, "")
    assert ok.compile_s > 0 and ok.argument_bytes == _argument_bytes(SUBSET[0][0])
    # head_dim 96 is not a Triton tile: the case fails with the kernel's own error, no raise.
    odd = dataclasses.replace(SUBSET[0][0], shape=dataclasses.replace(
        SUBSET[0][0].shape, head_dim=96))
    bad = km.run_case(odd, target)
    assert not bad.ok and bad.kernel_calls == 0
    assert "head_dim must be a power of two >= 16 for the GPU kernel, got 96" in bad.error
    assert km.format_row(bad).split()[-1] != "ok" and "FAIL ValueError" in km.format_row(bad)


@pytest.mark.skipif(os.environ.get("PDJAX_GPU_COMPILE_ALL") != "1",
                    reason="the whole matrix: PDJAX_GPU_COMPILE_ALL=1")
def test_whole_matrix_compiles(target):
    results = km.run_matrix(target, km.kernel_cases())
    failed = [f"{r.case.label}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.kernel_calls == (3 if r.case.kernel == "rpa" else 1) for r in results)


def test_compile_catches_what_lowering_cannot(target):
    """Block sizes whose K/V stages overflow shared memory lower fine for ``cuda`` but the
    compile refuses them against the target's 227 KiB (``shared_memory_per_block_optin``)."""
    import functools

    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pdjax.pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
    from pdjax.pallas_kernels.ragged_paged_attention.tuning import BlockSizes

    sharding = NamedSharding(Mesh(target.devices[:1], ("x",)), PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    cache = spec((2, 257, 16, 1, 128), jnp.bfloat16)
    args = (spec((64, 8, 128), jnp.bfloat16), cache, cache, spec((), jnp.int32),
            spec((64,), jnp.int32), spec((64, 16), jnp.int32), spec((65,), jnp.int32),
            spec((3,), jnp.int32))
    # 4 stages x 1024 rows x (K + V) x 128 x 2 bytes = 2 MiB of stages, far over 227 KiB.
    huge = {path: BlockSizes(1 if path == "decode" else 16, kv_tokens=1024, num_stages=4)
            for path in ("decode", "prefill", "mixed")}
    fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1, block_sizes=huge))
    with jax.default_device(target.devices[0]):
        lowered = fn.trace(*args).lower()
        assert lowered.as_text().count(TRITON_CALL) == 3
        with pytest.raises(Exception, match=r"Shared memory size limit exceeded.*available: "
                                            r"232448"):
            lowered.compile()


def test_gpu_tiles_of_128_by_128_take_8_warps():
    """The H200 compile showed every head_dim-128 prefill/mixed kernel of 128-row tiles over 4
    warps spilling (ptxas: 255 registers, 136-232 bytes of spill stores: Llama-3 8B fp8 or
    page 32/64, Llama-3 70B TP 8, Qwen3-30B-A3B); 8 warps do not spill. The GPU table no
    longer depends on the page size (rows are gathered), and warps follow the tile."""
    from pdjax.pallas_kernels.ragged_paged_attention.tuning import get_block_sizes, gpu_group_pad

    def sizes(path, group, page_size, kv_bits, head_dim=128):
        return get_block_sizes("gpu", path, head_dim=head_dim, group=group,
                               page_size=page_size, kv_bits=kv_bits, max_pages=512,
                               num_tokens=2048)

    for group, kv_bits, page_size in ((4, 8, 16), (4, 16, 64), (8, 16, 16), (8, 8, 32)):
        for path in ("prefill", "mixed"):
            bs = sizes(path, group, page_size, kv_bits)
            rows = bs.q_tokens * gpu_group_pad(group, bs.q_tokens)
            assert bs.num_warps == (8 if rows * 128 > 32 * 4 * 64 else 4), (path, group, bs)
        assert sizes("prefill", group, page_size, kv_bits).num_warps == 8
    assert sizes("mixed", 4, 64, 16).num_warps == 4           # 64-row tile: 4 warps suffice
    assert sizes("prefill", 3, 64, 16, head_dim=64).num_warps == 4
    for path in ("decode", "prefill", "mixed"):
        assert sizes(path, 4, 64, 16) == sizes(path, 4, 16, 16)


@needs_cuda
@pytest.mark.slow      # starts a process
def test_matrix_cli_reports_no_spills_for_llama70b_tp8(tmp_path):
    """The CLI with ``--ptxas``: Llama-3 70B at TP 8 (8 query heads on 1 KV head, head_dim
    128), page 16, both KV dtypes and buckets: every case compiles and no kernel spills (before
    the warps rule its prefill and mixed kernels spilled 136-232 bytes a thread)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), CUDA_VISIBLE_DEVICES="-1",
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "pdjax.aot.kernel_matrix", "--gpu", "h200", "--kernels", "rpa",
         "--models", "llama3-70b", "--page-sizes", "16", "--ptxas", str(tmp_path / "dump")],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("rpa ")]
    assert len(rows) == 4 and all(row[-1] == "ok" for row in rows)
    # columns: ... calls temp_MiB regs spill result
    assert all(int(row[-5]) == 3 and 0 < int(row[-3]) <= 255 and int(row[-2]) == 0
               for row in rows), rows
    assert "4/4 compiled" in out.stdout and "0 cases spill registers" in out.stdout
