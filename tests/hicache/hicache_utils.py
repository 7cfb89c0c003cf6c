"""Helpers of the HiCache engine tests: greedy generations with the top-2 logprobs of every
token, compared tie-aware (DESIGN.md §5), and the cached tokens they report."""

from __future__ import annotations

from model_utils import assert_output_agrees


def generate(engine, prompts, sampling_params: dict) -> list[dict]:
    """``engine``'s outputs for ``prompts`` with the top-2 logprobs of every token."""
    return engine.generate(input_ids=prompts, sampling_params=sampling_params,
                           return_logprob=True, top_logprobs_num=2)


def agree(ref: list[dict], outs: list[dict], what: str) -> None:
    """``outs`` give ``ref``'s greedy tokens, tie-aware, and logprobs within tolerance."""
    assert len(ref) == len(outs)
    for i, (r, o) in enumerate(zip(ref, outs)):
        assert assert_output_agrees(r, o, f"{what} prompt {i}") >= 1


def cached_tokens(outs: list[dict]) -> list[int]:
    """Each output's ``cached_tokens``."""
    return [o["meta_info"]["cached_tokens"] for o in outs]
