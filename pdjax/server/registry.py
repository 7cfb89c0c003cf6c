"""The live requests: ``RequestGroup`` (the samples of one HTTP request) and ``ServerState``
(what the handlers share: the engine client, the groups by rid, the drain flag). DESIGN.md §4.

Each HTTP request becomes a ``RequestGroup``: one ``GenerateRequest`` per sample (batch and
``n > 1``), one pump task per sample that forwards the engine's outputs into the group's queue,
and a ``SampleAccumulator`` per sample that turns them into increments. A stop string found
there (``OutputAccumulator``) ends the sample; the group then calls ``engine.abort(rid)`` so
the engine frees the pages.
Whatever ends a request early (a client that disconnects, an error, ``/abort_request``, a
shutdown) aborts every unfinished sample in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Iterable

from aiohttp import web

from pdjax.detokenizer import TokenTexts
from pdjax.engine_io import GenerateRequest
from pdjax.metrics import Metrics
from pdjax.server.engine_client import ArgsOwner, CoreOwner, EngineClient, GrammarCompiler
from pdjax.server.errors import RequestError
from pdjax.server.results import SampleAccumulator, SampleDelta, SampleResult
from pdjax.server.validation import ServingContext

logger = logging.getLogger(__name__)

DRAIN_ABORT_GRACE_S = 5.0


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
        metrics = state.metrics if log_metrics else None
        self.samples = [SampleAccumulator(k, r, state.tokenizer, metrics, state.engine_abort)
                        for k, r in enumerate(reqs)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    @property
    def rids(self) -> list[str]:
        return [s.req.rid for s in self.samples]

    def start(self) -> None:
        for s in self.samples:
            s.task = asyncio.get_running_loop().create_task(self._pump(s))

    async def _pump(self, s: SampleAccumulator) -> None:
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
            if isinstance(agen, AsyncGenerator):
                with contextlib.suppress(Exception):
                    await agen.aclose()

    def _unfinished(self) -> list[SampleAccumulator]:
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

    def __init__(self, engine: EngineClient, served_model_name: str | None, api_key: str | None,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        args = engine.args if isinstance(engine, ArgsOwner) else None
        self.tool_call_parser = tool_call_parser or (args.tool_call_parser if args else None)
        self.reasoning_parser = reasoning_parser or (args.reasoning_parser if args else None)
        self.tokenizer = engine.tokenizer
        if engine.metrics is None:
            # The server owns the metrics; the engine thread attaches its gauges and compile
            # counter when its core is built (or now, if it already is).
            engine.metrics = Metrics()
            if isinstance(engine, CoreOwner) and engine.core is not None:
                engine.metrics.attach_engine(engine.core)
        self.metrics: Metrics = engine.metrics
        self.api_key = api_key
        self.served_model_name = served_model_name or engine.served_model_name or engine.model_path
        self.token_texts = TokenTexts(engine.tokenizer)
        self.created = int(time.time())
        self.draining = False
        self._by_rid: dict[str, RequestGroup] = {}
        self._by_group_rid: dict[str, RequestGroup] = {}
        self.num_inflight = 0
        self._idle: asyncio.Event | None = None

    @property
    def ctx(self) -> ServingContext:
        """Read per request: the engine's context length is known only after it loaded."""
        engine = self.engine
        return ServingContext(tokenizer=engine.tokenizer, served_model_name=self.served_model_name,
                              model_path=engine.model_path,
                              context_length=int(engine.context_length),
                              vocab_size=len(engine.tokenizer),
                              tool_call_parser=self.tool_call_parser,
                              reasoning_parser=self.reasoning_parser,
                              compile_grammar=engine.compile_grammar
                              if isinstance(engine, GrammarCompiler) else None)

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
        reason = self.engine.unhealthy_reason                       # multi-host: a node is gone
        if reason:
            raise RequestError(reason, status=503)
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
