"""What one sample produced: ``SampleResult`` (all so far), ``SampleDelta`` (one increment)
and ``SampleAccumulator``, which builds both from the engine's ``GenerateOutput`` stream
(DESIGN.md §4). The renderers (``native_api``, ``openai_render``) read these only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, Callable

from pdjax.engine_io import GenerateOutput, GenerateRequest
from pdjax.metrics import Metrics, RequestTimer
from pdjax.detokenizer import IncrementalDetokenizer, trim_matched_stop_token

LOGPROB_FLOOR = -9999.0      # JSON has no -inf: log(0) is reported as this


@dataclasses.dataclass
class SampleResult:
    """Everything one sample produced so far (filled by the server as outputs arrive).

    ``output_ids``: accepted output tokens (a stop string cuts the tokens after the one that
    completed it; a stop token stays here though its text is trimmed). ``output_logprobs`` /
    ``output_top_logprobs`` align with ``output_ids``. ``prompt_logprobs`` cover positions
    ``logprob_start_len..`` of the prompt. ``e2e_latency`` in seconds.
    """

    index: int
    rid: str
    prompt_ids: list[int]
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    logprob_start_len: int = -1
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    e2e_latency: float = 0.0
    finished: bool = False

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclasses.dataclass
class SampleDelta:
    """One increment of a sample: the text released and the tokens accepted with it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finished: bool
    first_token_offset: int = 0       # index in output_ids of token_ids[0]


def json_logprob(v: float | None) -> float | None:
    """A logprob as JSON can carry it: None stays None, log(0) = -inf is ``LOGPROB_FLOOR``."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else LOGPROB_FLOOR


class SampleAccumulator:
    """Turns one request's ``GenerateOutput`` stream into ``SampleDelta`` increments and its
    ``SampleResult``: detokenization, stop strings (``IncrementalDetokenizer``), logprobs, the
    finish reason and the request's metrics (``RequestTimer``; none when ``metrics`` is None).

    ``engine_abort(rid)`` tells the engine to drop the request (``abort``). ``task``: the
    task that pumps the engine's outputs to it (set by ``RequestGroup``).
    """

    def __init__(self, index: int, req: GenerateRequest, tokenizer: Any,
                 metrics: Metrics | None, engine_abort: Callable[[str], None]) -> None:
        sp = req.sampling_params
        self.index = index
        self.req = req
        self._engine_abort = engine_abort
        self.detok = IncrementalDetokenizer(tokenizer, sp.stop,
                                            skip_special_tokens=sp.skip_special_tokens,
                                            prompt_ids=req.input_ids)
        self.result = SampleResult(index=index, rid=req.rid, prompt_ids=list(req.input_ids),
                                   prompt_tokens=len(req.input_ids),
                                   logprob_start_len=req.logprob_start_len)
        self.timer = RequestTimer(metrics)
        self.done = False
        self.task: asyncio.Task | None = None

    def apply(self, out: GenerateOutput) -> tuple[SampleDelta, bool]:
        """Consume one engine output; returns the delta and whether the engine must be told to
        abort (a stop string ended the request before the engine did)."""
        r = self.result
        if out.prompt_tokens:
            r.prompt_tokens = out.prompt_tokens
        r.cached_tokens = max(r.cached_tokens, out.cached_tokens or 0)
        if out.prompt_logprobs is not None and r.prompt_logprobs is None:
            r.prompt_logprobs = list(out.prompt_logprobs)
            r.prompt_top_logprobs = list(out.prompt_top_logprobs or [])
        if out.error:
            return self.fail(out.error, out.status_code or 500), False
        ids = [int(t) for t in out.new_token_ids]
        feed = trim_matched_stop_token(ids, out.finish_reason) if out.finished else ids
        step = self.detok.add_tokens(feed)
        text = step.text
        must_abort = False
        if step.stop_matched is not None:
            accepted = ids[:step.num_tokens]
            finished = True
            r.finish_reason = {"type": "stop", "matched": step.stop_matched}
            must_abort = not out.finished
        else:
            accepted = ids
            finished = out.finished
            if finished:
                tail = self.detok.finish()
                text += tail.text
                if tail.stop_matched is not None:
                    r.finish_reason = {"type": "stop", "matched": tail.stop_matched}
                else:
                    r.finish_reason = out.finish_reason or {"type": "abort",
                                                            "message": "finished without reason"}
        offset = len(r.output_ids)
        lps = [float(v) for v in out.new_logprobs[:len(accepted)]]
        tops = [list(t) for t in out.new_top_logprobs[:len(accepted)]]
        r.output_ids.extend(accepted)
        r.output_logprobs.extend(lps)
        r.output_top_logprobs.extend(tops)
        r.text += text
        self.timer.on_tokens(len(accepted))
        if finished:
            self._finalize(r.finish_reason.get("type", "abort"))
        return SampleDelta(self.index, text, accepted, lps, tops, finished, offset), must_abort

    def fail(self, message: str, status: int) -> SampleDelta:
        r = self.result
        r.error, r.error_status = message, status
        r.finish_reason = {"type": "abort", "message": message}
        self._finalize("error")
        return SampleDelta(self.index, "", [], [], [], True, len(r.output_ids))

    def abort(self, message: str) -> SampleDelta:
        """Abort in the engine (frees its pages) and finish with ``finish_reason`` abort."""
        self._engine_abort(self.req.rid)
        tail = self.detok.finish()
        r = self.result
        r.text += tail.text
        r.finish_reason = {"type": "abort", "message": message}
        self._finalize("abort")
        return SampleDelta(self.index, tail.text, [], [], [], True, len(r.output_ids))

    def _finalize(self, reason: str) -> None:
        r = self.result
        self.done = True
        r.finished = True
        r.e2e_latency = self.timer.on_finish(reason, r.prompt_tokens, r.completion_tokens,
                                             r.cached_tokens)
