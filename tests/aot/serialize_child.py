"""Run by test_abstract_engine.py in a process of its own: serialize the core executables of
the tiny Llama on the CPU, match them back by lowered module, and point a runner at them.

Its own process because XLA CPU executables deserialized in a process break it (their JIT
kernels are lost, and later compiles of the same process crashed in the persistent
compilation cache). Prints one JSON line of figures; any failed check exits non-zero."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_abstract_engine import SETTINGS, cpu_target, dummy_runner  # noqa: E402

from pdjax.aot.engine import AbstractEngine  # noqa: E402
from pdjax.config import ServerArgs  # noqa: E402
from pdjax.runner.executables import ExecutableStore, save_executables  # noqa: E402
from pdjax.sched.batch import BatchRow  # noqa: E402


def main(out_dir: str) -> None:
    engine = AbstractEngine(ServerArgs(**SETTINGS), cpu_target())
    entries = engine.entries("core")
    results = [engine.compile_entry(e) for e in entries]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    save_executables(engine, results, out_dir)
    store = ExecutableStore(out_dir, device_kind=jax.devices("cpu")[0].device_kind,
                            devices=jax.devices("cpu")[:1])
    refused = store.reason
    foreign = ExecutableStore(out_dir, device_kind="NVIDIA H200").reason
    store.reason = None               # the matching itself, as on an accelerator
    loaded = store.load(entries[0].lower()) is not None
    other = AbstractEngine(ServerArgs(**{**SETTINGS, "max_running_requests": 8}), cpu_target())
    other_loaded = store.load(other.entries("core")[0].lower()) is not None
    # A runner pointed at the folder compiles (and runs) as usual on the CPU.
    runner = dummy_runner(engine, executables_dir=out_dir)
    runner.warmup(progress=False, core_only=True)
    runner.stop_background(None)
    row = BatchRow(input_ids=[5, 6, 7, 8, 9], start_pos=0, pages=[1])
    key = engine.buckets.pick("prefill_chunk", 5, 1, 1, ready=runner.ready_keys)
    token = int(np.asarray(runner.forward(key, runner.make_batch(key, [row]))[0].tokens)[0])
    print(json.dumps({"entries": len(entries), "manifest_entries": len(store.manifest["entries"]),
                      "cpu_reason": refused, "foreign_reason": foreign, "loaded": loaded,
                      "other_loaded": other_loaded, "num_loaded": store.num_loaded,
                      "runner_loaded": runner.executables.num_loaded,
                      "warmup_done": runner.warmup_done, "token": token}))


if __name__ == "__main__":
    main(sys.argv[1])
