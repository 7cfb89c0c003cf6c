"""Shape buckets: the whole, bounded list of shapes the engine compiles (DESIGN.md §2).

Three entry points share the model:

    decode          (R, P)      R = T: one token per row          R in request buckets
    prefill_chunk   (T, R, P)   prefill rows only                  R = max_running_requests
    mixed           (T, R, P)   decode rows first, then a chunk    R = max_running_requests

Padded rows cost nothing in attention (kv_len 0), so prefill and mixed use one row count.
Pages-per-sequence buckets grow by ``pages_growth`` (x4 by default) because every extra
bucket is another compile per token bucket. Never imports JAX.
"""

from __future__ import annotations

import dataclasses

ENTRY_POINTS = ("decode", "prefill_chunk", "mixed")


def _geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
    out, v = [], start
    while v < stop:
        out.append(v)
        v *= factor
    out.append(stop)
    return tuple(sorted(set(out)))


@dataclasses.dataclass(frozen=True)
class BucketKey:
    entry: str
    num_tokens: int
    num_rows: int
    pages_per_seq: int


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Bucket lists derived from the scheduler limits; ``ValueError`` for bad limits."""

    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    pages_per_seq_buckets: tuple[int, ...]
    max_rows: int

    @classmethod
    def create(cls, *, chunked_prefill_size: int, max_running_requests: int,
               max_pages_per_seq: int, min_tokens: int = 16, pages_growth: int = 4,
               max_num_batched_tokens: int | None = None) -> "Buckets":
        """Token buckets run up to ``max_num_batched_tokens`` (the most tokens of one forward;
        default ``chunked_prefill_size``)."""
        top = max_num_batched_tokens or chunked_prefill_size
        for name, v in (("chunked_prefill_size", chunked_prefill_size), ("max_num_batched_tokens", top),
                        ("max_running_requests", max_running_requests),
                        ("max_pages_per_seq", max_pages_per_seq)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        return cls(
            token_buckets=_geometric(min(min_tokens, top), top, 2),
            request_buckets=_geometric(1, max_running_requests, 2),
            pages_per_seq_buckets=_geometric(min(4, max_pages_per_seq), max_pages_per_seq, pages_growth),
            max_rows=max_running_requests,
        )

    @staticmethod
    def _fit(buckets: tuple[int, ...], n: int, what: str) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")

    def pick(self, entry: str, num_tokens: int, num_rows: int, pages_per_seq: int) -> BucketKey:
        """Smallest bucket holding the batch; raises ``ValueError`` if none does."""
        p = self._fit(self.pages_per_seq_buckets, max(pages_per_seq, 1), "pages per sequence")
        if entry == "decode":
            r = self._fit(self.request_buckets, num_rows, "decode rows")
            return BucketKey(entry, r, r, p)
        if entry not in ENTRY_POINTS:
            raise ValueError(f"entry must be one of {ENTRY_POINTS}, got {entry!r}")
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} rows exceed max_running_requests {self.max_rows}")
        return BucketKey(entry, self._fit(self.token_buckets, num_tokens, "tokens"), self.max_rows, p)

    def all_keys(self) -> list[BucketKey]:
        """Every shape warm-up compiles, in a stable order."""
        keys = [BucketKey("decode", r, r, p) for r in self.request_buckets
                for p in self.pages_per_seq_buckets]
        for entry in ("prefill_chunk", "mixed"):
            keys += [BucketKey(entry, t, self.max_rows, p) for t in self.token_buckets
                     for p in self.pages_per_seq_buckets]
        return keys

    def describe(self) -> str:
        return (f"token buckets {list(self.token_buckets)}, decode request buckets "
                f"{list(self.request_buckets)}, pages-per-seq buckets "
                f"{list(self.pages_per_seq_buckets)}, rows {self.max_rows}: "
                f"{len(self.all_keys())} forward shapes")
