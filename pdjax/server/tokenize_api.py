"""``/tokenize`` and ``/detokenize``: the served tokenizer over HTTP, with vLLM's request and
response shapes, so that a client can find token ids (for ``logit_bias``, stop tokens, prompt
budgets) without loading the tokenizer itself.

``POST /tokenize`` takes either ``{"prompt": str, "add_special_tokens": true}`` or
``{"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {...},
"add_special_tokens": false}`` (the chat template applied as ``/v1/chat/completions`` does),
plus ``"model"`` and ``"return_token_strs": false``, and answers
``{"count", "max_model_len", "tokens", "token_strs"?}``. ``POST /detokenize`` takes
``{"tokens": [int], "model"}`` and answers ``{"prompt": str}``. Bad input is a
``RequestError`` naming the field (HTTP 400); nothing reaches the engine.
"""

from __future__ import annotations

from typing import Any

from pdjax.server.errors import RequestError
from pdjax.server.openai_api import chat_messages, chat_template_kwargs, check_model
from pdjax.server.validation import (ServingContext, check_bool, check_token_ids, checked_body,
                                     encode_prompt)

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                    "chat_template_kwargs", "return_token_strs"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(body: Any, ctx: ServingContext) -> dict[str, Any]:
    """The ``/tokenize`` response for ``body`` (module docstring). Raises ``RequestError``."""
    body = checked_body(body, _TOKENIZE_FIELDS, {}, "/tokenize")
    check_model(body, ctx)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("give exactly one of prompt and messages", "prompt")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string", "prompt")
        for field in ("add_generation_prompt", "chat_template_kwargs"):
            if field in body:
                raise RequestError(f"{field} applies to messages only", field)
        special = check_bool("add_special_tokens", body.get("add_special_tokens", True))
        ids = encode_prompt(ctx, prompt, add_special_tokens=special, limit_to_context=False)
    else:
        ids = _tokenize_chat(body, ctx)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.context_length,
                           "tokens": ids}
    if check_bool("return_token_strs", body.get("return_token_strs", False)):
        out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
    return out


def _tokenize_chat(body: dict[str, Any], ctx: ServingContext) -> list[int]:
    messages = chat_messages(body["messages"])
    generation_prompt = check_bool("add_generation_prompt", body.get("add_generation_prompt", True))
    kwargs = chat_template_kwargs(body.get("chat_template_kwargs", {}), generation_prompt)
    try:
        text = ctx.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja errors, a missing template, bad kwargs
        raise RequestError(f"messages: the chat template failed: {e}", "messages") from None
    special = check_bool("add_special_tokens", body.get("add_special_tokens", False))
    return encode_prompt(ctx, text, add_special_tokens=special, param="messages",
                         limit_to_context=False)


def detokenize(body: Any, ctx: ServingContext) -> dict[str, Any]:
    """The ``/detokenize`` response: ``{"prompt": text}`` of ``tokens`` (each in
    ``[0, vocab_size)``). Raises ``RequestError`` naming ``tokens``."""
    body = checked_body(body, _DETOKENIZE_FIELDS, {}, "/detokenize")
    check_model(body, ctx)
    tokens = body.get("tokens")
    if tokens == []:
        return {"prompt": ""}
    return {"prompt": ctx.tokenizer.decode(check_token_ids("tokens", tokens, ctx))}
