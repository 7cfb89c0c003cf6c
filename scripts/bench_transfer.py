#!/usr/bin/env python
"""PD KV transfer benchmark: for prompts of several lengths, what the PD servers moved (bytes,
pages, copy ops, transfer time, GB/s, from their ``/metrics``), next to a raw transfer-engine
batch write of the same bytes in the same run, and PD vs colocated TTFT.

Servers: by default this script starts them on 127.0.0.1 with ephemeral ports, all with the
same model and flags: a prefill server and a decode server (``--disaggregation-transfer-backend
mooncake``; ``--transfer-backend mooncake,jax`` measures each backend with its own servers, the
backend a column of every row), the router in front of them (``python -m pdjax.router``), and a colocated server.
``--prefill-url``, ``--decode-url``, ``--router-url`` and ``--colocated-url`` use running ones
instead (all four together).

Per prompt length, ``--requests-per-len`` requests with fresh random token ids (no prefix hit
anywhere) go one at a time, alternating colocated and PD (through the router), streamed, so
each TTFT and each transfer is measured alone. The PD figures are the change of the prefill
server's counters over those requests (``pdjax:kv_transfer_total_bytes``, ``_pages_total``,
``_copy_ops_total``, ``_chunks_total``, ``kv_transfer_latency_seconds``: first chunk queued to
Success, per request; for a prompt of several chunks that span includes the forwards of the
later chunks, so compare one-chunk prompts with the raw write); the decode server's byte count
is reported beside them and must agree.

The raw write: two Mooncake engines in this process (TCP over loopback, as the servers use),
one ``batch_write`` of the same bytes in the same number of copies as one PD request, the
median of ``--raw-repeats``. ``transfer_gbps_pd_over_raw`` compares the PD transfer's
effective rate (its latency includes waiting for the chunk's forward and the status message)
with the bare data plane.

    python scripts/bench_transfer.py --input-lens 128,512,1024 --requests-per-len 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (ServerProcess, fetch_metrics, http_json, machine_info,  # noqa: E402
                          metric_total, now_iso, print_table, ratio, require_positive,
                          write_json)
from bench_serving import request_completion  # noqa: E402
from pdjax.ports import free_port  # noqa: E402

PD_COUNTERS = {"bytes": "pdjax:kv_transfer_total_bytes_total",
               "pages": "pdjax:kv_transfer_pages_total",
               "copy_ops": "pdjax:kv_transfer_copy_ops_total",
               "chunks": "pdjax:kv_transfer_chunks_total",
               "latency_sum_s": "pdjax:kv_transfer_latency_seconds_sum",
               "latency_count": "pdjax:kv_transfer_latency_seconds_count",
               "write_sum_s": "pdjax:kv_transfer_write_seconds_sum",
               "failed": "pdjax:kv_transfer_failed_total"}


def _delta(before: dict | None, after: dict | None, name: str) -> float:
    a, b = metric_total(after, name), metric_total(before, name)
    return (a or 0.0) - (b or 0.0)


def _gb(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else bytes_per_s / 1e9


def server_flags(args) -> list[str]:
    flags = ["--dtype", args.dtype, "--page-size", str(args.page_size),
             "--max-total-tokens", str(args.max_total_tokens),
             "--max-running-requests", str(args.max_running_requests),
             "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--context-length", str(args.context_length), "--skip-warmup-progress"]
    return (["--model-path", args.model_path] if args.model_path else []) + flags


@contextlib.contextmanager
def deployment(args, extra_server_flags: tuple[str, ...] = ()):
    """Yield ``{prefill, decode, router, colocated}`` URLs, starting the servers if needed
    (``extra_server_flags`` go to the three ``pdjax.serve`` processes)."""
    given = [args.prefill_url, args.decode_url, args.router_url, args.colocated_url]
    if all(given):
        yield dict(zip(("prefill", "decode", "router", "colocated"), given))
        return
    if any(given):
        raise ValueError("--prefill-url, --decode-url, --router-url and --colocated-url go together")
    common = server_flags(args) + list(extra_server_flags)
    pp, dp, rp, cp, bp = (free_port() for _ in range(5))
    servers = [
        ServerProcess(common + ["--role", "prefill", "--port", str(pp),
                                "--disaggregation-bootstrap-port", str(bp),
                                "--disaggregation-transfer-backend", args.transfer_backend], pp),
        ServerProcess(common + ["--role", "decode", "--port", str(dp),
                                "--disaggregation-transfer-backend", args.transfer_backend], dp),
        ServerProcess(common + ["--port", str(cp)], cp),
    ]
    router = ServerProcess(["--prefill", servers[0].url, str(bp), "--decode", servers[1].url,
                            "--port", str(rp)], rp, module="pdjax.router")
    try:
        for s in servers:          # start together: warm-ups overlap
            s.start()
        for s in servers:
            s.wait_healthy()
        router.start().wait_healthy()
        yield {"prefill": servers[0].url, "decode": servers[1].url, "router": router.url,
               "colocated": servers[2].url}
    finally:
        router.stop()
        for s in servers:
            s.stop()


async def one_request(url: str, model: str, ids: list[int], output_len: int):
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        out = await request_completion(s, url.rstrip("/") + "/v1/completions", body, len(ids), {})
    if not out.success:
        raise RuntimeError(f"{url}: request of {len(ids)} tokens failed: {out.error}")
    return out


def raw_write(sizes: list[tuple[int, int]], repeats: int, backend: str) -> dict[int, dict]:
    """For each ``(total_bytes, num_copies)``: median time and GB/s of one ``batch_write`` of
    ``num_copies`` equal copies (the last takes the remainder) between two engines."""
    from pdjax.transfer.engine import create_transfer_engine

    results: dict[int, dict] = {}
    biggest = max(b for b, _ in sizes)
    src = np.random.default_rng(0).integers(0, 255, size=biggest, dtype=np.uint8)
    dst = np.zeros(biggest, dtype=np.uint8)
    with create_transfer_engine(backend, "127.0.0.1") as a, \
            create_transfer_engine(backend, "127.0.0.1") as b:
        a.register_memory(src.ctypes.data, src.nbytes, label="kv")
        b.register_memory(dst.ctypes.data, dst.nbytes, label="kv")
        for total, copies in sizes:
            copies = max(1, min(copies, total))
            each = total // copies
            lens = [each] * (copies - 1) + [total - each * (copies - 1)]
            offsets = np.cumsum([0] + lens[:-1]).tolist()
            descs = [(src.ctypes.data + o, dst.ctypes.data + o, n) for o, n in zip(offsets, lens)]
            a.batch_write(b.session_id, descs)                       # warm the connection
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                a.batch_write(b.session_id, descs)
                times.append(time.perf_counter() - t0)
            if not np.array_equal(src[:total], dst[:total]):
                raise RuntimeError("raw transfer: destination bytes differ from the source")
            t = statistics.median(times)
            results[total] = {"bytes": total, "copy_ops": copies, "time_ms": 1000 * t,
                              "gbps": total / t / 1e9}
    return results


async def run(args, urls: dict[str, str], backend: str | None = None) -> dict[str, Any]:
    model = http_json(urls["colocated"] + "/v1/models")["data"][0]["id"]
    pd_model = http_json(urls["decode"] + "/v1/models")["data"][0]["id"]
    vocab = http_json(urls["colocated"] + "/model_info").get("vocab_size") or 256
    rng = np.random.default_rng(args.seed)

    def prompt(n):
        return rng.integers(3, vocab, size=n).tolist()

    # Warm-up (not measured): the first request of each path pays connection set-up.
    await one_request(urls["colocated"], model, prompt(8), 2)
    await one_request(urls["router"], pd_model, prompt(8), 2)
    rows = []
    for n in args.input_lens:
        before_p, before_d = fetch_metrics(urls["prefill"]), fetch_metrics(urls["decode"])
        ttft_c, ttft_pd = [], []
        for _ in range(args.requests_per_len):
            ttft_c.append((await one_request(urls["colocated"], model, prompt(n), args.output_len)).ttft_s)
            ttft_pd.append((await one_request(urls["router"], pd_model, prompt(n), args.output_len)).ttft_s)
        await asyncio.sleep(0.2)       # the decode side's counters land right after Success
        after_p, after_d = fetch_metrics(urls["prefill"]), fetch_metrics(urls["decode"])
        if after_p is None or after_d is None:
            raise RuntimeError("the prefill or decode server has no /metrics")
        d = {k: _delta(before_p, after_p, name) for k, name in PD_COUNTERS.items()}
        r = args.requests_per_len
        lat = d["latency_sum_s"] / d["latency_count"] if d["latency_count"] else None
        row = {
            "transfer_backend": backend or args.transfer_backend, "input_len": n, "requests": r,
            "transfer_bytes_per_request": d["bytes"] / r,
            "transfer_pages_per_request": d["pages"] / r,
            "transfer_copy_ops_per_request": d["copy_ops"] / r,
            "transfer_chunks_per_request": d["chunks"] / r,
            "decode_received_bytes_per_request": _delta(before_d, after_d, PD_COUNTERS["bytes"]) / r,
            "transfer_failed": int(d["failed"]),
            "transfer_time_ms": None if lat is None else 1000 * lat,
            "transfer_gbps": _gb(ratio(d["bytes"], d["latency_sum_s"])),
            # The data plane alone: time inside the transfer engine's batch writes.
            "write_time_ms_per_request": 1000 * d["write_sum_s"] / r,
            "write_gbps": _gb(ratio(d["bytes"], d["write_sum_s"])),
            "ttft_colocated_ms": 1000 * statistics.median(ttft_c),
            "ttft_pd_ms": 1000 * statistics.median(ttft_pd),
        }
        row["ttft_pd_over_colocated"] = ratio(row["ttft_pd_ms"], row["ttft_colocated_ms"])
        rows.append(row)
    sizes = [(int(r["transfer_bytes_per_request"]), int(round(r["transfer_copy_ops_per_request"])))
             for r in rows if r["transfer_bytes_per_request"] > 0]
    raw = await asyncio.to_thread(raw_write, sizes, args.raw_repeats, args.raw_backend) if sizes else {}
    for r in rows:
        w = raw.get(int(r["transfer_bytes_per_request"]))
        r["raw_write_time_ms"] = None if w is None else w["time_ms"]
        r["raw_write_gbps"] = None if w is None else w["gbps"]
        r["transfer_gbps_pd_over_raw"] = ratio(r["transfer_gbps"], r["raw_write_gbps"])
        r["write_gbps_pd_over_raw"] = ratio(r["write_gbps"], r["raw_write_gbps"])
    compiles = {role: metric_total(fetch_metrics(urls[role]), "pdjax:compile_count_total")
                for role in ("prefill", "decode", "colocated")}
    return {"rows": rows, "compile_count": compiles}


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    backends = [b for b in args.transfer_backend.split(",") if b]
    if len(backends) > 1 and args.prefill_url:
        raise ValueError("--transfer-backend: one backend with running servers (--*-url)")
    startup_s, measured, by_backend = 0.0, {"rows": []}, {}
    for backend in backends:       # one deployment per backend, the same prompts' shapes
        t0 = time.perf_counter()
        with deployment(argparse.Namespace(**{**vars(args), "transfer_backend": backend})) \
                as urls:
            startup_s += time.perf_counter() - t0
            one = asyncio.run(run(args, urls, backend))
        measured["rows"] += one["rows"]
        measured["compile_count"] = measured.get("compile_count", one["compile_count"])
        by_backend[backend] = one["compile_count"]
    if len(backends) > 1:
        measured["compile_count_by_backend"] = by_backend
    result: dict[str, Any] = {
        "date": now_iso(), "model": args.model_path or "SmolLM2-135M-Instruct (default)",
        "dtype": args.dtype, "page_size": args.page_size, "transfer_backend": args.transfer_backend,
        "raw_backend": args.raw_backend, "input_lens": args.input_lens,
        "requests_per_len": args.requests_per_len, "output_len": args.output_len,
        "servers_startup_s": startup_s, **measured, "machine": machine_info()}
    table = []
    for r in result["rows"]:
        table += [(f"-- {r['transfer_backend']}: prompt {r['input_len']} tokens --", ""),
                  ("Bytes / pages / copy ops:", f"{r['transfer_bytes_per_request']:.0f} / "
                   f"{r['transfer_pages_per_request']:.0f} / {r['transfer_copy_ops_per_request']:.0f}"),
                  ("PD transfer time (ms):", r["transfer_time_ms"]),
                  ("PD transfer GB/s:", r["transfer_gbps"]),
                  ("PD batch writes (ms):", r["write_time_ms_per_request"]),
                  ("PD batch write GB/s:", r["write_gbps"]),
                  ("Raw batch write (ms):", r["raw_write_time_ms"]),
                  ("Raw batch write GB/s:", r["raw_write_gbps"]),
                  ("TTFT colocated / PD (ms):", f"{r['ttft_colocated_ms']:.1f} / {r['ttft_pd_ms']:.1f}"),
                  ("TTFT PD / colocated:", r["ttft_pd_over_colocated"])]
    table.append(("Compile count (P/D/colocated):", "/".join(
        str(None if v is None else int(v)) for v in result["compile_count"].values())))
    print_table("PD KV transfer benchmark", table)
    write_json(args.output_file, result)
    return result


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {text!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or GGUF (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-lens", type=_int_list, default=[128, 512, 1024])
    p.add_argument("--requests-per-len", type=int, default=3)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--context-length", type=int, default=None,
                   help="default: the longest prompt + output, rounded up to 256")
    p.add_argument("--transfer-backend", default="mooncake",
                   help="the PD servers' backend, or several comma-separated (mooncake,jax): "
                        "one deployment each, a row per backend and prompt length")
    p.add_argument("--raw-backend", default="mooncake", help="backend of the raw write")
    p.add_argument("--raw-repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    for role in ("prefill", "decode", "router", "colocated"):
        p.add_argument(f"--{role}-url", default=None)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    require_positive(p, args, ("requests_per_len", "output_len", "raw_repeats", "page_size"))
    if args.context_length is None:
        args.context_length = -(-(max(args.input_lens) + args.output_len + 1) // 256) * 256
    if max(args.input_lens) + args.output_len >= args.context_length:
        p.error("--context-length must exceed the longest prompt plus --output-len")
    return args


if __name__ == "__main__":
    main()
