"""Prometheus metrics of one pdjax server, exposed on ``/metrics`` (DESIGN.md §1).

Names follow SGLang's ``sglang:*`` metrics with a ``pdjax:`` prefix. Each ``Metrics`` owns its
own ``CollectorRegistry``, so several servers (or tests) in one process never share counters.

Who updates what:
  * the HTTP server (``pdjax.server.results``): per-request histograms (TTFT, ITL, end-to-end
    latency) and counters (prompt, generation and cached tokens, finished requests by reason),
    through ``RequestTimer``; it also refreshes the load gauges from ``get_load()`` on a scrape;
  * the engine: the gauges (``num_running_reqs``, ``num_queue_reqs``, ``kv_usage``,
    ``num_used_pages``) and ``compile_count`` (XLA compiles after warm-up).

Adding metrics (e.g. the PD transfer metrics) is one call: ``metrics.add_counter(name, doc,
labels)``, ``add_gauge`` or ``add_histogram``; the object is also stored as an attribute
``metrics.<name>``.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pdjax:"

# Buckets in seconds, wide enough for CPU test models and fast enough for accelerators.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2,
                  0.5, 1.0, 2.0, 5.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                 300.0, 600.0, 1200.0)

_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class Metrics:
    """The registry and metric objects of one server.

    Attributes (prometheus_client objects; the exposed name is ``pdjax:<attribute>``, counters
    get the ``_total`` suffix on exposition):
      time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds
        Histograms, seconds.
      prompt_tokens_total, generation_tokens_total, cached_tokens_total
        Counters, tokens.
      num_requests_total
        Counter with label ``finish_reason`` (``stop``, ``length``, ``abort``, ``error``).
      compile_count
        Counter: XLA compiles after warm-up (exposed as ``pdjax:compile_count_total``).
      num_running_reqs, num_queue_reqs, num_used_pages
        Gauges, counts.
      kv_usage
        Gauge, fraction of KV pages held by requests, 0..1: evictable prefix-cache pages
        count as free (``num_used_pages`` includes them).
      step_host_time_seconds, step_forward_time_seconds
        Histograms, seconds per engine step: host work (scheduling, batch building, reading
        results) and the forward (dispatch plus waiting for the device); their ``_sum`` ratio
        is the host overhead. With overlapped scheduling the host work runs while the device
        computes, so the forward time is only the wait.
      dp_gather_bytes_total
        Counter, bytes: DP attention's gathers and scatters, received per device over the
        forwards (``dp_attention.dp_collective_bytes``; 0 without DP attention).
      overlapped_dispatches_total, exposed_dispatches_total
        Counters: forwards dispatched while the previous forward still ran (the device had its
        next step queued) and forwards dispatched after it had finished (the device may have
        waited for the host). Only steps dispatched with a step in flight count.
      step_tokens
        Histogram, tokens per forward (decode rows included): the budget the scheduler chose.
      step_time_predicted_seconds, step_time_seconds
        Histograms, seconds: the cost model's forecast of each forward (when it had one) and the
        measured forward (with overlap: the device time the engine attributes to it, when
        known), for the stall-free budget of ``--target-itl-ms``.
      spec_*
        Speculative decoding, registered by ``attach_engine`` when the engine speculates
        (``pdjax.spec.metrics``): acceptance rate, accept length, the accept-length histogram.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._names: set[str] = set()
        self._attach_lock = threading.Lock()
        self._attached: list[Any] = []
        self.add_histogram("time_to_first_token_seconds",
                           "Time from request arrival to its first output token (TTFT), s.",
                           buckets=TTFT_BUCKETS_S)
        self.add_histogram("inter_token_latency_seconds",
                           "Time between consecutive output tokens of a request (ITL), s.",
                           buckets=ITL_BUCKETS_S)
        self.add_histogram("e2e_request_latency_seconds",
                           "Time from request arrival to its last output, s.",
                           buckets=E2E_BUCKETS_S)
        self.add_counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.add_counter("generation_tokens_total", "Output tokens streamed to clients.")
        self.add_counter("cached_tokens_total", "Prompt tokens served from the prefix cache.")
        self.add_counter("num_requests_total", "Finished requests by finish reason.",
                         labels=("finish_reason",))
        self.add_counter("compile_count", "XLA compilations after warm-up (should stay 0).")
        self.add_gauge("num_running_reqs", "Requests in the running batch.")
        self.add_gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.add_gauge("num_used_pages", "KV cache pages held by requests or the prefix cache.")
        self.add_gauge("kv_usage", "Fraction of KV cache pages held by requests, 0..1 (evictable "
                       "prefix-cache pages count as free; num_used_pages includes them).")
        self.add_histogram("step_host_time_seconds",
                           "Host time of one engine step: scheduling, batch building and "
                           "sampling (everything but the forward), s.", buckets=STEP_BUCKETS_S)
        self.add_histogram("step_forward_time_seconds",
                           "Forward time of one engine step (dispatch and waiting for the "
                           "device), s.", buckets=STEP_BUCKETS_S)
        self.add_counter("overlapped_dispatches", "Forwards dispatched while the previous one "
                         "still ran on the device (overlapped scheduling).")
        self.add_counter("exposed_dispatches", "Forwards dispatched, with overlap on, after the "
                         "previous one had finished (the device may have waited for the host).")
        self.add_counter("dp_gather_bytes", "DP attention: bytes each device received in the "
                         "forwards' DP gathers and scatters (0 without DP attention).")
        self.add_histogram("step_tokens", "Tokens of one forward, decode rows included.",
                           buckets=STEP_TOKEN_BUCKETS)
        self.add_histogram("step_time_predicted_seconds",
                           "The step cost model's forecast of one forward, s.",
                           buckets=STEP_BUCKETS_S)
        self.add_histogram("step_time_seconds",
                           "Measured time of one forward (device work finished), s.",
                           buckets=STEP_BUCKETS_S)

    # -- registration --------------------------------------------------------------------
    def _check_name(self, name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"metric name must match {_NAME_RE.pattern}, got {name!r}")
        if name in self._names or hasattr(self, name):
            raise ValueError(f"metric name {name!r} is already registered")
        self._names.add(name)
        return PREFIX + name

    def add_counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """Register a counter ``pdjax:<name>`` and store it as ``self.<name>``.

        Raises ``ValueError`` when the name is malformed or taken.
        """
        metric = Counter(self._check_name(name), doc, tuple(labels), registry=self.registry)
        setattr(self, name, metric)
        return metric

    def add_gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """Register a gauge ``pdjax:<name>`` and store it as ``self.<name>``."""
        metric = Gauge(self._check_name(name), doc, tuple(labels), registry=self.registry)
        setattr(self, name, metric)
        return metric

    def add_histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                      buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS) -> Histogram:
        """Register a histogram ``pdjax:<name>`` (``buckets`` in the metric's unit)."""
        metric = Histogram(self._check_name(name), doc, tuple(labels), registry=self.registry,
                           buckets=tuple(buckets))
        setattr(self, name, metric)
        return metric

    # -- updates ---------------------------------------------------------------------------
    def set_load(self, load: dict[str, Any]) -> None:
        """Set the load gauges from an engine ``get_load()`` dict.

        Keys read: ``num_running_reqs``, ``num_waiting_reqs``, ``num_used_pages``,
        ``kv_usage``; missing keys leave their gauge unchanged.
        """
        for key, gauge in (("num_running_reqs", self.num_running_reqs),
                           ("num_waiting_reqs", self.num_queue_reqs),
                           ("num_used_pages", self.num_used_pages),
                           ("kv_usage", self.kv_usage)):
            value = load.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(value)

    def attach_engine(self, core: Any) -> None:
        """Wire an ``EngineCore`` (called on the engine thread once the core is built).

        After every step (``core.step_hooks``) the load gauges are set from
        ``core.get_load()`` and the step's host and forward times (the increase of
        ``core.host_time_s`` / ``core.forward_time_s``) are observed, with the step's
        tokens and predicted forward time (``batch.num_tokens``, ``batch.predicted_time_s``);
        each compile on the request path
        (``core.runner.on_unexpected_compile``) adds the runner's new
        ``compiles_after_warmup`` to ``compile_count``. Idempotent per core.
        """
        with self._attach_lock:
            if any(c is core for c in self._attached):
                return
            self._attached.append(core)
        names = ("host_time_s", "forward_time_s", "num_overlapped_dispatches",
                 "num_exposed_dispatches", "dp_gather_bytes")
        last = [getattr(core, n, None) for n in names]

        def on_step(batch, outputs):
            self.set_load(core.get_load())
            now = [getattr(core, n, None) for n in names]
            delta = [None if a is None or b is None else max(0, a - b) for a, b in zip(now, last)]
            if delta[0] is not None:
                self.step_host_time_seconds.observe(delta[0])
            if delta[1] is not None:
                self.step_forward_time_seconds.observe(delta[1])
                # With overlap the wait is not the forward: the engine's device-time estimate is.
                device_s = getattr(core, "last_forward_device_s", delta[1]) if \
                    getattr(core, "overlap", False) else delta[1]
                if device_s is not None:
                    self.step_time_seconds.observe(device_s)
            if delta[2]:
                self.overlapped_dispatches.inc(delta[2])
            if delta[3]:
                self.exposed_dispatches.inc(delta[3])
            if delta[4]:
                self.dp_gather_bytes.inc(delta[4])
            last[:] = now
            if batch is not None:
                self.step_tokens.observe(batch.num_tokens)
                predicted = getattr(batch, "predicted_time_s", None)
                if predicted is not None:
                    self.step_time_predicted_seconds.observe(predicted)

        core.step_hooks.append(on_step)
        if getattr(core, "speculator", None) is not None:
            from pdjax.spec.metrics import attach_spec_metrics

            attach_spec_metrics(self, core)
        runner = getattr(core, "runner", None)
        if runner is None:
            return
        previous = runner.on_unexpected_compile
        seen = [runner.compiles_after_warmup]

        def on_compile(key):
            now = runner.compiles_after_warmup
            if now > seen[0]:
                self.compile_count.inc(now - seen[0])
                seen[0] = now
            if previous is not None:
                previous(key)

        runner.on_unexpected_compile = on_compile

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry: ``(body, content_type)``."""
        body = prometheus_client.generate_latest(self.registry)
        return body, prometheus_client.CONTENT_TYPE_LATEST


class RequestTimer:
    """Per-request latency bookkeeping; feeds ``Metrics`` as outputs arrive.

    ``arrival_s`` is a ``time.perf_counter()`` value. ``on_tokens`` records TTFT for the first
    tokens and one ITL sample per later token (an increment of ``k`` tokens that arrived ``dt``
    after the previous one counts as ``k`` gaps of ``dt / k``). ``on_finish`` records the
    end-to-end latency and the token counters once; later calls do nothing.
    """

    def __init__(self, metrics: Metrics | None, arrival_s: float | None = None) -> None:
        self.metrics = metrics
        self.arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finished = False

    def on_tokens(self, num_tokens: int, now_s: float | None = None) -> None:
        if num_tokens <= 0 or self.finished:
            return
        now = time.perf_counter() if now_s is None else now_s
        m = self.metrics
        if self.first_token_s is None:
            self.first_token_s = now
            if m is not None:
                m.time_to_first_token_seconds.observe(now - self.arrival_s)
            num_gaps = num_tokens - 1
            gap = 0.0
        else:
            num_gaps = num_tokens
            gap = (now - self.last_token_s) / num_tokens
        if m is not None:
            for _ in range(num_gaps):
                m.inter_token_latency_seconds.observe(gap)
        self.last_token_s = now

    def on_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int, now_s: float | None = None) -> float:
        """Record the finished request; returns its end-to-end latency in seconds."""
        now = time.perf_counter() if now_s is None else now_s
        e2e = now - self.arrival_s
        if self.finished:
            return e2e
        self.finished = True
        m = self.metrics
        if m is not None:
            m.e2e_request_latency_seconds.observe(e2e)
            m.num_requests_total.labels(finish_reason=finish_reason).inc()
            m.prompt_tokens_total.inc(max(0, prompt_tokens))
            m.generation_tokens_total.inc(max(0, completion_tokens))
            m.cached_tokens_total.inc(max(0, cached_tokens))
        return e2e
