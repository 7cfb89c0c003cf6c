"""Micro-benchmark: one decode step of B rows against one mixed step (B decode rows plus a
prompt chunk) at several prompt contexts, calling ``ModelRunner.forward`` directly.

Prints the wall time (median and min over interleaved rounds) and the process CPU time
(median; less sensitive to a shared machine's load) of: the decode step of ``--batch-size``
rows; the extend entry with the same decode rows alone in each token bucket up to 32 (what the
extra padded tokens and rows of the mixed entry cost); the mixed step of the decode rows plus
``--chunk`` prompt tokens (a comma list: each size in turn) at each prompt context. Shapes
follow bench_mixed's server flags.

    python scripts/bench_mixed_step.py --contexts 256,1024,2000 --chunk 8,24
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from pdjax.jax_setup import enable_compilation_cache
from pdjax.models.loader import load_model, make_mesh, resolve_model_path
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import Buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--context-length", type=int, default=2016)
    ap.add_argument("--batch-size", type=int, default=8, help="decode rows")
    ap.add_argument("--decode-context", type=int, default=64, help="cached tokens per decode row")
    ap.add_argument("--contexts", default="256,1024,2000", help="prompt contexts (tokens cached)")
    ap.add_argument("--chunk", default="8,24", help="prompt tokens in the mixed step (comma list)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--attention-backend", default=None,
                    help="attention impl (default: the platform's, cpu on CPU); xla, cpu and "
                         "reference take the one pages-per-sequence bucket of a traced bound")
    ap.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="unrolled layers (the CPU default; --no-unroll-layers: the scan)")
    ap.add_argument("--cpu-matmul-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="packed weights and the native matmul (the CPU default)")
    args = ap.parse_args()

    enable_compilation_cache()
    mesh = make_mesh(1)
    _, model = load_model(resolve_model_path(args.model_path), mesh=mesh, progress=False,
                          attention_impl=args.attention_backend, unroll_layers=args.unroll_layers,
                          cpu_matmul_kernel=args.cpu_matmul_kernel)
    ps = args.page_size
    buckets = Buckets.create(chunked_prefill_size=args.chunked_prefill_size,
                             max_running_requests=args.max_running_requests,
                             max_pages_per_seq=-(-args.context_length // ps),
                             traced_pages_bound=True)
    runner = ModelRunner(model, mesh, num_pages=args.num_pages, page_size=ps,
                         kv_dtype=np.float32, buckets=buckets,
                         chunk_size=args.chunked_prefill_size)
    rng = np.random.default_rng(0)
    next_page = [1]

    def pages(n_tokens):
        n = -(-n_tokens // ps)
        out = list(range(next_page[0], next_page[0] + n))
        next_page[0] += n
        return out

    dec_pages = [pages(args.decode_context + 1) for _ in range(args.batch_size)]
    decode_rows = [BatchRow([int(rng.integers(100, 1000))], args.decode_context, p)
                   for p in dec_pages]

    cases = []                 # (label, key, flat batch)
    dkey = buckets.pick("decode", args.batch_size, args.batch_size,
                        -(-(args.decode_context + 1) // ps))
    cases.append((f"decode {args.batch_size} rows", dkey, decode_rows))
    for t in (b for b in buckets.token_buckets if b <= 32):
        key = buckets.pick("mixed", t, args.batch_size, dkey.pages_per_seq)
        cases.append((f"extend, the {args.batch_size} decode rows alone, T={t}", key, decode_rows))
    for chunk in (int(c) for c in args.chunk.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            prompt = BatchRow([int(x) for x in rng.integers(100, 1000, chunk)], ctx - chunk,
                              pages(ctx))
            rows = decode_rows + [prompt]
            key = buckets.pick("mixed", args.batch_size + chunk, len(rows), -(-ctx // ps))
            cases.append((f"mixed {args.batch_size} rows + {chunk} prompt tokens, context {ctx}, "
                          f"T={key.num_tokens}", key, rows))
    batches = [(label, key, runner.make_batch(key, rows)) for label, key, rows in cases]
    times = {label: [] for label, _, _ in batches}
    cpu = {label: [] for label, _, _ in batches}
    # Interleaved rounds (the machine is shared: a load spike hits every case alike); the
    # first round compiles or loads each executable and is not counted.
    for i in range(args.iters + 1):
        for label, key, fb in batches:
            t0, c0 = time.perf_counter(), time.process_time()
            out, _ = runner.forward(key, fb)
            jax.block_until_ready(out.tokens)
            if i:
                times[label].append(time.perf_counter() - t0)
                cpu[label].append(time.process_time() - c0)
    base = min(times[batches[0][0]])
    cpu_base = statistics.median(cpu[batches[0][0]])
    print(f"{'case':64s} {'median ms':>9s} {'min ms':>7s} {'min/decode':>10s} "
          f"{'CPU ms (median)':>15s} {'CPU/decode':>10s}")
    for label, ts in times.items():
        c = statistics.median(cpu[label])
        print(f"{label:64s} {statistics.median(ts) * 1e3:9.1f} {min(ts) * 1e3:7.1f} "
              f"{min(ts) / base:10.2f} {c * 1e3:15.1f} {c / cpu_base:10.2f}")

if __name__ == "__main__":
    main()
