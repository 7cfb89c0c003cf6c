"""When the device runs each step: a watcher thread that timestamps the completion of every
dispatched forward, for the overlap measurements (``scripts/bench_step_overlap.py``).

``EngineCore.dispatch_hooks`` calls ``on_dispatch`` right after each forward is dispatched.
Per step ``i`` (in dispatch order), with ``done[i]`` the completion time:

    device busy on step i:   from max(dispatch[i], done[i-1]) to done[i]
    device idle before i:    max(0, dispatch[i] - done[i-1])   (it waited for the host)

A step dispatched while the previous one still ran (``jax.Array.is_ready()`` False at
dispatch) had no idle gap at all; that is recorded exactly. Otherwise the watcher's timestamp
bounds the completion from above (it wakes a little after the device finishes), so the idle
gap it gives is a lower bound; ``exposed_steps`` counts those steps so a reader can judge.
"""

from __future__ import annotations

import queue
import threading
import time


class DeviceTimeline:
    """Attach with ``core.dispatch_hooks.append(timeline.on_dispatch)``; ``close()`` then
    ``summary()``."""

    def __init__(self):
        self.records: list[dict] = []        # dispatch_s, done_s, prev_busy, entry, rows
        self._q: queue.Queue = queue.Queue()
        self._last = None
        self._thread = threading.Thread(target=self._watch, name="pdjax-timeline", daemon=True)
        self._thread.start()

    def on_dispatch(self, batch, key, tokens, t_dispatch: float) -> None:
        prev_busy = self._last is not None and not self._last.is_ready()
        self._last = tokens
        self._q.put((dict(dispatch_s=t_dispatch, prev_busy=prev_busy, entry=key.entry,
                          rows=len(batch.rows)), tokens))

    def _watch(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            rec, tokens = item
            tokens.block_until_ready()
            rec["done_s"] = time.perf_counter()
            self.records.append(rec)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def summary(self, records: list[dict] | None = None) -> dict:
        """Device busy and idle seconds over consecutive ``records`` (the first one only opens
        the window): ``idle_fraction`` = idle / (busy + idle)."""
        recs = self.records if records is None else records
        busy = idle = 0.0
        exposed = 0
        for prev, cur in zip(recs, recs[1:]):
            gap = 0.0 if cur["prev_busy"] else max(0.0, cur["dispatch_s"] - prev["done_s"])
            exposed += not cur["prev_busy"]
            idle += gap
            busy += cur["done_s"] - max(cur["dispatch_s"], prev["done_s"])
        n = max(len(recs) - 1, 0)
        return {"num_steps": n, "device_busy_s": busy, "device_idle_s": idle,
                "idle_fraction": idle / (busy + idle) if busy + idle > 0 else None,
                "exposed_steps": exposed,
                "step_ms": 1000.0 * (busy + idle) / n if n else None}
