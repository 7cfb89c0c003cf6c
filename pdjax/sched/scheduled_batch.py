"""What one ``Scheduler.schedule()`` returns: the rows of a step (DESIGN.md §3). Pure Python."""

from __future__ import annotations

import dataclasses

from pdjax.request import Request


@dataclasses.dataclass
class ScheduledRow:
    """``num_tokens`` new tokens of ``req`` from position ``start``; a verify row's last
    ``len(draft_ids)`` of them are drafts (not in ``req.all_ids``; ``pdjax.sched.spec_rows``)."""

    req: Request
    start: int
    num_tokens: int
    draft_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start == self.req.num_tokens - 1 and bool(self.req.output_ids)

    @property
    def is_verify(self) -> bool:
        """A decode row carrying drafts (one logits row per token, DESIGN.md §3)."""
        return bool(self.draft_ids)

    @property
    def samples(self) -> bool:
        """True when this row reaches the request's newest token, so a token is sampled."""
        return self.start + self.num_tokens - len(self.draft_ids) == self.req.num_tokens

    @property
    def token_ids(self) -> list[int]:
        known = self.num_tokens - len(self.draft_ids)
        return self.req.all_ids[self.start:self.start + known] + self.draft_ids


def chunk_pairs(num_tokens: int, start: int) -> int:
    """Context tokens a row of ``num_tokens`` new tokens from position ``start`` attends,
    summed over its tokens, if it is a prompt chunk (more than one token), else 0: the cost
    model's ``q`` term of one row."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2 if num_tokens > 1 else 0


@dataclasses.dataclass
class ScheduledBatch:
    forward_mode: str             # "decode" | "prefill_chunk" | "mixed"
    rows: list[ScheduledRow]      # decode rows first
    step: int
    predicted_time_s: float | None = None     # the cost model's forecast of the forward

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_cached_tokens(self) -> int:
        """Context tokens the rows read from the cache (the sum of their starts)."""
        return sum(r.start for r in self.rows)

    @property
    def num_chunk_pairs(self) -> int:
        """Context tokens the prompt chunks' new tokens attend, summed over them (the cost
        model's ``q``): ``n * start + n (n + 1) / 2`` per row of ``n > 1`` tokens."""
        return sum(chunk_pairs(r.num_tokens, r.start) for r in self.rows)

    def pages_per_seq(self, page_size: int) -> int:
        """Most pages one row reaches after this step."""
        return max(-(-(r.start + r.num_tokens) // page_size) for r in self.rows)
