"""The engine's side of KV transfer: the ``KVTransferWorker`` it polls (DESIGN.md §4).

A worker owns what moves KV bytes -- threads, sockets, device copies -- and the engine thread
talks to it at two points of every step (vLLM V1's KV-connector worker role,
``start_load_kv`` / ``wait_for_save`` / ``get_finished``, folded into two calls)::

    step(): out = worker.poll()                       what finished since the last step
            scheduler.update_from_kv_output(out)      pages back / requests ready
            (PD role: rooms, timeouts)  -> schedule -> forward -> read
            worker.start(scheduler.build_connector_meta(batch))   what to move now

``start`` must not block on the network: it queues work (or does a local copy) and returns;
``poll`` never blocks. ``has_work`` tells the engine to step again although no request is
scheduled (something finished and ``poll`` would report it). The worker is built together with
its connector (``pdjax.transfer.factory``): both halves of one transfer method share its
state, as vLLM's scheduler and worker connectors share a class.
"""

from __future__ import annotations

import abc
import queue
from typing import Any, Callable

from pdjax.sched.kv_connector import KVConnectorOutput


class EventQueue:
    """The typed events a worker's threads report to the engine thread (DESIGN.md §4, "Threads
    and their events"): ``post`` from any thread (then ``wake()``: the engine should step),
    ``drain`` on the engine thread, oldest first."""

    def __init__(self, wake: Callable[[], None]):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = wake

    def post(self, event: Any) -> None:
        self._queue.put(event)
        self._wake()

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out


class KVTransferWorker(abc.ABC):
    """Base of the transfer workers (see the module docstring). Engine thread only, except
    for the worker's own threads."""

    @abc.abstractmethod
    def start(self, meta: Any) -> None:
        """Begin moving what ``meta`` (``KVConnector.build_meta``'s value, never None) says."""

    @abc.abstractmethod
    def poll(self) -> KVConnectorOutput:
        """What finished since the last call (an empty output when nothing did)."""

    def has_work(self) -> bool:
        """Whether ``poll`` has something to report now."""
        return False

    def close(self) -> None:
        """Stop the worker's threads (engine shutdown)."""


class NullWorker(KVTransferWorker):
    """A colocated server's worker: nothing to move, nothing ever finished."""

    def start(self, meta: Any) -> None:
        raise AssertionError(f"NullWorker.start({meta!r}): a NullConnector plans no transfer")

    def poll(self) -> KVConnectorOutput:
        return KVConnectorOutput()
