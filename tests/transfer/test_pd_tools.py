"""Tool calls through PD without ``--tool-call-parser``: a prefill, a decode and the
pdjax router, real processes on 127.0.0.1, asked with the ``openai`` client. ``required`` and a
named function are structured outputs over the tools' schemas, as in vLLM: the prefill's first
token and the decode's tokens follow the call grammar, and the answer carries ``tool_calls``."""

import json

import jsonschema
import openai
import pytest
from grammar_cases import TOOL_PARAMS, TOOLS, chat_tool_calls
from pd_harness import (at_baseline, free_port, pd_router, pd_server, running, wait_until)

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def pd(tiny_checkpoints, tmp_path_factory):
    """P, D and the router, no tool-call parser; a chat template that names the tools (the
    parser-less instructions would not fit the tiny context)."""
    from transformers import AutoTokenizer

    model = tiny_checkpoints["llama"]
    tok_dir = str(tmp_path_factory.mktemp("pd_tools_tokenizer"))
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}"
                         "{% endif %}{% for m in messages %}{{ m.content }}\n{% endfor %}")
    tok.save_pretrained(tok_dir)
    logs = str(tmp_path_factory.mktemp("pd_tools"))
    extra = ["--tokenizer-path", tok_dir]
    bport = free_port()
    p = pd_server("tp", "prefill", model, logs, bootstrap_port=bport, extra=extra)
    d = pd_server("td", "decode", model, logs, extra=extra)
    router = pd_router("trouter", p, bport, d, logs)
    with running([p, d, router]):
        yield dict(p=p, d=d, router=router, model=model)


async def _calls(oa, stream, **kw):
    """``[[name, arguments]]`` and the finish reason of one chat completion; a non-streamed
    answer has no text beside its calls."""
    calls, finish, content = await chat_tool_calls(oa, stream, **kw)
    if not stream:
        assert not content, (calls, content)
    return calls, finish


@pytest.mark.asyncio
async def test_required_and_named_tool_choice_through_pd_without_a_parser(pd):
    oa = openai.AsyncOpenAI(base_url=pd["router"].url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    try:
        for choice, parallel in (("required", False),
                                 ({"type": "function", "function": {"name": "add"}}, True)):
            for stream in (False, True):
                got, finish = await _calls(oa, stream, model=pd["model"], messages=msgs, tools=TOOLS,
                                           tool_choice=choice, parallel_tool_calls=parallel,
                                           max_tokens=60, temperature=0)
                assert len(got) == 1 and finish == "tool_calls", (choice, stream, got, finish)
                name, args = got[0]
                if isinstance(choice, dict):
                    assert name == "add"
                jsonschema.validate(json.loads(args), TOOL_PARAMS[name])
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await oa.chat.completions.create(model=pd["model"], messages=msgs, tools=TOOLS,
                                             max_tokens=4)
    finally:
        await oa.close()
    for s in ("p", "d"):
        assert wait_until(lambda: at_baseline(pd[s]), 10), s
