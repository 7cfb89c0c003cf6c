#!/usr/bin/env python
"""Online serving benchmark in the style of SGLang's ``bench_serving``.

Sends ``--num-prompts`` streamed ``/v1/completions`` requests (OpenAI-compatible) to a running
server, at ``--request-rate`` requests/s (Poisson arrivals; ``inf``: all at once) with at most
``--max-concurrency`` in flight, and reports what SGLang reports, under SGLang's names:

    request_throughput (req/s), input_throughput / output_throughput / total_throughput (tok/s),
    TTFT (time to first token), TPOT (time per output token after the first:
    (e2e - TTFT) / (output_len - 1)), ITL (gap between consecutive streamed chunks) and
    end-to-end latency: mean, median, p90, p99, std, max in ms (``mean_ttft_ms``, ...).

With ``--backend pdjax`` prompts go as token ids with ``ignore_eos`` (exact lengths), and the
server's ``/metrics`` adds the compile count (``pdjax:compile_count_total``: XLA compiles after
warm-up, should stay 0) and the host overhead per engine step (scheduling + batch building +
sampling vs forward). ``--backend openai`` sends text prompts and works against any
OpenAI-compatible server (vLLM, SGLang).

    python scripts/bench_serving.py --port 30000 --num-prompts 64 --random-input-len 256 \
        --random-output-len 64 --request-rate inf --output-file out.json
    python scripts/bench_serving.py --dataset-name sharegpt --dataset-path sharegpt.json ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (fetch_metrics, flatten_stats, http_json, machine_info, metric_total,  # noqa: E402
                          now_iso, print_table, require_positive, server_step_times,
                          summarize_ms, write_json)

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclasses.dataclass
class DatasetRow:
    prompt: str
    prompt_ids: list[int] | None
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------------------------- datasets

def _special_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> list[DatasetRow]:
    """SGLang's ``random`` dataset: lengths uniform in ``[len * range_ratio, len]``; prompts
    are random non-special token ids (and their decoded text)."""
    rng = np.random.default_rng(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in _special_ids(tokenizer)]
    in_lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=num_prompts)
    rows = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = [int(vocab[j]) for j in rng.integers(0, len(vocab), size=int(n_in))]
        rows.append(DatasetRow(tokenizer.decode(ids), ids, int(n_in), int(n_out)))
    return rows


def sample_sharegpt_requests(tokenizer, path: str, num_prompts: int, fixed_output_len: int | None,
                             context_len: int | None, seed: int) -> list[DatasetRow]:
    """ShareGPT JSON (a list of ``{"conversations": [{"from", "value"}, ...]}``): the first
    turn is the prompt, the second gives the output length (unless ``fixed_output_len``).
    Conversations with fewer than two turns, a prompt or output under 4 tokens, a prompt over
    1024 tokens or prompt + output over 2048 (or the context length) are skipped, as in SGLang."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    pairs = [(c[0]["value"], c[1]["value"]) for c in convs if isinstance(c, list) and len(c) >= 2]
    random.Random(seed).shuffle(pairs)
    limit = min(2048, context_len or 2048)
    rows: list[DatasetRow] = []
    for prompt, completion in pairs:
        if len(rows) == num_prompts:
            break
        ids = tokenizer.encode(prompt)
        out_len = fixed_output_len or len(tokenizer.encode(completion))
        if len(ids) < 4 or out_len < 4 or len(ids) > 1024 or len(ids) + out_len > limit:
            continue
        rows.append(DatasetRow(prompt, ids, len(ids), out_len))
    if len(rows) < num_prompts:
        raise ValueError(f"--dataset-path {path}: only {len(rows)} usable conversations for "
                         f"--num-prompts {num_prompts}")
    return rows


# ---------------------------------------------------------------------------------- requests

def request_body(args, model: str, row: DatasetRow, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": row.output_len, "temperature": 0.0,
                            "stream": stream}
    if args.backend == "pdjax":
        body["prompt"] = row.prompt_ids if row.prompt_ids is not None else row.prompt
        body["ignore_eos"] = not args.disable_ignore_eos
    else:
        body["prompt"] = row.prompt
        if not args.disable_ignore_eos:
            body["ignore_eos"] = True       # vLLM and SGLang accept it as an extension
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(args.extra_request_body)
    return body


async def request_completion(session: aiohttp.ClientSession, url: str, body: dict,
                             prompt_len: int, headers: dict) -> RequestOutput:
    """One streamed completion: TTFT at the first chunk with text, one ITL per later chunk
    with text (SGLang's accounting); output length from ``usage`` when the server sends it."""
    out = RequestOutput(prompt_len=prompt_len)
    t0 = time.perf_counter()
    last = t0
    usage_tokens = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            buf = b""
            async for raw in resp.content:
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    data = json.loads(payload)
                    if data.get("error"):
                        out.error = str(data["error"])
                        return out
                    if data.get("usage"):
                        usage_tokens = data["usage"].get("completion_tokens")
                        # The server's own count; a text prompt may retokenize differently.
                        out.prompt_len = data["usage"].get("prompt_tokens") or out.prompt_len
                    choices = data.get("choices") or []
                    text = choices[0].get("text", "") if choices else ""
                    if text:
                        now = time.perf_counter()
                        if not out.generated_text and out.ttft_s == 0.0:
                            out.ttft_s = now - t0
                        else:
                            out.itl_s.append(now - last)
                        last = now
                        out.generated_text += text
        out.latency_s = time.perf_counter() - t0
        out.output_len = usage_tokens if usage_tokens is not None else len(out.itl_s) + (1 if out.ttft_s else 0)
        out.success = out.ttft_s > 0.0 or out.output_len > 0
        if not out.success:
            out.error = "no output tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def arrivals(rows: list[DatasetRow], request_rate: float, seed: int):
    """Yield rows at Poisson arrival times (``request_rate`` req/s; ``inf``: no waiting)."""
    rng = np.random.default_rng(seed)
    for row in rows:
        yield row
        if request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))


async def run_benchmark(args, rows: list[DatasetRow], model: str) -> tuple[list[RequestOutput], float]:
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:
        async def one(row):
            if sem is None:
                return await request_completion(session, url, request_body(args, model, row),
                                                row.prompt_len, headers)
            async with sem:
                return await request_completion(session, url, request_body(args, model, row),
                                                row.prompt_len, headers)

        t0 = time.perf_counter()
        tasks = []
        async for row in arrivals(rows, args.request_rate, args.seed):
            tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - t0


def calculate_metrics(outputs: list[RequestOutput], duration_s: float) -> dict[str, Any]:
    """SGLang's ``BenchmarkMetrics`` from the per-request outputs (failed requests excluded)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    tpots = [(o.latency_s - o.ttft_s) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl_s]
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(outputs) - len(ok),
        "duration": duration_s, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "input_throughput": total_in / duration_s,
        "output_throughput": total_out / duration_s,
        "total_throughput": (total_in + total_out) / duration_s,
        "concurrency": sum(o.latency_s for o in ok) / duration_s,
    }
    m.update(flatten_stats("ttft", summarize_ms(o.ttft_s for o in ok)))
    m.update(flatten_stats("tpot", summarize_ms(tpots)))
    m.update(flatten_stats("itl", summarize_ms(itls)))
    m.update(flatten_stats("e2e_latency", summarize_ms(o.latency_s for o in ok)))
    return m


def get_model_and_tokenizer(args):
    """The served model name and a tokenizer (``--tokenizer``, else the server's model path)."""
    from pdjax.models.loader import load_tokenizer

    base = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        model = http_json(base + "/v1/models")["data"][0]["id"]
    tok_path = args.tokenizer
    context_len = None
    if args.backend == "pdjax":
        info = http_json(base + "/model_info")
        context_len = info.get("context_length")
        tok_path = tok_path or info.get("tokenizer_path") or info.get("model_path")
    return model, load_tokenizer(tok_path), context_len


def wait_healthy(base_url: str, timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200 (a pdjax server answers 503 while it warms
    up); ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health not 200 after {timeout_s} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.health_timeout_s > 0:
        wait_healthy(args.base_url, args.health_timeout_s)
    model, tokenizer, context_len = get_model_and_tokenizer(args)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-path is required for --dataset-name sharegpt")
        rows = sample_sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts + args.warmup_requests,
                                        args.sharegpt_output_len, context_len, args.seed)
    else:
        rows = sample_random_requests(tokenizer, args.num_prompts + args.warmup_requests,
                                      args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
    # Warm-up uses its own prompts, so nothing of the measured run sits in the prefix cache.
    warm_rows, rows = rows[args.num_prompts:], rows[:args.num_prompts]
    base = args.base_url.rstrip("/")
    outputs, duration, before, after, profile_dir = asyncio.run(_run(args, rows, warm_rows, model))
    result: dict[str, Any] = {
        "date": now_iso(), "backend": args.backend, "base_url": base, "model": model,
        "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "warmup_requests": args.warmup_requests,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
    }
    result.update(calculate_metrics(outputs, duration))
    compile_total = metric_total(after, "pdjax:compile_count_total")
    compile_before = metric_total(before, "pdjax:compile_count_total")
    result["server_compile_count"] = None if compile_total is None else int(compile_total)
    result["compile_count_during_bench"] = (None if compile_total is None or compile_before is None
                                            else int(compile_total - compile_before))
    result["server_step_times"] = server_step_times(before, after)
    result["profile_dir"] = profile_dir
    result["machine"] = machine_info()
    result["errors"] = [o.error for o in outputs if not o.success][:5]
    if args.output_details:
        result["details"] = [dataclasses.asdict(o) for o in outputs]
    print_report(result)
    write_json(args.output_file, result)
    return result


async def _run(args, rows, warm_rows, model):
    """Warm-up, metrics scrape, (profile start), the measured run, (profile stop), scrape."""
    base = args.base_url.rstrip("/")
    if warm_rows:
        await _warmup(args, warm_rows, model)
    scrape = args.backend == "pdjax"
    metrics_url = args.metrics_url or base
    before = await asyncio.to_thread(fetch_metrics, metrics_url) if scrape else None
    if args.profile:
        await asyncio.to_thread(http_json, base + "/start_profile",
                                {"output_dir": args.profile_dir} if args.profile_dir else {})
    outputs, duration = await run_benchmark(args, rows, model)
    profile_dir = None
    if args.profile:
        answer = await asyncio.to_thread(http_json, base + "/stop_profile", {})
        profile_dir = answer.get("trace_dir")
    after = await asyncio.to_thread(fetch_metrics, metrics_url) if scrape else None
    return outputs, duration, before, after, profile_dir


async def _warmup(args, warm_rows, model) -> None:
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT) as session:
        results = await asyncio.gather(*[
            request_completion(session, url, request_body(
                args, model, dataclasses.replace(r, output_len=min(r.output_len, 16))),
                r.prompt_len, headers) for r in warm_rows])
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0]}")


def print_report(r: dict[str, Any]) -> None:
    rows = [("Backend:", r["backend"]), ("Traffic request rate:", r["request_rate"]),
            ("Max request concurrency:", r["max_concurrency"] or "not set"),
            ("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Benchmark duration (s):", r["duration"]),
            ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", r["request_throughput"]),
            ("Input token throughput (tok/s):", r["input_throughput"]),
            ("Output token throughput (tok/s):", r["output_throughput"]),
            ("Total token throughput (tok/s):", r["total_throughput"]),
            ("Concurrency:", r["concurrency"])]
    for name, key, short in (("End-to-End Latency", "e2e_latency", "E2E"),
                             ("Time to First Token", "ttft", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                             ("Inter-Token Latency", "itl", "ITL")):
        rows.append((f"-- {name} --", ""))
        rows += [(f"{s.capitalize()} {short} (ms):", r[f"{s}_{key}_ms"])
                 for s in ("mean", "median", "p90", "p99")]
    st = r["server_step_times"]
    rows += [("-- Server --", ""), ("Compile count (after warm-up):", r["server_compile_count"]),
             ("Engine steps:", st["num_steps"]),
             ("Host time per step (ms):", st["host_time_per_step_ms"]),
             ("Forward time per step (ms):", st["forward_time_per_step_ms"]),
             ("Host overhead fraction:", st["host_overhead_fraction"])]
    print_table("Serving Benchmark Result", rows)


def _extra_body(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--extra-request-body is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-request-body must be a JSON object")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("pdjax", "openai"), default="pdjax")
    p.add_argument("--base-url", default=None, help="server URL; default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--metrics-url", default=None,
                   help="server whose /metrics gives the compile count and step times (default: "
                        "the base URL; behind a PD router: the decode server)")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the server's model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", type=_extra_body, default={})
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--health-timeout-s", type=float, default=600.0,
                   help="wait this long for GET /health to answer 200 (0: do not wait)")
    p.add_argument("--output-file", default=None, help="write the JSON result here")
    p.add_argument("--output-details", action="store_true", help="per-request results in the JSON")
    p.add_argument("--profile", action="store_true",
                   help="wrap the run in /start_profile and /stop_profile (XLA trace)")
    p.add_argument("--profile-dir", default=None, help="trace directory on the server")
    args = p.parse_args(argv)
    require_positive(p, args, ("num_prompts", "random_input_len", "random_output_len"))
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for no pacing)")
    if not 0.0 < args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in (0, 1]")
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    return args


if __name__ == "__main__":
    main()
