"""What a request produced, built in one place (DESIGN.md §3): the stop conditions on a new
token (``token_finish_reason``) and ``OutputAccumulator``, which turns one request's stream of
``GenerateOutput`` increments into text deltas and a ``RequestOutput`` (detokenization, stop
strings, logprobs, the finish reason).

The engine checks the token stops (EOS, ``stop_token_ids``, ``max_new_tokens``); the consumer
of its outputs (the HTTP server, the offline ``Engine``) runs the accumulator, which needs the
tokenizer:

    EngineCore.step -> GenerateOutput (token ids, logprobs, FinishReason)
        -> OutputAccumulator.add -> OutputDelta (text, accepted ids) + RequestOutput

A stop string (or ``stop_regex`` match) that completes in the text ends the request there
(past the first ``min_new_tokens`` tokens, as the stop tokens): the accumulator reports it
(``OutputDelta.stop_string_hit``) and its owner aborts the request in the engine, which frees
the pages. Pure Python: never imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Sequence

from pdjax.detokenizer import IncrementalDetokenizer
from pdjax.engine_io import GenerateOutput
from pdjax.request import FinishReason, SamplingParams


def token_finish_reason(sp: SamplingParams, token: int, num_output: int,
                        eos_token_ids: Collection[int], *,
                        grammar_terminated: bool = False) -> FinishReason | None:
    """The finish after output token ``token`` (the ``num_output``-th), or None.

    In order: an EOS token (unless ``ignore_eos``) or a ``stop_token_ids`` entry stops on it
    (``matched`` = the token, trimmed from the text); a grammar that admits nothing more
    (``grammar_terminated``) stops with ``matched`` None (the token is part of the answer);
    ``max_new_tokens`` reached is a length finish. The context-length limit is the
    scheduler's (``Scheduler.resolve``). SGLang's order (``Req.check_finished``).
    """
    if (not sp.ignore_eos and token in eos_token_ids) or token in sp.stop_token_ids:
        return FinishReason.stop(token)
    if grammar_terminated:
        return FinishReason.stop(None)
    if sp.max_new_tokens is not None and num_output >= sp.max_new_tokens:
        return FinishReason.of_length(num_output)
    return None


def trim_matched_stop_token(token_ids: Sequence[int], finish_reason: FinishReason | None
                            ) -> list[int]:
    """Drop the final token when the request stopped on it (EOS or a ``stop_token_ids`` entry),
    so that it never appears in the text (SGLang's default, ``no_stop_trim=False``).
    Returns a new list."""
    ids = list(token_ids)
    matched = finish_reason.matched_token if finish_reason is not None else None
    if ids and matched is not None and ids[-1] == matched:
        ids.pop()
    return ids


@dataclasses.dataclass
class RequestOutput:
    """Everything one request produced so far (filled by ``OutputAccumulator``).

    ``output_ids``: accepted output tokens (a stop string cuts the tokens after the one that
    completed it; a stop token stays here though its text is trimmed). ``output_logprobs`` /
    ``output_top_logprobs`` align with ``output_ids``; ``prompt_logprobs`` cover positions
    ``logprob_start_len..`` of the prompt (position 0's entry is None). ``error`` /
    ``error_status``: the request failed (answer with the error, not the text).
    """

    rid: str
    prompt_ids: list[int]
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    logprob_start_len: int = -1
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    error_param: str | None = None       # the request field at fault (the error's param)
    finished: bool = False
    spec_verify_ct: int = 0          # speculative verify rows (0: none ran)
    spec_accepted_tokens: int = 0    # drafts they accepted

    @property
    def spec_accept_len(self) -> float | None:
        """Mean tokens a verify row emitted, the target's own included (SGLang's accept
        length); None when no verify row ran."""
        if not self.spec_verify_ct:
            return None
        return (self.spec_accepted_tokens + self.spec_verify_ct) / self.spec_verify_ct

    def spec_meta_info(self) -> dict:
        """``spec_verify_ct`` and ``spec_accept_len`` for ``meta_info`` (empty when no verify
        row ran)."""
        if not self.spec_verify_ct:
            return {}
        return {"spec_verify_ct": self.spec_verify_ct,
                "spec_accept_len": round(self.spec_accept_len, 4)}

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclasses.dataclass
class OutputDelta:
    """What one increment added: the text released and the tokens accepted with it.

    ``first_token_offset``: index in ``output_ids`` of ``token_ids[0]``. ``stop_string_hit``:
    a stop string ended the request before the engine did (its owner aborts it there).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finished: bool
    first_token_offset: int = 0
    stop_string_hit: bool = False


class OutputAccumulator:
    """One request's ``GenerateOutput`` stream -> ``OutputDelta`` increments and ``result``.

    Args:
      tokenizer: a ``transformers`` tokenizer (for ``IncrementalDetokenizer``).
      sp: the request's sampling params (``stop`` strings, ``stop_regex``, ``min_new_tokens``,
        ``skip_special_tokens``).
      result: the record to fill (``RequestOutput`` or a subclass); its ``prompt_ids`` give
        the detokenizer its left context.
    """

    def __init__(self, tokenizer: Any, sp: SamplingParams, result: RequestOutput) -> None:
        self.result = result
        if not result.prompt_tokens:
            result.prompt_tokens = len(result.prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, sp.stop,
                                            skip_special_tokens=sp.skip_special_tokens,
                                            prompt_ids=result.prompt_ids,
                                            stop_regex=sp.stop_regex,
                                            min_new_tokens=sp.min_new_tokens)

    @property
    def finished(self) -> bool:
        return self.result.finished

    def add(self, out: GenerateOutput) -> OutputDelta:
        """Consume one engine output (after the last one, nothing more is consumed)."""
        r = self.result
        if r.finished:
            return OutputDelta("", [], [], [], True, len(r.output_ids))
        if out.prompt_tokens:
            r.prompt_tokens = out.prompt_tokens
        r.cached_tokens = max(r.cached_tokens, out.cached_tokens or 0)
        r.spec_verify_ct = max(r.spec_verify_ct, out.spec_verify_ct)
        r.spec_accepted_tokens = max(r.spec_accepted_tokens, out.spec_accepted_tokens)
        if out.prompt_logprobs is not None and r.prompt_logprobs is None:
            r.prompt_logprobs = list(out.prompt_logprobs)
            r.prompt_top_logprobs = list(out.prompt_top_logprobs or [])
        if out.error:
            return self.fail(out.error, out.status_code or 500, out.error_param)
        ids = [int(t) for t in out.new_token_ids]
        try:
            step = self.detok.add_tokens(
                trim_matched_stop_token(ids, out.finish_reason) if out.finished else ids)
        except ValueError as e:       # a stop_regex search timed out: the engine must stop too
            d = self.fail(str(e), 400)
            d.stop_string_hit = not out.finished
            return d
        text = step.text
        stop_string_hit = False
        if step.stop_matched is not None:
            accepted = ids[:step.num_tokens]
            r.finish_reason = FinishReason.stop(step.stop_matched)
            stop_string_hit = not out.finished
            r.finished = True
        else:
            accepted = ids
            if out.finished:
                try:
                    tail = self.detok.finish()
                except ValueError as e:
                    return self.fail(str(e), 400)
                text += tail.text
                if tail.stop_matched is not None:
                    r.finish_reason = FinishReason.stop(tail.stop_matched)
                else:
                    r.finish_reason = out.finish_reason or FinishReason.abort(
                        "finished without reason")
                r.finished = True
        offset = len(r.output_ids)
        lps = [float(v) for v in out.new_logprobs[:len(accepted)]]
        tops = [list(t) for t in out.new_top_logprobs[:len(accepted)]]
        r.output_ids.extend(accepted)
        r.output_logprobs.extend(lps)
        r.output_top_logprobs.extend(tops)
        r.text += text
        return OutputDelta(text, accepted, lps, tops, r.finished, offset, stop_string_hit)

    def fail(self, message: str, status: int, param: str | None = None) -> OutputDelta:
        """The request failed: finish with an abort carrying ``message`` (HTTP ``status``;
        ``param``: the request field at fault)."""
        r = self.result
        r.error, r.error_status, r.error_param = message, status, param
        r.finish_reason = FinishReason.abort(message, status, param)
        r.finished = True
        return OutputDelta("", [], [], [], True, len(r.output_ids))

    def abort(self, message: str) -> OutputDelta:
        """Finish early (the owner aborts the request in the engine): the text held back is
        released, ``finish_reason`` is an abort with ``message``."""
        try:
            tail_text = self.detok.finish().text
        except ValueError:            # a stop_regex search timed out: nothing more is released
            tail_text = ""
        r = self.result
        r.text += tail_text
        r.finish_reason = FinishReason.abort(message)
        r.finished = True
        return OutputDelta(tail_text, [], [], [], True, len(r.output_ids))
