"""PD with n-gram speculative decoding on the decode server (issue 33): greedy tokens equal
those of the same pair decoding plainly (requests opting out), tie-aware; acceptance shows on
the decode server's /metrics; every page comes back."""

import random

import pytest
from pd_harness import at_baseline, get, prefill_decode_router, speculation_agrees, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_spec"))
    ngram = ["--speculative-algorithm", "ngram"]
    decode_extra = ngram + ["--speculative-num-draft-tokens", "4",
                            "--speculative-ngram-min-match-window-size", "1"]
    with prefill_decode_router(tiny_checkpoints["llama"], logs, decode_name="decode_spec",
                               prefill_extra=ngram, decode_extra=decode_extra) as servers:
        yield servers



def test_pd_decode_speculates_from_its_first_step(pd):
    rng = random.Random(33)
    prompts = []
    for n in (24, 41, 57):
        pat = [rng.randrange(3, 440) for _ in range(rng.randrange(3, 7))]
        prompts.append((pat * 20)[:n])
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}
    verified = 0
    for ids in prompts:
        ref, out = speculation_agrees(pd["router"], ids, greedy)
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
