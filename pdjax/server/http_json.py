"""JSON over HTTP for the servers and the PD router: bodies in, JSON and SSE answers out."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdjax.server.errors import RequestError, error_body

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
CLIENT_MAX_SIZE = 64 << 20            # request bodies up to 64 MiB (long prompts as token ids)


def json_dumps(obj: Any) -> str:
    """Strict JSON text (no NaN / Infinity), UTF-8 kept as is."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json_dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int, param: str | None = None,
                   err_type: str | None = None) -> web.Response:
    """``errors.error_body`` as a response with that status."""
    return json_response(error_body(message, status, param, err_type), status)


async def read_json(request: web.Request, allow_empty: bool = False) -> Any:
    """The parsed body; ``RequestError`` (400) for an empty body (``{}`` with
    ``allow_empty``), one that is not UTF-8 (naming the first bad byte and its offset), or not
    JSON, or nested deeper than the parser allows."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; a JSON object is required")
    try:
        text = raw.decode("utf-8")      # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at "
                           f"offset {e.start} ({e.reason})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"malformed JSON body: {type(e).__name__}: {e}") from None


async def read_json_object(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    """``read_json``, and ``RequestError`` unless the body is a JSON object."""
    body = await read_json(request, allow_empty)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def write_sse(resp: web.StreamResponse, obj: Any) -> None:
    """One server-sent event: ``data: <json>`` and a blank line."""
    await resp.write(b"data: " + json_dumps(obj).encode("utf-8") + b"\n\n")


@web.middleware
async def client_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp middleware: the client's mistakes as JSON error bodies typed by status (a
    ``RequestError``; an unknown path or method, which aiohttp answers in plain text)."""
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(e.message, e.status, e.param)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(f"{e.reason}: {request.method} {request.path}", e.status)
        raise
