"""Host share of an engine step, and with overlapped scheduling the time the device waits for
the host between forwards (what shows that the overlap hides the host).

One offline ``Engine``; the same ``--batch`` greedy requests run twice, first with
``--disable-overlap-schedule`` semantics (``core.overlap = False``), then overlapped. The window
is the decode steps where all ``--batch`` rows decode together.

- Without overlap: host share = host time / (host + forward) per step, from the engine's
  ``host_time_s`` / ``forward_time_s`` (forward = dispatch + waiting for the results).
- With overlap: device idle share = idle / (busy + idle) from ``pdjax.runner.timeline``: the
  completion of each forward is timestamped by a watcher thread; a forward dispatched while the
  previous one still ran (``is_ready()`` False) had no gap at all.

Prints one JSON object and a short table. Example (CPU, SmolLM2, batch 32):

    python scripts/bench_step_overlap.py --batch 32 --new-tokens 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (add_overlap_bench_args, machine_info, now_iso,  # noqa: E402
                          overlap_bench_engine, run_batch, write_json)


def _run(engine, prompts, new_tokens: int, overlap: bool) -> dict:
    from pdjax.request import SamplingParams
    from pdjax.runner.timeline import DeviceTimeline

    core = engine.core
    core.overlap = overlap
    timeline = DeviceTimeline()
    core.dispatch_hooks.append(timeline.on_dispatch)
    steps = []
    last = [core.host_time_s, core.forward_time_s]

    def on_step(batch, outputs):
        steps.append(dict(mode=batch.forward_mode, rows=len(batch.rows),
                          host_s=core.host_time_s - last[0], forward_s=core.forward_time_s - last[1]))
        last[:] = [core.host_time_s, core.forward_time_s]

    core.step_hooks.append(on_step)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    try:
        output_ids, wall = run_batch(core, prompts, sp, "ov" if overlap else "sync")
    finally:
        core.step_hooks.remove(on_step)
        core.dispatch_hooks.remove(timeline.on_dispatch)
        timeline.close()
    n = len(prompts)
    # Window: full-batch decode steps, dropping the first two (bucket change, first fetch).
    win = [s for s in steps if s["mode"] == "decode" and s["rows"] == n][2:]
    recs = [r for r in timeline.records if r["entry"] == "decode" and r["rows"] == n][2:]
    host = sum(s["host_s"] for s in win)
    fwd = sum(s["forward_s"] for s in win)
    tl = timeline.summary(recs)
    return {"overlap": overlap, "wall_s": wall, "num_window_steps": len(win),
            "host_ms_per_step": 1000 * host / len(win) if win else None,
            "forward_ms_per_step": 1000 * fwd / len(win) if win else None,
            "host_share": host / (host + fwd) if win else None,
            "device_step_ms": tl["step_ms"], "device_idle_ms_per_step":
                1000 * tl["device_idle_s"] / tl["num_steps"] if tl["num_steps"] else None,
            "device_idle_share": tl["idle_fraction"], "exposed_steps": tl["exposed_steps"],
            "output_ids": output_ids}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_overlap_bench_args(p, batch=32, new_tokens=40)
    args = p.parse_args(argv)
    engine = overlap_bench_engine(args)
    rng = np.random.default_rng(0)
    vocab = engine.core.model_cfg.vocab_size
    prompts = [[int(x) for x in rng.integers(3, min(vocab, 20000), args.prompt_len)]
               for _ in range(args.batch)]
    # Alternate the modes (the machine may be shared: its load drifts); keep the median run.
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            runs[overlap].append(_run(engine, prompts, args.new_tokens, overlap=overlap))
    ids = {r.pop("output_ids").__repr__() for rs in runs.values() for r in rs}
    same = len(ids) == 1

    def median(rs):     # the lower median: one run disturbed by the machine's load is dropped
        return sorted(rs, key=lambda r: r["wall_s"])[(len(rs) - 1) // 2]

    sync, over = median(runs[False]), median(runs[True])
    sync["wall_s_all"] = [r["wall_s"] for r in runs[False]]
    over["wall_s_all"] = [r["wall_s"] for r in runs[True]]
    result = {"date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
              "machine": machine_info(), "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "backend": __import__("jax").default_backend(),
              "tokens_equal": same, "compiles_after_warmup": engine.core.runner.compiles_after_warmup,
              "sync": sync, "overlap": over}
    print(json.dumps(result, indent=2))
    print(f"\nbatch {args.batch}: without overlap host share {sync['host_share']:.2%} "
          f"({sync['host_ms_per_step']:.2f} ms host / {sync['forward_ms_per_step']:.1f} ms forward "
          f"per step); with overlap device idle {over['device_idle_share']:.2%} of the step "
          f"({over['device_idle_ms_per_step']:.3f} ms of {over['device_step_ms']:.1f} ms; "
          f"{over['exposed_steps']}/{over['num_window_steps']} steps dispatched after the previous "
          f"one had finished); wall {sync['wall_s']:.1f} s -> {over['wall_s']:.1f} s; "
          f"tokens equal: {same}")
    write_json(args.output_file, result)
    engine.shutdown()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
