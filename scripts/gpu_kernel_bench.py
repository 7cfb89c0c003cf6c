"""Micro-benchmark of ragged paged attention: achieved HBM GB/s (decode) and TFLOP/s (prefill)
against the device's peak.

Needs only jax and numpy (put the repo on PYTHONPATH; nothing is installed). On a GPU it times
the Pallas GPU kernel (``--impl auto``); on a CPU-only host it falls back to the jnp reference
in a tiny mode, which only checks that the script works.

    python scripts/gpu_kernel_bench.py [--impl auto|reference|tpu|gpu] [--tiny] [--iters N]
                                       [--json PATH] [--peak-hbm-gbs X] [--peak-tflops Y]
                                       [--interpret]   (kernels through the Pallas interpreter:
                                                        tests this script's kernel path on CPU)

Figures:
  decode  GB/s    = bytes of K and V read (sum of kv_lens x Hkv x D x 2 x itemsize) plus q and
                    out, divided by the time of one call;
  prefill TFLOP/s = 4 x Hq x D x (keys each query token sees, causal), divided by the time.
Each call is the whole dispatch (metadata, three path kernels, merge). Times are the mean over
``--iters`` back-to-back calls after a warm-up call that compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention, ragged_paged_attention_reference, resolve_impl)

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

# device_kind substring -> (HBM GB/s, dense bf16 TFLOP/s), from the vendors' data sheets.
PEAKS = (
    ("H200", (4800.0, 989.0)),
    ("H100 PCIe", (2000.0, 756.0)),
    ("H100", (3350.0, 989.0)),
    ("H800", (3350.0, 989.0)),
    ("B200", (8000.0, 2250.0)),
    ("A100-SXM4-80GB", (2039.0, 312.0)),
    ("A100 80GB", (1935.0, 312.0)),
    ("A100", (1555.0, 312.0)),
    ("L40S", (864.0, 362.0)),
    ("L4", (300.0, 121.0)),
)

MODELS = {   # name -> (num_q_heads, num_kv_heads, head_dim)
    "smollm2": (9, 3, 64),
    "llama8b": (32, 8, 128),
}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str                    # "decode" | "prefill" | "mixed"
    model: str
    seqs: tuple                  # ((q_len, kv_len), ...); decode rows first
    distribution: tuple          # (decode_end, prefill_end, num_seqs)

    def label(self) -> str:
        q = sum(s[0] for s in self.seqs)
        kv = max(s[1] for s in self.seqs)
        return f"{self.kind:7s} {self.model:8s} R={len(self.seqs):<4d} T={q:<5d} max_kv={kv}"


def full_cases() -> list[Case]:
    cases = []
    for model, batch, ctx in (("smollm2", 64, 2048), ("smollm2", 256, 1024),
                              ("llama8b", 32, 4096), ("llama8b", 128, 2048)):
        cases.append(Case("decode", model, ((1, ctx),) * batch, (batch, batch, batch)))
    for model, chunk, prefix in (("smollm2", 2048, 0), ("llama8b", 2048, 0),
                                 ("llama8b", 512, 3584)):
        cases.append(Case("prefill", model, ((chunk, prefix + chunk),), (0, 1, 1)))
    cases.append(Case("mixed", "llama8b", ((1, 2048),) * 64 + ((256, 1024),), (64, 65, 65)))
    return cases


def tiny_cases() -> list[Case]:
    return [Case("decode", "smollm2", ((1, 64),) * 4, (4, 4, 4)),
            Case("prefill", "smollm2", ((32, 48),), (0, 1, 1)),
            Case("mixed", "smollm2", ((1, 40),) * 2 + ((8, 8),), (2, 3, 3))]


def build_inputs(case: Case, *, page_size: int = 16, layers: int = 2, dtype=jnp.bfloat16,
                 seed: int = 0):
    """Device arrays for ``case``: a random pool just large enough, random page order."""
    num_q_heads, num_kv_heads, head_dim = MODELS[case.model]
    q_lens = np.array([s[0] for s in case.seqs], np.int32)
    kv_lens = np.array([s[1] for s in case.seqs], np.int32)
    pages = -(-kv_lens // page_size)
    num_pages = int(pages.sum()) + 1
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((len(q_lens), int(pages.max())), np.int32)
    start = 0
    for r, n in enumerate(pages):
        page_indices[r, :n] = order[start:start + n]
        start += n
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    pool = (layers, num_pages, page_size, num_kv_heads * head_dim)      # the engine's rows
    q = jax.random.normal(key_q, (int(cu_q_lens[-1]), num_q_heads, head_dim), dtype)
    k = jax.random.normal(key_k, pool, dtype)
    # |v| <= 0.5 keeps every output in [-0.5, 0.5], where one bf16 ulp (1.95e-3) is below the
    # 2e-3 check tolerance.
    v = jax.random.uniform(key_v, pool, dtype, -0.5, 0.5)
    return (q, k, v, jnp.int32(layers - 1), jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu_q_lens), jnp.asarray(case.distribution, jnp.int32))


def decode_bytes(case: Case, itemsize: int) -> int:
    num_q_heads, num_kv_heads, head_dim = MODELS[case.model]
    kv = sum(s[1] for s in case.seqs) * num_kv_heads * head_dim * 2 * itemsize
    tokens = sum(s[0] for s in case.seqs)
    return kv + 2 * tokens * num_q_heads * head_dim * itemsize


def attention_flops(case: Case) -> int:
    num_q_heads, _, head_dim = MODELS[case.model]
    keys = 0
    for q_len, kv_len in case.seqs:
        first = kv_len - q_len + 1                       # keys seen by the first query token
        keys += q_len * first + q_len * (q_len - 1) // 2
    return 4 * num_q_heads * head_dim * keys


def time_call(fn, args, iters: int) -> float:
    """Seconds per call: mean of ``iters`` back-to-back calls after a compiling warm-up."""
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / iters


def device_peaks(args) -> tuple[str, float | None, float | None]:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    hbm, tflops = None, None
    for name, (peak_hbm, peak_tflops) in PEAKS:
        if dev.platform == "gpu" and name in kind:
            hbm, tflops = peak_hbm, peak_tflops
            break
    return kind, args.peak_hbm_gbs or hbm, args.peak_tflops or tflops


def check_against_reference(impl: str, interpret: bool) -> float:
    """Max abs error of ``impl`` vs the reference on a small mixed batch (bf16)."""
    case = Case("mixed", "smollm2", ((1, 33), (1, 16), (40, 70), (5, 5)), (2, 3, 4))
    args = build_inputs(case, seed=7)
    out = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125, impl=impl,
                                    interpret=interpret))(*args)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.125))(*args)
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="auto", choices=("auto", "reference", "tpu", "gpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--peak-hbm-gbs", type=float, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels through the Pallas interpreter (CPU test)")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    impl = resolve_impl(args.impl)
    tiny = args.tiny or backend == "cpu"
    if backend == "cpu" and impl != "reference" and not args.interpret:
        print(f"no accelerator: --impl {args.impl} needs one; using the reference (tiny mode)")
        impl = "reference"
    iters = args.iters or (3 if tiny else 20)
    kind, peak_hbm, peak_tflops = device_peaks(args)
    print(f"device: {kind} ({backend}); jax {jax.__version__}; impl={impl}; "
          f"peak HBM {peak_hbm or 'n/a'} GB/s, peak bf16 {peak_tflops or 'n/a'} TFLOP/s")

    err = check_against_reference(impl, args.interpret)
    ok = err <= 2e-3
    print(f"check vs reference (bf16, mixed batch): max abs err {err:.2e} "
          f"{'ok' if ok else 'FAIL (> 2e-3)'}")

    results = []
    for case in (tiny_cases() if tiny else full_cases()):
        inputs = build_inputs(case)
        fn = jax.jit(functools.partial(ragged_paged_attention, impl=impl,
                                       sm_scale=MODELS[case.model][2] ** -0.5,
                                       interpret=args.interpret))
        seconds = time_call(fn, inputs, iters)
        row = {"case": case.label(), "kind": case.kind, "impl": impl, "ms": seconds * 1e3}
        gbs = decode_bytes(case, 2) / seconds / 1e9
        tflops = attention_flops(case) / seconds / 1e12
        row.update(gb_per_s=gbs, tflop_per_s=tflops)
        if case.kind == "decode":
            frac = f" ({100 * gbs / peak_hbm:5.1f}% of peak HBM)" if peak_hbm else ""
            figure = f"{gbs:9.1f} GB/s{frac}"
            row["fraction_of_peak"] = gbs / peak_hbm if peak_hbm else None
        elif case.kind == "prefill":
            frac = f" ({100 * tflops / peak_tflops:5.1f}% of peak bf16)" if peak_tflops else ""
            figure = f"{tflops:9.3f} TFLOP/s{frac}"
            row["fraction_of_peak"] = tflops / peak_tflops if peak_tflops else None
        else:
            figure = f"{gbs:9.1f} GB/s, {tflops:7.3f} TFLOP/s"
        print(f"{case.label()}  {seconds * 1e3:9.3f} ms  {figure}", flush=True)
        results.append(row)
        del inputs

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": kind, "backend": backend, "jax": jax.__version__, "impl": impl,
                       "peak_hbm_gbs": peak_hbm, "peak_bf16_tflops": peak_tflops,
                       "check_max_abs_err": err, "results": results}, f, indent=1)
    return 0 if ok and all(math.isfinite(r["ms"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
