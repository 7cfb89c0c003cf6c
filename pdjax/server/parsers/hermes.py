"""Hermes / Qwen2.5 / Qwen3 tool calls: JSON objects between ``<tool_call>`` tags.

    Let me check.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}
    \\n</tool_call>

Several calls are several blocks. Text before the first block is content. A block whose object
closes without ``</tool_call>`` (the output ended, or other text follows) still counts: models
often stop right after the object. ``--tool-call-parser hermes`` (also ``qwen25``, SGLang's
name for the same form).
"""

from __future__ import annotations

from pdjax.server.parsers.base import CallFormat, ToolCallParser

_TEXT, _CALL, _AFTER = range(3)


class HermesToolCallParser(ToolCallParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = _TEXT

    def call_format(self) -> CallFormat:
        return CallFormat(begin=self.start_marker + "\n", end="\n" + self.end_marker,
                          separator="\n")

    def _in_text(self) -> bool:
        return self._state == _TEXT

    def _char(self, ch: str) -> None:
        if self._state == _CALL:
            if self._push_call(ch) == "error":
                self._state = _TEXT
                self._char(ch)
            elif self._asm is None:
                self._state, self._hold = _AFTER, ""
            return
        if self._state == _AFTER:
            self._hold += ch
            stripped = self._hold.lstrip()
            if self.end_marker.startswith(stripped):
                if stripped == self.end_marker:
                    self._state, self._hold = _TEXT, ""
                return
            # Something else follows the call: read it as text (whitespace is dropped).
            self._state, rest, self._hold = _TEXT, stripped, ""
            for c in rest:
                self._char(c)
            return
        if self._text_char(ch, self.start_marker):
            self._begin_block(self.start_marker)
            self._begin_call()
            self._state = _CALL

    def _end(self) -> None:
        if self._state == _CALL:
            self._abandon_call()
        elif self._state == _TEXT and self._hold:
            self._content(self._hold)
        elif self._state == _AFTER and self._hold.strip():
            self._content(self._hold.strip())
        self._hold = ""
        self._state = _TEXT


class Qwen25ToolCallParser(HermesToolCallParser):
    name = "qwen25"
