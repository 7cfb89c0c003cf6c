"""The device half of ``EngineCore``'s step (DESIGN.md §3): build a scheduled batch's inputs
(flat token stream, sampling rows, grammar masks), dispatch its forward, draw split grammar rows
again once the step before is read, read a launched step's tokens into its requests, and feed
the cost model the forward's device time.

``EngineCore`` holds one ``ForwardStep``, built from what it uses (the runner, the buckets,
the scheduler, the cost model, the speculator, and the core's ``stop_check``,
``make_output`` and ``abort_request``); it owns the penalty slots and the dispatch counters.
``Launched`` is what one dispatch leaves in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from pdjax.constrained.grammar import bitmask_words
from pdjax.models.dp_attention import dp_collective_bytes
from pdjax.engine.prompt_logprobs import (apply_prompt_logprobs, dispatch_prompt_logprobs,
                                          wants_prompt_logprobs)
from pdjax.engine.speculative import (fill_verify_masks, resolve_verify_row,
                                      verify_sampling_rows)
from pdjax.engine_io import GenerateOutput
from pdjax.request import PENDING_TOKEN, Request
from pdjax.runner.device_sampler import (SamplingRow, StepOutputs, build_sampling_inputs,
                                         uses_penalties)
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import BucketKey
from pdjax.sched.dp_batch import rank_sizes, row_starts
from pdjax.sched.scheduled_batch import ScheduledBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Launched:
    """A step whose forward is dispatched and whose results are not read yet."""

    batch: ScheduledBatch
    key: BucketKey
    out: StepOutputs                             # on the device
    pending: list[tuple[int, Request, int]]      # (logits row, request, output index)
    row_of: dict[str, int]                       # rid -> logits row of its pending token
    prompt_lp: tuple | None                      # (wanted, device arrays) for prompt logprobs
    t_dispatch: float = 0.0                      # perf_counter when the dispatch returned
    num_placeholders: int = 0                    # input tokens read from the previous step
    t_start: float = 0.0                         # perf_counter when the dispatch began
    compiled: bool = False                       # a compile happened in the dispatch
    # Split grammar rows (overlap): their masks need the tokens of the step before, so they
    # are sampled again by ``sample_deferred`` from ``logits`` once that step is read.
    deferred: list[tuple[int, Request, SamplingRow]] = dataclasses.field(default_factory=list)
    logits: Any = None                           # [R, V] on the device while deferred rows wait
    has_grammar: bool = False                    # a pending token belongs to a grammar request
    verify: dict = dataclasses.field(default_factory=dict)   # row -> (ScheduledRow, logits span)


class ForwardStep:
    """``EngineCore``'s forward: launch, resample, read (see the module docstring).

    ``split_grammar_sampling()``: whether grammar rows whose input token is still on the
    device are drawn in a second dispatch (``EngineCore.split_grammar_sampling``).
    ``dispatch_hooks``: the core's list of callables ``(batch, key, device array,
    t_dispatch)`` run after each dispatch. ``eos_token_ids``: the model's and the tokenizer's.
    """

    def __init__(self, *, runner, buckets, scheduler, cost_model, speculator, model_cfg,
                 page_size: int, eos_token_ids: frozenset[int],
                 dispatch_hooks: list, split_grammar_sampling: Callable[[], bool],
                 stop_check: Callable, make_output: Callable, abort_request: Callable):
        self.runner, self.buckets, self.scheduler = runner, buckets, scheduler
        self.cost_model, self.speculator, self.model_cfg = cost_model, speculator, model_cfg
        self.page_size, self.eos_token_ids = page_size, eos_token_ids
        self.dispatch_hooks = dispatch_hooks
        self._split_grammar_sampling = split_grammar_sampling
        self.stop_check, self.make_output = stop_check, make_output
        self.abort_request = abort_request
        self.penalty_slots: dict[int, Request] = {}     # penalty slot -> request
        self.num_steps = 0                               # steps read
        self._last_forward_end_s = 0.0
        self.last_forward_device_s: float | None = None  # device time of the last forward read
        # Forwards dispatched while the previous one still ran on the device (the host's work
        # for the step was hidden behind it), and those dispatched after it had finished.
        self.num_overlapped_dispatches = 0
        self.num_exposed_dispatches = 0
        # Steps whose grammar rows were sampled in a second dispatch after the step before was
        # read (overlap kept), and grammar rows so sampled.
        self.num_grammar_split_steps = 0
        self.num_grammar_split_rows = 0
        # DP attention: bytes each device received in the forwards' DP gathers / scatters.
        self.dp_gather_bytes = 0

    def launch(self, batch: ScheduledBatch, prev: Launched | None,
                outputs: list[GenerateOutput]):
        """Build the metadata and sampling inputs of ``batch`` and dispatch its forward (not
        waited for); count its tokens in the scheduler. ``prev``: the step still in flight,
        whose device-resident tokens fill ``batch``'s placeholders. Returns
        ``(Launched, dispatch s)``."""
        rows = [BatchRow(r.token_ids, r.start, r.req.pages, 0 if r.is_verify else None)
                for r in batch.rows]
        max_pages = max(-(-(r.start + r.num_tokens) // self.page_size) for r in batch.rows)
        num_tokens, num_rows = batch.num_tokens, len(rows)
        if getattr(self.runner, "dp_size", 1) > 1:   # DP attention: one bucket, every rank
            num_tokens, num_rows = rank_sizes(rows, self.runner.jits.pages_per_rank)
        key = self.buckets.pick(batch.forward_mode, num_tokens, num_rows, max_pages,
                                ready=self.runner.ready_keys)
        fb = self.runner.make_batch(key, rows)
        prev_idx, sampling, deferred, verify = self._sampling_inputs(batch, rows, key, fb, prev,
                                                                     outputs)
        want_prompt_lp = any(wants_prompt_logprobs(r) for r in batch.rows)
        compiles = self.runner.compiles_after_warmup
        t1 = time.perf_counter()
        if prev is not None:
            if prev.out.tokens.is_ready():
                self.num_exposed_dispatches += 1
            else:
                self.num_overlapped_dispatches += 1
        out, hidden, logits = self.runner.forward(
            key, fb, sampling, prev_idx, prev.out.tokens if prev is not None else None,
            want_hidden=want_prompt_lp, want_logits=True)
        prompt_lp = (dispatch_prompt_logprobs(self.runner, batch, fb, hidden) if want_prompt_lp
                     else None)
        t2 = time.perf_counter()
        if getattr(self.runner, "dp_size", 1) > 1:
            self.dp_gather_bytes += dp_collective_bytes(self.model_cfg, key.num_tokens,
                                                        self.runner.hidden_itemsize)
        pending = self.scheduler.advance(batch)
        launched = Launched(batch, key, out, pending, {req.rid: i for i, req, _ in pending},
                             prompt_lp, t2, int((prev_idx >= 0).sum()), t1,
                             self.runner.compiles_after_warmup != compiles, deferred,
                             logits if deferred else None,
                             any(req.grammar is not None for _, req, _ in pending), verify)
        for hook in self.dispatch_hooks:     # a split step's forward ends with its logits
            hook(batch, key, logits if deferred else out.tokens, t2)
        return launched, t2 - t1

    def _sampling_inputs(self, batch: ScheduledBatch, rows: list[BatchRow], key, fb,
                         prev: Launched | None, outputs: list[GenerateOutput]):
        """The per-row inputs of ``batch``'s forward after its metadata ``fb``: ``prev_idx``
        (for each input token sampled by ``prev``, the step in flight, its row there; -1
        otherwise), the device sampling inputs (penalty slots, grammar masks, a verify row's
        rows), the grammar rows deferred to ``sample_deferred`` and the verify rows. A row
        whose sampling state fails is aborted (its output appended to ``outputs``) and left
        undrawn; the batch goes on. Returns ``(prev_idx, sampling, deferred, verify)``."""
        prev_idx = np.full(len(fb.input_ids), -1, np.int32)
        starts = row_starts(fb)      # DP attention: in its rank's segment
        samp_rows, failed, deferred = [], [], []
        verify = {}
        bitmask = None
        if any(row.samples and row.req.grammar is not None for row in batch.rows):
            bitmask = np.full((self.runner.logits_rows(key),
                               bitmask_words(self.model_cfg.vocab_size)), -1, np.int32)
        for i, row in enumerate(batch.rows):
            req = row.req
            for j, tok in enumerate(rows[i].input_ids):
                if tok == PENDING_TOKEN:     # sampled by the step in flight: resolved on device
                    prev_idx[int(starts[i]) + j] = prev.row_of[req.rid]
            if not row.samples:
                samp_rows.append(None)
                continue
            try:
                slot = self._penalty_slot(req) if uses_penalties(req.sampling_params) else 0
                row_params = SamplingRow.from_request(req, slot,
                                                     eos_token_ids=self.eos_token_ids)
                if req.grammar is not None and PENDING_TOKEN in req.output_ids:
                    if not self._split_grammar_sampling():
                        raise RuntimeError("grammar row scheduled while a token is pending")
                    # Its mask needs the token in flight: drawn by ``sample_deferred``.
                    deferred.append((i, req, row_params))
                    samp_rows.append(None)
                    continue
                if row.is_verify:           # the last rows: one logits row per token
                    start, stop = fb.logits_row_spans[i]
                    assert start == len(samp_rows)
                    if req.grammar is not None:
                        fill_verify_masks(req.grammar, row.draft_ids, bitmask[start:stop])
                    samp_rows += verify_sampling_rows(req, row.draft_ids, slot,
                                                      self.eos_token_ids)
                    verify[i] = (row, (start, stop))
                    continue
                if req.grammar is not None:
                    req.grammar.fill_bitmask(bitmask[i])
                samp_rows.append(row_params)
            except Exception as e:    # one request's bad state never fails the batch
                logger.exception("sampling failed for request %s", req.rid)
                failed.append((req, e))
                start, stop = fb.logits_row_spans[i]      # all its logits rows undrawn
                del samp_rows[start:]
                samp_rows += [None] * (stop - start)
        self._abort_failed(failed, outputs)
        sampling = build_sampling_inputs(samp_rows, self.runner.logits_rows(key), bitmask=bitmask,
                                         vocab_size=self.model_cfg.vocab_size)
        return prev_idx, sampling, deferred, verify

    def _abort_failed(self, failed: list[tuple[Request, Exception]],
                      outputs: list[GenerateOutput]) -> None:
        """Abort each request whose sampling state failed; its final output (with the error)
        goes to ``outputs``."""
        for req, e in failed:
            out = self.abort_request(req.rid, f"sampling failed: {e}")
            if out is not None:
                out.error = f"sampling failed: {e}"
                outputs.append(out)

    def sample_deferred(self, launched: Launched, outputs: list[GenerateOutput]) -> float:
        """Fill the masks of ``launched``'s deferred grammar rows from their matchers (which
        took the previous step's tokens) and dispatch their draw from the forward's logits
        (``ModelRunner.resample``); rows of requests that ended meanwhile are not drawn (their
        token is dropped when read). Returns the dispatch seconds."""
        R = self.runner.logits_rows(launched.key)
        bitmask = np.full((R, bitmask_words(self.model_cfg.vocab_size)), -1, np.int32)
        rows: list[SamplingRow | None] = [None] * R
        redo = np.zeros(R, bool)
        failed = []
        for i, req, row_params in launched.deferred:
            if req.is_finished or req.rid not in self.scheduler.requests:
                continue
            try:
                req.grammar.fill_bitmask(bitmask[i])
            except Exception as e:    # one request's bad state never fails the batch
                logger.exception("grammar mask failed for request %s", req.rid)
                failed.append((req, e))
                continue
            rows[i], redo[i] = row_params, True
        self._abort_failed(failed, outputs)
        t1 = time.perf_counter()
        if redo.any():
            sampling = build_sampling_inputs(rows, R, bitmask=bitmask,
                                             vocab_size=self.model_cfg.vocab_size)
            launched.out = self.runner.resample(launched.key.entry, launched.logits, sampling,
                                                launched.out, redo)
            self.num_grammar_split_steps += 1
            self.num_grammar_split_rows += int(redo.sum())
            t2 = time.perf_counter()
            key = dataclasses.replace(launched.key, entry="resample")
            for hook in self.dispatch_hooks:
                hook(launched.batch, key, launched.out.tokens, t2)
        launched.logits = None
        return time.perf_counter() - t1

    def complete(self, done: Launched) -> tuple[list[GenerateOutput], float]:
        """Read a launched step's results (blocks until its forward has run) and update and
        stream its requests; the one place tokens reach clients. Returns the outputs and the
        seconds spent waiting for the device."""
        t = time.perf_counter()
        tokens = np.asarray(done.out.tokens)
        self._observe_step_cost(done, time.perf_counter())
        reqs = [req for _, req, _ in done.pending]
        lps = tops = None
        if any(r.return_logprob for r in reqs):
            lps = np.asarray(done.out.token_logprob)
            if any(r.top_logprobs_num > 0 for r in reqs):
                tops = (np.asarray(done.out.top_ids), np.asarray(done.out.top_logprobs))
        if done.prompt_lp is not None:
            apply_prompt_logprobs(*done.prompt_lp)
        emitted = np.asarray(done.out.emitted) if done.verify else None
        fetch_s = time.perf_counter() - t
        outputs: list[GenerateOutput] = []
        for i, req, index in done.pending:
            if i in done.verify:
                out = resolve_verify_row(self, done.verify[i], index, tokens, emitted, lps, tops)
                if out is not None:
                    outputs.append(out)
                continue
            token = int(tokens[i])
            if not self.scheduler.resolve(req, index, token, self.stop_check):
                if req.is_finished or req.rid not in self.scheduler.requests:
                    continue              # aborted (or finished) while the step ran
            lp, top = [], []
            if req.return_logprob:
                lp = [float(lps[i])]
                k = req.top_logprobs_num
                top = [[(int(a), float(b)) for a, b in zip(tops[0][i, :k], tops[1][i, :k])]
                       if k > 0 else []]
                req.append_logprobs(lp[0], top[0])
            outputs.append(self.make_output(req, [token], lp, top, num_output=index + 1))
        self.num_steps += 1
        return outputs, fetch_s

    def _observe_step_cost(self, done: Launched, t_done: float) -> None:
        """Feed the cost model the device time of ``done``'s forward: from when the device could
        start it (its dispatch, or the previous forward's end) to when its tokens came back.
        The end is exact when the read had to wait; a forward that had
        already finished when read gets the read time, an upper bound (the cost model then errs
        on the slow side). A compile is no step time."""
        start = max(done.t_start, self._last_forward_end_s)
        self._last_forward_end_s = t_done
        self.last_forward_device_s = None
        if done.compiled:
            return
        self.last_forward_device_s = t_done - start
        self.cost_model.observe(done.key, done.batch.num_tokens, done.batch.num_cached_tokens,
                                t_done - start, done.batch.num_chunk_pairs)

    def _penalty_slot(self, req: Request) -> int:
        """``req``'s penalty slot; a new one (set from its known tokens) if it has none. A slot
        whose request is not running is reused: at most ``max_running_requests`` requests run,
        so one is always there."""
        for slot, owner in self.penalty_slots.items():
            if owner is req:
                return slot
        running = set(map(id, self.scheduler.running))
        slot = next((s for s in range(1, self.runner.num_penalty_slots)
                     if s not in self.penalty_slots or id(self.penalty_slots[s]) not in running),
                    None)
        if slot is None:
            raise RuntimeError("no free penalty slot")
        if PENDING_TOKEN in req.output_ids:
            raise RuntimeError(f"request {req.rid}: penalty slot needed while a token is pending")
        self.penalty_slots[slot] = req
        self.runner.init_penalty_slot(slot, req.prompt_ids, req.output_ids)
        return slot


def seed_cost_model(runner, buckets, cost_model) -> int:
    """Time one empty forward of every bucket a mixed step may use (already compiled by
    warm-up) on ``runner``, so ``cost_model`` has data before the first request. Returns the
    number of forwards timed."""
    keys = {buckets.pick("mixed", t, 1, p) for t in buckets.token_buckets
            for p in buckets.pages_per_seq_buckets}
    for key in sorted(keys, key=repr):
        fb = runner.make_batch(key, [])
        t0 = time.perf_counter()
        out, _ = runner.forward(key, fb)
        jax.block_until_ready(out.tokens)
        cost_model.observe(key, 0, 0, time.perf_counter() - t0)
    return len(keys)
