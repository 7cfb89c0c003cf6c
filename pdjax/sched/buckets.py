"""Shape buckets: the whole, bounded list of shapes the engine compiles (DESIGN.md §2).

Three forward modes (``ScheduledBatch.forward_mode``) run on two executables:

    forward mode    executable  shape       rows
    decode          decode      (R, P)      R = T: one token per row        R in request buckets
    prefill_chunk   extend      (T, R, P)   prefill rows only               R = max_running_requests
    mixed           extend      (T, R, P)   decode rows first, then chunks  R = max_running_requests

Prefill and mixed are the same function of the same shapes (``distribution`` tells the
attention which rows are which), so they share one executable per ``(T, P)``. Padded rows cost
nothing in attention (kv_len 0), so extend uses one row count.

Pages-per-sequence buckets: the Pallas kernels' grids depend on ``P``, so their buckets grow by
``pages_growth`` (x4 by default; every extra bucket is another compile per token bucket). The
jnp paths (``traced_pages_bound=True``) loop only over the pages some row reaches, with a
traced bound, so one bucket, ``max_pages_per_seq``, serves every batch. Never imports JAX.
"""

from __future__ import annotations

import dataclasses

FORWARD_MODES = ("decode", "prefill_chunk", "mixed")
ENTRY_POINTS = ("decode", "extend")
ENTRY_OF_MODE = {"decode": "decode", "prefill_chunk": "extend", "mixed": "extend"}


def _geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
    out, v = [], start
    while v < stop:
        out.append(v)
        v *= factor
    out.append(stop)
    return tuple(sorted(set(out)))


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """One executable's shape: ``entry`` in ``ENTRY_POINTS``, ``num_tokens`` T, ``num_rows``
    R and ``pages_per_seq`` P (decode: T = R)."""

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
               max_num_batched_tokens: int | None = None,
               traced_pages_bound: bool = False) -> "Buckets":
        """Token buckets run up to ``max_num_batched_tokens`` (the most tokens of one forward;
        default ``chunked_prefill_size``). ``traced_pages_bound``: the attention's cost does not
        grow with ``P`` (the jnp paths), so one pages-per-sequence bucket; otherwise geometric
        by ``pages_growth``."""
        top = max_num_batched_tokens or chunked_prefill_size
        for name, v in (("chunked_prefill_size", chunked_prefill_size), ("max_num_batched_tokens", top),
                        ("max_running_requests", max_running_requests),
                        ("max_pages_per_seq", max_pages_per_seq)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if pages_growth < 2:         # 1 would never reach max_pages_per_seq
            raise ValueError(f"pages_growth must be >= 2, got {pages_growth}")
        pages = ((max_pages_per_seq,) if traced_pages_bound else
                 _geometric(min(4, max_pages_per_seq), max_pages_per_seq, pages_growth))
        return cls(
            token_buckets=_geometric(min(min_tokens, top), top, 2),
            request_buckets=_geometric(1, max_running_requests, 2),
            pages_per_seq_buckets=pages,
            max_rows=max_running_requests,
        )

    def check_serves(self, limits: "Buckets") -> None:
        """Check that these buckets (a list chosen by hand, e.g. ``scripts/gpu_check.sh``'s
        few shapes) hold every batch the settings allow, ``limits`` being the buckets
        ``create`` derives from them: each list strictly ascending and positive, its largest
        entry at least ``limits``'s, and the same ``max_rows`` (the extend entry's row count).
        ``ValueError`` naming the list otherwise."""
        for name in ("token_buckets", "request_buckets", "pages_per_seq_buckets"):
            mine, need = getattr(self, name), getattr(limits, name)[-1]
            if not mine or mine[0] < 1 or any(a >= b for a, b in zip(mine, mine[1:])):
                raise ValueError(f"buckets.{name} must be positive and strictly ascending, "
                                 f"got {list(mine)}")
            if mine[-1] < need:
                raise ValueError(f"buckets.{name}: the largest, {mine[-1]}, is below the "
                                 f"{need} the settings allow")
        if self.max_rows != limits.max_rows:
            raise ValueError(f"buckets.max_rows must equal max_running_requests "
                             f"({limits.max_rows}), got {self.max_rows}")

    @staticmethod
    def _fit(buckets: tuple[int, ...], n: int, what: str) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")

    def pick(self, mode: str, num_tokens: int, num_rows: int, pages_per_seq: int,
             ready=None) -> BucketKey:
        """Smallest bucket holding a batch of forward ``mode`` (one of ``FORWARD_MODES``);
        raises ``ValueError`` if none does or the mode is unknown.

        ``ready``: the keys compiled so far (a container of ``BucketKey``; None: all). The
        smallest *ready* bucket holding the batch is picked, a larger one standing in for a
        shape still compiling in the background; ``core_keys`` hold every batch, so with them
        ready a key is always found (``ValueError`` otherwise).
        """
        if mode not in FORWARD_MODES:
            raise ValueError(f"mode must be one of {FORWARD_MODES}, got {mode!r}")
        p = self._fit(self.pages_per_seq_buckets, max(pages_per_seq, 1), "pages per sequence")
        if mode == "decode":
            r = self._fit(self.request_buckets, num_rows, "decode rows")
            key = BucketKey("decode", r, r, p)
        else:
            if num_rows > self.max_rows:
                raise ValueError(f"{num_rows} rows exceed max_running_requests {self.max_rows}")
            key = BucketKey(ENTRY_OF_MODE[mode], self._fit(self.token_buckets, num_tokens, "tokens"),
                            self.max_rows, p)
        if ready is None or key in ready:
            return key
        for other in self.all_keys():        # ascending tokens, then pages, per entry
            if (other.entry == key.entry and other.num_tokens >= key.num_tokens
                    and other.pages_per_seq >= key.pages_per_seq and other in ready):
                return other
        raise ValueError(f"no compiled bucket holds {key} yet")

    def all_keys(self) -> list[BucketKey]:
        """Every shape warm-up compiles (one executable each), in a stable order."""
        keys = [BucketKey("decode", r, r, p) for r in self.request_buckets
                for p in self.pages_per_seq_buckets]
        keys += [BucketKey("extend", t, self.max_rows, p) for t in self.token_buckets
                 for p in self.pages_per_seq_buckets]
        return keys

    def core_keys(self) -> list[BucketKey]:
        """The largest shape of each entry point: together they hold every batch ``pick``
        accepts (the warm core set compiled before the server is ready; the rest may follow
        in the background)."""
        p = self.pages_per_seq_buckets[-1]
        r = self.request_buckets[-1]
        return [BucketKey("decode", r, r, p),
                BucketKey("extend", self.token_buckets[-1], self.max_rows, p)]

    def describe(self) -> str:
        return (f"token buckets {list(self.token_buckets)}, decode request buckets "
                f"{list(self.request_buckets)}, pages-per-seq buckets "
                f"{list(self.pages_per_seq_buckets)}, rows {self.max_rows}: "
                f"{len(self.all_keys())} forward shapes")
