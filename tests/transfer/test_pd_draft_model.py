"""PD with the draft-model drafter on the decode server (issue 33): the decode server's draft
model prefills its own KV from the prompt that arrives with the first token, so with the tiny
Llama drafting for itself nearly every draft is accepted from the first step; greedy tokens
equal those of the same pair decoding plainly (requests opting out), tie-aware; every page
comes back."""

import random

import pytest
from pd_harness import (at_baseline, get, metric_value, prefill_decode_router, speculation_agrees,
                        wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_draft"))
    model = tiny_checkpoints["llama"]
    spec = ["--speculative-algorithm", "draft", "--speculative-draft-model-path", model]
    decode_extra = spec + ["--speculative-num-draft-tokens", "4"]
    with prefill_decode_router(model, logs, decode_name="decode_draft", prefill_extra=spec,
                               decode_extra=decode_extra) as servers:
        yield servers




def test_pd_decode_drafts_with_its_own_model(pd):
    rng = random.Random(34)
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}
    verified = 0
    for n in (24, 41, 57):
        ids = [rng.randrange(3, 440) for _ in range(n)]
        _, out = speculation_agrees(pd["router"], ids, greedy)
        assert len(out["output_ids"]) == 20
        verified += out["meta_info"].get("spec_verify_ct", 0)
        # 20 tokens at up to 4 a verify row: the draft kept up from the first step.
        assert out["meta_info"]["spec_verify_ct"] <= 8
    assert verified > 0
    status, text = get(pd["decode"].url + "/metrics")
    assert status == 200
    assert metric_value(text, "pdjax:spec_accept_rate") >= 0.8
    wait_until(lambda: at_baseline(pd["decode"]) and at_baseline(pd["prefill"]), 30)
