"""``python -m pdjax.aot``: compile every entry of a server for a TPU topology or a GPU target
from this (CPU) machine, print a table per entry and the per-chip HBM budget (DESIGN.md §7).

Exit status: 0 when every entry compiled, 1 when one failed (the table names the entry and
the compiler's message), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdjax.config import ServerArgs
from pdjax.config_fields import FlagParser
from pdjax.paths import writable_folder


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="python -m pdjax.aot",
        description="Compile a server's executables for a TPU or GPU target on a machine "
                    "without one; print compile times, kernels and the per-chip HBM budget.")
    target = parser.add_argument_group("aot")
    where = target.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="TPU topology (libtpu's names): v5e:2x2, v6e:4x4, "
                                          "v5p:2x2x1, v5p:4x4x4, v4:2x2x1, ...")
    where.add_argument("--gpu", help="NVIDIA target config in pdjax/aot/gpu_targets: h100, h200")
    target.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas (each a server of --tp-size chips of the "
                             "target); they multiply the chips and the KV tokens, not a chip's "
                             "budget (default: 1)")
    target.add_argument("--mem-fraction", type=float, default=0.9,
                        help="share of each chip's HBM the server may use, in (0, 1] (SGLang's "
                             "--mem-fraction-static, which sets it too; default: 0.9)")
    target.add_argument("--entries", choices=("all", "core"), default="all",
                        help="all: every bucket and helper executable; core: the largest decode "
                             "and extend shapes (which hold every batch) and their helpers "
                             "(default: all)")
    target.add_argument("--serialize", metavar="DIR",
                        help="write the executables and a manifest to DIR "
                             "(ModelRunner loads them with --aot-executables DIR)")
    target.add_argument("--json", metavar="FILE", help="write the table and budget as JSON")
    # The settings that fix what compiles: model, KV cache, scheduler (buckets).
    ServerArgs.add_cli_args(parser, only=("model", "cache", "scheduler"))
    return parser


def _check_outputs(ns) -> None:
    """Refuse --mem-fraction, --dp, --json and --serialize before anything compiles
    (``ValueError`` naming the flag)."""
    if getattr(ns, "mem_fraction_static", None) is not None:    # the server's name for it
        ns.mem_fraction = ns.mem_fraction_static
    if not 0 < ns.mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {ns.mem_fraction}")
    if ns.dp < 1:
        raise ValueError(f"dp must be >= 1, got {ns.dp}")
    if ns.json is not None:
        folder = os.path.dirname(os.path.abspath(ns.json))
        if not os.path.isdir(folder):
            raise ValueError(f"json: folder {folder} does not exist")
        if os.path.isdir(ns.json):
            raise ValueError(f"json: {ns.json} is a folder, not a file")
        writable_folder("json", folder)
    if ns.serialize is not None:
        writable_folder("serialize", ns.serialize)


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
        _check_outputs(ns)
        from pdjax.engine.settings import check_checkpoint_paths, check_devices

        _, model_cfg = check_checkpoint_paths(args)
        from pdjax.aot.targets import gpu_target, tpu_target

        chips = args.tp_size * ns.dp
        if ns.gpu is not None:
            if chips > 8:
                raise ValueError(f"dp: TP {args.tp_size} x DP {ns.dp} = {chips} GPUs; one "
                                 "host holds at most 8 (size one replica: --dp 1)")
            target = gpu_target(ns.gpu, num_gpus=chips)
        else:
            target = tpu_target(ns.topology)
            if chips > len(target.devices):
                raise ValueError(f"dp: TP {args.tp_size} x DP {ns.dp} = {chips} chips; "
                                 f"{target.name} has {len(target.devices)}")
        # What a chip cannot hold by itself is refused as a server refuses it (the compiler
        # would report an out-of-memory per entry, after minutes).
        check_devices(args, model_cfg, platform=target.platform, num_devices=None,
                      device_bytes=target.hbm_bytes)
        from pdjax.aot.engine import AbstractEngine

        engine = AbstractEngine(args, target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdjax.aot import report

    import numpy as np

    print(f"pdjax aot: {engine.config.model_path} ({type(engine.model_cfg).__name__}, "
          f"{np.dtype(engine.config.dtype).name} weights, KV {np.dtype(engine.config.kv_dtype).name})"
          f" on {target.name} "
          f"({target.device_kind}), TP {args.tp_size}"
          + (f", EP {args.ep_size} (MoE TP {args.tp_size // args.ep_size}, dispatch "
             f"{args.moe_a2a_backend})" if args.ep_size > 1 else "")
          + (f", DP attention {args.dp_size}" if args.dp_size > 1 else "")
          + f", attention {engine.config.attention_impl}",
          flush=True)
    print(f"buckets: {engine.buckets.describe()}", flush=True)
    results = []
    t0 = time.monotonic()
    for entry in engine.entries(ns.entries):
        result = engine.compile_entry(entry)
        results.append(result)
        status = "ok" if result.ok else "FAILED"
        print(f"  {entry.name}: {status} in {result.seconds:.1f} s", flush=True)
    print(report.format_entries(results))
    print(f"compiled {sum(r.ok for r in results)} of {len(results)} entries in "
          f"{time.monotonic() - t0:.0f} s")
    budget = None
    if any(r.ok and r.kind in ("decode", "extend") for r in results):
        budget = report.hbm_budget(engine, results, mem_fraction=ns.mem_fraction, dp=ns.dp)
        print(report.format_budget(engine, budget))
    if ns.serialize:
        from pdjax.runner.executables import save_executables

        path = save_executables(engine, results, ns.serialize)
        print(f"executables written: {path}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report.as_json(engine, results, budget), f, indent=1)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
