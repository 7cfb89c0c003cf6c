"""Sampler: filters, penalties, seeds and logprobs on hand-made logits."""

import numpy as np
import pytest

from pdjax.request import Request, SamplingParams
from pdjax.runner.sampler import log_softmax, sample_token, top_logprobs


def _req(prompt=(1, 2), outputs=(), seed=7, logprob=False, top=0, **sp):
    r = Request("r", list(prompt), SamplingParams(**sp), return_logprob=logprob, top_logprobs_num=top)
    r.output_ids = list(outputs)
    r.seed_for_sampling = seed
    return r


LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1], np.float32))


def _draws(n=300, **kw):
    out = []
    for s in range(n):
        out.append(sample_token(LOGITS.copy(), _req(seed=s, **kw)).token_id)
    return np.bincount(out, minlength=5)


def test_greedy_and_logprobs():
    res = sample_token(LOGITS.copy(), _req(temperature=0, logprob=True, top=3))
    assert res.token_id == 1
    assert res.logprob == pytest.approx(np.log(0.4), abs=1e-6)
    assert [t for t, _ in res.top_logprobs] == [1, 2, 3]
    assert res.top_logprobs[1][1] == pytest.approx(np.log(0.3), abs=1e-6)


def test_top_k_top_p_min_p_restrict_support():
    assert set(np.nonzero(_draws(top_k=2))[0]) == {1, 2}
    # top_p 0.65: 0.4 + 0.3 reaches it, so only tokens 1 and 2.
    assert set(np.nonzero(_draws(top_p=0.65))[0]) == {1, 2}
    # min_p 0.5: keep p >= 0.2.
    assert set(np.nonzero(_draws(min_p=0.5))[0]) == {1, 2}
    counts = _draws(n=2000)
    assert set(np.nonzero(counts)[0]) == {0, 1, 2, 3, 4}
    assert abs(counts[1] / 2000 - 0.4) < 0.05


def test_temperature_sharpens():
    hot, cold = _draws(n=1000, temperature=2.0), _draws(n=1000, temperature=0.3)
    assert cold[1] > hot[1]


def test_seed_reproducible_and_position_dependent():
    a = [sample_token(LOGITS.copy(), _req(seed=5, outputs=[0] * i)).token_id for i in range(40)]
    b = [sample_token(LOGITS.copy(), _req(seed=5, outputs=[0] * i)).token_id for i in range(40)]
    c = [sample_token(LOGITS.copy(), _req(seed=6, outputs=[0] * i)).token_id for i in range(40)]
    assert a == b and a != c


def test_penalties():
    logits = np.array([2.0, 1.9, -1.0, 0.5], np.float32)
    # Repetition penalty divides positive logits of seen tokens (prompt and output).
    assert sample_token(logits.copy(), _req(prompt=[0], temperature=0, repetition_penalty=1.5)).token_id == 1
    # Frequency penalty scales with the count; presence is flat.
    r = _req(prompt=[3], outputs=[0, 0], temperature=0, frequency_penalty=0.1)
    assert sample_token(logits.copy(), r).token_id == 1           # 2.0 - 0.2 < 1.9
    r = _req(prompt=[3], outputs=[0], temperature=0, presence_penalty=0.05)
    assert sample_token(logits.copy(), r).token_id == 0           # 2.0 - 0.05 > 1.9
    # Logprobs are of the raw logits, before penalties.
    r = _req(prompt=[0], temperature=0, repetition_penalty=2.0, logprob=True)
    res = sample_token(logits.copy(), r)
    assert res.token_id == 1 and res.logprob == pytest.approx(log_softmax(logits)[1], abs=1e-9)


def test_top_logprobs_order():
    lp = log_softmax(np.array([0.1, 3.0, 2.0, 3.0], np.float32))
    assert [t for t, _ in top_logprobs(lp, 3)] == [1, 3, 2]
    assert top_logprobs(lp, 0) == []


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2),
                                         ("min_p", 1.5), ("n", 0), ("max_new_tokens", -1),
                                         ("repetition_penalty", 0.0), ("frequency_penalty", 3.0),
                                         # beyond float32 (the device's): inf there
                                         ("temperature", 1e39), ("temperature", 1e308)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-6])
def test_subnormal_temperature_is_greedy(temperature):
    # Dividing by a subnormal temperature overflowed to inf/NaN and sampled token 0.
    res = sample_token(LOGITS.copy(), _req(temperature=temperature))
    assert res.token_id == 1
    assert SamplingParams(temperature=temperature).is_greedy


def test_seed_range_is_checked():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-5)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2 ** 200)
    assert SamplingParams(seed=2 ** 63 - 1).seed == 2 ** 63 - 1
