"""The step cost model (pdjax.sched.cost_model): recovers a known cost law from noisy samples,
predicts buckets it never timed from the pooled fit, and predicts real SmolLM2 step timings
replayed from bench_mixed (tests/sched/data/mixed_step_trace.json) online, as the scheduler uses
it: predict a step, then observe it. Pure Python."""

import json
import os
import random
import statistics

import pytest

from pdjax.sched.buckets import ENTRY_OF_MODE, BucketKey, Buckets
from pdjax.sched.cost_model import StepCostModel

BUCKETS = Buckets.create(chunked_prefill_size=256, max_running_requests=16, max_pages_per_seq=128)
TRACE = os.path.join(os.path.dirname(__file__), "data", "mixed_step_trace.json")


def _true_s(key, n, c):
    # 1 ms + 40 us per padded token + 2 us per cached token (a CPU-like forward)
    return 1e-3 + 4e-5 * key.num_tokens + 2e-6 * c


def _model():
    return StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, token_scale=256, cached_scale=2048)


def test_recovers_a_known_cost_law_and_predicts_an_untimed_bucket():
    rng = random.Random(0)
    model = _model()
    seen = [16, 32, 64, 256]                  # bucket 128 is never timed
    for _ in range(400):
        t = rng.choice(seen)
        key = BUCKETS.pick("mixed", t, 9, 64)
        n, c = rng.randint(t // 2 + 1, t), rng.randint(0, 4000)
        model.observe(key, n, c, _true_s(key, n, c) * rng.uniform(0.97, 1.03))
    errors, unseen = [], []
    for _ in range(200):
        t = rng.choice(seen + [128])
        key = BUCKETS.pick("mixed", t, 9, 64)
        n, c = rng.randint(t // 2 + 1, t), rng.randint(0, 4000)
        err = abs(model.predict("mixed", n, 9, 64, c) - _true_s(key, n, c)) / _true_s(key, n, c)
        (unseen if t == 128 else errors).append(err)
    assert statistics.median(errors) < 0.02 and max(errors) < 0.06
    assert statistics.median(unseen) < 0.05 and max(unseen) < 0.12
    desc = model.describe()
    assert desc["num_observed"] == 400 and len(desc["buckets"]) == 4
    # mixed batches run on the extend executable (shared with prefill_chunk batches)
    assert desc["entries"]["extend"]["per_cached_token_s"] == pytest.approx(2e-6, rel=0.1)
    for b in desc["buckets"]:
        assert b["entry"] == "extend" and b["num_samples"] > 50
        assert b["per_cached_token_s"] == pytest.approx(2e-6, rel=0.15)
        assert b["fixed_s"] == pytest.approx(1e-3 + 4e-5 * b["num_tokens"], rel=0.15)


def test_no_data_means_no_prediction_and_bad_arguments_name_the_field():
    model = _model()
    assert model.predict("mixed", 40, 9, 16, 100) is None
    assert model.predict("mixed", 10_000, 9, 16, 100) is None        # no bucket holds it
    model.observe(BUCKETS.pick("decode", 8, 8, 16), 8, 800, 0.01)
    assert model.predict("mixed", 40, 9, 16, 100) is None            # another entry point
    assert model.predict("decode", 8, 8, 16, 800) == pytest.approx(0.01, rel=0.05)
    model.observe(BUCKETS.pick("decode", 8, 8, 16), 8, 800, float("nan"))   # ignored
    assert model.num_observed == 1
    for kw, name in (({"token_scale": 0}, "token_scale"), ({"key_forget": 1.5}, "key_forget"),
                     ({"prior_strength": -1}, "prior_strength")):
        with pytest.raises(ValueError, match=name):
            StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, **kw)
    with pytest.raises(ValueError, match="token_buckets"):
        StepCostModel(BUCKETS.pick, (64, 16))


def test_replayed_smollm2_step_timings_are_predicted_online():
    with open(TRACE) as f:
        trace = json.load(f)
    steps = trace["steps"]
    assert len(steps) > 200
    # The keys come from the trace, so predict_key is used directly (no bucket picking).
    model = StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, token_scale=256, cached_scale=2016)
    errors = {"mixed": [], "decode": [], "prefill_chunk": []}
    for i, s in enumerate(steps):
        key = BucketKey(**s["key"])
        predicted = model.predict_key(key, s["num_tokens"], s["num_cached_tokens"])
        if predicted is not None and i >= 50:           # after the first rounds
            errors[key.entry].append(abs(predicted - s["measured_s"]) / s["measured_s"])
        model.observe(key, s["num_tokens"], s["num_cached_tokens"], s["measured_s"])
    medians = {e: statistics.median(v) for e, v in errors.items() if v}
    print("\nmedian relative error of the online prediction per entry:",
          {e: round(m, 3) for e, m in medians.items()}, {e: len(v) for e, v in errors.items()})
    assert len(errors["mixed"]) > 100
    # The machine is shared: its load swings a step by up to 2x, which the load factor tracks.
    assert medians["mixed"] < 0.15 and medians["decode"] < 0.2


def test_coefficients_stay_non_negative_on_collinear_noisy_samples():
    # Full buckets only (tokens = bucket size) and a cost that rises faster than linearly: an
    # unconstrained fit has a negative fixed cost and predicts a small step to cost nothing.
    model = _model()
    for t, secs in ((64, 0.010), (128, 0.030), (256, 0.090)) * 5:
        model.observe(BUCKETS.pick("mixed", t, 9, 16), t, 0, secs)
    desc = model.describe()
    for c in (desc["entries"]["extend"], *desc["buckets"]):
        assert all(c[k] >= 0 for k in c if k.endswith("_s")), c
    small = model.predict("mixed", 16, 9, 16, 0)
    assert small > 0.001                     # never 0 or negative for an untimed small bucket
    assert small <= model.predict("mixed", 64, 9, 16, 0) <= model.predict("mixed", 256, 9, 16, 0)


def test_margin_is_an_upper_quantile_of_the_replayed_prediction_errors():
    """Planned against ``prediction x margin``, about 1 - plan_quantile of the replayed SmolLM2
    mixed steps run over their plan; against the point prediction, about half do."""
    with open(TRACE) as f:
        steps = json.load(f)["steps"]
    model = StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, token_scale=256, cached_scale=2016)
    assert model.margin("mixed") == 1.0                  # nothing known yet
    over_point, over_planned, margins = [], [], []
    for i, s in enumerate(steps):
        # The trace names its keys by forward mode; the engine's keys use the entry point.
        mode = s["key"]["entry"]
        key = BucketKey(**{**s["key"], "entry": ENTRY_OF_MODE[mode]})
        predicted = model.predict_key(key, s["num_tokens"], s["num_cached_tokens"])
        margin = model.margin(mode)
        if predicted is not None and i >= 50 and mode == "mixed":
            over_point.append(s["measured_s"] > predicted)
            over_planned.append(s["measured_s"] > predicted * margin)
            margins.append(margin)
        model.observe(key, s["num_tokens"], s["num_cached_tokens"], s["measured_s"])
    assert len(over_planned) > 200
    share_point, share_planned = sum(over_point) / len(over_point), sum(over_planned) / len(over_planned)
    print(f"\nshare of mixed steps over the point prediction {share_point:.3f}, over prediction x "
          f"margin {share_planned:.3f}; median margin {statistics.median(margins):.3f}")
    assert share_point > 0.35 and share_planned < 0.12
    assert min(margins) >= 1.0 and statistics.median(margins) > 1.1
    assert model.describe()["entries"]["extend"]["margin"] == model.margin("prefill_chunk")
    with pytest.raises(ValueError, match="forward_mode"):
        model.margin("extend")
    for kw, name in (({"plan_quantile": 1.0}, "plan_quantile"),
                     ({"residual_window": 0}, "residual_window")):
        with pytest.raises(ValueError, match=name):
            StepCostModel(BUCKETS.pick, BUCKETS.token_buckets, **kw)
