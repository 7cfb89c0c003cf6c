"""The host tier's Prometheus metrics on the server's ``pdjax.metrics.Metrics`` (issue 43:
hits and bytes per tier, load and write seconds, host pool usage; DESIGN.md §3, "Host tier").

    pdjax:hicache_hit_tokens_total        prompt tokens loaded from the host instead of computed
    pdjax:hicache_loaded_bytes_total      bytes moved host -> device
    pdjax:hicache_written_bytes_total     bytes moved device -> host
    pdjax:hicache_load_seconds            a load: its start to its scatter dispatch
    pdjax:hicache_write_seconds           a write: its gather dispatch to its pages readable
    pdjax:hicache_host_pages_used         host slots holding or about to hold a page (gauge)
    pdjax:hicache_host_pages_total        host slots (gauge)

With a storage tier (L3, ``storage_tier``):

    pdjax:hicache_storage_hit_tokens_total     prompt tokens the store put on the host for a
                                               request (they then load as host hits)
    pdjax:hicache_storage_read_bytes_total     bytes read from the store into host slots
    pdjax:hicache_storage_written_bytes_total  bytes stored
    pdjax:hicache_storage_read_seconds         a prefetch: its start to its pages read
    pdjax:hicache_storage_write_seconds        a write task: its pages stored
    pdjax:hicache_storage_faults_total{kind}   corrupt (refused records), error (backend
                                               errors), dropped (writes over the backlog)

Pure Python; ``HiCacheRole.attach_metrics`` builds it and the worker reports to it.
"""

from __future__ import annotations

from typing import Any

COPY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class HiCacheMetrics:
    """Registers the metrics above on ``metrics`` (``ValueError`` if a name is taken);
    ``used_pages()`` and ``total_pages`` feed the gauges at scrape time."""

    def __init__(self, metrics: Any, page_size: int, bytes_per_page: int, used_pages,
                 total_pages: int, storage: bool = False):
        self.page_size, self.bytes_per_page = page_size, bytes_per_page
        self.hit_tokens = metrics.add_counter(
            "hicache_hit_tokens", "Prompt tokens loaded from the host KV tier (not computed).")
        self.loaded_bytes = metrics.add_counter(
            "hicache_loaded_bytes", "KV bytes loaded from the host tier into the device pool.")
        self.written_bytes = metrics.add_counter(
            "hicache_written_bytes", "KV bytes written from the device pool to the host tier.")
        self.load_seconds = metrics.add_histogram(
            "hicache_load_seconds", "Host tier load: start to scatter dispatch, s.",
            buckets=COPY_BUCKETS_S)
        self.write_seconds = metrics.add_histogram(
            "hicache_write_seconds", "Host tier write: gather dispatch to pages readable, s.",
            buckets=COPY_BUCKETS_S)
        metrics.add_gauge("hicache_host_pages_used",
                          "Host tier pages holding or about to hold KV.").set_function(used_pages)
        metrics.add_gauge("hicache_host_pages_total",
                          "Pages of the host tier's pool.").set(total_pages)
        if not storage:
            return
        self.storage_hit_tokens = metrics.add_counter(
            "hicache_storage_hit_tokens",
            "Prompt tokens the storage tier put on the host for a request (not computed).")
        self.storage_read_bytes = metrics.add_counter(
            "hicache_storage_read_bytes", "KV bytes read from the storage tier.")
        self.storage_written_bytes = metrics.add_counter(
            "hicache_storage_written_bytes", "KV bytes written to the storage tier.")
        self.storage_read_seconds = metrics.add_histogram(
            "hicache_storage_read_seconds", "Storage tier prefetch: start to pages read, s.",
            buckets=COPY_BUCKETS_S)
        self.storage_write_seconds = metrics.add_histogram(
            "hicache_storage_write_seconds", "Storage tier write task: its pages stored, s.",
            buckets=COPY_BUCKETS_S)
        self.storage_faults = metrics.add_counter(
            "hicache_storage_faults",
            "Storage tier faults: corrupt records refused, backend errors, writes dropped.",
            labels=("kind",))

    def on_load(self, num_pages: int, seconds: float) -> None:
        self.hit_tokens.inc(num_pages * self.page_size)
        self.loaded_bytes.inc(num_pages * self.bytes_per_page)
        self.load_seconds.observe(seconds)

    def on_write(self, num_pages: int, seconds: float) -> None:
        self.written_bytes.inc(num_pages * self.bytes_per_page)
        self.write_seconds.observe(seconds)

    # ---- the storage tier (the write and read hooks run on its thread) -------------------
    def on_storage_read(self, num_pages: int) -> None:
        self.storage_hit_tokens.inc(num_pages * self.page_size)
        self.storage_read_bytes.inc(num_pages * self.bytes_per_page)

    def on_storage_prefetch(self, seconds: float) -> None:
        self.storage_read_seconds.observe(seconds)

    def on_storage_write(self, num_pages: int, seconds: float) -> None:
        self.storage_written_bytes.inc(num_pages * self.bytes_per_page)
        self.storage_write_seconds.observe(seconds)

    def on_storage_fault(self, kind: str, n: int = 1) -> None:
        self.storage_faults.labels(kind).inc(n)
