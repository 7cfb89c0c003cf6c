"""How ``pdjax.router`` picks its workers: one ``WorkerPool`` per role and the room draw.

Pure Python (no I/O): the router feeds it outstanding counts and ``/get_load`` answers.
"""

from __future__ import annotations

import random
import time
from typing import Any

from pdjax.server.validation import MAX_ROOM


def draw_room(rng: random.Random) -> int:
    """A bootstrap room in [1, 2**63): 0 means "unwritten" in the metadata row."""
    return rng.randint(1, MAX_ROOM)


POLICIES = ("load_aware", "round_robin")


def _usage(value: object) -> bool:
    """Whether ``value`` is a ``kv_usage``: a number in [0, 1]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


class WorkerPool:
    """The workers of one role and the router's view of their load (pure Python).

    ``outstanding[i]``: requests this router sent to worker ``i`` that have not finished
    (``acquire``/``release``); ``kv_usage[i]``: the share of its KV pool in use, from its last
    ``/get_load`` (``set_kv_usage``; 0 until the first poll). ``choose()`` returns the index
    to use: ``load_aware`` takes the fewest outstanding, then the lowest ``kv_usage``, then
    the first in round-robin order; ``round_robin`` ignores load. A worker the router could
    not reach (``mark_down``) is skipped for ``DOWN_HOLD_S`` (until its next good ``/get_load``,
    ``mark_up``, when the router polls), unless every worker is down: a dead worker has no requests
    outstanding, so without this the fewest-outstanding rule would send it the most (a fault
    run sent a killed worker half of 500 requests). Raises ``ValueError`` for an unknown policy or no workers.
    """

    DOWN_HOLD_S = 2.0

    def __init__(self, urls: list[str], policy: str = "load_aware"):
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} not in {POLICIES}")
        if not urls:
            raise ValueError("urls: at least one worker is required")
        self.urls = list(urls)
        self.policy = policy
        self.outstanding = [0] * len(urls)
        self.kv_usage = [0.0] * len(urls)
        self.num_chosen = [0] * len(urls)
        self.down_until = [0.0] * len(urls)
        self.down_at = [0.0] * len(urls)
        self._next = 0

    def mark_down(self, i: int, now: float | None = None, hold_s: float | None = None) -> None:
        """Worker ``i`` could not be reached: skip it for ``hold_s`` seconds (default
        ``DOWN_HOLD_S``; ``math.inf``: until ``mark_up``, for a router that polls it)."""
        now = time.monotonic() if now is None else now
        self.down_until[i] = now + (self.DOWN_HOLD_S if hold_s is None else hold_s)
        self.down_at[i] = now

    def mark_up(self, i: int, polled_at: float) -> None:
        """Worker ``i`` answered a ``/get_load`` sent at ``polled_at`` (monotonic): choose it
        again, unless it was marked down after that poll went out (a stale answer)."""
        if polled_at >= self.down_at[i]:
            self.down_until[i] = 0.0

    def choose(self, now: float | None = None) -> int:
        n = len(self.urls)
        now = time.monotonic() if now is None else now
        order = [(self._next + k) % n for k in range(n)]
        order = [j for j in order if self.down_until[j] <= now] or order
        if self.policy == "load_aware":
            i = min(order, key=lambda j: (self.outstanding[j], self.kv_usage[j]))
        else:
            i = order[0]
        self._next = (i + 1) % n
        self.num_chosen[i] += 1
        return i

    def acquire(self) -> int:
        """``choose()`` and count the request as outstanding on it."""
        i = self.choose()
        self.outstanding[i] += 1
        return i

    def release(self, i: int) -> None:
        self.outstanding[i] = max(0, self.outstanding[i] - 1)

    def set_kv_usage(self, i: int, load: object) -> None:
        """Take ``kv_usage`` from a ``/get_load`` body; anything else leaves it unchanged. A
        worker with DP attention (``dp_ranks``, each with its ``kv_usage``) counts as its
        least used rank's: a new request runs on one rank, the least loaded."""
        value = load.get("kv_usage") if isinstance(load, dict) else None
        ranks = load.get("dp_ranks") if isinstance(load, dict) else None
        if isinstance(ranks, list) and ranks and all(
                isinstance(r, dict) and _usage(r.get("kv_usage")) for r in ranks):
            value = min(r["kv_usage"] for r in ranks)
        if _usage(value):
            self.kv_usage[i] = float(value)

    def state(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"url": u, "outstanding": o, "kv_usage": k, "num_chosen": c, "down": d > now}
                for u, o, k, c, d in zip(self.urls, self.outstanding, self.kv_usage,
                                         self.num_chosen, self.down_until)]
