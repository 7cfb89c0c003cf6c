"""SGLang's watchdog (``--watchdog-timeout``): an engine step that runs longer than
``watchdog_timeout_s`` means the engine is hung (a stuck device, a deadlock); the server then
logs every thread's stack and exits rather than hang with its requests. Pure Python."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


def exit_hung_process(elapsed_s: float) -> None:
    """The default action: dump every thread's stack to stderr and kill the process
    (SIGKILL: a hung engine thread cannot be stopped any other way; SGLang also kills)."""
    logger.critical("engine step has run for %.1f s (watchdog_timeout_s): exiting", elapsed_s)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Watchdog:
    """Calls ``on_timeout(elapsed_s)`` once when a step (``step_started`` ..
    ``step_ended``) lasts over ``timeout_s`` seconds; checks every ``poll_s`` seconds on a
    daemon thread, started by ``start``. Thread-safe."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[float], None] = exit_hung_process,
                 poll_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self._on_timeout = on_timeout
        self._started_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdjax-watchdog", daemon=True)
        self.fired = False

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def step_started(self) -> None:
        self._started_s = time.monotonic()

    def step_ended(self) -> None:
        self._started_s = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            started = self._started_s
            if started is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.timeout_s and not self.fired:
                self.fired = True
                self._on_timeout(elapsed)
