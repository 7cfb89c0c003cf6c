"""A separate draft model (``--speculative-algorithm draft``): greedy tokens equal plain
decoding (tie-aware); the target itself as the draft model has every draft accepted (its
catch-up, draft steps and rollback keep its KV right); an unrelated draft model has none
accepted and changes nothing; the draft model's pages all come back; no compile after
warm-up."""

import numpy as np
import pytest

from model_utils import assert_tokens_match, top2_gaps_from_top_logprobs
from pdjax.config import ServerArgs
from pdjax.engine import Engine
from pdjax.runner.model_runner import compile_count


def _engine(ckpts, draft):
    return Engine(ckpts["llama"], dtype="float32", page_size=8, max_total_tokens=2048,
                  max_running_requests=4, chunked_prefill_size=32, context_length=128,
                  progress=False, speculative_algorithm="draft",
                  speculative_draft_model_path=ckpts[draft], speculative_num_draft_tokens=4,
                  enable_mixed_chunk=True)


@pytest.mark.parametrize("draft,min_accept_len", [("llama", 3.5), ("qwen2", 1.0)])
def test_draft_model_greedy_tokens_equal(tiny_checkpoints, draft, min_accept_len):
    eng = _engine(tiny_checkpoints, draft)
    try:
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, 500, n).tolist() for n in (20, 37, 50, 90)]
        sp = {"max_new_tokens": 25, "temperature": 0, "ignore_eos": True}
        before = compile_count()
        ref = eng.generate(input_ids=prompts, sampling_params={**sp, "speculative": False},
                           return_logprob=True, top_logprobs_num=2)
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        for o, r in zip(out, ref):
            gaps = top2_gaps_from_top_logprobs(r["meta_info"]["output_top_logprobs"])
            assert_tokens_match(o["output_ids"], r["output_ids"], gaps, what=draft)
            assert len(o["output_ids"]) == 25
            assert o["meta_info"]["spec_verify_ct"] > 0
            assert o["meta_info"]["spec_accept_len"] >= min_accept_len
        assert compile_count() == before
        drafter = eng.core.speculator.drafter
        assert not drafter._seqs
        assert drafter.allocator.num_free == drafter.allocator.num_pages - 1
        assert eng.core.flush_cache()
        sched = eng.core.scheduler
        assert sched.allocator.num_free == sched.config.num_pages - 1
    finally:
        eng.shutdown()


def test_draft_flags_go_together():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="ngram", speculative_draft_model_path="/x")
