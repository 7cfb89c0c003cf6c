"""Compile every attention kernel for a real accelerator target, at the shapes of real models.

The kernels have run in interpret mode and been lowered for ``tpu``/``cuda``; only a compile
runs the backend (Mosaic on TPU, Triton and ptxas on GPU) that rejects a kernel. This module
enumerates the (kernel, model shape, KV dtype, page size, TP, token bucket) matrix, compiles
each case for a ``Target`` (``pdjax.aot.targets``: compile-only devices, no accelerator needed)
and prints a table of compile seconds and pass/fail::

    .venv-cuda/bin/python -m pdjax.aot.kernel_matrix --gpu h200
    .venv-tpu/bin/python -m pdjax.aot.kernel_matrix --topology v5e:2x2

``--ptxas DIR`` (GPU) adds each case's registers and spill stores a thread (``ptx_spills``).

Kernel shapes are per device: a TP-8 case carries the heads one device holds (the kernels are
custom calls without a sharding rule; the model shards heads around them). A case passes when
the compile succeeds and the optimized HLO holds the kernel's custom call (``KERNEL_CALLS``),
so a silent fallback to a jnp path cannot pass.

The GEMM kernels (the MoE's grouped GEMM, ``gmm``, and the dense block-scaled FP8 GEMM,
``fp8_gemm``) are cases too, at real DeepSeek-V3.2 / GLM-5 expert and linear shapes per device
(``gemm_cases``); ``--kernels gmm fp8_gemm`` runs only them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback
from typing import TYPE_CHECKING, Callable, Iterable

from pdjax.aot.gemm_cases import GEMM_KERNELS, gemm_cases
from pdjax.aot.kernel_case import KernelCase
from pdjax.aot.gemm_cases import case_function as gemm_case_function
from pdjax.aot.targets import Target, resolve_target

if TYPE_CHECKING:
    from pdjax.aot.ptx_spills import PtxWatcher

# The custom call each platform's Pallas kernels become in the compiled HLO.
KERNEL_CALLS = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Per-device attention shape of one model at one TP degree.

    ``family``: ``"gqa"`` (ragged paged attention) or ``"mla"`` (MLA attention and the DSA
    indexer). GQA: ``num_q_heads``, ``num_kv_heads``, ``head_dim``. MLA: ``num_q_heads`` heads
    of width ``kv_lora_rank + rope_dim``; the indexer has ``index_heads`` x ``index_head_dim``
    and keeps ``index_topk`` positions. ``layers``: the stacked cache's layer count.
    """

    model: str
    tp: int
    family: str
    num_q_heads: int
    layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0


# The supported models' attention at TP degrees their head counts allow (the config.json
# values of pdjax/aot/configs; query and KV heads divided by TP, the indexer is replicated).
_DSV32 = dict(kv_lora_rank=512, rope_dim=64, index_heads=64, index_head_dim=128,
              index_topk=2048)
_GLM5 = dict(kv_lora_rank=512, rope_dim=64, index_heads=32, index_head_dim=128,
             index_topk=2048)
MODEL_SHAPES = (
    AttentionShape("llama3-8b", 1, "gqa", 32, 32, num_kv_heads=8, head_dim=128),
    AttentionShape("llama3-70b", 8, "gqa", 64 // 8, 80, num_kv_heads=8 // 8, head_dim=128),
    AttentionShape("qwen3-32b", 4, "gqa", 64 // 4, 64, num_kv_heads=8 // 4, head_dim=128),
    AttentionShape("smollm2-135m", 1, "gqa", 9, 30, num_kv_heads=3, head_dim=64),
    AttentionShape("deepseek-v3.2", 1, "mla", 128, 61, **_DSV32),
    AttentionShape("deepseek-v3.2", 8, "mla", 128 // 8, 61, **_DSV32),
    AttentionShape("glm-5", 1, "mla", 64, 78, **_GLM5),
    AttentionShape("glm-5", 8, "mla", 64 // 8, 78, **_GLM5),
)


@dataclasses.dataclass(frozen=True)
class TokenBucket:
    """A forward's static batch shape: ``num_tokens`` (T) tokens of ``num_seqs`` (R) requests
    over a page table of ``context`` tokens per request. ``decode``: every row has q_len 1."""

    name: str
    num_tokens: int
    num_seqs: int
    context: int


BUCKETS = (
    TokenBucket("decode", 128, 128, 8192),    # 128 decode rows at up to 8K of context
    TokenBucket("mixed", 2048, 64, 8192),     # a 2048-token chunked-prefill / mixed step
)
PAGE_SIZES = (16, 32, 64)
POOL_TOKENS = 65536          # KV pool of every case, in tokens per layer
GQA_KV_DTYPES = ("bfloat16", "float8_e4m3fn")
MLA_KV_DTYPES = ("bfloat16", "float8_e4m3fn")    # fp8: the FP8 latent record (fp8_record.py)


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Outcome of one case: ``ok`` (compiled and the kernel's custom call is in the HLO),
    ``compile_s`` (trace + lower + compile, seconds), ``kernel_calls`` (how many of the
    kernel custom calls the compiled HLO holds), per-device ``argument_bytes`` /
    ``temp_bytes`` from ``memory_analysis()`` (-1 when not given), ``error`` (first line);
    GPU with a PTX dump (``--ptxas``): the most ``registers`` a thread and ``spill_bytes``
    (spill stores a thread) over the case's kernels, from ``ptx_spills`` (-1: not measured)."""

    case: KernelCase
    ok: bool
    compile_s: float
    kernel_calls: int = 0
    argument_bytes: int = -1
    temp_bytes: int = -1
    error: str = ""
    registers: int = -1
    spill_bytes: int = -1


def kernel_cases(models: Iterable[AttentionShape] = MODEL_SHAPES,
                 page_sizes: Iterable[int] = PAGE_SIZES,
                 buckets: Iterable[TokenBucket] = BUCKETS,
                 kernels: Iterable[str] | None = None) -> list[KernelCase]:
    """The matrix: ragged paged attention for every GQA model x KV dtype (bf16, fp8) x page
    size x bucket; MLA dense and sparse (bf16 latent cache and the FP8 record) and the indexer
    (bf16 keys and FP8 keys with their scales, bf16 on TPU as the engine keeps them; with the
    top-k) for every MLA shape x page size x bucket. ``kernels`` filters by kernel name."""
    cases = []
    for shape in models:
        for page_size in page_sizes:
            for bucket in buckets:
                if shape.family == "gqa":
                    cases += [KernelCase("rpa", shape, dt, page_size, bucket)
                              for dt in GQA_KV_DTYPES]
                else:
                    cases += [KernelCase(k, shape, dt, page_size, bucket)
                              for k in ("mla_dense", "mla_sparse") for dt in MLA_KV_DTYPES]
                    cases += [KernelCase("indexer", shape, dt, page_size, bucket)
                              for dt in MLA_KV_DTYPES]
    if kernels is not None:
        kernels = set(kernels)
        cases = [c for c in cases if c.kernel in kernels]
    return cases


def _metadata_shapes(case: KernelCase):
    """ShapeDtypeStruct-ready shapes of the DESIGN.md §2 metadata of a case."""
    import jax.numpy as jnp
    b = case.bucket
    pages_per_seq = -(-b.context // case.page_size)
    # A pool of POOL_TOKENS tokens (page tables may share pages: only the shape matters here).
    num_pages = max(pages_per_seq, POOL_TOKENS // case.page_size) + 1    # + the null page
    meta = (((), jnp.int32),                                  # layer
            ((b.num_seqs,), jnp.int32),                       # kv_lens
            ((b.num_seqs, pages_per_seq), jnp.int32),         # page_indices
            ((b.num_seqs + 1,), jnp.int32),                   # cu_q_lens
            ((3,), jnp.int32))                                # distribution
    return num_pages, meta


def case_function(case: KernelCase, platform: str) -> tuple[Callable, list[tuple]]:
    """The jittable function of a case and its arguments as ``(shape, dtype)`` pairs.

    ``platform``: the kernels' ``impl`` (``"gpu"`` or ``"tpu"``). Raises ``ValueError`` for an
    unknown kernel name.
    """
    if case.kernel in GEMM_KERNELS:
        return gemm_case_function(case, platform)
    import jax.numpy as jnp
    s, b = case.shape, case.bucket
    kv_dtype = jnp.dtype(case.kv_dtype)
    num_pages, meta = _metadata_shapes(case)
    t = b.num_tokens
    if case.kernel == "rpa":
        from pdjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention
        cache = ((s.layers, num_pages, case.page_size, s.num_kv_heads * s.head_dim), kv_dtype)
        args = [((t, s.num_q_heads, s.head_dim), jnp.bfloat16), cache, cache, *meta]
        if kv_dtype.itemsize == 1 and platform == "gpu":
            # FP8 KV as the engine keeps it: a float32 scale per token per KV head (fp8_kv).
            scales = ((s.layers, num_pages, case.page_size, s.num_kv_heads), jnp.float32)

            def fn(*a):
                return ragged_paged_attention(*a[:8], sm_scale=s.head_dim ** -0.5,
                                              k_scales=a[8], v_scales=a[9], impl=platform)
            return fn, args + [scales, scales]
        # TPU: its kernel does not read per-token scales yet (it refuses them); its fp8 case
        # keeps a static scale.
        scale = None if kv_dtype.itemsize == 2 else 0.5
        fn = functools.partial(ragged_paged_attention, sm_scale=s.head_dim ** -0.5,
                               k_scale=scale, v_scale=scale, impl=platform)
        return fn, args
    from pdjax.pallas_kernels.lanes import aligned_width, kv_row_align

    if case.kernel in ("mla_dense", "mla_sparse"):
        from pdjax.pallas_kernels.mla_sparse_attention import mla_sparse_attention
        dim = s.kv_lora_rank + s.rope_dim
        # The latent pool as the engine lays it out on the platform (whole lanes on TPU).
        row = aligned_width(dim, kv_row_align(platform))
        args = [((t, s.num_q_heads, dim), jnp.bfloat16),
                ((s.layers, num_pages, case.page_size, row), kv_dtype), *meta]
        if case.kernel == "mla_sparse":
            args.append(((t, s.index_topk), jnp.int32))
        fn = functools.partial(mla_sparse_attention, sm_scale=dim ** -0.5,
                               kv_lora_rank=s.kv_lora_rank, impl=platform)
        if kv_dtype.itemsize == 1:      # the FP8 record's planes, as the engine lays them out
            from pdjax.pallas_kernels.mla_sparse_attention import fp8_record
            layout = fp8_record.Fp8LatentLayout(s.kv_lora_rank, s.rope_dim,
                                                kv_row_align(platform))
            planes = [((s.layers, num_pages, case.page_size, w), d)
                      for _, w, d in layout.planes()]
            n, attend = len(planes), fn

            def fn(q, *rest):
                kv = fp8_record.Fp8Latent(rest[0], rest[1] if n == 3 else None, rest[n - 1])
                return attend(q, kv, *rest[n:])

            args = [args[0], *planes, *args[2:]]
        return fn, args
    if case.kernel == "indexer":
        from pdjax.pallas_kernels.indexer import indexer_scores, topk_positions

        def indexer(q, weights, k_cache, *metadata):
            scores = indexer_scores(q, weights, k_cache, *metadata,
                                    sm_scale=s.index_head_dim ** -0.5, impl=platform)
            return topk_positions(scores, s.index_topk)

        args = [((t, s.index_heads, s.index_head_dim), jnp.bfloat16),
                ((t, s.index_heads), jnp.float32),
                ((s.layers, num_pages, case.page_size,
                  aligned_width(s.index_head_dim, kv_row_align(platform))), kv_dtype), *meta]
        if kv_dtype.itemsize == 1 and platform == "tpu":     # the engine keeps them bf16 there
            args[2] = (args[2][0], jnp.bfloat16)
        elif kv_dtype.itemsize == 1:      # FP8 keys and their float32 scale per 128
            from pdjax.pallas_kernels.indexer import Fp8Keys
            from pdjax.pallas_kernels.mla_sparse_attention.fp8_record import num_scale_groups
            lead = (s.layers, num_pages, case.page_size)
            args[2:3] = [(lead + (s.index_head_dim,), kv_dtype),
                         (lead + (num_scale_groups(s.index_head_dim),), jnp.float32)]
            score = indexer

            def indexer(q, weights, keys, scale, *metadata):
                return score(q, weights, Fp8Keys(keys, scale), *metadata)
        return indexer, args
    raise ValueError(f"kernel must be one of rpa, mla_dense, mla_sparse, indexer, "
                     f"got {case.kernel!r}")


def compile_case(case: KernelCase, target: Target):
    """Trace, lower and compile one case for ``target``'s first device; returns the compiled
    executable. The inputs are ShapeDtypeStructs replicated on a one-device mesh, so the
    lowering platform is the target's; the Pallas lowering asks the default device for its
    kind, hence ``Target.device_context``."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    fn, args = case_function(case, target.platform)
    mesh = Mesh(target.devices[:1], ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec())
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in args]
    with target.device_context():
        return jax.jit(fn).trace(*specs).lower().compile()


def run_case(case: KernelCase, target: Target) -> CaseResult:
    """``compile_case`` timed and checked: ok iff it compiles and its optimized HLO holds the
    platform's kernel custom call (``KERNEL_CALLS``). Never raises for a failed compile."""
    start = time.perf_counter()
    try:
        compiled = compile_case(case, target)
    except Exception as e:    # a kernel the backend rejects: report it, go on with the matrix
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        return CaseResult(case, False, time.perf_counter() - start, error=msg)
    seconds = time.perf_counter() - start
    calls = compiled.as_text().count(KERNEL_CALLS[target.platform])
    mem = compiled.memory_analysis()
    arg_bytes = getattr(mem, "argument_size_in_bytes", -1) if mem is not None else -1
    temp_bytes = getattr(mem, "temp_size_in_bytes", -1) if mem is not None else -1
    error = "" if calls else f"no {KERNEL_CALLS[target.platform]} in the compiled HLO"
    return CaseResult(case, calls > 0, seconds, calls, arg_bytes, temp_bytes, error)


def run_matrix(target: Target, cases: Iterable[KernelCase],
               on_result: Callable[[CaseResult], None] | None = None,
               ptx: PtxWatcher | None = None) -> list[CaseResult]:
    """``run_case`` over ``cases`` in order; ``on_result`` sees each result as it comes.
    ``ptx``: a ``ptx_spills.PtxWatcher`` on XLA's dump folder, to add each case's registers
    and spills."""
    results = []
    for case in cases:
        result = run_case(case, target)
        if ptx is not None:
            kernels = ptx.new_kernels()
            if kernels:
                result = dataclasses.replace(
                    result, registers=max(k.registers for k in kernels),
                    spill_bytes=max(k.spill_bytes for k in kernels))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


TABLE_HEADER = (f"{'kernel':<11} {'model':<13} {'tp':>2} {'kv dtype':<13} {'page':>4} "
                f"{'bucket':<6} {'T':>5} {'R':>4} {'compile_s':>9} {'calls':>5} "
                f"{'temp_MiB':>8} {'regs':>4} {'spill':>5}  result")


def format_row(r: CaseResult) -> str:
    """One table row of a result (the error's first line when it failed)."""
    c = r.case
    temp = f"{r.temp_bytes / 2**20:8.1f}" if r.temp_bytes >= 0 else f"{'-':>8}"
    regs = f"{r.registers:>4} {r.spill_bytes:>5}" if r.registers >= 0 else f"{'-':>4} {'-':>5}"
    status = "ok" if r.ok else "FAIL " + r.error.splitlines()[0][:160] if r.error else "FAIL"
    return (f"{c.kernel:<11} {c.shape.model:<13} {c.shape.tp:>2} {c.kv_dtype:<13} "
            f"{c.page_size:>4} {c.bucket.name:<6} {c.bucket.num_tokens:>5} "
            f"{c.bucket.num_seqs:>4} {r.compile_s:9.2f} {r.kernel_calls:>5} {temp} {regs}  "
            f"{status}")


def main(argv: list[str] | None = None) -> int:
    """CLI: compile the matrix for ``--gpu NAME`` or ``--topology TPU_TOPOLOGY``; print the
    table and a summary; exit status 1 when any case failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--gpu", help="GPU target config name (h100, h200)")
    group.add_argument("--topology", help="TPU topology (v5e:2x2, v6e:2x2, v5p:2x2x1, ...)")
    parser.add_argument("--kernels", nargs="+",
                        choices=("rpa", "mla_dense", "mla_sparse", "indexer", *GEMM_KERNELS),
                        help="only these kernels (default: all)")
    parser.add_argument("--page-sizes", nargs="+", type=int, default=list(PAGE_SIZES))
    parser.add_argument("--models", nargs="+", help="only these models (default: all)")
    parser.add_argument("--ptxas", metavar="DUMP_DIR",
                        help="GPU: dump XLA's PTX there and report each case's registers and "
                             "spill stores a thread (ptxas -v); must start before JAX does")
    args = parser.parse_args(argv)

    watcher = None
    if args.ptxas:
        from pdjax.aot.ptx_spills import PtxWatcher, enable_ptx_dump, ptxas_path
        if args.gpu is None:
            parser.error("--ptxas needs --gpu")
        if ptxas_path() is None:
            parser.error("--ptxas: no ptxas (pip install 'jax[cuda12]' brings it)")
        enable_ptx_dump(args.ptxas)
        watcher = PtxWatcher(args.ptxas, ptxas_path())
    target = resolve_target(topology=args.topology, gpu=args.gpu)
    models = [m for m in MODEL_SHAPES if not args.models or m.model in args.models]
    cases = kernel_cases(models, args.page_sizes, kernels=args.kernels)
    cases += gemm_cases(BUCKETS, kernels=args.kernels, models=args.models)
    print(f"target {target.name}: {len(target.devices)} x {target.device_kind} "
          f"({target.platform}); {len(cases)} cases", flush=True)
    print(TABLE_HEADER, flush=True)
    start = time.perf_counter()
    results = run_matrix(target, cases, on_result=lambda r: print(format_row(r), flush=True),
                         ptx=watcher)
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} compiled in "
          f"{time.perf_counter() - start:.1f} s (compile seconds summed: "
          f"{sum(r.compile_s for r in results):.1f})", flush=True)
    spilled = [r for r in results if r.spill_bytes > 0]
    if watcher is not None:
        print(f"{len(spilled)} cases spill registers" + "".join(
            f"\n  {r.case.label}: {r.spill_bytes} bytes a thread at {r.registers} registers"
            for r in spilled), flush=True)
    for r in failed:
        print(f"\nFAILED {r.case.label}:\n{r.error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
