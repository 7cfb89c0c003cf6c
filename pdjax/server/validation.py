"""Field checks and limits shared by every request parser and by the PD router (DESIGN.md §4).

Every check raises ``RequestError`` (HTTP 400) with a message that starts with the field's name.
The sample limits (``MAX_N``, ``MAX_BATCH_SIZE``, ``MAX_SAMPLES``) are checked before anything
is tokenized or allocated, by the servers (``check_batch_size``, ``check_num_samples``) and by
the router before it draws rooms (``checked_num_samples``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pdjax.input_checks as input_checks
from pdjax.constrained.grammar import GrammarSpec
from pdjax.request import INT32_MAX, SEED_LIMIT, SamplingParams
from pdjax.server.errors import RequestError

MAX_TOP_LOGPROBS = input_checks.MAX_TOP_LOGPROBS
MAX_ROOM = (1 << 63) - 1
# Limits checked before anything is tokenized or allocated (the PD router checks the same).
MAX_N = 64                   # sampling_params.n / n (SamplingParams checks it too)
MAX_BATCH_SIZE = 1024        # prompts in one request
MAX_SAMPLES = 1024           # prompts x n: one engine request (and one PD room) each
FAKE_BOOTSTRAP_HOST = "2.2.2.2"   # the servers' own PD warm-up / health probe; never a client's


@dataclasses.dataclass(frozen=True)
class ServingContext:
    """What parsing needs to know about the served model.

    ``context_length``: maximum tokens per sequence. ``vocab_size``: token ids must lie in
    ``[0, vocab_size)``. ``tool_call_parser`` / ``reasoning_parser``: the server's
    ``--tool-call-parser`` / ``--reasoning-parser`` (None: off). ``compile_grammar``: compiles
    (and caches) a ``GrammarSpec``, ``ValueError`` naming its field when invalid (None: the
    engine checks it when the request arrives).
    """

    tokenizer: Any
    served_model_name: str
    model_path: str
    context_length: int
    vocab_size: int
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    compile_grammar: Callable[[GrammarSpec], Any] | None = None

    def model_names(self) -> set[str]:
        return {self.served_model_name, self.model_path}


def is_int(v: Any) -> bool:
    """An integer, not a bool (JSON ``true`` is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_bool(name: str, v: Any) -> bool:
    """``v`` if a boolean, else ``RequestError`` naming ``name``."""
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` if an integer in ``[lo, hi]``, else ``RequestError`` naming ``name``. Every
    integer a request carries is read through here or ``SamplingParams.validate`` with both
    bounds explicit: an unbounded Python int must never reach a C long or an int32
    array. ``None`` leaves a side open for the callers that bound it themselves."""
    if not is_int(v):
        raise RequestError(f"{name} must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise RequestError(f"{name} must be in [{lo_s}, {hi_s}], got {v}", name)
    return v


def check_str(name: str, v: Any, allow_empty: bool = True) -> str:
    """``v`` if a string (non-empty unless ``allow_empty``), else ``RequestError``."""
    if not isinstance(v, str):
        raise RequestError(f"{name} must be a string, got {type(v).__name__}", name)
    if not allow_empty and not v:
        raise RequestError(f"{name} must not be empty", name)
    return v


def present_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The body without null-valued fields (null means "absent" everywhere)."""
    return {k: v for k, v in body.items() if v is not None}


def checked_body(body: Any, allowed: set[str], default_only: dict[str, Callable[[Any], bool]],
                 what: str) -> dict[str, Any]:
    """A request body: a JSON object, without its null fields, every field ``check_fields``'d."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = present_fields(body)
    check_fields(body, allowed, default_only, what)
    return body


def check_fields(body: dict[str, Any], allowed: set[str],
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


def check_token_ids(name: str, ids: Any, ctx: ServingContext) -> list[int]:
    """A non-empty list of token ids in ``[0, ctx.vocab_size)``, else ``RequestError`` naming
    ``name`` (``input_checks.check_token_ids``, the offline ``Engine``'s check too)."""
    try:
        return input_checks.check_token_ids(name, ids, ctx.vocab_size)
    except ValueError as e:
        raise RequestError(str(e), name) from None


def check_batch_size(name: str, batch: int) -> None:
    """``RequestError`` for more than ``MAX_BATCH_SIZE`` prompts."""
    if batch > MAX_BATCH_SIZE:
        raise RequestError(f"{name}: a batch of {batch} prompts exceeds the limit of "
                           f"{MAX_BATCH_SIZE}", name)


def check_num_samples(batch: int, n: int, name: str = "n") -> None:
    """``RequestError`` for more than ``MAX_SAMPLES`` samples (prompts x ``n``)."""
    if batch * n > MAX_SAMPLES:
        raise RequestError(f"{name}: {batch} prompt(s) x n = {n} is {batch * n} samples, over "
                           f"the limit of {MAX_SAMPLES} per request", name)


def check_prompt_length(name: str, ids: list[int], ctx: ServingContext) -> None:
    """``RequestError`` for a prompt of ``ctx.context_length`` tokens or more."""
    try:
        input_checks.check_prompt_length(name, len(ids), ctx.context_length)
    except ValueError as e:
        raise RequestError(str(e), name) from None


def check_max_new_tokens(name: str, sp: SamplingParams, prompt_len: int, ctx: ServingContext,
                         prompt_name: str = "prompt") -> None:
    """``RequestError`` naming ``name`` (``max_tokens``, ``max_new_tokens``, ...) when the
    prompt plus the ``max_new_tokens`` the client asked for exceed the context length
    (``input_checks.check_max_new_tokens``, vLLM's 400)."""
    try:
        input_checks.check_max_new_tokens(name, sp.max_new_tokens, prompt_len,
                                          ctx.context_length, prompt_name)
    except ValueError as e:
        raise RequestError(str(e), name) from None


_MAX_TOKEN_CHARS: dict[int, int] = {}      # id(tokenizer) -> its longest token, in characters


def max_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token in ``tokenizer``'s vocabulary (cached per tokenizer):
    a text of ``c`` characters has at least ``c / max_token_chars`` tokens (one character per
    byte in byte-level BPE vocabularies; byte-fallback and special tokens only raise it)."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        _MAX_TOKEN_CHARS[key] = max((len(t) for t in vocab), default=0)
    return _MAX_TOKEN_CHARS[key]


def encode_prompt(ctx: ServingContext, text: str, add_special_tokens: bool = True,
                  param: str = "prompt", limit_to_context: bool = True) -> list[int]:
    """Token ids of ``text``; text the tokenizer refuses (e.g. a lone UTF-16 surrogate from
    a JSON ``\\ud800`` escape) is the client's error: ``RequestError`` naming ``param``.

    ``limit_to_context``: a text too long for the context even at the longest token per
    piece (with a margin of 2 for normalizers) is refused before it is tokenized: a 50 MB
    prompt took 66 s to tokenize and left the server 16 GB larger, only to be refused."""
    longest = max_token_chars(ctx.tokenizer) if limit_to_context else 0
    if longest and len(text) > 2 * longest * ctx.context_length:
        raise RequestError(f"{param}: {len(text)} characters, at least "
                           f"{len(text) // (2 * longest)} tokens, far over the model's context "
                           f"length of {ctx.context_length} tokens", param)
    try:
        return list(ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # tokenizers raises TypeError / ValueError / its own exceptions
        raise RequestError(f"{param}: the text cannot be tokenized ({type(e).__name__}: {e})",
                           param) from None


def parse_sampling_params(d: dict[str, Any], ctx: ServingContext, param: str,
                          max_tokens_name: str = "max_new_tokens") -> SamplingParams:
    """``SamplingParams`` from a JSON object; ``RequestError`` naming the field (prefixed by
    ``param``; ``max_new_tokens`` called ``max_tokens_name``), also for a ``max_new_tokens``
    over the context length."""
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
    try:
        sp.check_vocab_ids(ctx.vocab_size)
    except ValueError as e:      # the message starts with the field's name
        raise RequestError(f"{param}: {e}" if param else str(e),
                           param or str(e).split(":")[0]) from None
    # Only what the client asked for is refused; the default is clamped per prompt
    # (``clamp_default_max_new``).
    if "max_new_tokens" in d and sp.max_new_tokens is not None \
            and sp.max_new_tokens > ctx.context_length:
        raise RequestError(
            f"{max_tokens_name} = {sp.max_new_tokens} exceeds the model's context length of "
            f"{ctx.context_length} tokens", max_tokens_name)
    return sp


def check_grammar(spec: GrammarSpec | None, ctx: ServingContext) -> None:
    """Compile ``spec`` now (the parsers run off the event loop; the backend caches it), so
    that a bad schema, regex or grammar is a 400 naming its field before anything reaches the
    engine."""
    if spec is None or ctx.compile_grammar is None:
        return
    try:
        ctx.compile_grammar(spec)
    except ValueError as e:
        msg = str(e)
        raise RequestError(msg if msg.startswith(spec.field) else f"{spec.field}: {msg}",
                           spec.field.split(".")[0]) from None


def clamp_default_max_new(sp: SamplingParams, prompt_len: int,
                          ctx: ServingContext) -> SamplingParams:
    """The default ``max_new_tokens`` (the client did not set it) cut to what the context
    leaves after the prompt, as SGLang does. Returns a copy. ``RequestError`` naming
    ``min_new_tokens`` when the cut leaves fewer tokens than it asks for."""
    max_new = input_checks.default_max_new_tokens(sp.max_new_tokens, prompt_len,
                                                  ctx.context_length)
    if max_new is not None and sp.min_new_tokens > max_new:
        raise RequestError(f"min_new_tokens = {sp.min_new_tokens} does not fit in the model's "
                           f"context length of {ctx.context_length} tokens after the prompt's "
                           f"{prompt_len} (at most {max_new})", "min_new_tokens")
    return sp if max_new == sp.max_new_tokens else dataclasses.replace(sp, max_new_tokens=max_new)


def sample_params(sp: SamplingParams, j: int) -> SamplingParams:
    """A private copy for sample ``j`` of a prompt (the engine may change its copy, e.g. the PD
    prefill role forces ``max_new_tokens=1``). With a ``seed``, sample ``j`` uses ``seed + j``
    so that the ``n`` samples differ while staying reproducible."""
    seed = sp.seed if sp.seed is None or j == 0 else (sp.seed + j) % SEED_LIMIT
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
    check_str(name, v, allow_empty=False)
    if v == FAKE_BOOTSTRAP_HOST:
        # The fake host makes a decode read pages nothing wrote.
        raise RequestError(f"{name}: {v} is reserved for the server's own warm-up and health "
                           f"probe", name)
    return v


def pd_fields(body: dict[str, Any], num: int) -> tuple[list, list, list]:
    """The PD fields (SGLang names) per sample: ``(hosts, ports, rooms)``, each ``num`` long.

    ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` are a scalar or one value per
    sample (a list in the sample order of the request kind). A scalar room ``r`` gives sample
    ``k`` room ``r + k`` (as SGLang does); a list must hold one distinct room per sample.
    """
    hosts = _per_sample("bootstrap_host", body.get("bootstrap_host"), num, _check_bootstrap_host)
    ports = _per_sample("bootstrap_port", body.get("bootstrap_port"), num,
                        lambda n, v: check_int(n, v, 1, 65535))
    rooms = _per_sample("bootstrap_room", body.get("bootstrap_room"), num,
                        lambda n, v: check_int(n, v, 0, MAX_ROOM), room=True)
    given = [r for r in rooms if r is not None]
    if len(set(given)) != len(given):
        raise RequestError("bootstrap_room must hold a distinct room per sample", "bootstrap_room")
    return hosts, ports, rooms


# ---------------------------------------------------------------------------------------------
# Sample counts before parsing (the PD router)
# ---------------------------------------------------------------------------------------------

def checked_num_samples(path: str, body: dict[str, Any]) -> int:
    """``num_samples``, refused before any room is drawn when it is over the servers' limits:
    ``RequestError`` (a ``ValueError``) naming the field for ``n`` above ``MAX_N``, a batch above
    ``MAX_BATCH_SIZE`` or more than ``MAX_SAMPLES`` samples in all."""
    if path == "/generate":
        sp = body.get("sampling_params")
        sps = sp if isinstance(sp, list) else [sp]
        ns = [d.get("n", 1) for d in sps[:MAX_BATCH_SIZE + 1] if isinstance(d, dict)]
        name, prompts = "sampling_params.n", body.get("text", body.get("input_ids"))
        batch_name = "text" if "text" in body else "input_ids"
        batch = len(prompts) if isinstance(prompts, list) and prompts and \
            (batch_name == "text" or isinstance(prompts[0], list)) else 1
    else:
        ns, name, batch_name = [body.get("n", 1)], "n", "prompt"
        prompt = body.get("prompt")
        batch = len(prompt) if path == "/v1/completions" and isinstance(prompt, list) \
            and prompt and not isinstance(prompt[0], int) else 1
    for n in ns:
        if is_int(n) and n > MAX_N:
            raise RequestError(f"{name}: n = {n} exceeds the limit of {MAX_N}", name)
    if batch > MAX_BATCH_SIZE:
        raise RequestError(f"{batch_name}: a batch of {batch} prompts exceeds the limit of "
                           f"{MAX_BATCH_SIZE}", batch_name)
    total = num_samples(path, body)
    if total > MAX_SAMPLES:
        raise RequestError(f"{name}: {total} samples exceed the limit of {MAX_SAMPLES} per "
                           "request", name)
    return total


def num_samples(path: str, body: dict[str, Any]) -> int:
    """How many samples (rooms) a request body asks for: prompts in the batch x ``n``."""
    if path == "/generate":
        sp = body.get("sampling_params") or {}
        n = sp.get("n", 1) if isinstance(sp, dict) else 1
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            batch = len(text)
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            batch = len(ids)
        else:
            batch = 1
    else:
        n = body.get("n", 1)
        prompt = body.get("prompt")
        if path == "/v1/completions" and isinstance(prompt, list) and prompt \
                and not isinstance(prompt[0], int):
            batch = len(prompt)
        else:
            batch = 1
    n = n if is_int(n) and n > 0 else 1
    return max(1, batch) * n
