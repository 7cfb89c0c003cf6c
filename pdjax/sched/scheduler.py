"""Continuous batching with chunked prefill, mixed batches and retraction (DESIGN.md §3).

One step: ``schedule() -> (caller launches the forward, which samples) -> advance() -> ...
-> resolve()`` per sampled token (``process_results`` does both at once). Between ``advance``
and ``resolve`` the sampled token is a ``PENDING_TOKEN`` placeholder at the end of
``output_ids``: with overlapped scheduling the next step is scheduled before it is known.
Pure Python; never imports JAX.

Policy, per step:
1. Decode rows first: every running request whose prompt is done gets one token. Their next
   page comes first (``check_decode_mem``); when the pool is exhausted even after evicting the
   prefix cache, the decode request with the least progress is retracted (pages released into
   the prefix cache, requeued at the front, recomputed later).
2. The rest of the token budget (``max_num_batched_tokens``, default ``chunked_prefill_size``;
   capped by ``max_prefill_tokens``; under DP attention each rank's own, ``StepBudget``: the
   step's bucket is sized by the busiest rank) goes to prefill: first requests already being
   prefilled, then waiting ones in arrival order (head of line; no skipping), admitted only
   when the whole prompt's pages plus one fit. A prompt longer than ``chunked_prefill_size``
   or the budget is split into chunks; one chunked request at a time (a rank). A prefill row
   shares its full pages in the prefix cache when it is scheduled, so a request admitted after
   it (in the same step too) starts past the prefix they share (in-batch prefix sharing).
3. With ``enable_mixed_chunk`` the decode rows and the prefill chunk share one forward (the
   ``mixed`` entry). Without it a step is either decode or prefill, alternating when both have
   work, so decode rows never wait more than one step (the fairness bound).
4. With ``target_itl_ms`` and decode rows in a mixed step, the prefill gets only as many tokens
   as the cost model (``pdjax.sched.cost_model``) predicts fit in the target next to the decode
   rows (Sarathi-Serve's stall-free batching, ``pdjax.sched.itl_target``): the step is filled
   up to the largest compiled token bucket that fits, never a new shape (the chunk may end
   anywhere inside it), planned against an upper quantile of the model's errors. The first
   prefill row still advances every step (no starvation): by at least one token (a sub-page
   chunk is fine in a colocated step), one page for page-aligned chunks; with nothing
   decoding, prefill gets the whole chunk. Before any forward is timed, the chunk is
   unconstrained.
5. Speculative decoding (``DraftRows``, ``speculator`` set): decode rows of requests that
   speculate carry drafts, within the token budget (half of it when prefill waits) and the
   free pages; verify rows go last in the batch; rejected drafts are rolled back by counters
   (``resolve_verify``).
6. A ``KVConnector`` (``pdjax.sched.kv_connector``) is asked at admission
   (``pdjax.sched.admission``: what a request gets; this file: when it is tried) how many
   prompt tokens arrive from elsewhere (such a request waits in ``waiting_remote``; "not yet"
   skips it for this step, the rest of the queue goes on) and at a finish whether the pages stay
   (``held``) until their KV has left (the books: ``pdjax.sched.remote_kv.RemoteKV``). A
   request whose whole prompt arrives (PD decode) joins the running batch with the first token
   the worker reports, when it has a slot; such admissions do not wait for a running slot
   (at most ``max_running_requests`` of them in flight) and run every step.

Page ownership, checked by ``check_invariants`` from independent sides:

    request.pages = [cached prefix pages (owned by the prefix cache, locked) | own pages]
    own pages of live, held and waiting_remote requests + the connector's owned_pages
        + prefix-cache pages + free list = pages 1..num_pages-1
"""

from __future__ import annotations

import collections
import time
from typing import Mapping

from pdjax.request import PENDING_TOKEN, FinishReason, Request
from pdjax.sched.admission import AdmitResult, admit, start_after_prefix, start_with_first_token
from pdjax.sched.step_budget import StepBudget
from pdjax.sched.itl_target import fit_target
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.kv_connector import KVConnector, KVConnectorOutput, NullConnector
from pdjax.sched.scheduled_batch import ScheduledBatch, ScheduledRow
from pdjax.sched.scheduler_config import SchedulerConfig
from pdjax.sched.remote_kv import RemoteKV
from pdjax.sched.spec_rows import DraftRows


class Scheduler:
    """Owns the waiting/running queues; holds the pages (``KVCacheManager``), the remote-KV
    books (``RemoteKV``) and the drafts (``DraftRows``).

    ``cost_model``: a ``StepCostModel`` (or any object with its ``token_buckets``, ``predict``
    and ``margin``), needed for ``target_itl_ms``; each batch carries its prediction.
    ``connector``: the ``KVConnector`` asked at admission and finish (default
    ``NullConnector``: colocated serving). ``speculator``: the ``SpecController`` that drafts
    for decode rows (None: no speculation). ``kv``: the pages, when built before the scheduler
    (``EngineCore`` hands them to its KV connection too); default: a new ``KVCacheManager``.
    """

    def __init__(self, config: SchedulerConfig, cost_model=None,
                 connector: KVConnector | None = None, speculator=None,
                 kv: KVCacheManager | None = None):
        self.config = config
        self.cost_model = cost_model
        self.page_size = config.page_size
        # The pages (allocator, prefix cache) and what is done with a request's pages.
        self.kv = kv if kv is not None else KVCacheManager(
            config.num_pages, config.page_size, config.disable_radix_cache)
        self.allocator = self.kv.allocator
        self.prefix_cache = self.kv.prefix_cache
        # Drafts of decode rows (speculative decoding; ``speculator`` None: off).
        self.drafts = DraftRows(self.kv, config.max_request_tokens, speculator)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self._last_forward_mode: str | None = None
        self.num_retractions = 0
        self.num_prompt_tokens_computed = 0
        # Requests finished inside schedule() (no forward, so no sampled output carries their
        # finish): the engine drains them every step with ``pop_finished`` and answers them.
        self._finished_unreported: list[Request] = []
        # KV that moves between servers (read-only views ``held``, ``waiting_remote``):
        # changed only on the connector's answers and its worker's output.
        self.remote = RemoteKV(self.kv, config.num_reserved_decode_tokens, connector)
        # Requests whose pending token is certainly their last (length limits): not scheduled
        # again while it is pending (overlap).
        self.finishing: set[str] = set()

    # ------------------------------------------------------------------ queue operations
    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request may hold (``SchedulerConfig.max_request_tokens``)."""
        return self.config.max_request_tokens

    @property
    def speculator(self):
        """The ``SpecController`` that drafts for decode rows, or None (set by the engine)."""
        return self.drafts.speculator

    @speculator.setter
    def speculator(self, speculator) -> None:
        self.drafts.speculator = speculator

    def may_speculate(self, req: Request) -> bool:
        """Whether ``req`` is one that speculates (it opted in)."""
        return self.drafts.may_speculate(req)

    @property
    def connector(self) -> KVConnector:
        """The ``KVConnector`` asked at admission and finish."""
        return self.remote.connector

    @connector.setter
    def connector(self, connector: KVConnector) -> None:
        self.remote.connector = connector

    @property
    def held(self) -> Mapping[str, Request]:
        """Finished requests whose pages are kept until ``finished_sending`` (read-only)."""
        return self.remote.held

    @property
    def waiting_remote(self) -> Mapping[str, Request]:
        """Admitted requests whose KV arrives from elsewhere (read-only, rid -> request)."""
        return self.remote.waiting

    def check_new_request(self, req: Request) -> None:
        """``ValueError`` if ``req`` cannot be queued: its rid is in use, or its prompt cannot
        fit the context or the pool (``add_request`` checks the same)."""
        if req.rid in self.requests:
            raise ValueError(f"rid {req.rid!r} is already in use")
        if req.num_tokens >= self.max_request_tokens:
            raise ValueError(f"prompt of {req.num_tokens} tokens is at or over the context "
                             f"length {self.max_request_tokens}")

    def add_request(self, req: Request) -> None:
        """Queue ``req``; ``ValueError`` if its prompt cannot fit the context or the pool."""
        self.check_new_request(req)
        req.arrival_time = req.arrival_time or time.monotonic()
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort_request(self, rid: str, message: str = "aborted") -> Request | None:
        """Drop ``rid`` wherever it is; its pages come back. Returns the request or None."""
        req = self.requests.pop(rid, None)
        self.finishing.discard(rid)
        if self.speculator is not None:
            self.speculator.release(rid)
        if req is None:
            return None
        self.drop_pending(req)
        req.abort(message)                 # first: the connector reads why
        if self.remote.owns(req):
            self.remote.end_waiting(req)   # a write may still land: the connector decides
        elif req in self.waiting:
            self.waiting.remove(req)
            self.remote.not_yet.discard(rid)
            self.connector.request_finished(req)      # no pages: the connector forgets it
        elif req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        return req

    @property
    def has_work(self) -> bool:
        """Whether ``schedule`` may do something: running requests, KV arrived for a slot, or
        a queued request the connector did not answer "not yet" (the connector wakes the
        engine when that changes)."""
        return bool(self.running or self.remote.arrived or any(
            r.rid not in self.remote.not_yet for r in self.waiting))

    # ------------------------------------------------------------------ pages
    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req)
        req.retract(self.step_id)
        self.waiting.appendleft(req)
        self.num_retractions += 1

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's rows; None when there is nothing to run."""
        self.step_id += 1
        if type(self.connector) is not NullConnector:     # colocated: nothing is remote
            self._admit_remote_only()
        decode_reqs = [r for r in self.running
                       if not r.is_prefilling and r.rid not in self.finishing]
        has_prefill_work = any(r.is_prefilling for r in self.running) or any(
            r.last_scheduled_step != self.step_id for r in self.waiting)
        mixed = self.config.enable_mixed_chunk
        run_decode = bool(decode_reqs) and (mixed or not has_prefill_work
                                            or self._last_forward_mode != "decode")
        rows: list[ScheduledRow] = []
        if run_decode:
            rows = self._schedule_decode(decode_reqs)
        run_prefill = has_prefill_work and (mixed or not rows)
        if run_prefill:
            budget = self._step_budget()
            for r in rows:
                budget.take(r.req, r.num_tokens)
            budget = budget.part(lambda n: min(n, self.config.max_prefill_tokens))
            rows += self._schedule_prefill(budget, rows)
        if not rows and decode_reqs and not run_decode:
            rows = self._schedule_decode(decode_reqs)   # prefill could not start: decode now
        if not rows:
            return None
        # Verify rows last: the plain decode rows and full chunks keep their places in the
        # kernel's ``distribution``, and every other row keeps logits row = row index.
        rows = [r for r in rows if not r.is_verify] + [r for r in rows if r.is_verify]
        n_decode = sum(r.is_decode for r in rows)
        n_verify = sum(r.is_verify for r in rows)
        mode = ("decode" if n_decode == len(rows) else
                "prefill_chunk" if n_decode == n_verify == 0 else "mixed")
        self._last_forward_mode = mode
        for r in rows:
            r.req.last_scheduled_step = self.step_id
        batch = ScheduledBatch(mode, rows, self.step_id)
        if self.cost_model is not None:
            batch.predicted_time_s = self.cost_model.predict(
                mode, batch.num_tokens, len(rows), batch.pages_per_seq(self.page_size),
                batch.num_cached_tokens, batch.num_chunk_pairs)
        return batch

    def _schedule_decode(self, decode_reqs: list[Request]) -> list[ScheduledRow]:
        # check_decode_mem: every decode row needs room for one more token; retract the
        # request with the least progress until the rest fit.
        reqs = list(decode_reqs)
        while reqs:
            if self.kv.make_room(reqs):
                break
            if len(reqs) == 1 and len(self.running) == 1:
                # Alone and still no room: the pool cannot hold this request at all.
                victim = reqs[0]
                if victim.output_ids[-1] == PENDING_TOKEN:
                    return []      # its last token first reaches the client (overlap)
                self.finish_request(victim, FinishReason.of_length(len(victim.output_ids)))
                self._finished_unreported.append(victim)
                return []
            victim = min(reqs, key=lambda r: (len(r.output_ids), -r.arrival_time))
            reqs.remove(victim)
            self._retract(victim)
        rows = []
        for r in reqs:
            grown = self.kv.grow(r, r.num_tokens)
            assert grown, "decode pages were reserved above"
            rows.append(ScheduledRow(r, r.num_tokens - 1, 1))
        # Drafts take at most half the budget when prefill work waits (DraftRows).
        has_prefill = any(r.is_prefilling for r in self.running) or bool(self.waiting)
        spare = self._step_budget()
        for r in rows:
            spare.take(r.req, 1)
        self.drafts.add_drafts(rows, spare.part(lambda n: n // 2) if has_prefill else spare)
        return rows

    def _step_budget(self) -> StepBudget:
        """A whole step's token budget: one, or each DP attention rank's own (``StepBudget``)."""
        dp = self.config.dp_size
        return StepBudget(self.config.token_budget, dp, self.kv.rank_of if dp > 1 else None)

    def _admit(self, req: Request, remote_only: bool = False) -> AdmitResult:
        """``admission.admit`` of a queued request; a RUNNING one joins the running batch."""
        result = admit(req, self.kv, self.remote, self.running, remote_only)
        if result is AdmitResult.RUNNING:
            self.running.append(req)
        return result

    def _admit_remote_only(self) -> None:
        """Admit, in queue order, the requests whose KV the connector provides (a PD decode's
        every request): they need no forward, so they do not wait for a prefill step or a
        running slot; at most ``max_running_requests`` wait for their KV at once. Stops at the
        first request that would be computed here or does not fit."""
        i = 0
        while i < len(self.waiting) and len(self.remote.waiting) < self.config.max_running_requests:
            req = self.waiting[i]
            if req.last_scheduled_step == self.step_id:
                return
            admitted = self._admit(req, remote_only=True)
            if admitted is AdmitResult.NOT_YET:
                i += 1
                continue
            if admitted is AdmitResult.NO_ROOM:
                return
            del self.waiting[i]

    def _schedule_prefill(self, budget: StepBudget,
                          decode_rows: list[ScheduledRow]) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        candidates = [r for r in self.running if r.is_prefilling]
        targeted = bool(decode_rows) and self.config.target_itl_ms is not None \
            and self.cost_model is not None
        i = 0           # the next queued request to try ("not yet" ones stay queued)
        while not budget.exhausted:
            if candidates:
                req = candidates.pop(0)
            else:
                if i >= len(self.waiting) or len(self.running) + len(self.remote.waiting) \
                        >= self.config.max_running_requests:
                    break
                req = self.waiting[i]
                if req.last_scheduled_step == self.step_id:
                    break
                admitted = self._admit(req)
                if admitted is AdmitResult.NOT_YET:
                    i += 1
                    continue
                if admitted is AdmitResult.NO_ROOM:
                    break
                del self.waiting[i]
                if admitted is AdmitResult.REMOTE:
                    continue          # its KV arrives first
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(budget.left_for(req), remaining, self.config.chunked_prefill_size)
            if targeted:
                n = fit_target(self.cost_model, self.config, decode_rows + rows, req, n,
                               first=not rows)
            if n < remaining and self.config.page_aligned_chunks:
                n = (req.num_computed_tokens + n) // self.page_size * self.page_size - req.num_computed_tokens
            if budget.left_for(req) <= 0:
                continue     # DP attention: its rank's budget is spent, another's is not
            if n <= 0 or not self.kv.grow(req, req.num_computed_tokens + n):
                if budget.num_pools > 1:
                    # DP attention: only this rank's prefill stops (its budget is under a
                    # page, or its pool is full); the other ranks' go on
                    budget.close(req)
                    continue
                if req in self.running and candidates:
                    # A running prompt whose chunk does not fit yet: the next running one
                    # may (requests admitted with KV from elsewhere took the free pages;
                    # they finish and return them). Stopping here could stall every one.
                    continue
                break
            rows.append(ScheduledRow(req, req.num_computed_tokens, n))
            self.kv.share(req, req.num_computed_tokens + n)
            budget.take(req, n)
            if n < remaining:
                budget.close(req)       # one chunked request at a time (per DP rank)
        return rows

    # ------------------------------------------------------------------ KV from elsewhere
    def build_connector_meta(self, batch: ScheduledBatch | None) -> object | None:
        """What the transfer worker must move after ``batch`` (``KVConnector.build_meta``)."""
        return self.connector.build_meta(batch)

    def update_from_kv_output(self, output: KVConnectorOutput | None,
                              stop_check=None) -> list[Request]:
        """Apply what the worker finished (vLLM's ``_update_from_kv_xfer_finished``), then let
        arrived requests join the running batch while it has slots.

        ``finished_sending``: a held request's pages go back (full pages into the prefix
        cache). ``failed_recving``: a queued or arriving request ends with the connector's
        error (``request_finished`` decides its pages). ``finished_recving``: an arriving
        request's KV is in; it runs from past the arrived tokens (their full pages shared in
        the prefix cache) or, when its whole prompt arrived, from its first token
        (``first_tokens``; missing: the request fails). ``stop_check(req)`` (the engine's)
        checks that first token. Unknown rids are ignored (an abort came first).

        Returns the requests the client must hear about: those that got their first token
        (maybe finished at once) and those that ended."""
        changed: list[Request] = []
        if output:
            for rid in output.finished_sending:
                self.remote.sent(rid)
            for rid, failure in output.failed_recving.items():
                req = self.requests.get(rid)
                if req is not None and (self.remote.owns(req) or req in self.waiting):
                    self._end_unrun(req, req.fail(failure.message, failure.status_code))
                    changed.append(req)
            # In admission order (a set has none): the oldest gets the first free slot.
            for rid in [r for r in self.remote.waiting if r in output.finished_recving]:
                req = self.remote.arrive(rid, output.first_tokens.get(rid))
                if req is not None and self.remote.is_whole_prompt(req) \
                        and rid not in output.first_tokens:
                    self._end_unrun(req, req.fail("connector: the whole prompt's KV arrived "
                                                  "without its first token"))
                    changed.append(req)
        if output is not None:
            self.connector.update(output)
        while self.remote.arrived and len(self.running) < self.config.max_running_requests:
            req, first = self.remote.take_arrived()
            if first is None:                 # a prefix arrived: the rest is computed here
                start_after_prefix(req, self.kv)
                self.running.append(req)
                continue
            changed.append(req)
            if req.sampling_params.max_new_tokens == 0:
                # Nothing to decode (colocated finishes such a request without a forward):
                # the prefill's first token is not the client's; the pages go back.
                self.remote.finished(req)
                self.requests.pop(req.rid, None)
                req.finish(FinishReason.of_length(0))
                continue
            self._start_with_first_token(req, first, stop_check)
        return changed

    def _start_with_first_token(self, req: Request, first, stop_check) -> None:
        """``admission.start_with_first_token``, then ``req`` joins the running batch;
        finished at once when that token stops it."""
        start_with_first_token(req, first, self.step_id)
        self.running.append(req)
        reason = stop_check(req) if stop_check is not None else None
        if reason is None and req.num_tokens >= self.max_request_tokens:
            reason = FinishReason.of_length(len(req.output_ids))
        if reason is not None:
            self.finish_request(req, reason)

    def _end_unrun(self, req: Request, reason: FinishReason) -> None:
        """Finish ``req``, queued or arriving, without running it (its KV will not come)."""
        if self.remote.owns(req):
            self.remote.end_waiting(req)
        else:
            self.waiting.remove(req)
            self.remote.not_yet.discard(req.rid)
            self.connector.request_finished(req)
        self.requests.pop(req.rid, None)
        req.finish(reason)

    # ------------------------------------------------------------------ results
    def process_results(self, batch: ScheduledBatch, sampled: dict[int, int],
                        stop_check) -> list[Request]:
        """Advance counters after the forward. ``sampled[row_index]`` is the token sampled for
        each row with ``samples``; ``stop_check(req)`` returns a finish reason or None after a
        token is appended. Returns the requests that finished this step (pages released)."""
        finished = []
        for i, req, index in self.advance(batch):
            if self.resolve(req, index, sampled[i], stop_check):
                finished.append(req)
        return finished

    def advance(self, batch: ScheduledBatch) -> list[tuple[int, Request, int]]:
        """Count the batch's tokens as computed once its forward is launched, and append a
        ``PENDING_TOKEN`` for each row with ``samples``. Returns ``(row_index, req, index)``
        per pending token: ``req.output_ids[index]`` is the placeholder."""
        pending = []
        for i, row in enumerate(batch.rows):
            req = row.req
            if req.is_finished or req.rid not in self.requests:
                continue
            if not row.is_decode and not row.is_verify:
                self.num_prompt_tokens_computed += row.num_tokens
            # A verify row's drafts count once accepted (``resolve_verify``).
            req.set_num_computed_tokens(row.start + row.num_tokens - len(row.draft_ids))
            if not row.samples:
                continue
            pending.append((i, req, req.append_pending()))
            mnt = req.sampling_params.max_new_tokens
            if (mnt is not None and len(req.output_ids) >= mnt) or \
                    req.num_tokens >= self.max_request_tokens:
                self.finishing.add(req.rid)
        return pending

    def resolve(self, req: Request, index: int, token: int, stop_check) -> bool:
        """Put the sampled ``token`` in place of the placeholder ``req.output_ids[index]`` and
        check the stop conditions (``stop_check(req)`` sees ``output_ids`` up to ``index``).
        On a finish, placeholders after ``index`` are dropped, the KV counter is set back to
        what a step without overlap would have (the token has no KV yet) and the pages are
        released. Returns True if ``req`` finished."""
        if req.is_finished or req.rid not in self.requests:
            return False
        tail = req.resolve_pending(index, token)
        reason = stop_check(req)
        if reason is None and req.num_tokens >= self.max_request_tokens:
            reason = FinishReason.of_length(len(req.output_ids))
        if reason is None:
            req.restore_pending(tail)
            return False
        req.clamp_computed_to_known()
        if req in self.waiting:                   # retracted while its last token was pending
            self.waiting.remove(req)
        self.finish_request(req, reason)
        return True

    def drop_pending(self, req: Request) -> int:
        """Drop trailing placeholders of ``req`` (an abort while a step is in flight) and set
        the KV counter back to the tokens a step without overlap would have computed."""
        n = req.drop_pending()
        if n:
            req.clamp_computed_to_known()
        return n

    def pop_finished(self) -> list[Request]:
        """Requests finished by ``schedule()`` itself since the last call (a lone decode request
        the pool cannot grow): the caller must still send their final output."""
        done, self._finished_unreported = self._finished_unreported, []
        return done

    def finish_waiting(self, req: Request, reason: FinishReason) -> bool:
        """Finish a request that never ran (``max_new_tokens`` 0) with ``reason``; False if
        it is no longer queued (aborted meanwhile)."""
        if self.requests.get(req.rid) is not req or req not in self.waiting:
            return False
        self.waiting.remove(req)
        self.finish_request(req, reason)
        return True

    def finish_request(self, req: Request, reason: FinishReason) -> None:
        self.finishing.discard(req.rid)
        if self.speculator is not None:
            self.speculator.release(req.rid)
        if req in self.running:
            self.running.remove(req)
            self.remote.finished(req)          # held until finished_sending, or released
        self.requests.pop(req.rid, None)
        req.finish(reason)

    def resolve_verify(self, row: ScheduledRow, index: int, tokens: list[int],
                       stop_check) -> tuple[int, bool]:
        """Put a verify row's emitted ``tokens`` (accepted drafts, then the target's own token)
        in place of the placeholder ``req.output_ids[index]``, checking the stop conditions
        after each as ``resolve`` does (a stop drops the tokens after it); then give back the
        pages only rejected drafts reached (``DraftRows``). Returns ``(tokens kept,
        finished)``."""
        req = row.req
        # The newest token's KV and the accepted drafts'; the rest of the row is garbage.
        req.set_num_computed_tokens(row.start + len(tokens))
        for j, token in enumerate(tokens):
            if j:
                index = req.append_pending()
            if self.resolve(req, index, token, stop_check):
                return j + 1, True
            if req.is_finished or req.rid not in self.requests:
                return j, False           # aborted while the step ran
        self.drafts.release_rejected_pages(req)
        return len(tokens), False

    def num_shared_pages(self, req: Request) -> int:
        """How many of ``req.pages`` (from the first) belong to the prefix cache."""
        return self.kv.num_shared_pages(req)

    def evict_unlocked(self) -> int:
        """Evict every cached page no request holds (``KVCacheManager.evict_unlocked``)."""
        return self.kv.evict_unlocked()

    # ------------------------------------------------------------------ accounting
    @property
    def num_used_pages(self) -> int:
        return self.kv.num_used_pages

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless request-owned, cached and free pages partition the
        pool (counted from each side independently) and requests' pages are disjoint."""
        assert not self.held.keys() & self.requests.keys(), "a held request is also scheduled"
        assert not {r.rid for r in self.running} & self.waiting_remote.keys(), \
            "a request waiting for its KV also runs"
        assert not {r.rid for r in self.waiting} & self.waiting_remote.keys(), \
            "a request waiting for its KV is also queued"
        self.kv.check([*self.running, *self.remote.requests()], self.connector.owned_pages())
