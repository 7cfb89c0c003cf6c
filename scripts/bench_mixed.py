#!/usr/bin/env python
"""The Sarathi-Serve experiment at this machine's scale: decode ITL while a long prompt arrives,
with mixed batches on and off (``--enable-mixed-chunk``), in one process so the ratio is fair.

``--batch-size`` (B) requests decode steadily; then one ``--long-prompt-len`` (L) prompt
arrives. Its prefill is chunked by ``--chunked-prefill-size`` (C). Without mixed batches the
scheduler alternates a decode step and a prefill-chunk step, so every decode token of the
arrival window waits for a whole extra forward; with mixed batches the decode rows ride in the
chunk's forward (SGLang's ``mix_with_running``; shared/seeds/003, Sarathi-Serve figure 7):

    off:  |decode B|prefill C|decode B|prefill C|decode B| ...   ITL = t(B) + t(C)
    on:   |mixed B + (C-B)|mixed B + (C-B)|decode B| ...           ITL = t(B + C - B)

One offline ``EngineCore`` (warmed up once) runs every setting: ``--repeats`` rounds of
off, on (alternating, so background load hits both alike). Each round uses fresh random
prompts and flushes the prefix cache. ITL is measured as the host sees it: the time between
consecutive tokens of one decode request (each ``step()`` return is one token per request).

Reported per setting (ms): steady-state decode ITL and arrival-window ITL (every gap between two
tokens of a decode request that overlaps the interval from the long prompt's arrival to its
first token; with mixed batches off, the last such gap spans the final prefill chunk and ends
after it) as p50/p99/max, the ratio of
each to the steady state, the long prompt's TTFT, the forward kinds in the window, and host
overhead (scheduling + batch building + sampling vs forward). JSON with ``--output-file``.

    python scripts/bench_mixed.py --batch-size 8 --long-prompt-len 1024 --chunked-prefill-size 256
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time
import uuid
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (StepProfiler, engine_step_times, machine_info, now_iso, print_table,  # noqa: E402
                          ratio, summarize_ms, trace_files, write_json)

SETTINGS = (("mixed_off", False), ("mixed_on", True))


def build_core(args):
    from pdjax.config import ServerArgs
    from pdjax.engine import EngineCore

    server_args = ServerArgs(
        model_path=args.model_path, dtype=args.dtype, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length,
        skip_warmup_progress=True)
    return EngineCore(server_args, progress=False)


def _request(ids: list[int], max_new_tokens: int):
    from pdjax.engine_io import GenerateRequest
    from pdjax.request import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(uuid.uuid4().hex, list(ids), sp)


def decode_tokens_needed(args) -> int:
    """Tokens each decode request must be allowed: steady steps, the arrival window (at most
    two steps per chunk), the tail, and slack for the initial prefill steps."""
    chunks = -(-args.long_prompt_len // (args.chunked_prefill_size - args.batch_size))
    return args.steady_steps + 2 * chunks + args.tail_steps + 8


def run_round(core, args, mixed: bool, seed: int, profiler: StepProfiler | None = None) -> dict:
    """One arrival experiment; returns raw ITL samples (s), TTFT (s) and window details."""
    sched = core.scheduler
    sched.config = dataclasses.replace(sched.config, enable_mixed_chunk=mixed)
    core.flush_cache()
    rng = np.random.default_rng(seed)
    vocab = core.model_cfg.vocab_size
    special = set(core.eos_token_ids)

    def prompt(n):
        ids = rng.integers(3, vocab, size=n).tolist()
        return [t if t not in special else 3 for t in ids]

    max_new = decode_tokens_needed(args)
    decode_rids = []
    for _ in range(args.batch_size):
        g = _request(prompt(args.decode_prompt_len), max_new)
        core.add_request(g)
        decode_rids.append(g.rid)
    stamps: dict[str, list[float]] = collections.defaultdict(list)
    modes_seen: list[str] = []

    def on_step(batch, outs):
        modes_seen.append(batch.forward_mode)

    def step() -> str | None:
        """One engine step; stamps each output token; returns the forward kind (or None)."""
        n = len(modes_seen)
        outs = core.step()
        now = time.perf_counter()
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.rid} failed: {o.error}")
            if o.new_token_ids:
                stamps[o.rid].append(now)
        return modes_seen[-1] if len(modes_seen) > n else None

    core.step_hooks.append(on_step)
    try:
        return _arrival(core, args, step, stamps, decode_rids, prompt, profiler)
    finally:
        core.step_hooks.remove(on_step)
        for rid in decode_rids:
            core.abort_request(rid)


def _arrival(core, args, step, stamps, decode_rids, prompt, profiler) -> dict:
    # Prefill the decode batch, then let it decode steadily.
    while any(len(stamps[r]) == 0 for r in decode_rids):
        step()
    t_steady = time.perf_counter()
    for _ in range(args.steady_steps):
        step()
    if profiler is not None:
        profiler.start()
    snap = (core.num_steps, core.host_time_s, core.forward_time_s)
    long_req = _request(prompt(args.long_prompt_len), 1)
    t_arrival = time.perf_counter()
    core.add_request(long_req)
    modes: collections.Counter = collections.Counter()
    while not stamps[long_req.rid]:
        modes[step()] += 1
    t_first = stamps[long_req.rid][0]
    window_overhead = engine_step_times(core, *snap)
    for _ in range(args.tail_steps):
        step()
    if profiler is not None:
        profiler.stop()
    steady, arrival = [], []
    for rid in decode_rids:
        ts = stamps[rid]
        for a, b in zip(ts, ts[1:]):
            if a >= t_steady and b <= t_arrival:
                steady.append(b - a)
            elif b > t_arrival and a < t_first:      # the gap overlaps the long prefill
                arrival.append(b - a)
    return {"steady_itl_s": steady, "arrival_itl_s": arrival, "ttft_s": t_first - t_arrival,
            "window_steps": dict(modes), "window_host": window_overhead}


def _stats(samples_s: list[float]) -> dict[str, float | None]:
    s = summarize_ms(samples_s)
    return {"p50": s["median"], "p99": s["p99"], "max": s["max"], "mean": s["mean"],
            "num_samples": len(samples_s)}


def summarize_setting(rounds: list[dict]) -> dict[str, Any]:
    steady = _stats([x for r in rounds for x in r["steady_itl_s"]])
    arrival = _stats([x for r in rounds for x in r["arrival_itl_s"]])
    steps: collections.Counter = collections.Counter()
    for r in rounds:
        steps.update(r["window_steps"])
    host = [r["window_host"] for r in rounds]
    n_steps = sum(h["num_steps"] for h in host)
    host_ms = sum((h["host_time_per_step_ms"] or 0) * h["num_steps"] for h in host)
    fwd_ms = sum((h["forward_time_per_step_ms"] or 0) * h["num_steps"] for h in host)
    return {
        "steady_itl_ms": steady,
        "arrival_itl_ms": arrival,
        "ratio_p50_to_steady_p50": ratio(arrival["p50"], steady["p50"]),
        "ratio_p99_to_steady_p99": ratio(arrival["p99"], steady["p99"]),
        "ratio_max_to_steady_p50": ratio(arrival["max"], steady["p50"]),
        "long_prompt_ttft_ms": summarize_ms(r["ttft_s"] for r in rounds)["median"],
        "arrival_p99_per_round_ms": [_stats(r["arrival_itl_s"])["p99"] for r in rounds],
        "window_forward_modes": dict(steps),
        "window_host_overhead": {
            "num_steps": n_steps,
            "host_time_per_step_ms": host_ms / n_steps if n_steps else None,
            "forward_time_per_step_ms": fwd_ms / n_steps if n_steps else None,
            "host_overhead_fraction": ratio(host_ms, host_ms + fwd_ms)},
    }


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    core = build_core(args)
    load_s = time.perf_counter() - t0
    if args.long_prompt_len + 1 >= core.context_length:
        raise ValueError(f"--long-prompt-len {args.long_prompt_len} does not fit the context "
                         f"length {core.context_length}")
    compiles0 = core.runner.compiles_after_warmup
    rounds: dict[str, list[dict]] = {name: [] for name, _ in SETTINGS}
    for i in range(args.repeats):
        for name, mixed in SETTINGS:
            rounds[name].append(run_round(core, args, mixed, seed=args.seed + i))
    if args.profile_dir:
        # Extra, unmeasured rounds: tracing slows the steps it records.
        for name, mixed in SETTINGS:
            profiler = StepProfiler(core, os.path.join(args.profile_dir, name), args.profile_steps)
            run_round(core, args, mixed, seed=args.seed + args.repeats, profiler=profiler)
    result: dict[str, Any] = {
        "date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
        "dtype": args.dtype, "batch_size": args.batch_size,
        "decode_prompt_len": args.decode_prompt_len, "long_prompt_len": args.long_prompt_len,
        "chunked_prefill_size": args.chunked_prefill_size, "page_size": args.page_size,
        "steady_steps": args.steady_steps, "repeats": args.repeats,
        "engine_load_and_warmup_s": load_s, "warmup_s": core.warmup_s,
        "compiles_after_warmup": core.runner.compiles_after_warmup - compiles0,
    }
    for name, _ in SETTINGS:
        result[name] = summarize_setting(rounds[name])
    off, on = result["mixed_off"], result["mixed_on"]
    result["arrival_p99_on_over_off"] = ratio(on["arrival_itl_ms"]["p99"], off["arrival_itl_ms"]["p99"])
    result["arrival_p50_on_over_off"] = ratio(on["arrival_itl_ms"]["p50"], off["arrival_itl_ms"]["p50"])
    result["ttft_on_over_off"] = ratio(on["long_prompt_ttft_ms"], off["long_prompt_ttft_ms"])
    result["profile_traces"] = trace_files(args.profile_dir) if args.profile_dir else []
    result["machine"] = machine_info()
    rows = []
    for name, _ in SETTINGS:
        r = result[name]
        rows += [(f"-- {name} --", ""),
                 ("Steady ITL p50 / p99 (ms):", f"{r['steady_itl_ms']['p50']:.2f} / {r['steady_itl_ms']['p99']:.2f}"),
                 ("Arrival ITL p50 (ms):", r["arrival_itl_ms"]["p50"]),
                 ("Arrival ITL p99 (ms):", r["arrival_itl_ms"]["p99"]),
                 ("Arrival ITL max (ms):", r["arrival_itl_ms"]["max"]),
                 ("Arrival p99 / steady p99:", r["ratio_p99_to_steady_p99"]),
                 ("Long prompt TTFT (ms):", r["long_prompt_ttft_ms"]),
                 ("Host overhead fraction:", r["window_host_overhead"]["host_overhead_fraction"])]
    rows += [("-- on / off --", ""), ("Arrival ITL p99 ratio:", result["arrival_p99_on_over_off"]),
             ("Long prompt TTFT ratio:", result["ttft_on_over_off"]),
             ("Compiles after warm-up:", result["compiles_after_warmup"])]
    print_table("Mixed-batch arrival benchmark", rows)
    write_json(args.output_file, result)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or GGUF (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=8, help="decode requests (B)")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--steady-steps", type=int, default=16)
    p.add_argument("--tail-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="default: batch size + 1 (the long prompt)")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: long prompt + 64, rounded up to a page")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-dir", default=None,
                   help="XLA trace of --profile-steps steps from the arrival, in an extra "
                        "unmeasured round per setting (DIR/mixed_off, DIR/mixed_on)")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    for name in ("batch_size", "decode_prompt_len", "long_prompt_len", "chunked_prefill_size",
                 "steady_steps", "repeats", "profile_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.chunked_prefill_size <= args.batch_size:
        p.error("--chunked-prefill-size must exceed --batch-size (mixed steps need room for a chunk)")
    if args.max_running_requests is None:
        args.max_running_requests = args.batch_size + 1
    if args.context_length is None:
        need = max(args.long_prompt_len, args.decode_prompt_len + decode_tokens_needed(args)) + 16
        args.context_length = -(-need // args.page_size) * args.page_size
    return args


if __name__ == "__main__":
    main()
