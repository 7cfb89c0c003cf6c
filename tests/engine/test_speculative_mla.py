"""n-gram speculative decoding on the tiny DeepSeek-V3.2 and GLM-5 (MLA with the DSA indexer):
greedy tokens equal those of the same engine decoding plainly (requests opting out run the
decode entry), tie-aware (DESIGN.md §5); verify rows ran; no compile after warm-up."""

import numpy as np
import pytest

from model_utils import TINY_TOKENIZER_VOCAB, assert_speculation_keeps_tokens
from pdjax.engine import Engine
from pdjax.runner.model_runner import compile_count


@pytest.mark.slow      # two MLA engines each: a heavy model check
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_mla_greedy_tokens_equal_with_speculation(tiny_checkpoints, name):
    eng = Engine(tiny_checkpoints[name], dtype="float32", page_size=8, max_total_tokens=2048,
                 max_running_requests=4, chunked_prefill_size=32, context_length=128,
                 progress=False, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                 speculative_ngram_min_match_window_size=1)
    try:
        rng = np.random.default_rng(5)
        prompts = []
        for n in (20, 37, 50):
            pat = rng.integers(3, TINY_TOKENIZER_VOCAB, int(rng.integers(3, 7))).tolist()
            prompts.append((pat * 20)[:n])
        sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        before = compile_count()
        out, _ = assert_speculation_keeps_tokens(eng, prompts, sp, what=name)
        assert [len(o["output_ids"]) for o in out] == [24] * len(prompts)
        assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) >= 3
        assert compile_count() == before
        sched = eng.core.scheduler
        sched.check_invariants()
        assert eng.core.flush_cache() and sched.allocator.num_free == sched.config.num_pages - 1
    finally:
        eng.shutdown()
