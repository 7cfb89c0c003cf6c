"""Requests, their states and sampling parameters (DESIGN.md §1).

``Request`` is the single source of truth for token counters: ``num_prompt_tokens``,
``num_computed_tokens`` and ``output_ids``. Whether a request is still in (chunked) prefill is
derived from them, never stored twice; the counters change only through ``Request`` methods,
and the state only through ``set_state`` (a checked transition table). ``FinishReason`` is the
typed finish of a request; it becomes SGLang's dict (``to_dict``) only at the HTTP edge.
Pure Python: never imports JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from typing import Any

from pdjax.constrained.grammar import GrammarSpec

# SGLang's constrained-decoding sampling params (at most one per request) -> grammar kind.
GRAMMAR_PARAMS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}

# The widths every integer field is stored in on its way to the device: token ids, top-k and
# counts are int32 arrays, seeds 63-bit (a Python int past them would fail deep in numpy or
# XLA as a 500, not a 400 naming the field).
INT32_MAX = (1 << 31) - 1
SEED_LIMIT = 1 << 63
FLOAT32_MAX = 3.4028234663852886e38    # the largest finite float32 (sampling runs in float32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with SGLang's field names.

    ``top_k = -1`` means no top-k limit (0 is rejected, as SGLang does). Every integer field
    has explicit bounds (token ids and ``top_k`` at most ``INT32_MAX``, ``seed`` below 2**63).
    Frozen: a layer that needs other values builds a copy (``dataclasses.replace``). ``stop`` and
    ``stop_token_ids`` are stored as tuples (a list or a single string is accepted).
    ``max_new_tokens = None`` means up to the context length. ``seed`` makes sampling
    reproducible whatever else shares the batch. ``grammar``: the structured-output constraint
    (``from_dict`` builds it from SGLang's ``json_schema`` / ``regex`` / ``ebnf``; the OpenAI
    layer from ``response_format`` or ``tool_choice``). ``logit_bias``: ``{token_id: bias}``
    (OpenAI's field; JSON object keys are decimal strings), each bias in [-100, 100] added to
    the token's logit before sampling, at most ``MAX_LOGIT_BIAS`` entries (OpenAI's limit);
    the ids (and ``stop_token_ids``) are checked against the vocabulary by the server and the
    engine (``check_vocab_ids``). ``speculative``: False opts this request out of speculative
    decoding on a server started with ``--speculative-algorithm`` (its decode rows verify no
    drafts). ``min_new_tokens``: the stop tokens (EOS unless ``ignore_eos``, and
    ``stop_token_ids``) are masked on the device until that many output tokens are out, and
    stop strings and ``stop_regex`` end nothing before then (in [0, ``max_new_tokens``]).
    ``stop_regex``: regular expressions (a string or a list; stored as a tuple) matched against
    the output text like stop strings: the text ends before the first match, finish reason
    ``stop`` with ``matched`` the pattern (SGLang's ``FINISHED_MATCHED_REGEX``); a pattern
    that does not compile or matches the empty string is refused. Raises ``ValueError``
    naming the field.
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    grammar: GrammarSpec | None = None
    logit_bias: dict[int, float] | None = None
    speculative: bool = True
    min_new_tokens: int = 0
    stop_regex: tuple[str, ...] = ()

    MAX_NEW_TOKENS_LIMIT = 1 << 20
    MAX_LOGIT_BIAS = 300          # entries per request (OpenAI's limit; a fixed device width)
    LOGIT_BIAS_LIMIT = 100.0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got "
                             f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if isinstance(self.stop_regex, str):
            object.__setattr__(self, "stop_regex", (self.stop_regex,))
        if self.stop_regex is not None and not isinstance(self.stop_regex, (list, tuple)):
            raise ValueError(f"stop_regex must be a string or a list of strings, got "
                             f"{self.stop_regex!r:.100}")
        object.__setattr__(self, "stop_regex", tuple(self.stop_regex or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON dict; unknown keys raise ``ValueError`` naming them. ``json_schema``
        (a JSON string or object), ``regex`` and ``ebnf`` (strings; at most one of them) become
        ``grammar``, compiled later (``pdjax.constrained``)."""
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"sampling_params: a dict of parameters, got {type(d).__name__}")
        d = dict(d or {})
        names = ({f.name for f in dataclasses.fields(cls)} - {"grammar"}) | set(GRAMMAR_PARAMS)
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"sampling_params: unsupported field(s) {unknown}")
        constraints = {k: d.pop(k) for k in GRAMMAR_PARAMS if d.get(k) is not None}
        for k in GRAMMAR_PARAMS:
            d.pop(k, None)
        if len(constraints) > 1:
            raise ValueError(f"sampling_params: at most one of json_schema, regex and ebnf may be "
                             f"set, got {sorted(constraints)}")
        for key, text in constraints.items():
            if key == "json_schema" and isinstance(text, (dict, bool)):
                text = json.dumps(text)
            if not isinstance(text, str):
                raise ValueError(f"{key} must be a string, got {type(text).__name__}")
            d["grammar"] = GrammarSpec(GRAMMAR_PARAMS[key], text, field=f"sampling_params.{key}")
        if d.get("stop") is None:
            d.pop("stop", None)
        for key in ("stop_token_ids", "stop_regex", "min_new_tokens"):
            if d.get(key) is None:
                d.pop(key, None)
        return cls(**d)

    def validate(self) -> None:
        def num(name, v, *, integer=False, allow_none=False):
            if v is None and allow_none:
                return
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if not ok or isinstance(v, bool):
                kind = "an integer" if integer else "a number"
                raise ValueError(f"{name} must be {kind}, got {v!r}")
            if not integer and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
                # The device samples in float32: a larger value becomes inf there.
                raise ValueError(f"{name} must be finite in float32 (at most {FLOAT32_MAX:.4g} "
                                 f"in magnitude), got {v!r}")

        num("max_new_tokens", self.max_new_tokens, integer=True, allow_none=True)
        if self.max_new_tokens is not None and not 0 <= self.max_new_tokens <= self.MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens must be in [0, {self.MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}")
        num("min_new_tokens", self.min_new_tokens, integer=True)
        if self.max_new_tokens is None:
            if not 0 <= self.min_new_tokens <= self.MAX_NEW_TOKENS_LIMIT:
                raise ValueError(f"min_new_tokens must be in [0, {self.MAX_NEW_TOKENS_LIMIT}], "
                                 f"got {self.min_new_tokens}")
        elif not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens ({self.max_new_tokens})]"
                             f", got {self.min_new_tokens}")
        check_stop_regex(self.stop_regex)
        num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        num("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, integer=True)
        if self.top_k == 0 or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, {INT32_MAX}], got "
                             f"{self.top_k}")
        num("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            num(name, v)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        num("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or list of them, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX
                   for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got "
                             f"{self.stop_token_ids!r}")
        num("seed", self.seed, integer=True, allow_none=True)
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        num("n", self.n, integer=True)
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in [1, 64], got {self.n}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a boolean, got {self.speculative!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got "
                             f"{self.skip_special_tokens!r}")

    def check_vocab_ids(self, vocab_size: int) -> None:
        """``ValueError`` naming the field (``logit_bias`` or ``stop_token_ids``) for a token id
        outside ``[0, vocab_size)``: a stop id the model cannot sample would never match."""
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("stop_token_ids", self.stop_token_ids)):
            for t in ids:
                if not t < vocab_size:
                    raise ValueError(f"{name}: token id {t} is outside the vocabulary "
                                     f"[0, {vocab_size})")

    # Below this temperature sampling is greedy: dividing logits by a subnormal temperature
    # overflows to inf (and then NaN), as SGLang also guards.
    GREEDY_TEMPERATURE = 1e-5

    @property
    def is_greedy(self) -> bool:
        return self.temperature < self.GREEDY_TEMPERATURE or self.top_k == 1

    def held_stop_ids(self, position: int, eos_token_ids) -> tuple[int, ...]:
        """The stop tokens masked for output token ``position`` (0-based): EOS (unless
        ``ignore_eos``) and ``stop_token_ids`` while ``position < min_new_tokens``, else ()."""
        if position >= self.min_new_tokens:
            return ()
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(sorted(set(eos) | set(self.stop_token_ids)))


# A stop_regex longer than this is refused (it is compiled per request and searched after every
# token).
MAX_STOP_REGEX_CHARS = 4096


def check_stop_regex(patterns: tuple[str, ...]) -> None:
    """``ValueError`` naming ``stop_regex`` for a pattern that is not a non-empty string of at
    most ``MAX_STOP_REGEX_CHARS``, does not compile, or matches the empty string (it would end
    every request at once)."""
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"stop_regex must be a non-empty string or list of them, got "
                             f"{p!r:.100}")
        if len(p) > MAX_STOP_REGEX_CHARS:
            raise ValueError(f"stop_regex: a pattern may hold at most {MAX_STOP_REGEX_CHARS} "
                             f"characters, got {len(p)}")
        compiled = compile_stop_regex(p)
        if compiled.search("") is not None:
            raise ValueError(f"stop_regex: {p!r:.100} matches the empty string")


def compile_stop_regex(pattern: str):
    """``pattern`` compiled (the ``regex`` module: Python's syntax, with partial matches for
    holding back text that may start a match); ``ValueError`` naming ``stop_regex``."""
    import regex

    try:
        return regex.compile(pattern)
    except (regex.error, RecursionError, OverflowError) as e:
        raise ValueError(f"stop_regex: {pattern!r:.100} is not a valid regular expression "
                         f"({e})") from None


def _parse_logit_bias(raw: Any) -> dict[int, float] | None:
    """``{token_id: bias}`` from a dict with int or decimal-string keys; None or {} -> None.
    ``ValueError`` naming ``logit_bias`` for a bad key, a bias that is not a finite number in
    [-100, 100], a repeated id, or more than ``MAX_LOGIT_BIAS`` entries."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"logit_bias must be an object {{token_id: bias}}, got {raw!r}")
    if len(raw) > SamplingParams.MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {SamplingParams.MAX_LOGIT_BIAS} tokens, "
                         f"got {len(raw)}")
    out: dict[int, float] = {}
    limit = SamplingParams.LOGIT_BIAS_LIMIT
    for key, bias in raw.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            tok = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            tok = key
        else:
            raise ValueError(f"logit_bias: key {key!r:.40} is not a token id (an integer in "
                             f"[0, {INT32_MAX}])")
        if tok > INT32_MAX:
            raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer in "
                             f"[0, {INT32_MAX}])")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias) or not -limit <= bias <= limit:
            raise ValueError(f"logit_bias: the bias of token {key!r} must be a number in "
                             f"[-100, 100], got {bias!r}")
        if tok in out:
            raise ValueError(f"logit_bias: token id {tok} is given twice")
        out[tok] = float(bias)
    return out or None


# An output token sampled on the device but not yet known on the host (overlapped scheduling,
# DESIGN.md §3): it sits at the end of ``Request.output_ids`` from launch until the step's results
# are read, and it never has KV computed, reaches a client, or enters the prefix cache.
PENDING_TOKEN = -1


class FinishType(enum.Enum):
    STOP = "stop"          # an EOS / stop token, a stop string, or the end of a grammar
    LENGTH = "length"      # max_new_tokens or the context length
    ABORT = "abort"        # client abort, bad input or an error


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a request finished. Build with ``stop`` / ``length`` / ``abort``.

    ``matched``: what a stop matched: a token id (``int``, its text is trimmed), a stop string,
    or None (a grammar reached its end). ``length``: output tokens at a length finish.
    ``message`` / ``status``: an abort's message and HTTP status (None: the caller's default);
    ``param``: the request field a 4xx abort is about (the error's ``param``), or None.
    ``to_dict`` gives SGLang's ``meta_info.finish_reason``; called only at the HTTP edge and by
    the offline ``Engine``'s results.
    """

    type: FinishType
    matched: int | str | None = None
    length: int = 0
    message: str = ""
    status: int | None = None
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> "FinishReason":
        return cls(FinishType.STOP, matched=matched)

    @classmethod
    def of_length(cls, length: int) -> "FinishReason":
        return cls(FinishType.LENGTH, length=length)

    @classmethod
    def abort(cls, message: str, status: int | None = None,
              param: str | None = None) -> "FinishReason":
        return cls(FinishType.ABORT, message=message, status=status, param=param)

    @property
    def matched_token(self) -> int | None:
        """The stop token the request ended on (its text is not part of the answer), or None."""
        if self.type is FinishType.STOP and isinstance(self.matched, int) \
                and not isinstance(self.matched, bool):
            return self.matched
        return None

    def to_dict(self) -> dict[str, Any]:
        """SGLang's shape: ``{"type": "stop", "matched": m}``, ``{"type": "length",
        "length": n}`` or ``{"type": "abort", "message": s}``."""
        if self.type is FinishType.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.type is FinishType.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


class RequestState(enum.Enum):
    WAITING = "waiting"          # queued; may hold no pages
    RUNNING = "running"          # prefill chunks or decode steps in flight
    FINISHED = "finished"        # stop condition hit, pages released (PD prefill: held)
    ABORTED = "aborted"          # client abort or error, pages released


# Every legal state change; ``Request.set_state`` raises on any other.
#
#     WAITING --admit--> RUNNING --finish--> FINISHED
#        ^                  |  \--abort---> ABORTED
#        '----retract-------'
#     WAITING --finish (max_new_tokens 0 / too long) / abort--> FINISHED / ABORTED
_TRANSITIONS = {
    RequestState.WAITING: {RequestState.RUNNING, RequestState.ABORTED, RequestState.FINISHED},
    RequestState.RUNNING: {RequestState.WAITING, RequestState.FINISHED, RequestState.ABORTED},
    RequestState.FINISHED: set(),
    RequestState.ABORTED: set(),
}


@dataclasses.dataclass
class Request:
    """One sequence being served. ``pages`` lists the KV pages it holds, in position order.

    Counters: the first ``num_computed_tokens`` tokens of ``all_ids`` have KV in ``pages``
    (``num_cached_tokens`` of them came from the prefix cache). ``is_prefilling`` is derived.
    They change only through the methods below (the scheduler and the engine call them).
    """

    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    arrival_time: float = 0.0
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    prefix_node: Any = None       # prefix-cache node locked while this request runs
    num_retractions: int = 0
    last_scheduled_step: int = 0
    seed_for_sampling: int = 0    # sampling_params.seed, or a random one drawn at arrival
    reported_cached_tokens: int | None = None   # PD decode: the longer of both prefix hits
    grammar: Any = None           # GrammarMatcher of sampling_params.grammar (engine thread)
    spec_verify_ct: int = 0       # speculative verify rows run for it
    spec_accepted_tokens: int = 0  # drafts those rows accepted

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt must contain at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the newest one still lack KV (prompt or recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_ids

    @property
    def num_cached_tokens_reported(self) -> int:
        """Prompt tokens served from a prefix cache (``cached_tokens`` in usage); on a PD decode
        server ``reported_cached_tokens``: the longer of the prefill's and the decode's prefix
        hits (DESIGN.md §4)."""
        cached = self.num_cached_tokens if self.reported_cached_tokens is None \
            else self.reported_cached_tokens
        return max(0, min(cached, self.num_prompt_tokens))

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    def set_state(self, new: RequestState) -> None:
        """Move to ``new``; ``RuntimeError`` for a change ``_TRANSITIONS`` does not list."""
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"request {self.rid}: illegal transition {self.state} -> {new}")
        self.state = new

    # ------------------------------------------------------------------ lifecycle
    def start_running(self, num_cached_tokens: int) -> None:
        """Admitted with ``num_cached_tokens`` tokens of KV from the prefix cache."""
        self.num_computed_tokens = self.num_cached_tokens = num_cached_tokens
        self.set_state(RequestState.RUNNING)

    def retract(self, step_id: int) -> None:
        """Back to the queue without pages: all KV is recomputed on readmission."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_retractions += 1
        self.last_scheduled_step = step_id     # not readmitted in the step that retracted it
        self.set_state(RequestState.WAITING)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.set_state(RequestState.FINISHED)

    def abort(self, message: str, status: int | None = None) -> None:
        self.finish_reason = FinishReason.abort(message, status)
        self.set_state(RequestState.ABORTED)

    def fail(self, error: str, status: int | None = None,
             param: str | None = None) -> FinishReason:
        """Record ``error`` (the request failed; the server answers with it, not text) and
        return the abort reason that finishes the request (HTTP ``status``; None: 500;
        ``param``: the request field at fault)."""
        self.error = error
        return FinishReason.abort(error, status, param)

    # ------------------------------------------------------------------ counters
    def set_num_computed_tokens(self, n: int) -> None:
        """A forward computed KV up to position ``n`` (exclusive)."""
        self.num_computed_tokens = n

    def clamp_computed_to_known(self) -> None:
        """The newest token has no KV yet (what a step without overlap would have computed)."""
        self.num_computed_tokens = min(self.num_computed_tokens, max(self.num_tokens - 1, 0))

    def append_pending(self) -> int:
        """Add a placeholder for a token sampled on the device; returns its output index."""
        self.output_ids.append(PENDING_TOKEN)
        return len(self.output_ids) - 1

    def resolve_pending(self, index: int, token: int) -> list[int]:
        """Put ``token`` in place of placeholder ``index`` and cut the placeholders after it
        (returned, for ``restore_pending`` when the request goes on)."""
        self.output_ids[index] = int(token)
        tail = self.output_ids[index + 1:]
        del self.output_ids[index + 1:]
        return tail

    def restore_pending(self, tail: list[int]) -> None:
        self.output_ids.extend(tail)

    def drop_pending(self) -> int:
        """Drop trailing placeholders; returns how many there were."""
        n = 0
        while self.output_ids and self.output_ids[-1] == PENDING_TOKEN:
            self.output_ids.pop()
            n += 1
        return n

    def reserve_prebuilt(self, num_cached_tokens: int) -> None:
        """PD decode: pages reserved, ``num_cached_tokens`` of the prompt from the prefix cache,
        the rest arriving from the prefill server."""
        self.num_cached_tokens = num_cached_tokens
        self.num_computed_tokens = 0

    def start_prebuilt(self, first_token_id: int, step_id: int) -> None:
        """PD decode: the prompt's KV arrived with the first output token; decoding starts."""
        self.num_computed_tokens = self.num_prompt_tokens
        self.output_ids.append(int(first_token_id))
        self.last_scheduled_step = step_id
        self.set_state(RequestState.RUNNING)

    def append_logprobs(self, logprob: float, top: list[tuple[int, float]]) -> None:
        """The logprob (and top logprobs) of the newest output token."""
        self.output_logprobs.append(logprob)
        self.output_top_logprobs.append(top)

    def append_prompt_logprobs(self, logprob: float | None,
                               top: list[tuple[int, float]] | None) -> None:
        """The logprob (and top logprobs) of the next prompt position (None: position 0)."""
        self.prompt_logprobs.append(logprob)
        self.prompt_top_logprobs.append(top)

    def set_reported_cached_tokens(self, n: int) -> None:
        """PD decode: the prefix the request reused (the longer of the prefill's and the
        decode's hits), reported as ``cached_tokens``."""
        self.reported_cached_tokens = n
