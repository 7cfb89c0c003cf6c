"""What crosses between the HTTP server and the engine loop (DESIGN.md §3).

The server submits a ``GenerateRequest`` and receives ``GenerateOutput`` increments, pushed
from the engine thread into the caller's asyncio queue (never polled). Pure Python.
"""

from __future__ import annotations

import dataclasses
from pdjax.request import FinishReason, SamplingParams


@dataclasses.dataclass
class GenerateRequest:
    """One sample to generate. ``n > 1`` is expanded by the caller into ``n`` requests.

    ``logprob_start_len``: first prompt position whose logprob is returned (-1: none).
    ``bootstrap_*``: PD fields (SGLang names); ``bootstrap_room`` is per sample.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclasses.dataclass
class GenerateOutput:
    """An increment of one request's output, in order; the last one has ``finished=True``.

    ``finish_reason``: a typed ``FinishReason`` (``to_dict`` gives SGLang's shape at the HTTP
    edge); an abort's ``status`` is the HTTP status of ``error``.
    ``prompt_logprobs`` / ``prompt_top_logprobs`` come once, with the first increment:
    entries for positions ``logprob_start_len..len(prompt)-1``; the entry of position 0 is None.
    ``error``: set when the request failed (the server answers with an error, not text).
    ``spec_verify_ct`` / ``spec_accepted_tokens``: totals so far (speculative decoding).
    """

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] = dataclasses.field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    spec_verify_ct: int = 0          # speculative verify rows of the request so far
    spec_accepted_tokens: int = 0    # drafts they accepted

    @property
    def status_code(self) -> int | None:
        """HTTP status for ``error`` (400: bad input; None: the default, 500)."""
        return self.finish_reason.status if self.finish_reason is not None else None

    @property
    def error_param(self) -> str | None:
        """The request field ``error`` is about (the HTTP error's ``param``), or None."""
        return self.finish_reason.param if self.finish_reason is not None else None
