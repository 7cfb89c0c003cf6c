"""``logit_bias`` in the engine (tiny random Llama): applied on the device to every drawn token,
the first one included, with overlap on and off; rows without a bias keep their greedy tokens;
ids outside the vocabulary are a ``ValueError`` naming the field; nothing compiles."""

import numpy as np
import pytest

from model_utils import assert_tokens_match, top2_gaps_from_top_logprobs
from pdjax.runner.model_runner import compile_count

PROMPTS = [[5, 9, 33, 70, 101], [200, 17, 4, 4, 88, 301, 12, 9, 40]]


@pytest.mark.parametrize("overlap", [False, True])
def test_bias_forces_and_forbids_tokens(llama_engine, overlap):
    core = llama_engine.core
    before_overlap = core.overlap
    core.overlap = overlap
    try:
        before, before_runner = compile_count(), core.runner.compiles_after_warmup
        plain = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        ref = llama_engine.generate(input_ids=PROMPTS, sampling_params=plain,
                                    return_logprob=True, top_logprobs_num=2)
        first = ref[0]["output_ids"][0]
        runner_up = ref[0]["meta_info"]["output_top_logprobs"][0][1][1]
        forced = 77 if first != 77 else 78
        outs = llama_engine.generate(
            input_ids=PROMPTS + PROMPTS[:1] + PROMPTS[1:],
            sampling_params=[
                dict(plain, logit_bias={str(forced): 100}),                  # every token
                dict(plain, temperature=1.0, seed=3, logit_bias={forced: 100, 3: 5}),
                dict(plain, max_new_tokens=1, logit_bias={first: -100}),     # the runner-up
                plain])                                                      # no bias
        assert outs[0]["output_ids"] == [forced] * 6
        assert outs[1]["output_ids"] == [forced] * 6       # +100 leaves no other mass
        assert outs[2]["output_ids"] == [runner_up] and runner_up != first
        gaps = top2_gaps_from_top_logprobs(ref[1]["meta_info"]["output_top_logprobs"])
        assert_tokens_match(outs[3]["output_ids"], ref[1]["output_ids"], gaps,
                            what="beside biased rows")
        assert compile_count() == before and core.runner.compiles_after_warmup == before_runner
    finally:
        core.overlap = before_overlap


def test_bias_ids_outside_the_model_vocabulary_are_refused(llama_engine):
    vocab = llama_engine.core.model_cfg.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias: token id {vocab} is outside"):
        llama_engine.generate(input_ids=PROMPTS[0],
                              sampling_params={"max_new_tokens": 2, "logit_bias": {vocab: 1}})
    with pytest.raises(ValueError, match="logit_bias"):
        llama_engine.generate(input_ids=PROMPTS[0],
                              sampling_params={"max_new_tokens": 2, "logit_bias": {"1": -101}})
    with pytest.raises(ValueError, match=rf"stop_token_ids: token id {vocab} is outside"):
        llama_engine.generate(input_ids=PROMPTS[0],
                              sampling_params={"max_new_tokens": 2, "stop_token_ids": [vocab]})
    assert not llama_engine.core.scheduler.has_work
    np.testing.assert_equal(llama_engine.generate(input_ids=PROMPTS[0], sampling_params={
        "max_new_tokens": 2, "temperature": 0, "logit_bias": {vocab - 1: 100}})["output_ids"],
        [vocab - 1] * 2)
