"""Request parsing/validation and response building for the HTTP API (issue 4, DESIGN.md §4).

Three request kinds, each parsed into ``GenerateRequest`` objects, one per sample:

  * ``/generate`` (SGLang-native): ``text`` or ``input_ids``, single or batch, with ``n`` from
    ``sampling_params``. Samples are ordered as SGLang orders them, ``k = j * batch + i``
    (sample ``j`` of prompt ``i``), and the response list follows that order;
  * ``/v1/completions``: ``prompt`` (string, list of strings, token ids, or lists of them);
    choice ``k = i * n + j``;
  * ``/v1/chat/completions``: ``messages`` through the tokenizer's chat template; choice ``k = j``.

PD fields (SGLang names): ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` are a
scalar or one value per sample (a list in the sample order above). A scalar room ``r`` gives
sample ``k`` room ``r + k`` (as SGLang does); a list must hold one distinct room per sample.

Every bad input raises ``RequestError`` (HTTP 400 unless stated) with a message that names the
field. Fields that ask for behaviour pdjax does not have (``response_format``, ``logit_bias``,
...) are rejected, never ignored; a field set to ``null`` counts as absent. Tool calling and
reasoning output (``tools.py``, ``chat_output.py``, ``parsers/``) hook in at the chat request
and at the chat answer.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, Callable, Sequence

from pdjax.engine_io import GenerateRequest
from pdjax.request import SamplingParams
from pdjax.server import tools as tool_api
from pdjax.server.chat_output import ChatOutputConfig, ChoiceOutput
from pdjax.server.detokenizer import TokenTexts
from pdjax.server.errors import RequestError

MAX_TOP_LOGPROBS = 20
MAX_ROOM = (1 << 63) - 1
# Limits checked before anything is tokenized or allocated (the PD router checks the same).
MAX_N = 64                   # sampling_params.n / n (SamplingParams checks it too)
MAX_BATCH_SIZE = 1024        # prompts in one request
MAX_SAMPLES = 1024           # prompts x n: one engine request (and one PD room) each
FAKE_BOOTSTRAP_HOST = "2.2.2.2"   # the servers' own PD warm-up / health probe; never a client's
LOGPROB_FLOOR = -9999.0      # JSON has no -inf: log(0) is reported as this


def error_body(message: str, status: int, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    """OpenAI-style error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    if err_type is None:
        err_type = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 503: "service_unavailable"}.get(
                        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@dataclasses.dataclass(frozen=True)
class ServingContext:
    """What parsing needs to know about the served model.

    ``context_length``: maximum tokens per sequence. ``vocab_size``: token ids must lie in
    ``[0, vocab_size)``. ``tool_call_parser`` / ``reasoning_parser``: the server's
    ``--tool-call-parser`` / ``--reasoning-parser`` (None: off).
    """

    tokenizer: Any
    served_model_name: str
    model_path: str
    context_length: int
    vocab_size: int
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def model_names(self) -> set[str]:
        return {self.served_model_name, self.model_path}


# ---------------------------------------------------------------------------------------------
# Parsed requests
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class NativeRequest:
    """A parsed ``/generate`` body. ``requests[k]`` is sample ``k``; ``is_single``: answer with
    one object (else a list). ``group_rid``: the caller's ``rid`` (for ``/abort_request``)."""

    requests: list[GenerateRequest]
    is_single: bool
    stream: bool
    return_text_in_logprobs: bool = False
    group_rid: str | None = None
    log_metrics: bool = True
    reasoning_parser: str | None = None     # set by ``separate_reasoning: true``


@dataclasses.dataclass
class OpenAIRequest:
    """A parsed ``/v1/completions`` (``kind="completion"``) or ``/v1/chat/completions``
    (``kind="chat"``) body. ``requests[k]`` is choice ``k``; ``n`` samples per prompt.

    ``logprobs``: None (off) or the number of top logprobs per token (0 = only the sampled
    token's). ``echo_texts``: per prompt, the text to prepend (completions ``echo``).
    """

    kind: str
    requests: list[GenerateRequest]
    n: int
    num_prompts: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    model: str
    response_id: str
    created: int
    echo_texts: list[str] | None = None
    group_rid: str | None = None
    chat_output: ChatOutputConfig | None = None
    _choice_outputs: dict[int, ChoiceOutput] = dataclasses.field(default_factory=dict)

    def prompt_index(self, k: int) -> int:
        return k // self.n

    def choice_output(self, k: int) -> ChoiceOutput | None:
        """Choice ``k``'s output parsers (streaming state), or None without parsing."""
        if self.chat_output is None:
            return None
        if k not in self._choice_outputs:
            self._choice_outputs[k] = self.chat_output.new_choice()
        return self._choice_outputs[k]


# ---------------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v):
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise RequestError(f"{name} must be in [{lo_s}, {hi_s}], got {v}", name)
    return v


def _check_str(name: str, v: Any, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise RequestError(f"{name} must be a string, got {type(v).__name__}", name)
    if not allow_empty and not v:
        raise RequestError(f"{name} must not be empty", name)
    return v


def _present(body: dict[str, Any]) -> dict[str, Any]:
    """The body without null-valued fields (null means "absent" everywhere)."""
    return {k: v for k, v in body.items() if v is not None}


def _check_fields(body: dict[str, Any], allowed: set[str],
                  default_only: dict[str, Callable[[Any], bool]], what: str) -> None:
    """Reject unknown fields and known-but-unsupported ones whose value is not the default."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in default_only:
            if default_only[key](value):
                continue
            raise RequestError(f"{key} is not supported by pdjax ({what}); got {value!r}", key)
        raise RequestError(f"unsupported field {key!r} in {what} request", key)


def _validate_token_ids(name: str, ids: Any, ctx: ServingContext) -> list[int]:
    if not isinstance(ids, list):
        raise RequestError(f"{name} must be a list of token ids", name)
    if not ids:
        raise RequestError(f"{name} is empty: the prompt needs at least one token", name)
    for pos, t in enumerate(ids):
        if not _is_int(t):
            raise RequestError(f"{name}[{pos}] must be an integer token id, got {t!r}", name)
        if not 0 <= t < ctx.vocab_size:
            raise RequestError(
                f"{name}[{pos}] = {t} is outside the vocabulary [0, {ctx.vocab_size})", name)
    return list(ids)


def _check_batch_size(name: str, batch: int) -> None:
    if batch > MAX_BATCH_SIZE:
        raise RequestError(f"{name}: a batch of {batch} prompts exceeds the limit of "
                           f"{MAX_BATCH_SIZE}", name)


def _check_num_samples(batch: int, n: int, name: str = "n") -> None:
    if batch * n > MAX_SAMPLES:
        raise RequestError(f"{name}: {batch} prompt(s) x n = {n} is {batch * n} samples, over "
                           f"the limit of {MAX_SAMPLES} per request", name)


def _check_prompt_length(name: str, ids: list[int], ctx: ServingContext) -> None:
    if len(ids) >= ctx.context_length:
        raise RequestError(
            f"{name}: the prompt has {len(ids)} tokens, at or over the model's context length "
            f"of {ctx.context_length} tokens", name)


def _encode(ctx: ServingContext, text: str, add_special_tokens: bool = True,
            param: str = "prompt") -> list[int]:
    """Token ids of ``text``; text the tokenizer refuses (e.g. a lone UTF-16 surrogate from
    a JSON ``\\ud800`` escape) is the client's error: ``RequestError`` naming ``param``."""
    try:
        return list(ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # tokenizers raises TypeError / ValueError / its own exceptions
        raise RequestError(f"{param}: the text cannot be tokenized ({type(e).__name__}: {e})",
                           param) from None


def _sampling_params(d: dict[str, Any], ctx: ServingContext, param: str,
                     max_tokens_name: str = "max_new_tokens") -> SamplingParams:
    # null means "default" for every field but max_new_tokens (null: up to the context length)
    d = {k: v for k, v in d.items() if v is not None or k == "max_new_tokens"}
    try:
        sp = SamplingParams.from_dict(d)
    except ValueError as e:
        msg = str(e)
        if max_tokens_name != "max_new_tokens":
            msg = msg.replace("max_new_tokens", max_tokens_name)
        if param and not msg.startswith(param):
            msg = f"{param}: {msg}"
        # SamplingParams' messages start with the field's name.
        raise RequestError(msg, param or msg.split()[0].rstrip(":")) from None
    except TypeError as e:
        raise RequestError(f"{param}: {e}", param) from None
    # Only what the client asked for is refused; the default is clamped per prompt
    # (``_clamp_default_max_new``).
    if "max_new_tokens" in d and sp.max_new_tokens is not None \
            and sp.max_new_tokens > ctx.context_length:
        raise RequestError(
            f"{max_tokens_name} = {sp.max_new_tokens} exceeds the model's context length of "
            f"{ctx.context_length} tokens", max_tokens_name)
    return sp


def _clamp_default_max_new(sp: SamplingParams, prompt_len: int,
                           ctx: ServingContext) -> SamplingParams:
    """The default ``max_new_tokens`` (the client did not set it) cut to what the context
    leaves after the prompt, as SGLang does (issue 16, item 6). Returns a copy."""
    left = max(1, ctx.context_length - prompt_len)
    if sp.max_new_tokens is None or sp.max_new_tokens <= left:
        return sp
    return dataclasses.replace(sp, max_new_tokens=left)


def _sample_params(sp: SamplingParams, j: int) -> SamplingParams:
    """A private copy for sample ``j`` of a prompt (the engine may change its copy, e.g. the PD
    prefill role forces ``max_new_tokens=1``). With a ``seed``, sample ``j`` uses ``seed + j``
    so that the ``n`` samples differ while staying reproducible."""
    seed = sp.seed if sp.seed is None or j == 0 else sp.seed + j
    return dataclasses.replace(sp, seed=seed)


def _per_sample(name: str, value: Any, num: int, check: Callable[[str, Any], Any],
                room: bool = False) -> list[Any]:
    """Expand a PD field to one value per sample: None, a scalar, or a list of ``num``."""
    if value is None:
        return [None] * num
    if isinstance(value, list):
        if len(value) != num:
            raise RequestError(f"{name} must be a scalar or a list of one value per sample "
                               f"({num}), got a list of {len(value)}", name)
        return [None if v is None else check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    v = check(name, value)
    if room:
        if v + num - 1 > MAX_ROOM:
            raise RequestError(f"{name} + {num - 1} overflows the 63-bit room range", name)
        return [v + k for k in range(num)]
    return [v] * num


def _check_bootstrap_host(name: str, v: Any) -> str:
    _check_str(name, v, allow_empty=False)
    if v == FAKE_BOOTSTRAP_HOST:
        # The fake host makes a decode read pages nothing wrote (issue 16, item 8).
        raise RequestError(f"{name}: {v} is reserved for the server's own warm-up and health "
                           f"probe", name)
    return v


def _pd_fields(body: dict[str, Any], num: int) -> tuple[list, list, list]:
    hosts = _per_sample("bootstrap_host", body.get("bootstrap_host"), num, _check_bootstrap_host)
    ports = _per_sample("bootstrap_port", body.get("bootstrap_port"), num,
                        lambda n, v: _check_int(n, v, 1, 65535))
    rooms = _per_sample("bootstrap_room", body.get("bootstrap_room"), num,
                        lambda n, v: _check_int(n, v, 0, MAX_ROOM), room=True)
    given = [r for r in rooms if r is not None]
    if len(set(given)) != len(given):
        raise RequestError("bootstrap_room must hold a distinct room per sample", "bootstrap_room")
    return hosts, ports, rooms


# ---------------------------------------------------------------------------------------------
# /generate
# ---------------------------------------------------------------------------------------------

_NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "return_logprob",
                  "top_logprobs_num", "logprob_start_len", "rid", "bootstrap_host",
                  "bootstrap_port", "bootstrap_room", "return_text_in_logprobs", "log_metrics",
                  "separate_reasoning"}
_NATIVE_DEFAULT_ONLY: dict[str, Callable[[Any], bool]] = {
    "image_data": lambda v: v in ([], ""), "video_data": lambda v: v in ([], ""),
    "audio_data": lambda v: v in ([], ""), "input_embeds": lambda v: False,
    "lora_path": lambda v: False, "session_params": lambda v: False,
    "custom_logit_processor": lambda v: False, "token_ids_logprob": lambda v: v == [],
    "return_hidden_states": lambda v: v is False, "routed_dp_rank": lambda v: v == 0,
    "data_parallel_rank": lambda v: v == 0, "disagg_prefill_dp_rank": lambda v: v == 0,
    # Sent with their defaults by sglang-router (PD mode, issue 5).
    "background": lambda v: v is False, "no_logs": lambda v: isinstance(v, bool),
    "return_bytes": lambda v: v is False, "return_entropy": lambda v: v is False,
}


def _per_prompt(name: str, value: Any, batch: int, n: int, default: Any,
                check: Callable[[str, Any], Any]) -> list[Any]:
    """A native per-prompt field: scalar, or (batch requests with n == 1) a list of ``batch``."""
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if n > 1:
            raise RequestError(f"{name} cannot be a list when n > 1", name)
        if len(value) != batch:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {batch}", name)
        return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [check(name, value)] * batch


def parse_generate_request(body: Any, ctx: ServingContext) -> NativeRequest:
    """Validate a ``/generate`` body (SGLang's ``GenerateReqInput`` fields) and expand it into
    one ``GenerateRequest`` per sample. Raises ``RequestError``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = _present(body)
    _check_fields(body, _NATIVE_FIELDS, _NATIVE_DEFAULT_ONLY, "/generate")
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("exactly one of text or input_ids must be given", "text")

    # Prompts.
    prompts: list[list[int]]
    if "text" in body:
        text = body["text"]
        if isinstance(text, str):
            is_single, texts = True, [text]
        elif isinstance(text, list) and text:
            is_single, texts = False, text
            _check_batch_size("text", len(texts))
        else:
            raise RequestError("text must be a string or a non-empty list of strings", "text")
        prompts = []
        for i, t in enumerate(texts):
            name = "text" if is_single else f"text[{i}]"
            _check_str(name, t)
            if not t:
                raise RequestError(f"{name} is empty: the prompt needs at least one token", "text")
            prompts.append(_encode(ctx, t, param=name))
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or of lists)",
                               "input_ids")
        if all(isinstance(x, list) for x in ids):
            is_single = False
            _check_batch_size("input_ids", len(ids))
            prompts = [_validate_token_ids(f"input_ids[{i}]", x, ctx) for i, x in enumerate(ids)]
        else:
            is_single = True
            prompts = [_validate_token_ids("input_ids", ids, ctx)]
    batch = len(prompts)
    for i, p in enumerate(prompts):
        field = "text" if "text" in body else "input_ids"
        _check_prompt_length(field if is_single else f"{field}[{i}]", p, ctx)

    # Sampling params: one dict, or one per prompt; n must agree.
    sp_raw = body.get("sampling_params", {})
    if isinstance(sp_raw, dict):
        sp_list = [_sampling_params(sp_raw, ctx, "sampling_params")] * batch
        explicit = ["max_new_tokens" in sp_raw] * batch
    elif isinstance(sp_raw, list) and not is_single:
        if len(sp_raw) != batch or not all(isinstance(d, dict) for d in sp_raw):
            raise RequestError(f"sampling_params must be an object or a list of {batch} objects",
                               "sampling_params")
        sp_list = [_sampling_params(d, ctx, f"sampling_params[{i}]") for i, d in enumerate(sp_raw)]
        explicit = ["max_new_tokens" in d for d in sp_raw]
    else:
        raise RequestError("sampling_params must be an object (or a list of objects for a batch)",
                           "sampling_params")
    sp_list = [sp if exp else _clamp_default_max_new(sp, len(p), ctx)
               for sp, exp, p in zip(sp_list, explicit, prompts)]
    n = sp_list[0].n
    if any(sp.n != n for sp in sp_list):
        raise RequestError("sampling_params: n must be the same for every prompt",
                           "sampling_params")
    if n > 1:
        is_single = False
    _check_num_samples(batch, n, "sampling_params.n")
    num = batch * n

    stream = _check_bool("stream", body.get("stream", False))
    ret_lp = _per_prompt("return_logprob", body.get("return_logprob"), batch, n, False, _check_bool)
    top_n = _per_prompt("top_logprobs_num", body.get("top_logprobs_num"), batch, n, 0,
                        lambda nm, v: _check_int(nm, v, 0, MAX_TOP_LOGPROBS))
    start = _per_prompt("logprob_start_len", body.get("logprob_start_len"), batch, n, -1,
                        lambda nm, v: _check_int(nm, v, -1))
    for i in range(batch):
        if start[i] >= len(prompts[i]):
            raise RequestError(f"logprob_start_len = {start[i]} must be below the prompt length "
                               f"({len(prompts[i])})", "logprob_start_len")

    # Request ids.
    rid = body.get("rid")
    group_rid = None
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        _check_str("rid", rid, allow_empty=False)
        group_rid = rid
        rids = [rid] if num == 1 and is_single else [f"{rid}_{k}" for k in range(num)]
    elif isinstance(rid, list) and not is_single:
        if len(rid) != batch:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {batch}", "rid")
        for i, r in enumerate(rid):
            _check_str(f"rid[{i}]", r, allow_empty=False)
        rids = [rid[k % batch] if n == 1 else f"{rid[k % batch]}_{k // batch}" for k in range(num)]
    else:
        raise RequestError("rid must be a string (or a list of strings for a batch)", "rid")
    if len(set(rids)) != len(rids):
        raise RequestError("rid: request ids in one request must be distinct", "rid")

    reasoning_parser = None
    if _check_bool("separate_reasoning", body.get("separate_reasoning", False)):
        if ctx.reasoning_parser is None:
            raise RequestError("separate_reasoning needs a reasoning parser: start the server "
                               "with --reasoning-parser", "separate_reasoning")
        reasoning_parser = ctx.reasoning_parser

    hosts, ports, rooms = _pd_fields(body, num)
    reqs = []
    for k in range(num):
        i = k % batch
        reqs.append(GenerateRequest(
            rid=rids[k], input_ids=list(prompts[i]),
            sampling_params=_sample_params(sp_list[i], k // batch),
            return_logprob=ret_lp[i], top_logprobs_num=top_n[i] if ret_lp[i] else 0,
            logprob_start_len=start[i] if ret_lp[i] else -1,
            bootstrap_host=hosts[k], bootstrap_port=ports[k], bootstrap_room=rooms[k]))
    return NativeRequest(
        requests=reqs, is_single=is_single, stream=stream,
        return_text_in_logprobs=_check_bool("return_text_in_logprobs",
                                            body.get("return_text_in_logprobs", False)),
        group_rid=group_rid,
        log_metrics=_check_bool("log_metrics", body.get("log_metrics", True)),
        reasoning_parser=reasoning_parser)


# ---------------------------------------------------------------------------------------------
# OpenAI requests
# ---------------------------------------------------------------------------------------------

# Sampling fields shared by both OpenAI endpoints; the extras (top_k ... skip_special_tokens)
# are SGLang/vLLM extensions sent through the openai client's ``extra_body``.
_OPENAI_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
                    "stop_token_ids", "skip_special_tokens"}
_OPENAI_COMMON = _OPENAI_SAMPLING | {
    "model", "max_tokens", "stream", "stream_options", "logprobs", "user", "rid",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "metadata", "service_tier",
    "prompt_cache_key", "safety_identifier"}
_COMPLETION_FIELDS = _OPENAI_COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _OPENAI_COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                                 "chat_template_kwargs", "tools", "tool_choice",
                                 "parallel_tool_calls", "separate_reasoning", "stream_reasoning"}


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


_OPENAI_DEFAULT_ONLY: dict[str, Callable[[Any], bool]] = {
    "tools": _empty, "tool_choice": lambda v: v == "none", "functions": _empty,
    "function_call": lambda v: v == "none", "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: v == {"type": "text"}, "logit_bias": _empty,
    "suffix": _empty, "best_of": lambda v: v == 1, "store": lambda v: v is False,
    "modalities": lambda v: v == ["text"], "audio": lambda v: False,
    "prediction": lambda v: False, "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False, "regex": lambda v: False,
    "json_schema": lambda v: False, "ebnf": lambda v: False,
    # Sent with their defaults by sglang-router (PD mode, issue 5); the two reasoning
    # switches act on chat requests only.
    "no_stop_trim": lambda v: v is False, "continue_final_message": lambda v: v is False,
    "return_hidden_states": lambda v: v is False,
    "separate_reasoning": lambda v: isinstance(v, bool),
    "stream_reasoning": lambda v: isinstance(v, bool),
}


def _check_model(body: dict[str, Any], ctx: ServingContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.served_model_name
    _check_str("model", model)
    if model not in ctx.model_names():
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{ctx.served_model_name!r}", "model")
    return model


def _openai_sampling(body: dict[str, Any], ctx: ServingContext, max_tokens: Any,
                     max_tokens_name: str) -> SamplingParams:
    if max_tokens is not None:
        _check_int(max_tokens_name, max_tokens, 0, SamplingParams.MAX_NEW_TOKENS_LIMIT)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        v = body.get(name)
        if v is not None and (not _is_num(v) or not math.isfinite(v)):
            raise RequestError(f"{name} must be a finite number, got {v!r}", name)
    d = {k: body[k] for k in _OPENAI_SAMPLING if k in body}
    stop = d.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if isinstance(stop, list) and not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must contain non-empty strings only", "stop")
    if isinstance(stop, str) and not stop:
        raise RequestError("stop must not be an empty string", "stop")
    if "stop_token_ids" in d and not isinstance(d["stop_token_ids"], list):
        raise RequestError("stop_token_ids must be a list of integers", "stop_token_ids")
    if "skip_special_tokens" in d:
        _check_bool("skip_special_tokens", d["skip_special_tokens"])
    d["max_new_tokens"] = max_tokens
    return _sampling_params(d, ctx, "", max_tokens_name)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    for key, value in opts.items():
        if key == "include_usage":
            continue
        if key == "continuous_usage_stats" and value in (False, None):
            continue
        raise RequestError(f"stream_options.{key} is not supported", f"stream_options.{key}")
    v = opts.get("include_usage", False)
    return bool(_check_bool("stream_options.include_usage", False if v is None else v))


def _openai_requests(body: dict[str, Any], prompts: list[list[int]], sp: SamplingParams,
                     base_rid: str, logprobs: int | None) -> list[GenerateRequest]:
    n = sp.n
    num = len(prompts) * n
    hosts, ports, rooms = _pd_fields(body, num)
    reqs = []
    for k in range(num):
        reqs.append(GenerateRequest(
            rid=base_rid if num == 1 else f"{base_rid}_{k}", input_ids=list(prompts[k // n]),
            sampling_params=_sample_params(sp, k % n), return_logprob=logprobs is not None,
            top_logprobs_num=logprobs or 0, logprob_start_len=-1,
            bootstrap_host=hosts[k], bootstrap_port=ports[k], bootstrap_room=rooms[k]))
    return reqs


def _base_rid(body: dict[str, Any], response_id: str) -> tuple[str, str | None]:
    rid = body.get("rid")
    if rid is None:
        return response_id, None
    _check_str("rid", rid, allow_empty=False)
    return rid, rid


def parse_completion_request(body: Any, ctx: ServingContext) -> OpenAIRequest:
    """Validate a ``/v1/completions`` body. Raises ``RequestError``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = _present(body)
    _check_fields(body, _COMPLETION_FIELDS, _OPENAI_DEFAULT_ONLY, "/v1/completions")
    model = _check_model(body, ctx)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raw = prompt
    else:
        raise RequestError("prompt must be a non-empty string, list of strings, list of token "
                           "ids or list of token-id lists", "prompt")
    _check_batch_size("prompt", len(raw))
    prompts, texts = [], []
    for i, p in enumerate(raw):
        name = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise RequestError(f"{name} is empty: the prompt needs at least one token",
                                   "prompt")
            ids = _encode(ctx, p, param=name)
            texts.append(p)
        else:
            ids = _validate_token_ids(name, p, ctx)
            texts.append(ctx.tokenizer.decode(ids))
        _check_prompt_length(name, ids, ctx)
        prompts.append(ids)

    stream = _check_bool("stream", body.get("stream", False))
    include_usage = _stream_options(body, stream)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    echo = _check_bool("echo", body.get("echo", False))
    if echo and logprobs is not None:
        raise RequestError("echo together with logprobs is not supported by pdjax", "echo")
    sp = _openai_sampling(body, ctx, body.get("max_tokens", 16), "max_tokens")
    _check_num_samples(len(prompts), sp.n)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    base, group_rid = _base_rid(body, response_id)
    return OpenAIRequest(
        kind="completion", requests=_openai_requests(body, prompts, sp, base, logprobs),
        n=sp.n, num_prompts=len(prompts), stream=stream, include_usage=include_usage,
        logprobs=logprobs, model=model, response_id=response_id, created=int(time.time()),
        echo_texts=texts if echo else None, group_rid=group_rid)


_CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{name} must be an object", "messages")
        m = _present(m)
        role = m.get("role")
        if role == "function":
            raise RequestError(f"{name}.role 'function' (the deprecated functions API) is not "
                               "supported; use tools and role 'tool'", "messages")
        if role not in _CHAT_ROLES:
            raise RequestError(f"{name}.role must be one of {sorted(_CHAT_ROLES)}, got {role!r}",
                               "messages")
        for key in m:
            if key not in _MESSAGE_FIELDS:
                raise RequestError(f"{name}.{key} is not supported", "messages")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError(f"{name}.content[{j}]: content type {kind!r} is not "
                                       "supported (text only)", "messages")
                parts.append(_check_str(f"{name}.content[{j}].text", part.get("text")))
            content = "".join(parts)
        elif not isinstance(content, str):
            raise RequestError(f"{name}.content must be a string or a list of text parts",
                               "messages")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if "name" in m:
            msg["name"] = _check_str(f"{name}.name", m["name"])
        msg.update(tool_api.message_tool_fields(m, role, name))
        if "reasoning_content" in m:      # an earlier answer sent back (templates may use it)
            if role != "assistant":
                raise RequestError(f"{name}.reasoning_content is only allowed in assistant "
                                   "messages", "messages")
            msg["reasoning_content"] = _check_str(f"{name}.reasoning_content",
                                                  m["reasoning_content"])
        out.append(msg)
    return out


def parse_chat_request(body: Any, ctx: ServingContext) -> OpenAIRequest:
    """Validate a ``/v1/chat/completions`` body and apply the chat template
    (``apply_chat_template(add_generation_prompt=True)``). Raises ``RequestError``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = _present(body)
    _check_fields(body, _CHAT_FIELDS, _OPENAI_DEFAULT_ONLY, "/v1/chat/completions")
    model = _check_model(body, ctx)
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    messages = _chat_messages(body["messages"])
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if "tools" in kwargs:
        raise RequestError("chat_template_kwargs.tools: pass tools as the tools field",
                           "chat_template_kwargs")
    chat_tools = tool_api.parse_tools(body, ctx.tool_call_parser)
    try:
        prompt_text = tool_api.render_prompt(ctx.tokenizer, messages, chat_tools, kwargs)
    except Exception as e:  # jinja errors, a missing template, bad kwargs
        raise RequestError(f"messages: the chat template failed: {e}", "messages") from None
    if not isinstance(prompt_text, str) or not prompt_text:
        raise RequestError("messages: the chat template produced an empty prompt", "messages")
    ids = _encode(ctx, prompt_text, add_special_tokens=False, param="messages")
    if not ids:
        raise RequestError("messages: the prompt is empty", "messages")
    _check_prompt_length("messages", ids, ctx)

    stream = _check_bool("stream", body.get("stream", False))
    include_usage = _stream_options(body, stream)
    want_lp = _check_bool("logprobs", body.get("logprobs", False))
    top = body.get("top_logprobs")
    if top is not None:
        top = _check_int("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if not want_lp and top > 0:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if want_lp else None
    if "max_completion_tokens" in body:
        max_tokens, mt_name = body["max_completion_tokens"], "max_completion_tokens"
    else:
        max_tokens, mt_name = body.get("max_tokens"), "max_tokens"
    sp = _openai_sampling(body, ctx, max_tokens, mt_name)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    base, group_rid = _base_rid(body, response_id)
    return OpenAIRequest(
        kind="chat", requests=_openai_requests(body, [ids], sp, base, logprobs), n=sp.n,
        num_prompts=1, stream=stream, include_usage=include_usage, logprobs=logprobs,
        model=model, response_id=response_id, created=int(time.time()), group_rid=group_rid,
        chat_output=_chat_output(body, ctx, chat_tools, prompt_text))


def _chat_output(body: dict[str, Any], ctx: ServingContext,
                 chat_tools: tool_api.ChatTools | None,
                 prompt_text: str) -> ChatOutputConfig | None:
    """How the answer is parsed: tool calls, and reasoning unless ``separate_reasoning`` is
    false (SGLang's switches; ``stream_reasoning: false`` sends the reasoning in one piece)."""
    separate = _check_bool("separate_reasoning", body.get("separate_reasoning", True))
    stream_reasoning = _check_bool("stream_reasoning", body.get("stream_reasoning", True))
    reasoning = ctx.reasoning_parser if separate else None
    if chat_tools is None and reasoning is None:
        return None
    return ChatOutputConfig(tools=chat_tools, reasoning_parser=reasoning,
                            prompt_text=prompt_text[-256:], stream_reasoning=stream_reasoning)


# ---------------------------------------------------------------------------------------------
# Results and responses
# ---------------------------------------------------------------------------------------------

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


def _lp(v: float | None) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else LOGPROB_FLOOR


def openai_finish_reason(finish_reason: dict[str, Any] | None) -> str | None:
    """SGLang's finish-reason dict -> OpenAI's string (``stop``, ``length``, ``abort``)."""
    if not finish_reason:
        return None
    return {"stop": "stop", "length": "length"}.get(finish_reason.get("type"), "abort")


def native_finish_reason(finish_reason: dict[str, Any] | None) -> dict[str, Any] | None:
    return dict(finish_reason) if finish_reason else None


def _native_lp_entries(lps: Sequence[float | None], ids: Sequence[int], texts: TokenTexts | None):
    return [[_lp(lp), int(t), texts.text(t) if texts else None] for lp, t in zip(lps, ids)]


def _native_top_entries(tops, texts: TokenTexts | None):
    out = []
    for top in tops:
        if top is None:
            out.append(None)
        else:
            out.append([[_lp(lp), int(t), texts.text(t) if texts else None] for t, lp in top])
    return out


def native_response(r: SampleResult, req: GenerateRequest, token_texts: TokenTexts | None,
                    index: int | None = None) -> dict[str, Any]:
    """SGLang's ``/generate`` answer for one sample (cumulative; also each stream event).

    ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
    "completion_tokens", "cached_tokens", "e2e_latency", [logprob fields]}, ["index"]}``.
    Logprob entries are ``[logprob, token_id, token_text_or_null]``; ``token_texts`` given
    means ``return_text_in_logprobs``.
    """
    meta: dict[str, Any] = {
        "id": r.rid, "finish_reason": native_finish_reason(r.finish_reason),
        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens, "e2e_latency": round(r.e2e_latency, 6)}
    if req.return_logprob:
        start = req.logprob_start_len if req.logprob_start_len >= 0 else len(r.prompt_ids)
        prompt_ids = r.prompt_ids[start:]
        plp = r.prompt_logprobs or []
        meta["input_token_logprobs"] = _native_lp_entries(plp, prompt_ids, token_texts)
        meta["output_token_logprobs"] = _native_lp_entries(r.output_logprobs, r.output_ids,
                                                           token_texts)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _native_top_entries(r.prompt_top_logprobs or [],
                                                             token_texts)
            meta["output_top_logprobs"] = _native_top_entries(r.output_top_logprobs, token_texts)
    out = {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def usage(req: OpenAIRequest, results: Sequence[SampleResult]) -> dict[str, Any]:
    """OpenAI ``usage``: prompt tokens once per prompt (its first sample), completion tokens
    over all samples, ``prompt_tokens_details.cached_tokens`` like the prompt tokens."""
    firsts = [r for r in results if r.index % req.n == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def completion_logprobs(token_ids: Sequence[int], lps: Sequence[float],
                        tops: Sequence[Sequence[tuple[int, float]]], top_n: int,
                        texts: TokenTexts, text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [texts.text(t) for t in token_ids]
    offsets, off = [], text_offset
    for s in tokens:
        offsets.append(off)
        off += len(s)
    top_list = None
    if top_n > 0:
        top_list = []
        for top in tops:
            d: dict[str, float] = {}
            for t, lp in list(top)[:top_n]:
                d.setdefault(texts.text(t), _lp(lp))
            top_list.append(d)
    return {"tokens": tokens, "token_logprobs": [_lp(v) for v in lps], "top_logprobs": top_list,
            "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]], top_n: int,
                  texts: TokenTexts) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    content = []
    for pos, (t, lp) in enumerate(zip(token_ids, lps)):
        top = tops[pos] if pos < len(tops) and top_n > 0 else []
        content.append({
            "token": texts.text(t), "logprob": _lp(lp), "bytes": texts.token_bytes(t),
            "top_logprobs": [{"token": texts.text(tt), "logprob": _lp(tlp),
                              "bytes": texts.token_bytes(tt)} for tt, tlp in list(top)[:top_n]]})
    return {"content": content, "refusal": None}


def _choice_text(req: OpenAIRequest, r: SampleResult) -> str:
    if req.echo_texts is not None:
        return req.echo_texts[req.prompt_index(r.index)] + r.text
    return r.text


def completion_response(req: OpenAIRequest, results: Sequence[SampleResult],
                        texts: TokenTexts) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object."""
    choices = []
    for r in results:
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs,
                                     req.logprobs, texts, 0)
        choices.append({"index": r.index, "text": _choice_text(req, r), "logprobs": lp,
                        "finish_reason": openai_finish_reason(r.finish_reason),
                        "matched_stop": (r.finish_reason or {}).get("matched")})
    return {"id": req.response_id, "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage(req, results),
            "system_fingerprint": None}


def chat_response(req: OpenAIRequest, results: Sequence[SampleResult],
                  texts: TokenTexts) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    choices = []
    for r in results:
        lp = None
        if req.logprobs is not None:
            lp = chat_logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs,
                               req.logprobs, texts)
        finish = openai_finish_reason(r.finish_reason)
        out = req.chat_output.new_choice() if req.chat_output is not None else None
        if out is None:
            message = {"role": "assistant", "content": r.text, "tool_calls": None}
        else:
            message = out.message(r.text)
            finish = out.finish_reason(finish)
        choices.append({"index": r.index, "message": message, "logprobs": lp,
                        "finish_reason": finish,
                        "matched_stop": (r.finish_reason or {}).get("matched")})
    return {"id": req.response_id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage(req, results),
            "system_fingerprint": None}


def _chunk(req: OpenAIRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    out = {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
           "choices": choices, "system_fingerprint": None}
    if req.include_usage:
        out["usage"] = None
    return out


def stream_start_chunks(req: OpenAIRequest) -> list[dict[str, Any]]:
    """Chunks sent before any token: the assistant role (chat) or the echoed prompt."""
    num = len(req.requests)
    if req.kind == "chat":
        return [_chunk(req, [{"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for k in range(num)]
    if req.echo_texts is not None:
        return [_chunk(req, [{"index": k, "text": req.echo_texts[req.prompt_index(k)],
                              "logprobs": None, "finish_reason": None}]) for k in range(num)]
    return []


def stream_delta_chunk(req: OpenAIRequest, d: SampleDelta, r: SampleResult,
                       texts: TokenTexts, text_offset: int) -> dict[str, Any] | None:
    """The chunk for one increment, or None when it carries nothing (no text, no tokens with
    logprobs, not finished). ``text_offset``: chars of this choice's text before ``d``."""
    want_lp = req.logprobs is not None and bool(d.token_ids)
    if not d.text and not want_lp and not d.finished:
        return None
    finish = openai_finish_reason(r.finish_reason) if d.finished else None
    if req.kind == "chat":
        lp = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts) \
            if want_lp else None
        delta = {"content": d.text} if d.text else {}
        choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        lp = completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts,
                                 text_offset) if want_lp else None
        choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": finish}
    if d.finished:
        choice["matched_stop"] = (r.finish_reason or {}).get("matched")
    return _chunk(req, [choice])


def stream_delta_chunks(req: OpenAIRequest, d: SampleDelta, r: SampleResult,
                        texts: TokenTexts, text_offset: int) -> list[dict[str, Any]]:
    """The chunks for one increment: ``stream_delta_chunk``'s, or, when the chat output is
    parsed (tools, reasoning), one chunk per parsed delta (a call's first delta alone); the
    increment's logprobs ride on the first, the finish reason on the last."""
    out = req.choice_output(d.index) if req.kind == "chat" else None
    if out is None:
        chunk = stream_delta_chunk(req, d, r, texts, text_offset)
        return [] if chunk is None else [chunk]
    deltas = out.stream(d.text, d.finished)
    want_lp = req.logprobs is not None and bool(d.token_ids)
    if not deltas and (want_lp or d.finished):
        deltas = [{}]
    chunks = []
    for j, delta in enumerate(deltas):
        lp = None
        if j == 0 and want_lp:
            lp = chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs, req.logprobs, texts)
        last = d.finished and j == len(deltas) - 1
        choice = {"index": d.index, "delta": delta, "logprobs": lp,
                  "finish_reason": out.finish_reason(openai_finish_reason(r.finish_reason))
                  if last else None}
        if last:
            choice["matched_stop"] = (r.finish_reason or {}).get("matched")
        chunks.append(_chunk(req, [choice]))
    return chunks


def stream_usage_chunk(req: OpenAIRequest, results: Sequence[SampleResult]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    out = _chunk(req, [])
    out["usage"] = usage(req, results)
    return out
