"""Offline Engine vs transformers: greedy tokens and logprobs on a batch of 16 prompts."""

import numpy as np
import pytest
import torch
import transformers

from model_utils import assert_tokens_match, boundary_prompts, hf_greedy, set_sched, top2_gaps

NEW = 12


def test_batch_greedy_and_logprobs_match_transformers(llama_engine, tiny_checkpoints):
    set_sched(llama_engine, chunked_prefill_size=64)
    prompts = boundary_prompts(16, seed=0)
    outs = llama_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                 "temperature": 0, "ignore_eos": True},
                                 return_logprob=True, top_logprobs_num=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"],
                                                           dtype=torch.float32).eval()
    compared = 0
    for p, out in zip(prompts, outs):
        ref, logits = hf_greedy(hf, p, NEW, eos_token_id=None, pad_token_id=0)
        n = assert_tokens_match(out["output_ids"], ref, top2_gaps(logits), what=f"len {len(p)}")
        ref_lp = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
        ours_lp = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        for i in range(n):
            assert abs(ours_lp[i] - ref_lp[i, ref[i]]) < 1e-4
        top = out["meta_info"]["output_top_logprobs"][0]
        assert top[0][1] == int(np.argmax(logits[0])) and abs(top[0][0] - ref_lp[0].max()) < 1e-4
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}
        compared += n
    assert compared >= 16 * NEW // 2      # ties are rare: most positions are compared


@pytest.mark.parametrize("start", [3, 16, 17])
def test_prompt_logprobs_match_transformers(llama_engine, tiny_checkpoints, start):
    """Prompt logprobs from a start position, across chunk boundaries (chunk 16), including a
    start exactly on a chunk boundary."""
    set_sched(llama_engine, chunked_prefill_size=16, disable_radix_cache=True)
    prompts = boundary_prompts(3, seed=5, lengths=(40, 33, 20))
    outs = llama_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2, "temperature": 0},
                                 return_logprob=True, logprob_start_len=start, top_logprobs_num=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"],
                                                           dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1).numpy()
        got = out["meta_info"]["input_token_logprobs"]
        assert len(got) == len(p) - start
        ref = [lp[i - 1, p[i]] for i in range(start, len(p))]
        assert np.abs(np.array(got) - np.array(ref)).max() < 1e-4
