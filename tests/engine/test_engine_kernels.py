"""The engine's greedy outputs are unchanged when a Pallas kernel is forced (interpret mode)."""

import pytest

from model_utils import boundary_prompts
from pdjax.engine import Engine

pytestmark = pytest.mark.slow      # slow tier: whole engines on forced Pallas kernels

SETTINGS = dict(dtype="float32", page_size=8, max_total_tokens=512, max_running_requests=2,
                chunked_prefill_size=16, context_length=40, enable_mixed_chunk=True,
                progress=False)


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoints):
    eng = Engine(tiny_checkpoints["llama"], attention_backend="reference", **SETTINGS)
    prompts = boundary_prompts(5, seed=11, lengths=(3, 8, 9, 17, 31))
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True},
                        return_logprob=True, top_logprobs_num=2)
    eng.shutdown()
    return prompts, outs


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_forced_kernel_gives_same_greedy_tokens(tiny_checkpoints, reference_tokens, impl):
    from model_utils import assert_tokens_match, top2_gaps_from_top_logprobs

    prompts, ref = reference_tokens
    eng = Engine(tiny_checkpoints["llama"], attention_backend=impl, pallas_interpret=True, **SETTINGS)
    try:
        # The kernel really is in the compiled forward.
        key = eng.core.buckets.all_keys()[0]
        text = eng.core.runner.lower(key).as_text(debug_info=True)
        assert f"ragged_paged_attention_{impl}_decode/pallas_call" in text
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True})
    finally:
        eng.shutdown()
    for a, b in zip(ref, outs):
        gaps = top2_gaps_from_top_logprobs(a["meta_info"]["output_top_logprobs"])
        assert_tokens_match(b["output_ids"], a["output_ids"], gaps, what=impl)
