"""The scheduler's limits (``SchedulerConfig``), in SGLang's terms (DESIGN.md §3). Pure Python."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits in SGLang's terms; ``ValueError`` naming the field for a bad value."""

    num_pages: int
    page_size: int = 16
    max_running_requests: int = 16
    chunked_prefill_size: int = 256
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    max_context_len: int = 4096
    page_aligned_chunks: bool = False   # PD prefill: non-last chunks end on a page boundary
    max_num_batched_tokens: int | None = None   # tokens per forward, decode rows included
    target_itl_ms: float | None = None          # stall-free mixed steps (scheduler.py, policy 4)
    num_reserved_decode_tokens: int = 0         # whole-prompt admissions (``remote_kv.RemoteKV``)
    dp_size: int = 1                            # DP attention ranks, num_pages / dp_size each

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_running_requests", "chunked_prefill_size",
                     "max_prefill_tokens", "max_context_len", "max_num_batched_tokens",
                     "dp_size"):
            v = getattr(self, name)
            if v is None and name == "max_num_batched_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if not isinstance(self.num_reserved_decode_tokens, int) or \
                isinstance(self.num_reserved_decode_tokens, bool) or \
                self.num_reserved_decode_tokens < 0:
            raise ValueError(f"num_reserved_decode_tokens: must be a non-negative integer, got "
                             f"{self.num_reserved_decode_tokens!r}")
        if self.num_pages // self.dp_size < 2:
            raise ValueError(f"num_pages: must be >= 2 a rank (page 0 is reserved), got "
                             f"{self.num_pages} for {self.dp_size} rank(s)")
        if self.page_aligned_chunks and min(self.chunked_prefill_size, self.token_budget) < self.page_size:
            name = ("chunked_prefill_size" if self.chunked_prefill_size < self.page_size
                    else "max_num_batched_tokens")
            raise ValueError(f"{name}: must be >= page_size ({self.page_size}) when chunks are "
                             f"page-aligned, got {getattr(self, name)}")
        if self.target_itl_ms is not None and not (isinstance(self.target_itl_ms, (int, float))
                                                   and 0 < self.target_itl_ms < float("inf")):
            raise ValueError(f"target_itl_ms: must be a positive number of milliseconds, got "
                             f"{self.target_itl_ms!r}")

    @property
    def token_budget(self) -> int:
        """Most tokens one forward carries, decode rows included."""
        return self.max_num_batched_tokens or self.chunked_prefill_size

    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request may hold: the context length, and what the pool (DP
        attention: one rank's) can hold."""
        return min(self.max_context_len, (self.num_pages // self.dp_size - 2) * self.page_size)
