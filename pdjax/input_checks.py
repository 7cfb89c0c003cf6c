"""Checks of what one generate request carries, shared by the HTTP parsers
(``server/validation.py`` turns each ``ValueError`` into a 400 whose ``param`` is the field)
and the offline ``Engine`` (which raises it as is), so that both refuse the same inputs
(DESIGN.md §4). Every message starts with the field's name. Pure Python.

The token budget of one request (vLLM's rule)::

    |<------------------ context_length ------------------->|
    |<--- prompt_len --->|<--- max_new_tokens --->|  (unused) |

``prompt_len`` must stay below ``context_length`` (at least one token to generate), and an
explicit ``max_new_tokens`` must fit in what is left; the default is cut to fit instead.
"""

from __future__ import annotations

import numbers
from typing import Any

from pdjax.request import INT32_MAX

MAX_TOP_LOGPROBS = 20      # top logprobs per token (OpenAI's limit; the sampler's fixed width)


def describe(value: Any) -> str:
    """``"<type> <repr>"``, at most 80 characters (for messages about a wrong value)."""
    return f"{type(value).__name__} {value!r}"[:80]


def is_token_id(t: Any) -> bool:
    """An integer (a Python or numpy int), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def check_token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    """``ids`` as a list of Python ints: a non-empty list (or tuple) of token ids in
    ``[0, vocab_size)`` (the tokenizer's vocabulary: an id past it has no text, even where the
    model's embedding table is larger). ``ValueError`` naming ``name`` or ``name[pos]``."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name}: a list of token ids, got {describe(ids)}")
    if not ids:
        raise ValueError(f"{name}: the prompt is empty (it needs at least one token)")
    for pos, t in enumerate(ids):
        if not is_token_id(t):
            raise ValueError(f"{name}[{pos}]: a token id must be an integer, got {describe(t)}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{pos}]: token id {t} is outside [0, {vocab_size}), the "
                             f"vocabulary")
    return [int(t) for t in ids]


def check_prompt_length(name: str, prompt_len: int, context_length: int) -> None:
    """``ValueError`` naming ``name`` for a prompt of ``context_length`` tokens or more (no
    room left for one new token)."""
    if prompt_len >= context_length:
        raise ValueError(f"{name}: the prompt has {prompt_len} tokens, at or over the model's "
                         f"context length of {context_length} tokens")


def check_max_new_tokens(name: str, max_new_tokens: int | None, prompt_len: int,
                         context_length: int, prompt_name: str = "prompt") -> None:
    """``ValueError`` naming ``name`` (``max_tokens``, ``max_new_tokens``, ...) when the
    prompt's ``prompt_len`` tokens plus ``max_new_tokens`` exceed ``context_length`` (vLLM
    answers 400 with the same numbers). None (up to the context length) always passes."""
    if max_new_tokens is None:
        return
    total = prompt_len + max_new_tokens
    if total > context_length:
        raise ValueError(
            f"{name}: this model's maximum context length is {context_length} tokens. However, "
            f"you requested {total} tokens ({prompt_len} in the {prompt_name}, {max_new_tokens} "
            f"in the completion). Please reduce the length of the {prompt_name} or {name}.")


def default_max_new_tokens(max_new_tokens: int | None, prompt_len: int,
                           context_length: int) -> int | None:
    """A default ``max_new_tokens`` (the client did not set it) cut to what the context leaves
    after the prompt, as SGLang does (at least 1)."""
    left = max(1, context_length - prompt_len)
    if max_new_tokens is None or max_new_tokens <= left:
        return max_new_tokens
    return left


def check_bool(name: str, v: Any) -> bool:
    """``v`` if a bool, else ``ValueError`` naming ``name``."""
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a boolean, got {describe(v)}")
    return v


def check_int(name: str, v: Any, lo: int, hi: int) -> int:
    """``v`` if an integer (not a bool) in ``[lo, hi]``, else ``ValueError`` naming ``name``."""
    if not is_token_id(v):
        raise ValueError(f"{name} must be an integer, got {describe(v)}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def check_logprob_fields(return_logprob: Any, top_logprobs_num: Any, logprob_start_len: Any,
                         prompt_len: int) -> tuple[bool, int, int]:
    """SGLang's logprob fields checked: ``(return_logprob, top_logprobs_num,
    logprob_start_len)``; ``top_logprobs_num`` in ``[0, MAX_TOP_LOGPROBS]``,
    ``logprob_start_len`` -1 (no prompt logprobs) or a prompt position in
    ``[0, prompt_len)``. ``ValueError`` naming the field."""
    check_bool("return_logprob", return_logprob)
    top = check_int("top_logprobs_num", top_logprobs_num, 0, MAX_TOP_LOGPROBS)
    start = check_int("logprob_start_len", logprob_start_len, -1, INT32_MAX)
    if start >= prompt_len:
        raise ValueError(f"logprob_start_len = {start} must be below the prompt length "
                         f"({prompt_len})")
    return return_logprob, top, start
