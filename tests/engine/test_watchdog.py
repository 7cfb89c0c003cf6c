"""The engine watchdog (``--watchdog-timeout-s``): a step over the timeout fires it once; steps
that end in time, and idle time between steps, never do."""

import threading
import time

import pytest

from pdjax.engine.watchdog import Watchdog


def test_a_step_over_the_timeout_fires_once_with_the_elapsed_time():
    fired, done = [], threading.Event()

    def on_timeout(elapsed_s):
        fired.append(elapsed_s)
        done.set()

    dog = Watchdog(0.2, on_timeout, poll_s=0.02).start()
    try:
        for _ in range(3):                 # short steps and idle gaps: no alarm
            dog.step_started()
            time.sleep(0.05)
            dog.step_ended()
            time.sleep(0.3)
        assert fired == []
        dog.step_started()                 # a hung step
        assert done.wait(5.0)
        time.sleep(0.2)
        assert len(fired) == 1 and 0.2 < fired[0] < 5.0 and dog.fired
    finally:
        dog.stop()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Watchdog(0.0, lambda s: None)
