#!/usr/bin/env python
"""Model load time: the source checkpoint (GGUF: read + dequantize + stack; HF: read + stack)
vs the same model as a pdjax Orbax checkpoint (``python -m pdjax.convert``), both placed on
the devices. Repeats alternate the two so that the machine's noise hits both alike.

    python scripts/bench_load.py                         # default SmolLM2 GGUF
    python scripts/bench_load.py --model-path DIR --repeats 5 --output-file load.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine_info, now_iso, write_json  # noqa: E402


def _timed_load(path: str | None, dtype: str) -> float:
    import jax

    from pdjax.models.loader import load_model

    t0 = time.perf_counter()
    _, model = load_model(path, dtype=dtype, progress=False)
    jax.block_until_ready(jax.tree.leaves(model))
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="source checkpoint (default: SmolLM2 GGUF)")
    p.add_argument("--orbax-dir", default=None, help="reuse/write the converted checkpoint here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)

    from pdjax.convert import convert
    from pdjax.models.orbax_checkpoint import is_orbax_checkpoint

    tmp = None
    dst = args.orbax_dir
    if dst is None:
        tmp = tempfile.TemporaryDirectory(prefix="pdjax-orbax-")
        dst = os.path.join(tmp.name, "ckpt")
    convert_s = None
    if not is_orbax_checkpoint(dst):
        t0 = time.perf_counter()
        convert(args.model_path, dst, progress=False)
        convert_s = time.perf_counter() - t0
    source_s, orbax_s = [], []
    for _ in range(args.repeats):
        source_s.append(_timed_load(args.model_path, args.dtype))
        orbax_s.append(_timed_load(dst, args.dtype))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    result = {"date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (GGUF Q4_1)",
              "dtype": args.dtype, "repeats": args.repeats, "convert_s": convert_s,
              "source_load_s": source_s, "orbax_load_s": orbax_s,
              "median_source_load_s": med(source_s), "median_orbax_load_s": med(orbax_s),
              "speedup_orbax_over_source": med(source_s) / med(orbax_s), "machine": machine_info()}
    print(f"load: source median {result['median_source_load_s']:.2f} s, orbax median "
          f"{result['median_orbax_load_s']:.2f} s ({result['speedup_orbax_over_source']:.1f}x)")
    if args.output_file:
        write_json(args.output_file, result)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
