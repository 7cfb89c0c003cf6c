"""Incremental detokenization with stop strings (DESIGN.md §1).

Per request: token ids go in as they are sampled, text deltas come out. Two things are held
back until they are settled:

  * a broken UTF-8 character: byte-level BPE splits a multi-byte character over several tokens,
    and decoding a partial character yields U+FFFD; text is released only once the decoded tail
    no longer ends in U+FFFD (or at the end of the request);
  * a possible stop string: the longest tail of the unreleased text that is a prefix of some
    stop string waits for the next token. When a stop string matches, the text is cut before
    it, and the request finishes (``pdjax.output.OutputAccumulator``);
  * a possible ``stop_regex`` match: the text from the first place where a match could still
    start (a partial match reaching the end of the text, the ``regex`` module's
    ``partial=True``) waits; a complete match cuts the text before it, as a stop string does.

Like the stop tokens, stop strings and regexes end nothing on the first ``min_new_tokens``
output tokens (vLLM's ``min_tokens`` rule): they are searched once more tokens are out.

Decoding uses a sliding window of ids (``prefix_offset`` .. end) so that tokenizers whose
decode depends on the neighbours (SentencePiece leading spaces) give the same text as one
full decode:

    ids:   [ ... | prefix_offset ........ read_offset ........ end ]
                   '-- decoded before --'  '-- new tokens --'
    new text = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Pure Python over a ``transformers`` tokenizer (``decode``, ``convert_ids_to_tokens``); the
server and the offline engine both use it, so it sits below both (DESIGN.md §1 "Layers").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from pdjax.request import compile_stop_regex

REPLACEMENT_CHAR = "\ufffd"
# A stop_regex search slower than this (a pathological pattern) fails the request rather than
# stall the thread that detokenizes every request.
STOP_REGEX_TIMEOUT_S = 1.0
# Prompt tokens decoded as left context, so that the first output token decodes as it would
# inside the full sequence.
NUM_CONTEXT_TOKENS = 5


@dataclasses.dataclass
class DetokenizerDelta:
    """What one ``add_tokens`` call released.

    ``text``: newly released text (may be empty). ``num_tokens``: how many of the given ids
    were consumed; fewer than given when a stop string matched (the ids after the one that
    completed the match are dropped). ``stop_matched``: the stop string that matched, or None.
    """

    text: str
    num_tokens: int
    stop_matched: str | None = None


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one request.

    Args:
      tokenizer: a ``transformers`` tokenizer (``decode(ids, skip_special_tokens=...)``).
      stop: stop strings; none of their characters is ever released, and the text is cut
        before the first one that appears.
      skip_special_tokens: passed to ``decode``.
      prompt_ids: the prompt, whose last ``NUM_CONTEXT_TOKENS`` ids are decoded as context
        (never released).
      stop_regex: regular expressions; the text is cut before the first match (what may
        still become one is held back), ``stop_matched`` is the pattern.
      min_new_tokens: stop strings and regexes are searched only once more output tokens
        than this are consumed.

    Raises ``ValueError`` when a stop string is empty or not a string, or naming
    ``stop_regex`` for a pattern that does not compile; ``add_tokens`` and ``finish`` raise
    ``ValueError`` naming ``stop_regex`` for a search over ``STOP_REGEX_TIMEOUT_S``.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] | None = None, stop_regex: Sequence[str] = (),
                 min_new_tokens: int = 0) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self._max_stop_len = max((len(s) for s in stop), default=0)
        stop_regex = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or ())
        self._regexes = [(p, compile_stop_regex(p)) for p in stop_regex]
        self.min_new_tokens = min_new_tokens
        context = list(prompt_ids or [])[-NUM_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)     # context + output ids, decode window source
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self._decoded = ""       # settled text (no trailing partial character)
        self._released = 0       # chars of _decoded handed out
        self.stop_matched: str | None = None
        self.finished = False

    # -- public ------------------------------------------------------------------------------
    @property
    def output_ids(self) -> list[int]:
        """The output ids consumed so far."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._decoded[:self._released]

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Consume new output ids; returns the text that is now safe to release.

        After a stop string matched (or ``finish``), further calls consume nothing.
        """
        if self.finished:
            return DetokenizerDelta("", 0, None)
        start = self._released
        consumed = 0
        for token_id in token_ids:
            consumed += 1
            self._ids.append(int(token_id))
            self._decode_step(final=False)
            if self._check_stop():
                return DetokenizerDelta(self._decoded[start:self._released], consumed,
                                        self.stop_matched)
            if not self._stops_armed:
                # Text settled before the stops arm is out of their reach (whatever the chunk
                # size): only a possible start of a later match stays held.
                self._release(hold_stop_prefix=True)
        self._release(hold_stop_prefix=True)
        return DetokenizerDelta(self._decoded[start:self._released], consumed, None)

    def finish(self) -> DetokenizerDelta:
        """End of the request: release everything held back (a trailing partial character
        decodes as U+FFFD), still cutting at a stop string. Idempotent."""
        if self.finished:
            return DetokenizerDelta("", 0, self.stop_matched)
        start = self._released
        self._decode_step(final=True)
        if not self._check_stop():
            self._release(hold_stop_prefix=False)
        self.finished = True
        return DetokenizerDelta(self._decoded[start:self._released], 0, self.stop_matched)

    # -- internals -----------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self, final: bool) -> None:
        """Move settled text from the window into ``_decoded``."""
        if self._read_offset >= len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if not final and (full_text.endswith(REPLACEMENT_CHAR)
                          or len(full_text) <= len(prefix_text)):
            # A partial character, or nothing visible yet (a skipped special token): keep the
            # window open and wait for more ids.
            return
        # The text up to read_offset is settled, so the new text is what the longer window adds.
        self._decoded += full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    @property
    def _stops_armed(self) -> bool:
        """Stop strings and regexes may end the request (past ``min_new_tokens`` tokens)."""
        return len(self._ids) - self._num_context > self.min_new_tokens

    def _search(self, pattern: str, compiled, partial: bool = False, pos: int | None = None):
        """``compiled.search`` over the decoded text from ``pos`` (default: the first unreleased
        character; the text before stays visible to anchors and lookbehinds)."""
        try:
            return compiled.search(self._decoded, self._released if pos is None else pos,
                                   partial=partial, timeout=STOP_REGEX_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(f"stop_regex: matching {pattern!r:.100} took over "
                             f"{STOP_REGEX_TIMEOUT_S:g} s") from None

    def _check_stop(self) -> bool:
        """Cut at the earliest stop string or ``stop_regex`` match in the unreleased text; True
        when one matched."""
        if not (self.stop or self._regexes) or not self._stops_armed:
            return False
        pending = self._decoded[self._released:]
        best_pos, best_stop = -1, None
        for s in self.stop:
            pos = pending.find(s)
            if pos >= 0 and (best_pos < 0 or pos < best_pos):
                best_pos, best_stop = pos, s
        for pattern, compiled in self._regexes:
            m = self._search(pattern, compiled)
            if m is not None and (best_pos < 0 or m.start() - self._released < best_pos):
                best_pos, best_stop = m.start() - self._released, pattern
        if best_stop is None:
            return False
        self._decoded = self._decoded[:self._released + best_pos]
        self._released = len(self._decoded)
        self.stop_matched = best_stop
        self.finished = True
        return True

    def _release(self, hold_stop_prefix: bool) -> None:
        hold = 0
        if hold_stop_prefix:
            hold = max(self._stop_prefix_len(self._decoded[self._released:]),
                       self._regex_hold_len())
        self._released = len(self._decoded) - hold

    def _regex_hold_len(self) -> int:
        """Characters at the end of the unreleased text from the first place a ``stop_regex``
        match could still start (the text so far ends inside a possible match)."""
        hold = 0
        for pattern, compiled in self._regexes:
            pos = self._released
            while pos <= len(self._decoded):
                m = self._search(pattern, compiled, partial=True, pos=pos)
                if m is None:
                    break
                if m.partial:
                    hold = max(hold, len(self._decoded) - m.start())
                    break
                pos = max(m.end(), m.start() + 1)   # a complete match before min_new_tokens
        return hold

    def _stop_prefix_len(self, pending: str) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of a stop string."""
        for k in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other bytes to
    code points from 256 upward, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenTexts:
    """Per-token text and raw bytes, for logprob responses (OpenAI ``token`` and ``bytes``).

    ``text(id)`` is ``tokenizer.decode([id])`` (a partial UTF-8 character shows as U+FFFD, as
    OpenAI does); ``token_bytes(id)`` recovers the token's real bytes for byte-level BPE and
    SentencePiece byte-fallback tokens, else the UTF-8 of its text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._text_cache: dict[int, str] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def text(self, token_id: int) -> str:
        t = self._text_cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._text_cache) < 1 << 18:
                self._text_cache[token_id] = t
        return t

    def token_bytes(self, token_id: int) -> list[int]:
        if token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self._byte_level and all(ch in _BYTE_DECODER for ch in piece):
                    return [_BYTE_DECODER[ch] for ch in piece]
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    try:
                        return [int(piece[3:5], 16)]
                    except ValueError:
                        pass
        return list(self.text(token_id).encode("utf-8"))
