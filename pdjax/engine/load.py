"""What ``/get_load`` and the router see of one engine: queue sizes and pages (DESIGN.md §4).
Pure Python over the scheduler's counters."""

from __future__ import annotations

from typing import Any

from pdjax.sched.scheduler import Scheduler


def engine_load(s: Scheduler, role=None) -> dict[str, Any]:
    """Queue sizes and pages. ``kv_usage``: the share of the pool that is not free and not
    evictable prefix cache (what new requests cannot get), in [0, 1]. With a PD ``role``
    (``EngineRole`` whose ``load()`` says something) also: pages nothing can evict (a finished
    PD server must show 0), prompt tokens computed (decode: stays 0), and the role's queue
    sizes (``role.load()``)."""
    total = s.kv.num_pages - len(s.kv.null_pages)      # DP attention: a null page a rank
    pinned = s.num_used_pages - s.prefix_cache.num_evictable_pages
    load = {"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
            "num_used_pages": s.num_used_pages, "num_total_pages": total,
            "num_cached_pages": s.prefix_cache.num_cached_pages, "kv_usage": pinned / total}
    if hasattr(s.kv, "rank_load"):    # DP attention: each rank's requests and pages
        load["dp_ranks"] = s.kv.rank_load()
    role_load = role.load() if role is not None else {}
    if role_load:
        load.update(num_evictable_pages=s.prefix_cache.num_evictable_pages,
                    num_pinned_pages=pinned,
                    num_prompt_tokens_computed=s.num_prompt_tokens_computed, **role_load)
    return load
