"""``min_new_tokens`` and ``stop_regex`` in the offline engine (tiny random Llama).

``min_new_tokens``: a stop token the greedy path produces early (``stop_token_ids``) is held
back on the device until that many tokens are out, overlap on and off, and the tokens before it
are the same as without; nothing compiles. ``stop_regex``: the text ends before the first match
with finish reason ``stop`` matching the pattern. Bad values are a ``ValueError`` naming the
field and the engine keeps serving."""

import re

import pytest

from pdjax.runner.model_runner import compile_count

PROMPT = [5, 9, 33, 70, 101]
PLAIN = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _first_repeat_free_stop(ids: list[int], at_least: int) -> tuple[int, int]:
    """(index, token) of the first output token at index >= ``at_least`` not seen before it."""
    for k in range(at_least, len(ids)):
        if ids[k] not in ids[:k]:
            return k, ids[k]
    pytest.fail(f"the tiny model's greedy output repeats itself: {ids} (pick another prompt)")


@pytest.mark.parametrize("overlap", [False, True])
def test_min_new_tokens_holds_back_a_stop_token_the_greedy_path_produces(llama_engine, overlap):
    core = llama_engine.core
    before_overlap, core.overlap = core.overlap, overlap
    try:
        ref = llama_engine.generate(input_ids=PROMPT, sampling_params=PLAIN,
                                    return_logprob=True, top_logprobs_num=2)
        ids = ref["output_ids"]
        k, stop = _first_repeat_free_stop(ids, 1)
        runner_up = ref["meta_info"]["output_top_logprobs"][k][1][1]
        before, before_runner = compile_count(), core.runner.compiles_after_warmup
        stopped = llama_engine.generate(input_ids=PROMPT, sampling_params=dict(
            PLAIN, stop_token_ids=[stop]))
        assert stopped["output_ids"] == ids[:k + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        held = llama_engine.generate(input_ids=PROMPT, sampling_params=dict(
            PLAIN, stop_token_ids=[stop], min_new_tokens=k + 2))
        out = held["output_ids"]
        assert out[:k] == ids[:k] and out[k] == runner_up != stop
        assert stop not in out[:k + 2] and len(out) >= k + 2
        if held["meta_info"]["finish_reason"]["type"] == "stop":
            assert out[-1] == stop and len(out) > k + 2
        # min_new_tokens 0 and min_new_tokens at the stop's index change nothing.
        for m in (0, k):
            same = llama_engine.generate(input_ids=PROMPT, sampling_params=dict(
                PLAIN, stop_token_ids=[stop], min_new_tokens=m))
            assert same["output_ids"] == ids[:k + 1]
        assert compile_count() == before and core.runner.compiles_after_warmup == before_runner
    finally:
        core.overlap = before_overlap


def test_min_new_tokens_holds_back_eos_for_each_of_n_samples(llama_engine):
    """The model's EOS is held back too (unless ignore_eos); each of n seeded samples keeps
    min_new_tokens tokens free of stop tokens."""
    core = llama_engine.core
    ref = llama_engine.generate(input_ids=PROMPT, sampling_params=PLAIN)["output_ids"]
    eos = sorted(core.eos_token_ids)
    sp = {"max_new_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "min_new_tokens": 6,
          "stop_token_ids": sorted(set(ref[:6]))}
    outs = llama_engine.generate(input_ids=PROMPT, sampling_params=sp)
    assert len(outs) == 3
    for o in outs:
        assert len(o["output_ids"]) >= 6
        assert not set(o["output_ids"][:6]) & (set(ref[:6]) | set(eos)), o["output_ids"]


def test_stop_regex_ends_the_text_at_the_first_match(llama_engine):
    tok = llama_engine.tokenizer
    ref = llama_engine.generate(input_ids=PROMPT, sampling_params=PLAIN)
    text, ids = ref["text"], ref["output_ids"]
    # A pattern matching the text of output token k, whose text first appears there (the tiny
    # model's output holds partial UTF-8 bytes: only clean pieces are taken).
    for k in range(1, len(ids)):
        prefix, piece = tok.decode(ids[:k]), tok.decode([ids[k]])
        if "\ufffd" not in prefix + piece and piece.strip() and text.find(piece) == len(prefix):
            break
    else:
        pytest.fail(f"no usable piece in {text!r} (pick another prompt)")
    pattern = re.escape(piece)
    out = llama_engine.generate(input_ids=PROMPT, sampling_params=dict(PLAIN, stop_regex=pattern))
    assert out["text"] == prefix and out["output_ids"] == ids[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    # Armed only past min_new_tokens: the same pattern does not stop before then.
    late = llama_engine.generate(input_ids=PROMPT, sampling_params=dict(
        PLAIN, stop_regex=pattern, min_new_tokens=k + 1))
    assert late["text"] == text and late["meta_info"]["finish_reason"]["type"] == "length"
    assert late["output_ids"] == ids


@pytest.mark.parametrize("sp,needle", [
    ({"min_new_tokens": 11}, r"min_new_tokens must be in \[0, max_new_tokens \(10\)\], got 11"),
    ({"min_new_tokens": -1}, "min_new_tokens must be in"),
    ({"stop_regex": "(unclosed"}, "stop_regex: '\\(unclosed' is not a valid regular expression"),
    ({"stop_regex": ["ok", ""]}, "stop_regex must be a non-empty string"),
    ({"min_new_tokens": 1, "stop_token_ids": list(range(100, 170))},
     "stop_token_ids: min_new_tokens holds back at most 64 stop tokens"),
])
def test_bad_values_name_the_field_and_the_engine_keeps_serving(llama_engine, sp, needle):
    with pytest.raises(ValueError, match=needle):
        llama_engine.generate(input_ids=PROMPT, sampling_params=dict(PLAIN, **sp))
    assert not llama_engine.core.scheduler.has_work
    assert len(llama_engine.generate(input_ids=PROMPT, sampling_params=PLAIN)["output_ids"]) == 10
