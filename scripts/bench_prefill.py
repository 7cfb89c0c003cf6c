#!/usr/bin/env python
"""Prefill time of long prompts: pdjax with each jnp attention path, and transformers, in one
process.

For each ``--prompt-lens`` length, one prompt of random tokens goes through the model with
one output token (so the time is the prefill: ``ceil(len / chunked_prefill_size)`` chunks in
pdjax, one forward in transformers). pdjax runs once per ``--attention-backends`` entry
(default ``reference``, the per-token path, then ``xla``, the per-request one), each engine
warmed up first (its compiles are not timed) and the first token compared with transformers'.

    python scripts/bench_prefill.py --prompt-lens 2048,4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine_info, now_iso, print_table, write_json  # noqa: E402


def run_pdjax(args, backend: str, prompts: list[list[int]]) -> dict:
    from pdjax.engine import Engine

    longest = max(len(p) for p in prompts) + 1
    context = -(-(longest + 1) // args.page_size) * args.page_size
    engine = Engine(args.model_path, dtype="float32", page_size=args.page_size,
                    max_running_requests=args.max_running_requests,
                    chunked_prefill_size=args.chunked_prefill_size,
                    max_total_tokens=max(16384, longest + 2 * args.page_size),
                    context_length=context, attention_backend=backend, progress=False,
                    skip_warmup_progress=True, disable_radix_cache=True)
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    times, tokens = [], []
    try:
        for p in prompts:
            t0 = time.perf_counter()
            out = engine.generate(input_ids=p, sampling_params=sp)
            times.append(time.perf_counter() - t0)
            tokens.append(out["output_ids"][0])
        compiles = engine.core.runner.compiles_after_warmup
    finally:
        engine.shutdown()
    return {"prefill_s": times, "first_tokens": tokens, "compiles_after_warmup": compiles}


def run_transformers(args, prompts: list[list[int]]) -> dict:
    import torch

    from bench_vs_hf import load_hf

    torch.set_num_threads(args.torch_threads)
    model = load_hf(args.model_path, "float32")
    times, tokens = [], []
    with torch.inference_mode():
        model(torch.tensor([prompts[0][:16]]))                       # untimed warm-up
        for p in prompts:
            t0 = time.perf_counter()
            logits = model(torch.tensor([p])).logits[0, -1]
            times.append(time.perf_counter() - t0)
            tokens.append(int(logits.argmax()))
    return {"prefill_s": times, "first_tokens": tokens}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--prompt-lens", default="2048,4096")
    p.add_argument("--attention-backends", default="reference,xla")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=os.cpu_count())
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, 40000, n).tolist() for n in lens]

    results = {b: run_pdjax(args, b, prompts) for b in args.attention_backends.split(",")}
    if not args.no_transformers:
        results["transformers"] = run_transformers(args, prompts)
    rows = []
    for name, r in results.items():
        for n, t in zip(lens, r["prefill_s"]):
            rows.append((f"{name}: {n}-token prompt (s)", round(t, 2)))
    if "transformers" in results:
        want = results["transformers"]["first_tokens"]
        for name, r in results.items():
            if name != "transformers":
                rows.append((f"{name}: first tokens = transformers",
                             sum(a == b for a, b in zip(r["first_tokens"], want))))
    print_table("prefill time, one prompt at a time", rows, width=64)
    result = {"date": now_iso(), "machine": machine_info(), "prompt_lens": lens,
              "chunked_prefill_size": args.chunked_prefill_size, "results": results}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
