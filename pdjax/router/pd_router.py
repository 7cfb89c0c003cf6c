"""``PDRouter``: the pairing of prefill and decode workers, and what it merges of their answers
(the package docstring says what the router does; DESIGN.md §4)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
import urllib.parse
from typing import Any

import aiohttp

from pdjax.router.pool import WorkerPool, draw_room
from pdjax.server.validation import checked_num_samples

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
# Stateless POSTs a server answers from its tokenizer and parsers alone (``handle_utility``).
UTILITY_PATHS = ("/tokenize", "/detokenize", "/separate_reasoning", "/parse_function_call")
_FORWARD_HEADERS = ("Authorization",)


def _merge_input_logprobs(decode_obj: Any, prefill_obj: Any) -> Any:
    """Put the prefill's prompt logprobs in front of the decode's, sample by sample."""
    if isinstance(decode_obj, list):
        if isinstance(prefill_obj, list) and len(prefill_obj) == len(decode_obj):
            return [_merge_input_logprobs(d, p) for d, p in zip(decode_obj, prefill_obj)]
        return decode_obj
    if not isinstance(decode_obj, dict) or not isinstance(prefill_obj, dict):
        return decode_obj
    dm, pm = decode_obj.get("meta_info"), prefill_obj.get("meta_info")
    if not isinstance(dm, dict) or not isinstance(pm, dict):
        return decode_obj
    for key in ("input_token_logprobs", "input_top_logprobs"):
        if isinstance(pm.get(key), list):
            dm[key] = pm[key] + (dm.get(key) if isinstance(dm.get(key), list) else [])
    return decode_obj


def _first_sse_json(raw: bytes) -> Any:
    for line in raw.splitlines():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            with contextlib.suppress(ValueError):
                return json.loads(line[6:])
    return None


class PDRouter:
    """Pairing of prefill and decode workers (``policy``: see ``WorkerPool``).

    ``prefills``: ``[(url, bootstrap_port or None)]``; ``decodes``: ``[url]``.
    ``load_poll_interval_s``: how often every worker's ``/get_load`` is read for
    ``kv_usage`` (load_aware with more than one worker of a role only). Raises ``ValueError`` for an empty list, a URL without
    host or an unknown policy.
    """

    def __init__(self, prefills: list[tuple[str, int | None]], decodes: list[str],
                 request_timeout_s: float = 3600.0, seed: int | None = None,
                 policy: str = "load_aware", load_poll_interval_s: float = 1.0):
        if not prefills or not decodes:
            raise ValueError("at least one --prefill and one --decode server are required")
        for url in [p[0] for p in prefills] + decodes:
            if not urllib.parse.urlparse(url).hostname:
                raise ValueError(f"worker URL {url!r} has no host (expected http://host:port)")
        self.prefills = [(u.rstrip("/"), p) for u, p in prefills]
        self.decodes = [u.rstrip("/") for u in decodes]
        self.request_timeout_s = request_timeout_s
        self._rng = random.Random(seed)
        self.prefill_pool = WorkerPool([u for u, _ in self.prefills], policy)
        self.decode_pool = WorkerPool(self.decodes, policy)
        if not load_poll_interval_s > 0:
            raise ValueError(f"load_poll_interval_s: {load_poll_interval_s!r} must be > 0")
        self.load_poll_interval_s = load_poll_interval_s
        self._poller: asyncio.Task | None = None
        # Prefill halves whose decode already answered: left to finish (never cancelled: a
        # cancel reads as a client abort on the prefill and fails a room that succeeded).
        self._finishing: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None
        self.num_requests = 0
        self.num_errors = 0

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout, trust_env=False)
        if self.prefill_pool.policy == "load_aware" and \
                max(len(self.prefills), len(self.decodes)) > 1:   # a choice to make
            self._poller = asyncio.create_task(self._poll_loads())

    def mark_down(self, pool: WorkerPool, i: int) -> None:
        """A request could not reach worker ``i`` of ``pool``: skip it until the poller reads
        its ``/get_load`` again (``WorkerPool.DOWN_HOLD_S`` without a poller)."""
        pool.mark_down(i, hold_s=math.inf if self._poller is not None else None)

    def let_finish(self, task: asyncio.Task) -> None:
        """Keep ``task`` (a prefill's ``_post``) running after its request was answered; it
        ends when the prefill answers or the session times out, and ``close`` cancels it."""
        if not task.done():
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def close(self) -> None:
        await cancel_tasks(*self._finishing)
        if self._poller is not None:
            await cancel_tasks(self._poller)
            self._poller = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def poll_loads_once(self) -> None:
        """Read every worker's ``/get_load`` once into the pools' ``kv_usage``."""
        pools = [(self.prefill_pool, i) for i in range(len(self.prefills))] + \
            [(self.decode_pool, i) for i in range(len(self.decodes))]
        polled_at = time.monotonic()
        results = await asyncio.gather(*(get_json(self, pool.urls[i] + "/get_load",
                                                   timeout_s=self.load_poll_interval_s * 2)
                                         for pool, i in pools))
        for (pool, i), (status, body) in zip(pools, results):
            if status == 200:
                pool.set_kv_usage(i, body)
                pool.mark_up(i, polled_at)
            else:              # unreachable or not serving (a restart warming up): skip it
                pool.mark_down(i, hold_s=math.inf)

    async def _poll_loads(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.poll_loads_once()
            await asyncio.sleep(self.load_poll_interval_s)

    @property
    def workers(self) -> list[str]:
        return [u for u, _ in self.prefills] + self.decodes

    def pick(self) -> tuple[int, int]:
        """Indices of the prefill and decode for the next request, counted outstanding until
        ``prefill_pool.release`` / ``decode_pool.release``."""
        return self.prefill_pool.acquire(), self.decode_pool.acquire()

    def inject(self, path: str, body: dict[str, Any], prefill_url: str,
               bootstrap_port: int | None) -> list[int]:
        """Add the bootstrap fields to ``body`` (in place); returns the rooms drawn.
        ``ValueError`` (naming the field) for a body over the sample limits."""
        n = checked_num_samples(path, body)
        rooms = [draw_room(self._rng) for _ in range(n)]
        host = urllib.parse.urlparse(prefill_url).hostname
        body["bootstrap_host"] = host if n == 1 else [host] * n
        body["bootstrap_port"] = bootstrap_port if n == 1 else [bootstrap_port] * n
        body["bootstrap_room"] = rooms[0] if n == 1 else rooms
        return rooms


async def cancel_tasks(*tasks: asyncio.Task) -> None:
    """Cancel every task still running and wait for all of them (their errors swallowed)."""
    for t in tasks:
        if not t.done():
            t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


async def get_json(router: PDRouter, url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    """GET ``url`` with the router's session: ``(status, parsed JSON or the text)``; ``(503,
    why)`` when the worker could not be reached in ``timeout_s`` seconds."""
    try:
        async with router.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return 503, f"{type(e).__name__}: {e}"
