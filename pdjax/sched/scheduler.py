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
   capped by ``max_prefill_tokens``) goes to prefill: first requests already being prefilled,
   then waiting ones in arrival order (head of line; no skipping), admitted only when the whole
   prompt's pages plus one fit. A prompt longer than ``chunked_prefill_size`` or the budget is
   split into chunks; one chunked request at a time. A prefill row shares its full pages in
   the prefix cache when it is scheduled, so a request admitted after it (in the same step too)
   starts past the prefix they share (in-batch prefix sharing).
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
5. Speculative decoding (``SpecRows``, ``speculator`` set): decode rows of requests that
   speculate carry drafts, within the token budget (half of it when prefill waits) and the
   free pages; verify rows go last in the batch; rejected drafts are rolled back by counters
   (``resolve_verify``).
6. A ``KVConnector`` (``pdjax.sched.kv_connector``) is asked at admission how many prompt
   tokens arrive from elsewhere (such a request waits in ``waiting_remote``; "not yet" skips
   it for this step, the rest of the queue goes on) and at a finish whether the pages stay
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
import dataclasses
import time
from typing import Mapping

from pdjax.kv.allocator import PageAllocator
from pdjax.kv.prefix_cache import RadixCache
from pdjax.request import PENDING_TOKEN, FinishReason, Request
from pdjax.sched.itl_target import fit_target
from pdjax.sched.kv_connector import KVConnector, KVConnectorOutput, NullConnector
from pdjax.sched.scheduled_batch import ScheduledBatch, ScheduledRow
from pdjax.sched.remote_kv import RemoteKV
from pdjax.sched.spec_rows import SpecRows


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
    target_itl_ms: float | None = None          # stall-free mixed steps (policy 4 above)
    num_reserved_decode_tokens: int = 0         # whole-prompt admissions (``RemoteKV``)

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_running_requests", "chunked_prefill_size",
                     "max_prefill_tokens", "max_context_len", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is None and name == "max_num_batched_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.num_reserved_decode_tokens, int) or \
                isinstance(self.num_reserved_decode_tokens, bool) or \
                self.num_reserved_decode_tokens < 0:
            raise ValueError(f"num_reserved_decode_tokens must be a non-negative integer, got "
                             f"{self.num_reserved_decode_tokens!r}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.page_aligned_chunks and min(self.chunked_prefill_size, self.token_budget) < self.page_size:
            raise ValueError("chunked_prefill_size and max_num_batched_tokens must be >= page_size "
                             "when chunks are page-aligned")
        if self.target_itl_ms is not None and not (isinstance(self.target_itl_ms, (int, float))
                                                   and 0 < self.target_itl_ms < float("inf")):
            raise ValueError(f"target_itl_ms must be a positive number of milliseconds, got "
                             f"{self.target_itl_ms!r}")

    @property
    def token_budget(self) -> int:
        """Most tokens one forward carries, decode rows included."""
        return self.max_num_batched_tokens or self.chunked_prefill_size

    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request may hold: the context length, and what the pool can hold."""
        return min(self.max_context_len, (self.num_pages - 2) * self.page_size)


class Scheduler(SpecRows):
    """Owns the waiting/running queues, the page allocator and the prefix cache.

    ``cost_model``: a ``StepCostModel`` (or any object with its ``token_buckets``, ``predict``
    and ``margin``), needed for ``target_itl_ms``; each batch carries its prediction.
    ``connector``: the ``KVConnector`` asked at admission and finish (default
    ``NullConnector``: colocated serving).
    """

    def __init__(self, config: SchedulerConfig, cost_model=None,
                 connector: KVConnector | None = None):
        self.config = config
        self.cost_model = cost_model
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.prefix_cache = RadixCache(config.page_size, self.allocator,
                                       enabled=not config.disable_radix_cache)
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
        self.remote = RemoteKV(self.allocator, config.page_size, self._release,
                               config.num_reserved_decode_tokens, connector)
        # Requests whose pending token is certainly their last (length limits): not scheduled
        # again while it is pending (overlap).
        self.finishing: set[str] = set()

    # ------------------------------------------------------------------ queue operations
    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request may hold (``SchedulerConfig.max_request_tokens``)."""
        return self.config.max_request_tokens

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

    def add_request(self, req: Request) -> None:
        """Queue ``req``; ``ValueError`` if its prompt cannot fit the context or the pool."""
        if req.rid in self.requests:
            raise ValueError(f"rid {req.rid!r} is already in use")
        if req.num_tokens >= self.max_request_tokens:
            raise ValueError(f"prompt of {req.num_tokens} tokens is at or over the context "
                             f"length {self.max_request_tokens}")
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
            self._release(req)
        return req

    @property
    def has_work(self) -> bool:
        """Whether ``schedule`` may do something: running requests, KV arrived for a slot, or
        a queued request the connector did not answer "not yet" (the connector wakes the
        engine when that changes)."""
        return bool(self.running or self.remote.arrived or any(
            r.rid not in self.remote.not_yet for r in self.waiting))

    # ------------------------------------------------------------------ pages
    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def _make_free(self, n: int) -> bool:
        """Evict from the prefix cache until ``n`` pages are free; False if impossible."""
        short = n - self.allocator.num_free
        if short > 0:
            self.prefix_cache.evict(short)
        return self.allocator.num_free >= n

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages to hold ``num_tokens`` tokens; False (no change) if impossible."""
        n = self._pages_needed(req, num_tokens)
        if n == 0:
            return True
        if not self._make_free(n):
            return False
        req.pages.extend(self.allocator.alloc(n))
        return True

    def _release(self, req: Request) -> None:
        """Return ``req``'s pages: full computed pages into the prefix cache, the rest freed."""
        # Shared pages are the cache's already (a forward launched after their scheduling
        # writes their KV, even when the request is dropped before it reads them).
        full = max(min(req.num_computed_tokens // self.page_size, len(req.pages)),
                   self.num_shared_pages(req))
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        self.prefix_cache.insert(req.all_ids[:full * self.page_size], req.pages[:full])
        if req.pages[full:]:
            self.allocator.free(req.pages[full:])
        req.pages = []

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
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
            budget = min(self.config.token_budget - sum(r.num_tokens for r in rows),
                         self.config.max_prefill_tokens)
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
            need = sum(self._pages_needed(r, r.num_tokens) for r in reqs)
            if self._make_free(need):
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
            grown = self._grow(r, r.num_tokens)
            assert grown, "decode pages were reserved above"
            rows.append(ScheduledRow(r, r.num_tokens - 1, 1))
        # Drafts take at most half the budget when prefill work waits (SpecRows).
        has_prefill = any(r.is_prefilling for r in self.running) or bool(self.waiting)
        spare = self.config.token_budget - len(rows)
        self._add_drafts(rows, spare // 2 if has_prefill else spare)
        return rows

    def _admit(self, req: Request, remote_only: bool = False) -> bool | None:
        """Admit a queued request: its prefix-cache hit, then what the connector has of the
        rest (``KVConnector.get_num_new_matched_tokens``; such a request waits in
        ``waiting_remote`` for it). False (no change) when its pages cannot be freed, or
        ``remote_only`` and the connector has nothing; None when the connector does not know
        yet (the request stays queued, skipped)."""
        ps = self.page_size
        max_pages = (req.num_tokens - 1) // ps
        if req.return_logprob and req.logprob_start_len >= 0:
            max_pages = min(max_pages, max(0, req.logprob_start_len - 1) // ps)
        pages, node = self.prefix_cache.match_prefix(req.all_ids, max_pages=max_pages)
        external = 0
        if not req.output_ids and not (req.return_logprob and req.logprob_start_len >= 0):
            external = self.connector.get_num_new_matched_tokens(req, len(pages) * ps)
            if external is None:
                self.remote.not_yet.add(req.rid)
                return None
        self.remote.not_yet.discard(req.rid)
        if remote_only and not external:
            return False
        need = -(-req.num_tokens // ps) + 1 - len(pages)
        reserve = 0
        if external and RemoteKV.check_external(req, len(pages) * ps, external, ps):
            need -= 1                     # nothing is computed here: no page for a next token
            reserve = self.remote.reserved_decode_pages(req, self.running)
        self.prefix_cache.lock(node)
        # The decode reservation yields when nothing else holds pages (it could never fit).
        if not self._make_free(need + reserve) and (
                not reserve or self.running or self.remote.waiting or not self._make_free(need)):
            self.prefix_cache.unlock(node)
            return False
        req.prefix_node = node
        req.pages = list(pages)
        if external:
            self.remote.admit(req, external)
            return True
        req.start_running(len(pages) * ps)
        self.connector.update_state_after_alloc(req, 0)
        self.running.append(req)
        return True

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
            if admitted is None:
                i += 1
                continue
            if not admitted:
                return
            del self.waiting[i]

    def _schedule_prefill(self, budget: int, decode_rows: list[ScheduledRow]) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        candidates = [r for r in self.running if r.is_prefilling]
        targeted = bool(decode_rows) and self.config.target_itl_ms is not None \
            and self.cost_model is not None
        i = 0           # the next queued request to try (those the connector cannot answer yet stay)
        while budget > 0:
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
                if admitted is None:
                    i += 1
                    continue
                if not admitted:
                    break
                del self.waiting[i]
                if self.remote.owns(req):
                    continue          # its KV arrives first
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(budget, remaining, self.config.chunked_prefill_size)
            if targeted:
                n = fit_target(self.cost_model, self.config, decode_rows + rows, req, n,
                               first=not rows)
            if n < remaining and self.config.page_aligned_chunks:
                n = (req.num_computed_tokens + n) // self.page_size * self.page_size - req.num_computed_tokens
            if n <= 0 or not self._grow(req, req.num_computed_tokens + n):
                break
            rows.append(ScheduledRow(req, req.num_computed_tokens, n))
            self._share_computed(req, req.num_computed_tokens + n)
            budget -= n
            if n < remaining:
                break          # one chunked request at a time
        return rows

    def _share_computed(self, req: Request, num_tokens: int) -> None:
        """The full pages of ``req``'s first ``num_tokens`` tokens, which this step computes,
        join the prefix cache now: a request admitted later in this step, or after, reuses
        them instead of computing the same prefix again (in-batch prefix sharing; vLLM caches
        a block when it schedules it). A row of the same forward may attend to them: every
        model writes a layer's KV for all the forward's tokens before any token of that layer
        reads the cache (DESIGN.md §3, "Prefix cache")."""
        full = min(num_tokens // self.page_size, len(req.pages))
        if req.prefix_node is None or full <= self.num_shared_pages(req):
            return
        ids = req.all_ids[:full * self.page_size]
        if PENDING_TOKEN in ids:
            return
        node = self.prefix_cache.extend_locked(req.prefix_node, ids, req.pages[:full])
        if node is not None:
            req.prefix_node = node

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
                loaded = len(req.pages) * self.page_size
                req.start_running(req.num_cached_tokens)
                req.set_num_computed_tokens(loaded)
                req.set_reported_cached_tokens(loaded)
                self.running.append(req)
                self._share_computed(req, loaded)
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
        """``req``'s prompt KV is in its pages and its first output token is ``first``: it
        joins the running batch; the next decode step computes that token's KV (the prompt is
        never recomputed). Finished at once when that token stops it."""
        req.start_prebuilt(first.token_id, self.step_id)
        if req.return_logprob:
            req.append_logprobs(float(first.logprob or 0.0),
                                list(first.top_logprobs)[:req.top_logprobs_num])
        if first.cached_tokens is not None:
            req.set_reported_cached_tokens(first.cached_tokens)
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

    def num_shared_pages(self, req: Request) -> int:
        """How many of ``req.pages`` (from the first) belong to the prefix cache: the path
        its lock holds, the prefix it matched plus the full pages it shared while running."""
        return 0 if req.prefix_node is None else self.prefix_cache.num_path_pages(req.prefix_node)

    def evict_unlocked(self) -> int:
        """Evict every cached page no request holds; returns how many. For a failed step: the
        pages its rows shared at scheduling may never have been written, and once its requests
        are aborted nothing else tells them apart."""
        return self.prefix_cache.evict(self.prefix_cache.num_evictable_pages)

    # ------------------------------------------------------------------ accounting
    @property
    def num_used_pages(self) -> int:
        return self.config.num_pages - 1 - self.allocator.num_free

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless request-owned, cached and free pages partition the
        pool (counted from each side independently) and requests' pages are disjoint."""
        free = set(self.allocator.free_pages())
        cached = set(self.prefix_cache.cached_pages())
        assert not self.held.keys() & self.requests.keys(), "a held request is also scheduled"
        assert not {r.rid for r in self.running} & self.waiting_remote.keys(), \
            "a request waiting for its KV also runs"
        assert not {r.rid for r in self.waiting} & self.waiting_remote.keys(), \
            "a request waiting for its KV is also queued"
        owned: list[int] = list(self.connector.owned_pages())
        for r in [*self.running, *self.remote.requests()]:
            k = self.num_shared_pages(r)
            assert k >= r.num_cached_tokens // self.page_size, f"{r.rid}: matched pages not shared"
            assert set(r.pages[:k]) <= cached, f"{r.rid}: prefix pages not in the prefix cache"
            owned += r.pages[k:]
        owned_set = set(owned)
        assert len(owned_set) == len(owned), "a page is owned by two requests"
        assert not (owned_set & cached) and not (owned_set & free) and not (cached & free), \
            "page sets overlap"
        assert 0 not in owned_set | cached | free, "the null page escaped"
        total = len(owned_set) + len(cached) + len(free)
        assert owned_set | cached | free == set(range(1, self.config.num_pages)), \
            f"pages leaked: {self.config.num_pages - 1 - total} missing"
