"""pdjax/output.py and the typed lifecycle in pdjax/request.py: token stops, the one output
accumulator (stop strings, trimmed stop tokens, logprobs, errors), FinishReason's SGLang
shape, frozen SamplingParams and the checked request transitions."""

import dataclasses

import pytest
from server_fakes import build_tokenizer, pieces_to_ids

from pdjax.engine_io import GenerateOutput
from pdjax.output import (OutputAccumulator, RequestOutput, token_finish_reason,
                          trim_matched_stop_token)
from pdjax.request import FinishReason, FinishType, Request, RequestState, SamplingParams


def test_finish_reason_sglang_dicts():
    assert FinishReason.stop(2).to_dict() == {"type": "stop", "matched": 2}
    assert FinishReason.stop("xy").to_dict() == {"type": "stop", "matched": "xy"}
    assert FinishReason.stop(None).to_dict() == {"type": "stop", "matched": None}
    assert FinishReason.of_length(7).to_dict() == {"type": "length", "length": 7}
    assert FinishReason.abort("gone", 400).to_dict() == {"type": "abort", "message": "gone"}
    assert FinishReason.abort("gone", 400).status == 400
    assert FinishReason.stop(2).matched_token == 2
    assert FinishReason.stop("2").matched_token is None
    assert FinishReason.stop(True).matched_token is None
    assert FinishReason.of_length(2).matched_token is None


def test_trim_matched_stop_token():
    assert trim_matched_stop_token([5, 6, 2], FinishReason.stop(2)) == [5, 6]
    assert trim_matched_stop_token([5, 6, 2], FinishReason.stop("x")) == [5, 6, 2]
    assert trim_matched_stop_token([5, 6, 2], FinishReason.of_length(3)) == [5, 6, 2]
    assert trim_matched_stop_token([5, 6], FinishReason.stop(2)) == [5, 6]
    assert trim_matched_stop_token([], None) == []


def test_token_finish_reason_order():
    sp = SamplingParams(max_new_tokens=3, stop_token_ids=[9])
    assert token_finish_reason(sp, 2, 1, {2}) == FinishReason.stop(2)
    assert token_finish_reason(sp, 9, 1, {2}) == FinishReason.stop(9)
    assert token_finish_reason(sp, 4, 2, {2}) is None
    assert token_finish_reason(sp, 4, 3, {2}) == FinishReason.of_length(3)
    # A stop token beats the length limit; a finished grammar beats it too.
    assert token_finish_reason(sp, 2, 3, {2}) == FinishReason.stop(2)
    assert token_finish_reason(sp, 4, 3, {2}, grammar_terminated=True) == FinishReason.stop(None)
    ignore = SamplingParams(max_new_tokens=None, ignore_eos=True, stop_token_ids=[9])
    assert token_finish_reason(ignore, 2, 100, {2}) is None
    assert token_finish_reason(ignore, 9, 100, {2}) == FinishReason.stop(9)


def _accumulator(tok, sp, prompt=(1, 2, 3)):
    return OutputAccumulator(tok, sp, RequestOutput("r", list(prompt)))


def test_a_stop_string_ends_the_request_and_cuts_the_tokens_after_it():
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["Hello", " wor", "ld", " S", "T", "O", "P", " and", " more"])
    acc = _accumulator(tok, SamplingParams(stop=["STOP"]))
    deltas = []
    for n, t in enumerate(ids):
        deltas.append(acc.add(GenerateOutput("r", [t], new_logprobs=[-0.1 * n],
                                             completion_tokens=n + 1)))
        if acc.finished:
            break
    last = deltas[-1]
    assert last.finished and last.stop_string_hit and not any(d.stop_string_hit
                                                              for d in deltas[:-1])
    r = acc.result
    assert r.text == "Hello world " and "".join(d.text for d in deltas) == r.text
    assert r.finish_reason == FinishReason.stop("STOP")
    assert r.output_ids == ids[:len(deltas)] and tok.decode(r.output_ids).endswith("STOP")
    assert r.output_logprobs == pytest.approx([-0.1 * n for n in range(len(deltas))])
    # After the finish nothing more is taken.
    after = acc.add(GenerateOutput("r", [ids[-1]], finished=True,
                                   finish_reason=FinishReason.of_length(9)))
    assert after.token_ids == [] and r.finish_reason == FinishReason.stop("STOP")


def test_a_stop_token_stays_in_the_ids_but_not_in_the_text():
    tok = build_tokenizer()
    eos = tok.eos_token_id
    ids = tok.encode("Paris is nice", add_special_tokens=False)
    acc = _accumulator(tok, SamplingParams())
    acc.add(GenerateOutput("r", ids[:-1], prompt_tokens=3, cached_tokens=2))
    d = acc.add(GenerateOutput("r", [ids[-1], eos], finished=True,
                               finish_reason=FinishReason.stop(eos)))
    r = acc.result
    assert d.finished and not d.stop_string_hit and d.first_token_offset == len(ids) - 1
    assert r.text == "Paris is nice" and r.output_ids == ids + [eos]
    assert r.finish_reason.to_dict() == {"type": "stop", "matched": eos}
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (3, 2, len(ids) + 1)


def test_an_error_output_fails_with_its_status_and_abort_releases_held_text():
    tok = build_tokenizer()
    acc = _accumulator(tok, SamplingParams())
    d = acc.add(GenerateOutput("r", [], finished=True, error="bad room",
                               finish_reason=FinishReason.abort("bad room", 400)))
    assert d.finished and acc.result.error == "bad room" and acc.result.error_status == 400
    assert acc.result.finish_reason == FinishReason.abort("bad room", 400)
    held = _accumulator(tok, SamplingParams(stop=["STOP"]))
    ids = pieces_to_ids(tok, ["Hello", " S"])
    held.add(GenerateOutput("r", ids))
    assert held.result.text == "Hello "       # "S" may start "STOP": held back
    tail = held.abort("client gone")
    assert tail.text == "S" and held.result.text == "Hello S"
    assert held.result.finish_reason == FinishReason.abort("client gone")


def test_sampling_params_are_frozen():
    sp = SamplingParams(stop="x", stop_token_ids=[3])
    assert sp.stop == ("x",) and sp.stop_token_ids == (3,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_new_tokens = 1
    one = dataclasses.replace(sp, max_new_tokens=1)
    assert one.max_new_tokens == 1 and sp.max_new_tokens == 128 and one.stop == ("x",)


def test_request_transitions_are_checked_and_counters_move_through_methods():
    req = Request("r", [1, 2, 3], SamplingParams())
    req.start_running(2)
    assert (req.state, req.num_computed_tokens, req.num_cached_tokens) == (
        RequestState.RUNNING, 2, 2)
    index = req.append_pending()
    assert index == 0 and req.output_ids == [-1]
    assert req.resolve_pending(0, 7) == [] and req.output_ids == [7]
    req.retract(step_id=5)
    assert (req.state, req.num_computed_tokens, req.num_retractions,
            req.last_scheduled_step) == (RequestState.WAITING, 0, 1, 5)
    req.start_running(0)
    req.finish(FinishReason.of_length(1))
    assert req.is_finished and req.finish_reason.type is FinishType.LENGTH
    for illegal in (RequestState.RUNNING, RequestState.WAITING, RequestState.ABORTED):
        with pytest.raises(RuntimeError, match="illegal transition"):
            req.set_state(illegal)
    with pytest.raises(RuntimeError, match="illegal transition"):
        req.abort("late")


def test_a_stop_regex_search_past_its_time_fails_the_request_and_stops_the_engine(monkeypatch):
    """A pattern that backtracks exponentially on the output ("(a|aa)+c" over a run of a's)
    fails the request with a 400 naming stop_regex once one search passes the time limit, and
    tells the owner to abort the engine's request; the text before stays the client's."""
    from pdjax import detokenizer

    monkeypatch.setattr(detokenizer, "STOP_REGEX_TIMEOUT_S", 0.05)
    tok = build_tokenizer()
    ids = pieces_to_ids(tok, ["Hi "] + ["a"] * 60)
    acc = _accumulator(tok, SamplingParams(stop_regex="(a|aa)+c"))
    for n, t in enumerate(ids):
        d = acc.add(GenerateOutput("r", [t], completion_tokens=n + 1))
        if acc.finished:
            break
    assert acc.finished and d.stop_string_hit and n < len(ids) - 1
    r = acc.result
    assert r.error_status == 400 and r.error.startswith("stop_regex: matching '(a|aa)+c' took")
    assert r.finish_reason.type is FinishType.ABORT
    assert r.text == "Hi "                   # the a's may still become a match: held back
