"""Chat output, parsed: reasoning, content and tool calls of one choice, streamed or whole.

    model text --ThinkReasoningParser--> reasoning_content
                        '--------------> content --ToolCallParser--> content, tool_calls

One ``ChoiceOutput`` per choice (parsers keep streaming state). Streaming returns OpenAI
``delta`` objects: ``{"reasoning_content": ...}``, ``{"content": ...}``, a call's first delta
``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`` and then
``{"tool_calls": [{"index", "function": {"arguments": piece}}]}``. The whole answer is the
``message`` object. ``finish_reason`` becomes ``tool_calls`` when a call was made and the
model stopped by itself.

Also the native side: ``NativeReasoning`` splits ``/generate`` text for ``separate_reasoning``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdjax.server.parsers import (ArgsEvent, CallStartEvent, ContentEvent,
                                  create_reasoning_parser)
from pdjax.server.tools import ChatTools


@dataclasses.dataclass(frozen=True)
class ChatOutputConfig:
    """How a chat request's output is parsed. ``reasoning_parser``: None (off, or
    ``separate_reasoning: false``); ``prompt_text`` decides whether the output starts inside a
    think block; ``stream_reasoning=False`` sends the reasoning as one delta when it ends."""

    tools: ChatTools | None = None
    reasoning_parser: str | None = None
    prompt_text: str = ""
    stream_reasoning: bool = True

    def new_choice(self) -> "ChoiceOutput":
        return ChoiceOutput(self)


class ChoiceOutput:
    """The parsers of one choice. ``stream(text, finished)`` -> delta objects;
    ``message(text)`` -> the whole ``message`` (use one or the other per instance)."""

    def __init__(self, cfg: ChatOutputConfig) -> None:
        self.cfg = cfg
        prefix = cfg.tools.forced_prefix() if cfg.tools is not None else ""
        # A forced call (opening in the prompt, or a grammar of calls only) leaves no room for
        # thinking first.
        forced = cfg.tools is not None and cfg.tools.choice != "auto"
        self.reasoning = (create_reasoning_parser(cfg.reasoning_parser, cfg.prompt_text)
                          if cfg.reasoning_parser and not forced else None)
        self.tool_parser = cfg.tools.new_parser() if cfg.tools is not None else None
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []
        self._held_reasoning: list[str] = []
        self._num_calls = 0
        self._deltas: list[dict[str, Any]] = []
        if prefix:
            self._content(prefix)        # the prompt wrote it; it is part of this output

    # -- streaming -------------------------------------------------------------------------------
    def stream(self, text: str, finished: bool) -> list[dict[str, Any]]:
        self._feed(text)
        if finished:
            self._finish()
        out, self._deltas = self._deltas, []
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason given the engine's (``stop`` -> ``tool_calls`` after a call)."""
        return "tool_calls" if reason == "stop" and self._num_calls else reason

    # -- whole -------------------------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed ``message``: content, ``reasoning_content`` (with a reasoning
        parser), ``tool_calls`` (complete calls only; a broken call is content)."""
        self._feed(text)
        self._finish()
        msg: dict[str, Any] = {"role": "assistant"}
        calls = []
        if self.tool_parser is not None:
            content, parsed = self.tool_parser.result()
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed]
        else:
            content = "".join(self.content_text)
        self._num_calls = len(calls)
        msg["content"] = None if calls and not content else content
        if self.cfg.reasoning_parser is not None:
            msg["reasoning_content"] = "".join(self.reasoning_text) or None
        msg["tool_calls"] = calls or None
        return msg

    # -- internals ---------------------------------------------------------------------------------
    def _feed(self, text: str) -> None:
        if self.reasoning is None:
            self._content(text)
            return
        reasoning, content = self.reasoning.feed(text)
        self._reason(reasoning)
        self._content(content)

    def _finish(self) -> None:
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            self._reason(reasoning)
            self._content(content)
        self._release_reasoning()
        if self.tool_parser is not None:
            self._tool_events(self.tool_parser.finish())

    def _reason(self, text: str) -> None:
        if not text:
            return
        self.reasoning_text.append(text)
        if self.cfg.stream_reasoning:
            self._delta("reasoning_content", text)
        else:
            self._held_reasoning.append(text)

    def _release_reasoning(self) -> None:
        if self._held_reasoning:
            self._deltas.append({"reasoning_content": "".join(self._held_reasoning)})
            self._held_reasoning = []

    def _content(self, text: str) -> None:
        if not text:
            return
        self._release_reasoning()
        if self.tool_parser is None:
            self.content_text.append(text)
            self._delta("content", text)
        else:
            self._tool_events(self.tool_parser.feed(text))

    def _tool_events(self, events) -> None:
        for e in events:
            if isinstance(e, ContentEvent):
                self.content_text.append(e.text)
                self._delta("content", e.text)
            elif isinstance(e, CallStartEvent):
                self._num_calls += 1
                self._deltas.append({"tool_calls": [{
                    "index": e.index, "id": e.id, "type": "function",
                    "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ArgsEvent):
                last = self._deltas[-1] if self._deltas else None
                calls = last.get("tool_calls") if last else None
                if (calls and "id" not in calls[0] and calls[0]["index"] == e.index):
                    calls[0]["function"]["arguments"] += e.text
                else:
                    self._deltas.append({"tool_calls": [
                        {"index": e.index, "function": {"arguments": e.text}}]})

    def _delta(self, key: str, text: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and set(last) == {key}:
            last[key] += text
        else:
            self._deltas.append({key: text})


class NativeReasoning:
    """``separate_reasoning`` on ``/generate``: the sample's text so far, split into
    ``reasoning_text`` and ``text`` (the answer), fed increment by increment."""

    def __init__(self, parser_name: str, prompt_text: str) -> None:
        self.parser = create_reasoning_parser(parser_name, prompt_text)
        self.reasoning = ""
        self.text = ""
        self._fed = 0
        self._finished = False

    def update(self, full_text: str, finished: bool) -> None:
        """Feed the part of the cumulative ``full_text`` not seen yet."""
        if self._finished:
            return
        self._finished = finished
        reasoning, content = self.parser.feed(full_text[self._fed:])
        self._fed = len(full_text)
        if finished:
            r2, c2 = self.parser.finish()
            reasoning, content = reasoning + r2, content + c2
        self.reasoning += reasoning
        self.text += content

    def apply(self, out: dict[str, Any]) -> dict[str, Any]:
        out["text"] = self.text
        out["reasoning_text"] = self.reasoning
        return out


def separate_reasoning_text(parser_name: str, text: str) -> tuple[str, str]:
    """SGLang's ``/separate_reasoning``: ``(reasoning_text, text)`` of a finished output."""
    parser = create_reasoning_parser(parser_name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
