"""Host overhead on /metrics: per-step host and forward time histograms fed from the engine's
``host_time_s`` / ``forward_time_s`` accumulators (pdjax.metrics.Metrics.attach_engine)."""

import pytest
from bench_common import parse_metrics, server_step_times

from pdjax.metrics import Metrics


class _Core:
    def __init__(self):
        self.step_hooks, self.runner = [], None
        self.host_time_s = self.forward_time_s = 0.0
        self.num_overlapped_dispatches = self.num_exposed_dispatches = 0

    def get_load(self):
        return {}


def test_step_time_histograms_and_server_step_times():
    m, core = Metrics(), _Core()
    m.attach_engine(core)
    assert len(core.step_hooks) == 1
    before = parse_metrics(m.render()[0].decode())
    for host, fwd, busy in ((0.001, 0.004, 0), (0.002, 0.006, 1), (0.003, 0.010, 1)):
        core.host_time_s += host
        core.forward_time_s += fwd
        core.num_overlapped_dispatches += busy
        core.num_exposed_dispatches += 1 - busy
        for hook in core.step_hooks:
            hook(None, [])
    after = parse_metrics(m.render()[0].decode())
    assert after[("pdjax:step_host_time_seconds_count", ())] == 3
    assert after[("pdjax:step_host_time_seconds_sum", ())] == pytest.approx(0.006)
    assert after[("pdjax:step_forward_time_seconds_sum", ())] == pytest.approx(0.020)
    assert after[("pdjax:overlapped_dispatches_total", ())] == 2
    assert after[("pdjax:exposed_dispatches_total", ())] == 1
    st = server_step_times(before, after)
    assert st["num_steps"] == 3
    assert st["host_time_per_step_ms"] == pytest.approx(2.0)
    assert st["forward_time_per_step_ms"] == pytest.approx(20.0 / 3)
    assert st["host_overhead_fraction"] == pytest.approx(6 / 26)
    assert server_step_times(None, after)["host_time_per_step_ms"] is None


def test_step_tokens_and_predicted_and_measured_step_time():
    from pdjax.request import Request, SamplingParams
    from pdjax.sched.scheduler import ScheduledBatch, ScheduledRow

    m, core = Metrics(), _Core()
    m.attach_engine(core)
    req = Request("r", list(range(3, 40)), SamplingParams(max_new_tokens=2))
    for rows, predicted, fwd in (([ScheduledRow(req, 0, 24)], 0.005, 0.006),
                                 ([ScheduledRow(req, 24, 13)], None, 0.003)):
        core.forward_time_s += fwd
        for hook in core.step_hooks:
            hook(ScheduledBatch("prefill_chunk", rows, 1, predicted_time_s=predicted), [])
    s = parse_metrics(m.render()[0].decode())
    assert s[("pdjax:step_tokens_count", ())] == 2 and s[("pdjax:step_tokens_sum", ())] == 37
    assert s[("pdjax:step_tokens_bucket", (("le", "16.0"),))] == 1      # the 13-token step
    assert s[("pdjax:step_time_predicted_seconds_count", ())] == 1      # only one had a forecast
    assert s[("pdjax:step_time_predicted_seconds_sum", ())] == pytest.approx(0.005)
    assert s[("pdjax:step_time_seconds_count", ())] == 2
    assert s[("pdjax:step_time_seconds_sum", ())] == pytest.approx(0.009)
