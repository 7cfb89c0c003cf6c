#!/usr/bin/env python
"""pdjax's offline ``Engine`` vs transformers' batched ``generate`` on the same model, prompts
and greedy settings, in one process: output tokens/s of each, the ratio, and whether the
tokens match.

Both run ``--num-prompts`` prompts of ``--input-len`` random tokens (equal lengths, so
transformers needs no padding; ``--range-ratio`` < 1 varies them and left-pads) for exactly
``--output-len`` greedy tokens (EOS ignored on both sides), in float32 by default. Each side
gets an untimed warm-up run first (pdjax's bucket compiles happen at engine start and are
reported separately).

Token match is exact and tie-aware (DESIGN.md §5): a prompt matches when the tokens agree up
to and including the first position where transformers' top-2 logit gap is below
``--tie-gap`` (after a near-tie, either choice is right and the continuations may differ).

    python scripts/bench_vs_hf.py --num-prompts 16 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (StepProfiler, add_offline_engine_args, engine_step_times,  # noqa: E402
                          machine_info, now_iso, offline_engine, print_table, ratio,
                          require_positive, trace_files, write_json)


def make_prompts(vocab_size: int, special: set[int], num: int, input_len: int, range_ratio: float,
                 seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num)
    allowed = np.array([t for t in range(vocab_size) if t not in special])
    return [allowed[rng.integers(0, len(allowed), size=int(n))].tolist() for n in lens]


def run_pdjax(args, prompts: list[list[int]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = offline_engine(args, prompts)
    load_s = time.perf_counter() - t0
    sp = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    core = engine.core
    engine.generate(input_ids=[p[: max(1, len(p) // 2)] for p in prompts], sampling_params=sp)
    core.flush_cache()
    compiles0 = core.runner.compiles_after_warmup
    snap = (core.num_steps, core.host_time_s, core.forward_time_s)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    elapsed = time.perf_counter() - t0
    result = {"time_s": elapsed, "load_and_warmup_s": load_s, "warmup_s": core.warmup_s,
              "output_ids": [o["output_ids"] for o in outs],
              "compiles_after_warmup": core.runner.compiles_after_warmup - compiles0,
              "step_times": engine_step_times(core, *snap)}
    if args.profile_dir:
        # An extra, untimed run: tracing slows the steps it records.
        core.flush_cache()
        profiler = StepProfiler(core, os.path.join(args.profile_dir, "pdjax"), args.profile_steps)
        profiler.start()
        engine.generate(input_ids=prompts, sampling_params=sp)
        profiler.stop()
    engine.shutdown()
    return result


def load_hf(model_path: str | None, dtype: str):
    import torch
    import transformers

    from pdjax.models.loader import is_gguf, resolve_model_path

    path = resolve_model_path(model_path)
    torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    kw = {"dtype": torch_dtype}
    if is_gguf(path):
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def greedy_generate_inputs(prompts: list[list[int]], pad_id: int):
    """``(input_ids [N, n], attention_mask [N, n], generate kwargs)`` for one left-padded
    batch of greedy ``generate`` (EOS ignored, logits returned)."""
    import torch

    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):           # left padding, as batched generation needs
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=pad_id,
              return_dict_in_generate=True, output_logits=True)
    return ids, mask, kw


def run_hf(args, prompts: list[list[int]], pad_id: int) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    model = load_hf(args.model_path, args.dtype)
    load_s = time.perf_counter() - t0
    ids, mask, kw = greedy_generate_inputs(prompts, pad_id)
    n = ids.shape[1]
    with torch.inference_mode():
        model.generate(ids[:, -max(1, n // 2):], attention_mask=mask[:, -max(1, n // 2):],
                       max_new_tokens=min(4, args.output_len), **kw)
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, **kw)
        elapsed = time.perf_counter() - t0
    tokens = gen.sequences[:, n:].tolist()
    logits = torch.stack(gen.logits, 1).float().numpy()           # [N, output_len, V]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    gaps = (top2[..., 1] - top2[..., 0]).tolist()
    return {"time_s": elapsed, "load_s": load_s, "output_ids": tokens, "top2_gaps": gaps,
            "torch_threads": torch.get_num_threads()}


def compare(ours: list[list[int]], ref: list[list[int]], gaps: list[list[float]],
            tie_gap: float) -> dict[str, Any]:
    """Exact and tie-aware (DESIGN.md §5) agreement of greedy tokens, per prompt."""
    exact = tie = 0
    first_mismatch, compared = [], 0
    for a, b, g in zip(ours, ref, gaps):
        n = len(b)
        for i, gap in enumerate(g):
            if gap < tie_gap:
                n = i + 1
                break
        mism = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if mism is None and len(a) != len(b):
            mism = min(len(a), len(b))
        first_mismatch.append(mism)
        exact += mism is None
        tie += list(a[:n]) == list(b[:n])
        compared += n
    return {"num_prompts_exact_match": exact, "num_prompts_match_tie_aware": tie,
            "tokens_match": tie == len(ref), "positions_compared": compared,
            "first_mismatch_positions": first_mismatch}


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    from pdjax.models.loader import load_tokenizer

    tok = load_tokenizer(args.model_path)
    special = set(getattr(tok, "all_special_ids", []) or [])
    prompts = make_prompts(len(tok), special, args.num_prompts, args.input_len,
                           args.range_ratio, args.seed)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    ours = run_pdjax(args, prompts)
    ref = run_hf(args, prompts, pad_id)
    out_tokens = args.num_prompts * args.output_len
    result: dict[str, Any] = {
        "date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
        "dtype": args.dtype, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio,
        "total_input_tokens": sum(len(p) for p in prompts), "total_output_tokens": out_tokens,
        "pdjax_time_s": ours["time_s"], "hf_time_s": ref["time_s"],
        "pdjax_output_throughput": out_tokens / ours["time_s"],
        "hf_output_throughput": out_tokens / ref["time_s"],
        "pdjax_load_and_warmup_s": ours["load_and_warmup_s"], "pdjax_warmup_s": ours["warmup_s"],
        "hf_load_s": ref["load_s"], "hf_torch_threads": ref["torch_threads"],
        "pdjax_compiles_after_warmup": ours["compiles_after_warmup"],
        "pdjax_step_times": ours["step_times"],
    }
    result["throughput_ratio_pdjax_over_hf"] = ratio(result["pdjax_output_throughput"],
                                                     result["hf_output_throughput"])
    result.update(compare(ours["output_ids"], ref["output_ids"], ref["top2_gaps"], args.tie_gap))
    result["profile_traces"] = trace_files(args.profile_dir) if args.profile_dir else []
    result["machine"] = machine_info()
    st = result["pdjax_step_times"]
    print_table("pdjax vs transformers (greedy)", [
        ("Prompts x (input, output) tokens:", f"{args.num_prompts} x ({args.input_len}, {args.output_len})"),
        ("pdjax output tok/s:", result["pdjax_output_throughput"]),
        ("transformers output tok/s:", result["hf_output_throughput"]),
        ("Ratio pdjax / transformers:", result["throughput_ratio_pdjax_over_hf"]),
        ("Prompts matching (exact):", f"{result['num_prompts_exact_match']}/{args.num_prompts}"),
        ("Prompts matching (tie-aware):", f"{result['num_prompts_match_tie_aware']}/{args.num_prompts}"),
        ("pdjax steps:", st["num_steps"]),
        ("pdjax host time per step (ms):", st["host_time_per_step_ms"]),
        ("pdjax forward time per step (ms):", st["forward_time_per_step_ms"]),
        ("pdjax compiles after warm-up:", result["pdjax_compiles_after_warmup"])])
    write_json(args.output_file, result)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=1.0)
    add_offline_engine_args(p, chunked_prefill_size=512, max_total_tokens=4096)
    p.add_argument("--tie-gap", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-dir", default=None,
                   help="XLA trace of --profile-steps pdjax steps, in an extra untimed run")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    require_positive(p, args, ("num_prompts", "input_len", "output_len", "page_size",
                               "chunked_prefill_size", "profile_steps"))
    if not 0.0 < args.range_ratio <= 1.0:
        p.error("--range-ratio must be in (0, 1]")
    return args


if __name__ == "__main__":
    main()
