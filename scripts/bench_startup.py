#!/usr/bin/env python
"""Server start-up: seconds from launching ``python -m pdjax.serve`` to ``/health`` 200,
with empty caches (cold) and then with the caches that run left (warm).

Each run gets a fresh cache folder under ``--cache-root`` (deleted afterwards unless
``--keep-cache``) as ``PDJAX_CACHE_DIR``: the JAX compilation cache and pdjax's own caches (the
tokenizer converted from the GGUF) both start empty; the warm runs reuse the cold run's folder.
After ``/health`` turns 200, one short greedy request is sent at once (its latency, while the
rest of the shapes may still compile in the background) and ``/get_server_info`` is polled
until every forward shape is compiled (``compiled_shapes == forward_shapes``). The server's own lines (``pdjax warm-up: ... N forward shapes`` and the start-up phases) are
copied from its log, so the figure comes with the shape count and its breakdown. Targets: cold <= 60 s, warm <= 20 s for the default server.

    python scripts/bench_startup.py                      # default server: SmolLM2, 8k context
    python scripts/bench_startup.py --warm-runs 2 -- --context-length 1024
    python scripts/bench_startup.py --code-root /work/main   # another checkout, same script
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (ROOT, ServerProcess, http_json, machine_info, now_iso,  # noqa: E402
                          print_table, write_json)
from pdjax.ports import free_port  # noqa: E402


def wait_health(server: ServerProcess) -> None:
    """Return as soon as ``server``'s ``/health`` answers 200. ``ServerProcess.wait_healthy``
    also waits for every background shape (``/get_load``), which is the later figure this
    script reports separately. Raises ``RuntimeError`` (with the log tail) when the server exits
    or is not healthy within its ``timeout_s``."""
    deadline = time.monotonic() + server.timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + server.health_path, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not healthy after {server.timeout_s} s:\n{server.log_tail()}")


def launch_to_healthy(server_args: list[str], cache_dir: str, code_root: str | None,
                      timeout_s: float) -> dict:
    """One launch; returns ``{"health_s", "first_request_s", "all_shapes_s", "warmup_line",
    "phases_line", "warmup_phases_line", "load_average"}`` (``load_average``: the 1, 5 and 15
    minute load averages at launch and at the end, ``{"before": [...], "after": [...]}``). Raises ``RuntimeError`` (with the
    server log tail) when the server exits or is not healthy within ``timeout_s``."""
    port = free_port()
    env = {"PDJAX_CACHE_DIR": cache_dir,
           "JAX_COMPILATION_CACHE_DIR": os.path.join(cache_dir, "jax_compilation_cache")}
    server = ServerProcess([*server_args, "--port", str(port), "--skip-warmup-progress"], port,
                           timeout_s=timeout_s, env=env,
                           cwd=os.path.abspath(code_root) if code_root else ROOT)
    if code_root:           # `python -m` puts the cwd first on sys.path, then PYTHONPATH
        server.env["PYTHONPATH"] = os.path.abspath(code_root)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    server.start()
    try:
        wait_health(server)
        health_s = time.monotonic() - t0
        t1 = time.monotonic()
        http_json(server.url + "/generate", {"text": "The capital of France is",
                                             "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                  timeout_s=timeout_s)
        first_request_s = time.monotonic() - t1
        while True:
            info = http_json(server.url + "/get_server_info")
            # A server without background compiles (older code) reports neither: all ready.
            if info.get("compiled_shapes", 0) >= info.get("forward_shapes", 0) \
                    or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.5)
        all_shapes_s = time.monotonic() - t0
    finally:
        server.stop()
    log = server.log_tail(1 << 20)

    def last(pattern):
        found = re.findall(pattern, log)
        return found[-1] if found else None

    return {"health_s": health_s, "first_request_s": first_request_s, "all_shapes_s": all_shapes_s,
            "warmup_line": last(r"pdjax warm-up: .*"),
            "phases_line": last(r"pdjax start-up phases .*"),
            "warmup_phases_line": last(r"pdjax warm-up phases .*"),
            "load_average": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm-runs", type=int, default=1, help="launches with the warm cache")
    p.add_argument("--cache-root", default=None, help="parent of the fresh cache folders")
    p.add_argument("--keep-cache", action="store_true")
    p.add_argument("--code-root", default=None,
                   help="run the server from this checkout (PYTHONPATH) instead of this one")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--output-json", default=None)
    p.add_argument("server_args", nargs="*", help="extra pdjax.serve arguments (after --)")
    args = p.parse_args(argv)
    if args.warm_runs < 0:
        p.error("--warm-runs must be >= 0")

    cache_dir = tempfile.mkdtemp(prefix="pdjax_startup_cache_", dir=args.cache_root)
    try:
        cold = launch_to_healthy(args.server_args, cache_dir, args.code_root, args.timeout_s)
        warm = [launch_to_healthy(args.server_args, cache_dir, args.code_root, args.timeout_s)
                for _ in range(args.warm_runs)]
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    result = {"date": now_iso(), "machine": machine_info(), "server_args": args.server_args,
              "code_root": args.code_root, "cold_health_s": cold["health_s"],
              "warm_health_s": [w["health_s"] for w in warm],
              "cold_first_request_s": cold["first_request_s"], "cold_all_shapes_s": cold["all_shapes_s"],
              "warm_first_request_s": [w["first_request_s"] for w in warm],
              "warm_all_shapes_s": [w["all_shapes_s"] for w in warm],
              "load_average": os.getloadavg(), "warmup_line": cold["warmup_line"],
              "load_average_per_run": {"cold": cold["load_average"],
                                       "warm": [w["load_average"] for w in warm]},
              "phases": {"cold": cold["phases_line"], "warm": [w["phases_line"] for w in warm]},
              "warmup_phases": {"cold": cold["warmup_phases_line"],
                                "warm": [w["warmup_phases_line"] for w in warm]}}
    rows = []
    for name, run in [("empty caches", cold)] + [(f"warm caches #{i + 1}", w) for i, w in enumerate(warm)]:
        rows += [(f"launch -> /health 200, {name} (s)", round(run["health_s"], 1)),
                 (f"  first request right after (s), {name}", round(run["first_request_s"], 2)),
                 (f"  launch -> every shape compiled (s), {name}", round(run["all_shapes_s"], 1)),
                 (f"  load average (1, 5, 15 min) at launch -> end, {name}",
                  " ".join(f"{x:.1f}" for x in run["load_average"]["before"]) + " -> "
                  + " ".join(f"{x:.1f}" for x in run["load_average"]["after"]))]
    print_table("pdjax server start-up", rows, width=60)
    for name, run in [("cold", cold)] + [(f"warm #{i + 1}", w) for i, w in enumerate(warm)]:
        for key in ("warmup_line", "phases_line", "warmup_phases_line"):
            if run[key]:
                print(f"{name}: {run[key]}")
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
