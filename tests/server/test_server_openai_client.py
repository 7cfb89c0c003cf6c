"""The ``openai`` Python client parses pdjax's answers (fake engine, live server on 127.0.0.1)."""

import openai
import pytest
import pytest_asyncio
from server_fakes import FakeEngine

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "Hello"}]


@pytest_asyncio.fixture
async def make_openai(make_client):
    """``await make_openai(engine=None) -> (AsyncOpenAI, engine)`` against a live server."""
    made = []

    async def make(engine=None):
        client, engine = await make_client(engine)
        oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                                max_retries=0)
        made.append(oa)
        return oa, engine

    yield make
    for oa in made:
        await oa.close()


async def test_openai_client_completion_chat_stream_logprobs_n2_stop(make_openai):
    oa, engine = await make_openai(FakeEngine(reply="Hello world, the quick € fox."))
    models = await oa.models.list()
    assert [m.id for m in models.data] == ["fake-model"]

    comp = await oa.completions.create(model="fake-model", prompt="Hi", max_tokens=40,
                                       logprobs=2, n=2)
    assert [c.text for c in comp.choices] == [engine.reply] * 2
    assert comp.choices[0].logprobs.token_logprobs[0] == pytest.approx(-0.5)
    assert comp.usage.completion_tokens == 2 * len(
        engine.tokenizer.encode(engine.reply, add_special_tokens=False) + ["eos"])

    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, max_tokens=40,
                                            stop=["quick"], logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert choice.message.content == "Hello world, the "
    assert choice.finish_reason == "stop"
    assert len(choice.logprobs.content[0].top_logprobs) == 2
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0

    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, max_tokens=40,
                                              stop=["quick"], stream=True,
                                              stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == choice.message.content
    assert usage.completion_tokens == chat.usage.completion_tokens


async def test_openai_client_sees_errors(make_openai):
    oa, engine = await make_openai()
    with pytest.raises(openai.BadRequestError) as info:
        await oa.chat.completions.create(model="fake-model", messages=MSG, temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        await oa.chat.completions.create(model="fake-model", messages=MSG, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    engine.fail_after = 2
    stream = await oa.chat.completions.create(model="fake-model", messages=MSG, stream=True)
    with pytest.raises(openai.APIError, match="injected engine failure"):
        async for _ in stream:
            pass
    engine.fail_after = None
    chat = await oa.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)
    assert chat.usage.completion_tokens == 2
