"""The HTTP handlers: SGLang-native and OpenAI-compatible endpoints (DESIGN.md §4).

    client --HTTP--> handler --GenerateRequest per sample--> engine.generate()  (engine thread)
                       ^                                          |
                       '---- SampleDelta <- OutputAccumulator <- GenerateOutput (pushed, in order)

A generation handler parses the body off the event loop (``native_api``, ``openai_api``),
opens a ``RequestGroup`` (``registry``) and answers with JSON or an SSE stream rendered from
the samples' results (``native_api``, ``openai_render``). The routes: ``app.create_app``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, Callable

from aiohttp import web

from pdjax.engine_io import GenerateRequest
from pdjax.request import SamplingParams
from pdjax.server import chat_output, native_api, openai_api, openai_render, tokenize_api
from pdjax.server import tools as tool_api
from pdjax.server.engine_client import PDRejecter
from pdjax.server.errors import RequestError, error_body
from pdjax.server.http_json import (SSE_HEADERS, error_response, json_response, read_json,
                                    read_json_object, write_sse)
from pdjax.server.openai_api import OpenAIRequest
from pdjax.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pdjax.server.registry import STATE_KEY, RequestGroup, ServerState
from pdjax.server.results import SampleAccumulator, SampleDelta
from pdjax.server.validation import FAKE_BOOTSTRAP_HOST, MAX_ROOM, MAX_SAMPLES, is_int

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

async def _stream(request: web.Request, group: RequestGroup,
                  on_start: Callable[[], list[dict]],
                  on_delta: Callable[[SampleDelta], list[dict]],
                  on_end: Callable[[], list[dict]]) -> web.StreamResponse:
    """Serve a group as SSE: ``data: {...}`` events, then ``data: [DONE]``.

    The headers wait for the first increment, so a request the engine refuses at once gets a
    real HTTP error status; a failure later becomes an ``{"error": ...}`` event.
    """
    first = await group.next_delta()
    if first is not None and group.samples[first.index].result.error:
        r = group.samples[first.index].result
        return error_response(r.error, r.error_status, r.error_param)
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        for obj in on_start():
            await write_sse(resp, obj)
        d, failed = first, False
        while d is not None:
            r = group.samples[d.index].result
            if r.error:
                await write_sse(resp, error_body(r.error, r.error_status, r.error_param))
                failed = True
                break
            for obj in on_delta(d):
                await write_sse(resp, obj)
            d = await group.next_delta()
        if not failed:
            for obj in on_end():
                await write_sse(resp, obj)
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        logger.info("client disconnected mid-stream; aborting %s", group.rids)
        group.close()
    return resp


async def _parse(state: ServerState, parse: Callable, body: Any):
    """``parse(body, ctx)`` off the event loop. A refused PD request also fails its bootstrap
    rooms in the engine, so that the peer server hears of it at once."""
    try:
        return await asyncio.to_thread(parse, body, state.ctx)
    except RequestError as e:
        rooms = _pd_rooms(body)
        if rooms and isinstance(state.engine, PDRejecter) and 400 <= e.status < 500:
            state.engine.pd_reject(rooms, e.message, e.status)
        raise


def _pd_rooms(body: Any) -> list[int]:
    """The valid ``bootstrap_room`` values of a body that failed validation (at most
    ``MAX_SAMPLES``); none when it names the fake warm-up host."""
    if not isinstance(body, dict) or body.get("bootstrap_host") == FAKE_BOOTSTRAP_HOST:
        return []
    room = body.get("bootstrap_room")
    rooms = room[:MAX_SAMPLES] if isinstance(room, list) else [room]
    return [r for r in rooms if is_int(r) and 1 <= r <= MAX_ROOM]


def _result_error(group: RequestGroup) -> web.Response | None:
    r = group.first_error()
    return None if r is None else error_response(r.error, r.error_status, r.error_param)


# ---------------------------------------------------------------------------------------------
# Handlers: generation
# ---------------------------------------------------------------------------------------------

async def handle_generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.check_accepting()
    with state.track():
        # Tokenizing a large prompt takes seconds: never on the event loop.
        parsed = await _parse(state, native_api.parse_generate_request,
                              await read_json(request))
        group = state.open_group(parsed.requests, parsed.group_rid, parsed.log_metrics)
        texts = state.token_texts if parsed.return_text_in_logprobs else None
        # separate_reasoning: each sample's text split into reasoning_text and text.
        split = None if parsed.reasoning_parser is None else [
            chat_output.NativeReasoning(parsed.reasoning_parser,
                                        state.tokenizer.decode(s.req.input_ids[-64:]))
            for s in group.samples]
        try:
            def one(s: SampleAccumulator, index: int | None) -> dict:
                out = native_api.native_response(s.result, s.req, texts, index)
                if split is not None:
                    split[s.index].update(s.result.text, s.result.finished)
                    split[s.index].apply(out)
                return out

            if parsed.stream:
                def on_delta(d: SampleDelta) -> list[dict]:
                    s = group.samples[d.index]
                    if not d.text and not d.finished and not (s.req.return_logprob and d.token_ids):
                        return []
                    return [one(s, None if parsed.is_single else s.index)]
                return await _stream(request, group, list, on_delta, list)
            await group.wait()
            err = _result_error(group)
            if err is not None:
                return err
            outs = [one(s, None) for s in group.samples]
            return json_response(outs[0] if parsed.is_single else outs)
        finally:
            group.close()


async def _handle_openai(request: web.Request, parse: Callable) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.check_accepting()
    with state.track():
        parsed: OpenAIRequest = await _parse(state, parse, await read_json(request))
        group = state.open_group(parsed.requests, parsed.group_rid)
        texts = state.token_texts
        results = [s.result for s in group.samples]
        try:
            if parsed.stream:
                token_chars = [0] * len(group.samples)

                def on_delta(d: SampleDelta) -> list[dict]:
                    chunks = openai_render.stream_delta_chunks(parsed, d, results[d.index],
                                                               texts, token_chars[d.index])
                    if parsed.logprobs is not None:
                        token_chars[d.index] += sum(len(texts.text(t)) for t in d.token_ids)
                    return chunks

                def on_end() -> list[dict]:
                    if not parsed.include_usage:
                        return []
                    return [openai_render.stream_usage_chunk(parsed, results)]

                return await _stream(request, group,
                                     lambda: openai_render.stream_start_chunks(parsed),
                                     on_delta, on_end)
            await group.wait()
            err = _result_error(group)
            if err is not None:
                return err
            build = (openai_render.chat_response if parsed.kind == "chat"
                     else openai_render.completion_response)
            return json_response(build(parsed, results, texts))
        finally:
            group.close()


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, openai_api.parse_completion_request)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, openai_api.parse_chat_request)


async def handle_health_generate(request: web.Request) -> web.Response:
    """Generates one token end to end; 200 when it works, 503 otherwise."""
    state = request.app[STATE_KEY]
    if not state.engine.is_ready or state.draining:
        return error_response("the server is not ready", 503)
    with state.track():
        ids = list(state.tokenizer.encode("Hi")) or [0]
        req = GenerateRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=ids[:8],
                              sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        mode = _server_info(state).get("disaggregation_mode", "null")
        if mode in ("prefill", "decode"):
            # No peer takes part: the fake transfer backend stands in (SGLang's 2.2.2.2).
            req.bootstrap_host = FAKE_BOOTSTRAP_HOST
            req.bootstrap_room = uuid.uuid4().int & MAX_ROOM or 1
        group = state.open_group([req], log_metrics=False)
        try:
            await asyncio.wait_for(group.wait(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response("health generation timed out", 503)
        finally:
            group.close("health check finished")
        r = group.samples[0].result
        if r.error:
            return error_response(f"health generation failed: {r.error}", 503)
        return web.Response(text="OK")


# ---------------------------------------------------------------------------------------------
# Handlers: control and information
# ---------------------------------------------------------------------------------------------

async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.draining:
        return error_response("the server is shutting down", 503)
    reason = state.engine.unhealthy_reason                      # multi-host: a node is gone
    if reason:
        return error_response(reason, 503)
    if not state.engine.is_ready:
        return error_response("the server is warming up", 503)
    return web.Response(text="OK")


def _server_info(state: ServerState) -> dict[str, Any]:
    info = dict(state.engine.server_info())
    info.setdefault("version", "unknown")
    info.setdefault("model_path", state.engine.model_path)
    if info.get("served_model_name") is None:
        info["served_model_name"] = state.served_model_name
    info.setdefault("context_length", state.engine.context_length)
    return info


async def handle_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    info = _server_info(state)
    info.setdefault("internal_states", [await asyncio.to_thread(state.engine.get_load)])
    return json_response(info)


async def handle_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    ctx = state.ctx
    return json_response({"model_path": ctx.model_path, "tokenizer_path": ctx.model_path,
                          "served_model_name": ctx.served_model_name, "is_generation": True,
                          "context_length": ctx.context_length, "vocab_size": ctx.vocab_size})


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    ctx = state.ctx
    return json_response({"object": "list", "data": [{
        "id": ctx.served_model_name, "object": "model", "created": state.created,
        "owned_by": "pdjax", "root": ctx.model_path, "max_model_len": ctx.context_length}]})


async def handle_get_load(request: web.Request) -> web.Response:
    # Engine calls that wait for the engine thread run off the event loop.
    return json_response(await asyncio.to_thread(request.app[STATE_KEY].engine.get_load))


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        state.metrics.set_load(await asyncio.to_thread(state.engine.get_load))
    except Exception:
        logger.exception("get_load failed while serving /metrics")
    body, content_type = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _parse_text_body(request: web.Request, field: str,
                           known: dict) -> tuple[dict, str, str]:
    """The body of ``/separate_reasoning`` / ``/parse_function_call``: (body, ``text``, the
    parser named by ``field``, default the server's own)."""
    body = await read_json_object(request)
    text = body.get("text")
    if not isinstance(text, str):
        raise RequestError("text must be a string", "text")
    name = body.get(field) or getattr(request.app[STATE_KEY], field)
    if name not in known:
        raise RequestError(f"{field} must be one of {sorted(known)}, got {name!r}", field)
    return body, text, name


async def handle_separate_reasoning(request: web.Request) -> web.Response:
    """SGLang's ``/separate_reasoning``: ``{"text", "reasoning_parser"}`` ->
    ``{"text", "reasoning_text"}`` (a finished output split by the named parser)."""
    _, text, name = await _parse_text_body(request, "reasoning_parser", REASONING_PARSERS)
    reasoning, answer = chat_output.separate_reasoning_text(name, text)
    return json_response({"text": answer, "reasoning_text": reasoning})


async def handle_parse_function_call(request: web.Request) -> web.Response:
    """SGLang's ``/parse_function_call``: ``{"text", "tools", "tool_call_parser"}`` ->
    ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}`` for a finished
    output (``parameters``: the arguments JSON text; ``tool_index``: into ``tools``)."""
    body, text, name = await _parse_text_body(request, "tool_call_parser", TOOL_CALL_PARSERS)
    chat_tools = tool_api.parse_tools({"tools": body.get("tools") or []}, name)
    if chat_tools is None:
        raise RequestError("tools must list at least one function", "tools")
    parser = chat_tools.new_parser()
    parser.feed(text)
    parser.finish()
    normal_text, calls = parser.result()
    index = {t["function"]["name"]: i for i, t in enumerate(chat_tools.tools)}
    return json_response({"normal_text": normal_text, "calls": [
        {"tool_index": index[c.name], "name": c.name, "parameters": c.arguments} for c in calls]})


async def handle_tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize`` (``tokenize_api``): prompt or chat messages -> token ids."""
    state = request.app[STATE_KEY]
    body = await read_json(request)
    return json_response(await asyncio.to_thread(tokenize_api.tokenize, body, state.ctx))


async def handle_detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize`` (``tokenize_api``): token ids -> text."""
    state = request.app[STATE_KEY]
    body = await read_json(request)
    return json_response(await asyncio.to_thread(tokenize_api.detokenize, body, state.ctx))


async def handle_flush_cache(request: web.Request) -> web.Response:
    ok = await asyncio.to_thread(request.app[STATE_KEY].engine.flush_cache)
    if ok:
        return web.Response(text="Cache flushed.\n")
    return error_response("cache not flushed: requests are running", 400)


async def handle_abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json_object(request)
    if body.get("abort_all") is True:
        return json_response({"success": True, "num_aborted": state.abort_all("aborted by "
                                                                             "/abort_request")})
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise RequestError("rid must be a non-empty string (or set abort_all: true)", "rid")
    return json_response({"success": True, "num_aborted": state.abort(rid)})


async def handle_start_profile(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json_object(request, allow_empty=True)
    # None lets the engine pick its default (--profile-dir).
    output_dir = body.get("output_dir") or os.environ.get("PDJAX_PROFILE_DIR")
    if output_dir is not None and not isinstance(output_dir, str):
        raise RequestError("output_dir must be a string", "output_dir")
    num_steps = body.get("num_steps")
    if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool)
                                  or num_steps < 1):
        raise RequestError(f"num_steps must be a positive integer, got {num_steps!r}", "num_steps")
    try:
        trace_dir = await asyncio.to_thread(state.engine.start_profile, output_dir, num_steps)
    except (RuntimeError, ValueError) as e:
        raise RequestError(f"start_profile failed: {e}") from None
    return json_response({"success": True, "trace_dir": trace_dir})


async def handle_stop_profile(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        trace_dir = await asyncio.to_thread(state.engine.stop_profile)
    except (RuntimeError, ValueError) as e:
        raise RequestError(f"stop_profile failed: {e}") from None
    return json_response({"success": True, "trace_dir": trace_dir})
