"""The tool-call parser interface and the machinery its families share.

A parser reads the model's text as it streams (``feed``, then ``finish``) and emits events in
order::

    ContentEvent("Let me look.")                 text for ``message.content``
    CallStartEvent(0, "call_…", "get_weather")   a call begins: its id and function name
    ArgsEvent(0, '{"city": ')                    a piece of the call's ``arguments`` text
    ArgsEvent(0, '"Paris"}')

The arguments are the model's own text of the ``arguments`` value, so the pieces concatenate
to the final ``arguments`` string. A block that cannot be a call (not JSON, no ``name``, a
function that is not among the request's tools) goes back into the content, character for
character. ``result()`` gives the non-streamed answer: the content and the complete calls; a
call that broke after its name was already streamed (or was cut off by ``max_tokens``) is
content there. The streamed answer cannot take back what it sent: such a call stays a call
with the arguments streamed so far, and the text from the fault on is content.

Each family (``hermes.py``, ``llama3.py``) frames calls differently; the JSON call object inside
is read by ``CallAssembler``. ``call_format()`` describes the framing and the JSON schema of a
valid call so that grammar-constrained decoding (structured outputs) can later enforce
``tool_choice="required"`` or a named function.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from typing import Any, Sequence

from pdjax.server.parsers.json_scan import JsonScanner


@dataclasses.dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStartEvent:
    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class ArgsEvent:
    index: int
    text: str


Event = ContentEvent | CallStartEvent | ArgsEvent


@dataclasses.dataclass
class ToolCall:
    """One call as the parser read it. ``arguments``: the raw JSON text of the arguments
    object; ``raw``: the block's full text (the fallback content); ``complete``: the JSON call
    object closed and validated."""

    index: int
    id: str
    name: str
    arguments: str = ""
    raw: str = ""
    complete: bool = False

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "index": self.index,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """How a family writes calls, for a grammar: each call is ``begin + <call object> + end``,
    calls are joined by ``separator``; the call object is JSON with ``name_key`` and
    ``arguments_key``. ``schema(tool)`` is the JSON schema of one call object."""

    begin: str
    end: str
    separator: str
    name_key: str = "name"
    arguments_key: str = "arguments"

    def schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        return {"type": "object",
                "properties": {self.name_key: {"const": fn["name"]}, self.arguments_key: params},
                "required": [self.name_key, self.arguments_key], "additionalProperties": False}

    def lark_grammar(self, schemas: Sequence[dict[str, Any]], max_calls: int | None) -> str:
        """A Lark grammar (llguidance's dialect, ``%json`` for the call object) of an output
        that is only calls: one call matching one of ``schemas`` (``max_calls=1``) or several
        joined by ``separator``. The call object is JSON as ``json.dumps`` writes it (``", "``
        and ``": "``, no other whitespace), so a model cannot pad a call until ``max_tokens``."""
        body = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": list(schemas)}
        body["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "}
        call = " ".join(p for p in (json.dumps(self.begin) if self.begin else "", "body",
                                    json.dumps(self.end) if self.end else "") if p)
        start = "call" if max_calls == 1 else f"call ({json.dumps(self.separator)} call)*"
        return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(body)}\n"


def release_before_marker(hold: str, marker: str) -> tuple[str, str]:
    """Split held-back text into the part that cannot begin ``marker`` (safe to send on) and
    the rest: a possible partial marker, or the whole marker.

    ``release_before_marker("ab <to", "<tool_call>") == ("ab ", "<to")``.
    """
    cut = 0
    while cut < len(hold) and not marker.startswith(hold[cut:]):
        nxt = hold.find(marker[0], cut + 1)
        cut = len(hold) if nxt < 0 else nxt
    return hold[:cut], hold[cut:]


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class CallAssembler:
    """Reads one JSON call object, a character at a time.

    The object needs a string ``name`` that is one of ``tool_names`` (any name when that is
    empty) and, optionally, an object under one of ``arguments_keys`` (absent: ``{}``).
    ``push`` returns ``"ok"``, ``"done"`` (the object closed and is a valid call) or
    ``"error"``; the header (name) is ready once the name is known and the arguments object
    has begun (or the object closed), so an error found before that point costs nothing.
    """

    def __init__(self, tool_names: frozenset[str], arguments_keys: Sequence[str]) -> None:
        self.scanner = JsonScanner()
        self.tool_names = tool_names
        self.arguments_keys = tuple(arguments_keys)
        self.raw: list[str] = []
        self.name: str | None = None
        self._args_member = None
        self._started = False

    def push(self, ch: str) -> str:
        if not self._started:
            if ch in " \t\n\r":
                self.raw.append(ch)
                return "ok"
            if ch != "{":
                return "error"
            self._started = True
        if not self.scanner.push(ch):
            return "error"
        self.raw.append(ch)
        if not self._check_members():
            return "error"
        if self.scanner.done:
            return "done" if self.name is not None else "error"
        return "ok"

    def push_run(self, text: str, i: int) -> int:
        """Accept the plain characters of a string at ``text[i:]`` at once; returns how many
        (0: push them one by one). Member boundaries never fall inside such a run."""
        n = self.scanner.push_string_run(text, i) if self._started else 0
        if n:
            self.raw.extend(text[i:i + n])
        return n

    def _check_members(self) -> bool:
        for m in self.scanner.members:
            if m.key == "name" and m.end is not None and self.name is None:
                offset = self._offset()
                try:
                    value = json.loads("".join(self.raw[offset + m.start:offset + m.end]))
                except ValueError:
                    return False
                if not isinstance(value, str) or (self.tool_names and value not in self.tool_names):
                    return False
                self.name = value
            elif m.key in self.arguments_keys and m.start >= 0:
                if self._args_member is None:
                    self._args_member = m
                    if self.raw[self._offset() + m.start] != "{":
                        return False
                elif self._args_member is not m:
                    return False          # two arguments members: ambiguous
        return True

    def _offset(self) -> int:
        """Leading whitespace before the object is kept in ``raw`` but not in the scanner."""
        return len(self.raw) - self.scanner.pos

    @property
    def header_ready(self) -> bool:
        return self.name is not None and (self._args_member is not None or self.scanner.done)

    def arguments_text(self, skip: int = 0) -> str:
        """The arguments text read so far (``{}`` when the closed object had none), less its
        first ``skip`` characters (what was already streamed)."""
        m = self._args_member
        if m is None:
            return "{}"[skip:] if self.scanner.done else ""
        offset = self._offset()
        end = len(self.raw) if m.end is None else offset + m.end
        return "".join(self.raw[offset + m.start + skip:end])


class ToolCallParser(abc.ABC):
    """Base of the per-family parsers: streaming state, whitespace around calls, results.

    ``tools``: the request's OpenAI tool objects (names checked against them).
    ``max_calls``: calls past this many are read but dropped (``parallel_tool_calls=false``).
    Whitespace that only separates content from a call (or calls from each other) is dropped;
    with no call in the output, the content is the model's text exactly.
    """

    name: str = ""
    arguments_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tools: Sequence[dict[str, Any]] = (), max_calls: int | None = None) -> None:
        self.tool_names = frozenset(t["function"]["name"] for t in tools)
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._events: list[Event] = []
        self._segments: list[list[str] | ToolCall] = []   # content runs (pieces) and calls
        self._ws = ""               # trailing content whitespace not yet sent
        self._after_call = False    # drop the whitespace that follows a complete call
        self._asm: CallAssembler | None = None
        self._call: ToolCall | None = None
        self._block: list[str] = []   # the current block's text (its fallback content)
        self._sent_args = 0
        self._num_seen = 0            # calls started, dropped ones included
        self._hold = ""               # text held back: a possible partial marker

    # -- interface -----------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        """Consume a piece of output text; returns the events it completes."""
        i = 0
        while i < len(text):
            n = self._plain_run(text, i)
            if n:
                self._content(text[i:i + n])
                i += n
            elif self._asm is not None and (n := self._asm.push_run(text, i)):
                self._block.append(text[i:i + n])
                self._stream_args()
                i += n
            else:
                self._char(text[i])
                i += 1
        return self._take()

    def finish(self) -> list[Event]:
        """The output ended: flush what was held back."""
        self._end()
        ws, self._ws = self._ws, ""
        if ws and not self._after_call:
            self._content(ws, hold_ws=False)
        return self._take()

    def result(self) -> tuple[str, list[ToolCall]]:
        """After ``finish``: the non-streamed content and complete calls (OpenAI's
        ``message.content`` / ``tool_calls``); broken calls are content here."""
        parts, calls = [], []
        for seg in self._segments:
            if isinstance(seg, list):
                parts.extend(seg)
            elif seg.complete:
                calls.append(seg)
            else:
                parts.append(seg.raw)
        calls = calls if self.max_calls is None else calls[:self.max_calls]
        for i, c in enumerate(calls):
            c.index = i
        return "".join(parts), calls

    @abc.abstractmethod
    def call_format(self) -> CallFormat:
        """The family's framing, for grammar-constrained decoding and prompt forcing."""

    def forced_prefix(self, function_name: str | None) -> str:
        """Text that opens a call (of ``function_name`` when given): appended to the prompt
        for ``tool_choice="required"`` or a named function, and fed to the parser first."""
        fmt = self.call_format()
        if function_name is None:
            return f'{fmt.begin}{{"{fmt.name_key}": "'
        name = json.dumps(function_name)
        return f'{fmt.begin}{{"{fmt.name_key}": {name}, "{fmt.arguments_key}": '

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """Instructions for a chat template that does not render ``tools`` itself."""
        fmt = self.call_format()
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        example = (f'{fmt.begin}{{"{fmt.name_key}": <function-name>, "{fmt.arguments_key}": '
                   f'<args-json-object>}}{fmt.end}')
        return ("You may call one or more functions to help with the user's request. The "
                f"functions, as JSON signatures:\n{listing}\nTo call a function, answer with "
                f"one call per function, each as:\n{example}")

    # -- for the families ----------------------------------------------------------------------
    @abc.abstractmethod
    def _char(self, ch: str) -> None:
        """Consume one character (the family's framing state machine)."""

    def _end(self) -> None:
        """Flush the family's held text at the end of the output."""
        if self._asm is not None:
            self._abandon_call()

    @abc.abstractmethod
    def _in_text(self) -> bool:
        """Is the family's state machine reading plain text (outside any call)?"""

    def _plain_run(self, text: str, i: int) -> int:
        """How many characters from ``text[i]`` on are plain content for sure (no marker can
        start there; a fast path past ``_char``); 0: read ``text[i]`` with ``_char``."""
        if not self._in_text() or self._hold:
            return 0
        j = text.find("<", i)
        return (len(text) if j < 0 else j) - i

    def _text_char(self, ch: str, marker: str) -> bool:
        """Text state: hold ``ch`` back while it may begin ``marker``, send the rest as
        content; True when the held text is the whole marker (consumed)."""
        safe, self._hold = release_before_marker(self._hold + ch, marker)
        if safe:
            self._content(safe)
        if self._hold == marker:
            self._hold = ""
            return True
        return False

    def _take(self) -> list[Event]:
        """The pending events, neighbours of one kind (and call) merged."""
        groups: list[tuple[Event, list[str]]] = []
        for e in self._events:
            last = groups[-1][0] if groups else None
            if isinstance(e, ContentEvent) and isinstance(last, ContentEvent):
                groups[-1][1].append(e.text)
            elif isinstance(e, ArgsEvent) and isinstance(last, ArgsEvent) and last.index == e.index:
                groups[-1][1].append(e.text)
            elif isinstance(e, CallStartEvent):
                groups.append((e, []))
            else:
                groups.append((e, [e.text]))
        self._events = []
        return [e if isinstance(e, CallStartEvent) else dataclasses.replace(e, text="".join(t))
                for e, t in groups]

    def _content(self, text: str, hold_ws: bool = True) -> None:
        """Send content, keeping trailing whitespace back until it is known whether a call
        follows; whitespace right after a complete call is dropped."""
        s = self._ws + text
        if self._after_call:
            s = s.lstrip()
            if not s:
                self._ws = ""
                return
            self._after_call = False
        body = s.rstrip() if hold_ws else s
        self._ws = s[len(body):]
        if body:
            self._events.append(ContentEvent(body))
            if self._segments and isinstance(self._segments[-1], list):
                self._segments[-1].append(body)
            else:
                self._segments.append([body])

    def _begin_block(self, opening: str) -> None:
        """A block that may hold a call begins with ``opening`` (a marker, or nothing)."""
        self._block = [self._ws, opening]
        self._ws = ""

    def _begin_call(self) -> None:
        self._asm = CallAssembler(self.tool_names, self.arguments_keys)
        self._call = None
        self._sent_args = 0

    def _push_call(self, ch: str) -> str:
        """Feed the current call object; returns the assembler's status. On ``"error"`` the
        character is NOT consumed: the family re-reads it as content."""
        asm = self._asm
        status = asm.push(ch)
        if status == "error":
            if self._call is None:
                self._fallback()
            else:
                self._break_call()
            return status
        self._block.append(ch)
        if self._call is None and asm.header_ready:
            index = self._num_seen
            self._num_seen += 1
            self._call = ToolCall(index=index, id=new_call_id(), name=asm.name)
            if self._visible(self._call):
                self._events.append(CallStartEvent(index, self._call.id, self._call.name))
        self._stream_args()
        if status == "done":
            call = self._call
            call.arguments = asm.arguments_text()
            call.raw = "".join(self._block)
            call.complete = True
            self._segments.append(call)
            self._asm, self._call = None, None
            self._after_call = True
        return status

    def _stream_args(self) -> None:
        """Send the arguments text read since the last piece (once the header is out)."""
        if self._call is None:
            return
        new = self._asm.arguments_text(self._sent_args)
        if new:
            if self._visible(self._call):
                self._events.append(ArgsEvent(self._call.index, new))
            self._sent_args += len(new)

    def _visible(self, call: ToolCall) -> bool:
        return self.max_calls is None or call.index < self.max_calls

    def _fallback(self) -> None:
        """The block is not a call and nothing of it was sent as a call: it is content."""
        text = "".join(self._block)
        self._asm, self._call, self._block = None, None, []
        self._content(text)

    def _break_call(self) -> None:
        """The call broke after its name was sent: it stays a call in the stream; the
        non-streamed answer shows its block as content."""
        call = self._call
        call.arguments = self._asm.arguments_text()
        call.raw = "".join(self._block)
        self._segments.append(call)
        self._asm, self._call, self._block = None, None, []

    def _abandon_call(self) -> None:
        """The output ended inside a call."""
        if self._call is None:
            self._fallback()
        else:
            self._break_call()
