"""``EngineCore``, the engine every role runs (DESIGN.md §3, §4): one step schedules, launches
the forward (which samples on the device) and processes a step's results; overlapped by
default. With KV from or to elsewhere the step also talks to the transfer side::

    step():  role.poll()                              (PD: rooms, the metadata gate, timeouts)
             scheduler.update_from_kv_output(worker.poll())   what the worker finished: KV
                                                       in (with a first token) or failed
             scheduler.schedule()  ->  launch  ->  read the step due (ForwardStep)
             worker.start(scheduler.build_connector_meta(batch))   what to move now
             role.after_step(batch, outputs)           (PD: hold answers until sent)

The device half (building inputs, dispatching, reading tokens) is ``pdjax.engine.forward``.

Single-threaded; ``pdjax.engine.async_engine`` runs it on its own thread for the HTTP server,
``pdjax.engine.offline`` drives it directly.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Any

import jax

from pdjax.config import ServerArgs
from pdjax.engine.forward import ForwardStep, Launched, seed_cost_model
from pdjax.engine.load import engine_load
from pdjax.engine.runner_setup import build_runner
from pdjax.engine.speculative import make_speculator, must_read_first
from pdjax.engine.startup import PhaseTimer, warn_if_context_cut
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.engine_roles import EngineRole, RoleHost
from pdjax.distributed import join as join_cluster
from pdjax.models.loader import load_tokenizer
from pdjax.output import token_finish_reason
from pdjax.request import FinishReason, Request
from pdjax.runner.device_sampler import MAX_HELD_STOP_IDS, MAX_TOP_LOGPROBS
from pdjax.sched.buckets import Buckets
from pdjax.sched.cost_model import StepCostModel
from pdjax.sched.dp_kv_cache_manager import DpKVCacheManager
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.scheduler import ScheduledBatch, Scheduler
from pdjax.transfer.factory import check_kv_connector, create_kv_connection

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class StepClock:
    """Seconds one ``step`` spent dispatching and waiting for the device (the rest of its
    wall time is host time); made by each step and passed to the helpers that wait."""

    device_s: float = 0.0


class EngineCore(ForwardStep):
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
    ``buckets``: the shapes to compile instead of those ``Buckets.create`` derives from the
    settings (a short list for a benchmark of a big model, ``scripts/gpu_engine_check.py``);
    ``ValueError`` when they cannot hold every batch (``Buckets.check_serves``).
    """

    def __init__(self, args: ServerArgs, *, progress: bool = True, background_compile: bool = False,
                 tokenizer=None, buckets: Buckets | None = None):
        phase = PhaseTimer()         # seconds of each start-up phase, printed as one line
        self.startup_phases_s = phase.phases
        self.args = args
        check_kv_connector(args.kv_connector)       # before anything loads
        # Multi-host (--nnodes > 1): JAX's distributed runtime, the nodes checked (DESIGN.md §6);
        # before anything asks JAX for its backend (resolving "auto" does). The engine runs on
        # node 0; the other nodes only build the runner (pdjax.entrypoints.multihost).
        self.cluster = join_cluster(args)
        if self.cluster is not None and not self.cluster.is_leader:
            raise ValueError(f"node_rank {args.node_rank}: the engine runs on node 0; a follower "
                             f"runs pdjax.entrypoints.multihost")
        node = build_runner(args, progress=progress, buckets=buckets, phase=phase)
        # --mem-fraction-static sized the pool from the loaded weights: node.args holds it.
        args = self.args = node.args
        self.config = config = node.config
        self.model_path = node.model_path
        self.model_cfg = node.model_cfg
        self.context_length = node.context_length
        self.buckets = node.buckets
        self.runner = node.runner
        self.tokenizer = (tokenizer() if tokenizer is not None
                          else load_tokenizer(args.tokenizer_path or self.model_path))
        phase("tokenizer")
        self.sched_config = config.scheduler
        warn_if_context_cut(self.sched_config, self.context_length)
        # Fitted from every timed forward; the scheduler plans with it under target_itl_ms.
        self.cost_model = StepCostModel(self.buckets.pick, self.buckets.token_buckets,
                                        token_scale=self.buckets.token_buckets[-1],
                                        cached_scale=self.context_length)
        # Speculative decoding (None: off): drafts per request, their statistics.
        self.speculator = make_speculator(args, config, self.model_cfg, self.runner)
        if self.speculator is not None:
            phase("speculator")
        if self.cluster is not None:
            self.runner = self.cluster.mirror(self.runner)   # node 0's calls go to every node
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._rng = random.Random(args.random_seed)
        self._zero_token_reqs: list[Request] = []
        self.host_time_s = 0.0        # scheduling + batch building + sampling
        self.forward_time_s = 0.0
        self.step_hooks: list = []    # callables(batch, outputs) after each step (metrics)
        # callables(batch, key, device array, t_dispatch) after each dispatch (device timelines,
        # benchmarks): the sampled tokens; for a split grammar step, the forward's logits and
        # then the resample's tokens (key.entry "resample").
        self.dispatch_hooks: list = []
        self.overlap = config.overlap
        # The step launched and not read yet (overlap); stored only at the end of ``step`` and
        # ``drain``: inside a step it flows as a value (``_read_first`` -> ``_run`` ->
        # ``_process``), so here it still names the step in flight when the step began.
        self._inflight: Launched | None = None
        self._grammar_backend = None                     # built on first use (grammar_backend)
        self._grammar_lock = threading.Lock()
        self.num_grammar_syncs = 0    # steps that read the step in flight first (no split)
        self._warm_up(progress, background_compile, phase)
        # KV from or to elsewhere (DESIGN.md §4), built before the scheduler: the connector it
        # calls, the worker this step polls and starts, and the role that sees requests first
        # (pdjax/engine_roles.py). Colocated: the null connection, never None.
        sc = self.sched_config
        kv = (KVCacheManager(sc.num_pages, sc.page_size, sc.disable_radix_cache)
              if sc.dp_size == 1 else      # DP attention: pages carry a rank
              DpKVCacheManager(sc.dp_size, sc.num_pages // sc.dp_size, sc.page_size,
                               sc.disable_radix_cache))
        conn = create_kv_connection(RoleHost(
            args=args, model_path=self.model_path, model_cfg=self.model_cfg,
            context_length=self.context_length, runner=self.runner, kv=kv,
            wait_for_device=self.wait_for_device, wait_for_kv=self.wait_for_kv,
            abort_request=lambda rid, message: self.scheduler.abort_request(rid, message),
            num_prompt_tokens_computed=lambda: self.scheduler.num_prompt_tokens_computed))
        self.role: EngineRole = conn.role
        self.kv_worker = conn.worker
        self.scheduler = Scheduler(self.sched_config, cost_model=self.cost_model,
                                   connector=conn.connector, speculator=self.speculator, kv=kv)
        # The device half of the step: inputs, dispatch, split grammar rows, reading tokens.
        self.forward = ForwardStep(
            runner=self.runner, buckets=self.buckets, scheduler=self.scheduler,
            cost_model=self.cost_model, speculator=self.speculator, model_cfg=self.model_cfg,
            page_size=args.page_size, eos_token_ids=self.eos_token_ids,
            dispatch_hooks=self.dispatch_hooks,
            split_grammar_sampling=lambda: self.split_grammar_sampling,
            stop_check=self.stop_check, make_output=self.make_output,
            abort_request=self.abort_request)

    def _warm_up(self, progress: bool, background_compile: bool, phase: PhaseTimer) -> None:
        """Compile the buckets (and a draft model's), seed the cost model under an ITL target,
        print the start-up phases. ``background_compile`` (the server): only the core shapes
        before ready, the rest on a background thread; requests meanwhile pad to a compiled
        shape (never compile). The ITL target plans with every token bucket's timing, so it
        waits for all of them."""
        args = self.args
        self.warmup_s = self.runner.warmup(
            progress=progress and not args.skip_warmup_progress,
            split_sampling=self.overlap and args.grammar_backend != "none",
            # Multi-host: no background compiles (their first runs would be node 0's alone).
            core_only=background_compile and args.target_itl_ms is None and self.cluster is None)
        if self.speculator is not None:
            self.speculator.drafter.warmup()     # a draft model's buckets (DESIGN.md §3)
        phase("warmup")
        if args.target_itl_ms is not None:
            seed_cost_model(self.runner, self.buckets, self.cost_model)
            phase("seed_cost_model")
        phase.report()

    # ------------------------------------------------------------------ the forward's counters
    @property
    def num_steps(self) -> int:
        """Steps whose results were read."""
        return self.forward.num_steps

    @property
    def dp_gather_bytes(self) -> int:
        """DP attention: bytes each device received in the DP gathers and scatters of the
        forwards so far (``dp_attention.dp_collective_bytes``); 0 without."""
        return self.forward.dp_gather_bytes

    @property
    def num_overlapped_dispatches(self) -> int:
        """Forwards dispatched while the previous one still ran on the device."""
        return self.forward.num_overlapped_dispatches

    @property
    def num_exposed_dispatches(self) -> int:
        """Forwards dispatched after the previous one had finished."""
        return self.forward.num_exposed_dispatches

    @property
    def num_grammar_split_steps(self) -> int:
        """Steps whose grammar rows were drawn in a second dispatch (overlap kept)."""
        return self.forward.num_grammar_split_steps

    @property
    def num_grammar_split_rows(self) -> int:
        return self.forward.num_grammar_split_rows

    @property
    def last_forward_device_s(self) -> float | None:
        """Device seconds of the last forward read (None: it compiled)."""
        return self.forward.last_forward_device_s

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
        for pos, t in enumerate(g.input_ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"input_ids[{pos}]: a token id must be an integer, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"input_ids[{pos}]: token id {t} is outside [0, {vocab})")
        g.sampling_params.check_vocab_ids(vocab)
        held = g.sampling_params.held_stop_ids(0, self.eos_token_ids)
        if len(held) > MAX_HELD_STOP_IDS:
            raise ValueError(f"stop_token_ids: min_new_tokens holds back at most "
                             f"{MAX_HELD_STOP_IDS} stop tokens (the model's EOS ids included), "
                             f"got {len(held)}")
        for name, value, low in (("top_logprobs_num", g.top_logprobs_num, 0),
                                 ("logprob_start_len", g.logprob_start_len, -1)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: an integer, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if g.top_logprobs_num > MAX_TOP_LOGPROBS:
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
        self.scheduler.check_new_request(req)
        self.role.add_request(g, req)      # PD: the request's room (ValueError: refused)
        self.scheduler.add_request(req)
        # The role's sampling parameters (a PD prefill samples one token whatever the client
        # asked). A PD decode's request still moves its KV (its prefill waits for the page
        # list): the scheduler finishes it once the KV is in.
        if req.sampling_params.max_new_tokens == 0 and not req.return_logprob \
                and self.args.role != "decode":
            self._zero_token_reqs.append(req)
        return req

    @property
    def has_work(self) -> bool:
        """Whether ``step()`` has something to do (scheduled requests, a step in flight, or PD
        events)."""
        return (self.scheduler.has_work or self._inflight is not None
                or self.role.has_work() or self.kv_worker.has_work())

    def abort_request(self, rid: str, message: str = "aborted by client") -> GenerateOutput | None:
        out = self.role.abort(rid, message)
        if out is not None:
            return out
        req = self.scheduler.abort_request(rid, message)
        return None if req is None else self.make_output(req, [], [], [])

    def wait_for_device(self) -> None:
        """Block until the step in flight (if any) has run: afterwards no forward still writes
        pages a finish or abort released (PD decode calls this from ``role.poll()`` before
        handing pages to a transfer). Within a step it waits for the step in flight when the
        step began, also when ``_read_first`` has read it already (nothing then to wait for)."""
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
        outputs, fetch_s = self.forward.complete(done)
        self._start_transfers(done.batch)
        outputs = self.role.after_step(done.batch, outputs)
        self.forward_time_s += fetch_s
        for hook in self.step_hooks:
            hook(done.batch, outputs)
        return outputs

    # ------------------------------------------------------------------ the step
    def step(self) -> list[GenerateOutput]:
        """One step: schedule -> run -> process (DESIGN.md §3). Returns the outputs of every
        request that got a token or finished; with overlap, ``run`` launches this step's
        forward before ``process`` reads the previous one's.

        The step in flight flows through the step as a value: the helpers take it and return
        what stays in flight, and only the end of ``step`` (or ``drain``) stores it."""
        t0 = time.perf_counter()
        clock = StepClock()
        outputs: list[GenerateOutput] = []
        try:
            prev, read_first = self._read_first(self._inflight, outputs, clock)
            batch = self._schedule(outputs)
            launched = self._run(batch, prev, outputs, clock)
            done, in_flight, outputs = self._process(prev, read_first, launched, outputs, clock)
        except BaseException:
            self._inflight = None     # a failed step leaves nothing in flight
            raise
        self._inflight = in_flight
        # Forward time: dispatching and waiting for the device; host time: the rest.
        self.forward_time_s += clock.device_s
        self.host_time_s += max(0.0, time.perf_counter() - t0 - clock.device_s)
        if done is not None:
            for hook in self.step_hooks:
                hook(done.batch, outputs)
        return outputs

    def _read_first(self, prev: Launched | None, outputs: list[GenerateOutput],
                    clock: StepClock) -> tuple[Launched | None, Launched | None]:
        """Read ``prev``, the step in flight, before scheduling when the next step needs its
        tokens on the host (DESIGN.md §3):

        - grammars without resample executables (overlap turned on after start-up): the masks
          of the next step need the tokens of a step with grammar rows ("Grammars");
        - speculative decoding: drafts continue a request's newest token, so a step holding a
          verify row or a request that would speculate now (``must_read_first``) is read
          first; requests backed off decode overlapped ("Speculative decoding").

        Returns ``(the step still in flight, the step read)``: one is ``prev``, the other None."""
        if prev is None:
            return None, None
        grammar_sync = prev.has_grammar and not self.split_grammar_sampling
        if not grammar_sync and not must_read_first(self.speculator, self.scheduler, prev):
            return prev, None
        if grammar_sync:
            self.num_grammar_syncs += 1
        outputs += self._read(prev, clock)
        return None, prev

    def _schedule(self, outputs: list[GenerateOutput]) -> ScheduledBatch | None:
        """PD events, what the transfer worker finished, requests done without a forward, then
        the scheduler's batch."""
        outputs += self.role.poll()
        # KV that arrived or will not: a request's first token (PD decode), or its error.
        for req in self.scheduler.update_from_kv_output(self.kv_worker.poll(), self.stop_check):
            outputs.append(self.make_output(req, list(req.output_ids),
                                            list(req.output_logprobs),
                                            list(req.output_top_logprobs)))
        while self._zero_token_reqs:       # max_new_tokens = 0: done without a forward
            req = self._zero_token_reqs.pop()
            if self.scheduler.finish_waiting(req, FinishReason.of_length(0)):
                outputs.append(self.make_output(req, [], [], []))
        batch = self.scheduler.schedule()
        # Requests the scheduler finished without a forward (a lone decode request the pool
        # cannot grow) still owe their client a final output.
        outputs += [self.make_output(req, [], [], []) for req in self.scheduler.pop_finished()]
        return batch

    def _run(self, batch: ScheduledBatch | None, prev: Launched | None,
             outputs: list[GenerateOutput], clock: StepClock) -> Launched | None:
        """Launch ``batch``'s forward (not waited for); its placeholder inputs come from
        ``prev``, the step still in flight."""
        if batch is None:
            return None
        launched, dispatch_s = self.forward.launch(batch, prev, outputs)
        clock.device_s += dispatch_s
        return launched

    def _process(self, prev: Launched | None, read_first: Launched | None,
                 launched: Launched | None, outputs: list[GenerateOutput], clock: StepClock):
        """Read the step whose results are due, sample ``launched``'s split grammar rows, and
        hand the outputs to the PD role. ``prev``: the step in flight before ``launched`` and
        not read yet; ``read_first``: the step ``_read_first`` read instead. With overlap
        ``prev`` is read now and ``launched`` stays in flight; without, ``launched`` is read at
        once (and ``prev`` is None). Returns ``(the step read or None, the step now in flight
        or None, outputs)``."""
        if read_first is not None:          # read already; the new step stays in flight
            done, in_flight = read_first, launched
        else:
            done, in_flight = (prev, launched) if self.overlap else (launched, prev)
            if done is not None:
                outputs += self._read(done, clock)
        if launched is not None and launched.deferred:
            # The step before is read and its tokens taken by the matchers: fill the masks
            # while the new forward runs, then sample its grammar rows.
            clock.device_s += self.forward.sample_deferred(launched, outputs)
        batch = done.batch if done is not None else None
        self._start_transfers(batch)     # every step: a request admitted now may wait for KV
        if done is not None or outputs:
            # done None: no forward's results were read, but requests may have finished.
            outputs = self.role.after_step(batch, outputs)
        return done, in_flight, outputs

    def _start_transfers(self, batch: ScheduledBatch | None) -> None:
        """Hand the worker what the connector says must move after ``batch`` was read."""
        meta = self.scheduler.build_connector_meta(batch)
        if meta is not None:
            self.kv_worker.start(meta)

    def _read(self, done: Launched, clock: StepClock) -> list[GenerateOutput]:
        outputs, fetch_s = self.forward.complete(done)
        clock.device_s += fetch_s
        return outputs

    def stop_check(self, req: Request) -> FinishReason | None:
        """The finish reason after ``req``'s newest token, or None (``token_finish_reason``);
        a grammar request's matcher takes the token here (once per token): a token it does not
        allow fails the request, and a grammar that admits nothing more stops it."""
        tok = req.output_ids[-1]
        if req.grammar is not None and not req.grammar.accept(tok):
            # The client's grammar cannot be continued (e.g. it nests without end, or grows
            # past the grammar library's limits): a 400 naming the grammar's field.
            field = req.grammar.spec.field
            return req.fail(f"{field}: token {tok} was not allowed "
                            f"({_short(req.grammar.error)})", 400, param=field)
        return token_finish_reason(
            req.sampling_params, tok, len(req.output_ids), self.eos_token_ids,
            grammar_terminated=req.grammar is not None and req.grammar.is_terminated)

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
            cached_tokens=req.num_cached_tokens_reported, error=req.error,
            spec_verify_ct=req.spec_verify_ct, spec_accepted_tokens=req.spec_accepted_tokens)

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        if self.scheduler.running or self.scheduler.waiting:
            return False
        return self.scheduler.prefix_cache.reset()

    def get_load(self) -> dict[str, Any]:
        """Queue sizes and pages (``engine_load``), and the forward shapes compiled so far of
        all the buckets (``num_ready_buckets`` < ``num_buckets`` while the background warm-up
        runs: batches pad to a larger shape meanwhile, and timings are not yet steady)."""
        return {**engine_load(self.scheduler, self.role),
                "num_ready_buckets": len(self.runner.ready_keys),
                "num_buckets": len(self.buckets.all_keys())}


def _short(message: str | None, limit: int = 300) -> str:
    """The first line of a grammar library's message, at most ``limit`` characters (its errors
    can carry kilobytes of parser state)."""
    first = (message or "").strip().splitlines()[0] if (message or "").strip() else ""
    return first if len(first) <= limit else first[:limit] + " ..."
