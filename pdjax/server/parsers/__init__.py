"""Output parsers of the chat API: tool calls (``--tool-call-parser``) and reasoning
(``--reasoning-parser``), one module per model family behind these two registries (SGLang's
parser names). Pure Python.

    tool calls:  hermes, qwen25  -> hermes.py   (<tool_call>{json}</tool_call>)
                 llama3          -> llama3.py   ({"name": ..., "parameters": ...})
    reasoning:   deepseek-r1, qwen3 -> reasoning.py (<think>...</think>)
"""

from __future__ import annotations

from typing import Any, Sequence

from pdjax.server.parsers.base import (ArgsEvent, CallFormat, CallStartEvent, ContentEvent,
                                       Event, ToolCall, ToolCallParser)
from pdjax.server.parsers.hermes import HermesToolCallParser, Qwen25ToolCallParser
from pdjax.server.parsers.llama3 import Llama3ToolCallParser
from pdjax.server.parsers.reasoning import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                            ThinkReasoningParser)

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesToolCallParser, Qwen25ToolCallParser, Llama3ToolCallParser)}
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def create_tool_call_parser(name: str, tools: Sequence[dict[str, Any]] = (),
                            max_calls: int | None = None) -> ToolCallParser:
    """A fresh parser (one per choice: it holds streaming state). ``ValueError`` naming
    ``tool_call_parser`` for an unknown name."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_CALL_PARSERS[name](tools, max_calls=max_calls)


def create_reasoning_parser(name: str, prompt_text: str = "") -> ThinkReasoningParser:
    """A fresh reasoning parser for an output that follows ``prompt_text`` (its tail tells
    whether the template opened a think block). ``ValueError`` naming ``reasoning_parser``."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}")
    cls = REASONING_PARSERS[name]
    return cls(starts_in_reasoning=cls.starts_in_reasoning(prompt_text))


__all__ = ["ArgsEvent", "CallFormat", "CallStartEvent", "ContentEvent", "Event", "ToolCall",
           "ToolCallParser", "ThinkReasoningParser", "TOOL_CALL_PARSERS", "REASONING_PARSERS",
           "create_tool_call_parser", "create_reasoning_parser"]
