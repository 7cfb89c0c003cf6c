"""A step's token budget, one per DP attention rank (DESIGN.md §3, §6). Pure Python; never
imports JAX.

Without DP attention a step has one budget: ``token_budget`` tokens (``max_num_batched_tokens``,
default ``chunked_prefill_size``), decode rows, drafts and prefill chunks included. Under DP
attention every rank runs its own padded segment of the step, and the bucket is sized by the
busiest rank (``sched/dp_batch.py``), so each rank has the whole budget for its own rows, as
SGLang's per-rank schedulers have (the group carries up to ``dp * token_budget`` tokens)::

    token_budget 16, dp 4     rank 0        rank 1        rank 2 (idle)   rank 3
    decode rows               4             1             -               2
    prefill chunks            12            15            16              14
    segment (bucket: 16)      16            16            16              16

A rank whose prefill was cut into a chunk takes no more prefill this step (one chunked
request at a time, per rank; ``close``).
"""

from __future__ import annotations

from typing import Callable


class StepBudget:
    """Tokens the rows of one step may still take, per pool: one pool, or ``dp_size`` ranks
    with ``rank_of(req)`` naming a request's (``DpKVCacheManager.rank_of``). ``ValueError``
    for ``dp_size`` < 1 or ``dp_size`` > 1 without ``rank_of``."""

    def __init__(self, tokens: int, dp_size: int = 1,
                 rank_of: Callable[[object], int] | None = None):
        if dp_size < 1 or (dp_size > 1 and rank_of is None):
            raise ValueError(f"dp_size: {dp_size} ranks need rank_of (and at least one)")
        self.left = [tokens] * dp_size
        self._rank_of = rank_of

    @property
    def num_pools(self) -> int:
        """1, or the DP attention ranks."""
        return len(self.left)

    def _pool(self, req) -> int:
        return 0 if len(self.left) == 1 else self._rank_of(req)

    def left_for(self, req) -> int:
        """Tokens ``req``'s pool (its rank's) may still take this step."""
        return self.left[self._pool(req)]

    def take(self, req, n: int) -> None:
        """``req``'s pool takes ``n`` tokens (it may go below 0: a decode row always runs)."""
        self.left[self._pool(req)] -= n

    def close(self, req) -> None:
        """``req``'s pool takes nothing more this step."""
        self.left[self._pool(req)] = 0

    @property
    def exhausted(self) -> bool:
        """No pool has a token left."""
        return max(self.left) <= 0

    def part(self, fn: Callable[[int], int]) -> "StepBudget":
        """A budget of ``fn(left)`` tokens per pool (e.g. half for the drafts, or capped by
        ``max_prefill_tokens``), with the same pools."""
        out = StepBudget(0, len(self.left), self._rank_of)
        out.left = [fn(max(x, 0)) for x in self.left]
        return out
