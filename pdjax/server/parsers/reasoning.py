"""Reasoning parsers: the ``<think>…</think>`` part of the output goes to ``reasoning_content``.

    <think>\\nThe user wants 2+2.\\n</think>\\n\\nIt is 4.   ->  reasoning "The user wants 2+2.",
                                                             content   "It is 4."

``deepseek-r1``: the output starts in reasoning whether or not it opens with ``<think>``
(DeepSeek-R1's chat template writes ``<think>`` into the prompt), up to ``</think>``.
``qwen3``: the output is reasoning only when it opens with ``<think>``, or when the prompt ends
inside an open ``<think>`` (thinking-only templates); with ``enable_thinking: false`` the
template closes the think block in the prompt and everything is content. These follow SGLang's
``--reasoning-parser`` semantics (docs: advanced_features/separate_reasoning).

Whitespace that only pads the think block (after ``<think>``, before ``</think>``, and between
``</think>`` and the answer) is dropped. ``feed`` returns ``(reasoning, content)`` pieces.
"""

from __future__ import annotations

from pdjax.server.parsers.base import release_before_marker

_START, _REASONING, _CONTENT = range(3)


class ThinkReasoningParser:
    """Splits ``<think>`` reasoning from content while the text streams.

    ``starts_in_reasoning``: the output begins inside the think block (the prompt opened it).
    """

    name = "think"
    think_start = "<think>"
    think_end = "</think>"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._forced = starts_in_reasoning
        self._state = _START
        self._hold = ""
        self._ws = ""                 # reasoning's trailing whitespace, not yet sent
        self._reasoning_started = False
        self._strip_content = False   # the answer after </think>: drop its leading whitespace

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        """Does the prompt leave a think block open (the template wrote ``<think>``)?"""
        return prompt_text.rfind(cls.think_start) > prompt_text.rfind(cls.think_end)

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a piece of output; returns the ``(reasoning, content)`` it releases."""
        reasoning: list[str] = []
        content: list[str] = []
        i = 0
        while i < len(text):
            if self._state == _CONTENT:           # after </think>: the rest is the answer
                self._emit_content(text[i:], content)
                break
            if self._state == _REASONING and not self._hold:
                j = text.find("<", i)             # no marker can start before the next "<"
                j = len(text) if j < 0 else j
                if j > i:
                    self._reason(text[i:j], reasoning)
                    i = j
                    continue
            self._char(text[i], reasoning, content)
            i += 1
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: release what was held back (an unclosed think block is all
        reasoning)."""
        reasoning: list[str] = []
        content: list[str] = []
        hold, self._hold = self._hold, ""
        if self._state == _START:
            if self._forced:
                self._reason(hold.lstrip(), reasoning)
            else:
                self._emit_content(hold, content)
        elif self._state == _REASONING:
            self._reason(hold, reasoning)
        self._state = _CONTENT
        return "".join(reasoning), "".join(content)

    def _char(self, ch: str, reasoning: list[str], content: list[str]) -> None:
        if self._state == _CONTENT:
            self._emit_content(ch, content)
            return
        self._hold += ch
        if self._state == _START:
            stripped = self._hold.lstrip()
            if self.think_start.startswith(stripped):
                if stripped == self.think_start:
                    self._hold, self._state = "", _REASONING
                return
            hold, self._hold = self._hold, ""
            if self._forced:
                self._state = _REASONING
                for c in hold.lstrip():
                    self._char(c, reasoning, content)
            else:
                self._state = _CONTENT
                self._emit_content(hold, content)
            return
        safe, self._hold = release_before_marker(self._hold, self.think_end)
        if safe:
            self._reason(safe, reasoning)
        if self._hold == self.think_end:
            self._hold, self._ws, self._state = "", "", _CONTENT
            self._strip_content = True

    def _reason(self, text: str, out: list[str]) -> None:
        s = self._ws + text
        if not self._reasoning_started:
            s = s.lstrip()
            if not s:
                self._ws = ""
                return
            self._reasoning_started = True
        body = s.rstrip()
        self._ws = s[len(body):]
        out.append(body)

    def _emit_content(self, text: str, out: list[str]) -> None:
        if self._strip_content:
            text = text.lstrip()
            if not text:
                return
            self._strip_content = False
        out.append(text)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """Always starts in reasoning (the template opened ``<think>``; R1-0528 writes it again)."""

    name = "deepseek-r1"

    def __init__(self, starts_in_reasoning: bool = True) -> None:
        super().__init__(starts_in_reasoning=True)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Reasoning only when the output opens ``<think>`` or the prompt left one open."""

    name = "qwen3"
