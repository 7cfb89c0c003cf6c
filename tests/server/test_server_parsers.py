"""Tool-call and reasoning parsers (``pdjax.server.parsers``): whole and streamed outputs, the
stream cut at every character boundary, several calls, text before a call, malformed calls."""

import json

import pytest

from pdjax import config
from pdjax.server.chat_output import ChatOutputConfig
from pdjax.server.parsers import (REASONING_PARSERS, TOOL_CALL_PARSERS, ArgsEvent,
                                  CallStartEvent, ContentEvent, create_reasoning_parser,
                                  create_tool_call_parser)
from pdjax.server.parsers.json_scan import JsonScanner
from pdjax.server.tools import ChatTools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "add"}}]

HERMES_TWO = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris \\"centre\\" \\u00e9", "days": [1, 2.5e1, -3], "metric": true, '
              '"note": null}}\n</tool_call>\n<tool_call>\n{"arguments": {"a": 1, "b": {"c": []}}, '
              '"name": "add"}\n</tool_call>')
HERMES_TWO_CALLS = [
    ("get_weather", '{"city": "Paris \\"centre\\" \\u00e9", "days": [1, 2.5e1, -3], '
                    '"metric": true, "note": null}'),
    ("add", '{"a": 1, "b": {"c": []}}')]


def replay(parser, pieces):
    """Feed ``pieces`` and finish; returns (content, [(name, arguments)], events)."""
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStartEvent):
            assert e.index not in calls and e.id.startswith("call_") and len(e.id) == 29
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgsEvent):
            calls[e.index][1] += e.text          # a call's arguments come after its start
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], events


def whole(name, text, **kw):
    p = create_tool_call_parser(name, TOOLS, **kw)
    p.feed(text)
    p.finish()
    content, calls = p.result()
    return content, [(c.name, c.arguments) for c in calls]


def check_all_splits(name, text, content, calls, **kw):
    """Streamed in two pieces at every boundary, and one character at a time, the output
    reads as the whole: same content, same calls with the same arguments text."""
    assert whole(name, text, **kw) == (content, calls)
    for i in range(len(text) + 1):
        got = replay(create_tool_call_parser(name, TOOLS, **kw), [text[:i], text[i:]])[:2]
        assert got == (content, calls), i
    got = replay(create_tool_call_parser(name, TOOLS, **kw), list(text))[:2]
    assert got == (content, calls)


def test_registries_match_the_cli_choices():
    assert tuple(sorted(TOOL_CALL_PARSERS)) == config.TOOL_CALL_PARSERS
    assert tuple(sorted(REASONING_PARSERS)) == config.REASONING_PARSERS
    with pytest.raises(ValueError, match="tool_call_parser"):
        create_tool_call_parser("mistral")
    with pytest.raises(ValueError, match="tool_call_parser"):
        config.ServerArgs(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="reasoning_parser"):
        config.ServerArgs(reasoning_parser="r2")


@pytest.mark.parametrize("name", ["hermes", "qwen25"])
def test_hermes_two_calls_after_text_every_split(name):
    check_all_splits(name, HERMES_TWO, "Let me look that up.", HERMES_TWO_CALLS)
    for _, args in HERMES_TWO_CALLS:
        json.loads(args)
    # The header (id, name) of a call whose arguments come first waits for the name.
    _, _, events = replay(create_tool_call_parser(name, TOOLS), [HERMES_TWO])
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ContentEvent", "CallStartEvent", "ArgsEvent", "CallStartEvent",
                     "ArgsEvent"]


def test_hermes_streams_arguments_in_pieces():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    p = create_tool_call_parser("hermes", TOOLS)
    cut = text.index("Ro")
    first = p.feed(text[:cut])
    second = p.feed(text[cut:]) + p.finish()
    assert isinstance(first[0], CallStartEvent) and first[0].name == "get_weather"
    assert first[1:] == [ArgsEvent(0, '{"city": "')]
    assert second == [ArgsEvent(0, 'Rome"}')]


@pytest.mark.parametrize("text", [
    "Plain answer, no call.",
    "Trailing whitespace and a partial marker stay: <tool\n\n",
    "  leading spaces, a < sign and </tool_call> alone\n",
    "<tool_call>\nnot json at all\n</tool_call> and after",               # not JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',                  # no name
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',             # name not a string
    '<tool_call>\n{"name": "add", "arguments": "{}"}\n</tool_call>',       # arguments not an object
    'Cut short: <tool_call>\n{"name": "get_wea',                           # ended before the name
])
def test_hermes_non_calls_are_content_every_split(text):
    check_all_splits("hermes", text, text, [])


def test_hermes_malformed_after_the_name_whole_vs_stream():
    text = ('Before.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, }}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    # Whole: the broken block is content, character for character; the good call stands.
    content, calls = whole("hermes", text)
    assert content == 'Before.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, }}\n</tool_call>'
    assert calls == [("add", '{"a": 2}')]
    # Streamed: the name was sent; the call keeps the arguments sent so far and the rest of
    # the block is content.
    content, calls, _ = replay(create_tool_call_parser("hermes", TOOLS), list(text))
    assert calls == [("add", '{"a": 1, '), ("add", '{"a": 2}')]
    assert content == "Before.}}\n</tool_call>"


def test_hermes_output_cut_inside_the_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert whole("hermes", text) == (text, [])
    content, calls, _ = replay(create_tool_call_parser("hermes", TOOLS), [text])
    assert (content, calls) == ("", [("get_weather", '{"city": "Pa')])


def test_hermes_lenient_framing_and_no_arguments():
    # No closing tag at the end; an object without arguments is a call with {}.
    check_all_splits("hermes", '<tool_call>\n{"name": "add"}', "", [("add", "{}")])
    check_all_splits("hermes", '<tool_call>{"name": "add", "arguments": {}}\nDone.',
                     "Done.", [("add", "{}")])


def test_parallel_tool_calls_false_keeps_the_first_call():
    check_all_splits("hermes", HERMES_TWO, "Let me look that up.", HERMES_TWO_CALLS[:1],
                     max_calls=1)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('  {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", '
     '"arguments": {"a": 1}}', "", [("get_weather", '{"city": "Oslo"}'), ("add", '{"a": 1}')]),
    ('Sure, calling it.<|python_tag|>{"name": "add", "parameters": {"a": 3}}',
     "Sure, calling it.", [("add", '{"a": 3}')]),
    ('{"parameters": {"a": 5}, "name": "add"}', "", [("add", '{"a": 5}')]),
    ('{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),     # a JSON answer
    ('{"name": "Alice", "age": 3}', '{"name": "Alice", "age": 3}', []),     # not a tool name
    ("The answer is {\"name\": \"add\"}", "The answer is {\"name\": \"add\"}", []),  # mid-text
    ('<|python_tag|>not json', '<|python_tag|>not json', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_every_split(text, content, calls):
    check_all_splits("llama3", text, content, calls)


def test_call_format_schema_and_forced_prefix():
    tools = ChatTools(tools=TOOLS, choice="function", function_name="get_weather",
                      max_calls=None, parser_name="hermes")
    prefix = tools.forced_prefix()
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    schema, = tools.call_schemas()
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"]["required"] == ["city"]
    llama = create_tool_call_parser("llama3", TOOLS)
    assert llama.forced_prefix(None) == '{"name": "'
    # The forced opening plus the model's continuation reads as one call.
    out = ChatOutputConfig(tools=tools).new_choice()
    msg = out.message('{"city": "Lima"}}\n</tool_call>')
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Lima"}'}
    assert msg["content"] is None and out.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("doc", [
    '{}', '{"a": 1}', '{"a": [1, 2, {"b": null}], "c": "x\\ny\\u12ab"}', '{"a": -0.5e-3}',
    '{"a": true, "b": false}', ' {"a" : [ ] , "b" : { } } ',
    '{"a": 01}', '{"a": 1.}', '{"a": .5}', '{"a": +1}', '{"a": [1,]}', '{"a": 1,}',
    '{a: 1}', "{'a': 1}", '{"a": tru}', '{"a": "\\x"}', '{"a": "\\u12g4"}', '{"a" 1}',
    '{"a": "line\nbreak"}', '{"a": 1}}', '[1, 2]', '"s"', '{"a": nul}', '{"a": -}',
])
def test_json_scanner_agrees_with_json_loads(doc):
    scanner = JsonScanner()
    accepted = all(scanner.push(ch) for ch in doc) and scanner.done
    try:
        json.loads(doc)
        valid = True
    except ValueError:
        valid = False
    assert accepted == valid, doc


REASONING_CASES = [
    # (parser, prompt tail, output, reasoning, content)
    ("deepseek-r1", "<think>\n", "The user adds 2 and 2.\nThat is 4.\n</think>\n\nIt is 4.",
     "The user adds 2 and 2.\nThat is 4.", "It is 4."),
    ("deepseek-r1", "", "<think>\nShort.\n</think>\nFour.", "Short.", "Four."),
    ("deepseek-r1", "", "Never closes the think block", "Never closes the think block", ""),
    ("qwen3", "", "<think>\nHmm, 2+2.\n</think>\n\nFour.", "Hmm, 2+2.", "Four."),
    ("qwen3", "", "No thinking here: 4 <think> stays.", "", "No thinking here: 4 <think> stays."),
    ("qwen3", "<think>\n\n</think>\n\n", "Four, said plainly.", "", "Four, said plainly."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened by the template</think>Four.",
     "opened by the template", "Four."),
    ("qwen3", "", "<think>cut off while thin", "cut off while thin", ""),
    ("qwen3", "", "  <thin", "", "  <thin"),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_every_split(name, prompt, text, reasoning, content):
    for cuts in [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = create_reasoning_parser(name, prompt)
        r, c = [], []
        for piece in cuts:
            a, b = parser.feed(piece)
            r.append(a)
            c.append(b)
        a, b = parser.finish()
        assert ("".join(r) + a, "".join(c) + b) == (reasoning, content), cuts


def test_reasoning_then_tool_call_stream_and_whole():
    text = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    cfg = ChatOutputConfig(tools=ChatTools(TOOLS, "auto", None, None, "hermes"),
                           reasoning_parser="qwen3")
    msg = cfg.new_choice().message(text)
    assert msg["reasoning_content"] == "The user wants the weather."
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Paris"}'}
    for i in range(len(text) + 1):
        out = cfg.new_choice()
        deltas = out.stream(text[:i], False) + out.stream(text[i:], True)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        starts = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
        args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                       if "tool_calls" in d)
        assert reasoning == "The user wants the weather."
        assert not any(d.get("content") for d in deltas)
        assert [(s["function"]["name"], s["function"]["arguments"]) for s in starts] == [
            ("get_weather", "")]
        assert args == '{"city": "Paris"}'
        assert out.finish_reason("stop") == "tool_calls"
        assert out.finish_reason("length") == "length"


def test_stream_reasoning_false_sends_the_reasoning_once():
    cfg = ChatOutputConfig(reasoning_parser="deepseek-r1", stream_reasoning=False)
    out = cfg.new_choice()
    deltas = []
    for ch in "step one, step two</think>Answer.":
        deltas += out.stream(ch, False)
    deltas += out.stream("", True)
    assert deltas[0] == {"reasoning_content": "step one, step two"}
    assert [d for d in deltas[1:] if "reasoning_content" in d] == []
    assert "".join(d["content"] for d in deltas[1:]) == "Answer."


@pytest.mark.parametrize("name", ["hermes", "llama3"])
def test_random_outputs_never_lose_text(name):
    """Random mixes of markers, JSON pieces and text: no exception, whole or streamed; with no
    complete call the content is the text exactly; streamed with no call sent, likewise."""
    import random

    rng = random.Random(1234)
    atoms = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<tool", "{", "}", "[", "]", ":",
             ",", ";", '"', '"name"', '"arguments"', '"parameters"', '"add"', '"get_weather"',
             "1", "-2.5e3", "true", "null", "\\", "\\u00e9", " ", "\n", "x", "Hi", "é", "<"]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 30)))
        content, calls = whole(name, text)
        if not calls:
            assert content == text, text
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s_content, s_calls, _ = replay(create_tool_call_parser(name, TOOLS), pieces)
        if not s_calls:
            assert s_content == text, text
        for _, args in calls:
            json.loads(args)


def test_cli_flags_reach_the_server_and_the_pd_children():
    from pdjax.entrypoints.pd_roles import child_argv
    from pdjax.ports import free_port
    from pdjax.serve import parse_args as serve_parse_args

    def parse_args(argv):      # a free port: parse_args checks it (30000 may be in use here)
        return serve_parse_args(argv + ["--port", str(free_port())])

    args = parse_args(["--tool-call-parser", "llama3", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3", "qwen3")
    argv = child_argv(args, "decode", 30002)
    assert argv[argv.index("--tool-call-parser") + 1] == "llama3"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert parse_args([]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "mistral"])


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
@pytest.mark.parametrize("choice,name,parallel", [("required", None, True),
                                                  ("required", None, False),
                                                  ("function", "get_weather", True)])
def test_tool_choice_grammar_admits_exactly_the_valid_calls(parser, choice, name, parallel):
    """The grammar ``required`` / a named function would be enforced with (llguidance via
    pdjax.constrained): the parser's own call text walks through it and reads back as the
    same calls; a wrong function, missing required arguments or a second call where one is
    allowed do not."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from server_fakes import build_tokenizer

    from pdjax.constrained.grammar import GrammarBackend

    tok = build_tokenizer()
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    tools = ChatTools(TOOLS, choice, name, None if parallel else 1, parser)
    spec = tools.grammar_spec()
    fmt = tools.new_parser().call_format()

    def call(fn, args):
        return (f'{fmt.begin}{{"name": "{fn}", "{fmt.arguments_key}": '
                f'{json.dumps(args)}}}{fmt.end}')

    def walk(text):
        m = backend.matcher(spec)
        ids = tok.encode(text, add_special_tokens=False)
        return all(m.accept(t) for t in ids) and m.is_accepting

    one = call("get_weather", {"city": "Paris"})
    two = one + fmt.separator + call("get_weather", {"city": "Rome"})
    assert walk(one)
    assert walk(two) == (choice == "required" and parallel)
    assert not walk(call("get_weather", {"town": "Paris"}))           # required "city" missing
    assert walk(call("add", {"a": 1})) == (choice == "required")
    assert not walk(call("launch", {}))
    assert not walk("Sure! " + one)
    assert whole(parser, two) == ("", [("get_weather", '{"city": "Paris"}'),
                                       ("get_weather", '{"city": "Rome"}')])
    assert tools.grammar_spec() == spec and ChatTools(TOOLS, "auto", None, None,
                                                      parser).grammar_spec() is None
