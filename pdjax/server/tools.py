"""Tool calling on ``/v1/chat/completions``, request side: ``tools``, ``tool_choice``,
``parallel_tool_calls``, tool messages, and the prompt that renders the tools.

The chat template renders the tools (``apply_chat_template(..., tools=...)``). A template that
ignores them (its prompt is the same with and without) gets the parser's instructions as a
system message instead, so the model still sees the functions. ``tool_choice="required"`` or a
named function is enforced: ``ChatTools.grammar_spec`` is the grammar of exactly the calls the
choice allows, and the engine decodes under it (structured outputs, ``pdjax.constrained``), so
the answer is always a parseable call whose arguments validate; with no ``--tool-call-parser``
the calls are bare JSON objects (``GRAMMAR_CALL_PARSER``), as vLLM serves them. Without
enforcement
(``enforced=False``, parser tests) the start of a call is appended to the prompt instead
(``ToolCallParser.forced_prefix``): the model continues inside a call, which steers only.

Every bad field raises ``RequestError`` (HTTP 400) naming it, as in ``validation``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pdjax.constrained.grammar import GrammarSpec
from pdjax.server.errors import RequestError
from pdjax.server.parsers import ToolCallParser, create_tool_call_parser

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
# Without ``--tool-call-parser``, ``required`` and a named function are still served, as vLLM
# serves them (structured outputs over the tools' schemas; only ``auto`` needs a parser): the
# grammar then writes bare JSON call objects, ``{"name": ..., "parameters": {...}}`` joined by
# ``"; "`` (Llama 3.1's JSON tool format, the nearest to vLLM's ``[{"name", "parameters"}]``),
# and this parser reads them back: the grammar fixes the format, so nothing is guessed.
GRAMMAR_CALL_PARSER = "llama3"
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
TOOL_CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ChatTools:
    """A request's validated tools. ``choice``: ``auto``, ``required`` or ``function``
    (``function_name`` set); ``none`` never builds one. ``max_calls``: 1 when
    ``parallel_tool_calls`` is false, else None. ``enforced``: ``required`` / a named function
    is decoded under ``grammar_spec()`` (the server's way), so no call opening goes into the
    prompt."""

    tools: list[dict[str, Any]]
    choice: str
    function_name: str | None
    max_calls: int | None
    parser_name: str
    enforced: bool = False

    def new_parser(self) -> ToolCallParser:
        return create_tool_call_parser(self.parser_name, self.tools, self.max_calls)

    def forced_prefix(self) -> str:
        """The call opening appended to the prompt ("" for ``auto`` and when enforced)."""
        if self.choice == "auto" or self.enforced:
            return ""
        name = self.function_name
        if name is None and len(self.tools) == 1:
            name = self.tools[0]["function"]["name"]
        return self.new_parser().forced_prefix(name)

    def call_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the calls the choice allows, in the parser's call format (for a
        grammar backend: a call is ``begin + <object matching one schema> + end``)."""
        fmt = self.new_parser().call_format()
        allowed = [t for t in self.tools
                   if self.function_name is None or t["function"]["name"] == self.function_name]
        return [fmt.schema(t) for t in allowed]

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar that enforces ``required`` (one or more calls; one without
        ``parallel_tool_calls``) or a named function (one call of it), for the structured
        outputs backend (``pdjax.constrained``); None for ``auto``. With it, the forced
        prompt opening is not needed: the grammar covers the whole answer."""
        if self.choice == "auto":
            return None
        max_calls = 1 if self.function_name is not None else self.max_calls
        grammar = self.new_parser().call_format().lark_grammar(self.call_schemas(), max_calls)
        return GrammarSpec("lark", grammar, field="tool_choice")


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    name = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise RequestError(f"{name} must be an object", "tools")
    for key in tool:
        if key not in _TOOL_KEYS:
            raise RequestError(f"{name}.{key} is not supported", "tools")
    if tool.get("type") != "function":
        raise RequestError(f"{name}.type must be 'function', got {tool.get('type')!r}", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{name}.function must be an object", "tools")
    fn = {k: v for k, v in fn.items() if v is not None}
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise RequestError(f"{name}.function.{key} is not supported", "tools")
    fname = fn.get("name")
    if not isinstance(fname, str) or not _NAME.match(fname):
        raise RequestError(f"{name}.function.name must be 1 to 64 letters, digits, '_' or "
                           f"'-', got {fname!r}", "tools")
    if "description" in fn and not isinstance(fn["description"], str):
        raise RequestError(f"{name}.function.description must be a string", "tools")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise RequestError(f"{name}.function.parameters must be a JSON schema object", "tools")
    if "strict" in fn and not isinstance(fn["strict"], bool):
        raise RequestError(f"{name}.function.strict must be a boolean", "tools")
    return {"type": "function", "function": fn}


def parse_tools(body: dict[str, Any], tool_call_parser: str | None) -> ChatTools | None:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (null fields already
    removed). None when no tool may be called (no tools, or ``tool_choice="none"``).
    ``tool_call_parser``: the server's ``--tool-call-parser``; ``auto`` (the default with
    tools) needs one, ``required`` and a named function do not (``GRAMMAR_CALL_PARSER``).
    Raises ``RequestError`` naming the field."""
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    tools = [_check_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools: function names must be distinct", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {parallel!r}",
                           "parallel_tool_calls")
    choice = body.get("tool_choice", "auto" if tools else "none")
    function_name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (choice.get("type") != "function" or set(choice) - {"type", "function"}
                or not isinstance(fn, dict) or set(fn) != {"name"}
                or not isinstance(fn["name"], str)):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                               '"function", "function": {"name": NAME}}', "tool_choice")
        function_name = fn["name"]
        if function_name not in names:
            raise RequestError(f"tool_choice names function {function_name!r}, which is not "
                               "in tools", "tool_choice")
        choice = "function"
    elif choice not in TOOL_CHOICES:
        raise RequestError(f'tool_choice must be "none", "auto", "required" or a named '
                           f"function, got {choice!r}", "tool_choice")
    if choice == "none":
        return None
    if not tools:
        raise RequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
    if tool_call_parser is None and choice == "auto":
        raise RequestError('tool_choice "auto" needs a tool-call parser: start the server '
                           'with --tool-call-parser (hermes, qwen25 or llama3), or ask for '
                           '"required" or a named function', "tool_choice")
    return ChatTools(tools=tools, choice=choice, function_name=function_name,
                     max_calls=None if parallel else 1,
                     parser_name=tool_call_parser or GRAMMAR_CALL_PARSER,
                     enforced=choice != "auto")


def message_tool_fields(m: dict[str, Any], role: str, name: str) -> dict[str, Any]:
    """The tool fields of chat message ``m`` for the template: a ``tool`` message's
    ``tool_call_id``; an assistant message's ``tool_calls`` with ``arguments`` decoded to an
    object (HF templates write them with ``tojson``)."""
    out: dict[str, Any] = {}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError(f"{name}.tool_call_id must be a non-empty string", "messages")
        out["tool_call_id"] = call_id
    elif "tool_call_id" in m:
        raise RequestError(f"{name}.tool_call_id is only allowed in tool messages", "messages")
    if "tool_calls" in m:
        if role != "assistant":
            raise RequestError(f"{name}.tool_calls is only allowed in assistant messages",
                               "messages")
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{name}.tool_calls must be a list", "messages")
        out["tool_calls"] = [_message_call(f"{name}.tool_calls[{j}]", c)
                             for j, c in enumerate(calls)]
    return out


def _message_call(name: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError(f"{name} must be an object with a function", "messages")
    if call.get("type", "function") != "function":
        raise RequestError(f"{name}.type must be 'function'", "messages")
    fn = call["function"]
    fname = fn.get("name")
    if not isinstance(fname, str) or not fname:
        raise RequestError(f"{name}.function.name must be a non-empty string", "messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise RequestError(f"{name}.function.arguments must be a JSON string", "messages")
    try:
        decoded = json.loads(args) if args.strip() else {}
    except (ValueError, RecursionError):
        raise RequestError(f"{name}.function.arguments is not valid JSON", "messages") from None
    out = {"type": "function", "function": {"name": fname, "arguments": decoded}}
    if "id" in call:
        if not isinstance(call["id"], str):
            raise RequestError(f"{name}.id must be a string", "messages")
        out["id"] = call["id"]
    return out


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], chat_tools: ChatTools | None,
                  template_kwargs: dict[str, Any]) -> str:
    """The prompt text: the chat template with the tools (or, where the template ignores
    them, with the parser's instructions as a system message), plus the forced call opening.
    ``template_kwargs``: the request's ``chat_template_kwargs`` (``add_generation_prompt``
    defaults to true). Template errors propagate (the caller turns them into a 400)."""
    template_kwargs = {"add_generation_prompt": True, **template_kwargs}

    def render(msgs, **extra):
        return tokenizer.apply_chat_template(msgs, tokenize=False, **template_kwargs, **extra)

    plain = render(messages)
    if chat_tools is None:
        return plain
    text = render(messages, tools=chat_tools.tools)
    if text == plain:
        instructions = chat_tools.new_parser().system_prompt(chat_tools.tools)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=f"{messages[0]['content']}\n\n{instructions}")
            msgs = [first] + messages[1:]
        else:
            msgs = [{"role": "system", "content": instructions}] + messages
        text = render(msgs)
    return text + chat_tools.forced_prefix()
