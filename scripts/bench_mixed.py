#!/usr/bin/env python
"""The Sarathi-Serve experiment at this machine's scale: decode ITL while a long prompt arrives,
with mixed batches off, on, and on with a token budget sized to an ITL target
(``--enable-mixed-chunk --target-itl-ms``), in one process so the ratios are fair.

``--batch-size`` (B) requests decode steadily; then one ``--long-prompt-len`` (L) prompt
arrives. Its prefill is chunked by ``--chunked-prefill-size`` (C). Without mixed batches the
scheduler alternates a decode step and a prefill-chunk step, so every decode token of the
arrival window waits for a whole extra forward; with mixed batches the decode rows ride in the
chunk's forward (SGLang's ``mix_with_running``; shared/seeds/003, Sarathi-Serve figure 7):

    off:  |decode B|prefill C|decode B|prefill C|decode B| ...   ITL = t(B) + t(C)
    on:   |mixed B + (C-B)|mixed B + (C-B)|decode B| ...           ITL = t(B + C - B)

    target: |mixed B + n|mixed B + n|mixed B + n| ...  n: the largest bucket fill whose
                                                          predicted step fits the target

One offline ``EngineCore`` (warmed up once) runs every setting: ``--repeats`` rounds of
off, on, on with the target, and the sweep targets, interleaved (so background load hits all
alike). The targets are multiples (``--target-factors``; the first is the headline setting)
of the steady decode step, measured first with the same batch. Each round uses fresh random
prompts and flushes the prefix cache. ITL is measured as the host sees it: the time between
consecutive tokens of one decode request (each ``step()`` return is one token per request).

Reported per setting (ms): steady-state decode ITL and arrival-window ITL (every gap between two
tokens of a decode request that overlaps the interval from the long prompt's arrival to its
first token; with mixed batches off, the last such gap spans the final prefill chunk and ends
after it) as p50/p99/max, the ratio of
each to the steady state, the long prompt's TTFT, the forward kinds in the window, and host
overhead (scheduling + batch building + sampling vs forward), and the window throughput
(decode tokens plus the long prompt's tokens over the window); the stall-free bound (1.5 x the
steady ITL p99) and, under a target, the target over that bound and the share of arrival gaps
over the target. JSON with ``--output-file``;
``--plot-file`` draws every decoding request's inter-token gaps over time (PNG, matplotlib);
``--step-trace-file`` keeps every timed forward (key, tokens, cached tokens, measured and
predicted seconds) for replaying the cost model.

    python scripts/bench_mixed.py --batch-size 8 --long-prompt-len 1024 --chunked-prefill-size 256
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (StepProfiler, engine_step_times, machine_info, now_iso, print_table,  # noqa: E402
                          ratio, require_positive, summarize_ms, trace_files, write_json)

BASE_SETTINGS = ("mixed_off", "mixed_on", "mixed_on_target")


def settings(targets_ms: list[float]) -> list[tuple[str, bool, float | None]]:
    """``(name, mixed, target_itl_ms)``: off, on, on with the first target, then the sweep."""
    out = [("mixed_off", False, None), ("mixed_on", True, None), ("mixed_on_target", True, targets_ms[0])]
    out += [(f"target_{t:.0f}ms", True, t) for t in targets_ms[1:]]
    return out


def build_core(args):
    from pdjax.config import ServerArgs
    from pdjax.engine import EngineCore

    server_args = ServerArgs(
        model_path=args.model_path, dtype=args.dtype, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length,
        # The window accounting (the forwards between the arrival and the first token) is the
        # synchronous loop's; overlapped scheduling is measured by bench_step_overlap.py.
        disable_overlap_schedule=True, skip_warmup_progress=True,
        unroll_layers=args.unroll_layers)
    return EngineCore(server_args, progress=False)


def _request(ids: list[int], max_new_tokens: int):
    from pdjax.engine_io import GenerateRequest
    from pdjax.request import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(uuid.uuid4().hex, list(ids), sp)


def decode_tokens_needed(args) -> int:
    """Tokens each decode request must be allowed: steady steps, the arrival window (at most
    two steps per chunk; under a target a chunk may be a single token, the planner's floor),
    the tail, and slack for the initial prefill steps. With ``--context-length`` given, capped
    to the room it leaves after the decode prompt: the decode requests may then finish before
    the long prompt's first token, and the arrival window ends with them."""
    need = args.steady_steps + 2 * args.long_prompt_len + args.tail_steps + 8
    if args.context_length is not None:
        need = min(need, args.context_length - args.decode_prompt_len - 1)
    return need


def run_round(core, args, mixed: bool, seed: int, profiler: StepProfiler | None = None,
              target_itl_ms: float | None = None, trace: list | None = None) -> dict:
    """One arrival experiment; returns raw ITL samples (s), TTFT (s) and window details."""
    sched = core.scheduler
    sched.config = dataclasses.replace(sched.config, enable_mixed_chunk=mixed,
                                       target_itl_ms=target_itl_ms)
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
    last_fwd = [core.forward_time_s]

    def on_step(batch, outs):
        modes_seen.append(batch.forward_mode)
        if trace is not None:
            key = core.buckets.pick(batch.forward_mode, batch.num_tokens, len(batch.rows),
                                    batch.pages_per_seq(core.args.page_size))
            trace.append({"key": dataclasses.asdict(key), "num_tokens": batch.num_tokens,
                          "num_cached_tokens": batch.num_cached_tokens,
                          "num_chunk_pairs": batch.num_chunk_pairs,
                          "measured_s": core.forward_time_s - last_fwd[0],
                          "predicted_s": batch.predicted_time_s})
        last_fwd[0] = core.forward_time_s

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
        return _arrival(core, args, step, stamps, decode_rids, prompt, profiler, modes_seen)
    finally:
        core.step_hooks.remove(on_step)
        for rid in decode_rids:
            core.abort_request(rid)


def _arrival(core, args, step, stamps, decode_rids, prompt, profiler, modes_seen) -> dict:
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
    steady, arrival, window_tokens = [], [], 0
    gaps = []          # per decode request: [(end of the gap - arrival, gap)] in s, for the plot
    for rid in decode_rids:
        ts = stamps[rid]
        gaps.append([(b - t_arrival, b - a) for a, b in zip(ts, ts[1:]) if b >= t_steady])
        window_tokens += sum(t_arrival < t <= t_first for t in ts)
        for a, b in zip(ts, ts[1:]):
            if a >= t_steady and b <= t_arrival:
                steady.append(b - a)
            elif b > t_arrival and a < t_first:      # the gap overlaps the long prefill
                arrival.append(b - a)
    window_s = t_first - t_arrival
    return {"steady_itl_s": steady, "arrival_itl_s": arrival, "ttft_s": window_s,
            "window_steps": dict(modes), "window_host": window_overhead, "gaps": gaps,
            "window_throughput": (window_tokens + args.long_prompt_len) / window_s}


def _stats(samples_s: list[float]) -> dict[str, float | None]:
    s = summarize_ms(samples_s)
    return {"p50": s["median"], "p99": s["p99"], "max": s["max"], "mean": s["mean"],
            "num_samples": len(samples_s)}


#: The stall-free bound (DESIGN.md §3): arrival ITL p99 at most this many times the steady ITL p99.
ITL_BOUND_FACTOR = 1.5


def summarize_setting(rounds: list[dict], target_itl_ms: float | None = None) -> dict[str, Any]:
    """Figures of one setting over its rounds (``run_round``'s dicts). With ``target_itl_ms``
    also the share of arrival gaps longer than the target (what the planner promises to keep
    small) and the target over the stall-free bound (``ITL_BOUND_FACTOR`` x the steady ITL p99):
    above 1, a step the planner fits to its target already breaks the bound."""
    steady = _stats([x for r in rounds for x in r["steady_itl_s"]])
    arrival_s = [x for r in rounds for x in r["arrival_itl_s"]]
    arrival = _stats(arrival_s)
    bound_ms = None if steady["p99"] is None else ITL_BOUND_FACTOR * steady["p99"]
    over = None
    if target_itl_ms is not None and arrival_s:
        over = sum(1000 * x > target_itl_ms for x in arrival_s) / len(arrival_s)
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
        "itl_bound_ms": bound_ms,
        "target_itl_ms": target_itl_ms,
        "target_over_bound": None if target_itl_ms is None else ratio(target_itl_ms, bound_ms),
        "arrival_share_over_target": over,
        "long_prompt_ttft_ms": summarize_ms(r["ttft_s"] for r in rounds)["median"],
        "window_throughput_tok_s": statistics.median(r["window_throughput"] for r in rounds),
        "arrival_p99_per_round_ms": [_stats(r["arrival_itl_s"])["p99"] for r in rounds],
        "window_forward_modes": dict(steps),
        "window_host_overhead": {
            "num_steps": n_steps,
            "host_time_per_step_ms": host_ms / n_steps if n_steps else None,
            "forward_time_per_step_ms": fwd_ms / n_steps if n_steps else None,
            "host_overhead_fraction": ratio(host_ms, host_ms + fwd_ms)},
    }


def measure_decode_step(core, args, num_steps: int = 12) -> float:
    """Median forward time (ms) of a decode step of the benchmark's batch, mixed batches off."""
    sched = core.scheduler
    sched.config = dataclasses.replace(sched.config, enable_mixed_chunk=False, target_itl_ms=None)
    rng = np.random.default_rng(args.seed + 10_000)
    rids = []
    for _ in range(args.batch_size):
        g = _request(rng.integers(3, 100, size=args.decode_prompt_len).tolist(), num_steps + 4)
        core.add_request(g)
        rids.append(g.rid)
    times, modes = [], []
    core.step_hooks.append(lambda batch, outs: modes.append(batch.forward_mode))
    try:
        while core.scheduler.has_work and len(times) < num_steps:
            before = core.forward_time_s
            n = len(modes)
            core.step()
            if len(modes) > n and modes[-1] == "decode":
                times.append(core.forward_time_s - before)
    finally:
        core.step_hooks.pop()
        for rid in rids:
            core.abort_request(rid)
    return 1000 * statistics.median(times)


def plot_gaps(rounds: dict[str, dict], ttft_s: dict[str, float], path: str, title: str,
              targets_ms: dict[str, float | None] | None = None) -> None:
    """One panel per setting: every decoding request's inter-token gaps (ms, log scale) against
    the time since the long prompt arrived; the dashed line is its first token, the dotted
    one the ITL target (where set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rounds)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names):
        for req_gaps in rounds[name]["gaps"]:
            if req_gaps:
                x, y = zip(*req_gaps)
                ax.plot(x, [1000 * g for g in y], marker=".", linewidth=0.8, markersize=3)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.axvline(ttft_s[name], color="black", linestyle="--", linewidth=0.8)
        if targets_ms and targets_ms.get(name):
            ax.axhline(targets_ms[name], color="red", linestyle=":", linewidth=1.0)
        ax.set_yscale("log")
        ax.set_title(name.replace("_", " "), fontsize=10)
        ax.set_xlabel("time since the long prompt arrived (s)")
    np.atleast_1d(axes)[0].set_ylabel("inter-token gap (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    core = build_core(args)
    load_s = time.perf_counter() - t0
    if args.long_prompt_len + 1 >= core.context_length:
        raise ValueError(f"--long-prompt-len {args.long_prompt_len} does not fit the context "
                         f"length {core.context_length}")
    from pdjax.engine.forward import seed_cost_model

    compiles0 = core.runner.compiles_after_warmup
    num_seeded = seed_cost_model(core.runner, core.buckets, core.cost_model)
    decode_step_ms = measure_decode_step(core, args)
    print(f"warm-up {core.warmup_s:.0f} s, {num_seeded} seed forwards; steady decode step "
          f"{decode_step_ms:.1f} ms", file=sys.stderr, flush=True)
    targets_ms = ([float(t) for t in args.target_itl_ms] if args.target_itl_ms
                  else [f * decode_step_ms for f in args.target_factors])
    plan = settings(targets_ms)
    trace: list[dict] | None = [] if args.step_trace_file else None
    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in plan}
    for i in range(args.repeats):
        for name, mixed, target in plan:
            rounds[name].append(run_round(core, args, mixed, seed=args.seed + i,
                                          target_itl_ms=target, trace=trace))
            r = rounds[name][-1]
            print(f"round {i + 1}/{args.repeats} {name}: arrival ITL p99 "
                  f"{_stats(r['arrival_itl_s'])['p99']:.1f} ms, TTFT {1000 * r['ttft_s']:.0f} ms",
                  file=sys.stderr, flush=True)
    if args.profile_dir:
        # Extra, unmeasured rounds: tracing slows the steps it records.
        for name, mixed, target in plan[:2]:
            profiler = StepProfiler(core, os.path.join(args.profile_dir, name), args.profile_steps)
            run_round(core, args, mixed, seed=args.seed + args.repeats, profiler=profiler,
                      target_itl_ms=target)
    result: dict[str, Any] = {
        "date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
        "dtype": args.dtype, "batch_size": args.batch_size,
        "decode_prompt_len": args.decode_prompt_len, "long_prompt_len": args.long_prompt_len,
        "chunked_prefill_size": args.chunked_prefill_size, "page_size": args.page_size,
        "steady_steps": args.steady_steps, "repeats": args.repeats,
        "unroll_layers": args.unroll_layers,
        "engine_load_and_warmup_s": load_s, "warmup_s": core.warmup_s,
        "cost_model_seed_forwards": num_seeded,
        "steady_decode_step_ms": decode_step_ms, "target_itl_ms": targets_ms[0],
        "target_factor": targets_ms[0] / decode_step_ms,
    }
    for name, _, target in plan:
        result[name] = summarize_setting(rounds[name], target)
    result["compiles_after_warmup"] = core.runner.compiles_after_warmup - compiles0
    off, on, tgt = result["mixed_off"], result["mixed_on"], result["mixed_on_target"]
    result["arrival_p99_on_over_off"] = ratio(on["arrival_itl_ms"]["p99"], off["arrival_itl_ms"]["p99"])
    result["arrival_p50_on_over_off"] = ratio(on["arrival_itl_ms"]["p50"], off["arrival_itl_ms"]["p50"])
    result["ttft_on_over_off"] = ratio(on["long_prompt_ttft_ms"], off["long_prompt_ttft_ms"])
    result["arrival_p99_target_over_off"] = ratio(tgt["arrival_itl_ms"]["p99"], off["arrival_itl_ms"]["p99"])
    result["ttft_target_over_off"] = ratio(tgt["long_prompt_ttft_ms"], off["long_prompt_ttft_ms"])
    result["throughput_target_over_off"] = ratio(tgt["window_throughput_tok_s"],
                                                 off["window_throughput_tok_s"])
    result["target_sweep"] = sorted(
        ({"target_itl_ms": target, "setting": name,
          "arrival_itl_p99_ms": result[name]["arrival_itl_ms"]["p99"],
          "ratio_p99_to_steady_p99": result[name]["ratio_p99_to_steady_p99"],
          "long_prompt_ttft_ms": result[name]["long_prompt_ttft_ms"],
          "window_throughput_tok_s": result[name]["window_throughput_tok_s"]}
         for name, _, target in plan if target is not None), key=lambda r: r["target_itl_ms"])
    result["cost_model"] = core.cost_model.describe()["entries"]
    result["profile_traces"] = trace_files(args.profile_dir) if args.profile_dir else []
    result["machine"] = machine_info()
    if args.plot_file:
        shown = ("mixed_off", "mixed_on", "mixed_on_target")
        plot_gaps({n: rounds[n][0] for n in shown}, {n: rounds[n][0]["ttft_s"] for n in shown},
                  args.plot_file, f"{args.batch_size} requests decoding, a {args.long_prompt_len}-"
                  f"token prompt arrives at 0; target {targets_ms[0]:.0f} ms",
                  {"mixed_on_target": targets_ms[0]})
        result["plot_file"] = args.plot_file
    if trace is not None:
        write_json(args.step_trace_file, {"model": result["model"], "steps": trace})
    rows = [("Steady decode step (ms):", decode_step_ms),
            ("Target ITL (ms):", f"{targets_ms[0]:.1f} ({result['target_factor']:.2f} x decode step)")]
    for name, _, target in plan:
        r = result[name]
        rows += [(f"-- {name} --", ""),
                 ("Steady ITL p50 / p99 (ms):", f"{r['steady_itl_ms']['p50']:.2f} / {r['steady_itl_ms']['p99']:.2f}"),
                 ("Arrival ITL p50 (ms):", r["arrival_itl_ms"]["p50"]),
                 ("Arrival ITL p99 (ms):", r["arrival_itl_ms"]["p99"]),
                 ("Arrival ITL max (ms):", r["arrival_itl_ms"]["max"]),
                 ("Arrival p99 / steady p99:", r["ratio_p99_to_steady_p99"]),
                 (f"Bound {ITL_BOUND_FACTOR} x steady p99 (ms):", r["itl_bound_ms"])]
        if target is not None:
            rows += [("Target / bound:", r["target_over_bound"]),
                     ("Arrival gaps over the target:", r["arrival_share_over_target"])]
        rows += [("Long prompt TTFT (ms):", r["long_prompt_ttft_ms"]),
                 ("Window throughput (tok/s):", r["window_throughput_tok_s"]),
                 ("Host overhead fraction:", r["window_host_overhead"]["host_overhead_fraction"])]
    rows += [("-- on / off --", ""), ("Arrival ITL p99 ratio:", result["arrival_p99_on_over_off"]),
             ("Long prompt TTFT ratio:", result["ttft_on_over_off"]),
             ("-- target / off --", ""), ("Arrival ITL p99 ratio:", result["arrival_p99_target_over_off"]),
             ("Long prompt TTFT ratio:", result["ttft_target_over_off"]),
             ("Window throughput ratio:", result["throughput_target_over_off"]),
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
    p.add_argument("--target-factors", type=lambda v: [float(x) for x in v.split(",")],
                   default=[2.0, 1.5, 3.0, 5.0],
                   help="ITL targets as multiples of the measured steady decode step; the first "
                        "is the mixed_on_target setting, the rest the sweep")
    p.add_argument("--target-itl-ms", type=lambda v: [float(x) for x in v.split(",")], default=None,
                   help="absolute ITL targets (ms) instead of --target-factors")
    p.add_argument("--plot-file", default=None, help="PNG of every decode request's gaps over time")
    p.add_argument("--step-trace-file", default=None,
                   help="JSON of every timed forward (for replaying the cost model)")
    p.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's --unroll-layers / --no-unroll-layers (default: its auto)")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    require_positive(p, args, ("batch_size", "decode_prompt_len", "long_prompt_len",
                               "chunked_prefill_size", "steady_steps", "repeats", "profile_steps"))
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
