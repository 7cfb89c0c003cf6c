"""The only owner of device state: parameters, the KV cache, and one jitted function per entry
point (``decode``, ``extend``), compiled ahead of time once per bucket at warm-up (DESIGN.md §2).

The NNX model is split into ``graphdef`` and ``state`` once; each entry point is a
``jax.jit`` of a pure function that merges them, with the KV cache donated so XLA updates it in
place. Compiles are counted from JAX's own monitoring events (a lowering to MLIR happens for
every new executable, whether or not the persistent cache then serves the binary).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from pdjax.models.attention import AttentionMetadata
from pdjax.pallas_kernels.lanes import kv_row_align
from pdjax.paths import writable_folder
from pdjax.runner import device_sampler
from pdjax.runner.device_sampler import SamplingInputs, StepOutputs
from pdjax.runner.entry_points import EntryPoints
from pdjax.runner.executables import ExecutableStore
from pdjax.runner.pool_copy import kv_pool_copy
from pdjax.sched.batch import FlatBatch
from pdjax.sched.buckets import BucketKey, Buckets

logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_compile_lock = threading.Lock()
_compile_count = 0
_background_compile_count = 0
_thread_state = threading.local()      # .background: this thread is a background warm-up


def _on_event(event: str, duration_s: float, **kwargs) -> None:
    global _compile_count, _background_compile_count
    if event == _COMPILE_EVENT:        # reported on the thread that lowers
        with _compile_lock:
            if getattr(_thread_state, "background", False):
                _background_compile_count += 1
            else:
                _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Executables lowered in this process so far (JAX monitoring events), outside the
    background warm-up threads (``background_compile_count`` counts those)."""
    return _compile_count


def background_compile_count() -> int:
    """Executables lowered by background warm-up threads (``ModelRunner.warmup(core_only=True)``)."""
    return _background_compile_count


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``shape``'s shape and dtype, made on the devices of its sharding."""
    return jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=shape.sharding)()


def shard_bytes(leaf) -> int:
    """Bytes of one device's shard of ``leaf`` (an array or a ``ShapeDtypeStruct`` with a
    sharding), from its shape and sharding only."""
    shape = leaf.sharding.shard_shape(leaf.shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def device_memory_bytes(device) -> int | None:
    """What ``device`` can hold: its allocator's limit (TPU, GPU), or the host's physical memory
    for a CPU device; None when unknown."""
    try:
        stats = device.memory_stats()
    except Exception:          # some backends do not implement it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def check_pool_fits(caches: dict, num_pages: int, page_size: int, limit: int | None) -> None:
    """``ValueError`` naming ``max_total_tokens`` when one device's shard of the KV pool
    (``caches``: ``ShapeDtypeStruct``s with their shardings) is larger by itself than ``limit``
    bytes (a device's memory, ``device_memory_bytes``; None: unknown, not checked): it would
    fail deep in an allocation (a MemoryError, an XLA out-of-memory) after the weights had
    loaded, or in the compiler."""
    check_pool_bytes(sum(shard_bytes(c) for c in caches.values()), num_pages, page_size, limit)


def check_pool_bytes(per_device: int, num_pages: int, page_size: int, limit: int | None) -> None:
    """``check_pool_fits`` from the pool's bytes on one device (``per_device``); the parse-time
    check (``engine.settings.check_devices``) computes them from the cache specs alone."""
    if limit is not None and per_device > limit:
        raise ValueError(f"max_total_tokens: a KV pool of {num_pages * page_size:,} tokens "
                         f"needs {per_device / 2**30:,.1f} GiB on each device, more than its "
                         f"{limit / 2**30:,.1f} GiB")


class ModelRunner:
    """Runs forwards of ``FlatBatch``es on ``mesh``; owns the KV cache.

    KV cache: ``caches``, one layer-major array per buffer of ``model.cache_spec`` (GQA:
    ``k_cache``/``v_cache`` ``[layers, num_pages, page_size, KVH * D]``, split between KV heads over ``tp``),
    donated to every forward. Sampling runs inside the forward (``device_sampler``): ``forward``
    returns ``StepOutputs`` on the device, of which the host fetches the sampled ids (and the
    logprob rows asked for), and the logits, which ``resample`` draws some rows of again (the
    grammar rows of an overlapped step, whose masks are filled after the forward's dispatch;
    under TP they keep the lm head's vocabulary split). Penalty tables: ``prompt_seen``
    ``[S, V]`` bool and ``penalty_counts`` ``[S, V]`` int32, ``S = num_penalty_slots`` (slot 0
    is the null slot).
    """

    def __init__(self, model, mesh: Mesh, *, num_pages: int, page_size: int, kv_dtype,
                 buckets: Buckets, chunk_size: int | None = None,
                 executables_dir: str | None = None, verify_width: int = 1):
        self.cfg = model.cfg
        self.mesh = mesh
        self.page_size = page_size
        self.num_pages = num_pages
        self.buckets = buckets
        self.chunk_size = chunk_size
        self.graphdef, self.state = nnx.split(model)
        # DP attention: num_pages are the group's, dp_size ranks of num_pages / dp_size each
        # (global page ids, sched/dp_kv_cache_manager.py); the model's buffers hold a rank's
        # pool per device (models/dp_attention.py).
        self.dp_size = getattr(self.cfg, "dp_size", 1)
        # bytes of an activation element (DP attention's gather metric)
        self.hidden_itemsize = jnp.dtype(model.embed_tokens[...].dtype).itemsize
        self.cache_specs = tuple(model.cache_spec(
            num_pages // self.dp_size, page_size, kv_dtype,
            row_align=kv_row_align(mesh.devices.flat[0].platform)))
        self.max_rows = buckets.max_rows
        # The jits and their lowerings from shapes (the same code pdjax.aot compiles).
        self.jits = EntryPoints(self.graphdef, mesh, self.cache_specs, max_rows=self.max_rows,
                                vocab_size=self.cfg.vocab_size, page_size=page_size,
                                chunk_size=chunk_size, verify_width=verify_width,
                                dp_size=self.dp_size,
                                pages_per_rank=num_pages // self.dp_size)
        self.kv_bytes_per_page = sum(s.bytes_per_page for s in self.cache_specs)
        # Zeros of exactly the shapes and shardings the lowerings take. Slot 0 of the penalty
        # tables is the null slot; no_prev_tokens stands for the previous step's sampled ids
        # when no step came before (placeholders unused).
        caches, counts, seen, no_prev = self.jits.abstract_device_state()
        check_pool_fits(caches, num_pages, page_size, device_memory_bytes(mesh.devices.flat[0]))
        self.caches, self.penalty_counts, self.prompt_seen, self.no_prev_tokens = jax.tree.map(
            _zeros, (caches, counts, seen, no_prev))
        self.resample_rows: tuple[int, ...] = ()     # logits rows warm-up compiled resample for
        # Executables of ``python -m pdjax.aot --serialize`` loaded instead of compiled.
        self.executables = (ExecutableStore(executables_dir, mesh.devices.flat[0].device_kind,
                                            devices=mesh.devices.flat)
                            if executables_dir else None)
        if self.executables is not None and self.executables.reason is not None:
            logger.warning("aot_executables %s not used: %s", executables_dir,
                           self.executables.reason)
        # BucketKey, or ("resample", entry, rows) -> AOT executable (warm-up)
        self._compiled = {}
        # Keys the request path may use: compiled, with their prompt-logprobs (and resample)
        # executables. Replaced whole (never mutated) when the background warm-up adds one.
        self.ready_keys: frozenset = frozenset()
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self.warmup_done = False
        self.compiles_after_warmup = 0
        self.on_unexpected_compile = None     # callback(key) set by the engine (metrics)
        self.warmup_barrier = None            # callable() between compiling and running (multi-host)
        # BucketKey -> why its executable does not update the KV buffers in place
        # (``kv_pool_copy``); see ``require_in_place_kv``.
        self.kv_copying: dict[BucketKey, str] = {}
        self.in_place_kv_required = False
        # Orders require_in_place_kv against the background warm-up making a bucket ready.
        self._kv_copy_lock = threading.Lock()

    @property
    def num_penalty_slots(self) -> int:
        """Penalty table rows: one per request that can run at once, plus the null slot 0."""
        return self.jits.num_penalty_slots

    def logits_rows(self, key: BucketKey) -> int:
        """Sampling rows of bucket ``key`` (``EntryPoints.logits_rows``)."""
        return self.jits.logits_rows(key)

    @property
    def max_logits_rows(self) -> int:
        """Length of every forward's sampled ids (``StepOutputs.tokens``)."""
        return self.jits.max_logits_rows

    # ------------------------------------------------------------------ batches
    def make_batch(self, key: BucketKey, rows) -> FlatBatch:
        return self.jits.example_batch(key, rows)

    def forward(self, key: BucketKey, fb: FlatBatch, sampling: SamplingInputs | None = None,
                prev_idx: np.ndarray | None = None, prev_tokens: jax.Array | None = None,
                want_hidden: bool = False, want_logits: bool = False):
        """Dispatch one forward with sampling; returns ``(StepOutputs, hidden or None)`` on the
        device without waiting (JAX dispatch is asynchronous), and the logits ``[R, V]`` as a
        third element when ``want_logits`` (for ``resample``).

        ``sampling``: per logits row (``build_sampling_inputs`` with ``vocab_size`` or a
        ``[R, ceil(V/32)]`` grammar bitmask; default: all greedy, no grammar).
        ``prev_idx [T]`` int32: for a token whose id is not known on the host, its row in
        ``prev_tokens`` (the previous step's ``StepOutputs.tokens``), else -1.
        ``hidden`` (``[T, H]``) is returned for prompt logprobs when asked.
        """
        before = compile_count()
        if sampling is None:
            sampling = device_sampler.build_sampling_inputs([], self.logits_rows(key),
                                                            vocab_size=self.cfg.vocab_size)
        if prev_idx is None:
            prev_idx = np.full(len(fb.input_ids), -1, np.int32)
        # Host arrays go to the jitted call as numpy: its C++ fast path copies them, far cheaper
        # than a jnp.asarray each.
        md = AttentionMetadata(fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens,
                               fb.page_indices, fb.distribution)
        out, hidden, self.caches, self.penalty_counts, logits = self._executable(key)(
            self.graphdef, self.jits.max_logits_rows, self.state, self.caches, self.penalty_counts,
            self.prompt_seen, fb.input_ids, prev_idx,
            self.no_prev_tokens if prev_tokens is None else prev_tokens, md,
            fb.logits_indices, sampling)
        self._check_compiles(before, key)
        if want_logits:
            return out, (hidden if want_hidden else None), logits
        return out, (hidden if want_hidden else None)

    def resample(self, entry: str, logits, sampling: SamplingInputs, first: StepOutputs,
                 redo: np.ndarray) -> StepOutputs:
        """Draw rows ``redo [R]`` bool of ``logits [R, V]`` (a forward's of entry point
        ``entry``, on the device) again with ``sampling`` (built for those rows; penalty counts
        are updated for them); the other rows keep ``first``'s tokens and logprobs. Dispatched
        without waiting. One executable per entry point and logits row count, compiled by
        ``warmup(split_sampling=True)``."""
        before = compile_count()
        compiled = self._compiled.get(("resample", entry, logits.shape[0]))
        args = (logits, sampling, self.prompt_seen, self.penalty_counts, first, redo)
        out, self.penalty_counts = (compiled(*args) if compiled is not None
                                    else self.jits.resample(self.jits.max_logits_rows, *args))
        self._check_compiles(before, ("resample", entry, logits.shape[0]))
        return out

    def lower(self, key: BucketKey):
        """The lowered forward of bucket ``key`` (``jax.stages.Lowered``; tests read its text).
        Device state enters as its shapes and shardings only (``abstract``), so a background
        thread may lower while the engine thread runs forwards."""
        return self.jits.lower_forward(key, self.state, self.caches, self.penalty_counts,
                                       self.prompt_seen, self.no_prev_tokens)

    def _check_compiles(self, before: int, key) -> None:
        if self.warmup_done and compile_count() != before:
            self.compiles_after_warmup += compile_count() - before
            logger.warning("compile on the request path for bucket %s", key)
            if self.on_unexpected_compile is not None:
                self.on_unexpected_compile(key)

    def prompt_logprobs_at(self, hidden, indices: list[int], target_ids: list[int], want_top: bool):
        """Logprobs of prompt tokens ``target_ids`` predicted at token rows ``indices`` of
        ``hidden``, on the device: ``(logprob [n], top_ids [n, K], top_logprobs [n, K])`` padded
        to the token bucket ``n`` (one executable per bucket); the caller fetches them."""
        before = compile_count()
        n = hidden.shape[0]
        idx = np.zeros(n, np.int32)
        idx[:len(indices)] = indices
        tgt = np.zeros(n, np.int32)
        tgt[:len(target_ids)] = target_ids
        out = self.jits.prompt_logprobs(self.graphdef, self.state, hidden, jnp.asarray(idx), jnp.asarray(tgt),
                              jnp.asarray(bool(want_top)))
        self._check_compiles(before, ("prompt_logprobs", n))
        return out

    def init_penalty_slot(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Set penalty slot ``slot`` (>= 1) from a request's prompt and (known) output ids."""
        vocab = self.cfg.vocab_size
        seen = np.zeros(vocab, bool)
        seen[np.asarray(prompt_ids, np.int64)] = True
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab).astype(np.int32)
        before = compile_count()
        self.prompt_seen, self.penalty_counts = self.jits.init_penalty_slot(
            self.prompt_seen, self.penalty_counts, jnp.int32(slot), jnp.asarray(seen),
            jnp.asarray(counts[:vocab]))
        self._check_compiles(before, "init_penalty_slot")

    # ------------------------------------------------------------------ warm-up
    def _executable(self, key: BucketKey):
        """``key``'s AOT executable from warm-up, called like the jit (graphdef and max_rows
        first, and dropped: they are static); the jit itself for a key warm-up did not compile."""
        compiled = self._compiled.get(key)
        if compiled is None:
            return self.jits.forwards[key.entry]
        return lambda graphdef, max_rows, *args: compiled(*args)

    def _lower(self, key: BucketKey):
        return self.lower(key)

    def _lower_resample(self, first: StepOutputs, logits):
        """The lowered ``resample`` for a forward's outputs ``first`` and ``logits [R, V]``."""
        return self.jits.lower_resample(first, logits, self.prompt_seen, self.penalty_counts)

    def _compile(self, lowered):
        """``lowered``'s executable: loaded from ``aot_executables`` when one matches it,
        compiled otherwise."""
        if self.executables is not None:
            loaded = self.executables.load(lowered)
            if loaded is not None:
                return loaded
        return lowered.compile()

    def _compile_all(self, jobs, threads: int, progress: bool, desc: str) -> None:
        """Compile ``(key, lowered)`` jobs on ``threads`` threads into ``_compiled``."""
        with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
                tqdm(total=len(jobs), desc=desc, disable=not progress, unit="shape") as bar:
            futures = {pool.submit(self._compile, low): key for key, low in jobs}
            for future in concurrent.futures.as_completed(futures):
                key = futures[future]
                self._compiled[key] = future.result()
                with self._kv_copy_lock:
                    self._note_kv_copy(key, self._compiled[key])
                bar.update()

    def _note_kv_copy(self, key, compiled) -> bool:
        """Record in ``kv_copying`` whether forward ``key``'s executable copies the KV pool;
        True when it does."""
        if not isinstance(key, BucketKey):
            return False
        why = kv_pool_copy(compiled, self.kv_shard_bytes(),
                           [self.caches[s.name].dtype.itemsize for s in self.cache_specs])
        if why is None:
            return False
        self.kv_copying[key] = why
        logger.warning("bucket %s does not update the KV pool in place: %s", key, why)
        return True

    def kv_shard_bytes(self) -> list[int]:
        """Bytes of one device's shard of each KV buffer (``cache_specs`` order). From shapes
        and shardings only: a background compile calls it while a step holds the donated
        buffers."""
        return [shard_bytes(self.caches[s.name]) for s in self.cache_specs]

    def require_in_place_kv(self) -> None:
        """Promise that every forward updates the KV buffers in place, for a transfer engine
        that reads or writes pages in them while steps run (PD's direct path): a step that
        copies a buffer into a temporary and back, or into a new buffer, loses every write
        that lands in between, and one that holds other values in a donated KV buffer in
        mid-step gives a reader garbage (``runner/pool_copy.py``). Raises ``ValueError`` naming the compiled buckets that copy;
        afterwards a background-compiled bucket that copies is never made ready."""
        with self._kv_copy_lock:
            if self.kv_copying:
                listed = "; ".join(f"{k}: {why}"
                                   for k, why in sorted(self.kv_copying.items(), key=str))
                raise ValueError(f"KV pool not updated in place by {len(self.kv_copying)} "
                                 f"bucket(s), so pages written into it during a step would be "
                                 f"lost: {listed}")
            self.in_place_kv_required = True

    def warmup(self, progress: bool = True, compile_threads: int | None = None,
               split_sampling: bool = False, core_only: bool = False) -> float:
        """Compile the buckets (the list is printed), then run each once; returns seconds.

        Shapes are traced and lowered one by one, then compiled ahead of time on
        ``compile_threads`` threads (default: the CPU count, at most 4; XLA compiles release
        the GIL) and kept: ``forward`` calls these executables, so no request compiles.
        ``split_sampling``: also compile ``resample`` for every logits row count (one small
        executable each; the overlapped grammar path).

        ``core_only``: compile only ``Buckets.core_keys`` (the largest shape of each entry,
        which hold every batch) before returning, and the other shapes on one background
        thread, each joining ``ready_keys`` once compiled with its prompt-logprobs (and
        resample) executable; the engine picks among ``ready_keys``
        (``Buckets.pick(ready=...)``), so a request arriving meanwhile runs padded to a larger
        shape and still never compiles. ``wait_background`` joins it.
        """
        keys = self.buckets.all_keys()
        core = self.buckets.core_keys() if core_only else keys
        rest = [k for k in keys if k not in core]
        logger.info("warm-up: %s", self.buckets.describe())
        print(f"pdjax warm-up: {self.buckets.describe()}"
              + (f"; {len(core)} before ready, {len(rest)} in the background" if core_only else ""),
              flush=True)
        t0 = time.monotonic()
        threads = compile_threads or min(4, os.cpu_count() or 1)
        lowered = [self._lower(key) for key in core]
        t_lowered = time.monotonic()
        self._compile_all(list(zip(core, lowered)), threads, progress, "compiling buckets")
        t_compiled = time.monotonic()
        if self.warmup_barrier is not None:     # multi-host: every node compiled before any runs
            self.warmup_barrier()
        first_of = {}        # (entry, logits rows) -> a forward's (StepOutputs, logits)
        logprob_tokens = set()         # one prompt-logprobs executable per token count
        for key in core:
            fb = self.make_batch(key, [])
            out, hidden, logits = self.forward(key, fb, want_hidden=key.entry != "decode",
                                               want_logits=True)
            if key.entry == "extend" and key.num_tokens not in logprob_tokens:
                logprob_tokens.add(key.num_tokens)
                self.prompt_logprobs_at(hidden, [0], [0], want_top=True)
            first_of.setdefault((key.entry, self.logits_rows(key)), (out, logits))
        if split_sampling:
            # One resample per logits row count, lowered from real forward outputs (their
            # shardings: under TP the logits stay split over the vocabulary).
            jobs = [(("resample", entry, rows), self._lower_resample(out, logits))
                    for (entry, rows), (out, logits) in sorted(first_of.items())]
            self._compile_all(jobs, threads, progress, "compiling resample")
            if self.warmup_barrier is not None:
                self.warmup_barrier()
            for (entry, rows), (out, logits) in sorted(first_of.items()):
                sampling = device_sampler.build_sampling_inputs([], rows,
                                                                vocab_size=self.cfg.vocab_size)
                self.resample(entry, logits, sampling, out, np.zeros(rows, bool))
            self.resample_rows = tuple(sorted({rows for _, rows in first_of}))
        self.init_penalty_slot(0, [], [])
        jax.block_until_ready(self.caches)
        self.ready_keys = frozenset(core)
        self.warmup_done = True
        t_end = time.monotonic()
        self.warmup_phases_s = {"lower": round(t_lowered - t0, 2),
                                "compile": round(t_compiled - t_lowered, 2),
                                "first_runs": round(t_end - t_compiled, 2)}
        print(f"pdjax warm-up phases (s): {self.warmup_phases_s}", flush=True)
        if rest:
            self._background = threading.Thread(
                target=self._compile_in_background, args=(rest, split_sampling),
                name="pdjax-background-compile", daemon=True)
            self._background.start()
        return t_end - t0

    def _compile_in_background(self, keys: list[BucketKey], split_sampling: bool) -> None:
        """Compile ``keys`` one by one (one thread: the other cores serve requests); each joins
        ``ready_keys`` with its prompt-logprobs executable (and, with ``split_sampling``, the
        resample of its logits row count). Lowerings here are counted by
        ``background_compile_count``, not as compiles on the request path."""
        _thread_state.background = True
        t0 = time.monotonic()
        try:
            for key in keys:
                if self._stop_background.is_set():
                    return
                compiled = self._compile(self._lower(key))
                # The forward's outputs as shapes with the executable's own output shardings.
                outs = jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(
                    info.shape, info.dtype, sharding=sharding),
                    compiled.out_info, compiled.output_shardings)
                if key.entry == "extend":
                    # The prompt-logprobs jit for this token count, called as the request path
                    # calls it (host index arrays included: each shape stages through a jit of
                    # its own) on a hidden of the forward's own output sharding, so the request
                    # path hits every cache.
                    info = outs[1]
                    hidden = jax.device_put(jnp.zeros(info.shape, info.dtype), info.sharding)
                    jax.block_until_ready(self.prompt_logprobs_at(hidden, [0], [0], want_top=True))
                resample_key = ("resample", key.entry, self.logits_rows(key))
                if split_sampling and resample_key not in self._compiled:
                    self._compiled[resample_key] = self._compile(
                        self._lower_resample(outs[0], outs[4]))
                    self.resample_rows = tuple(sorted({*self.resample_rows,
                                                       self.logits_rows(key)}))
                self._compiled[key] = compiled
                with self._kv_copy_lock:
                    if self._note_kv_copy(key, compiled) and self.in_place_kv_required:
                        logger.error("bucket %s is not used: KV pages are written into the "
                                     "pool while steps run", key)
                        continue
                    self.ready_keys = self.ready_keys | {key}
            logger.info("background warm-up: %d shapes in %.1f s", len(keys), time.monotonic() - t0)
            print(f"pdjax background warm-up: {len(keys)} shapes in {time.monotonic() - t0:.1f} s",
                  flush=True)
        except Exception:       # the core set still serves every batch
            logger.exception("background warm-up failed; larger shapes keep serving")

    def wait_background(self, timeout_s: float | None = None) -> bool:
        """Wait for the background warm-up (if any); True when every shape is ready."""
        if self._background is not None:
            self._background.join(timeout_s)
        return len(self.ready_keys) == len(self.buckets.all_keys())

    def stop_background(self, timeout_s: float | None = None) -> bool:
        """Stop the background warm-up after the shape it is compiling, and wait up to
        ``timeout_s`` seconds (None: no limit) for that compile to end (shutdown: a compile
        still running when the interpreter exits aborts the process in XLA's C++ code).
        Returns True when no background thread is left running."""
        self._stop_background.set()
        if self._background is not None:
            self._background.join(timeout_s)
            return not self._background.is_alive()
        return True

    # ------------------------------------------------------------------ profiling
    def start_profile(self, output_dir: str) -> None:
        """Start an XLA profiler trace into ``output_dir`` (made if missing). ``ValueError``
        naming ``output_dir`` when the folder cannot be written: checked first, since a trace
        that fails to export at its stop leaves the profiler started for good."""
        jax.profiler.start_trace(writable_folder("output_dir", output_dir))

    def stop_profile(self) -> None:
        jax.block_until_ready(self.caches)
        jax.profiler.stop_trace()

    # ------------------------------------------------------------------ KV pages (PD)
    def kv_buffers(self) -> list[jax.Array]:
        """The KV buffers in ``cache_specs`` order (what PD registers and copies)."""
        return [self.caches[s.name] for s in self.cache_specs]

    def gather_pages(self, page_idx: np.ndarray) -> list[np.ndarray]:
        """Host copies of pages ``page_idx [n]`` int32 of every buffer: ``[layers, n, ...]``
        each, in ``cache_specs`` order (PD staging). One executable per ``n``."""
        out = self.jits.gather_pages(self.caches, jnp.asarray(page_idx, jnp.int32))
        return [np.asarray(out[s.name]) for s in self.cache_specs]

    def scatter_pages(self, page_idx: np.ndarray, parts: list[np.ndarray]) -> None:
        """Write ``parts`` (as ``gather_pages`` returns them) into pages ``page_idx``; the cache
        is donated. Padding entries of ``page_idx`` should point at the null page 0."""
        named = {s.name: p for s, p in zip(self.cache_specs, parts)}
        self.caches = self.jits.scatter_pages(self.caches, jnp.asarray(page_idx, jnp.int32), named)
