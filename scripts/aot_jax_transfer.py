"""Compile the device programs of the ``jax`` PD data plane for a TPU or GPU target from this
(CPU) machine (issue 42 item 5, DESIGN.md §4 and §7): the runner's ``gather_pages`` (the
prefill's compact chunk) and donated ``scatter_pages`` (the decode's step-boundary write),
which ``python -m pdjax.aot`` also lists, plus the programs this backend adds
(``jax_transfer_programs.lower_transfer_programs``: the decode's padding mask, the prefill's
head-group unit slice and the decode's unit concatenation), at the largest page bucket of the
server's context. Per program: compile seconds and the compiler's temp bytes per chip beside
the largest KV buffer a chip holds; a temp that large is a pool-sized temporary.

    .venv-tpu/bin/python scripts/aot_jax_transfer.py --topology v6e:2x2 \\
        --model-path pdjax/aot/configs/llama-3-8b --tp-size 1 --page-size 16 \\
        --context-length 8192 --units 2

Takes ``python -m pdjax.aot``'s flags (model, cache, scheduler) and ``--units`` (head-group
units per KV-head buffer, default 1: same TP on both sides). Exit status: 0 when every
program compiled with a temp below a KV buffer, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from pdjax.aot.__main__ import build_parser
    from pdjax.config import ServerArgs

    parser = build_parser()
    parser.add_argument("--units", type=int, default=1,
                        help="head-group units per KV-head buffer (max of the two TP sizes)")
    ns = parser.parse_args(argv)
    try:
        if ns.units < 1:
            raise ValueError(f"units must be >= 1, got {ns.units}")
        args = ServerArgs.from_cli_args(ns)
        from pdjax.aot.engine import AbstractEngine, Entry
        from pdjax.aot.targets import gpu_target, tpu_target

        target = gpu_target(ns.gpu, args.tp_size) if ns.gpu else tpu_target(ns.topology)
        engine = AbstractEngine(args, target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdjax.runner.model_runner import shard_bytes
    from pdjax.transfer.jax_transfer_programs import lower_transfer_programs
    from pdjax.transfer.local_kv import page_buckets

    bucket = page_buckets(-(-engine.context_length // args.page_size))[-1]
    kv_max = max(shard_bytes(c) for c in engine.caches.values())
    entries = [e for e in engine.entries("core") if e.kind in ("gather_pages", "scatter_pages")]
    with engine.device_context():
        entries += [Entry(name.split()[0], name, (lambda lo=lo: lo))
                    for name, lo in lower_transfer_programs(engine.caches, bucket, ns.units)]
    print(f"{engine.config.model_path} on {target.name} ({target.device_kind}), TP "
          f"{args.tp_size}, {bucket}-page bucket, {ns.units} unit(s); largest KV buffer per "
          f"chip {kv_max / 2**20:.1f} MiB", flush=True)
    bad = 0
    for entry in entries:
        r = engine.compile_entry(entry)
        pool_sized = r.ok and r.temp_bytes >= kv_max
        bad += (not r.ok) or pool_sized
        print(f"  {r.name:42s} {'ok' if r.ok else 'FAILED'} {r.seconds:6.1f} s  temp "
              f"{r.temp_bytes / 2**20:9.1f} MiB  out {r.output_bytes / 2**20:9.1f} MiB"
              + ("  [temp >= a KV buffer]" if pool_sized else "")
              + (f"  {r.error[:300]}" if r.error else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
