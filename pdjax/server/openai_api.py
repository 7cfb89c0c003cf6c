"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``: requests parsed into one
``GenerateRequest`` per choice (DESIGN.md §4; the answers: ``openai_render``).

``/v1/completions``: ``prompt`` (string, list of strings, token ids, or lists of them); choice
``k = i * n + j``. ``/v1/chat/completions``: ``messages`` through the tokenizer's chat template;
choice ``k = j``. Every bad input raises ``RequestError`` naming the field; fields that ask for
behaviour pdjax does not have (``suffix``, ``best_of``, ...) are rejected, never ignored; a field set to
``null`` counts as absent. Tool calling and reasoning output (``tools.py``, ``chat_output.py``,
``parsers/``) hook in at the chat request and the answer.

Structured outputs: ``response_format`` (``text``, ``json_object``, ``json_schema``) on both
endpoints, and ``tool_choice`` ``required`` / a named function (``ChatTools.grammar_spec``),
become the request's ``SamplingParams.grammar``, compiled while parsing (``check_grammar``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any, Callable

from pdjax.constrained.grammar import GrammarSpec
from pdjax.engine_io import GenerateRequest
from pdjax.request import SamplingParams
from pdjax.server import tools as tool_api
from pdjax.server.chat_output import ChatOutputConfig, ChoiceOutput
from pdjax.server.errors import RequestError
from pdjax.server.validation import (MAX_TOP_LOGPROBS, ServingContext, check_batch_size,
                                     check_bool, check_grammar, check_int, check_max_new_tokens,
                                     check_num_samples,
                                     check_prompt_length, check_str, check_token_ids,
                                     checked_body, encode_prompt, is_int, is_num,
                                     parse_sampling_params, pd_fields, present_fields,
                                     sample_params)


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


# Sampling fields shared by both OpenAI endpoints; the extras (top_k ... skip_special_tokens)
# are SGLang/vLLM extensions sent through the openai client's ``extra_body``.
_OPENAI_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
                    "stop_token_ids", "skip_special_tokens", "logit_bias", "speculative",
                    "min_tokens", "stop_regex"}
_OPENAI_COMMON = _OPENAI_SAMPLING | {
    "model", "max_tokens", "stream", "stream_options", "logprobs", "user", "rid",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "metadata", "service_tier",
    "prompt_cache_key", "safety_identifier", "response_format"}
_COMPLETION_FIELDS = _OPENAI_COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _OPENAI_COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                                 "chat_template_kwargs", "tools", "tool_choice",
                                 "parallel_tool_calls", "separate_reasoning", "stream_reasoning"}


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


_OPENAI_DEFAULT_ONLY: dict[str, Callable[[Any], bool]] = {
    "tools": _empty, "tool_choice": lambda v: v == "none", "functions": _empty,
    "function_call": lambda v: v == "none", "parallel_tool_calls": lambda v: isinstance(v, bool),
    "suffix": _empty, "best_of": lambda v: v == 1, "store": lambda v: v is False,
    "modalities": lambda v: v == ["text"], "audio": lambda v: False,
    "prediction": lambda v: False, "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False, "regex": lambda v: False,
    "json_schema": lambda v: False, "ebnf": lambda v: False,
    # Sent with their defaults by sglang-router (PD mode); the two reasoning
    # switches act on chat requests only.
    "no_stop_trim": lambda v: v is False, "continue_final_message": lambda v: v is False,
    "return_hidden_states": lambda v: v is False,
    "separate_reasoning": lambda v: isinstance(v, bool),
    "stream_reasoning": lambda v: isinstance(v, bool),
}


_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _response_format(body: dict[str, Any]) -> GrammarSpec | None:
    """OpenAI's ``response_format``: None for ``text``, else the grammar it asks for.
    ``json_schema.strict`` is accepted either way: the schema is always enforced."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise RequestError("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise RequestError(f"response_format.type must be one of {list(_RESPONSE_FORMAT_TYPES)}, "
                           f"got {kind!r}", "response_format")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(k for k in rf if k not in allowed and rf[k] is not None)
    if extra:
        raise RequestError(f"response_format.{extra[0]} is not supported with type {kind!r}",
                           "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", field="response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise RequestError("response_format.json_schema must be an object with name and schema",
                           "response_format")
    bad = sorted(k for k in js if k not in _JSON_SCHEMA_KEYS)
    if bad:
        raise RequestError(f"response_format.json_schema.{bad[0]} is not supported",
                           "response_format")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("response_format.json_schema.name must be a non-empty string",
                           "response_format")
    if js.get("strict") is not None:
        check_bool("response_format.json_schema.strict", js["strict"])
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                           "response_format")
    return GrammarSpec("json_schema", json.dumps(schema), field="response_format")


def check_model(body: dict[str, Any], ctx: ServingContext) -> str:
    """The ``model`` field: the served name when absent; ``RequestError`` naming ``model``
    for a model this server does not serve: 404, as OpenAI and vLLM answer it."""
    model = body.get("model")
    if model is None:
        return ctx.served_model_name
    check_str("model", model)
    if model not in ctx.model_names():
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{ctx.served_model_name!r}", "model", status=404)
    return model


def _openai_sampling(body: dict[str, Any], ctx: ServingContext, max_tokens: Any,
                     max_tokens_name: str) -> SamplingParams:
    if max_tokens is not None:
        check_int(max_tokens_name, max_tokens, 0, SamplingParams.MAX_NEW_TOKENS_LIMIT)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        v = body.get(name)
        if v is not None and (not is_num(v) or not math.isfinite(v)):
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
    for name in ("skip_special_tokens", "speculative"):
        if name in d:
            check_bool(name, d[name])
    min_tokens = d.pop("min_tokens", None)     # vLLM's and SGLang's OpenAI name
    if min_tokens is not None:
        check_int("min_tokens", min_tokens, 0, SamplingParams.MAX_NEW_TOKENS_LIMIT)
        if max_tokens is not None and min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({min_tokens}) must be at most {max_tokens_name} "
                               f"({max_tokens})", "min_tokens")
        d["min_new_tokens"] = min_tokens
    d["max_new_tokens"] = max_tokens
    return parse_sampling_params(d, ctx, "", max_tokens_name)


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
    return bool(check_bool("stream_options.include_usage", False if v is None else v))


def _openai_requests(body: dict[str, Any], prompts: list[list[int]], sp: SamplingParams,
                     base_rid: str, logprobs: int | None) -> list[GenerateRequest]:
    n = sp.n
    num = len(prompts) * n
    hosts, ports, rooms = pd_fields(body, num)
    reqs = []
    for k in range(num):
        reqs.append(GenerateRequest(
            rid=base_rid if num == 1 else f"{base_rid}_{k}", input_ids=list(prompts[k // n]),
            sampling_params=sample_params(sp, k % n), return_logprob=logprobs is not None,
            top_logprobs_num=logprobs or 0, logprob_start_len=-1,
            bootstrap_host=hosts[k], bootstrap_port=ports[k], bootstrap_room=rooms[k]))
    return reqs


# Accepted and not acted on (OpenAI's bookkeeping fields), but type-checked as OpenAI does.
_STRING_ONLY_FIELDS = ("user", "service_tier", "prompt_cache_key", "safety_identifier")


def _check_bookkeeping(body: dict[str, Any]) -> None:
    """``user`` and the other fields above are strings; ``metadata`` maps strings to
    strings. ``RequestError`` naming the field."""
    for field in _STRING_ONLY_FIELDS:
        if field in body:
            check_str(field, body[field])
    if "metadata" in body:
        meta = body["metadata"]
        if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise RequestError("metadata must be an object of string values", "metadata")


def _base_rid(body: dict[str, Any], response_id: str) -> tuple[str, str | None]:
    rid = body.get("rid")
    if rid is None:
        return response_id, None
    check_str("rid", rid, allow_empty=False)
    return rid, rid


def parse_completion_request(body: Any, ctx: ServingContext) -> OpenAIRequest:
    """Validate a ``/v1/completions`` body. Raises ``RequestError``."""
    body = checked_body(body, _COMPLETION_FIELDS, _OPENAI_DEFAULT_ONLY, "/v1/completions")
    model = check_model(body, ctx)
    _check_bookkeeping(body)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raw = prompt
    else:
        raise RequestError("prompt must be a non-empty string, list of strings, list of token "
                           "ids or list of token-id lists", "prompt")
    check_batch_size("prompt", len(raw))
    prompts, texts = [], []
    for i, p in enumerate(raw):
        name = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise RequestError(f"{name} is empty: the prompt needs at least one token",
                                   "prompt")
            ids = encode_prompt(ctx, p, param=name)
            texts.append(p)
        else:
            ids = check_token_ids(name, p, ctx)
            texts.append(ctx.tokenizer.decode(ids))
        check_prompt_length(name, ids, ctx)
        prompts.append(ids)

    stream = check_bool("stream", body.get("stream", False))
    include_usage = _stream_options(body, stream)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    echo = check_bool("echo", body.get("echo", False))
    if echo and logprobs is not None:
        raise RequestError("echo together with logprobs is not supported by pdjax", "echo")
    sp = _openai_sampling(body, ctx, body.get("max_tokens", 16), "max_tokens")
    if "max_tokens" in body:     # the default (16) may run into the context's end instead
        for ids in prompts:
            check_max_new_tokens("max_tokens", sp, len(ids), ctx)
    check_num_samples(len(prompts), sp.n)
    sp = dataclasses.replace(sp, grammar=_response_format(body))
    check_grammar(sp.grammar, ctx)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    base, group_rid = _base_rid(body, response_id)
    return OpenAIRequest(
        kind="completion", requests=_openai_requests(body, prompts, sp, base, logprobs),
        n=sp.n, num_prompts=len(prompts), stream=stream, include_usage=include_usage,
        logprobs=logprobs, model=model, response_id=response_id, created=int(time.time()),
        echo_texts=texts if echo else None, group_rid=group_rid)


_CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The checked ``messages`` list of a chat request (text content only); ``RequestError``
    naming ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{name} must be an object", "messages")
        m = present_fields(m)
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
        if "content" not in m and role != "assistant":    # an assistant turn may be calls only
            raise RequestError(f"{name}.content is required for role {role!r}", "messages")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError(f"{name}.content[{j}]: content type {kind!r} is not "
                                       "supported (text only)", "messages")
                parts.append(check_str(f"{name}.content[{j}].text", part.get("text")))
            content = "".join(parts)
        elif not isinstance(content, str):
            raise RequestError(f"{name}.content must be a string or a list of text parts",
                               "messages")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if "name" in m:
            msg["name"] = check_str(f"{name}.name", m["name"])
        msg.update(tool_api.message_tool_fields(m, role, name))
        if "reasoning_content" in m:      # an earlier answer sent back (templates may use it)
            if role != "assistant":
                raise RequestError(f"{name}.reasoning_content is only allowed in assistant "
                                   "messages", "messages")
            msg["reasoning_content"] = check_str(f"{name}.reasoning_content",
                                                 m["reasoning_content"])
        out.append(msg)
    return out


# Arguments of ``apply_chat_template`` that the server sets itself (how it renders), or that
# would run a client's template; a client may not pass them through chat_template_kwargs.
_SERVER_TEMPLATE_ARGS = {"tools": "pass tools as the tools field",
                         "chat_template": "a request cannot bring its own template",
                         "conversation": "pass the conversation as messages"}
_TEMPLATE_ARGS_SET_BY_SERVER = ("tokenize", "return_dict", "return_tensors", "padding",
                                "truncation", "max_length", "return_assistant_tokens_mask",
                                "tokenizer_kwargs")
# Template switches read as booleans (SGLang and vLLM pass them to the template as given).
_BOOL_TEMPLATE_ARGS = ("add_generation_prompt", "continue_final_message", "enable_thinking")


def chat_template_kwargs(kwargs: Any, add_generation_prompt: bool = True) -> dict[str, Any]:
    """The checked ``chat_template_kwargs`` (extra variables of the chat template), with
    ``add_generation_prompt`` (``/tokenize``'s top-level field, else true) unless they set it:
    the keyword arguments of ``apply_chat_template`` besides ``tokenize``. ``RequestError``
    naming ``chat_template_kwargs.KEY`` for an argument the server sets itself, a switch that
    is not a boolean, or ``continue_final_message`` together with ``add_generation_prompt``."""
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    for key, value in kwargs.items():
        name = f"chat_template_kwargs.{key}"
        if key in _SERVER_TEMPLATE_ARGS:
            raise RequestError(f"{name}: {_SERVER_TEMPLATE_ARGS[key]}", name)
        if key in _TEMPLATE_ARGS_SET_BY_SERVER:
            raise RequestError(f"{name}: set by the server, not by a request", name)
        if key in _BOOL_TEMPLATE_ARGS:
            check_bool(name, value)
    kwargs = {"add_generation_prompt": add_generation_prompt, **kwargs}
    if kwargs.get("continue_final_message") and kwargs["add_generation_prompt"]:
        name = "chat_template_kwargs.continue_final_message"
        raise RequestError(f"{name}: continuing the final message needs add_generation_prompt "
                           "false", name)
    return kwargs


def parse_chat_request(body: Any, ctx: ServingContext) -> OpenAIRequest:
    """Validate a ``/v1/chat/completions`` body and apply the chat template
    (``apply_chat_template``; ``add_generation_prompt`` true unless ``chat_template_kwargs``
    says otherwise). Raises ``RequestError``."""
    body = checked_body(body, _CHAT_FIELDS, _OPENAI_DEFAULT_ONLY, "/v1/chat/completions")
    model = check_model(body, ctx)
    _check_bookkeeping(body)
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    messages = chat_messages(body["messages"])
    kwargs = chat_template_kwargs(body.get("chat_template_kwargs", {}))
    chat_tools = tool_api.parse_tools(body, ctx.tool_call_parser)
    try:
        prompt_text = tool_api.render_prompt(ctx.tokenizer, messages, chat_tools, kwargs)
    except Exception as e:  # jinja errors, a missing template, bad kwargs
        raise RequestError(f"messages: the chat template failed: {e}", "messages") from None
    if not isinstance(prompt_text, str) or not prompt_text:
        raise RequestError("messages: the chat template produced an empty prompt", "messages")
    ids = encode_prompt(ctx, prompt_text, add_special_tokens=False, param="messages")
    if not ids:
        raise RequestError("messages: the prompt is empty", "messages")
    check_prompt_length("messages", ids, ctx)

    stream = check_bool("stream", body.get("stream", False))
    include_usage = _stream_options(body, stream)
    want_lp = check_bool("logprobs", body.get("logprobs", False))
    top = body.get("top_logprobs")
    if top is not None:
        top = check_int("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if not want_lp and top > 0:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if want_lp else None
    if "max_completion_tokens" in body:
        max_tokens, mt_name = body["max_completion_tokens"], "max_completion_tokens"
    else:
        max_tokens, mt_name = body.get("max_tokens"), "max_tokens"
    sp = _openai_sampling(body, ctx, max_tokens, mt_name)
    check_max_new_tokens(mt_name, sp, len(ids), ctx, "messages")
    grammar = _response_format(body)
    tool_grammar = chat_tools.grammar_spec() if chat_tools is not None else None
    if tool_grammar is not None:
        if grammar is not None:
            raise RequestError(f"response_format {body['response_format']['type']!r} cannot be "
                               f"combined with tool_choice {body.get('tool_choice')!r}: the "
                               "answer must be a tool call", "response_format")
        grammar = tool_grammar
    sp = dataclasses.replace(sp, grammar=grammar)
    check_grammar(sp.grammar, ctx)
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
    separate = check_bool("separate_reasoning", body.get("separate_reasoning", True))
    stream_reasoning = check_bool("stream_reasoning", body.get("stream_reasoning", True))
    reasoning = ctx.reasoning_parser if separate else None
    if chat_tools is None and reasoning is None:
        return None
    return ChatOutputConfig(tools=chat_tools, reasoning_parser=reasoning,
                            prompt_text=prompt_text[-256:], stream_reasoning=stream_reasoning)
