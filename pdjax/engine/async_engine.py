"""``AsyncEngine``: an ``EngineCore`` on its own thread, for the HTTP server (DESIGN.md §3).

The server's calls become typed commands (``pdjax.engine.commands``) in the engine thread's
inbox; outputs are pushed into the caller's event loop (``call_soon_threadsafe``), never polled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import re
import threading
from typing import AsyncIterator

from pdjax.config import ServerArgs
from pdjax.engine.commands import (AbortRequest, AddRequest, Command, FlushCache, GetLoad,
                                   GetPDState, RejectRooms, StartProfile, StopProfile)
from pdjax.engine.core import DEFAULT_SERVED_MODEL_NAME, EngineCore
from pdjax.engine.watchdog import Watchdog
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.models.loader import load_tokenizer, resolve_model_path
from pdjax.request import FinishReason

logger = logging.getLogger(__name__)

# "FIELD: message", the form of every request ValueError: FIELD becomes the error's param.
_LEADING_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


class AsyncEngine:
    """``EngineCore`` on its own thread, for the HTTP server (never on the event loop).

    ``start()`` loads and warms up in the background; ``is_ready`` turns True after warm-up.
    ``generate(req)`` is an async generator of ``GenerateOutput`` increments, pushed from the
    engine thread into the caller's loop with ``call_soon_threadsafe`` (never polled); leaving
    it early (client disconnect) aborts the request and frees its pages.
    """

    def __init__(self, args: ServerArgs, *, progress: bool = True):
        self.args = args
        self.model_path = resolve_model_path(args.model_path, args.revision)
        self.served_model_name = args.served_model_name or args.model_path or DEFAULT_SERVED_MODEL_NAME
        # Loaded on its own thread (a GGUF's tokenizer is converted on the first start, seconds
        # of Python) while the engine thread loads the model; ``tokenizer`` waits for it.
        self._tokenizer = concurrent.futures.Future()
        threading.Thread(target=self._load_tokenizer, name="pdjax-tokenizer", daemon=True).start()
        self.core: EngineCore | None = None
        self.metrics = None                  # pdjax.metrics.Metrics, set by the server
        self.error: BaseException | None = None
        self.is_ready = False
        self.unhealthy_reason: str | None = None      # set when a multi-host node is lost
        self._progress = progress
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pdjax-engine", daemon=True)
        self._profile_steps_left: int | None = None
        self._profile_dir: str | None = None
        self._ready_event = threading.Event()
        # A step over watchdog_timeout_s: the engine is presumed hung and the process exits.
        self.watchdog = Watchdog(args.watchdog_timeout_s)

    def _load_tokenizer(self) -> None:
        try:
            self._tokenizer.set_result(load_tokenizer(self.args.tokenizer_path or self.model_path))
        except BaseException as e:       # raised where the tokenizer is used
            self._tokenizer.set_exception(e)

    @property
    def tokenizer(self):
        """The tokenizer (``load_tokenizer``); blocks until it is loaded, raises its error."""
        return self._tokenizer.result()

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        """Serve with another tokenizer (the engine core keeps its own)."""
        done = concurrent.futures.Future()
        done.set_result(value)
        self._tokenizer = done

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def wait_started(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait up to ``timeout_s`` for the load and warm-up to end; returns the error that
        stopped the engine from starting, or None (ready, or still starting)."""
        self._ready_event.wait(timeout_s)
        return self.error

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        self._ready_event.wait(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}") from self.error
        return self.is_ready

    @property
    def context_length(self) -> int:
        return self.core.context_length if self.core is not None else 0

    def compile_grammar(self, spec) -> None:
        """Compile ``spec`` (cached) from the calling thread, never the engine's: the server
        calls it while parsing, off the event loop. ``ValueError`` naming the field."""
        if self.core is None:
            raise RuntimeError("engine is not running")
        self.core.compile_grammar(spec)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread and the background warm-up, waiting up to ``timeout_s``
        seconds for each (a background compile ends before the process exits)."""
        self._stop = True
        if self.core is not None:
            self.core.runner.stop_background(timeout_s=0)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.core is not None and not self.core.runner.stop_background(timeout_s):
            logger.warning("the background warm-up did not stop within %.0f s", timeout_s)

    # ------------------------------------------------------------------ client API
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if req.rid in self._streams:
            yield GenerateOutput(req.rid, [], finished=True, error=f"rid {req.rid!r} is already in use",
                                 finish_reason=FinishReason.abort("duplicate rid"))
            return
        self._streams[req.rid] = (loop, q)
        self._call(AddRequest(req))
        finished = False
        try:
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._call(AbortRequest(rid))

    def pd_reject(self, rooms: list[int], message: str, status_code: int = 400) -> None:
        """The HTTP server refused a request for these bootstrap rooms before it reached the
        engine: a prefill fails the rooms and tells their decode at once."""
        if rooms:
            self._call(RejectRooms(tuple(rooms), message, status_code))

    def flush_cache(self) -> bool:
        return self._call_sync(FlushCache())

    def get_load(self) -> dict:
        return self._call_sync(GetLoad()) if self.core is not None else {}

    def pd_state(self) -> dict:
        """The PD manager's rooms, peers and transfer records (``/pd_state``); {} otherwise."""
        return self._call_sync(GetPDState()) if self.core is not None else {}

    def server_info(self) -> dict:
        info = {k: v for k, v in self.args.to_flat_dict().items()
                if k not in ("api_key", "disaggregation_secret")}
        info.update(version=_version(), disaggregation_mode=_disagg_mode(self.args.role),
                    load_balance_method="round_robin", context_length=self.context_length,
                    model_path=self.model_path, is_ready=self.is_ready)
        if self.core is not None:
            info.update(max_total_tokens=self.core.args.max_total_tokens,  # as sized (mem fraction)
                        num_total_pages=self.core.args.num_pages - 1,
                        max_total_num_tokens=(self.core.args.num_pages - 1) * self.args.page_size,
                        buckets=self.core.buckets.describe(),
                        warmup_s=round(self.core.warmup_s, 3),
                        compiled_shapes=len(self.core.runner.ready_keys),
                        forward_shapes=len(self.core.buckets.all_keys()),
                        step_cost_model=self.core.cost_model.describe(),
                        # The settings' "auto" as resolved (engine/settings.py).
                        attention_backend=self.core.config.attention_impl,
                        unroll_layers=self.core.config.unroll_layers,
                        cpu_matmul_kernel=self.core.config.cpu_matmul_kernel)
        return info

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return self._call_sync(StartProfile(output_dir or self.args.profile_dir or "profiles",
                                            num_steps))

    def stop_profile(self) -> str:
        return self._call_sync(StopProfile())

    # ------------------------------------------------------------------ thread plumbing
    def _call(self, cmd: Command) -> None:
        self._inbox.put((cmd, None))
        self._wake.set()

    def _call_sync(self, cmd: Command, timeout_s: float = 60.0):
        if not self._thread.is_alive():
            raise RuntimeError("engine is not running")
        done = threading.Event()
        box: list = []
        self._inbox.put((cmd, (done, box)))
        self._wake.set()
        if not done.wait(timeout_s):
            raise TimeoutError(f"engine did not answer {type(cmd).__name__} within {timeout_s} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _push(self, out: GenerateOutput) -> None:
        stream = self._streams.get(out.rid)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _handle(self, cmd: Command):
        """Run one command on the engine thread; returns its answer (``_call_sync``)."""
        core = self.core
        match cmd:
            case AddRequest(req):
                try:
                    core.add_request(req)
                except ValueError as e:
                    # Bad input is a 400; a room another request holds a 409 (RoomConflict).
                    # The message names the field first ("bootstrap_room: required ...").
                    status = getattr(e, "status_code", 400)
                    field = _LEADING_FIELD.match(str(e))
                    core.role.on_rejected(req, str(e))   # PD: the peer hears of it at once
                    self._push(GenerateOutput(req.rid, [], finished=True, error=str(e),
                                              finish_reason=FinishReason.abort(
                                                  str(e), status, field and field.group(1))))
            case RejectRooms(rooms, message, status_code):
                for room in rooms:
                    core.role.reject_room(room, message, status_code)
            case AbortRequest(rid):
                out = core.abort_request(rid)
                if out is not None:
                    self._push(out)
            case FlushCache():
                return core.flush_cache()
            case GetLoad():
                return core.get_load()
            case GetPDState():
                return core.role.debug_state()
            case StartProfile(output_dir, num_steps):
                core.runner.start_profile(output_dir)
                self._profile_dir, self._profile_steps_left = output_dir, num_steps
                return output_dir
            case StopProfile():
                if self._profile_dir is None:
                    raise ValueError("no profile is running")
                core.runner.stop_profile()
                out_dir, self._profile_dir, self._profile_steps_left = self._profile_dir, None, None
                return out_dir
            case _:
                raise ValueError(f"unknown engine command {cmd!r}")
        return None

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                result = self._handle(cmd)
            except BaseException as e:      # reported to the caller, never kills the loop
                result = e
                if reply is None:
                    logger.exception("engine command %s failed", type(cmd).__name__)
            if reply is not None:
                reply[1].append(result)
                reply[0].set()

    def _run(self) -> None:
        try:
            self.core = EngineCore(self.args, progress=self._progress, background_compile=True,
                                   tokenizer=self._tokenizer.result)
            if self.metrics is not None and hasattr(self.metrics, "attach_engine"):
                self.metrics.attach_engine(self.core)
            self.core.role.set_wake(self._wake.set)
            if self.metrics is not None:
                self.core.role.attach_metrics(self.metrics)
            if self.core.cluster is not None:
                self.core.cluster.on_lost = self._on_node_lost
            self.is_ready = True
        except BaseException as e:
            if isinstance(e, ValueError):       # a setting that cannot work: its message says why
                logger.error("engine failed to start: %s", e)
            else:
                logger.exception("engine failed to start")
            self.error = e
            self._ready_event.set()
            return
        self._ready_event.set()
        self.watchdog.start()
        while not self._stop:
            self._drain_inbox()
            if not self.core.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.watchdog.step_started()
            try:
                outputs = self.core.step()
            except Exception as e:
                logger.exception("engine step failed; failing the running requests")
                for rid in list(self.core.scheduler.requests):
                    out = self.core.abort_request(rid, f"internal error: {e}")
                    if out is not None:
                        out.error = f"internal error: {e}"
                        self._push(out)
                self.core.scheduler.evict_unlocked()
                continue
            finally:
                self.watchdog.step_ended()
            for out in outputs:
                self._push(out)
            if self._profile_steps_left is not None:
                self._profile_steps_left -= 1
                if self._profile_steps_left <= 0:
                    self.core.runner.stop_profile()
                    self._profile_dir = self._profile_steps_left = None
        self.watchdog.stop()
        self.core.kv_worker.close()            # before the role's sockets close
        self.core.role.close()
        if self.core.cluster is not None:
            self.core.cluster.close()

    def _on_node_lost(self, reason: str) -> None:
        """Multi-host: a node went away (called from the heartbeat thread, while the engine
        thread may be stuck in a collective): unhealthy from now on, every open request fails."""
        self.unhealthy_reason = reason
        self.is_ready = False
        for rid in list(self._streams):
            self._push(GenerateOutput(rid, [], finished=True, error=reason,
                                      finish_reason=FinishReason.abort(reason, 503)))


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pdjax")
    except Exception:
        return "0.0.0"


def _disagg_mode(role: str) -> str:
    return {"colocated": "null", "prefill": "prefill", "decode": "decode"}.get(role, "null")
