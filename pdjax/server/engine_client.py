"""What the HTTP server calls on the engine (DESIGN.md §4): ``EngineClient``.

``pdjax.engine.AsyncEngine`` is the production client (the engine on its own thread); the
test fake (``tests/server/server_fakes.FakeEngine``) is another. The other capabilities are
optional and checked with ``isinstance``: ``StartupReporter`` (the server exits when the engine
fails to start), ``PDRejecter`` (a refused PD request fails its bootstrap rooms at once),
``ArgsOwner`` (the parsers default to its flags), ``CoreOwner`` (the core's gauges) and
``GrammarCompiler`` (structured outputs are compiled, and checked, while parsing).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, runtime_checkable

from pdjax.config import ServerArgs
from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.metrics import Metrics


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it.

    ``tokenizer``: a Hugging Face tokenizer (``encode``, ``decode``, ``len``: the vocabulary the
    server range-checks token ids against). ``context_length``: tokens per sequence (read per
    request: known once the engine loaded). ``is_ready``: True after warm-up.
    ``unhealthy_reason``: why a started engine can no longer serve (multi-host: a node went
    away), else None. ``metrics``: the server's ``Metrics`` (None until the server sets it). ``generate(req)``: an async iterator
    of ``GenerateOutput`` increments ending with a finished one; ``abort(rid)`` drops a request
    and frees its pages (unknown rids are ignored). ``flush_cache()``: False while requests run.
    ``get_load()`` / ``server_info()``: JSON objects. ``start_profile`` / ``stop_profile``:
    the trace directory; ``RuntimeError`` / ``ValueError`` when refused. The blocking calls
    (``flush_cache``, ``get_load``, profiling) run off the event loop.
    """

    tokenizer: Any
    model_path: str
    served_model_name: str | None
    is_ready: bool
    unhealthy_reason: str | None
    metrics: Metrics | None

    @property
    def context_length(self) -> int: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    def abort(self, rid: str) -> None: ...

    def flush_cache(self) -> bool: ...

    def get_load(self) -> dict: ...

    def server_info(self) -> dict: ...

    def start_profile(self, output_dir: str | None, num_steps: int | None) -> str: ...

    def stop_profile(self) -> str: ...


@runtime_checkable
class StartupReporter(Protocol):
    """An engine that loads in the background: ``wait_started(timeout_s)`` waits up to
    ``timeout_s`` seconds and returns the error that stopped the start, or None."""

    def wait_started(self, timeout_s: float | None = None) -> BaseException | None: ...


@runtime_checkable
class PDRejecter(Protocol):
    """A PD role: ``pd_reject(rooms, message, status_code)`` fails those bootstrap rooms so
    that the peer server hears of a refused request at once."""

    def pd_reject(self, rooms: list[int], message: str, status_code: int = 400) -> None: ...


@runtime_checkable
class ArgsOwner(Protocol):
    """An engine client built from ``ServerArgs`` (``AsyncEngine``): the server's
    ``tool_call_parser`` / ``reasoning_parser`` default to ``--tool-call-parser`` /
    ``--reasoning-parser``."""

    args: ServerArgs


@runtime_checkable
class GrammarCompiler(Protocol):
    """An engine that compiles structured-output grammars: ``compile_grammar(spec)`` (a
    ``pdjax.constrained.grammar.GrammarSpec``) compiles it into the engine's cache from the
    calling thread, ``ValueError`` naming ``spec.field`` when it is invalid."""

    def compile_grammar(self, spec: Any) -> None: ...


@runtime_checkable
class CoreOwner(Protocol):
    """An engine client that runs an ``EngineCore`` in this process (``AsyncEngine``): ``core``
    is None until built; the server attaches its gauges to the metrics (``attach_engine``)."""

    core: Any
