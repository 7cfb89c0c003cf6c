"""Start-up reports of ``EngineCore``: the phase timing (``scripts/bench_startup.py`` reads the
printed line) and a context length the KV pool cuts."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("pdjax.engine.core")


class PhaseTimer:
    """``timer(name)`` records the seconds since the previous call (or since construction) as
    phase ``name`` in ``phases`` (in order); ``report()`` logs and prints them as one line."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round(now - self._t, 2)
        self._t = now

    def report(self) -> None:
        line = ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items())
        logger.info("start-up phases (s): %s", line)
        print(f"pdjax start-up phases (s): {line}", flush=True)


def warn_if_context_cut(sched_config, context_length: int) -> None:
    """Log a warning when the KV pool (``sched_config.num_pages`` pages) holds fewer tokens
    than the context length asked for (``sched_config.max_context_len``), so that requests get
    ``context_length`` (the scheduler's ``max_request_tokens``) instead."""
    if context_length < sched_config.max_context_len:
        logger.warning("context length %d cut to %d tokens: the KV pool holds %d pages of %d "
                       "(raise --max-total-tokens for the full length)",
                       sched_config.max_context_len, context_length, sched_config.num_pages,
                       sched_config.page_size)
