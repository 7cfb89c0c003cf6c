"""DeviceTimeline arithmetic: busy and idle seconds from dispatch and completion timestamps."""

import jax.numpy as jnp
import pytest

from pdjax.runner.timeline import DeviceTimeline


def test_summary_busy_idle_and_exposed_steps():
    tl = DeviceTimeline()
    tl.close()
    recs = [dict(dispatch_s=0.0, done_s=1.0, prev_busy=False),
            dict(dispatch_s=0.5, done_s=2.0, prev_busy=True),     # queued behind: no gap
            dict(dispatch_s=2.25, done_s=3.0, prev_busy=False),   # 0.25 s idle
            dict(dispatch_s=3.5, done_s=4.0, prev_busy=False)]    # 0.5 s idle
    s = tl.summary(recs)
    assert s["num_steps"] == 3 and s["exposed_steps"] == 2
    assert s["device_busy_s"] == pytest.approx(1.0 + 0.75 + 0.5)
    assert s["device_idle_s"] == pytest.approx(0.75)
    assert s["idle_fraction"] == pytest.approx(0.75 / 3.0)
    assert s["step_ms"] == pytest.approx(1000.0)
    assert tl.summary([])["idle_fraction"] is None


def test_watcher_timestamps_every_dispatch_in_order():
    class Key:
        entry = "decode"

    class Batch:
        rows = [0, 1]

    tl = DeviceTimeline()
    for i in range(3):
        tl.on_dispatch(Batch, Key, jnp.arange(4) * i, float(i))
    tl.close()
    assert [r["dispatch_s"] for r in tl.records] == [0.0, 1.0, 2.0]
    assert all(r["done_s"] > 0 and r["rows"] == 2 for r in tl.records)
