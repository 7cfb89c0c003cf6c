"""HiCache's host tier: TTFT and throughput of a multi-turn workload whose working set is
several times the device KV pool, with and without ``--enable-hierarchical-cache``, side by
side in one run (issue 43, DESIGN.md §3 "Host tier").

Workload: ``--conversations`` conversations, each opening with its own document of
``--doc-tokens`` random token ids; turn ``t`` of a conversation is its previous prompt, the
previous answer and ``--question-tokens`` new ids. Every turn asks every conversation in turn,
one request at a time, so the device pool (``--max-total-tokens``) holds only the last one or
two conversations and a later turn finds its prefix evicted from the device. Two offline
engines, the same settings but the tier, answer each request alternately (which goes first
swaps every request, so a load swing of a shared machine hits both). TTFT: from the request's
arrival to its first token (engine steps); throughput: output tokens over the wall time of the
turns after the first. Greedy tokens must be equal on both engines.

    python scripts/bench_hicache.py --model-path tests/.checkpoints/llama   # tiny, seconds
    python scripts/bench_hicache.py                                         # SmolLM2-135M

With ``--storage-path DIR`` the engine with the tier also writes through to the ``file``
storage tier (L3) in ``DIR``; after the turns a third engine, started fresh on the same folder
(its device and host tiers empty: a restarted server), asks every conversation's last prompt
once more: its TTFT and cached tokens are the L3 row, next to the engine without the tier.

Prints one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine_info, now_iso, summarize_ms, write_json  # noqa: E402


def _ask(core, ids, sp) -> tuple[float, list[int], int]:
    """One request alone on ``core``: (TTFT seconds, output ids, cached tokens)."""
    from pdjax.engine_io import GenerateRequest

    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    core.add_request(GenerateRequest(rid, list(ids), sp))
    ttft, out, cached = None, [], 0
    while True:
        for o in core.step():
            if o.rid != rid:
                continue
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            out += o.new_token_ids
            cached = o.cached_tokens
            if o.finished:
                core.drain()
                return ttft, out, cached


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=448)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hicache-ratio", type=float, default=8.0)
    p.add_argument("--storage-path", default=None,
                   help="a folder for the file storage tier (L3): adds the restarted row")
    p.add_argument("--output-file", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    from pdjax.engine import Engine
    from pdjax.request import SamplingParams

    storage = {} if args.storage_path is None else dict(
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config=json.dumps({"path": args.storage_path}))
    longest = args.doc_tokens + args.turns * (args.question_tokens + args.answer_tokens)
    context = -(-(longest + 1) // args.page_size) * args.page_size
    kw = dict(dtype="float32", page_size=args.page_size, max_total_tokens=args.max_total_tokens,
              max_running_requests=4, chunked_prefill_size=256, context_length=context,
              progress=False)
    engines = {"without": Engine(args.model_path, **kw),
               "with": Engine(args.model_path, enable_hierarchical_cache=True,
                              hicache_ratio=args.hicache_ratio, **kw, **storage)}
    vocab = min(engines["with"].core.model_cfg.vocab_size, 1000)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, vocab, args.doc_tokens)]
               for _ in range(args.conversations)]
    sp = SamplingParams(max_new_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    rec = {m: {"ttft_cold": [], "ttft_again": [], "cached_again": [], "wall_again": 0.0,
               "tokens_again": 0} for m in engines}
    equal, k = True, 0
    for turn in range(args.turns):
        for c in range(args.conversations):
            if turn:
                prompts[c] = prompts[c] + [int(t) for t in
                                           rng.integers(3, vocab, args.question_tokens)]
            order = list(engines) if k % 2 == 0 else list(engines)[::-1]
            k += 1
            outs = {}
            for m in order:
                t0 = time.perf_counter()
                ttft, out, cached = _ask(engines[m].core, prompts[c], sp)
                r = rec[m]
                if turn == 0:
                    r["ttft_cold"].append(ttft)
                else:
                    r["ttft_again"].append(ttft)
                    r["cached_again"].append(cached)
                    r["wall_again"] += time.perf_counter() - t0
                    r["tokens_again"] += len(out)
                outs[m] = out
            equal &= outs["with"] == outs["without"]
            prompts[c] = prompts[c] + outs["without"]
    last = [p[:-len(outs["without"])] for p in prompts]     # each conversation's last prompt
    load = engines["with"].core.get_load()
    if args.storage_path is not None:
        engines["with"].core.kv_worker.storage.flush()
        fresh = Engine(args.model_path, enable_hierarchical_cache=True,
                       hicache_ratio=args.hicache_ratio, **kw, **storage)
        r = rec["restarted, from the store (L3)"] = {"ttft_cold": [], "ttft_again": [],
                                                     "cached_again": [], "wall_again": 0.0,
                                                     "tokens_again": 0}
        for ids in last:
            t0 = time.perf_counter()
            ttft, out, cached = _ask(fresh.core, ids, sp)
            r["ttft_again"].append(ttft)
            r["cached_again"].append(cached)
            r["wall_again"] += time.perf_counter() - t0
            r["tokens_again"] += len(out)
        load_l3 = fresh.core.get_load()
        fresh.shutdown()
    modes = {}
    for m, r in rec.items():
        modes[m] = {"ttft_cold_ms": summarize_ms(r["ttft_cold"]) if r["ttft_cold"] else None,
                    "ttft_again_ms": summarize_ms(r["ttft_again"]),
                    "cached_tokens_again_mean": float(np.mean(r["cached_again"]))
                    if r["cached_again"] else None,
                    "throughput_again_tok_s": r["tokens_again"] / r["wall_again"]
                    if r["wall_again"] else None}
    a, b = modes["without"]["ttft_again_ms"]["median"], modes["with"]["ttft_again_ms"]["median"]
    result = {"date": now_iso(), "machine": machine_info(), "args": vars(args),
              "working_set_tokens": sum(len(x) for x in prompts), "modes": modes,
              "ttft_again_ratio": a / b if a and b else None, "tokens_equal": bool(equal),
              "hicache_load": {k: v for k, v in load.items() if k.startswith("hicache_")}}
    if args.storage_path is not None:
        c = modes["restarted, from the store (L3)"]["ttft_again_ms"]["median"]
        result["ttft_l3_ratio"] = a / c if a and c else None
        result["hicache_load_l3"] = {k: v for k, v in load_l3.items()
                                     if k.startswith("hicache_")}
    print(f"working set {result['working_set_tokens']} tokens over a device pool of "
          f"{args.max_total_tokens}; tokens equal: {equal}")
    print("| | TTFT cold median ms | TTFT re-asked median ms | p90 ms | cached tokens "
          "re-asked (mean) | tok/s re-asked |")
    print("|---|---|---|---|---|---|")
    for m, v in modes.items():
        cold = f"{v['ttft_cold_ms']['median']:.1f}" if v["ttft_cold_ms"] else "-"
        name = f"{m} the host tier" if m in ("with", "without") else m
        print(f"| {name} | {cold} | "
              f"{v['ttft_again_ms']['median']:.1f} | {v['ttft_again_ms']['p90']:.1f} | "
              f"{v['cached_tokens_again_mean']:.0f} | {v['throughput_again_tok_s']:.1f} |")
    print(f"TTFT re-asked, without / with: {result['ttft_again_ratio']:.2f}x")
    if result.get("ttft_l3_ratio"):
        print(f"TTFT re-asked, without / restarted from the store: "
              f"{result['ttft_l3_ratio']:.2f}x")
    write_json(args.output_file, result)
    for e in engines.values():
        e.shutdown()
    return result


if __name__ == "__main__":
    main()
