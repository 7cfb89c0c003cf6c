"""The abstract engine: every executable a server compiles, built from shapes only, for a
``Target`` (compile-only TPU or GPU devices; DESIGN.md §7).

``AbstractEngine(args, target)`` resolves ``args`` as ``EngineCore`` does, but for the target's
platform (``resolve_engine_config(args, platform)``: Pallas kernels, bfloat16, a scan over
layers, no CPU kernels), reads only the checkpoint's config (an HF folder, a GGUF header, an
Orbax checkpoint's config, or a folder holding nothing but ``config.json``), and builds the
model with ``nnx.eval_shape``: every parameter is a ``jax.ShapeDtypeStruct`` with its TP
sharding on the target's mesh, and so are the KV cache and the sampler's tables
(``EntryPoints.abstract_device_state``). ``entries()`` lists what a server of these settings
compiles, and ``compile_entry`` lowers and compiles one for the target, reporting the
compiler's own ``memory_analysis`` and the kernels in the executable.

    entry                 one executable per                      compiled by the server at
    decode / extend       BucketKey (Buckets.all_keys)            warm-up (ModelRunner.warmup)
    prompt_logprobs       extend token bucket                     warm-up
    resample              (entry, logits rows)                    warm-up with overlap
    init_penalty_slot     -                                       warm-up
    gather / scatter      staging page bucket (transfer path)     LocalKV.warmup (staging)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pdjax.aot.targets import Target
from pdjax.config import ServerArgs
from pdjax.engine.settings import make_buckets, resolve_engine_config
from pdjax.engine.speculative import model_kwargs
from pdjax.models.loader import checkpoint_architecture, checkpoint_config, run_config
from pdjax.models.params import abstract_model
from pdjax.models.registry import model_family
from pdjax.pallas_kernels.lanes import kv_row_align
from pdjax.runner.entry_points import EntryPoints
from pdjax.runner.model_runner import check_pool_fits, shard_bytes
from pdjax.runner.pool_copy import kv_pool_copy
from pdjax.sched.buckets import BucketKey
from pdjax.transfer.local_kv import page_buckets

# Kernel names as they appear in a compiled executable's text (Pallas names its calls).
_KERNEL_NAMES = re.compile(
    r"\b((?:ragged_paged_attention|mla_sparse_attention|mla_dense_attention|indexer_scores"
    r"|grouped_matmul)"
    r"_(?:tpu|gpu)(?:_\w+)?)\b")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One executable to compile: ``kind`` (the table above), ``name`` (unique, printable),
    ``key`` (the ``BucketKey`` for forwards) and ``lower`` (returns ``jax.stages.Lowered``)."""

    kind: str
    name: str
    lower: Callable[[], Any]
    key: BucketKey | None = None


@dataclasses.dataclass
class CompiledEntry:
    """What compiling one ``Entry`` gave. Bytes are per chip, from the compiler's
    ``memory_analysis()``: ``argument_bytes`` (weights, KV cache, inputs), ``output_bytes``,
    ``alias_bytes`` (outputs that reuse a donated argument: the KV cache), ``temp_bytes``
    (scratch the executable needs while it runs), ``code_bytes``. ``kernels``: the Pallas
    kernels it calls. ``pool_copy``: for a forward, why it does not update the KV pool in
    place (``runner/pool_copy.py``; None when it does). ``error``: the compiler's message when
    it failed (the rest is then 0)."""

    kind: str
    name: str
    seconds: float
    kernels: tuple[str, ...] = ()
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    pool_copy: str | None = None
    error: str | None = None
    executable: Any = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None


class AbstractEngine:
    """A server's executables for ``target``, without weights or device arrays.

    Args:
      args: the serving settings (``ServerArgs``: model, page size, pool, buckets, TP).
      target: where to compile (``pdjax.aot.targets``); its first ``args.tp_size`` devices
        form the ``tp`` mesh.
      buckets: the shapes to compile instead of those ``make_buckets`` derives from ``args``
        (as ``EngineCore(buckets=...)``; ``ValueError`` when they cannot hold every batch).

    Raises:
      ValueError: a checkpoint whose config cannot be read, a TP size the target does not have
        or the model cannot split (named field).
    """

    def __init__(self, args: ServerArgs, target: Target, buckets=None):
        if args.tp_size > len(target.devices):
            raise ValueError(f"tp_size: {args.tp_size} devices asked, {target.name} has "
                             f"{len(target.devices)}")
        self.args = args
        self.target = target
        self.config = config = resolve_engine_config(args, platform=target.platform)
        if config.attention_impl not in (target.platform, "xla", "reference"):
            raise ValueError(f"attention_backend: {config.attention_impl!r} does not run on "
                             f"{target.platform} (auto, xla or reference)")
        self.family = model_family(checkpoint_architecture(config.model_path))
        self.mesh = Mesh(np.array(target.devices[:args.tp_size]), ("tp",))
        self.model_cfg = run_config(self.family, checkpoint_config(config.model_path),
                                    args.tp_size, args.ep_size, args.moe_a2a_backend,
                                    args.dp_size, attention_impl=config.attention_impl)
        # DP attention: num_pages are the group's, a rank's share per chip (dp_attention.py)
        self.pages_per_chip = args.num_pages // args.dp_size
        model = nnx.eval_shape(lambda: self.family.model_class(
            self.model_cfg, dtype=config.dtype, rngs=nnx.Rngs(0),
            **model_kwargs(args, config.model_path)))
        self.graphdef, self.state = abstract_model(
            model, self.family.param_specs(self.model_cfg, args.tp_size), self.mesh)
        self.context_length = config.scheduler.max_request_tokens
        self.buckets = make_buckets(args, self.context_length, config.attention_impl,
                                    self.family)
        if buckets is not None:
            buckets.check_serves(self.buckets)
            self.buckets = buckets
        self._lowered = {}                    # BucketKey -> its lowered forward (lowered once)
        self.cache_specs = tuple(model.cache_spec(self.pages_per_chip, args.page_size,
                                                  config.kv_dtype,
                                                  row_align=kv_row_align(target.platform)))
        self.jits = EntryPoints(self.graphdef, self.mesh, self.cache_specs,
                                max_rows=self.buckets.max_rows,
                                vocab_size=self.model_cfg.vocab_size, page_size=args.page_size,
                                chunk_size=args.chunked_prefill_size,
                                dp_size=args.dp_size, pages_per_rank=self.pages_per_chip)
        (self.caches, self.penalty_counts, self.prompt_seen,
         self.no_prev_tokens) = self.jits.abstract_device_state()
        check_pool_fits(self.caches, args.num_pages, args.page_size, target.hbm_bytes)

    def device_context(self):
        """``Target.device_context`` of the target (tracing needs it)."""
        return self.target.device_context()

    # ------------------------------------------------------------------ sizes
    def weight_bytes_per_chip(self) -> int:
        """Bytes of the parameters one chip holds (its shards of every array)."""
        return sum(shard_bytes(leaf) for leaf in jax.tree.leaves(self.state))

    def kv_bytes_per_page_per_chip(self) -> int:
        """Bytes one KV page takes on one chip, over every buffer and layer."""
        return sum(shard_bytes(c) for c in self.caches.values()) // self.pages_per_chip

    # ------------------------------------------------------------------ entries
    def entries(self, which: str = "all") -> list[Entry]:
        """What a server of these settings compiles: ``"all"`` (every bucket and helper
        executable) or ``"core"`` (``Buckets.core_keys``: the largest decode and extend shapes,
        which hold every batch, and their helpers)."""
        if which not in ("all", "core"):
            raise ValueError(f"entries: 'all' or 'core', got {which!r}")
        keys = self.buckets.all_keys() if which == "all" else self.buckets.core_keys()
        out = [Entry(k.entry, f"{k.entry} T={k.num_tokens} R={k.num_rows} P={k.pages_per_seq}",
                     functools.partial(self._lower_forward, k), k) for k in keys]
        for tokens in sorted({k.num_tokens for k in keys if k.entry == "extend"}):
            out.append(Entry("prompt_logprobs", f"prompt_logprobs T={tokens}",
                             functools.partial(self._lower_prompt_logprobs, tokens)))
        for entry, rows in sorted({(k.entry, k.num_rows) for k in keys}):
            out.append(Entry("resample", f"resample {entry} R={rows}",
                             functools.partial(self._lower_resample, entry, rows)))
        out.append(Entry("init_penalty_slot", "init_penalty_slot", lambda: (
            self.jits.lower_init_penalty_slot(self.prompt_seen, self.penalty_counts))))
        max_pages = -(-self.context_length // self.args.page_size)
        pages = page_buckets(max_pages) if which == "all" else page_buckets(max_pages)[-1:]
        for n in pages:
            out += [Entry("gather_pages", f"gather_pages n={n}",
                          functools.partial(self.jits.lower_gather_pages, self.caches, n)),
                    Entry("scatter_pages", f"scatter_pages n={n}",
                          functools.partial(self.jits.lower_scatter_pages, self.caches, n))]
        return out

    def _lower_forward(self, key: BucketKey):
        if key not in self._lowered:
            self._lowered[key] = self.jits.lower_forward(
                key, self.state, self.caches, self.penalty_counts, self.prompt_seen,
                self.no_prev_tokens)
        return self._lowered[key]

    def _forward_key(self, match) -> BucketKey:
        """A bucket ``match(key)`` accepts: one already lowered if any (lowering a real-size
        model takes minutes), else the first in ``Buckets.all_keys`` order."""
        lowered = [k for k in self._lowered if match(k)]
        return lowered[0] if lowered else next(k for k in self.buckets.all_keys() if match(k))

    def _forward_outputs(self, entry: str, rows: int):
        """The shapes and shardings of a forward's ``(StepOutputs, hidden, ..., logits)`` for a
        bucket of ``entry`` with ``rows`` logits rows (what resample takes), from its
        lowering's output info (no compile)."""
        key = self._forward_key(lambda k: k.entry == entry and k.num_rows == rows)
        with self.device_context():
            return self._lower_forward(key).out_info

    def _lower_resample(self, entry: str, rows: int):
        out = self._forward_outputs(entry, rows)
        first, logits = _sharded(out[0], self.jits.replicated), _sharded(out[4],
                                                                          self.jits.replicated)
        return self.jits.lower_resample(first, logits, self.prompt_seen, self.penalty_counts)

    def _lower_prompt_logprobs(self, tokens: int):
        key = self._forward_key(lambda k: k.entry == "extend" and k.num_tokens == tokens)
        with self.device_context():
            hidden = self._lower_forward(key).out_info[1]
        return self.jits.lower_prompt_logprobs(self.state,
                                               _sharded(hidden, self.jits.replicated))

    # ------------------------------------------------------------------ compiling
    def compile_entry(self, entry: Entry) -> CompiledEntry:
        """Lower and compile ``entry`` for the target; a compiler error is reported in
        ``CompiledEntry.error`` with the entry's name, not raised."""
        t0 = time.monotonic()
        try:
            with self.device_context():
                compiled = entry.lower().compile()
        except Exception as e:  # noqa: BLE001 (the compiler's error is the result)
            return CompiledEntry(entry.kind, entry.name, time.monotonic() - t0,
                                 error=f"{type(e).__name__}: {e}")
        seconds = time.monotonic() - t0
        stats = compiled.memory_analysis()
        text = _executable_text(compiled)
        return CompiledEntry(
            entry.kind, entry.name, seconds,
            kernels=tuple(sorted(set(_KERNEL_NAMES.findall(text)))),
            argument_bytes=int(stats.argument_size_in_bytes),
            output_bytes=int(stats.output_size_in_bytes),
            alias_bytes=int(stats.alias_size_in_bytes),
            temp_bytes=int(stats.temp_size_in_bytes),
            code_bytes=int(stats.generated_code_size_in_bytes),
            # Forwards and the page scatter (staging path, HiCache loads) take the pool donated.
            pool_copy=(kv_pool_copy(compiled, [shard_bytes(c) for c in self.caches.values()],
                                       [c.dtype.itemsize for c in self.caches.values()])
                       if entry.key is not None or entry.kind == "scatter_pages" else None),
            executable=compiled)


def _sharded(tree, default_sharding):
    """``out_info`` shapes with a sharding each (outputs left to the compiler get
    ``default_sharding``)."""
    def one(info):
        sharding = getattr(info, "sharding", None) or default_sharding
        return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def _executable_text(compiled) -> str:
    with contextlib.suppress(Exception):
        return compiled.as_text() or ""
    return ""
