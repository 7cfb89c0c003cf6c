"""The whole engine on one NVIDIA GPU: a random-weight model of Llama-3-8B's shape
in bfloat16 through the real ``Engine`` -> ``EngineCore`` -> ``ModelRunner`` path.

Nothing is downloaded: a config.json and a word-level tokenizer of the model's vocabulary are
written to a temporary folder and the engine loads it with ``load_format="dummy"`` (random
weights made on the device by the model's own initializers, ``loader.load_dummy_model``).
Each engine compiles only the few shapes the check uses (``EngineCore(buckets=...)``).

Figures (printed and written as JSON with ``--json``):
  attention paths  the same greedy prompts through the Pallas GPU kernel and the jnp/XLA path:
                   tokens equal, and tie-aware (DESIGN.md §5: equal up to and including the
                   first position where the XLA path's top-2 logprob gap is below
                   ``gap_tol``);
  decode           median time of a decode step with every row decoding (the engine's own
                   ``last_forward_device_s``, overlap on: the device's time, or the host's
                   where the host is slower -- ``host_ms_per_step`` tells) at a few batch
                   sizes x contexts, against the weight-read roofline: (bytes of every weight
                   the step reads -- all but the embedding table, whose B rows are gathered --
                   plus the KV bytes of the rows' contexts) / HBM bandwidth;
  prefill          TFLOP/s of full ``chunk``-token prefill chunks: 2 x matmul weights x tokens
                   + 4 x layers x q heads x head_dim x keys each token sees (causal) + the LM
                   head of the sampled rows, over the chunk's median device time.

    python scripts/gpu_engine_check.py [--tiny] [--json PATH] [--peak-hbm-gbs X]
                                       [--peak-tflops Y] [--max-batch B]

``--tiny`` (the default without a GPU; ``GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh``): the
same steps on a 2-layer model of hidden 64 in float32, the GPU kernel through the Pallas
interpreter, a nominal bandwidth -- a test of this script (tests/bench/test_gpu_check.py), not
a measurement. Full mode budget on an H100/H200: 6 compiled shapes for the kernel path, 2 for
the XLA path, about 0.4 M prompt tokens, meant to take under 8 minutes (not yet timed on a GPU). Exit status 1 when the tokens differ (tie-aware) or a
figure is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Llama-3-8B's config.json, shape fields only (meta-llama/Meta-Llama-3.1-8B).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)
TINY_MODEL = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
HOST_LACKS = ("zmq", "gguf", "mooncake", "llguidance", "pytest")
NOMINAL_CPU_GBS = 20.0           # tiny mode only: a placeholder bandwidth, not a measurement
NOMINAL_CPU_TFLOPS = 0.1


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures. ``decode_cases``: ``(batch, context)`` pairs, ``context`` the
    prompt length; ``compare_lengths``: prompt lengths of the attention-path comparison."""

    model: dict
    dtype: str
    page_size: int
    chunk: int                    # chunked_prefill_size: the one token bucket of extend
    decode_cases: tuple
    new_tokens: int
    prefill_prompts: int          # prompts of prefill_len tokens, one output token each
    prefill_len: int
    compare_lengths: tuple
    compare_tokens: int
    gap_tol: float

    @property
    def context_length(self) -> int:
        return max(max(c for _, c in self.decode_cases) + self.new_tokens, self.prefill_len + 1,
                   max(self.compare_lengths) + self.compare_tokens)

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def pages_buckets(self) -> tuple[int, ...]:
        """One per decode context, and the longest context (prefill, comparison)."""
        return tuple(sorted({self.pages(c + self.new_tokens) for _, c in self.decode_cases}
                            | {self.pages(self.context_length)}))

    def max_total_tokens(self) -> int:
        """The largest decode case with a page of slack per row, and the comparison."""
        need = max(max(b * self.pages(c + self.new_tokens) for b, c in self.decode_cases),
                   sum(self.pages(n + self.compare_tokens) for n in self.compare_lengths),
                   self.prefill_prompts * self.pages(self.prefill_len + 1))
        return (need + max(b for b, _ in self.decode_cases) + 2) * self.page_size


FULL = Plan(LLAMA3_8B, "bfloat16", 16, 2048,
            decode_cases=((1, 1024), (1, 4096), (64, 1024), (64, 4096)), new_tokens=32,
            prefill_prompts=4, prefill_len=4096, compare_lengths=(37, 300, 1000, 2500),
            compare_tokens=24, gap_tol=0.1)
# Every context in one pages-per-sequence bucket (8 pages): 3 shapes for the interpreted kernel.
TINY = Plan(TINY_MODEL, "float32", 16, 64, decode_cases=((1, 112), (4, 112)), new_tokens=8,
            prefill_prompts=2, prefill_len=112, compare_lengths=(5, 30, 70, 100),
            compare_tokens=8, gap_tol=1e-3)


# ---------------------------------------------------------------------------------- the model

def write_model_dir(folder: str, model: dict) -> str:
    """config.json of ``model`` (HF field names) and a word-level tokenizer with one token per
    id (``<unk>``, ``<s>``, ``</s>``, then ``t3``...), so any sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(model, architectures=["LlamaForCausalLM"], model_type="llama",
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="bfloat16")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, model["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return folder


def random_prompts(rng, lengths, vocab: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def engine_settings(plan: Plan, impl: str, *, interpret: bool, max_rows: int,
                    max_total_tokens: int) -> dict:
    """``Engine`` keyword arguments for the dummy model with only the shapes ``plan`` needs:
    extend at one token bucket (``plan.chunk``), decode at the plan's batch sizes; the XLA
    path's one pages-per-sequence bucket (its cost follows kv_lens), the kernel's one per
    context."""
    from pdjax.sched.buckets import Buckets

    pages = plan.pages_buckets()
    if impl == "xla":
        requests, pages = (max_rows,), pages[-1:]
    else:
        requests = tuple(sorted({b for b, _ in plan.decode_cases} | {max_rows}))
    buckets = Buckets(token_buckets=(plan.chunk,), request_buckets=requests,
                      pages_per_seq_buckets=pages, max_rows=max_rows)
    # XLA's dots, as on a GPU, also in the CPU dry run: the roofline counts the checkpoint's
    # weights, not the CPU kernel's packed copies (models/platform.py, cpu_matmul_kernel).
    return dict(dtype=plan.dtype, load_format="dummy", attention_backend=impl,
                cpu_matmul_kernel=False, pallas_interpret=interpret, page_size=plan.page_size,
                chunked_prefill_size=plan.chunk, context_length=plan.context_length,
                max_running_requests=max_rows, max_total_tokens=max_total_tokens,
                grammar_backend="none", skip_warmup_progress=True, progress=False,
                buckets=buckets)


def xla_engine_settings(plan: Plan, compare: list[list[int]]) -> dict:
    """The XLA path runs the comparison only: one row per prompt, a pool just for them."""
    n = len(compare)
    pages = sum(plan.pages(len(p) + plan.compare_tokens) for p in compare) + n + 2
    return engine_settings(plan, "xla", interpret=False, max_rows=n,
                           max_total_tokens=pages * plan.page_size)


def kernel_engine_settings(plan: Plan, interpret: bool) -> dict:
    return engine_settings(plan, "gpu", interpret=interpret,
                           max_rows=max(b for b, _ in plan.decode_cases),
                           max_total_tokens=plan.max_total_tokens())


@dataclasses.dataclass
class StepRecord:
    mode: str
    rows: int
    tokens: int
    kv_tokens: int               # sum over rows of the context each reads after the step
    attention_keys: int          # sum over new tokens of the keys each sees (causal)
    sampled_rows: int
    device_s: float | None       # EngineCore.last_forward_device_s (None: a compile)


def record_steps(core) -> tuple[list[StepRecord], object]:
    """Append a ``StepRecord`` per completed step of ``core``; returns (list, hook)."""
    steps: list[StepRecord] = []

    def on_step(batch, outputs):
        keys = sum(r.num_tokens * r.start + r.num_tokens * (r.num_tokens + 1) // 2
                   for r in batch.rows)
        steps.append(StepRecord(batch.forward_mode, len(batch.rows), batch.num_tokens,
                                sum(r.start + r.num_tokens for r in batch.rows), keys,
                                # read after the step: a row sampled if it reached the
                                # prompt's end (the request has grown since)
                                sum(1 for r in batch.rows
                                    if r.start + r.num_tokens >= r.req.num_prompt_tokens),
                                core.last_forward_device_s))

    core.step_hooks.append(on_step)
    return steps, on_step


def weight_read_bytes(core, rows: int) -> tuple[int, int]:
    """(bytes of every parameter, bytes a decode step of ``rows`` rows reads of them: all but
    the embedding table, of which only the rows' ids are gathered, unless tied to the head)."""
    import jax
    from flax import nnx

    total = embed = 0
    for path, var in nnx.to_flat_state(core.runner.state):
        # A stack [L, ...], or its L per-layer arrays once unrolled (DecoderLayers.unstack).
        nbytes = sum(int(a.nbytes) for a in jax.tree.leaves(var.get_value()))
        total += nbytes
        if path[0] == "embed_tokens":
            embed = nbytes
    cfg = core.model_cfg
    if cfg.tie_word_embeddings:
        return total, total
    row_bytes = embed // cfg.vocab_size
    return total, total - embed + rows * row_bytes


def matmul_weights_per_token(cfg) -> int:
    """Multiply-adds per token in the decoder layers (q, k, v, o and the gated MLP)."""
    H, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = H * (cfg.num_q_heads + 2 * cfg.num_kv_heads) * D + cfg.num_q_heads * D * H + 3 * H * F
    return cfg.num_layers * per_layer


# ---------------------------------------------------------------------------------- the steps

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run_comparison(engine, prompts, new_tokens: int) -> list[dict]:
    outs = engine.generate(input_ids=prompts,
                           sampling_params=dict(GREEDY, max_new_tokens=new_tokens),
                           return_logprob=True, top_logprobs_num=2)
    return [{"output_ids": o["output_ids"],
             "top2_gaps": [t[0][0] - t[1][0] for t in o["meta_info"]["output_top_logprobs"]]}
            for o in outs]


def compare_tokens(kernel: list[dict], ref: list[dict], gap_tol: float) -> dict:
    """Per prompt: exact equality, and DESIGN.md §5's tie-aware equality against ``ref``."""
    prompts, all_equal, all_match = [], True, True
    for k, r in zip(kernel, ref):
        a, b = k["output_ids"], r["output_ids"]
        n = len(b)
        for i, gap in enumerate(r["top2_gaps"]):
            if gap < gap_tol:
                n = i + 1
                break
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                       None if len(a) == len(b) else min(len(a), len(b)))
        equal, match = a == b, a[:n] == b[:n]
        all_equal &= equal
        all_match &= match
        prompts.append({"kernel_ids": a, "xla_ids": b, "equal": equal, "compared": n,
                        "match": match, "first_divergence": diverge,
                        "min_top2_gap": min(r["top2_gaps"]) if r["top2_gaps"] else None})
    return {"tokens_equal": all_equal, "tokens_match": all_match, "gap_tol": gap_tol,
            "prompts": prompts}


def run_decode_case(engine, rng, batch: int, context: int, new_tokens: int, hbm_gbs: float) -> dict:
    """``batch`` prompts of ``context`` tokens, decoded together for ``new_tokens`` steps.

    Prompts submitted together would reach decode one by one (prefill chunks and decode steps
    alternate), and with long prompts the first would finish before the last starts. So they
    are prefilled first (one output token each), then submitted again: the prefix cache holds
    all but their last tokens, one short prefill step admits every row, and the decode steps
    that follow all have ``batch`` rows (``cached_tokens`` in the result shows the hits)."""
    core = engine.core
    prompts = random_prompts(rng, [context] * batch, core.model_cfg.vocab_size)
    engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=1))
    steps, hook = record_steps(core)
    t0, host0, steps0 = time.perf_counter(), core.host_time_s, core.num_steps
    try:
        outs = engine.generate(input_ids=prompts,
                               sampling_params=dict(GREEDY, max_new_tokens=new_tokens))
    finally:
        core.step_hooks.remove(hook)
    wall_s = time.perf_counter() - t0
    host_ms = 1e3 * (core.host_time_s - host0) / max(1, core.num_steps - steps0)
    full = [s for s in steps if s.mode == "decode" and s.rows == batch and s.device_s is not None]
    # The first may wait on the prefill before it; the last, read by the drain, is timed short.
    timed = full[1:-1] if len(full) > 3 else full
    param_bytes, weight_bytes = weight_read_bytes(core, batch)
    kv_per_token = core.runner.kv_bytes_per_page / core.runner.page_size
    row = {"batch": batch, "context": context, "new_tokens": new_tokens,
           "output_tokens": sum(len(o["output_ids"]) for o in outs), "wall_s": wall_s,
           "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
           "host_ms_per_step": host_ms,
           "decode_steps_timed": len(timed), "step_ms_median": None, "step_ms_min": None,
           "weight_bytes": weight_bytes, "kv_bytes": None, "roofline_ms": None,
           "roofline_fraction": None, "achieved_gbs": None}
    if timed:
        step_s = float(np.median([s.device_s for s in timed]))
        kv_bytes = float(np.mean([s.kv_tokens for s in timed])) * kv_per_token
        roofline_s = (weight_bytes + kv_bytes) / (hbm_gbs * 1e9)
        row.update(step_ms_median=step_s * 1e3, step_ms_min=min(s.device_s for s in timed) * 1e3,
                   kv_bytes=kv_bytes, roofline_ms=roofline_s * 1e3,
                   roofline_fraction=roofline_s / step_s,
                   achieved_gbs=(weight_bytes + kv_bytes) / step_s / 1e9)
    return row


def run_prefill(engine, rng, plan: Plan, peak_tflops: float) -> dict:
    core = engine.core
    cfg = core.model_cfg
    prompts = random_prompts(rng, [plan.prefill_len] * plan.prefill_prompts, cfg.vocab_size)
    steps, hook = record_steps(core)
    try:
        engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=1))
    finally:
        core.step_hooks.remove(hook)
    chunks = [s for s in steps if s.mode == "prefill_chunk" and s.tokens == plan.chunk
              and s.device_s is not None]
    timed = chunks[1:] if len(chunks) > 2 else chunks
    per_token = matmul_weights_per_token(cfg)
    row = {"chunk_tokens": plan.chunk, "prompt_tokens": plan.prefill_len,
           "chunks_timed": len(timed), "step_ms_median": None, "tflops": None, "mfu": None}
    if timed:
        flops = [2 * s.tokens * per_token + 2 * s.sampled_rows * cfg.hidden_size * cfg.vocab_size
                 + 4 * cfg.num_layers * cfg.num_q_heads * cfg.head_dim * s.attention_keys
                 for s in timed]
        rates = [f / s.device_s / 1e12 for f, s in zip(flops, timed)]
        row.update(step_ms_median=float(np.median([s.device_s for s in timed])) * 1e3,
                   tflops=float(np.median(rates)), mfu=float(np.median(rates)) / peak_tflops,
                   flops_per_chunk_mean=float(np.mean(flops)))
    return row


def peaks(args, tiny: bool) -> tuple[str, float, float, str]:
    """``(device kind, HBM GB/s, bf16 TFLOP/s, source)``: the flags, else the data-sheet table
    of ``gpu_kernel_bench.PEAKS`` by device name, else (tiny mode) nominal figures."""
    import jax

    from gpu_kernel_bench import device_peaks

    kind, hbm, tflops = device_peaks(args)
    source = "flag" if args.peak_hbm_gbs else ("table" if hbm else "nominal")
    if hbm is None or tflops is None:
        if not tiny:
            raise SystemExit(f"gpu_engine_check: no peak figures for {kind!r} "
                             f"({jax.default_backend()}); pass --peak-hbm-gbs and --peak-tflops")
        hbm, tflops = hbm or NOMINAL_CPU_GBS, tflops or NOMINAL_CPU_TFLOPS
    return kind, hbm, tflops, source


def print_report(result: dict) -> None:
    paths = result["attention_paths"]
    print(f"\n== attention paths: tokens equal {paths['tokens_equal']}, tie-aware match "
          f"{paths['tokens_match']} (gap tol {paths['gap_tol']})")
    for i, p in enumerate(paths["prompts"]):
        print(f"  prompt {i}: equal={p['equal']} compared={p['compared']} "
              f"first_divergence={p['first_divergence']} min_top2_gap={p['min_top2_gap']:.4f}")
    print(f"== decode vs weight-read roofline ({result['peak_hbm_gbs']:g} GB/s, "
          f"{result['peak_source']})")
    print(f"  {'batch':>5} {'context':>7} {'step ms':>9} {'roofline ms':>11} {'fraction':>8} "
          f"{'GB/s':>8} {'host ms':>8}")
    for d in result["decode"]:
        if d["step_ms_median"] is None:
            print(f"  {d['batch']:>5} {d['context']:>7}  no full decode step timed")
            continue
        print(f"  {d['batch']:>5} {d['context']:>7} {d['step_ms_median']:9.3f} "
              f"{d['roofline_ms']:11.3f} {d['roofline_fraction']:8.3f} {d['achieved_gbs']:8.1f} "
              f"{d['host_ms_per_step']:8.3f}")
    p = result["prefill"]
    if p["tflops"] is not None:
        print(f"== prefill: {p['chunk_tokens']}-token chunks of {p['prompt_tokens']}-token "
              f"prompts: {p['step_ms_median']:.2f} ms, {p['tflops']:.2f} TFLOP/s "
              f"({100 * p['mfu']:.1f}% of {result['peak_tflops']:g})")
    print(f"== total {result['total_s']:.1f} s (engine starts: "
          f"{', '.join(f'{k} {v:.1f} s' for k, v in result['engine_start_s'].items())})")


def with_executables(settings: dict, folder: str | None, impl: str) -> dict:
    """``settings`` with ``aot_executables`` set to ``folder/impl`` when given."""
    return settings if folder is None else {**settings,
                                            "aot_executables": os.path.join(folder, impl)}


def serialize_executables(out_dir: str, target_name: str, max_batch: int | None) -> int:
    """Compile the full plan's two engines (the XLA path and the Pallas GPU path) for the GPU
    target ``target_name`` on this host, without a GPU (``pdjax.aot``), and write their
    executables to ``out_dir/xla`` and ``out_dir/gpu``: ``gpu_check.sh`` then measures
    instead of compiling. They load only under the same jax/jaxlib as here (the lent H200:
    jax 0.11.2 with CUDA 13, Python 3.12; DESIGN.md §7). Returns the exit status."""
    from pdjax.aot.engine import AbstractEngine
    from pdjax.aot.targets import gpu_target
    from pdjax.config import ServerArgs
    from pdjax.runner.executables import save_executables

    plan = FULL
    if max_batch is not None:
        plan = dataclasses.replace(plan, decode_cases=tuple(
            c for c in plan.decode_cases if c[0] <= max_batch))
    target = gpu_target(target_name, num_gpus=1)
    rng = np.random.default_rng(0)
    compare = random_prompts(rng, plan.compare_lengths, plan.model["vocab_size"])
    failed = 0
    with tempfile.TemporaryDirectory(prefix="pdjax_gpu_check_") as folder:
        write_model_dir(folder, plan.model)
        for impl, settings in (("xla", xla_engine_settings(plan, compare)),
                               ("gpu", kernel_engine_settings(plan, False))):
            settings = dict(settings)
            buckets = settings.pop("buckets")
            settings.pop("progress")
            engine = AbstractEngine(ServerArgs(model_path=folder, **settings), target,
                                    buckets=buckets)
            results = [engine.compile_entry(e) for e in engine.entries("all")]
            for r in results:
                print(f"{impl} {r.name}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.1f} s"
                      + ("" if r.ok else f": {r.error.splitlines()[0][:200]}"), flush=True)
            failed += sum(not r.ok for r in results)
            print(save_executables(engine, results, os.path.join(out_dir, impl)), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", default=None,
                        help="tiny model on any backend (default without a GPU)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--peak-hbm-gbs", type=float, default=None,
                        help="HBM bandwidth (default: from the device name)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 TFLOP/s (default: from the device name)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="drop decode cases above this batch (a smaller GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aot-executables", default=None, metavar="DIR",
                        help="load the executables --serialize wrote (DIR/xla, DIR/gpu) "
                             "instead of compiling them, where they match")
    parser.add_argument("--serialize", default=None, metavar="DIR",
                        help="on a host without a GPU (jax with the CUDA plugin, e.g. the "
                             "device's own jax version): compile both engines' executables "
                             "for --target and write them to DIR, then exit")
    parser.add_argument("--target", default="h200", help="GPU target of --serialize")
    args = parser.parse_args(argv)
    if args.serialize:
        return serialize_executables(args.serialize, args.target, args.max_batch)

    import jax

    from bench_common import machine_info, now_iso, write_json

    t_start = time.perf_counter()
    backend = jax.default_backend()
    tiny = args.tiny if args.tiny is not None else backend != "gpu"
    plan = TINY if tiny else FULL
    if args.max_batch is not None:
        cases = tuple(c for c in plan.decode_cases if c[0] <= args.max_batch)
        if not cases:
            raise SystemExit(f"--max-batch {args.max_batch} leaves no decode case")
        plan = dataclasses.replace(plan, decode_cases=cases)
    kind, hbm_gbs, peak_tflops, source = peaks(args, tiny)
    interpret = backend != "gpu"
    print(f"gpu_engine_check: {'tiny' if tiny else 'Llama-3-8B shape'} {plan.dtype} on {kind} "
          f"({backend}); kernel path gpu{' (interpreted)' if interpret else ''}", flush=True)
    rng = np.random.default_rng(args.seed)
    compare = random_prompts(rng, plan.compare_lengths, plan.model["vocab_size"])
    result = {"date": now_iso(), "machine": machine_info(), "mode": "tiny" if tiny else "full",
              "device": kind, "backend": backend, "dtype": plan.dtype,
              "model": {k: plan.model[k] for k in ("vocab_size", "hidden_size",
                                                   "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads",
                                                   "head_dim")},
              "peak_hbm_gbs": hbm_gbs, "peak_tflops": peak_tflops, "peak_source": source,
              "engine_start_s": {}}
    from pdjax.engine import Engine

    with tempfile.TemporaryDirectory(prefix="pdjax_gpu_check_") as folder:
        write_model_dir(folder, plan.model)

        # 1. the jnp/XLA path (the reference), only for the comparison; freed before the next
        t0 = time.perf_counter()
        engine = Engine(folder, **with_executables(xla_engine_settings(plan, compare),
                                                   args.aot_executables, "xla"))
        result["engine_start_s"]["xla"] = time.perf_counter() - t0
        ref = run_comparison(engine, compare, plan.compare_tokens)
        engine.shutdown()
        del engine
        gc.collect()
        print(f"xla path done ({time.perf_counter() - t_start:.1f} s)", flush=True)

        # 2. the Pallas GPU kernel path: the comparison, then the figures
        t0 = time.perf_counter()
        engine = Engine(folder, **with_executables(kernel_engine_settings(plan, interpret),
                                                   args.aot_executables, "gpu"))
        result["engine_start_s"]["gpu"] = time.perf_counter() - t0
        core = engine.core
        result["model"]["param_bytes"] = weight_read_bytes(core, 1)[0]
        result["warmup_shapes"] = len(core.buckets.all_keys())
        result["attention_paths"] = compare_tokens(
            run_comparison(engine, compare, plan.compare_tokens), ref, plan.gap_tol)
        print(f"comparison done ({time.perf_counter() - t_start:.1f} s)", flush=True)
        result["decode"] = []
        for batch, context in plan.decode_cases:
            result["decode"].append(run_decode_case(engine, rng, batch, context,
                                                    plan.new_tokens, hbm_gbs))
            print(f"decode batch {batch} context {context} done "
                  f"({time.perf_counter() - t_start:.1f} s)", flush=True)
        result["prefill"] = run_prefill(engine, rng, plan, peak_tflops)
        result["compiles_after_warmup"] = core.runner.compiles_after_warmup
        result["executables_loaded"] = (core.runner.executables.num_loaded
                                        if core.runner.executables is not None else 0)
        engine.shutdown()
    result["total_s"] = time.perf_counter() - t_start
    # Packages the GPU host lacks (DESIGN.md §5): the colocated engine path must not need them.
    result["imported_host_lacks"] = sorted(m for m in HOST_LACKS if m in sys.modules)
    print_report(result)
    write_json(args.json, result)
    ok = (result["attention_paths"]["tokens_match"]
          and all(d["roofline_fraction"] is not None for d in result["decode"])
          and result["prefill"]["tflops"] is not None)
    if not ok:
        print("gpu_engine_check: FAIL (tokens differ past a tie, or a figure is missing)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
