"""The router's HTTP side: the generation handlers (both halves at once, errors passed through,
streams relayed), the fan-out and utility endpoints, ``create_router_app`` and
``serve_router``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
from aiohttp import web

from pdjax.router.pd_router import (GENERATE_PATHS, UTILITY_PATHS, PDRouter, cancel_tasks,
                                    get_json, _FORWARD_HEADERS, _first_sse_json,
                                    _merge_input_logprobs)
from pdjax.router.pool import WorkerPool
from pdjax.server.app import listening
from pdjax.server.errors import error_body
from pdjax.server.http_json import (CLIENT_MAX_SIZE, SSE_HEADERS, client_errors,
                                    error_response, read_json_object)
from pdjax.server.validation import checked_num_samples

logger = logging.getLogger(__name__)


ROUTER_KEY = web.AppKey("pdjax_router", PDRouter)


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    """The router's own failure (a worker unreachable, unhealthy or failing): ``router_error``."""
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


async def handle_generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    path = request.path
    body = await read_json_object(request)          # RequestError: the client's (middleware)
    checked_num_samples(path, body)
    router.num_requests += 1
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
                await cancel_tasks(d_task)
                return _counted(router, _worker_error("prefill", p_url, p_status, p_raw, p_type))
        await asyncio.wait({d_task})
        if _never_reached(d_task):
            # The prefill cannot have caused this, and without its decode it only waits out
            # its bootstrap timeout: no verdict to wait for (it was PREFILL_VERDICT_S).
            router.num_errors += 1
            await cancel_tasks(p_task)
            return _error(f"decode server {d_url} unreachable: {d_task.exception()}", 502)
        d_status, d_raw, d_type = _result(d_task)
        if d_status != 200:
            verdict = await _prefill_verdict(p_task, p_url)
            await cancel_tasks(p_task)
            return _counted(router, verdict or _worker_error("decode", d_url, d_status, d_raw,
                                                             d_type))
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
            await cancel_tasks(p_task)
        await cancel_tasks(d_task)


PREFILL_VERDICT_S = 5.0        # how long a failed decode waits for the prefill's own answer


def _counted(router: PDRouter, resp: web.Response) -> web.Response:
    """``resp``, counted in ``pdjax_router_errors_total`` when it is the servers' or the
    router's failure (5xx); a worker's 4xx is the client's mistake."""
    if resp.status >= 500:
        router.num_errors += 1
    return resp


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


def _never_reached(task: asyncio.Task) -> bool:
    """Whether a finished ``_post`` task failed to connect at all (nothing listens there)."""
    return (not task.cancelled() and
            isinstance(task.exception(), (aiohttp.ClientConnectorError, ConnectionRefusedError)))


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
                return _counted(router, _worker_error("prefill", "", p_status, p_raw, p_type))
        try:
            d_resp = await d_open
        except (aiohttp.ClientError, OSError) as e:
            router.num_errors += 1
            if isinstance(e, (aiohttp.ClientConnectionError, OSError)):
                router.mark_down(router.decode_pool, d_i)
            return _error(f"decode server {d_url} unreachable: {e}", 502)
        if d_resp.status != 200:
            raw = await d_resp.read()
            verdict = await _prefill_verdict(p_task, "")
            return _counted(router, verdict or _worker_error(
                "decode", d_url, d_resp.status, raw, d_resp.headers.get("Content-Type", "")))
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
        await cancel_tasks(d_open)
        if d_resp is None and not d_open.cancelled() and d_open.exception() is None:
            d_resp = d_open.result()
        if d_resp is not None:
            d_resp.release()
        if p_task not in router._finishing:
            await cancel_tasks(p_task)


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


async def handle_health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    results = await asyncio.gather(*(get_json(router, u + "/health") for u in router.workers))
    bad = [f"{u}: {s}" for u, (s, _) in zip(router.workers, results) if s != 200]
    if bad:
        return _error("unhealthy workers: " + "; ".join(bad), 503)
    return web.Response(text="OK")


async def handle_health_generate(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    results = await asyncio.gather(*(get_json(router, u + "/health_generate", 60.0)
                                     for u in router.workers))
    bad = [f"{u}: {s}" for u, (s, _) in zip(router.workers, results) if s != 200]
    if bad:
        return _error("unhealthy workers: " + "; ".join(bad), 503)
    return web.Response(text="OK")


async def _fan_out(request: web.Request, path: str) -> web.Response:
    router = request.app[ROUTER_KEY]
    p = await asyncio.gather(*(get_json(router, u + path) for u, _ in router.prefills))
    d = await asyncio.gather(*(get_json(router, u + path) for u in router.decodes))
    return web.json_response({"prefill": [x for _, x in p], "decode": [x for _, x in d]})


async def handle_server_info(request: web.Request) -> web.Response:
    return await _fan_out(request, "/get_server_info")


async def handle_get_load(request: web.Request) -> web.Response:
    """Every worker's ``/get_load``, plus the router's own view (``router``: per pool, each
    worker's outstanding requests, last ``kv_usage`` and how often it was chosen)."""
    router = request.app[ROUTER_KEY]
    p = await asyncio.gather(*(get_json(router, u + "/get_load") for u, _ in router.prefills))
    d = await asyncio.gather(*(get_json(router, u + "/get_load") for u in router.decodes))
    return web.json_response({"prefill": [x for _, x in p], "decode": [x for _, x in d],
                              "router": {"policy": router.prefill_pool.policy,
                                         "prefill": router.prefill_pool.state(),
                                         "decode": router.decode_pool.state()}})


async def _first_prefill(request: web.Request, path: str) -> web.Response:
    router = request.app[ROUTER_KEY]
    status, obj = await get_json(router, router.prefills[0][0] + path)
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
            "# HELP pdjax_router_errors_total Routed requests that failed (5xx: a server or the "
            "router; a client's 4xx is not counted).\n"
            "# TYPE pdjax_router_errors_total counter\n"
            f"pdjax_router_errors_total {router.num_errors}\n")
    return web.Response(text=text, content_type="text/plain")


def create_router_app(router: PDRouter) -> web.Application:
    """The router's aiohttp application (routes listed in the module docstring)."""
    # A client's mistake: the servers' JSON error body typed by its status, never
    # router_error and never counted in pdjax_router_errors_total.
    app = web.Application(middlewares=[client_errors], client_max_size=CLIENT_MAX_SIZE)
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
