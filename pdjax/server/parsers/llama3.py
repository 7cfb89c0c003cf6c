"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A call is a JSON object at the start of the output, or after ``<|python_tag|>`` (a special
token: it is in the text only with ``skip_special_tokens=false``); more calls follow after
``;``. ``"arguments"`` is accepted for ``"parameters"``. An object that is not a call of one of
the request's tools (say, a JSON answer) is content. ``--tool-call-parser llama3``.
"""

from __future__ import annotations

from pdjax.server.parsers.base import CallFormat, ToolCallParser

_START, _TEXT, _PRECALL, _CALL, _AFTER = range(5)


class Llama3ToolCallParser(ToolCallParser):
    name = "llama3"
    arguments_keys = ("parameters", "arguments")
    python_tag = "<|python_tag|>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = _START

    def call_format(self) -> CallFormat:
        return CallFormat(begin="", end="", separator="; ", arguments_key="parameters")

    def _in_text(self) -> bool:
        return self._state == _TEXT

    def _char(self, ch: str) -> None:
        st = self._state
        if st == _START:
            if ch in " \t\n\r":
                self._hold += ch
                return
            self._state = _TEXT
            if ch == "{":
                self._ws, self._hold = self._hold, ""
                self._begin_block("")
                self._begin_call()
                self._state = _CALL
                self._char(ch)
                return
            held, self._hold = self._hold, ""
            self._content(held)
            self._char(ch)
            return
        if st == _PRECALL:
            if ch in " \t\n\r":
                self._block.append(ch)
                return
            self._begin_call()
            self._state = _CALL
            if ch != "{":
                self._fallback()
                self._state = _TEXT
            self._char(ch)
            return
        if st == _CALL:
            if self._push_call(ch) == "error":
                self._state = _TEXT
                self._char(ch)
            elif self._asm is None:
                self._state = _AFTER
            return
        if st == _AFTER:
            if ch in " \t\n\r":
                return
            if ch == ";":
                self._begin_block("")
                self._block.append(ch)
                self._state = _PRECALL
                return
            self._state = _TEXT
        if self._text_char(ch, self.python_tag):
            self._begin_block(self.python_tag)
            self._state = _PRECALL

    def _end(self) -> None:
        if self._state in (_CALL, _PRECALL):
            if self._asm is None:
                self._begin_call()
            self._abandon_call()
        elif self._hold:
            self._content(self._hold)
        self._hold = ""
        self._state = _TEXT
