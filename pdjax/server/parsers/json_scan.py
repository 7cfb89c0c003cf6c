"""A JSON validator that reads one character at a time (RFC 8259), for streamed tool calls.

A tool-call parser must decide, while the model is still writing, whether the text so far can
still become a valid call: it streams a call's arguments only while they are a valid JSON
prefix, and turns a block back into plain content when it is not. ``JsonScanner`` answers that
question per character and reports where the members of the top-level object begin and end,
so the parser can take the ``name`` and the raw ``arguments`` text without re-parsing.

Pure Python; a call is a few hundred characters, so a per-character loop is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')    # string characters with no special meaning
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_WS = frozenset(" \t\n\r")
_ESCAPES = frozenset('"\\/bfnrt')

# States (what the next character may be).
_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _OBJ_NEXT, _ARR_FIRST, _ARR_NEXT = range(7)
_STRING, _ESCAPE, _UNICODE, _NUMBER_TOK, _LITERAL, _DONE = range(7, 13)


@dataclasses.dataclass
class Member:
    """A member of the top-level object: ``key`` (decoded) and its value's span in the
    scanned text, ``[start, end)`` in characters; ``end`` is None while the value is open."""

    key: str
    start: int
    end: int | None = None


class JsonScanner:
    """Validates one JSON value, a character at a time.

    ``push(ch)`` returns False at the first character that no valid JSON text can have at
    that point (the scanner then stays failed); ``done`` turns True when the top-level value
    is complete (for a number: at the first character after it); only whitespace may follow.
    ``members`` lists the top-level object's members as they appear. ``pos`` counts the
    characters accepted.
    """

    def __init__(self) -> None:
        self.stack: list[str] = []        # "{" / "[" per open container
        self.state = _VALUE
        self.pos = 0
        self.failed = False
        self.members: list[Member] = []
        self._is_key = False
        self._token: list[str] = []       # the current key (raw) or number
        self._literal = ""                # the rest of true / false / null
        self._unicode_left = 0

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def push(self, ch: str) -> bool:
        if self.state == _DONE and ch in _WS and not self.failed:
            self.pos += 1
            return True
        if self.failed or self.state == _DONE:
            self.failed = True
            return False
        if not self._step(ch):
            self.failed = True
            return False
        self.pos += 1
        return True

    def push_string_run(self, text: str, i: int) -> int:
        """Inside a string, accept the run of plain characters at ``text[i:]`` in one go (a
        fast path for long arguments); returns how many (0 outside a string)."""
        if self.state != _STRING or self.failed:
            return 0
        m = _STRING_RUN.match(text, i)
        if m is None:
            return 0
        n = m.end() - i
        if self._is_key:
            self._token.append(m.group())
        self.pos += n
        return n

    # -- internals ---------------------------------------------------------------------------
    def _value_end(self, end: int) -> None:
        """The value that ends at ``end`` (exclusive) is complete."""
        depth = len(self.stack)
        if depth == 1 and self.stack[0] == "{" and self.members and self.members[-1].end is None:
            self.members[-1].end = end
        if not self.stack:
            self.state = _DONE
        else:
            self.state = _OBJ_NEXT if self.stack[-1] == "{" else _ARR_NEXT

    def _value_start(self) -> None:
        if len(self.stack) == 1 and self.stack[0] == "{" and self.members:
            self.members[-1].start = self.pos

    def _step(self, ch: str) -> bool:
        st = self.state
        if st == _STRING:
            if ch == '"':
                if self._is_key:
                    self._token.append(ch)
                    self._end_key()
                    self.state = _COLON
                else:
                    self._value_end(self.pos + 1)
                return True
            if ch == "\\":
                self.state = _ESCAPE
            elif ord(ch) < 0x20:
                return False
            if self._is_key:
                self._token.append(ch)
            return True
        if st == _ESCAPE:
            if ch == "u":
                self.state, self._unicode_left = _UNICODE, 4
            elif ch in _ESCAPES:
                self.state = _STRING
            else:
                return False
            if self._is_key:
                self._token.append(ch)
            return True
        if st == _UNICODE:
            if ch not in _HEX:
                return False
            self._unicode_left -= 1
            if self._unicode_left == 0:
                self.state = _STRING
            if self._is_key:
                self._token.append(ch)
            return True
        if st == _NUMBER_TOK:
            if ch in _NUMBER_CHARS:
                self._token.append(ch)
                return True
            if not _NUMBER.match("".join(self._token)):
                return False
            self._value_end(self.pos)
            return self._step(ch)          # the delimiter belongs to what follows
        if st == _LITERAL:
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_end(self.pos + 1)
            return True
        if ch in _WS:
            return True
        if st in (_VALUE, _ARR_FIRST):
            if st == _ARR_FIRST and ch == "]":
                self.stack.pop()
                self._value_end(self.pos + 1)
                return True
            return self._start_value(ch)
        if st in (_OBJ_FIRST, _OBJ_KEY):
            if ch == '"':
                self.state, self._is_key, self._token = _STRING, True, [ch]
                return True
            if st == _OBJ_FIRST and ch == "}":
                self.stack.pop()
                self._value_end(self.pos + 1)
                return True
            return False
        if st == _COLON:
            if ch != ":":
                return False
            self.state = _VALUE
            return True
        if st in (_OBJ_NEXT, _ARR_NEXT):
            close = "}" if st == _OBJ_NEXT else "]"
            if ch == ",":
                self.state = _OBJ_KEY if st == _OBJ_NEXT else _VALUE
                return True
            if ch == close:
                self.stack.pop()
                self._value_end(self.pos + 1)
                return True
            return False
        return False

    def _start_value(self, ch: str) -> bool:
        self._value_start()
        if ch == "{":
            self.stack.append("{")
            self.state = _OBJ_FIRST
        elif ch == "[":
            self.stack.append("[")
            self.state = _ARR_FIRST
        elif ch == '"':
            self.state, self._is_key = _STRING, False
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self.state, self._token = _NUMBER_TOK, [ch]
        elif ch in "tfn":
            self.state = _LITERAL
            self._literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
        else:
            return False
        return True

    def _end_key(self) -> None:
        if len(self.stack) == 1 and self.stack[0] == "{":
            self.members.append(Member(key=json.loads("".join(self._token)), start=-1))
        self._is_key = False
        self._token = []
