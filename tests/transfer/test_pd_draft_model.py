"""PD with the draft-model drafter on the decode server (issue 33): the decode server's draft
model prefills its own KV from the prompt that arrives with the first token, so with the tiny
Llama drafting for itself nearly every draft is accepted from the first step; greedy tokens
equal those of the same pair decoding plainly (requests opting out), tie-aware; every page
comes back."""

import random

import pytest
from pd_harness import (at_baseline, free_port, generate, get, greedy_agrees, metric_value,
                        pd_router, pd_server, running, wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_draft"))
    model = tiny_checkpoints["llama"]
    spec = ["--speculative-algorithm", "draft", "--speculative-draft-model-path", model]
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, extra=spec)
    decode = pd_server("decode_draft", "decode", model, logs,
                       extra=spec + ["--speculative-num-draft-tokens", "4"])
    router = pd_router("router", prefill, bport, decode, logs)
    with running([prefill, decode, router]):
        yield dict(prefill=prefill, decode=decode, router=router)




def test_pd_decode_drafts_with_its_own_model(pd):
    rng = random.Random(34)
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}
    verified = 0
    for n in (24, 41, 57):
        ids = [rng.randrange(3, 440) for _ in range(n)]
        ref = generate(pd["router"], ids, {**greedy, "speculative": False}, return_logprob=True,
                   top_logprobs_num=2)
        out = generate(pd["router"], ids, greedy)
        greedy_agrees(ref["output_ids"], ref["meta_info"]["output_top_logprobs"],
                      out["output_ids"])
        assert len(out["output_ids"]) == 20
        verified += out["meta_info"].get("spec_verify_ct", 0)
        # 20 tokens at up to 4 a verify row: the draft kept up from the first step.
        assert out["meta_info"]["spec_verify_ct"] <= 8
    assert verified > 0
    status, text = get(pd["decode"].url + "/metrics")
    assert status == 200
    assert metric_value(text, "pdjax:spec_accept_rate") >= 0.8
    wait_until(lambda: at_baseline(pd["decode"]) and at_baseline(pd["prefill"]), 30)
