"""Tool calls and reasoning through the HTTP API, with the ``openai`` client against a live
server; a scripted fake engine plays the model (the tiny random model never writes a call)."""

import json

import openai
import pytest
import pytest_asyncio
from server_fakes import TOOLS_CHAT_TEMPLATE, FakeEngine, build_tokenizer, parse_sse
from pdjax.server.tools import ChatTools

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
TOOLS = [WEATHER, ADD]
TWO_CALLS = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
             '"b": 2.5}}\n</tool_call>')


@pytest_asyncio.fixture
async def make_openai(make_client):
    """``await make_openai(engine, **create_app_kwargs) -> (AsyncOpenAI, client, engine)``."""
    made = []

    async def make(engine, **kwargs):
        client, engine = await make_client(engine, **kwargs)
        oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                                max_retries=0)
        made.append(oa)
        return oa, client, engine

    yield make
    for oa in made:
        await oa.close()


def tools_engine(*script):
    return FakeEngine(build_tokenizer(TOOLS_CHAT_TEMPLATE), script=list(script),
                      context_length=2048)


async def collect(stream):
    """Stream chunks -> per choice: content, reasoning, calls {index: [id, name, args]},
    finish_reason, and the tool-call deltas in order."""
    out: dict[int, dict] = {}
    async for chunk in stream:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": {},
                                         "finish": None, "call_deltas": []})
            o["content"] += c.delta.content or ""
            o["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:
                o["call_deltas"].append(tc)
                if tc.id is not None:
                    assert tc.index not in o["calls"]
                    o["calls"][tc.index] = [tc.id, tc.function.name, tc.function.arguments]
                else:
                    assert tc.function.name is None
                    o["calls"][tc.index][2] += tc.function.arguments
            if c.finish_reason is not None:
                o["finish"] = c.finish_reason
    return out


async def test_auto_tool_calls_whole_and_streamed(make_openai):
    oa, _, engine = await make_openai(tools_engine(TWO_CALLS), tool_call_parser="hermes")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                            max_tokens=400)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "add"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"},
                                                               {"a": 1, "b": 2.5}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    # The template rendered the tools into the prompt.
    prompt = engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\n<tools>\n")
    assert json.dumps(WEATHER) in prompt and json.dumps(ADD) in prompt

    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                              max_tokens=400, stream=True)
    got = (await collect(stream))[0]
    assert got["finish"] == "tool_calls" and got["content"] == "I will check."
    assert [(name, json.loads(args)) for _, name, args in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2.5})]
    # Like OpenAI: the first delta of a call has id, type, name and empty arguments; the
    # arguments follow in several pieces.
    firsts = [tc for tc in got["call_deltas"] if tc.id is not None]
    assert [(tc.type, tc.function.arguments) for tc in firsts] == [("function", "")] * 2
    pieces = [tc for tc in got["call_deltas"] if tc.id is None and tc.index == 0]
    assert len(pieces) > 3


async def test_parallel_tool_calls_false_and_n2(make_openai):
    oa, _, _ = await make_openai(tools_engine(TWO_CALLS), tool_call_parser="qwen25")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                            parallel_tool_calls=False, max_tokens=400)
    assert [c.function.name for c in chat.choices[0].message.tool_calls] == ["get_weather"]
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                              max_tokens=400, n=2, stream=True)
    got = await collect(stream)
    assert sorted(got) == [0, 1]
    for o in got.values():
        assert [name for _, name, _ in o["calls"].values()] == ["get_weather", "add"]
        assert o["finish"] == "tool_calls"


async def test_malformed_call_is_content_and_no_call_is_plain(make_openai):
    bad = 'Sure <tool_call>\n{"name": "get_weather", arguments: {}}\n</tool_call>'
    oa, _, _ = await make_openai(tools_engine(bad, "Just text."), tool_call_parser="hermes")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS)
    assert chat.choices[0].message.content == bad
    assert chat.choices[0].message.tool_calls is None
    assert chat.choices[0].finish_reason == "stop"
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                              stream=True)
    got = (await collect(stream))[0]
    assert (got["content"], got["calls"], got["finish"]) == ("Just text.", {}, "stop")


async def test_history_with_tool_calls_and_results_renders(make_openai):
    oa, _, engine = await make_openai(tools_engine(TWO_CALLS, "It is sunny, 21 C."),
                                      tool_call_parser="hermes")
    first = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                             max_tokens=400)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = MSG + [msg.model_dump(),        # as a client sends it back, nulls included
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
                     {"role": "tool", "tool_call_id": msg.tool_calls[1].id, "content": "3.5"}]
    second = await oa.chat.completions.create(model="fake-model", messages=history,
                                              tools=TOOLS, max_tokens=400)
    assert second.choices[0].message.content == "It is sunny, 21 C."
    assert second.choices[0].finish_reason == "stop"
    prompt = engine.prompts[-1]
    # Arguments go to the template as objects (not double-encoded strings).
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in prompt
    assert "<tool_response>{\"temp_c\": 21}</tool_response>" in prompt
    assert "<tool_response>3.5</tool_response>" in prompt


async def test_named_and_required_choice_are_decoded_under_the_call_grammar(make_openai):
    # The engine decodes under the grammar of the allowed calls (the fake only compiles it), so
    # the prompt carries no forced opening and the answer is the whole call.
    oa, _, engine = await make_openai(
        tools_engine('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
                     '</tool_call>',
                     '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'),
        tool_call_parser="hermes")
    chat = await oa.chat.completions.create(
        model="fake-model", messages=MSG, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n")
    spec = engine.submitted[-1].sampling_params.grammar
    named = ChatTools(TOOLS, "function", "get_weather", None, "hermes").grammar_spec()
    assert (spec.kind, spec.field, spec.text) == ("lark", "tool_choice", named.text)
    assert '"get_weather"' in spec.text and '"add"' not in spec.text
    call, = chat.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Lima"})
    assert chat.choices[0].finish_reason == "tool_calls"
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                              tool_choice="required", stream=True)
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n")
    required = ChatTools(TOOLS, "required", None, None, "hermes").grammar_spec()
    assert engine.submitted[-1].sampling_params.grammar.text == required.text
    got = (await collect(stream))[0]
    assert [(n, json.loads(a)) for _, n, a in got["calls"].values()] == [("add", {"a": 2})]


async def test_tool_choice_with_response_format_is_refused(make_openai):
    oa, _, _ = await make_openai(tools_engine("x"), tool_call_parser="hermes")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                         tool_choice="required",
                                         response_format={"type": "json_object"})


async def test_tool_choice_none_and_template_without_tools(make_openai):
    # The default fake template ignores tools: the parser's instructions go in a system
    # message instead. tool_choice none: no tools in the prompt at all.
    engine = FakeEngine(script=['<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'],
                        context_length=2048)
    oa, _, engine = await make_openai(engine, tool_call_parser="hermes")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=[ADD])
    prompt = engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(ADD["function"]) in prompt and "<tool_call>" in prompt
    assert chat.choices[0].message.tool_calls[0].function.arguments == "{}"
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=[ADD],
                                            tool_choice="none")
    assert engine.prompts[-1] == "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    assert chat.choices[0].message.tool_calls is None
    assert chat.choices[0].message.content.startswith("<tool_call>")


async def test_llama3_parser_through_the_server(make_openai):
    reply = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    oa, _, _ = await make_openai(tools_engine(reply), tool_call_parser="llama3")
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                              stream=True)
    got = (await collect(stream))[0]
    assert [(n, a) for _, n, a in got["calls"].values()] == [("get_weather", '{"city": "Oslo"}')]
    assert got["content"] == "" and got["finish"] == "tool_calls"


@pytest.mark.parametrize("body,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
async def test_bad_tool_fields_are_400_on_a_tools_server(make_client, body, needle):
    client, engine = await make_client(tools_engine("x"), tool_call_parser="hermes")
    resp = await client.post("/v1/chat/completions",
                             json={"messages": MSG, "max_tokens": 4, **body})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert needle in err["message"] and err["param"] in ("tools", "tool_choice",
                                                         "parallel_tool_calls")
    assert engine.submitted == []
    resp = await client.post("/v1/chat/completions",
                             json={"messages": MSG, "max_tokens": 4, "tools": [WEATHER]})
    assert resp.status == 200


THINK = "The user asks about Paris.\nLook it up.\n</think>\n\nParis is sunny."


async def test_reasoning_content_whole_streamed_and_switches(make_openai):
    oa, _, _ = await make_openai(FakeEngine(script=[THINK]), reasoning_parser="deepseek-r1")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG)
    msg = chat.choices[0].message
    assert msg.reasoning_content == "The user asks about Paris.\nLook it up."
    assert msg.content == "Paris is sunny."
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, stream=True)
    got = (await collect(stream))[0]
    assert (got["reasoning"], got["content"], got["finish"]) == (
        "The user asks about Paris.\nLook it up.", "Paris is sunny.", "stop")
    raw = await oa.chat.completions.create(model="fake-model", messages=MSG,
                                           extra_body={"separate_reasoning": False})
    assert raw.choices[0].message.content == THINK
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, stream=True,
                                              extra_body={"stream_reasoning": False})
    pieces = []
    async for chunk in stream:
        for c in chunk.choices:
            if getattr(c.delta, "reasoning_content", None):
                pieces.append(c.delta.reasoning_content)
    assert pieces == ["The user asks about Paris.\nLook it up."]


async def test_reasoning_and_tool_call_together(make_openai):
    reply = '<think>\nNeed the weather.\n</think>\n\n' + TWO_CALLS
    oa, _, _ = await make_openai(tools_engine(reply), tool_call_parser="hermes",
                                 reasoning_parser="qwen3")
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, tools=TOOLS,
                                            max_tokens=400)
    msg = chat.choices[0].message
    assert msg.reasoning_content == "Need the weather."
    assert msg.content == "I will check."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "add"]
    # The answer goes back in the history with its reasoning_content.
    again = await oa.chat.completions.create(model="fake-model", messages=MSG + [
        msg.model_dump(), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                           "content": "sunny"}], tools=TOOLS, max_tokens=400)
    assert again.choices[0].finish_reason == "tool_calls"


async def test_generate_separate_reasoning_and_endpoint(make_client):
    client, _ = await make_client(FakeEngine(script=[THINK]), reasoning_parser="deepseek-r1")
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 200}}
    plain = await (await client.post("/generate", json=body)).json()
    assert plain["text"] == THINK and "reasoning_text" not in plain
    split = await (await client.post("/generate", json={**body, "separate_reasoning": True})).json()
    assert split["reasoning_text"] == "The user asks about Paris.\nLook it up."
    assert split["text"] == "Paris is sunny."
    assert split["output_ids"] == plain["output_ids"]
    resp = await client.post("/generate", json={**body, "separate_reasoning": True,
                                                "stream": True})
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert (last["reasoning_text"], last["text"]) == (split["reasoning_text"], split["text"])
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))      # cumulative
    resp = await client.post("/separate_reasoning",
                             json={"text": "<think>a\n</think>\nb", "reasoning_parser": "qwen3"})
    assert await resp.json() == {"text": "b", "reasoning_text": "a"}
    resp = await client.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "r9"})
    assert resp.status == 400 and "reasoning_parser" in (await resp.json())["error"]["message"]


async def test_tool_calls_and_reasoning_through_the_pd_router(make_client):
    """The router sends the same body to a prefill and a decode server (fakes here): both
    render the same prompt with the tools, and the decode's parsed answer reaches the client."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdjax.router import PDRouter, create_router_app

    reply = "<think>\nweather\n</think>\n\n" + TWO_CALLS
    kw = dict(tool_call_parser="hermes", reasoning_parser="qwen3")
    prefill, p_engine = await make_client(tools_engine("x"), **kw)
    decode, d_engine = await make_client(tools_engine(reply), **kw)
    router = PDRouter([(str(prefill.make_url("")), 8998)], [str(decode.make_url(""))])
    rclient = TestClient(TestServer(create_router_app(router)))
    await rclient.start_server()
    oa = openai.AsyncOpenAI(base_url=str(rclient.make_url("/v1")), api_key="unused",
                            max_retries=0)
    try:
        for stream in (False, True):
            resp = await oa.chat.completions.create(model="fake-model", messages=MSG,
                                                    tools=TOOLS, max_tokens=400, stream=stream)
            if stream:
                got = (await collect(resp))[0]
                names = [n for _, n, _ in got["calls"].values()]
                reasoning, finish = got["reasoning"], got["finish"]
            else:
                msg = resp.choices[0].message
                names = [c.function.name for c in msg.tool_calls]
                reasoning, finish = msg.reasoning_content, resp.choices[0].finish_reason
            assert (names, reasoning, finish) == (["get_weather", "add"], "weather",
                                                  "tool_calls")
            p_req, d_req = p_engine.submitted[-1], d_engine.submitted[-1]
            assert p_req.input_ids == d_req.input_ids
            assert p_req.bootstrap_room == d_req.bootstrap_room is not None
            assert json.dumps(WEATHER) in d_engine.prompts[-1]
    finally:
        await oa.close()
        await rclient.close()


async def test_parse_function_call_endpoint(make_client):
    client, _ = await make_client(FakeEngine())
    resp = await client.post("/parse_function_call", json={
        "text": TWO_CALLS, "tools": TOOLS, "tool_call_parser": "hermes"})
    assert await resp.json() == {"normal_text": "I will check.", "calls": [
        {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Paris"}'},
        {"tool_index": 1, "name": "add", "parameters": '{"a": 1, "b": 2.5}'}]}
    for body, field in (({"text": "x", "tools": TOOLS, "tool_call_parser": "nope"},
                         "tool_call_parser"),
                        ({"text": "x", "tools": [{"type": "x"}], "tool_call_parser": "hermes"},
                         "tools[0].type"),
                        ({"text": 5, "tools": TOOLS, "tool_call_parser": "hermes"}, "text")):
        resp = await client.post("/parse_function_call", json=body)
        assert resp.status == 400 and field in (await resp.json())["error"]["message"]


async def test_parsers_come_from_the_engine_args(make_client):
    """``serve.py`` passes nothing: the server reads ``--tool-call-parser`` and
    ``--reasoning-parser`` from the engine's ``args`` (as ``AsyncEngine`` has them)."""
    from pdjax.config import ServerArgs

    engine = tools_engine("<think>a</think>" + TWO_CALLS)
    engine.args = ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3")
    client, _ = await make_client(engine)
    resp = await client.post("/v1/chat/completions",
                             json={"messages": MSG, "tools": TOOLS, "max_tokens": 400})
    msg = (await resp.json())["choices"][0]["message"]
    assert msg["reasoning_content"] == "a"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "add"]
    with pytest.raises(ValueError, match="tool_call_parser"):
        from pdjax.server.app import create_app
        create_app(engine, tool_call_parser="mistral")
