"""What ``python -m pdjax.aot`` prints: a table of the compiled entries and a per-chip HBM
budget, both from the compiler's ``memory_analysis`` (DESIGN.md §7).

    usable        = mem_fraction x HBM per chip
    weights       = the parameter shards one chip holds (their shard shapes)
    other args    = the largest forward's argument bytes (compiler) - weights - KV pool
    largest temp  = the largest temp bytes over every compiled entry (compiler)
    KV pages      = (usable - weights - other args - largest temp) // KV bytes per page per chip

The KV pool the entries were compiled with is replaced by what fits: the cache is donated
(``alias_bytes``) so its size does not change the temp a step needs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.aot.engine import AbstractEngine, CompiledEntry

_MIB = 1 << 20
_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class HbmBudget:
    """Per-chip HBM budget in bytes (the module docstring's formula); ``kv_pages`` may be
    negative (the model does not fit); ``kv_tokens = kv_pages * page_size``;
    ``fits_one_context``: at least one request of the full context length fits."""

    hbm_bytes: int
    mem_fraction: float
    weight_bytes: int
    other_argument_bytes: int
    largest_temp_bytes: int
    largest_temp_entry: str
    kv_bytes_per_page: int
    page_size: int
    context_length: int
    kv_pages: int
    dp: int

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_pages) * self.page_size

    @property
    def fits_one_context(self) -> bool:
        return self.kv_pages >= -(-self.context_length // self.page_size) + 1


def hbm_budget(engine: AbstractEngine, results: list[CompiledEntry], *, mem_fraction: float,
               dp: int = 1) -> HbmBudget:
    """The budget of ``engine``'s chips from ``results`` (its compiled entries).

    Raises:
      ValueError: ``mem_fraction`` outside (0, 1], or no forward compiled.
    """
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    forwards = [r for r in results if r.ok and r.kind in ("decode", "extend")]
    if not forwards:
        raise ValueError("no forward compiled: no budget")
    compiled = [r for r in results if r.ok]
    weights = engine.weight_bytes_per_chip()
    page_bytes = engine.kv_bytes_per_page_per_chip()
    pool = page_bytes * engine.pages_per_chip
    other = max(r.argument_bytes for r in forwards) - weights - pool
    temp = max(compiled, key=lambda r: r.temp_bytes)
    usable = int(mem_fraction * engine.target.hbm_bytes)
    pages = (usable - weights - max(0, other) - temp.temp_bytes) // page_bytes
    return HbmBudget(engine.target.hbm_bytes, mem_fraction, weights, other, temp.temp_bytes,
                     temp.name, page_bytes, engine.args.page_size, engine.context_length,
                     int(pages), dp)


def format_entries(results: list[CompiledEntry]) -> str:
    """One line per compiled entry: name, compile seconds, kernels, argument / temp MiB."""
    lines = [f"{'entry':34s} {'compile s':>9s} {'args MiB':>10s} {'temp MiB':>9s}  kernels"]
    for r in results:
        if r.ok:
            kernels = ", ".join(r.kernels) or "-"
            if r.pool_copy is not None:      # runner/pool_copy.py: exact, or from sizes
                kernels += ("  [temp >= a KV buffer]" if "sizes only" in r.pool_copy
                            else "  [copies the KV pool]")
            lines.append(f"{r.name:34s} {r.seconds:9.1f} {r.argument_bytes / _MIB:10.1f} "
                         f"{r.temp_bytes / _MIB:9.1f}  {kernels}")
        else:
            lines.append(f"{r.name:34s} {r.seconds:9.1f} {'FAILED':>10s} {'':9s}  "
                         f"{r.error.splitlines()[0][:300]}")
    return "\n".join(lines)


def _size(num_bytes: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if abs(num_bytes) >= _GIB:
        return f"{num_bytes / _GIB:.2f} GiB"
    return f"{num_bytes / _MIB:.1f} MiB"


def format_budget(engine: AbstractEngine, budget: HbmBudget) -> str:
    """The per-chip HBM budget and how many KV pages / tokens fit."""
    b = budget
    tp = engine.args.tp_size
    chips = tp * b.dp
    spare = len(engine.target.devices) - chips
    lines = [
        f"HBM per chip ({engine.target.device_kind}; {chips} chip{'s' * (chips > 1)}: "
        f"TP {tp} x DP {b.dp}"
        + (f", EP {engine.args.ep_size}" if engine.args.ep_size > 1 else "")
        + (f", DP attention {engine.args.dp_size}" if engine.args.dp_size > 1 else "")
        + (f"; {spare} of {engine.target.name}'s chips unused"
                                  if spare > 0 else "") + "):",
        f"  HBM {_size(b.hbm_bytes)} x mem_fraction {b.mem_fraction} = "
        f"{_size(int(b.mem_fraction * b.hbm_bytes))} usable",
        f"  weights            {_size(b.weight_bytes):>12s}",
        f"  other arguments    {_size(b.other_argument_bytes):>12s}",
        f"  largest temp       {_size(b.largest_temp_bytes):>12s} ({b.largest_temp_entry})",
        f"  KV per page        {b.kv_bytes_per_page / 1024:9.1f} KiB ({b.page_size} tokens)",
    ]
    if b.kv_pages <= 0:
        lines.append(f"  DOES NOT FIT: {_size(-b.kv_pages * b.kv_bytes_per_page)} short "
                     "before the first KV page")
    else:
        total = f" ({b.kv_tokens * b.dp} over {b.dp} replicas)" if b.dp > 1 else ""
        lines.append(f"  KV pool            {b.kv_pages} pages = {b.kv_tokens} tokens{total}; "
                     f"{_size(b.kv_pages * b.kv_bytes_per_page)}")
        dp_attn = engine.args.dp_size
        if dp_attn > 1:     # each rank's chips hold its own requests' KV (dp_attention.py)
            group = b.kv_tokens * dp_attn
            lines.append(f"  KV tokens          {b.kv_tokens} per chip, {group} for the group "
                         f"of {tp} chips (DP attention {dp_attn}: each rank its own requests)"
                         + (f"; {group * b.dp} over {b.dp} replicas" if b.dp > 1 else ""))
        lines.append(f"  one request of {b.context_length} tokens "
                     f"{'fits' if b.fits_one_context else 'does NOT fit'}")
    host = host_kv_pool(engine, budget)
    if host is not None:
        slots, nbytes = host
        lines.append(f"host memory (HiCache L2, not HBM): {slots} pages = "
                     f"{slots * b.page_size} tokens; {_size(nbytes)} per server of {tp} chips "
                     f"(the page gather / scatter entries are its copies)")
    return "\n".join(lines)


def host_kv_pool(engine: AbstractEngine, budget: HbmBudget) -> tuple[int, int] | None:
    """``(pages, bytes)`` of the HiCache host pool a server with these settings holds
    (``--enable-hierarchical-cache``; None without): ``--hicache-size`` GiB, else
    ``--hicache-ratio`` times the device pool, whose pages are the budget's (all chips' shards
    of a page, as ``kv.hicache.host_pool.page_bytes`` counts them)."""
    args = engine.args
    if not args.enable_hierarchical_cache:
        return None
    page = sum(int(np.prod(c.shape, dtype=np.int64)) // c.shape[1] * np.dtype(c.dtype).itemsize
               for c in engine.caches.values())      # [L, N, ...]: one page, every layer
    if args.hicache_size > 0:
        slots = args.hicache_size * _GIB // page
    else:
        slots = int(args.hicache_ratio * max(0, budget.kv_pages) * args.dp_size)
    return slots, slots * page


def as_json(engine: AbstractEngine, results: list[CompiledEntry],
            budget: HbmBudget | None) -> dict:
    """The run as a JSON-able dict: target, settings, entries, budget (``--json``)."""
    entries = [{f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                if f.name != "executable"} for r in results]
    for e in entries:
        e["kernels"] = list(e["kernels"])
    return {"target": engine.target.name, "device_kind": engine.target.device_kind,
            "model_path": engine.config.model_path, "tp_size": engine.args.tp_size,
            "ep_size": engine.args.ep_size, "moe_a2a_backend": engine.args.moe_a2a_backend,
            "dp_attention_size": engine.args.dp_size,
            "page_size": engine.args.page_size, "context_length": engine.context_length,
            "entries": entries,
            "budget": None if budget is None else {**dataclasses.asdict(budget),
                                                   "kv_tokens": budget.kv_tokens,
                                                   "kv_tokens_group": budget.kv_tokens
                                                   * engine.args.dp_size,
                                                   "fits_one_context": budget.fits_one_context}}
