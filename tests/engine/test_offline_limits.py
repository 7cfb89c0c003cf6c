"""The offline ``Engine`` and integer fields past their device widths: a ``top_k``
over int32 is a ``ValueError`` naming it (the device's int32 array could not hold it), and the
largest seed with ``n`` samples wraps below 2**63 instead of failing."""

import pytest

PROMPT = [5, 17, 42, 99, 7]


def test_top_k_past_int32_is_refused_naming_it(llama_engine):
    for top_k in (2 ** 31, 10 ** 30):
        with pytest.raises(ValueError, match="top_k"):
            llama_engine.generate(input_ids=PROMPT,
                                  sampling_params={"max_new_tokens": 2, "top_k": top_k})
    assert not llama_engine.core.scheduler.has_work
    out = llama_engine.generate(input_ids=PROMPT, sampling_params={
        "max_new_tokens": 2, "temperature": 0, "top_k": 2 ** 31 - 1})
    assert len(out["output_ids"]) == 2


def test_largest_seed_with_n_samples(llama_engine):
    outs = llama_engine.generate(input_ids=[PROMPT], sampling_params={
        "max_new_tokens": 3, "seed": 2 ** 63 - 1, "n": 2})
    assert [len(o["output_ids"]) for o in outs] == [3, 3]
