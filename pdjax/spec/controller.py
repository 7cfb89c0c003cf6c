"""Which running requests speculate this step, with how many drafts, and what came of it
(DESIGN.md §3, "Speculative decoding"). Pure Python; never imports JAX.

Adaptive draft length, per request: each verify step that keeps every draft lets the next one
propose one more (up to ``num_draft_tokens - 1``); one that keeps none halves it. When it would
drop below 1 the request stops speculating for a back-off of ``2 ** misses`` steps (capped at
``MAX_BACKOFF_STEPS``), then tries one draft again. A step where the drafter finds nothing
backs off too (``2 ** (dry steps in a row - 1)`` steps). Only *active* requests (not backed
off) make the engine read the step in flight before scheduling (so their newest token is
known to the drafter), which costs the overlap; the others decode overlapped as without
speculation (DESIGN.md §3). A request whose drafts keep failing (chat) so pays for a verify
row now and then and plain overlapped decode steps otherwise.

Statistics (``SpecStats``): verify rows, drafts proposed, drafts accepted and the histogram of
tokens a verify row emitted (accepted drafts + the target's own token), read by ``/metrics``.
"""

from __future__ import annotations

import dataclasses

MAX_BACKOFF_STEPS = 64


@dataclasses.dataclass
class SpecStats:
    """Totals since start. ``accept_len_hist[n]``: verify rows that emitted ``n`` tokens
    (``n`` in ``[1, num_draft_tokens]``)."""

    num_verify_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accept_len_hist: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens per verify row, the target's own included (SGLang's "accept length")."""
        return ((self.num_accepted_tokens + self.num_verify_rows) / self.num_verify_rows
                if self.num_verify_rows else 0.0)


@dataclasses.dataclass
class _ReqState:
    length: int                 # drafts to ask for next
    resume_step: int = 0        # first step it speculates again (back-off)
    misses: int = 0             # back-offs so far in a row
    dry: int = 0                # steps in a row the drafter found nothing


class SpecController:
    """Draft lengths per request around a ``Drafter``.

    ``num_draft_tokens``: tokens of a verify row (SGLang's ``--speculative-num-draft-tokens``):
    the request's newest token plus at most ``num_draft_tokens - 1`` drafts. ``adaptive``:
    the per-request draft length above (off: always the most). ``max_batch_size``: a step
    with more decode rows than this carries no drafts (None: no limit).
    """

    def __init__(self, drafter, num_draft_tokens: int, adaptive: bool = True,
                 max_batch_size: int | None = None):
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be >= 2, got {num_draft_tokens!r}")
        self.drafter = drafter
        self.max_drafts = num_draft_tokens - 1
        self.adaptive = adaptive
        self.max_batch_size = max_batch_size     # no drafts in a step with more decode rows
        self.stats = SpecStats()
        self._reqs: dict[str, _ReqState] = {}
        self.step = 0               # scheduling steps with decode rows (``begin_step``)

    def begin_step(self) -> None:
        """A step's decode rows are being scheduled (back-offs count these)."""
        self.step += 1

    def active(self, rid: str) -> bool:
        """Whether ``rid`` would speculate now (not backed off); no side effect."""
        st = self._reqs.get(rid)
        return st is None or st.resume_step <= self.step

    def wanted(self, req) -> int:
        """Drafts ``req`` should try this step (0: backed off, decode plainly)."""
        st = self._reqs.setdefault(req.rid, _ReqState(self.max_drafts))
        return st.length if st.resume_step <= self.step else 0

    def propose(self, reqs: list, max_tokens: list[int]) -> list[list[int]]:
        """The drafter's proposals, each cut to its ``max_tokens`` entry."""
        todo = [i for i, k in enumerate(max_tokens) if k > 0]
        drafts: list[list[int]] = [[] for _ in reqs]
        if todo:
            got = self.drafter.propose([reqs[i] for i in todo], [max_tokens[i] for i in todo])
            for i, d in zip(todo, got):
                drafts[i] = list(d)[:max_tokens[i]]
        return drafts

    def on_verified(self, rid: str, num_drafts: int, num_accepted: int,
                    num_emitted: int) -> None:
        """A verify row of ``rid`` with ``num_drafts`` drafts kept ``num_accepted`` and emitted
        ``num_emitted`` tokens (fewer than ``num_accepted + 1`` when a stop cut it)."""
        s = self.stats
        s.num_verify_rows += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.accept_len_hist[num_emitted] = s.accept_len_hist.get(num_emitted, 0) + 1
        self.drafter.on_verified(rid, num_accepted)
        st = self._reqs.get(rid)
        if st is None or not self.adaptive:
            return
        if num_accepted == num_drafts:
            st.length = min(self.max_drafts, st.length + 1)
            st.misses = 0
        elif num_accepted == 0:
            if st.length == 1:
                st.misses += 1
                st.resume_step = self.step + 1 + min(MAX_BACKOFF_STEPS, 2 ** st.misses)
            st.length = max(1, st.length // 2)
        else:
            st.length = max(1, num_accepted)
            st.misses = 0

    def on_no_draft(self, rid: str) -> None:
        """The drafter found nothing for ``rid`` this step: back off (no overlap is given up
        for a request that drafts nothing)."""
        st = self._reqs.get(rid)
        if st is None or not self.adaptive:
            return
        st.dry += 1
        st.resume_step = self.step + 1 + min(MAX_BACKOFF_STEPS, 2 ** (st.dry - 1))

    def on_draft(self, rid: str) -> None:
        """The drafter found a draft for ``rid``."""
        st = self._reqs.get(rid)
        if st is not None:
            st.dry = 0

    def release(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self.drafter.release(rid)
