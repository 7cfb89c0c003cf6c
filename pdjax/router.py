"""``python -m pdjax.router``: a minimal PD router (DESIGN.md §4, the router).

    python -m pdjax.router --prefill http://127.0.0.1:30001 8998 --decode http://127.0.0.1:30002 \\
        [--prefill URL [BOOTSTRAP_PORT] ...] [--decode URL ...] --host 127.0.0.1 --port 30000

The same arguments as sglang-router's PD mode. For every generation request
(``/generate``, ``/v1/completions``, ``/v1/chat/completions``) it picks a prefill and a decode
server (``--policy load_aware``, the default: the one with the fewest requests this router has
outstanding on it, ties broken by the lowest ``kv_usage`` its ``/get_load`` reported in the
last poll, then round robin; ``--policy round_robin``: round robin), adds ``bootstrap_host``
(the prefill URL's host), ``bootstrap_port`` (the prefill's bootstrap port, or null: the
server's default) and ``bootstrap_room`` (a random room in [1, 2**63); a list of one room per
sample for batches and ``n > 1``), POSTs the same body to both at once, and returns the
decode server's answer, streaming included:

    client --> router --body + bootstrap fields--> prefill  (computes the prompt, sends the KV)
                      '-------- same body ------->  decode  (receives the KV, generates) --> client

Errors: a 4xx from either server reaches the client as that 4xx with its body (a decode that
failed because the prefill refused the request gives way to the prefill's 4xx); a server that
failed (5xx) or could not be reached gives 502 ``router_error``; the other half is cancelled.
Before anything is drawn, a body is refused with 400 when it is not JSON (or nested deeper than
the parser allows), or asks for more than ``MAX_SAMPLES`` samples (``MAX_BATCH_SIZE`` prompts,
``n`` up to ``MAX_N``), the limits the servers apply. With
``return_logprob`` on ``/generate``, the prompt logprobs computed by the prefill are put in
front of the decode's ``meta_info.input_token_logprobs`` (and ``input_top_logprobs``), per
sample and per stream event. ``/health`` is 200 only when every worker is healthy.
``/tokenize``, ``/detokenize``, ``/separate_reasoning`` and ``/parse_function_call`` are
answered by the first prefill server (``handle_utility``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import sys
import time
import urllib.parse
from typing import Any

import aiohttp
from aiohttp import web

from pdjax.server.app import listening
from pdjax.server.errors import RequestError
from pdjax.server.errors import error_body
from pdjax.server.http_json import (CLIENT_MAX_SIZE, SSE_HEADERS, error_response,
                                    read_json_object)
from pdjax.router_pool import POLICIES, WorkerPool, draw_room
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
        await _cancel(*self._finishing)
        if self._poller is not None:
            await _cancel(self._poller)
            self._poller = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def poll_loads_once(self) -> None:
        """Read every worker's ``/get_load`` once into the pools' ``kv_usage``."""
        pools = [(self.prefill_pool, i) for i in range(len(self.prefills))] + \
            [(self.decode_pool, i) for i in range(len(self.decodes))]
        polled_at = time.monotonic()
        results = await asyncio.gather(*(_get_json(self, pool.urls[i] + "/get_load",
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


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------

ROUTER_KEY = web.AppKey("pdjax_router", PDRouter)


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return error_response(message, status, param, "router_error")


async def _post(session: aiohttp.ClientSession, url: str, body: dict,
                headers: dict) -> tuple[int, bytes, str]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


async def _post_worker(router: "PDRouter", pool: WorkerPool, i: int, url: str, body: dict,
                       headers: dict) -> tuple[int, bytes, str]:
    """``_post`` to worker ``i`` of ``pool``; a connection failure marks it down."""
    try:
        return await _post(router.session, url, body, headers)
    except (aiohttp.ClientConnectionError, OSError):
        router.mark_down(pool, i)
        raise


def _error_text(raw: bytes) -> str:
    with contextlib.suppress(ValueError):
        obj = json.loads(raw)
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if isinstance(err, str):
                return err
    return raw.decode(errors="replace")[:2000]


async def _cancel(*tasks: asyncio.Task) -> None:
    for t in tasks:
        if not t.done():
            t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


async def handle_generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    path = request.path
    try:
        body = await read_json_object(request)
    except RequestError as e:
        return _error(e.message, e.status, e.param)
    router.num_requests += 1
    try:
        checked_num_samples(path, body)
    except RequestError as e:
        router.num_errors += 1
        return _error(e.message, e.status, e.param)
    p_i, d_i = router.pick()
    try:
        return await _generate(request, router, body, p_i, d_i)
    finally:
        router.decode_pool.release(d_i)


async def _generate(request: web.Request, router: PDRouter, body: dict, p_i: int,
                    d_i: int) -> web.StreamResponse:
    path = request.path
    (p_url, p_port), d_url = router.prefills[p_i], router.decodes[d_i]
    try:
        router.inject(path, body, p_url, p_port)
    except BaseException:
        router.prefill_pool.release(p_i)
        raise
    headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
    merge = path == "/generate" and bool(body.get("return_logprob"))
    p_task = asyncio.create_task(_post_worker(router, router.prefill_pool, p_i, p_url + path,
                                              body, headers))
    # The prefill's work is over when it answers (its KV is sent); the decode's at the end.
    p_task.add_done_callback(lambda _t: router.prefill_pool.release(p_i))
    if body.get("stream"):
        return await _stream(request, router, p_task, d_i, body, headers, merge)
    d_task = asyncio.create_task(_post_worker(router, router.decode_pool, d_i, d_url + path,
                                              body, headers))
    try:
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and not d_task.done():
            p_status, p_raw, p_type = _result(p_task)
            if p_status != 200:
                await _cancel(d_task)
                router.num_errors += 1
                return _worker_error("prefill", p_url, p_status, p_raw, p_type)
        await asyncio.wait({d_task})
        d_status, d_raw, d_type = _result(d_task)
        if d_status != 200:
            router.num_errors += 1
            verdict = await _prefill_verdict(p_task, p_url)
            await _cancel(p_task)
            return verdict or _worker_error("decode", d_url, d_status, d_raw, d_type)
        # The decode succeeded, so the prefill's transfer is over: it answers soon; never
        # cancel it (that would abort a room that succeeded). Its prompt logprobs are merged
        # when it answers in time.
        router.let_finish(p_task)
        if merge:
            await asyncio.wait({p_task}, timeout=PREFILL_VERDICT_S)
        if merge and p_task.done():
            p_status, p_raw, _ = _result(p_task)
            if p_status == 200:
                with contextlib.suppress(ValueError):
                    merged = _merge_input_logprobs(json.loads(d_raw), json.loads(p_raw))
                    return web.json_response(merged)
        return web.Response(status=200, body=d_raw, content_type="application/json")
    finally:
        if p_task not in router._finishing:
            await _cancel(p_task)
        await _cancel(d_task)


PREFILL_VERDICT_S = 5.0        # how long a failed decode waits for the prefill's own answer


def _worker_error(role: str, url: str, status: int, raw: bytes,
                  content_type: str) -> web.Response:
    """A worker's failure as the client sees it: its 4xx as is, anything else 502."""
    if 400 <= status < 500:
        return web.Response(status=status, body=raw,
                            content_type=content_type.split(";")[0] or "application/json")
    where = f"{role} server {url}" if url else f"{role} server"
    return _error(f"{where} failed ({status}): {_error_text(raw)}", 502)


async def _prefill_verdict(p_task: asyncio.Task, p_url: str) -> web.Response | None:
    """After a decode failure: the prefill's 4xx if it refused the request (the decode failed
    because of it), else None. Waits up to ``PREFILL_VERDICT_S`` for the prefill's answer."""
    if not p_task.done():
        await asyncio.wait({p_task}, timeout=PREFILL_VERDICT_S)
    if not p_task.done():
        return None
    status, raw, content_type = _result(p_task)
    if 400 <= status < 500:
        return _worker_error("prefill", p_url, status, raw, content_type)
    return None


def _result(task: asyncio.Task) -> tuple[int, bytes, str]:
    """A finished ``_post`` task's result; a connection error counts as a 502."""
    try:
        return task.result()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return 502, json.dumps({"error": {"message": f"{type(e).__name__}: {e}"}}).encode(), ""


async def _stream(request: web.Request, router: PDRouter, p_task: asyncio.Task, d_i: int,
                  body: dict, headers: dict, merge: bool) -> web.StreamResponse:
    session = router.session
    d_url = router.decodes[d_i] + request.path

    async def open_decode() -> aiohttp.ClientResponse:
        return await session.post(d_url, json=body, headers=headers)

    d_open = asyncio.create_task(open_decode())
    d_resp = None
    try:
        done, _ = await asyncio.wait({p_task, d_open}, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and not d_open.done():
            p_status, p_raw, p_type = _result(p_task)
            if p_status != 200:
                router.num_errors += 1
                return _worker_error("prefill", "", p_status, p_raw, p_type)
        try:
            d_resp = await d_open
        except (aiohttp.ClientError, OSError) as e:
            router.num_errors += 1
            if isinstance(e, (aiohttp.ClientConnectionError, OSError)):
                router.mark_down(router.decode_pool, d_i)
            return _error(f"decode server {d_url} unreachable: {e}", 502)
        if d_resp.status != 200:
            router.num_errors += 1
            raw = await d_resp.read()
            verdict = await _prefill_verdict(p_task, "")
            return verdict or _worker_error("decode", d_url, d_resp.status, raw,
                                            d_resp.headers.get("Content-Type", ""))
        prefill_obj = None
        if merge:
            await asyncio.wait({p_task})
            p_status, p_raw, _ = _result(p_task)
            if p_status == 200:
                prefill_obj = _first_sse_json(p_raw)
        resp, complete = await _relay_sse(request, router, d_resp, d_i, d_url, prefill_obj)
        if complete:
            router.let_finish(p_task)       # the decode streamed to the end: see _generate
        return resp
    finally:
        await _cancel(d_open)
        if d_resp is None and not d_open.cancelled() and d_open.exception() is None:
            d_resp = d_open.result()
        if d_resp is not None:
            d_resp.release()
        if p_task not in router._finishing:
            await _cancel(p_task)


async def _relay_sse(request: web.Request, router: PDRouter, d_resp: aiohttp.ClientResponse,
                     d_i: int, d_url: str, prefill_obj: dict | None
                     ) -> tuple[web.StreamResponse, bool]:
    """Stream the decode's SSE events to the client, each with the prefill's input logprobs
    merged in when ``prefill_obj`` is given. Returns ``(response, whether the decode streamed
    to the end)``; a decode (``d_i`` of the pool, at ``d_url``) that goes away mid-stream is
    marked down and the client gets an error event, never a stream that just stops."""
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        async for line in d_resp.content:
            if prefill_obj is not None and line.startswith(b"data: ") \
                    and line.strip() != b"data: [DONE]":
                with contextlib.suppress(ValueError):
                    obj = _merge_input_logprobs(json.loads(line[6:]), prefill_obj)
                    line = b"data: " + json.dumps(obj).encode() + b"\n"
            await resp.write(line)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        router.num_errors += 1
        router.mark_down(router.decode_pool, d_i)
        err = error_body(f"decode server {d_url} failed mid-stream: "
                         f"{type(e).__name__}: {e}", 502, None, "router_error")
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write_eof()
        return resp, False
    await resp.write_eof()
    return resp, True


async def _get_json(router: PDRouter, url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    try:
        async with router.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return 503, f"{type(e).__name__}: {e}"


async def handle_health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    results = await asyncio.gather(*(_get_json(router, u + "/health") for u in router.workers))
    bad = [f"{u}: {s}" for u, (s, _) in zip(router.workers, results) if s != 200]
    if bad:
        return _error("unhealthy workers: " + "; ".join(bad), 503)
    return web.Response(text="OK")


async def handle_health_generate(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    results = await asyncio.gather(*(_get_json(router, u + "/health_generate", 60.0)
                                     for u in router.workers))
    bad = [f"{u}: {s}" for u, (s, _) in zip(router.workers, results) if s != 200]
    if bad:
        return _error("unhealthy workers: " + "; ".join(bad), 503)
    return web.Response(text="OK")


async def _fan_out(request: web.Request, path: str) -> web.Response:
    router = request.app[ROUTER_KEY]
    p = await asyncio.gather(*(_get_json(router, u + path) for u, _ in router.prefills))
    d = await asyncio.gather(*(_get_json(router, u + path) for u in router.decodes))
    return web.json_response({"prefill": [x for _, x in p], "decode": [x for _, x in d]})


async def handle_server_info(request: web.Request) -> web.Response:
    return await _fan_out(request, "/get_server_info")


async def handle_get_load(request: web.Request) -> web.Response:
    """Every worker's ``/get_load``, plus the router's own view (``router``: per pool, each
    worker's outstanding requests, last ``kv_usage`` and how often it was chosen)."""
    router = request.app[ROUTER_KEY]
    p = await asyncio.gather(*(_get_json(router, u + "/get_load") for u, _ in router.prefills))
    d = await asyncio.gather(*(_get_json(router, u + "/get_load") for u in router.decodes))
    return web.json_response({"prefill": [x for _, x in p], "decode": [x for _, x in d],
                              "router": {"policy": router.prefill_pool.policy,
                                         "prefill": router.prefill_pool.state(),
                                         "decode": router.decode_pool.state()}})


async def _first_prefill(request: web.Request, path: str) -> web.Response:
    router = request.app[ROUTER_KEY]
    status, obj = await _get_json(router, router.prefills[0][0] + path)
    if status != 200:
        return _error(f"prefill server: {obj}", 503)
    return web.json_response(obj)


async def handle_model_info(request: web.Request) -> web.Response:
    return await _first_prefill(request, "/get_model_info")


async def handle_models(request: web.Request) -> web.Response:
    return await _first_prefill(request, "/v1/models")


async def handle_flush_cache(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    out = []
    for u in router.workers:
        try:
            async with router.session.post(u + "/flush_cache") as r:
                out.append(r.status)
        except (aiohttp.ClientError, OSError):
            out.append(503)
    status = 200 if all(s == 200 for s in out) else 400
    return web.json_response({"workers": router.workers, "status": out}, status=status)


async def handle_utility(request: web.Request) -> web.Response:
    """A stateless POST (``UTILITY_PATHS``: tokenizer and parser endpoints) answered by the
    first prefill server: its status and body reach the client as they are (a 400 names the
    field); an unreachable server is a 502 ``router_error``. Nothing is scheduled."""
    router = request.app[ROUTER_KEY]
    url = router.prefills[0][0] + request.path
    headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
    headers["Content-Type"] = "application/json"
    try:
        raw = await request.read()
        async with router.session.post(url, data=raw, headers=headers) as r:
            body = await r.read()
            return web.Response(body=body, status=r.status,
                                content_type=r.content_type or "application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return _error(f"prefill server {url} unreachable: {type(e).__name__}: {e}", 502)


async def handle_metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    text = ("# HELP pdjax_router_requests_total Generation requests routed.\n"
            "# TYPE pdjax_router_requests_total counter\n"
            f"pdjax_router_requests_total {router.num_requests}\n"
            "# HELP pdjax_router_errors_total Routed requests answered with an error.\n"
            "# TYPE pdjax_router_errors_total counter\n"
            f"pdjax_router_errors_total {router.num_errors}\n")
    return web.Response(text=text, content_type="text/plain")


def create_router_app(router: PDRouter) -> web.Application:
    """The router's aiohttp application (routes listed in the module docstring)."""
    app = web.Application(client_max_size=CLIENT_MAX_SIZE)
    app[ROUTER_KEY] = router

    async def on_startup(_app):
        await router.start()

    async def on_cleanup(_app):
        await router.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path in GENERATE_PATHS:
        app.router.add_post(path, handle_generate)
    for path, handler in (("/health", handle_health), ("/health_generate", handle_health_generate),
                          ("/get_server_info", handle_server_info),
                          ("/server_info", handle_server_info),
                          ("/get_model_info", handle_model_info),
                          ("/model_info", handle_model_info), ("/v1/models", handle_models),
                          ("/get_load", handle_get_load), ("/metrics", handle_metrics)):
        app.router.add_get(path, handler)
    app.router.add_post("/flush_cache", handle_flush_cache)
    for path in UTILITY_PATHS:
        app.router.add_post(path, handle_utility)
    return app


async def serve_router(router: PDRouter, host: str, port: int,
                       stop_event: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT or ``stop_event`` (the server's ``listening`` loop)."""
    stop = stop_event or asyncio.Event()
    async with listening(create_router_app(router), host, port, stop):
        logger.info("pdjax router on %s:%d: prefill %s, decode %s", host, port, router.prefills,
                    router.decodes)
        await stop.wait()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def parse_prefill_args(values: list[list[str]]) -> list[tuple[str, int | None]]:
    """``--prefill URL [BOOTSTRAP_PORT]`` occurrences -> ``[(url, port or None)]``.
    Raises ``ValueError`` for a bad port or extra values."""
    out = []
    for v in values:
        if not 1 <= len(v) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {v}")
        port = None
        if len(v) == 2 and v[1].lower() not in ("none", "null"):
            try:
                port = int(v[1])
            except ValueError:
                raise ValueError(f"--prefill {v[0]}: bootstrap port {v[1]!r} is not an "
                                 f"integer") from None
            if not 1 <= port <= 65535:
                raise ValueError(f"--prefill {v[0]}: bootstrap port {port} outside [1, 65535]")
        out.append((v[0], port))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdjax.router", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", nargs="+", action="append", required=True,
                   metavar=("URL", "BOOTSTRAP_PORT"), help="a prefill server and its bootstrap port")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="accepted for sglang-router compatibility (always on)")
    p.add_argument("--request-timeout-secs", type=float, default=3600.0)
    p.add_argument("--policy", choices=POLICIES, default="load_aware",
                   help="worker choice: fewest outstanding requests, ties by KV usage from "
                        "/get_load (load_aware), or round_robin")
    p.add_argument("--load-poll-interval-secs", type=float, default=1.0,
                   help="how often /get_load of every worker is read (load_aware)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        router = PDRouter(parse_prefill_args(ns.prefill), ns.decode, ns.request_timeout_secs,
                          policy=ns.policy, load_poll_interval_s=ns.load_poll_interval_secs)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_router(router, ns.host, ns.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
