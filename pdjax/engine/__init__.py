"""The engine (DESIGN.md §3): ``EngineCore`` (``core``: schedule -> run -> process, one
step at a time), the offline ``Engine`` (``offline``) and ``AsyncEngine`` (``async_engine``,
the core on its own thread for the HTTP server, driven by typed ``commands``)."""

from pdjax.engine.async_engine import AsyncEngine
from pdjax.engine.core import EngineCore
from pdjax.engine.offline import Engine

__all__ = ["AsyncEngine", "Engine", "EngineCore"]
