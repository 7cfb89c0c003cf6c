"""n-gram speculative decoding over 2 nodes x 2 simulated devices (TP 4, ``--nnodes 2``;
issue 33): greedy tokens equal a 1-process TP 1 engine without speculation (tie-aware), and
verify rows ran (the follower mirrors the verify forwards with their wider logits rows)."""

from __future__ import annotations

import pytest
from test_multihost import ARGS, start_cluster

from model_utils import assert_tokens_match, top2_gaps_from_top_logprobs
from pd_harness import post

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
            speculative_ngram_min_match_window_size=1)
PROMPTS = [([9, 41, 77, 300, 12] * 8)[:n] for n in (11, 23, 36)]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    from pdjax.engine import Engine

    with Engine(tiny_checkpoints["qwen3"], tp_size=1, progress=False, **ARGS) as eng:
        return eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True,
                            top_logprobs_num=2)


def test_two_nodes_tp4_speculate_with_equal_tokens(tiny_checkpoints, reference, tmp_path):
    leader, follower = start_cluster(tiny_checkpoints["qwen3"], str(tmp_path), SPEC, SPEC)
    try:
        leader.wait_healthy(600)
        status, out = post(leader.url + "/generate", {"input_ids": PROMPTS,
                                                      "sampling_params": GREEDY}, timeout_s=120)
        assert status == 200, out
        for i, (a, b) in enumerate(zip(out, reference, strict=True)):
            gaps = top2_gaps_from_top_logprobs(b["meta_info"]["output_top_logprobs"])
            assert_tokens_match(a["output_ids"], b["output_ids"], gaps, what=f"prompt {i}")
            assert len(a["output_ids"]) == GREEDY["max_new_tokens"]
        assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0
    finally:
        leader.stop()
        follower.stop()
