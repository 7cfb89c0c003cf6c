"""PD with n-gram speculative decoding on the decode server (issue 33): greedy tokens equal
those of the same pair decoding plainly (requests opting out), tie-aware; acceptance shows on
the decode server's /metrics; every page comes back."""

import random

import pytest
from pd_harness import (at_baseline, free_port, generate, get, greedy_agrees, pd_router, pd_server,
                        running, wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_spec"))
    model = tiny_checkpoints["llama"]
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport,
                        extra=["--speculative-algorithm", "ngram"])
    decode = pd_server("decode_spec", "decode", model, logs,
                       extra=["--speculative-algorithm", "ngram",
                              "--speculative-num-draft-tokens", "4",
                              "--speculative-ngram-min-match-window-size", "1"])
    router = pd_router("router", prefill, bport, decode, logs)
    with running([prefill, decode, router]):
        yield dict(prefill=prefill, decode=decode, router=router)



def test_pd_decode_speculates_from_its_first_step(pd):
    rng = random.Random(33)
    prompts = []
    for n in (24, 41, 57):
        pat = [rng.randrange(3, 440) for _ in range(rng.randrange(3, 7))]
        prompts.append((pat * 20)[:n])
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}
    verified = 0
    for ids in prompts:
        ref = generate(pd["router"], ids, {**greedy, "speculative": False}, return_logprob=True,
                   top_logprobs_num=2)
        out = generate(pd["router"], ids, greedy)
        greedy_agrees(ref["output_ids"], ref["meta_info"]["output_top_logprobs"],
                      out["output_ids"])
        assert len(out["output_ids"]) == 20
        assert "spec_verify_ct" not in ref["meta_info"]
        verified += out["meta_info"].get("spec_verify_ct", 0)
    # (That the first decode step drafts from the prompt: tests/sched/test_spec_rows.py.)
    assert verified > 0
    status, text = get(pd["decode"].url + "/metrics")
    assert status == 200
    rows = [line for line in text.splitlines() if line.startswith("pdjax:spec_verify_rows_total")]
    assert rows and float(rows[0].split()[-1]) >= verified
    wait_until(lambda: at_baseline(pd["decode"]) and at_baseline(pd["prefill"]), 30)
