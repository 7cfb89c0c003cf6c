"""Grammars for structured outputs through llguidance (JSON schema, any JSON object, regex,
EBNF/GBNF or Lark), and the per-request matcher that turns a grammar state into a token
bitmask.

The bitmask of one row is ``[ceil(V / 32)]`` int32: token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is set (llguidance's layout, shared with xgrammar and vLLM)::

    word 0                word 1
    bit 0 1 2 ... 31      bit 0 1 ...
    tok 0 1 2 ... 31      tok 32 33 ...

The host advances each matcher by the token sampled for it and fills the mask of the next
step; the sampler applies it to the logits (``apply_bitmask``: numpy here, the device sampler
has its own). Grammar text compiles once per distinct spec (LRU cache); the tokenizer is
converted once per backend (about 1 s for a 50k vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import numpy as np

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark")
MAX_GRAMMAR_CHARS = 256 * 1024
# Tokens a new grammar is followed for when it compiles (``GrammarBackend._walk``): the lexer
# and parser limits of llguidance show at the first tokens of a too-large repetition.
WALK_TOKENS = 8
# Compact JSON (no free whitespace between tokens): what a client parses is the same, and a
# model cannot pad an answer with whitespace until max_tokens (vLLM's and SGLang's
# "disable any whitespace" setting).
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request is constrained to. ``kind`` in ``GRAMMAR_KINDS``; ``text`` is the JSON
    schema (a JSON string), the regex, or the grammar; ignored for ``json_object``. ``field``
    names the request field it came from, for error messages (e.g. ``response_format``)."""

    kind: str
    text: str = ""
    field: str = "grammar"

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"{self.field}: grammar kind must be one of {GRAMMAR_KINDS}, "
                             f"got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.field}: must be a string")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.field}: longer than {MAX_GRAMMAR_CHARS} characters")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Masked copy of ``logits [R, V]`` (or ``[V]``): disallowed tokens get ``-inf``.

    ``bitmask`` is ``[R, ceil(V/32)]`` (or ``[ceil(V/32)]``) int32 in the layout above. The
    numpy oracle of the device sampler's masking."""
    vocab = logits.shape[-1]
    bits = (bitmask[..., np.arange(vocab) // 32] >> (np.arange(vocab) % 32)) & 1
    return np.where(bits.astype(bool), logits, -np.inf).astype(logits.dtype)


def _compile_text(spec: GrammarSpec) -> str:
    """The llguidance grammar definition of ``spec``; ``ValueError`` naming the field."""
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec.field}: the JSON schema is not valid JSON ({e})") from None
            except RecursionError:
                raise ValueError(f"{spec.field}: the JSON schema is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{spec.field}: a JSON schema must be an object or a boolean")
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "ebnf":
            return grammar_from("ebnf", spec.text)
        return LLMatcher.grammar_from_lark(spec.text)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(spec.field) else f"{spec.field}: {msg}") from None
    except RecursionError:      # a grammar nested past what the compiler walks
        raise ValueError(f"{spec.field}: the grammar is nested too deeply") from None


class GrammarMatcher:
    """One request's grammar state (an ``llguidance.LLMatcher``). Not thread-safe: the engine
    thread alone drives it."""

    def __init__(self, matcher, spec: GrammarSpec, vocab_size: int):
        self._m = matcher
        self.spec = spec
        self.vocab_size = vocab_size

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out [ceil(V/32)]`` int32 (C-contiguous)."""
        if out.dtype != np.int32 or out.ndim != 1 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError("out must be a contiguous 1-D int32 array")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)

    def bitmask(self) -> np.ndarray:
        out = np.zeros(bitmask_words(self.vocab_size), np.int32)
        self.fill_bitmask(out)
        return out

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and the matcher is in error) if it was not allowed."""
        return bool(self._m.consume_token(int(token_id))) and not self._m.is_error()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (the request should stop)."""
        return bool(self._m.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarBackend:
    """Compiles ``GrammarSpec``s against one tokenizer and makes matchers.

    Args:
      tokenizer: a transformers fast tokenizer (the server's).
      vocab_size: the model's vocabulary (may exceed the tokenizer's; extra ids are never
        allowed).
      eos_token_ids: tokens that end a request; the grammar allows them when complete.
      cache_size: distinct grammars kept compiled.

    ``compile`` (and ``validate``) are safe to call from worker threads (the server runs them
    off the event loop); ``matcher`` is cheap once compiled.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=(), cache_size: int = 256):
        import llguidance.hf

        eos = sorted(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos[0] if eos and len(eos) == 1 else eos)
        self.vocab_size = vocab_size
        self._eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._compile = functools.lru_cache(maxsize=cache_size)(self._compile_uncached)

    def _compile_uncached(self, spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        grammar = _compile_text(spec)
        kind = spec.kind.replace('_', ' ')
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(f"{spec.field}: invalid {kind}: {messages[0]}")
        # A grammar can be valid and still admit no text (a schema that only refers to itself,
        # "root ::= root"): its first mask fails. Found here (once per grammar, cached), it is
        # the client's error, not a request that fails at its first token.
        m = LLMatcher(self._tokenizer, grammar, log_level=0)
        first = np.zeros(bitmask_words(self.vocab_size), np.int32)
        m.unsafe_compute_mask_ptr(first.ctypes.data, first.size * 4)
        if m.is_error() or not first.any():
            why = (m.get_error() or "").strip().splitlines()[:1] or ["no token is allowed"]
            raise ValueError(f"{spec.field}: the {kind} admits no text ({why[0][:200]})")
        self._walk(m, first, spec, kind)
        return grammar

    def _walk(self, m, mask: np.ndarray, spec: GrammarSpec, kind: str) -> None:
        """Follow the grammar for up to ``WALK_TOKENS`` tokens (the lowest allowed id each
        time) so that a grammar past llguidance's lexer or parser limits (``a{1000000}``: "too
        many expressions constructed") is refused now, naming its field, instead of failing
        its request at the first generated token. ``ValueError`` naming ``spec.field``."""
        for _ in range(WALK_TOKENS):
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            allowed = [int(t) for t in allowed[:64] if t < self.vocab_size
                       and t not in self._eos_token_ids]
            if not allowed or m.is_stopped():
                return
            m.consume_token(allowed[0])
            if m.is_error():
                why = (m.get_error() or "").strip().splitlines()[:1] or ["a limit was reached"]
                raise ValueError(f"{spec.field}: the {kind} is too complex to follow "
                                 f"({why[0][:200]})")
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.size * 4)
            if m.is_error():
                why = (m.get_error() or "").strip().splitlines()[:1] or ["a limit was reached"]
                raise ValueError(f"{spec.field}: the {kind} is too complex to follow "
                                 f"({why[0][:200]})")

    def compile(self, spec: GrammarSpec) -> str:
        """The checked grammar definition of ``spec`` (cached); ``ValueError`` naming
        ``spec.field`` when the schema, regex or grammar is invalid."""
        return self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer, self.compile(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"{spec.field}: {m.get_error()}")
        return GrammarMatcher(m, spec, self.vocab_size)

    def cache_info(self) -> Any:
        return self._compile.cache_info()
