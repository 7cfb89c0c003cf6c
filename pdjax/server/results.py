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
from pdjax.output import OutputAccumulator, OutputDelta, RequestOutput

LOGPROB_FLOOR = -9999.0      # JSON has no -inf: log(0) is reported as this


@dataclasses.dataclass
class SampleResult(RequestOutput):
    """Everything one sample produced so far (``RequestOutput``), with its place in the HTTP
    request (``index``) and its end-to-end latency in seconds."""

    index: int = 0
    e2e_latency: float = 0.0


@dataclasses.dataclass
class SampleDelta(OutputDelta):
    """One increment of a sample (``OutputDelta``) and the sample's ``index``."""

    index: int = 0


def json_logprob(v: float | None) -> float | None:
    """A logprob as JSON can carry it: None stays None, log(0) = -inf is ``LOGPROB_FLOOR``."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else LOGPROB_FLOOR


class SampleAccumulator:
    """Turns one request's ``GenerateOutput`` stream into ``SampleDelta`` increments and its
    ``SampleResult`` (``pdjax.output.OutputAccumulator``: detokenization, stop strings,
    logprobs, the finish reason), and counts the request's metrics (``RequestTimer``; none
    when ``metrics`` is None).

    ``engine_abort(rid)`` tells the engine to drop the request (``abort``). ``task``: the
    task that pumps the engine's outputs to it (set by ``RequestGroup``).
    """

    def __init__(self, index: int, req: GenerateRequest, tokenizer: Any,
                 metrics: Metrics | None, engine_abort: Callable[[str], None]) -> None:
        self.index = index
        self.req = req
        self._engine_abort = engine_abort
        self.result = SampleResult(index=index, rid=req.rid, prompt_ids=list(req.input_ids),
                                   prompt_tokens=len(req.input_ids),
                                   logprob_start_len=req.logprob_start_len)
        self.output = OutputAccumulator(tokenizer, req.sampling_params, self.result)
        self.timer = RequestTimer(metrics)
        self.done = False
        self.task: asyncio.Task | None = None

    def apply(self, out: GenerateOutput) -> tuple[SampleDelta, bool]:
        """Consume one engine output; returns the delta and whether the engine must be told to
        abort (a stop string ended the request before the engine did)."""
        d = self.output.add(out)
        if self.result.error:
            self._finalize("error")
        else:
            self.timer.on_tokens(len(d.token_ids))
            if d.finished:
                self._finalize(self.result.finish_reason.type.value)
        return self._delta(d), d.stop_string_hit

    def fail(self, message: str, status: int) -> SampleDelta:
        d = self.output.fail(message, status)
        self._finalize("error")
        return self._delta(d)

    def abort(self, message: str) -> SampleDelta:
        """Abort in the engine (frees its pages) and finish with ``finish_reason`` abort."""
        self._engine_abort(self.req.rid)
        d = self.output.abort(message)
        self._finalize("abort")
        return self._delta(d)

    def _delta(self, d: OutputDelta) -> SampleDelta:
        return SampleDelta(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)},
                           index=self.index)

    def _finalize(self, reason: str) -> None:
        r = self.result
        self.done = True
        r.e2e_latency = self.timer.on_finish(reason, r.prompt_tokens, r.completion_tokens,
                                             r.cached_tokens)
