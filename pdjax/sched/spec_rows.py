"""Verify rows of the scheduler (DESIGN.md §3, "Speculative decoding"): drafts added to decode
rows, and the pages of rejected drafts given back. Pure Python; never imports JAX.

``DraftRows`` is held by ``pdjax.sched.scheduler.Scheduler`` (which resolves a verify row's
tokens, ``resolve_verify``) and works on its ``KVCacheManager``. A verify row is a decode row
carrying ``k`` drafts: it
computes the KV of the request's newest token and of the drafts (positions ``start`` to
``start + k``), so its request holds pages up to position ``start + k`` for one step. After
the forward only the accepted drafts count::

    position      start  +1  +2  +3            (k = 3 drafts, 1 accepted, bonus b)
    row tokens    t      d1  d2  d3
    KV written    t      d1  d2  d3            (every slot of the row, as any extend row)
    kept          t      d1 | b                num_computed_tokens = start + 2: d2, d3 garbage
    pages         [.... page i ....][ page i+1 ]   page i+1 holds only d3 -> freed

Rollback is bookkeeping only, no copy: ``num_computed_tokens`` stops before the first
rejected draft (attention reads ``kv_lens``, so the slots after it are never read, and the next
tokens overwrite them), the rejected tokens never enter ``all_ids`` (so neither the prefix
cache nor the allocator's owners see them: ``KVCacheManager.release`` caches only full pages of
computed tokens), and pages past the one the next token needs go back to the free list. Drafts use free
pages only: speculation never evicts the prefix cache or retracts a request.
"""

from __future__ import annotations

from pdjax.request import PENDING_TOKEN
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.step_budget import StepBudget


class DraftRows:
    """The drafts of a scheduler's decode rows. ``kv``: the scheduler's ``KVCacheManager``;
    ``max_request_tokens``: the most tokens one request may hold; ``speculator``: a
    ``SpecController``, or None (no speculation; set by the engine)."""

    def __init__(self, kv: KVCacheManager, max_request_tokens: int, speculator=None):
        self.kv = kv
        self.max_request_tokens = max_request_tokens
        self.speculator = speculator

    @staticmethod
    def may_speculate(req) -> bool:
        """Whether ``req`` is one that speculates (it opted in)."""
        return req.sampling_params.speculative

    def speculates(self, req) -> bool:
        """Whether ``req`` may carry drafts this step: ``may_speculate``, and no token of it
        is pending (overlap: its newest token is still on the device)."""
        return self.may_speculate(req) and PENDING_TOKEN not in req.output_ids

    def add_drafts(self, rows: list, budget: StepBudget | int) -> None:
        """Give decode ``rows`` (``ScheduledRow``s of one token) the drafts their requests
        want, within ``budget`` (tokens in all, or a ``StepBudget``: under DP attention each
        rank's) and the free pages; a row gets none where its ``max_new_tokens`` or the
        context leaves no room for more than one token."""
        if self.speculator is None:
            return
        self.speculator.begin_step()
        if isinstance(budget, int):
            budget = StepBudget(budget)
        limit = self.speculator.max_batch_size
        if budget.exhausted or (limit is not None and len(rows) > limit):
            return
        picked, wants = [], []
        for row in rows:
            req = row.req
            if not self.speculates(req):
                continue
            room = self.max_request_tokens - req.num_tokens - 1
            mnt = req.sampling_params.max_new_tokens
            if mnt is not None:
                room = min(room, mnt - len(req.output_ids) - 1)
            if room <= 0:
                continue
            k = min(self.speculator.wanted(req), room)
            if k > 0:
                picked.append(row)
                wants.append(k)
        if not picked:
            return
        drafts = self.speculator.propose([r.req for r in picked], wants)
        for row, draft in zip(picked, drafts):
            if not draft:
                self.speculator.on_no_draft(row.req.rid)
                continue
            self.speculator.on_draft(row.req.rid)
            req = row.req
            draft = draft[:max(budget.left_for(req), 0)]
            if not draft:
                continue
            # Free pages only, of the request's own pool (DP attention: its rank's).
            if not self.kv.alloc_free(req, self.kv.pages_needed(req, req.num_tokens
                                                                 + len(draft))):
                continue
            row.draft_ids = list(draft)
            row.num_tokens += len(draft)
            budget.take(req, len(draft))

    def release_rejected_pages(self, req) -> int:
        """Free ``req``'s pages past the one its next token's KV goes to (they held only
        rejected drafts); returns how many."""
        return self.kv.truncate(req, -(-req.num_tokens // self.kv.page_size))
