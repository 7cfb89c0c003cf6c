"""Structured outputs through the HTTP server over the real engine (tiny random Llama, CPU),
with the ``openai`` client: ``response_format`` JSON schemas of 20 shapes parse and validate,
streamed and not; ``json_object``; a regex-constrained ``/generate`` matches in full;
``tool_choice`` required / named always gives a parseable call whose arguments validate; bad
schemas and regexes are 400s naming the field; no compile after warm-up."""

import json
import re

import jsonschema
import openai
import pytest
import pytest_asyncio

from grammar_cases import MODEL_SCHEMAS, TOOL_PARAMS, TOOLS, chat_tool_calls
from pdjax.constrained.grammar import GrammarSpec
from pdjax.runner.model_runner import compile_count

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "Reply in JSON."}]


@pytest_asyncio.fixture
async def served(make_client, real_engine):
    client, engine = await make_client(real_engine, tool_call_parser="hermes")
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                            max_retries=0)
    yield client, oa, engine
    await oa.close()


# ChatML that renders the tools by name only: the instructions the server would add for a
# template without tools take ~640 tokens of the tiny BPE, over the 128-token context.
SHORT_TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.content }}\n{% endfor %}")


@pytest.fixture
def short_tools_template(real_engine):
    tok = real_engine.tokenizer
    before, tok.chat_template = tok.chat_template, SHORT_TOOLS_TEMPLATE
    yield
    tok.chat_template = before


def _format(i, schema):
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                   "strict": True}}


async def test_twenty_schemas_parse_and_validate_streamed_and_not(served):
    client, oa, engine = served
    before, runner_before = compile_count(), engine.core.runner.compiles_after_warmup
    for i, schema in enumerate(MODEL_SCHEMAS):
        # max_tokens: what the 128-token context leaves after the 31-token prompt
        kw = dict(model=engine.served_model_name, messages=MSG, max_tokens=97,
                  response_format=_format(i, schema), seed=i,
                  temperature=0 if i % 2 == 0 else 0.9)
        chat = await oa.chat.completions.create(**kw)
        text = chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        stream = await oa.chat.completions.create(stream=True, **kw)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == text, i        # same seed, same draws, streamed or not
        # Completions take response_format too.
        comp = await oa.completions.create(model=engine.served_model_name, prompt="JSON:",
                                           max_tokens=100, seed=i, temperature=0.9,
                                           extra_body={"response_format": _format(i, schema)})
        jsonschema.validate(json.loads(comp.choices[0].text), schema)
    assert compile_count() == before
    assert engine.core.runner.compiles_after_warmup == runner_before


async def test_n2_logprobs_and_json_object(served):
    _, oa, engine = served
    schema = MODEL_SCHEMAS[1]
    chat = await oa.chat.completions.create(
        model=engine.served_model_name, messages=MSG, max_tokens=97, n=2, seed=3,
        temperature=0.9, logprobs=True, top_logprobs=2, response_format=_format(1, schema))
    assert len(chat.choices) == 2
    for c in chat.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
        # Logprobs are the model's own (before the mask): never above the top entry.
        assert c.logprobs.content
        assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in c.logprobs.content)
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    # Any JSON object has no bounded language: a random model may not close it in max_tokens,
    # but every token it emits keeps the text a prefix of an object.
    chat = await oa.chat.completions.create(
        model=engine.served_model_name, messages=MSG, max_tokens=40, seed=4, temperature=0,
        response_format={"type": "json_object"})
    text = chat.choices[0].message.content
    assert text.startswith("{")
    backend = engine.core.grammar_backend
    m = backend.matcher(GrammarSpec("json_object"))
    assert all(m.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False))
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
async def test_regex_generate_matches_in_full(served, stream):
    client, _, _ = served
    regex = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}\."
    for seed in range(3):
        body = {"text": "Fact:", "stream": stream,
                "sampling_params": {"max_new_tokens": 60, "temperature": 1.0, "seed": seed,
                                    "regex": regex}}
        resp = await client.post("/generate", json=body)
        assert resp.status == 200
        if stream:
            chunks = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                      if line.startswith("data: {")]
            out = chunks[-1]
        else:
            out = await resp.json()
        assert re.fullmatch(regex, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("choice,parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "add"}}, True)])
async def test_tool_choice_required_and_named_always_give_a_valid_call(served, short_tools_template,
                                                                      choice, parallel):
    _, oa, engine = served
    for seed in range(4):
        for stream in (False, True):
            kw = dict(model=engine.served_model_name, messages=MSG, tools=TOOLS, max_tokens=100,
                      tool_choice=choice, parallel_tool_calls=parallel, seed=seed,
                      temperature=0 if seed == 0 else 1.0)
            got, finish, _ = await chat_tool_calls(oa, stream, **kw)
            assert got, (seed, stream)
            if not parallel or isinstance(choice, dict):     # one call, then the grammar ends
                assert finish == "tool_calls" and len(got) == 1, (seed, stream, got)
            else:       # a random model may go on calling until max_tokens
                assert finish in ("tool_calls", "length"), (seed, stream, finish)
            for name, args in got:
                if isinstance(choice, dict):
                    assert name == "add"
                jsonschema.validate(json.loads(args), TOOL_PARAMS[name])


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"$ref": "#/nope"}}}},
     "response_format"),
])
async def test_invalid_schema_is_a_400_naming_the_field(served, body, field):
    client, _, engine = served
    resp = await client.post("/v1/chat/completions", json={
        "model": engine.served_model_name, "messages": MSG, "max_tokens": 4, **body})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == field and err["message"].startswith(field), err
    resp = await client.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 4, "regex": "[a-"}})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert "sampling_params.regex" in err["message"] and err["param"] == "sampling_params", err
    # The server keeps serving.
    resp = await client.post("/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 4, "regex": "[a-c]{4}"}})
    assert re.fullmatch("[a-c]{4}", (await resp.json())["text"])


# One token of the tiny model's vocabulary (its tokenizer has 448 of the model's 512) holds a
# whole Hermes call; a +100 logit bias makes the random model write it, again and again.
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 35}}\n</tool_call>\n'


@pytest.fixture
def call_token(real_engine, short_tools_template):
    """The server's tokenizer with ``CALL_TEXT`` added as one token (before the server is
    made: it keeps the tokenizer's token texts); returns its id."""
    import copy

    before = real_engine.tokenizer
    tok = copy.deepcopy(before)
    tok.add_tokens([CALL_TEXT])
    real_engine.tokenizer = tok
    token_id = tok.convert_tokens_to_ids(CALL_TEXT)
    assert len(before) <= token_id < real_engine.core.model_cfg.vocab_size
    yield token_id
    real_engine.tokenizer = before


async def test_auto_tool_choice_with_a_biased_call_gives_tool_calls(call_token, served):
    """``tool_choice="auto"`` (the default with tools): the model's output holds a call, driven
    on the real tiny model by ``logit_bias``, so the answer carries it as ``tool_calls``; the
    stop string ends the output after the first call. Without the bias: no call."""
    _, oa, engine = served
    before = engine.core.runner.compiles_after_warmup
    kw = dict(model=engine.served_model_name, messages=MSG, tools=TOOLS, max_tokens=4,
              temperature=0, logit_bias={str(call_token): 100}, stop=["\n<tool_call>"])
    for auto in (None, "auto"):
        extra = {} if auto is None else {"tool_choice": auto}
        chat = await oa.chat.completions.create(**kw, **extra)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"a": 7, "b": 35}
        calls, finish, _ = await chat_tool_calls(oa, True, **kw, **extra)
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls] == [("add", {"a": 7, "b": 35})]
    # No stop string: the biased token repeats, and each copy is one more call.
    chat = await oa.chat.completions.create(**dict(kw, stop=None, max_tokens=3))
    assert [c.function.name for c in chat.choices[0].message.tool_calls] == ["add"] * 3
    # Without the bias the random model writes no call.
    chat = await oa.chat.completions.create(**dict(kw, logit_bias=None, max_tokens=8))
    assert not chat.choices[0].message.tool_calls
    assert engine.core.runner.compiles_after_warmup == before


@pytest.mark.parametrize("choice,parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "get_weather"}}, True)])
async def test_required_and_named_need_no_tool_call_parser(make_client, real_engine,
                                                           short_tools_template, choice,
                                                           parallel):
    """As in vLLM, ``required`` and a named function are structured outputs over the
    tools' schemas and need no ``--tool-call-parser`` (they were a 400 "tools need a tool-call
    parser"); the grammar writes bare JSON calls, read back into ``tool_calls``. ``auto`` still
    needs the parser: a 400 naming ``tool_choice``."""
    client, engine = await make_client(real_engine)             # no tool_call_parser
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                            max_retries=0)
    try:
        for seed in range(2):
            kw = dict(model=engine.served_model_name, messages=MSG, tools=TOOLS, max_tokens=100,
                      tool_choice=choice, parallel_tool_calls=parallel, seed=seed,
                      temperature=0 if seed == 0 else 1.0)
            got, finish, content = await chat_tool_calls(oa, False, **kw)
            streamed, _, _ = await chat_tool_calls(oa, True, **kw)
            for answer in (got, streamed):
                assert answer, (seed, got, content)
                if not parallel or isinstance(choice, dict):
                    assert len(answer) == 1 and finish == "tool_calls"
                for name, args in answer:
                    if isinstance(choice, dict):
                        assert name == "get_weather"
                    jsonschema.validate(json.loads(args), TOOL_PARAMS[name])
            assert not content, (got, content)        # the whole answer is calls
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await oa.chat.completions.create(model=engine.served_model_name, messages=MSG,
                                             tools=TOOLS, max_tokens=4)
    finally:
        await oa.close()
