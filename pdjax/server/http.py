"""The aiohttp HTTP server: SGLang-native and OpenAI-compatible endpoints (issue 4, DESIGN.md §4).

    client --HTTP--> handler --GenerateRequest per sample--> engine.generate()  (engine thread)
                       ^                                          |
                       '---- SampleDelta <- detokenizer <- GenerateOutput (pushed, in order)

Each HTTP request becomes a ``RequestGroup``: one ``GenerateRequest`` per sample (batch and
``n > 1``), one pump task per sample that forwards the engine's outputs into the group's queue,
and the handler that turns them into a JSON answer or an SSE stream. Stop strings are found by
the detokenizer; the server then calls ``engine.abort(rid)`` so the engine frees the pages.
Whatever ends a request early (a client that disconnects, an error, ``/abort_request``, a
shutdown) aborts every unfinished sample in the engine.

``run_server`` handles SIGTERM by draining: new generation requests get 503, running ones may
finish until ``drain_timeout_s``, the rest are aborted, then it returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import time
import uuid
from typing import Any, Callable, Iterable

from aiohttp import web

from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.metrics import Metrics, RequestTimer
from pdjax.request import SamplingParams
from pdjax.server import chat_output
from pdjax.server import openai_protocol as proto
from pdjax.server import tools as tool_api
from pdjax.server.detokenizer import IncrementalDetokenizer, TokenTexts, trim_matched_stop_token
from pdjax.server.openai_protocol import RequestError, SampleDelta, SampleResult
from pdjax.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
HEALTH_GENERATE_TIMEOUT_S = 20.0
DRAIN_ABORT_GRACE_S = 5.0
FAKE_BOOTSTRAP_HOST = proto.FAKE_BOOTSTRAP_HOST   # PD warm-up/health host: fake transfers
CLIENT_MAX_SIZE = 64 << 20            # request bodies up to 64 MiB (long prompts as token ids)
# Paths reachable without the API key (probes from load balancers and Prometheus).
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")


# ---------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------

class _Sample:
    """Turns one request's ``GenerateOutput`` stream into ``SampleDelta`` increments."""

    def __init__(self, index: int, req: GenerateRequest, state: "ServerState",
                 log_metrics: bool) -> None:
        sp = req.sampling_params
        self.index = index
        self.req = req
        self.state = state
        self.detok = IncrementalDetokenizer(state.tokenizer, sp.stop,
                                            skip_special_tokens=sp.skip_special_tokens,
                                            prompt_ids=req.input_ids)
        self.result = SampleResult(index=index, rid=req.rid, prompt_ids=list(req.input_ids),
                                   prompt_tokens=len(req.input_ids),
                                   logprob_start_len=req.logprob_start_len)
        self.timer = RequestTimer(state.metrics if log_metrics else None)
        self.done = False
        self.task: asyncio.Task | None = None

    def apply(self, out: GenerateOutput) -> tuple[SampleDelta, bool]:
        """Consume one engine output; returns the delta and whether the engine must be told to
        abort (a stop string ended the request before the engine did)."""
        r = self.result
        if out.prompt_tokens:
            r.prompt_tokens = out.prompt_tokens
        r.cached_tokens = max(r.cached_tokens, out.cached_tokens or 0)
        if out.prompt_logprobs is not None and r.prompt_logprobs is None:
            r.prompt_logprobs = list(out.prompt_logprobs)
            r.prompt_top_logprobs = list(out.prompt_top_logprobs or [])
        if out.error:
            return self.fail(out.error, getattr(out, "status_code", None) or 500), False
        ids = [int(t) for t in out.new_token_ids]
        feed = trim_matched_stop_token(ids, out.finish_reason) if out.finished else ids
        step = self.detok.add_tokens(feed)
        text = step.text
        must_abort = False
        if step.stop_matched is not None:
            accepted = ids[:step.num_tokens]
            finished = True
            r.finish_reason = {"type": "stop", "matched": step.stop_matched}
            must_abort = not out.finished
        else:
            accepted = ids
            finished = out.finished
            if finished:
                tail = self.detok.finish()
                text += tail.text
                if tail.stop_matched is not None:
                    r.finish_reason = {"type": "stop", "matched": tail.stop_matched}
                else:
                    r.finish_reason = out.finish_reason or {"type": "abort",
                                                            "message": "finished without reason"}
        offset = len(r.output_ids)
        lps = [float(v) for v in out.new_logprobs[:len(accepted)]]
        tops = [list(t) for t in out.new_top_logprobs[:len(accepted)]]
        r.output_ids.extend(accepted)
        r.output_logprobs.extend(lps)
        r.output_top_logprobs.extend(tops)
        r.text += text
        self.timer.on_tokens(len(accepted))
        if finished:
            self._finalize(r.finish_reason.get("type", "abort"))
        return SampleDelta(self.index, text, accepted, lps, tops, finished, offset), must_abort

    def fail(self, message: str, status: int) -> SampleDelta:
        r = self.result
        r.error, r.error_status = message, status
        r.finish_reason = {"type": "abort", "message": message}
        self._finalize("error")
        return SampleDelta(self.index, "", [], [], [], True, len(r.output_ids))

    def abort(self, message: str) -> SampleDelta:
        """Abort in the engine (frees its pages) and finish with ``finish_reason`` abort."""
        self.state.engine_abort(self.req.rid)
        tail = self.detok.finish()
        r = self.result
        r.text += tail.text
        r.finish_reason = {"type": "abort", "message": message}
        self._finalize("abort")
        return SampleDelta(self.index, tail.text, [], [], [], True, len(r.output_ids))

    def _finalize(self, reason: str) -> None:
        r = self.result
        self.done = True
        r.finished = True
        r.e2e_latency = self.timer.on_finish(reason, r.prompt_tokens, r.completion_tokens,
                                             r.cached_tokens)


# ---------------------------------------------------------------------------------------------
# One HTTP request: its samples
# ---------------------------------------------------------------------------------------------

class RequestGroup:
    """The samples of one HTTP request and the tasks that pump their engine outputs.

    ``next_delta()`` returns increments in arrival order and None once every sample finished
    (or the group was closed). ``close()`` aborts unfinished samples in the engine; it is safe
    to call more than once and from ``finally`` blocks of cancelled handlers.
    """

    def __init__(self, state: "ServerState", reqs: list[GenerateRequest],
                 group_rid: str | None, log_metrics: bool) -> None:
        self.state = state
        self.group_rid = group_rid
        self.samples = [_Sample(k, r, state, log_metrics) for k, r in enumerate(reqs)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    @property
    def rids(self) -> list[str]:
        return [s.req.rid for s in self.samples]

    def start(self) -> None:
        for s in self.samples:
            s.task = asyncio.get_running_loop().create_task(self._pump(s))

    async def _pump(self, s: _Sample) -> None:
        agen = None
        try:
            agen = self.state.engine.generate(s.req)
            async for out in agen:
                self._queue.put_nowait(("out", s, out))
                if out.finished:
                    return
            self._queue.put_nowait(("err", s, RuntimeError(
                "the engine's output stream ended before the request finished")))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine refused or failed the request
            self._queue.put_nowait(("err", s, e))
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _unfinished(self) -> list[_Sample]:
        return [s for s in self.samples if not s.done]

    async def next_delta(self) -> SampleDelta | None:
        while True:
            if self._queue.empty() and (self.closed or not self._unfinished()):
                return None
            kind, s, item = await self._queue.get()
            if kind == "delta":
                return item
            if kind == "wake" or s.done:
                continue
            if kind == "err":
                self.state.engine_abort(s.req.rid)     # in case the engine still holds it
                status = 400 if isinstance(item, ValueError) else 500
                return s.fail(f"{type(item).__name__}: {item}" if status == 500 else str(item),
                              status)
            delta, must_abort = s.apply(item)
            if must_abort:
                self.state.engine_abort(s.req.rid)
                if s.task is not None:
                    s.task.cancel()
            return delta

    async def wait(self) -> None:
        """Consume outputs until every sample finished, or stop at the first failed one."""
        while (d := await self.next_delta()) is not None:
            if d.finished and self.samples[d.index].result.error:
                return

    def first_error(self) -> SampleResult | None:
        return next((s.result for s in self.samples if s.result.error), None)

    def abort(self, message: str, rids: Iterable[str] | None = None) -> int:
        """Abort unfinished samples (all, or those in ``rids``); their final deltas are queued
        for the handler. Returns how many were aborted."""
        wanted = None if rids is None else set(rids)
        count = 0
        for s in self._unfinished():
            if wanted is None or s.req.rid in wanted:
                self._queue.put_nowait(("delta", s, s.abort(message)))
                if s.task is not None:
                    s.task.cancel()
                count += 1
        return count

    def close(self, message: str = "client disconnected") -> None:
        if self.closed:
            return
        self.closed = True
        for s in self._unfinished():
            s.abort(message)
        for s in self.samples:
            if s.task is not None and not s.task.done():
                s.task.cancel()
        self.state.unregister(self)
        self._queue.put_nowait(("wake", None, None))


# ---------------------------------------------------------------------------------------------
# Server state
# ---------------------------------------------------------------------------------------------

class ServerState:
    """What the handlers share: the engine client, metrics, the live request groups and the
    drain flag."""

    def __init__(self, engine: Any, served_model_name: str | None, api_key: str | None,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        args = getattr(engine, "args", None)       # AsyncEngine: the --flags it was built from
        self.tool_call_parser = tool_call_parser or getattr(args, "tool_call_parser", None)
        self.reasoning_parser = reasoning_parser or getattr(args, "reasoning_parser", None)
        self.tokenizer = engine.tokenizer
        if getattr(engine, "metrics", None) is None:
            # The server owns the metrics; the engine thread attaches its gauges and compile
            # counter when its core is built (or now, if it already is).
            engine.metrics = Metrics()
            core = getattr(engine, "core", None)
            if core is not None:
                engine.metrics.attach_engine(core)
        self.metrics: Metrics = engine.metrics
        self.api_key = api_key
        self.served_model_name = (served_model_name or getattr(engine, "served_model_name", None)
                                  or engine.model_path)
        self.token_texts = TokenTexts(engine.tokenizer)
        self.created = int(time.time())
        self.draining = False
        self._by_rid: dict[str, RequestGroup] = {}
        self._by_group_rid: dict[str, RequestGroup] = {}
        self.num_inflight = 0
        self._idle: asyncio.Event | None = None

    @property
    def ctx(self) -> proto.ServingContext:
        """Read per request: the engine's context length is known only after it loaded."""
        engine = self.engine
        vocab = getattr(engine, "vocab_size", None) or len(engine.tokenizer)
        return proto.ServingContext(tokenizer=engine.tokenizer,
                                    served_model_name=self.served_model_name,
                                    model_path=engine.model_path,
                                    context_length=int(engine.context_length),
                                    vocab_size=int(vocab),
                                    tool_call_parser=self.tool_call_parser,
                                    reasoning_parser=self.reasoning_parser)

    # -- request bookkeeping -------------------------------------------------------------------
    def open_group(self, reqs: list[GenerateRequest], group_rid: str | None = None,
                   log_metrics: bool = True) -> RequestGroup:
        """Register and start a group; ``RequestError`` when a rid is already in use."""
        rids = [r.rid for r in reqs]
        if group_rid in rids:
            group_rid = None          # one sample under the caller's own rid
        for key in rids + ([] if group_rid is None else [group_rid]):
            if key in self._by_rid or key in self._by_group_rid:
                raise RequestError(f"rid: request id {key!r} is already in use", "rid")
        group = RequestGroup(self, reqs, group_rid, log_metrics)
        for rid in rids:
            self._by_rid[rid] = group
        if group_rid is not None:
            self._by_group_rid[group_rid] = group
        group.start()
        return group

    def unregister(self, group: RequestGroup) -> None:
        for rid in group.rids:
            if self._by_rid.get(rid) is group:
                del self._by_rid[rid]
        if group.group_rid is not None and self._by_group_rid.get(group.group_rid) is group:
            del self._by_group_rid[group.group_rid]

    def engine_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # an abort must never take a handler down
            logger.exception("engine.abort(%r) failed", rid)

    def abort(self, rid: str, message: str = "aborted by /abort_request") -> int:
        """Abort a sample by its rid, or every sample of a request by the caller's rid."""
        group = self._by_rid.get(rid)
        if group is not None:
            return group.abort(message, [rid])
        group = self._by_group_rid.get(rid)
        if group is not None:
            return group.abort(message)
        self.engine_abort(rid)       # maybe a request the engine got from elsewhere
        return 0

    def abort_all(self, message: str) -> int:
        groups = {id(g): g for g in self._by_rid.values()}
        return sum(g.abort(message) for g in groups.values())

    # -- draining ----------------------------------------------------------------------------
    def check_accepting(self) -> None:
        """``RequestError`` 503 while draining or before the engine finished warming up."""
        if self.draining:
            raise RequestError("the server is shutting down and accepts no new requests",
                               status=503)
        if not self.engine.is_ready:
            raise RequestError("the engine is still loading or warming up; retry when /health "
                               "answers 200", status=503)

    @contextlib.contextmanager
    def track(self):
        """Counts one in-flight generation request."""
        if self._idle is None:
            self._idle = asyncio.Event()
        self.num_inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_inflight -= 1
            if self.num_inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        if self.num_inflight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return self.num_inflight == 0

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, let running requests finish for ``timeout_s``, abort the rest."""
        self.draining = True
        logger.info("draining: %d request(s) in flight", self.num_inflight)
        if await self.wait_idle(timeout_s):
            return
        n = self.abort_all("the server is shutting down")
        logger.info("drain timeout (%.1f s): aborted %d sample(s)", timeout_s, n)
        if not await self.wait_idle(DRAIN_ABORT_GRACE_S):
            logger.warning("%d request(s) still in flight after aborting", self.num_inflight)


STATE_KEY = web.AppKey("pdjax_server_state", ServerState)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def _json_dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_json_dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    return json_response(proto.error_body(message, status, param), status)


async def _read_json(request: web.Request, allow_empty: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; a JSON object is required")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RequestError(f"malformed JSON body: {type(e).__name__}: {e}") from None


async def _sse(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _json_dumps(obj).encode("utf-8") + b"\n\n")


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
        return error_response(r.error, r.error_status)
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        for obj in on_start():
            await _sse(resp, obj)
        d, failed = first, False
        while d is not None:
            r = group.samples[d.index].result
            if r.error:
                await _sse(resp, proto.error_body(r.error, r.error_status))
                failed = True
                break
            for obj in on_delta(d):
                await _sse(resp, obj)
            d = await group.next_delta()
        if not failed:
            for obj in on_end():
                await _sse(resp, obj)
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        logger.info("client disconnected mid-stream; aborting %s", group.rids)
        group.close()
    return resp


async def _parse(state: ServerState, parse: Callable, body: Any):
    """``parse(body, ctx)`` off the event loop. A refused PD request also fails its bootstrap
    rooms in the engine, so that the peer server hears of it at once (issue 16, item 3)."""
    try:
        return await asyncio.to_thread(parse, body, state.ctx)
    except RequestError as e:
        rooms = _pd_rooms(body)
        reject = getattr(state.engine, "pd_reject", None)
        if rooms and reject is not None and 400 <= e.status < 500:
            reject(rooms, e.message, e.status)
        raise


def _pd_rooms(body: Any) -> list[int]:
    """The valid ``bootstrap_room`` values of a body that failed validation (at most
    ``MAX_SAMPLES``); none when it names the fake warm-up host."""
    if not isinstance(body, dict) or body.get("bootstrap_host") == FAKE_BOOTSTRAP_HOST:
        return []
    room = body.get("bootstrap_room")
    rooms = room[:proto.MAX_SAMPLES] if isinstance(room, list) else [room]
    return [r for r in rooms if isinstance(r, int) and not isinstance(r, bool)
            and 1 <= r <= proto.MAX_ROOM]


def _result_error(group: RequestGroup) -> web.Response | None:
    r = group.first_error()
    return None if r is None else error_response(r.error, r.error_status)


# ---------------------------------------------------------------------------------------------
# Handlers: generation
# ---------------------------------------------------------------------------------------------

async def handle_generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.check_accepting()
    with state.track():
        # Tokenizing a large prompt takes seconds: never on the event loop.
        parsed = await _parse(state, proto.parse_generate_request, await _read_json(request))
        group = state.open_group(parsed.requests, parsed.group_rid, parsed.log_metrics)
        texts = state.token_texts if parsed.return_text_in_logprobs else None
        # separate_reasoning: each sample's text split into reasoning_text and text.
        split = None if parsed.reasoning_parser is None else [
            chat_output.NativeReasoning(parsed.reasoning_parser,
                                        state.tokenizer.decode(s.req.input_ids[-64:]))
            for s in group.samples]
        try:
            def one(s: _Sample, index: int | None) -> dict:
                out = proto.native_response(s.result, s.req, texts, index)
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
        parsed: proto.OpenAIRequest = await _parse(state, parse, await _read_json(request))
        group = state.open_group(parsed.requests, parsed.group_rid)
        texts = state.token_texts
        results = [s.result for s in group.samples]
        try:
            if parsed.stream:
                token_chars = [0] * len(group.samples)

                def on_delta(d: SampleDelta) -> list[dict]:
                    chunks = proto.stream_delta_chunks(parsed, d, results[d.index], texts,
                                                       token_chars[d.index])
                    if parsed.logprobs is not None:
                        token_chars[d.index] += sum(len(texts.text(t)) for t in d.token_ids)
                    return chunks

                def on_end() -> list[dict]:
                    if not parsed.include_usage:
                        return []
                    return [proto.stream_usage_chunk(parsed, results)]

                return await _stream(request, group, lambda: proto.stream_start_chunks(parsed),
                                     on_delta, on_end)
            await group.wait()
            err = _result_error(group)
            if err is not None:
                return err
            build = proto.chat_response if parsed.kind == "chat" else proto.completion_response
            return json_response(build(parsed, results, texts))
        finally:
            group.close()


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, proto.parse_completion_request)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle_openai(request, proto.parse_chat_request)


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
            req.bootstrap_room = uuid.uuid4().int & proto.MAX_ROOM or 1
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
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
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


async def handle_flush_cache(request: web.Request) -> web.Response:
    ok = await asyncio.to_thread(request.app[STATE_KEY].engine.flush_cache)
    if ok:
        return web.Response(text="Cache flushed.\n")
    return error_response("cache not flushed: requests are running", 400)


async def handle_abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("abort_all") is True:
        return json_response({"success": True, "num_aborted": state.abort_all("aborted by "
                                                                             "/abort_request")})
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise RequestError("rid must be a non-empty string (or set abort_all: true)", "rid")
    return json_response({"success": True, "num_aborted": state.abort(rid)})


async def handle_start_profile(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_json(request, allow_empty=True)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
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


# ---------------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------------

@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    if state.api_key and not request.path.startswith(AUTH_EXEMPT_PREFIXES):
        if request.headers.get("Authorization", "") != f"Bearer {state.api_key}":
            return error_response("invalid or missing API key", 401)
    try:
        return await handler(request)
    except RequestError as e:
        return error_response(e.message, e.status, e.param)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(f"{e.reason}: {request.method} {request.path}", e.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # no input may take the server down
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"internal server error: {type(e).__name__}: {e}", 500)


def create_app(engine_client: Any, served_model_name: str | None = None,
               api_key: str | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> web.Application:
    """Build the aiohttp application over an engine client (``pdjax.engine.AsyncEngine`` or
    any object with its interface: ``tokenizer``, ``model_path``, ``served_model_name``,
    ``context_length``, ``is_ready``, ``metrics``, ``generate``, ``abort``, ``flush_cache``,
    ``get_load``, ``server_info``, ``start_profile``, ``stop_profile``).

    ``api_key``: when set, every path but ``/health*`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>``. ``tool_call_parser`` / ``reasoning_parser``: parser
    names (``pdjax.server.parsers``); default: the engine's ``args`` (``--tool-call-parser``,
    ``--reasoning-parser``). The state is at ``app[STATE_KEY]``.
    """
    for field, name, known in (("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS),
                               ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            raise ValueError(f"{field} must be one of {sorted(known)}, got {name!r}")
    app = web.Application(middlewares=[_middleware], client_max_size=CLIENT_MAX_SIZE)
    app[STATE_KEY] = ServerState(engine_client, served_model_name, api_key, tool_call_parser,
                                 reasoning_parser)
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_post("/v1/completions", handle_completions)
    r.add_post("/v1/chat/completions", handle_chat_completions)
    r.add_get("/v1/models", handle_models)
    for path, handler in (("/health", handle_health), ("/health_generate", handle_health_generate),
                          ("/model_info", handle_model_info),
                          ("/get_model_info", handle_model_info),
                          ("/server_info", handle_server_info),
                          ("/get_server_info", handle_server_info),
                          ("/get_load", handle_get_load), ("/metrics", handle_metrics),
                          ("/flush_cache", handle_flush_cache)):
        r.add_get(path, handler)
    r.add_post("/flush_cache", handle_flush_cache)
    r.add_post("/abort_request", handle_abort_request)
    r.add_post("/separate_reasoning", handle_separate_reasoning)
    r.add_post("/parse_function_call", handle_parse_function_call)
    r.add_post("/start_profile", handle_start_profile)
    r.add_get("/start_profile", handle_start_profile)
    r.add_post("/stop_profile", handle_stop_profile)
    r.add_get("/stop_profile", handle_stop_profile)
    return app


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

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
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    code = 0
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        logger.info("pdjax HTTP server listening on %s", runner.addresses)
        if on_started is not None:
            on_started(list(runner.addresses))
        watcher = asyncio.create_task(_watch_engine_start(app[STATE_KEY].engine, stop))
        await stop.wait()
        watcher.cancel()
        if watcher.done() and not watcher.cancelled() and watcher.result():
            code = 1
        logger.info("shutdown requested: draining for up to %.1f s", drain_timeout_s)
        await app[STATE_KEY].drain(drain_timeout_s)
    finally:
        await runner.cleanup()
        for sig in installed:
            loop.remove_signal_handler(sig)
        if on_shutdown is not None:
            try:
                result = on_shutdown()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("on_shutdown failed")
                code = 1
    return code


async def _watch_engine_start(engine: Any, stop: asyncio.Event) -> bool:
    """Stop the server (exit code 1) when the engine fails to start, instead of answering
    503 "warming up" forever. Returns True when it did."""
    wait = getattr(engine, "wait_started", None)
    if wait is None:
        return False
    while not stop.is_set():
        error = await asyncio.to_thread(wait, 1.0)
        if error is not None:
            logger.error("the engine failed to start (%s): shutting down", error)
            stop.set()
            return True
        if getattr(engine, "is_ready", False):
            return False
    return False


def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 30000, *,
               on_shutdown: Callable[[], Any] | None = None,
               drain_timeout_s: float = 30.0) -> int:
    """Blocking ``serve`` on a fresh event loop; returns the exit code (0 after a clean
    SIGTERM drain)."""
    return asyncio.run(serve(app, host, port, on_shutdown=on_shutdown,
                             drain_timeout_s=drain_timeout_s))
