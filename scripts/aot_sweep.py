#!/usr/bin/env python
"""Run ``python -m pdjax.aot`` over models x targets and print one summary line each (the
tables of BENCHMARKS.md's "Deviceless AOT" section).

    python scripts/aot_sweep.py --tiny  [--targets v5e:2x2,v6e:2x2,v5p:2x2x1,h200]
    python scripts/aot_sweep.py --job deepseek-v3.2:v5p:4x4x2:32 --job llama-3-70b:h200:8

A job is ``MODEL:TARGET:TP`` (MODEL a folder of pdjax/aot/configs; TARGET a TPU topology or
h100/h200). TPU jobs run in ``.venv-tpu``, GPU jobs in ``.venv-cuda`` (scripts/aot_env.sh),
one process each, with ``--json`` read back. Extra arguments after ``--`` go to pdjax.aot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "pdjax", "aot", "configs")
TINY_MODELS = ("tiny-llama", "tiny-qwen3", "tiny-deepseek-v3.2", "tiny-glm-5")
# The CI test's small shapes: every kernel, short compiles.
TINY_SETTINGS = ["--entries", "all", "--max-total-tokens", "1024", "--context-length", "128",
                 "--chunked-prefill-size", "32", "--max-running-requests", "4"]
REAL_SETTINGS = ["--entries", "core", "--page-size", "64", "--context-length", "32768",
                 "--max-running-requests", "64", "--chunked-prefill-size", "2048",
                 "--max-total-tokens", "262144"]
GPUS = ("h100", "h200")


def run_job(model: str, target: str, tp: int, settings: list[str]) -> dict:
    """One pdjax.aot run; its JSON report plus ``wall_s`` and ``returncode``."""
    gpu = target in GPUS
    python = os.path.join(ROOT, ".venv-cuda" if gpu else ".venv-tpu", "bin", "python")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "aot.json")
        cmd = [python, "-m", "pdjax.aot", "--model-path", os.path.join(CONFIGS, model),
               "--gpu" if gpu else "--topology", target, "--tp-size", str(tp),
               "--json", out, *settings]
        env = {**os.environ, "PYTHONPATH": ROOT}
        if gpu:
            env.update(CUDA_VISIBLE_DEVICES="-1", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        report = json.load(open(out)) if os.path.exists(out) else {"entries": [],
                                                                     "budget": None}
    report.update(wall_s=time.monotonic() - t0, returncode=proc.returncode, model=model,
                  target_name=target, tp=tp)
    if proc.returncode not in (0, 1):
        report["error"] = proc.stderr.strip().splitlines()[-1:] or ["?"]
    return report


def summary(r: dict) -> str:
    entries = r["entries"]
    ok = [e for e in entries if e["error"] is None]
    fwd = [e for e in ok if e["kind"] in ("decode", "extend")]
    kernels = sorted({k for e in fwd for k in e["kernels"] if k.count("_") <= 3})
    b = r.get("budget")
    gib = 1 << 30
    budget = ("-" if b is None else
              f"{b['weight_bytes'] / gib:.2f} | {b['largest_temp_bytes'] / gib:.2f} | "
              + (f"{b['kv_tokens']:,}" if b["kv_pages"] > 0 else "does not fit"))
    failed = [e["name"] for e in entries if e["error"] is not None]
    return (f"| {r['model']} | {r['target_name']} | {r['tp']} | {len(ok)}/{len(entries)}"
            f"{' (' + ', '.join(failed[:3]) + ')' if failed else ''}"
            f"{' ' + str(r.get('error')) if r.get('error') else ''} | "
            f"{sum(e['seconds'] for e in entries):.0f} | {', '.join(kernels) or '-'} | {budget} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny models, every entry")
    parser.add_argument("--targets", default="v5e:2x2,v6e:2x2,v5p:2x2x1,h200")
    parser.add_argument("--job", action="append", default=[], help="MODEL:TARGET:TP")
    parser.add_argument("--json", default=None, help="write every report here")
    ns, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    jobs = []
    if ns.tiny:
        jobs += [(m, t, 1, TINY_SETTINGS + extra) for m in TINY_MODELS
                 for t in ns.targets.split(",")]
    for job in ns.job:
        model, rest = job.split(":", 1)
        target, tp = rest.rsplit(":", 1)
        jobs.append((model, target, int(tp), REAL_SETTINGS + extra))
    print("| model | target | TP | compiled | compile s | kernels | weights GiB/chip | "
          "largest temp GiB | KV tokens that fit |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    reports = []
    for job in jobs:
        reports.append(run_job(*job))
        print(summary(reports[-1]), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0 if all(r["returncode"] == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
