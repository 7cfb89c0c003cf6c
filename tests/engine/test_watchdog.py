"""The engine watchdog (``--watchdog-timeout-s``): a step over the timeout fires it once; steps
that end in time, and idle time between steps, never do."""

import threading
import time

import pytest

from pdjax.engine.watchdog import Watchdog


class FakeClock:
    """``time.monotonic`` that moves only when the test moves it: the watchdog polls in real
    time, but what it measures does not depend on how loaded the machine is."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_a_step_over_the_timeout_fires_once_with_the_elapsed_time(monkeypatch):
    import pdjax.engine.watchdog as watchdog

    clock = FakeClock()
    monkeypatch.setattr(watchdog, "time", clock)
    fired, done = [], threading.Event()

    def on_timeout(elapsed_s):
        fired.append(elapsed_s)
        done.set()

    dog = Watchdog(0.2, on_timeout, poll_s=0.01).start()
    try:
        for _ in range(3):                 # short steps and long idle gaps: no alarm
            dog.step_started()
            clock.now += 0.15
            time.sleep(0.05)               # several polls see the step at 0.15 s
            dog.step_ended()
            clock.now += 60.0
            time.sleep(0.05)
        assert fired == []
        dog.step_started()                 # a hung step
        clock.now += 0.25
        assert done.wait(5.0)
        clock.now += 10.0
        time.sleep(0.1)                    # polls after it fired: no second call
        assert fired == [pytest.approx(0.25)] and dog.fired
    finally:
        dog.stop()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Watchdog(0.0, lambda s: None)
