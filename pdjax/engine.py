"""The engine every role runs: ``EngineCore`` (one step = schedule, launch the forward, which
samples on the device, then read a step's results and update; overlapped by default),
the offline ``Engine`` in the style of ``sglang.Engine`` / ``vllm.LLM``, and ``AsyncEngine``,
which runs the core on its own thread for the HTTP server (DESIGN.md §3).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from typing import Any, AsyncIterator

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.config import ServerArgs
from pdjax.constrained.grammar import bitmask_words
from pdjax.distributed import join as join_cluster
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.engine_roles import EngineRole
from pdjax.jax_setup import enable_compilation_cache
from pdjax.models.loader import load_model, load_tokenizer, make_mesh, resolve_dtype, resolve_model_path
from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl
from pdjax.request import PENDING_TOKEN, Request, SamplingParams
from pdjax.runner.device_sampler import (MAX_TOP_LOGPROBS, SamplingRow, StepOutputs,
                                         build_sampling_inputs, uses_penalties)
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import BucketKey, Buckets
from pdjax.sched.cost_model import StepCostModel
from pdjax.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pdjax.transfer.factory import create_engine_role

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def kv_cache_dtype(args: ServerArgs, model_dtype):
    return {"auto": model_dtype, "float32": jnp.float32, "bfloat16": jnp.bfloat16,
            "fp8_e4m3": jnp.float8_e4m3fn}[args.kv_cache_dtype]


@dataclasses.dataclass
class _Launched:
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
    # are sampled again by ``_sample_deferred`` from ``logits`` once that step is read.
    deferred: list[tuple[int, Request, SamplingRow]] = dataclasses.field(default_factory=list)
    logits: Any = None                           # [R, V] on the device while deferred rows wait
    has_grammar: bool = False                    # a pending token belongs to a grammar request


class EngineCore:
    """Model, scheduler and runner of one server; single-threaded (call from one thread).

    ``step()`` returns the ``GenerateOutput`` increments of every request that got a token or
    finished in the step whose results it read. Overlapped scheduling (default; off with
    ``disable_overlap_schedule``, and for the prefill role, whose requests all end after one
    token): ``step()`` schedules and launches step N+1 while step N still runs on the device,
    then reads step N's tokens (DESIGN.md §3).

    ``background_compile`` (the server's ``AsyncEngine``): warm-up compiles the core shapes
    (``Buckets.core_keys``) and returns; the other shapes compile on a background thread and
    each batch runs on the smallest shape compiled so far (``ModelRunner.warmup(core_only)``).
    Off (the offline ``Engine``): every shape is compiled before the constructor returns.
    ``tokenizer``: a callable returning the tokenizer, called after the model is loaded (the
    server's ``AsyncEngine`` loads it on another thread meanwhile); default ``load_tokenizer``.
    """

    def __init__(self, args: ServerArgs, *, progress: bool = True, background_compile: bool = False,
                 tokenizer=None):
        # Seconds of each start-up phase, in order (printed as one line; bench_startup reads it).
        self.startup_phases_s: dict[str, float] = {}
        t_phase = time.monotonic()

        def phase(name: str) -> None:
            nonlocal t_phase
            now = time.monotonic()
            self.startup_phases_s[name] = round(now - t_phase, 2)
            t_phase = now

        enable_compilation_cache()
        self.args = args
        # Multi-host (--nnodes > 1): JAX's distributed runtime, the nodes checked (DESIGN.md §6).
        self.cluster = join_cluster(args)
        self.model_path = resolve_model_path(args.model_path, args.revision)
        mesh = make_mesh(args.tp_size)
        phase("backend")
        self.model_cfg, model = load_model(
            self.model_path, dtype=args.dtype, mesh=mesh, progress=progress,
            attention_impl=args.attention_backend, interpret=args.pallas_interpret)
        phase("model")
        self.tokenizer = (tokenizer() if tokenizer is not None
                          else load_tokenizer(args.tokenizer_path or self.model_path))
        phase("tokenizer")
        context = min(args.context_length or self.model_cfg.max_position_embeddings,
                      self.model_cfg.max_position_embeddings if args.context_length is None
                      else args.context_length)
        self.sched_config = SchedulerConfig(
            num_pages=args.num_pages, page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
            enable_mixed_chunk=args.enable_mixed_chunk,
            disable_radix_cache=args.disable_radix_cache, max_context_len=context,
            page_aligned_chunks=args.role == "prefill",
            max_num_batched_tokens=args.max_num_batched_tokens, target_itl_ms=args.target_itl_ms)
        self.scheduler = Scheduler(self.sched_config)
        self.context_length = self.scheduler.max_request_tokens
        self.buckets = Buckets.create(
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            max_pages_per_seq=-(-self.context_length // args.page_size),
            max_num_batched_tokens=args.max_num_batched_tokens,
            traced_pages_bound=resolve_impl(args.attention_backend)
            in getattr(model, "TRACED_PAGES_BOUND_IMPLS", ()))
        # Fitted from every timed forward; the scheduler plans with it under target_itl_ms.
        self.cost_model = StepCostModel(self.buckets.pick, self.buckets.token_buckets,
                                        token_scale=self.buckets.token_buckets[-1],
                                        cached_scale=self.context_length)
        self.scheduler.cost_model = self.cost_model
        kv_dtype = kv_cache_dtype(args, resolve_dtype(args.dtype))
        self.runner = ModelRunner(model, mesh, num_pages=args.num_pages, page_size=args.page_size,
                                  kv_dtype=kv_dtype, buckets=self.buckets,
                                  chunk_size=args.chunked_prefill_size)
        phase("kv_cache")
        if self.cluster is not None:
            self.runner = self.cluster.mirror(self.runner)
            if not self.cluster.is_leader:
                return      # a follower only makes node 0's runner calls (Cluster.follow)
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._rng = random.Random(args.random_seed)
        self._zero_token_reqs: list[Request] = []
        self.num_steps = 0
        self.host_time_s = 0.0        # scheduling + batch building + sampling
        self.forward_time_s = 0.0
        self.step_hooks: list = []    # callables(batch, outputs) after each step (metrics)
        # callables(batch, key, device array, t_dispatch) after each dispatch (device timelines,
        # benchmarks): the sampled tokens; for a split grammar step, the forward's logits and
        # then the resample's tokens (key.entry "resample").
        self.dispatch_hooks: list = []
        self.overlap = not args.disable_overlap_schedule and args.role != "prefill"
        self._inflight: _Launched | None = None
        self._last_forward_end_s = 0.0
        self.last_forward_device_s: float | None = None    # device time of the last forward read
        # Forwards dispatched while the previous one still ran on the device (the host's work
        # for the step was hidden behind it), and those dispatched after it had finished.
        self.num_overlapped_dispatches = 0
        self.num_exposed_dispatches = 0
        self._penalty_slots: dict[int, Request] = {}     # penalty slot -> request
        self._grammar_backend = None                     # built on first use (grammar_backend)
        self._grammar_lock = threading.Lock()
        # Steps whose grammar rows were sampled in a second dispatch after the step before was
        # read (overlap kept), and grammar rows so sampled.
        self.num_grammar_split_steps = 0
        self.num_grammar_split_rows = 0
        self.num_grammar_syncs = 0    # steps that read the step in flight first (no split)
        # background_compile (the server): only the core shapes before ready, the rest on a
        # background thread; requests meanwhile pad to a compiled shape (never compile). The
        # ITL target plans with every token bucket's timing, so it waits for all of them.
        self.warmup_s = self.runner.warmup(
            progress=progress and not args.skip_warmup_progress,
            split_sampling=self.overlap and args.grammar_backend != "none",
            # Multi-host: no background compiles (their first runs would be node 0's alone).
            core_only=background_compile and args.target_itl_ms is None and self.cluster is None)
        phase("warmup")
        if args.target_itl_ms is not None:
            self.seed_cost_model()
            phase("seed_cost_model")
        line = ", ".join(f"{k} {v:.1f}" for k, v in self.startup_phases_s.items())
        logger.info("start-up phases (s): %s", line)
        print(f"pdjax start-up phases (s): {line}", flush=True)
        # PD disaggregation (DESIGN.md §4): the role called at fixed points of the step
        # (pdjax/engine_roles.py); this core is its RoleHost.
        self.disagg: EngineRole | None = create_engine_role(self)

    # ------------------------------------------------------------------ grammars
    @property
    def split_grammar_sampling(self) -> bool:
        """Whether grammar rows whose input token is still on the device are sampled in a
        second dispatch (overlap, with the resample executables warm-up compiled when the
        engine started with overlap and a grammar backend; DESIGN.md §3, "Grammars")."""
        return self.overlap and bool(self.runner.resample_rows)

    @property
    def grammar_backend(self):
        """The ``GrammarBackend`` of this model's tokenizer, vocabulary and EOS ids, built on
        first use (converting the tokenizer takes about 1 s for 50k tokens). Thread-safe: the
        server compiles grammars from worker threads (``compile_grammar``)."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                from pdjax.constrained.grammar import GrammarBackend

                self._grammar_backend = GrammarBackend(
                    self.tokenizer, self.model_cfg.vocab_size, sorted(self.eos_token_ids))
            return self._grammar_backend

    def compile_grammar(self, spec) -> None:
        """Compile ``spec`` into the backend's cache; ``ValueError`` naming its field (also
        when ``grammar_backend`` is ``none``)."""
        self._check_grammar_enabled(spec)
        self.grammar_backend.compile(spec)

    def _check_grammar_enabled(self, spec) -> None:
        if self.args.grammar_backend == "none":
            raise ValueError(f"{spec.field}: structured outputs are disabled on this server "
                             f"(--grammar-backend none)")

    # ------------------------------------------------------------------ requests
    def add_request(self, g: GenerateRequest) -> Request:
        """Queue a request; ``ValueError`` (naming the problem) if it cannot be served."""
        if not g.input_ids:
            raise ValueError("input_ids: the prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in g.input_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]!r} is outside [0, {vocab})")
        g.sampling_params.check_logit_bias_ids(vocab)
        if not 0 <= g.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {g.top_logprobs_num}")
        req = Request(rid=g.rid, prompt_ids=list(g.input_ids), sampling_params=g.sampling_params,
                      return_logprob=g.return_logprob, top_logprobs_num=g.top_logprobs_num,
                      logprob_start_len=g.logprob_start_len if g.return_logprob else -1)
        sp = g.sampling_params
        req.seed_for_sampling = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        if sp.grammar is not None:
            self._check_grammar_enabled(sp.grammar)
            req.grammar = self.grammar_backend.matcher(sp.grammar)
        if self.disagg is not None and self.disagg.add_request(g, req):
            return req                # PD: the role's manager schedules it later
        self.scheduler.add_request(req)
        if sp.max_new_tokens == 0 and not req.return_logprob:
            self._zero_token_reqs.append(req)
        return req

    @property
    def has_work(self) -> bool:
        """Whether ``step()`` has something to do (scheduled requests, a step in flight, or PD
        events)."""
        return (self.scheduler.has_work or self._inflight is not None
                or (self.disagg is not None and self.disagg.has_work()))

    def abort_request(self, rid: str, message: str = "aborted by client") -> GenerateOutput | None:
        if self.disagg is not None:
            out = self.disagg.abort(rid, message)
            if out is not None:
                return out
        req = self.scheduler.abort_request(rid, message)
        return None if req is None else self.make_output(req, [], [], [])

    def wait_for_device(self) -> None:
        """Block until the step in flight (if any) has run: afterwards no forward still writes
        pages a finish or abort released (PD decode calls this before handing pages to a
        transfer)."""
        if self._inflight is not None:
            self.wait_for_kv()

    def wait_for_kv(self) -> None:
        """Block until every KV write dispatched so far has landed in the cache (PD prefill,
        before a transfer reads the pages from outside the device stream)."""
        jax.block_until_ready(self.runner.caches)

    def drain(self) -> list[GenerateOutput]:
        """Read the step in flight, if any, without launching another; returns its outputs."""
        done, self._inflight = self._inflight, None
        if done is None:
            return []
        outputs, fetch_s = self._complete(done)
        if self.disagg is not None:
            outputs = self.disagg.after_step(done.batch, outputs)
        self.forward_time_s += fetch_s
        for hook in self.step_hooks:
            hook(done.batch, outputs)
        return outputs

    # ------------------------------------------------------------------ the step
    def step(self) -> list[GenerateOutput]:
        t0 = time.perf_counter()
        waited = 0.0
        try:
            outputs: list[GenerateOutput] = []
            done = None
            if self._inflight is not None and self._inflight.has_grammar \
                    and not self.split_grammar_sampling:
                # No resample executables (overlap turned on after start-up): the masks of the
                # next step need the tokens of the step in flight, so read it first.
                done, self._inflight = self._inflight, None
                self.num_grammar_syncs += 1
                done_outputs, fetch_s = self._complete(done)
                outputs += done_outputs
                waited += fetch_s
            if self.disagg is not None:
                outputs += self.disagg.poll()
            while self._zero_token_reqs:       # max_new_tokens = 0: done without a forward
                req = self._zero_token_reqs.pop()
                if self.scheduler.abort_request(req.rid) is not None:
                    req.finish_reason = {"type": "length", "length": 0}
                    outputs.append(self.make_output(req, [], [], []))
            batch = self.scheduler.schedule()
            # Requests the scheduler finished without a forward (a lone decode request the pool
            # cannot grow) still owe their client a final output.
            outputs += [self.make_output(req, [], [], []) for req in self.scheduler.pop_finished()]
            launched = None
            if batch is not None:
                launched, dispatch_s = self._launch(batch, outputs)
                waited += dispatch_s
            if done is not None:          # read already; the new step stays in flight
                self._inflight = launched
            else:
                if self.overlap:
                    done, self._inflight = self._inflight, launched
                else:
                    done = launched
                if done is not None:
                    done_outputs, fetch_s = self._complete(done)
                    outputs += done_outputs
                    waited += fetch_s
            if launched is not None and launched.deferred:
                # The step before is read and its tokens taken by the matchers: fill the masks
                # while the new forward runs, then sample its grammar rows.
                waited += self._sample_deferred(launched, outputs)
            if self.disagg is not None and (done is not None or outputs):
                # batch None: no forward's results were read, but requests may have finished.
                outputs = self.disagg.after_step(done.batch if done is not None else None, outputs)
        except BaseException:
            self._inflight = None
            raise
        # Forward time: dispatching and waiting for the device; host time: the rest.
        self.forward_time_s += waited
        self.host_time_s += max(0.0, time.perf_counter() - t0 - waited)
        if done is not None:
            for hook in self.step_hooks:
                hook(done.batch, outputs)
        return outputs

    def _launch(self, batch: ScheduledBatch, outputs: list[GenerateOutput]):
        """Build the metadata and sampling inputs of ``batch`` and dispatch its forward (not
        waited for); count its tokens in the scheduler. Returns ``(_Launched, dispatch s)``."""
        prev = self._inflight
        rows = [BatchRow(r.token_ids, r.start, r.req.pages) for r in batch.rows]
        max_pages = max(-(-(r.start + r.num_tokens) // self.args.page_size) for r in batch.rows)
        key = self.buckets.pick(batch.forward_mode, batch.num_tokens, len(rows), max_pages,
                                ready=self.runner.ready_keys)
        fb = self.runner.make_batch(key, rows)
        prev_idx = np.full(key.num_tokens, -1, np.int32)
        samp_rows, failed, deferred = [], [], []
        bitmask = None
        if any(row.samples and row.req.grammar is not None for row in batch.rows):
            bitmask = np.full((key.num_rows, bitmask_words(self.model_cfg.vocab_size)), -1,
                              np.int32)
        for i, row in enumerate(batch.rows):
            req = row.req
            for j, tok in enumerate(rows[i].input_ids):
                if tok == PENDING_TOKEN:     # sampled by the step in flight: resolved on device
                    prev_idx[int(fb.cu_q_lens[i]) + j] = prev.row_of[req.rid]
            if not row.samples:
                samp_rows.append(None)
                continue
            try:
                slot = self._penalty_slot(req) if uses_penalties(req.sampling_params) else 0
                row_params = SamplingRow.from_request(req, slot)
                if req.grammar is not None and PENDING_TOKEN in req.output_ids:
                    if not self.split_grammar_sampling:
                        raise RuntimeError("grammar row scheduled while a token is pending")
                    # Its mask needs the token in flight: drawn by ``_sample_deferred``.
                    deferred.append((i, req, row_params))
                    samp_rows.append(None)
                    continue
                if req.grammar is not None:
                    req.grammar.fill_bitmask(bitmask[i])
                samp_rows.append(row_params)
            except Exception as e:    # one request's bad state never fails the batch
                logger.exception("sampling failed for request %s", req.rid)
                failed.append((req, e))
                samp_rows.append(None)
        for req, e in failed:
            out = self.abort_request(req.rid, f"sampling failed: {e}")
            if out is not None:
                out.error = f"sampling failed: {e}"
                outputs.append(out)
        sampling = build_sampling_inputs(samp_rows, key.num_rows, bitmask=bitmask,
                                         vocab_size=self.model_cfg.vocab_size)
        want_prompt_lp = any(self._wants_prompt_logprobs(r) for r in batch.rows)
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
        prompt_lp = self._prompt_logprobs(batch, fb, hidden) if want_prompt_lp else None
        t2 = time.perf_counter()
        pending = self.scheduler.advance(batch)
        launched = _Launched(batch, key, out, pending, {req.rid: i for i, req, _ in pending},
                             prompt_lp, t2, int((prev_idx >= 0).sum()), t1,
                             self.runner.compiles_after_warmup != compiles, deferred,
                             logits if deferred else None,
                             any(req.grammar is not None for _, req, _ in pending))
        for hook in self.dispatch_hooks:     # a split step's forward ends with its logits
            hook(batch, key, logits if deferred else out.tokens, t2)
        return launched, t2 - t1

    def _sample_deferred(self, launched: _Launched, outputs: list[GenerateOutput]) -> float:
        """Fill the masks of ``launched``'s deferred grammar rows from their matchers (which
        took the previous step's tokens) and dispatch their draw from the forward's logits
        (``ModelRunner.resample``); rows of requests that ended meanwhile are not drawn (their
        token is dropped when read). Returns the dispatch seconds."""
        R = launched.key.num_rows
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
        for req, e in failed:
            out = self.abort_request(req.rid, f"sampling failed: {e}")
            if out is not None:
                out.error = f"sampling failed: {e}"
                outputs.append(out)
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

    def _complete(self, done: _Launched) -> tuple[list[GenerateOutput], float]:
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
            self._apply_prompt_logprobs(*done.prompt_lp)
        fetch_s = time.perf_counter() - t
        outputs: list[GenerateOutput] = []
        for i, req, index in done.pending:
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
                req.output_logprobs.append(lp[0])
                req.output_top_logprobs.append(top[0])
            outputs.append(self.make_output(req, [token], lp, top, num_output=index + 1))
        self.num_steps += 1
        return outputs, fetch_s

    def _observe_step_cost(self, done: _Launched, t_done: float) -> None:
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
                                t_done - start)

    def _penalty_slot(self, req: Request) -> int:
        """``req``'s penalty slot; a new one (set from its known tokens) if it has none. A slot
        whose request is not running is reused: at most ``max_running_requests`` requests run,
        so one is always there."""
        for slot, owner in self._penalty_slots.items():
            if owner is req:
                return slot
        running = set(map(id, self.scheduler.running))
        slot = next((s for s in range(1, self.runner.num_penalty_slots)
                     if s not in self._penalty_slots or id(self._penalty_slots[s]) not in running),
                    None)
        if slot is None:
            raise RuntimeError("no free penalty slot")
        if PENDING_TOKEN in req.output_ids:
            raise RuntimeError(f"request {req.rid}: penalty slot needed while a token is pending")
        self._penalty_slots[slot] = req
        self.runner.init_penalty_slot(slot, req.prompt_ids, req.output_ids)
        return slot

    def seed_cost_model(self) -> int:
        """Time one empty forward of every bucket a mixed step may use (already compiled by
        warm-up), so the cost model has data before the first request. Returns the number of
        forwards timed."""
        keys = {self.buckets.pick("mixed", t, 1, p) for t in self.buckets.token_buckets
                for p in self.buckets.pages_per_seq_buckets}
        for key in sorted(keys, key=repr):
            fb = self.runner.make_batch(key, [])
            t0 = time.perf_counter()
            out, _ = self.runner.forward(key, fb)
            jax.block_until_ready(out.tokens)
            self.cost_model.observe(key, 0, 0, time.perf_counter() - t0)
        return len(keys)

    def stop_check(self, req: Request) -> dict | None:
        """The finish reason after ``req``'s newest token, or None; a grammar request's matcher
        takes the token here (once per token): a grammar that admits nothing more stops the
        request (``matched`` None: the token is part of the answer)."""
        sp = req.sampling_params
        tok = req.output_ids[-1]
        if req.grammar is not None and not req.grammar.accept(tok):
            req.error = f"grammar: token {tok} was not allowed ({req.grammar.error})"
            return {"type": "abort", "message": req.error}
        if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if req.grammar is not None and req.grammar.is_terminated:
            return {"type": "stop", "matched": None}
        if sp.max_new_tokens is not None and len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    @staticmethod
    def _wants_prompt_logprobs(row) -> bool:
        req = row.req
        # ">=": a chunk's last position predicts the next chunk's first token, which is the
        # first one wanted when logprob_start_len sits on the chunk boundary.
        return (req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids
                and row.start + row.num_tokens >= req.logprob_start_len)

    def _prompt_logprobs(self, batch: ScheduledBatch, fb, hidden):
        """Dispatch the logprobs of prompt tokens p >= logprob_start_len (from the logits at
        p - 1) on the device; returns ``(wanted, device arrays)`` for ``_apply_prompt_logprobs``.
        ``wanted``: (req, position p or None for position 0's empty entry)."""
        wanted, rows = [], []     # rows: flat row of position p - 1
        for i, row in enumerate(batch.rows):
            if not self._wants_prompt_logprobs(row):
                continue
            req, s, n = row.req, row.start, row.num_tokens
            lo = max(req.logprob_start_len, s)
            for p in range(lo, min(s + n, req.num_prompt_tokens)):
                if p == 0:
                    wanted.append((req, None))
                elif p - 1 >= s:
                    wanted.append((req, p))
                    rows.append(int(fb.cu_q_lens[i]) + p - 1 - s)
                else:
                    # p - 1 lies in the previous chunk: its logits were taken then.
                    pass
            # The next chunk's first token is predicted by this chunk's last position.
            p = s + n
            if p < req.num_prompt_tokens and p >= req.logprob_start_len:
                wanted.append((req, p))
                rows.append(int(fb.cu_q_lens[i]) + n - 1)
        if not rows:
            return wanted, None
        targets = [req.prompt_ids[p] for req, p in wanted if p is not None]
        want_top = any(req.top_logprobs_num > 0 for req, _ in wanted)
        return wanted, self.runner.prompt_logprobs_at(hidden, rows, targets, want_top)

    @staticmethod
    def _apply_prompt_logprobs(wanted, arrays) -> None:
        if arrays is not None:
            lp, ids, vals = (np.asarray(a) for a in arrays)
        j = 0
        for req, p in wanted:
            if p is None:
                req.prompt_logprobs.append(None)
                req.prompt_top_logprobs.append(None)
                continue
            k = min(req.top_logprobs_num, ids.shape[1])
            req.prompt_logprobs.append(float(lp[j]))
            req.prompt_top_logprobs.append([(int(a), float(b)) for a, b in zip(ids[j, :k], vals[j, :k])])
            j += 1

    def make_output(self, req: Request, tokens, lps, tops,
                    num_output: int | None = None) -> GenerateOutput:
        """The ``GenerateOutput`` increment of ``req`` carrying ``tokens`` (and their logprobs
        ``lps`` / top logprobs ``tops``); the PD decode role builds its outputs with it too.
        ``num_output``: the request's output tokens up to this increment (default: all of
        ``output_ids``; a placeholder of a later step in flight is not one)."""
        if num_output is None:
            num_output = len(req.output_ids)
        first = num_output <= len(tokens)
        send_prompt_lp = req.return_logprob and req.logprob_start_len >= 0 and first
        return GenerateOutput(
            rid=req.rid, new_token_ids=list(tokens), new_logprobs=list(lps),
            new_top_logprobs=list(tops),
            prompt_logprobs=list(req.prompt_logprobs) if send_prompt_lp else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if send_prompt_lp else None,
            finished=req.is_finished, finish_reason=req.finish_reason if req.is_finished else None,
            prompt_tokens=req.num_prompt_tokens, completion_tokens=num_output,
            cached_tokens=req.num_cached_tokens_reported, error=req.error)

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        if self.scheduler.running or self.scheduler.waiting:
            return False
        return self.scheduler.prefix_cache.reset()

    def get_load(self) -> dict[str, Any]:
        """Queue sizes and pages. ``kv_usage``: the share of the pool that is not free and
        not evictable prefix cache (what new requests cannot get), in [0, 1]."""
        s = self.scheduler
        total = s.config.num_pages - 1
        pinned = s.num_used_pages - s.prefix_cache.num_evictable_pages
        return {"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                "num_used_pages": s.num_used_pages, "num_total_pages": total,
                "num_cached_pages": s.prefix_cache.num_cached_pages,
                "kv_usage": pinned / total, **self._pd_load()}

    def _pd_load(self) -> dict[str, Any]:
        """PD fields of ``get_load``: pages nothing can evict (a finished PD server must show
        0), prompt tokens computed (decode: stays 0), and the role manager's queue sizes."""
        if self.disagg is None:
            return {}
        s = self.scheduler
        return {"num_evictable_pages": s.prefix_cache.num_evictable_pages,
                "num_pinned_pages": s.num_used_pages - s.prefix_cache.num_evictable_pages,
                "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
                **self.disagg.load()}


def _sampling_params(sp) -> SamplingParams:
    if isinstance(sp, SamplingParams):
        return dataclasses.replace(sp)
    return SamplingParams.from_dict(sp)


class Engine:
    """Offline engine in the style of ``sglang.Engine``: ``Engine(model_path=None,
    dtype="auto", **server_args)``; no path serves the default SmolLM2 model. Besides the
    ``ServerArgs`` fields: ``progress`` (warm-up progress bar) and ``background_compile``
    (``EngineCore``; default False: every shape compiled before the constructor returns).

    ``generate(prompt | list of prompts, sampling_params, input_ids=...)`` returns a dict (one
    prompt) or a list of dicts with ``text``, ``output_ids`` and ``meta_info``
    (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``, and
    logprobs when asked). ``n > 1`` gives ``n`` results per prompt, prompt-major.
    """

    def __init__(self, model_path: str | None = None, dtype: str = "auto", **server_args):
        progress = server_args.pop("progress", True)
        background_compile = server_args.pop("background_compile", False)
        self.args = ServerArgs(model_path=model_path, dtype=dtype, **server_args)
        self.core = EngineCore(self.args, progress=progress, background_compile=background_compile)
        self.tokenizer = self.core.tokenizer

    def generate(self, prompt=None, sampling_params=None, input_ids=None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int = 0):
        from pdjax.detokenizer import IncrementalDetokenizer, trim_matched_stop_token

        single = isinstance(prompt, str) or (input_ids is not None and input_ids
                                             and isinstance(input_ids[0], int))
        if prompt is not None and input_ids is not None:
            raise ValueError("pass either prompt or input_ids, not both")
        if input_ids is None:
            if prompt is None:
                raise ValueError("prompt: no prompt given")
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids_list = [input_ids] if single else list(input_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
        if len(sps) != len(ids_list):
            raise ValueError("sampling_params: list length differs from the number of prompts")
        core = self.core
        order, state = [], {}
        for ids, sp in zip(ids_list, sps):
            sp = _sampling_params(sp or {})
            for k in range(sp.n):
                rid = uuid.uuid4().hex
                one = dataclasses.replace(sp, n=1)
                if sp.n > 1 and sp.seed is not None:
                    one = dataclasses.replace(one, seed=sp.seed + k)
                g = GenerateRequest(rid, list(ids), one, return_logprob=return_logprob,
                                    top_logprobs_num=top_logprobs_num,
                                    logprob_start_len=-1 if logprob_start_len is None else logprob_start_len)
                core.add_request(g)
                order.append(rid)
                state[rid] = {"ids": [], "lps": [], "tops": [], "prompt_lps": None,
                              "out": None, "detok": IncrementalDetokenizer(
                                  self.tokenizer, stop=one.stop,
                                  skip_special_tokens=one.skip_special_tokens, prompt_ids=ids),
                              "text": "", "finish": None}
        pending = set(order)
        while pending:
            for out in core.step():
                st = state.get(out.rid)
                if st is None or out.rid not in pending:
                    continue
                st["ids"] += out.new_token_ids
                st["lps"] += out.new_logprobs
                st["tops"] += out.new_top_logprobs
                if out.prompt_logprobs is not None:
                    st["prompt_lps"] = (out.prompt_logprobs, out.prompt_top_logprobs)
                st["out"] = out
                new_ids = out.new_token_ids
                if out.finished:       # the matched EOS / stop token is not part of the text
                    new_ids = trim_matched_stop_token(new_ids, out.finish_reason)
                delta = st["detok"].add_tokens(new_ids)
                st["text"] += delta.text
                if delta.stop_matched is not None and not out.finished:
                    core.abort_request(out.rid)
                    st["finish"] = {"type": "stop", "matched": delta.stop_matched}
                    pending.discard(out.rid)
                    continue
                if out.finished:
                    st["text"] += st["detok"].finish().text
                    st["finish"] = out.finish_reason
                    pending.discard(out.rid)
        core.drain()      # the step in flight holds only rows of finished requests
        results = [self._result(rid, state[rid], return_logprob) for rid in order]
        return results[0] if single and len(results) == 1 else results

    def _result(self, rid, st, return_logprob) -> dict:
        out = st["out"]
        meta = {"id": rid, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(st["ids"]),
                "cached_tokens": out.cached_tokens, "finish_reason": st["finish"]}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(st["lps"], st["ids"])]
            meta["output_top_logprobs"] = [[(lp, t, None) for t, lp in top] for top in st["tops"]]
            if st["prompt_lps"] is not None:
                meta["input_token_logprobs"] = st["prompt_lps"][0]
                meta["input_top_logprobs"] = st["prompt_lps"][1]
        return {"text": st["text"], "output_ids": st["ids"], "meta_info": meta}

    def shutdown(self) -> None:
        """Drop every request and free the device state."""
        for rid in list(self.core.scheduler.requests):
            self.core.abort_request(rid)
        self.core.runner.caches = {}
        if self.core.cluster is not None:
            self.core.cluster.close()
        self.core = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.core is not None:
            self.shutdown()


class AsyncEngine:
    """``EngineCore`` on its own thread, for the HTTP server (never on the event loop).

    ``start()`` loads and warms up in the background; ``is_ready`` turns True after warm-up.
    ``generate(req)`` is an async generator of ``GenerateOutput`` increments, pushed from the
    engine thread into the caller's loop with ``call_soon_threadsafe`` (never polled); leaving
    it early (client disconnect) aborts the request and frees its pages.
    """

    def __init__(self, args: ServerArgs, *, progress: bool = True):
        self.args = args
        self.model_path = resolve_model_path(args.model_path, args.revision)
        self.served_model_name = args.served_model_name or args.model_path or DEFAULT_SERVED_MODEL_NAME
        # Loaded on its own thread (a GGUF's tokenizer is converted on the first start, seconds
        # of Python) while the engine thread loads the model; ``tokenizer`` waits for it.
        self._tokenizer = concurrent.futures.Future()
        threading.Thread(target=self._load_tokenizer, name="pdjax-tokenizer", daemon=True).start()
        self.core: EngineCore | None = None
        self.metrics = None                  # pdjax.metrics.Metrics, set by the server
        self.error: BaseException | None = None
        self.is_ready = False
        self.unhealthy_reason: str | None = None      # set when a multi-host node is lost
        self._progress = progress
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pdjax-engine", daemon=True)
        self._profile_steps_left: int | None = None
        self._profile_dir: str | None = None
        self._ready_event = threading.Event()

    def _load_tokenizer(self) -> None:
        try:
            self._tokenizer.set_result(load_tokenizer(self.args.tokenizer_path or self.model_path))
        except BaseException as e:       # raised where the tokenizer is used
            self._tokenizer.set_exception(e)

    @property
    def tokenizer(self):
        """The tokenizer (``load_tokenizer``); blocks until it is loaded, raises its error."""
        return self._tokenizer.result()

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        """Serve with another tokenizer (the engine core keeps its own)."""
        done = concurrent.futures.Future()
        done.set_result(value)
        self._tokenizer = done

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def wait_started(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait up to ``timeout_s`` for the load and warm-up to end; returns the error that
        stopped the engine from starting, or None (ready, or still starting)."""
        self._ready_event.wait(timeout_s)
        return self.error

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        self._ready_event.wait(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}") from self.error
        return self.is_ready

    @property
    def context_length(self) -> int:
        return self.core.context_length if self.core is not None else 0

    def compile_grammar(self, spec) -> None:
        """Compile ``spec`` (cached) from the calling thread, never the engine's: the server
        calls it while parsing, off the event loop. ``ValueError`` naming the field."""
        if self.core is None:
            raise RuntimeError("engine is not running")
        self.core.compile_grammar(spec)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        if self.core is not None:
            self.core.runner.stop_background()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ client API
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if req.rid in self._streams:
            yield GenerateOutput(req.rid, [], finished=True, error=f"rid {req.rid!r} is already in use",
                                 finish_reason={"type": "abort", "message": "duplicate rid"})
            return
        self._streams[req.rid] = (loop, q)
        self._call("add", req)
        finished = False
        try:
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._call("abort", rid)

    def pd_reject(self, rooms: list[int], message: str, status_code: int = 400) -> None:
        """The HTTP server refused a request for these bootstrap rooms before it reached the
        engine: a prefill fails the rooms and tells their decode at once (issue 16, item 3)."""
        if rooms:
            self._call("pd_reject", (list(rooms), message, status_code))

    def flush_cache(self) -> bool:
        return self._call_sync("flush")

    def get_load(self) -> dict:
        return self._call_sync("load") if self.core is not None else {}

    def pd_state(self) -> dict:
        """The PD manager's rooms, peers and transfer records (``/pd_state``); {} otherwise."""
        return self._call_sync("pd_state") if self.core is not None else {}

    def server_info(self) -> dict:
        info = {k: v for k, v in dataclasses.asdict(self.args).items()
                if k not in ("api_key", "disaggregation_secret")}
        info.update(version=_version(), dp_size=1, disaggregation_mode=_disagg_mode(self.args.role),
                    load_balance_method="round_robin", context_length=self.context_length,
                    model_path=self.model_path, is_ready=self.is_ready)
        if self.core is not None:
            info.update(num_total_pages=self.core.args.num_pages - 1,
                        max_total_num_tokens=(self.core.args.num_pages - 1) * self.args.page_size,
                        buckets=self.core.buckets.describe(),
                        warmup_s=round(self.core.warmup_s, 3),
                        compiled_shapes=len(self.core.runner.ready_keys),
                        forward_shapes=len(self.core.buckets.all_keys()),
                        step_cost_model=self.core.cost_model.describe())
        return info

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return self._call_sync("start_profile", (output_dir or self.args.profile_dir or "profiles", num_steps))

    def stop_profile(self) -> str:
        return self._call_sync("stop_profile")

    # ------------------------------------------------------------------ thread plumbing
    def _call(self, op: str, arg=None) -> None:
        self._inbox.put((op, arg, None))
        self._wake.set()

    def _call_sync(self, op: str, arg=None, timeout_s: float = 60.0):
        if not self._thread.is_alive():
            raise RuntimeError("engine is not running")
        done = threading.Event()
        box: list = []
        self._inbox.put((op, arg, (done, box)))
        self._wake.set()
        if not done.wait(timeout_s):
            raise TimeoutError(f"engine did not answer {op!r} within {timeout_s} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _push(self, out: GenerateOutput) -> None:
        stream = self._streams.get(out.rid)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _handle(self, op: str, arg):
        core = self.core
        if op == "add":
            try:
                core.add_request(arg)
            except ValueError as e:
                if core.disagg is not None:
                    core.disagg.on_rejected(arg, str(e))     # PD: the peer hears of it at once
                self._push(GenerateOutput(arg.rid, [], finished=True, error=str(e), status_code=400,
                                          finish_reason={"type": "abort", "message": str(e)}))
            return None
        if op == "pd_reject":
            if core.disagg is not None:
                rooms, message, status = arg
                for room in rooms:
                    core.disagg.reject_room(room, message, status)
            return None
        if op == "abort":
            out = core.abort_request(arg)
            if out is not None:
                self._push(out)
            return None
        if op == "flush":
            return core.flush_cache()
        if op == "load":
            return core.get_load()
        if op == "pd_state":
            return core.disagg.debug_state() if core.disagg is not None else {}
        if op == "start_profile":
            out_dir, steps = arg
            core.runner.start_profile(out_dir)
            self._profile_dir, self._profile_steps_left = out_dir, steps
            return out_dir
        if op == "stop_profile":
            if self._profile_dir is None:
                raise ValueError("no profile is running")
            core.runner.stop_profile()
            out_dir, self._profile_dir, self._profile_steps_left = self._profile_dir, None, None
            return out_dir
        raise ValueError(f"unknown engine op {op!r}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, arg, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                result = self._handle(op, arg)
            except BaseException as e:      # reported to the caller, never kills the loop
                result = e
                if reply is None:
                    logger.exception("engine op %s failed", op)
            if reply is not None:
                reply[1].append(result)
                reply[0].set()

    def _run(self) -> None:
        try:
            self.core = EngineCore(self.args, progress=self._progress, background_compile=True,
                                   tokenizer=self._tokenizer.result)
            if self.metrics is not None and hasattr(self.metrics, "attach_engine"):
                self.metrics.attach_engine(self.core)
            if self.core.disagg is not None:
                self.core.disagg.set_wake(self._wake.set)
                if self.metrics is not None:
                    self.core.disagg.attach_metrics(self.metrics)
            if self.core.cluster is not None:
                self.core.cluster.on_lost = self._on_node_lost
            self.is_ready = True
        except BaseException as e:
            logger.exception("engine failed to start")
            self.error = e
            self._ready_event.set()
            return
        self._ready_event.set()
        while not self._stop:
            self._drain_inbox()
            if not self.core.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception as e:
                logger.exception("engine step failed; failing the running requests")
                for rid in list(self.core.scheduler.requests):
                    out = self.core.abort_request(rid, f"internal error: {e}")
                    if out is not None:
                        out.error = f"internal error: {e}"
                        self._push(out)
                continue
            for out in outputs:
                self._push(out)
            if self._profile_steps_left is not None:
                self._profile_steps_left -= 1
                if self._profile_steps_left <= 0:
                    self.core.runner.stop_profile()
                    self._profile_dir = self._profile_steps_left = None
        if self.core.disagg is not None:
            self.core.disagg.close()
        if self.core.cluster is not None:
            self.core.cluster.close()

    def _on_node_lost(self, reason: str) -> None:
        """Multi-host: a node went away (called from the heartbeat thread, while the engine
        thread may be stuck in a collective): unhealthy from now on, every open request fails."""
        self.unhealthy_reason = reason
        self.is_ready = False
        for rid in list(self._streams):
            self._push(GenerateOutput(rid, [], finished=True, error=reason, status_code=503,
                                      finish_reason={"type": "abort", "message": reason}))


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pdjax")
    except Exception:
        return "0.0.0"


def _disagg_mode(role: str) -> str:
    return {"colocated": "null", "prefill": "prefill", "decode": "decode"}.get(role, "null")
