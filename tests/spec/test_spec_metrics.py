"""Speculative decoding on /metrics (pdjax.spec.metrics): the acceptance rate, accept length
and accept-length histogram follow the controller's statistics, step by step."""

from prometheus_client.parser import text_string_to_metric_families

from pdjax.metrics import Metrics
from pdjax.spec.controller import SpecController
from pdjax.spec.drafter import NgramDrafter


class _Core:
    def __init__(self):
        self.step_hooks = []
        self.speculator = SpecController(NgramDrafter(), num_draft_tokens=4)

    def get_load(self):
        return {}


def _samples(m):
    body, _ = m.render()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_spec_metrics_follow_the_controller():
    m, core = Metrics(), _Core()
    m.attach_engine(core)
    spec = core.speculator
    spec.on_verified("a", 3, 3, 4)
    spec.on_verified("b", 3, 0, 1)
    for hook in core.step_hooks:
        hook(None, [])
    spec.on_verified("a", 3, 1, 2)
    for hook in core.step_hooks:
        hook(None, [])
    s = _samples(m)
    assert s[("pdjax:spec_verify_rows_total", ())] == 3
    assert s[("pdjax:spec_draft_tokens_total", ())] == 9
    assert s[("pdjax:spec_accepted_tokens_total", ())] == 4
    assert abs(s[("pdjax:spec_accept_rate", ())] - 4 / 9) < 1e-9
    assert abs(s[("pdjax:spec_accept_length", ())] - 7 / 3) < 1e-9
    hist = {dict(k[1])["le"]: v for k, v in s.items()
            if k[0] == "pdjax:spec_verify_accept_length_bucket"}
    assert hist == {"1.0": 1, "2.0": 2, "3.0": 2, "4.0": 3, "+Inf": 3}
    assert s[("pdjax:spec_verify_accept_length_sum", ())] == 7
