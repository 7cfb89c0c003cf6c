"""Start-up phase timing of ``EngineCore`` (``scripts/bench_startup.py`` reads the printed line)."""

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
