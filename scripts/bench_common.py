"""Shared pieces of the benchmark scripts: latency statistics, Prometheus scraping, launching
``pdjax.serve`` subprocesses, step profiling of an offline engine, JSON/table output.

Latency statistics follow SGLang's ``bench_serving``: ``mean``, ``median``, ``p90``, ``p99``
(linear interpolation, ``numpy.percentile``), ``std`` and ``max``, all in milliseconds.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAT_KEYS = ("mean", "median", "p90", "p99", "std", "max")


# ---------------------------------------------------------------------------------- statistics

def summarize_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """``{mean, median, p90, p99, std, max}`` in ms of ``values_s`` (seconds); every value is
    ``None`` when there are no samples."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {k: None for k in STAT_KEYS}
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)),
            "std": float(arr.std()), "max": float(arr.max())}


def flatten_stats(prefix: str, stats: dict[str, float | None], unit: str = "ms") -> dict[str, Any]:
    """SGLang's flat names: ``flatten_stats("ttft", s)`` -> ``mean_ttft_ms``, ``p99_ttft_ms``..."""
    return {f"{k}_{prefix}_{unit}": v for k, v in stats.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---------------------------------------------------------------------------------- Prometheus

def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text exposition -> ``{(sample name, sorted label items): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_total(samples: dict[tuple[str, tuple], float] | None, name: str) -> float | None:
    """Sum of every sample called ``name`` (over all label sets); ``None`` if there is none."""
    if not samples:
        return None
    vals = [v for (n, _), v in samples.items() if n == name]
    return float(sum(vals)) if vals else None


def fetch_metrics(base_url: str, timeout_s: float = 10.0) -> dict[tuple[str, tuple], float] | None:
    """GET ``base_url/metrics`` and parse it; ``None`` when the server has no such endpoint."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return parse_metrics(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_json(url: str, body: dict | None = None, timeout_s: float = 60.0) -> Any:
    """GET (``body`` None) or POST JSON; returns the decoded JSON answer. ``RuntimeError`` with
    the server's message on an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    return json.loads(raw) if raw.strip() else None


def server_step_times(before: dict | None, after: dict | None) -> dict[str, float | None]:
    """Host overhead between two ``/metrics`` scrapes: mean host and forward time per engine
    step (ms) from the ``pdjax:step_*_time_seconds`` histograms, and host / (host + forward)."""
    def delta(name):
        a, b = metric_total(after, name), metric_total(before, name)
        return None if a is None or b is None else a - b

    steps = delta("pdjax:step_forward_time_seconds_count")
    host, fwd = delta("pdjax:step_host_time_seconds_sum"), delta("pdjax:step_forward_time_seconds_sum")
    if not steps or host is None or fwd is None:
        return {"num_steps": steps, "host_time_per_step_ms": None,
                "forward_time_per_step_ms": None, "host_overhead_fraction": None}
    return {"num_steps": int(steps), "host_time_per_step_ms": 1000.0 * host / steps,
            "forward_time_per_step_ms": 1000.0 * fwd / steps,
            "host_overhead_fraction": ratio(host, host + fwd)}


def engine_step_times(core, steps0: int = 0, host0: float = 0.0, fwd0: float = 0.0) -> dict:
    """The same host-overhead figures from an offline ``EngineCore``'s accumulators, counted
    from a snapshot ``(num_steps, host_time_s, forward_time_s)``."""
    steps = core.num_steps - steps0
    host, fwd = core.host_time_s - host0, core.forward_time_s - fwd0
    return {"num_steps": steps,
            "host_time_per_step_ms": 1000.0 * host / steps if steps else None,
            "forward_time_per_step_ms": 1000.0 * fwd / steps if steps else None,
            "host_overhead_fraction": ratio(host, host + fwd)}


# ---------------------------------------------------------------------------------- profiling

class StepProfiler:
    """XLA profiler trace around the next ``num_steps`` steps of an offline ``EngineCore``
    (``--profile-dir`` of the offline benches). The trace lands in
    ``output_dir/plugins/profile/<run>/*.xplane.pb`` (TensorBoard/XProf, Perfetto)."""

    def __init__(self, core, output_dir: str, num_steps: int):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.core, self.output_dir, self.left = core, output_dir, num_steps
        self.active = False

    def start(self) -> None:
        self.core.runner.start_profile(self.output_dir)
        self.active = True
        self.core.step_hooks.append(self._on_step)

    def _on_step(self, batch, outputs) -> None:
        self.left -= 1
        if self.left <= 0:
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.core.runner.stop_profile()
            self.active = False
            self.core.step_hooks.remove(self._on_step)


def trace_files(output_dir: str) -> list[str]:
    """Every ``*.xplane.pb`` under ``output_dir``."""
    found = []
    for root, _, files in os.walk(output_dir):
        found += [os.path.join(root, f) for f in files if f.endswith(".xplane.pb")]
    return sorted(found)


# ---------------------------------------------------------------------------------- servers

class ServerProcess:
    """A ``python -m <module> ARGS`` subprocess (``pdjax.serve`` by default), healthy once
    ``GET url/health`` answers 200. Used as a context manager; SIGTERM on exit, then SIGKILL.

    ``log_path``: stdout+stderr go there (a temporary file by default). Raises
    ``RuntimeError`` with the log tail when the process exits or stays unhealthy past
    ``timeout_s``.
    """

    def __init__(self, args: Sequence[str], port: int, *, module: str = "pdjax.serve",
                 host: str = "127.0.0.1", log_path: str | None = None, timeout_s: float = 600.0,
                 env: dict | None = None, health_path: str = "/health", cwd: str = ROOT):
        self.args, self.port, self.module, self.host = list(args), port, module, host
        self.url = f"http://{host}:{port}"
        self.timeout_s, self.health_path = timeout_s, health_path
        self.log_path = log_path or f"/tmp/pdjax_bench_{module.replace('.', '_')}_{port}.log"
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd)
        return self

    def wait_healthy(self) -> "ServerProcess":
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200 and self._warm():
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.module} on port {self.port} not healthy after "
                           f"{self.timeout_s} s:\n{self.log_tail()}")

    def _warm(self) -> bool:
        """A pdjax server compiles its larger shapes on a background thread after it turns
        healthy; timings taken meanwhile share the cores with the compiler. True once
        ``/get_load`` shows every bucket ready (or has no such count: another server)."""
        if self.module != "pdjax.serve":
            return True
        with urllib.request.urlopen(self.url + "/get_load", timeout=2) as r:
            load = json.loads(r.read())
        load = load[0] if isinstance(load, list) else load
        return load.get("num_ready_buckets", 0) >= load.get("num_buckets", 0)

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path) as f:
                return f.read()[-n:]
        return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start().wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------- output

def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    """Where the figures come from: CPU count, platform, jax version and backend."""
    import platform

    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import jax

        info.update(jax=jax.__version__, jax_backend=jax.default_backend(),
                    jax_devices=len(jax.devices()))
    return info


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path`` (no-op for ``None``)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False)
        f.write("\n")


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def print_table(title: str, rows: Sequence[tuple[str, Any]], width: int = 50) -> None:
    """SGLang-style two-column result table on stdout."""
    print(f"{' ' + title + ' ':=^{width}}")
    for name, value in rows:
        print(f"{name:<{width - 14}}{fmt(value):>14}")
    print("=" * width, flush=True)


# ------------------------------------------------------------------------------ arguments

def require_positive(p, args, names: Sequence[str]) -> None:
    """``p.error`` naming the first flag of ``names`` (argparse dests) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


# ------------------------------------------------------------------------ offline engines

def add_offline_engine_args(p, *, chunked_prefill_size: int, max_total_tokens: int) -> None:
    """The model and engine flags of the offline comparisons with transformers (``bench_vs_hf``,
    ``bench_vs_peers``), read by ``offline_engine`` (``--dtype``: one both sides run)."""
    p.add_argument("--model-path", default=None, help="HF folder or GGUF (default: SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=chunked_prefill_size)
    p.add_argument("--max-total-tokens", type=int, default=max_total_tokens)
    p.add_argument("--max-running-requests", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: the longest prompt + output, rounded up to a page")


def offline_engine(args, prompts: list[list[int]], **engine_kwargs):
    """A ``pdjax.Engine`` (``args.model_path``, ``args.dtype`` and the flags of
    ``add_offline_engine_args``) that holds every prompt plus ``args.output_len`` tokens at
    once: one batch, no preemption. Raises ``ValueError`` when ``--context-length`` does not
    hold the longest prompt plus its output."""
    from pdjax.engine import Engine

    longest = max(len(p) for p in prompts) + args.output_len
    context = args.context_length or -(-(longest + 1) // args.page_size) * args.page_size
    if longest >= context:
        raise ValueError(f"--context-length {context} does not hold a prompt plus its output "
                         f"({longest} tokens)")
    return Engine(args.model_path, dtype=args.dtype, page_size=args.page_size,
                  max_running_requests=args.max_running_requests or len(prompts),
                  chunked_prefill_size=args.chunked_prefill_size,
                  max_total_tokens=max(args.max_total_tokens,
                                       len(prompts) * (longest + args.page_size)),
                  context_length=context, progress=False, skip_warmup_progress=True,
                  **engine_kwargs)


def drain(core) -> dict[str, list[int]]:
    """Step the engine ``core`` until it has no work; the new tokens of each request by rid."""
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    return tokens


def run_batch(core, prompts: list[list[int]], sampling_params, tag: str
              ) -> tuple[list[list[int]], float]:
    """Add one request per prompt to the engine ``core`` (rids ``tag0``, ``tag1``, ...), all
    with ``sampling_params``, and step it until it has no work. Returns each prompt's new
    tokens, in order, and the wall seconds of the steps."""
    from pdjax.engine_io import GenerateRequest

    for i, p in enumerate(prompts):
        core.add_request(GenerateRequest(f"{tag}{i}", p, sampling_params))
    t0 = time.perf_counter()
    tokens = drain(core)
    wall = time.perf_counter() - t0
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))], wall


def add_overlap_bench_args(p, batch: int, new_tokens: int) -> None:
    """The flags the overlap benchmarks share (``bench_step_overlap``, ``bench_grammar_overlap``)."""
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--output-file", default=None, help="also write the JSON here")


def overlap_bench_engine(args):
    """A float32 ``pdjax.Engine`` sized for ``args.batch`` requests of ``args.prompt_len`` +
    ``args.new_tokens`` tokens (one 256-token chunk, no progress bars)."""
    from pdjax.engine import Engine

    context = 1 << (args.prompt_len + args.new_tokens + 16).bit_length()
    return Engine(args.model_path, dtype="float32", max_running_requests=args.batch,
                  chunked_prefill_size=256, context_length=context,
                  max_total_tokens=args.batch * context + 256, progress=False)
