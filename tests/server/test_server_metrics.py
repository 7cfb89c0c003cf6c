"""pdjax.metrics: names, registry isolation, RequestTimer arithmetic, extension."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdjax.metrics import Metrics, RequestTimer


def samples(metrics):
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_names_have_the_pdjax_prefix():
    names = {name for name, _ in samples(Metrics())}
    for want in ("pdjax:time_to_first_token_seconds_count",
                 "pdjax:inter_token_latency_seconds_count",
                 "pdjax:e2e_request_latency_seconds_count", "pdjax:prompt_tokens_total",
                 "pdjax:generation_tokens_total", "pdjax:cached_tokens_total",
                 "pdjax:compile_count_total", "pdjax:num_running_reqs", "pdjax:num_queue_reqs",
                 "pdjax:kv_usage", "pdjax:num_used_pages"):
        assert want in names, want


def test_registries_are_independent():
    a, b = Metrics(), Metrics()
    a.prompt_tokens_total.inc(5)
    assert samples(a)[("pdjax:prompt_tokens_total", ())] == 5
    assert samples(b)[("pdjax:prompt_tokens_total", ())] == 0


def test_request_timer_records_ttft_itl_e2e():
    m = Metrics()
    t = RequestTimer(m, arrival_s=10.0)
    t.on_tokens(1, now_s=10.5)           # TTFT 0.5
    t.on_tokens(2, now_s=10.7)           # two gaps of 0.1
    t.on_tokens(0, now_s=11.0)           # nothing
    t.on_tokens(1, now_s=11.0)           # one gap of 0.3
    assert t.on_finish("stop", prompt_tokens=7, completion_tokens=4, cached_tokens=3,
                       now_s=11.25) == pytest.approx(1.25)
    t.on_finish("stop", 7, 4, 3, now_s=12.0)                 # counted once
    s = samples(m)
    assert s[("pdjax:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("pdjax:inter_token_latency_seconds_count", ())] == 3
    assert s[("pdjax:inter_token_latency_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("pdjax:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.25)
    assert s[("pdjax:num_requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("pdjax:prompt_tokens_total", ())] == 7
    assert s[("pdjax:generation_tokens_total", ())] == 4
    assert s[("pdjax:cached_tokens_total", ())] == 3
    # A first increment of 3 tokens: TTFT once, 2 ITL gaps of 0.
    t2 = RequestTimer(m, arrival_s=0.0)
    t2.on_tokens(3, now_s=1.0)
    s = samples(m)
    assert s[("pdjax:inter_token_latency_seconds_count", ())] == 5
    assert s[("pdjax:time_to_first_token_seconds_count", ())] == 2


def test_set_load_and_adding_metrics():
    m = Metrics()
    m.set_load({"num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_pages": 10,
                "num_total_pages": 40, "kv_usage": 0.25})
    s = samples(m)
    assert (s[("pdjax:num_running_reqs", ())], s[("pdjax:num_queue_reqs", ())],
            s[("pdjax:num_used_pages", ())], s[("pdjax:kv_usage", ())]) == (3, 2, 10, 0.25)
    c = m.add_counter("kv_transfer_total_bytes", "Bytes moved by PD transfers.", labels=("role",))
    assert m.kv_transfer_total_bytes is c
    c.labels(role="prefill").inc(4096)
    h = m.add_histogram("kv_transfer_latency_seconds", "Transfer latency.", buckets=(0.1, 1.0))
    h.observe(0.5)
    s = samples(m)
    assert s[("pdjax:kv_transfer_total_bytes_total", (("role", "prefill"),))] == 4096
    assert s[("pdjax:kv_transfer_latency_seconds_bucket", (("le", "1.0"),))] == 1
    with pytest.raises(ValueError, match="already registered"):
        m.add_gauge("kv_usage", "again")
    with pytest.raises(ValueError, match="metric name"):
        m.add_gauge("bad name", "x")


class _Runner:
    def __init__(self):
        self.compiles_after_warmup = 0
        self.on_unexpected_compile = None

    def compile(self, n):          # what ModelRunner.forward does on a request-path compile
        self.compiles_after_warmup += n
        self.on_unexpected_compile("bucket")


class _Core:
    def __init__(self):
        self.step_hooks = []
        self.runner = _Runner()
        self.load = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_pages": 0,
                     "kv_usage": 0.0}

    def get_load(self):
        return dict(self.load)


def test_attach_engine_wires_gauges_and_compiles_once():
    m, core = Metrics(), _Core()
    m.attach_engine(core)
    m.attach_engine(core)                       # idempotent
    assert len(core.step_hooks) == 1
    core.load.update(num_running_reqs=4, num_waiting_reqs=1, num_used_pages=9, kv_usage=0.5)
    for hook in core.step_hooks:
        hook(None, [])
    s = samples(m)
    assert (s[("pdjax:num_running_reqs", ())], s[("pdjax:num_queue_reqs", ())],
            s[("pdjax:num_used_pages", ())], s[("pdjax:kv_usage", ())]) == (4, 1, 9, 0.5)
    core.runner.compile(1)
    core.runner.compile(2)
    assert samples(m)[("pdjax:compile_count_total", ())] == 3
