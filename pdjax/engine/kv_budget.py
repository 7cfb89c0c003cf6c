"""The KV pool sized from device memory: SGLang's ``--mem-fraction-static`` (DESIGN.md §3).

SGLang's rule: the weights and the KV pool together may take ``mem_fraction_static`` of each
device's memory; the rest is for a step's activations and the compiler's temporaries. So, per
device, after the weights have loaded::

    budget     = mem_fraction_static * device memory - bytes in use (the weights)
    pages      = budget // (bytes of one page of the pool on one device)
    max_total_tokens = (pages - 1) * page_size       (page 0, the null page, is one of them)

Device memory is the allocator's limit on TPU and GPU, physical memory on CPU
(``model_runner.device_memory_bytes``). Bytes in use are the larger of the weights' shard
bytes and, where the backend reports it, the allocator's ``bytes_in_use``. With DP attention
the pool's pages are split between ``dp_size`` ranks and a device holds one rank's share.
"""

from __future__ import annotations

from typing import Any

MIN_PAGES_PER_RANK = 2


def tokens_for_fraction(fraction: float, device_bytes: int, used_bytes: int,
                        bytes_per_page: float, page_size: int, dp_size: int = 1) -> int:
    """``max_total_tokens`` that fill ``fraction`` of ``device_bytes`` after ``used_bytes``.

    ``bytes_per_page``: bytes one page of the (whole group's) pool costs one device (a DP
    rank's device holds ``1 / dp_size`` of the pages). Pages are rounded down to a multiple of
    ``dp_size``. Raises ``ValueError`` naming ``mem_fraction_static`` when fewer than
    ``MIN_PAGES_PER_RANK`` pages per rank fit.
    """
    budget = int(fraction * device_bytes) - used_bytes
    pages = int(budget // bytes_per_page) if budget > 0 else 0
    pages -= pages % dp_size
    if pages < MIN_PAGES_PER_RANK * dp_size + 1:
        raise ValueError(
            f"mem_fraction_static: {fraction} of {device_bytes / 2**30:,.2f} GiB per device "
            f"leaves {max(budget, 0) / 2**30:,.3f} GiB for the KV pool after "
            f"{used_bytes / 2**30:,.3f} GiB of weights, fewer than "
            f"{MIN_PAGES_PER_RANK * dp_size + 1} pages of {bytes_per_page:,.0f} B; raise it "
            f"or set --max-total-tokens")
    return (pages - 1) * page_size


def device_bytes_in_use(state_leaves: list[Any], device: Any) -> int:
    """Bytes ``device`` holds after loading: the larger of the weights' bytes on one device
    (``state_leaves``: arrays with shardings) and the allocator's ``bytes_in_use`` where the
    backend reports one (TPU, GPU; not CPU)."""
    from pdjax.runner.model_runner import shard_bytes

    weights = sum(shard_bytes(leaf) for leaf in state_leaves
                  if hasattr(leaf, "sharding") and hasattr(leaf, "shape"))
    try:
        stats = device.memory_stats() or {}
    except Exception:          # some backends do not implement it
        stats = {}
    return max(weights, int(stats.get("bytes_in_use", 0)))
