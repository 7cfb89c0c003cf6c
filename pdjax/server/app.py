"""The aiohttp application of the HTTP server (routes, API key, errors) and its run loop
(DESIGN.md §4).

``run_server`` handles SIGTERM by draining: new generation requests get 503, running ones may
finish until ``drain_timeout_s``, the rest are aborted, then it returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from pdjax.server.engine_client import EngineClient, StartupReporter
from pdjax.server.handlers import (handle_abort_request, handle_chat_completions,
                                   handle_completions, handle_detokenize, handle_flush_cache,
                                   handle_generate, handle_get_load, handle_health,
                                   handle_health_generate, handle_metrics, handle_model_info, handle_models,
                                   handle_parse_function_call, handle_separate_reasoning,
                                   handle_server_info, handle_start_profile,
                                   handle_stop_profile, handle_tokenize)
from pdjax.server.http_json import CLIENT_MAX_SIZE, client_errors, error_response
from pdjax.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pdjax.server.registry import STATE_KEY, ServerState

logger = logging.getLogger(__name__)

# Paths reachable without the API key (probes from load balancers and Prometheus).
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    if state.api_key and not request.path.startswith(AUTH_EXEMPT_PREFIXES):
        if request.headers.get("Authorization", "") != f"Bearer {state.api_key}":
            return error_response("invalid or missing API key", 401)
    try:
        return await client_errors(request, handler)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # no input may take the server down
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"internal server error: {type(e).__name__}: {e}", 500)


def create_app(engine_client: EngineClient, served_model_name: str | None = None,
               api_key: str | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> web.Application:
    """Build the aiohttp application over an engine client (``pdjax.engine.AsyncEngine`` or
    any other ``engine_client.EngineClient``; ``TypeError`` for an object that is none).

    ``api_key``: when set, every path but ``/health*`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>``. ``tool_call_parser`` / ``reasoning_parser``: parser
    names (``pdjax.server.parsers``); default: the engine's ``args`` (``--tool-call-parser``,
    ``--reasoning-parser``; ``engine_client.ArgsOwner``), else off.
    The state is at ``app[STATE_KEY]``.
    """
    if not isinstance(engine_client, EngineClient):
        raise TypeError(f"engine_client: {type(engine_client).__name__} is not an EngineClient")
    for field, name, known in (("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS),
                               ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            raise ValueError(f"{field} must be one of {sorted(known)}, got {name!r}")
    app = web.Application(middlewares=[_middleware], client_max_size=CLIENT_MAX_SIZE)
    app[STATE_KEY] = ServerState(engine_client, served_model_name, api_key, tool_call_parser,
                                 reasoning_parser)
    # (methods, path, handler): SGLang's paths, with its aliases.
    routes = (
        ("POST", "/generate", handle_generate),
        ("POST", "/v1/completions", handle_completions),
        ("POST", "/v1/chat/completions", handle_chat_completions),
        ("GET", "/v1/models", handle_models),
        ("POST", "/tokenize", handle_tokenize),
        ("POST", "/detokenize", handle_detokenize),
        ("GET", "/health", handle_health),
        ("GET", "/health_generate", handle_health_generate),
        ("GET", "/model_info", handle_model_info),
        ("GET", "/get_model_info", handle_model_info),
        ("GET", "/server_info", handle_server_info),
        ("GET", "/get_server_info", handle_server_info),
        ("GET", "/get_load", handle_get_load),
        ("GET", "/metrics", handle_metrics),
        ("GET POST", "/flush_cache", handle_flush_cache),
        ("POST", "/abort_request", handle_abort_request),
        ("POST", "/separate_reasoning", handle_separate_reasoning),
        ("POST", "/parse_function_call", handle_parse_function_call),
        ("GET POST", "/start_profile", handle_start_profile),
        ("GET POST", "/stop_profile", handle_stop_profile),
    )
    add = {"GET": app.router.add_get, "POST": app.router.add_post}     # add_get: HEAD too
    for methods, path, handler in routes:
        for method in methods.split():
            add[method](path, handler)
    return app


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def listening(app: web.Application, host: str, port: int,
                    stop: asyncio.Event) -> AsyncIterator[list]:
    """Serve ``app`` on ``host:port`` inside the block (the bound addresses are yielded);
    SIGTERM / SIGINT set ``stop`` meanwhile. Leaving the block stops the server (in-flight
    handlers are cancelled) and removes the signal handlers. Shared with the PD router."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Not on Windows (NotImplementedError) nor off the main thread (RuntimeError, ValueError).
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        yield list(runner.addresses)
    finally:
        await runner.cleanup()
        for sig in installed:
            loop.remove_signal_handler(sig)


async def serve(app: web.Application, host: str, port: int, *,
                on_shutdown: Callable[[], Any] | None = None, drain_timeout_s: float = 30.0,
                stop_event: asyncio.Event | None = None,
                on_started: Callable[[list], Any] | None = None) -> int:
    """Serve ``app`` until SIGTERM/SIGINT (or ``stop_event``), then drain and stop.

    Draining: new generation requests and ``/health`` get 503; running requests may finish
    for ``drain_timeout_s`` seconds, then the rest are aborted. ``on_shutdown`` (sync or async,
    e.g. stopping the engine thread) runs last. ``on_started`` gets the bound addresses.
    Returns the exit code: 0, or 1 when ``on_shutdown`` raised.
    """
    stop = stop_event or asyncio.Event()
    code = 0
    try:
        async with listening(app, host, port, stop) as addresses:
            logger.info("pdjax HTTP server listening on %s", addresses)
            if on_started is not None:
                on_started(addresses)
            watcher = asyncio.create_task(_watch_engine_start(app[STATE_KEY].engine, stop,
                                                                addresses))
            await stop.wait()
            watcher.cancel()
            if watcher.done() and not watcher.cancelled() and watcher.result():
                code = 1
            logger.info("shutdown requested: draining for up to %.1f s", drain_timeout_s)
            await app[STATE_KEY].drain(drain_timeout_s)
    finally:
        if on_shutdown is not None:
            try:
                result = on_shutdown()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("on_shutdown failed")
                code = 1
    return code


async def _watch_engine_start(engine: EngineClient, stop: asyncio.Event,
                              addresses: list) -> bool:
    """Stop the server (exit code 1) when the engine fails to start, instead of answering
    503 "warming up" forever; log one "ready" line once the engine is ready (``/health``
    answers 200 from then on). Returns True when it stopped the server."""
    reporter = isinstance(engine, StartupReporter)
    while not stop.is_set():
        if reporter:
            error = await asyncio.to_thread(engine.wait_started, 1.0)
            if error is not None:
                logger.error("the engine failed to start (%s): shutting down", error)
                stop.set()
                return True
        if engine.is_ready:
            urls = ", ".join(f"http://{a[0]}:{a[1]}" if isinstance(a, tuple) else str(a)
                             for a in addresses)
            logger.info("pdjax server ready: %s (/health answers 200)", urls)
            return False
        if not reporter:
            await asyncio.sleep(0.1)
    return False


def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 30000, *,
               on_shutdown: Callable[[], Any] | None = None,
               drain_timeout_s: float = 30.0) -> int:
    """Blocking ``serve`` on a fresh event loop; returns the exit code (0 after a clean
    SIGTERM drain)."""
    return asyncio.run(serve(app, host, port, on_shutdown=on_shutdown,
                             drain_timeout_s=drain_timeout_s))
