"""PD transfer metrics of one prefill or decode server, on ``/metrics`` (DESIGN.md §4).

Names follow SGLang's (``sglang:kv_transfer_*``) with the ``pdjax:`` prefix; each is labelled
``role`` (``prefill`` | ``decode``). The prefill counts what it wrote, the decode what it
received (it cannot see copy ops: those are the prefill's choice).

    kv_transfer_total_bytes        KV bytes moved (pages x bytes per page, all buffers)
    kv_transfer_pages_total        KV pages moved
    kv_transfer_copy_ops_total     copy descriptors handed to the transfer engine (prefill)
    kv_transfer_chunks_total       transfer chunks (one per prefill forward that sent pages)
    kv_transfer_latency_seconds    first chunk queued -> Success, per request (histogram)
    kv_transfer_speed_gb_s         last request's bytes / latency, GB/s (1e9 B/s)
    kv_transfer_write_seconds      one chunk's transfer-engine batch write, s (histogram; its
                                   ``_sum`` against ``kv_transfer_total_bytes`` is the data
                                   plane's own GB/s, without forward or queueing time)
    kv_transfer_bootstrap_seconds  request arrival -> destination known (histogram)
    kv_transfer_state_seconds      time a room spent in each KVPoll ``state`` (queue times:
                                   Bootstrapping, WaitingForInput, Transferring)
    kv_transfer_failed_total       failed transfers, by ``reason`` (``RoomFailure.label``)
    kv_transfer_largest_batch      most copies in one engine batch (<= the per-peer limit)
    pd_queue_reqs                  requests per PD ``queue`` (bootstrap, waiting, inflight,
                                   prealloc, transfer, held)
    pd_quarantined_pages           decode pages waiting for an abort ack or the drain timeout
    pd_rejected_messages_total     malformed or refused control messages
    pd_auth_rejected_total         control messages refused by authentication, by ``reason``
                                   (hmac, replay, stale: ZMQ frames; bootstrap: PUT /route)
    pd_prompt_tokens_computed      prompt tokens the scheduler computed (decode: stays 0)

Pure Python; never imports JAX.
"""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 300.0)


class PDMetrics:
    """Registers the PD metrics on a ``pdjax.metrics.Metrics`` and updates them.

    Thread-safe (prometheus_client objects are). ``metrics=None`` gives a no-op instance.
    """

    def __init__(self, metrics: Any, role: str):
        self.role = role
        self.enabled = metrics is not None
        if not self.enabled:
            return
        m = metrics
        self._bytes = m.add_counter("kv_transfer_total_bytes", "KV bytes moved.", ("role",))
        self._pages = m.add_counter("kv_transfer_pages_total", "KV pages moved.", ("role",))
        self._copies = m.add_counter("kv_transfer_copy_ops_total",
                                     "Copy descriptors given to the transfer engine.", ("role",))
        self._chunks = m.add_counter("kv_transfer_chunks_total", "KV transfer chunks.", ("role",))
        self._latency = m.add_histogram("kv_transfer_latency_seconds",
                                        "First chunk queued to Success, per request, s.",
                                        ("role",), buckets=LATENCY_BUCKETS_S)
        self._speed = m.add_gauge("kv_transfer_speed_gb_s",
                                  "Last request's KV bytes / transfer latency, GB/s.", ("role",))
        self._write = m.add_histogram("kv_transfer_write_seconds",
                                      "Transfer-engine batch write of one chunk, s.",
                                      ("role",), buckets=LATENCY_BUCKETS_S)
        self._bootstrap = m.add_histogram("kv_transfer_bootstrap_seconds",
                                          "Request arrival to destination known, s.",
                                          ("role",), buckets=LATENCY_BUCKETS_S)
        self._state_s = m.add_histogram("kv_transfer_state_seconds",
                                        "Time a room spent in each KVPoll state, s.",
                                        ("role", "state"), buckets=LATENCY_BUCKETS_S)
        self._failed = m.add_counter("kv_transfer_failed", "Failed transfers by reason class.",
                                     ("role", "reason"))
        self._largest = m.add_gauge("kv_transfer_largest_batch",
                                    "Most copies in one transfer-engine batch.", ("role",))
        self._queues = m.add_gauge("pd_queue_reqs", "Requests per PD queue.", ("role", "queue"))
        self._quarantined = m.add_gauge("pd_quarantined_pages",
                                        "Decode pages held until an abort ack or drain timeout.",
                                        ("role",))
        self._rejected = m.add_counter("pd_rejected_messages",
                                       "Malformed or refused PD control messages.", ("role",))
        self._auth = m.add_counter("pd_auth_rejected",
                                   "PD control messages refused by authentication (reason: hmac, "
                                   "replay, stale, bootstrap).", ("role", "reason"))
        self._computed = m.add_gauge("pd_prompt_tokens_computed",
                                     "Prompt tokens computed by this server's scheduler.",
                                     ("role",))

    def on_chunk(self, num_bytes: int, num_pages: int, num_copies: int,
                 write_s: float | None = None) -> None:
        if self.enabled:
            if write_s is not None:
                self._write.labels(self.role).observe(write_s)
            self._bytes.labels(self.role).inc(num_bytes)
            self._pages.labels(self.role).inc(num_pages)
            self._copies.labels(self.role).inc(num_copies)
            self._chunks.labels(self.role).inc()

    def on_success(self, num_bytes: int, latency_s: float) -> None:
        if self.enabled:
            self._latency.labels(self.role).observe(latency_s)
            if latency_s > 0:
                self._speed.labels(self.role).set(num_bytes / latency_s / 1e9)

    def on_bootstrap(self, seconds: float) -> None:
        if self.enabled:
            self._bootstrap.labels(self.role).observe(seconds)

    def on_state(self, state: str, seconds: float) -> None:
        if self.enabled:
            self._state_s.labels(self.role, state).observe(max(0.0, seconds))

    def on_failure(self, reason_class: str) -> None:
        if self.enabled:
            self._failed.labels(self.role, reason_class).inc()

    def on_rejected(self) -> None:
        if self.enabled:
            self._rejected.labels(self.role).inc()

    def on_auth_rejected(self, reason: str) -> None:
        if self.enabled:
            self._auth.labels(self.role, reason).inc()

    def set_state(self, queues: dict[str, int], largest_batch: int, quarantined_pages: int,
                  prompt_tokens_computed: int) -> None:
        if not self.enabled:
            return
        for name, n in queues.items():
            self._queues.labels(self.role, name).set(n)
        self._largest.labels(self.role).set(largest_batch)
        self._quarantined.labels(self.role).set(quarantined_pages)
        self._computed.labels(self.role).set(prompt_tokens_computed)
