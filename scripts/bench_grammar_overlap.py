"""Device idle time between forwards when the batch holds grammar rows, before and after the
split grammar sampling (with overlap scheduling the mask for step N+1 is filled while step N
runs; DESIGN.md §3, "Grammars").

One offline ``Engine`` (overlap on); the same ``--batch`` greedy regex-constrained requests run
in three modes, alternating ``--repeats`` times:

- ``plain``: the same prompts without a grammar (the overlap floor);
- ``sync``: grammar steps read the step in flight before the next is scheduled (the scheme
  before the split: ``runner.resample_rows`` emptied, so the engine falls back to it);
- ``split``: step N+1's forward is dispatched first, then step N is read, the matchers advance,
  the masks are filled while the forward runs, and the grammar rows are drawn by a second
  dispatch (``ModelRunner.resample``) from the logits left on the device.

The device timeline (``pdjax.runner.timeline``) timestamps the end of every dispatch (for a
split step, the forward's logits and then the resample's tokens); idle = time the device had
nothing dispatched, over the decode steps where all rows decode together, per forward.
Prints one JSON object and a one-line summary. Example (CPU, SmolLM2, batch 8):

    python scripts/bench_grammar_overlap.py --batch 8 --new-tokens 32
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

# Exactly this many characters: no row can end by its grammar inside the run.
REGEX = "[a-z ]{4000}"


def _run(engine, prompts, new_tokens: int, mode: str, saved_rows) -> dict:
    from pdjax.constrained.grammar import GrammarSpec
    from pdjax.request import SamplingParams
    from pdjax.runner.timeline import DeviceTimeline

    core = engine.core
    core.runner.resample_rows = () if mode == "sync" else saved_rows
    timeline = DeviceTimeline()
    core.dispatch_hooks.append(timeline.on_dispatch)
    grammar = None if mode == "plain" else GrammarSpec("regex", REGEX)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True,
                        grammar=grammar)
    counters = (core.num_grammar_syncs, core.num_grammar_split_steps)
    try:
        output_ids, wall = run_batch(core, prompts, sp, mode)
    finally:
        core.dispatch_hooks.remove(timeline.on_dispatch)
        timeline.close()
        core.runner.resample_rows = saved_rows
    n = len(prompts)
    recs = [r for r in timeline.records if r["rows"] == n and r["entry"] in ("decode", "resample")]
    forwards = [i for i, r in enumerate(recs) if r["entry"] == "decode"]
    recs = recs[forwards[2]:] if len(forwards) > 2 else []      # drop the first two steps
    tl = timeline.summary(recs)
    num_forwards = sum(r["entry"] == "decode" for r in recs[1:])
    return {"mode": mode, "wall_s": wall, "num_window_forwards": num_forwards,
            "device_idle_ms_per_forward": 1000 * tl["device_idle_s"] / num_forwards
            if num_forwards else None,
            "device_busy_ms_per_forward": 1000 * tl["device_busy_s"] / num_forwards
            if num_forwards else None,
            "device_idle_share": tl["idle_fraction"], "exposed_dispatches": tl["exposed_steps"],
            "grammar_syncs": core.num_grammar_syncs - counters[0],
            "grammar_split_steps": core.num_grammar_split_steps - counters[1],
            "output_ids": output_ids}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_overlap_bench_args(p, batch=8, new_tokens=32)
    args = p.parse_args(argv)
    engine = overlap_bench_engine(args)
    saved_rows = engine.core.runner.resample_rows
    if not saved_rows:
        raise SystemExit("the engine compiled no resample executables (overlap off?)")
    rng = np.random.default_rng(0)
    vocab = engine.core.model_cfg.vocab_size
    prompts = [[int(x) for x in rng.integers(3, min(vocab, 20000), args.prompt_len)]
               for _ in range(args.batch)]
    modes = ("plain", "sync", "split")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(_run(engine, prompts, args.new_tokens, mode, saved_rows))
    grammar_ids = {repr(r.pop("output_ids")) for m in ("sync", "split") for r in runs[m]}
    for r in runs["plain"]:
        r.pop("output_ids")
    same = len(grammar_ids) == 1

    def median(rs):     # the lower median: one run disturbed by the machine's load is dropped
        return sorted(rs, key=lambda r: r["wall_s"])[(len(rs) - 1) // 2]

    best = {m: dict(median(runs[m]), wall_s_all=[r["wall_s"] for r in runs[m]]) for m in modes}
    result = {"date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
              "machine": machine_info(), "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "regex": REGEX,
              "backend": __import__("jax").default_backend(),
              "grammar_tokens_equal": same,
              "compiles_after_warmup": engine.core.runner.compiles_after_warmup, **best}
    print(json.dumps(result, indent=2))
    line = "; ".join(f"{m}: idle {best[m]['device_idle_ms_per_forward']:.2f} ms / forward "
                     f"({best[m]['device_idle_share']:.1%}), wall {best[m]['wall_s']:.2f} s"
                     for m in modes)
    print(f"\nbatch {args.batch} greedy, regex rows: {line}; grammar tokens sync = split: {same}")
    write_json(args.output_file, result)
    engine.shutdown()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
