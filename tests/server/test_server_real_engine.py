"""The HTTP server over the real ``AsyncEngine`` (tiny random Llama, CPU), with the ``openai``
client on 127.0.0.1: completion, chat, streaming, logprobs, n=2, stop strings, disconnects."""

import asyncio
import time

import jax
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "Hello world"}]


@pytest_asyncio.fixture
async def served(make_client, real_engine):
    client, engine = await make_client(real_engine)
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                            max_retries=0)
    yield client, oa, engine
    await oa.close()


async def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def metric(text, name, **labels):
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(name)


async def test_completion_chat_stream_logprobs_n2_and_stop(served):
    client, oa, engine = served
    greedy = dict(model=engine.served_model_name, max_tokens=24, temperature=0)
    comp = await oa.completions.create(prompt="The quick brown", **greedy)
    native = await (await client.post("/generate", json={
        "text": "The quick brown", "sampling_params": {"max_new_tokens": 24,
                                                       "temperature": 0}})).json()
    assert comp.choices[0].text == native["text"]
    assert comp.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    if comp.choices[0].finish_reason == "length":
        assert comp.usage.completion_tokens == 24
    chat = await oa.chat.completions.create(messages=MSG, logprobs=True, top_logprobs=2, **greedy)
    text = chat.choices[0].message.content
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)   # greedy

    # Streamed text equals the non-streamed text.
    stream = await oa.chat.completions.create(messages=MSG, stream=True, **greedy)
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == text

    # n=2 greedy: two identical choices with their own index.
    both = await oa.chat.completions.create(messages=MSG, n=2, **greedy)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.message.content for c in both.choices] == [text, text]

    # A stop string taken from the greedy text cuts it there, streamed or not.
    clean = [i for i in range(2, len(text) - 3) if "\ufffd" not in text[i:i + 3]]
    assert clean, text
    stop = text[clean[0]:clean[0] + 3]
    cut = text[:text.find(stop)]
    stopped = await oa.chat.completions.create(messages=MSG, stop=[stop], **greedy)
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"
    stream = await oa.chat.completions.create(messages=MSG, stop=[stop], stream=True, **greedy)
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == cut
    assert all(stop not in p for p in pieces)


async def test_native_generate_logprobs_match_openai(served):
    client, oa, engine = served
    ids = engine.tokenizer.encode("Once upon a time")
    resp = await client.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2})
    assert resp.status == 200
    meta = (await resp.json())["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert len(meta["input_token_logprobs"]) == len(ids)
    assert meta["input_token_logprobs"][0][0] is None
    comp = await oa.completions.create(model=engine.served_model_name, prompt=ids, max_tokens=6,
                                       temperature=0, logprobs=2)
    assert comp.choices[0].logprobs.token_logprobs == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-4)


async def test_disconnect_mid_stream_returns_the_pages(served):
    client, oa, engine = served
    core = engine.core
    slow = lambda batch, outputs: time.sleep(0.02)   # noqa: E731  (keeps the request running)
    core.step_hooks.append(slow)
    try:
        resp = await client.post("/v1/chat/completions", json={
            "messages": MSG, "stream": True, "max_tokens": 100, "ignore_eos": True, "n": 2})
        assert resp.status == 200
        for _ in range(6):
            await resp.content.readline()
        load = await (await client.get("/get_load")).json()
        assert load["num_running_reqs"] == 2
        before = await (await client.get("/metrics")).text()
        resp.close()

        async def freed():
            load = await (await client.get("/get_load")).json()
            return load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        await wait_for(freed)
    finally:
        core.step_hooks.remove(slow)
    after = await (await client.get("/metrics")).text()
    aborted = metric(after, "pdjax:num_requests_total", finish_reason="abort")
    try:
        aborted_before = metric(before, "pdjax:num_requests_total", finish_reason="abort")
    except KeyError:
        aborted_before = 0
    assert aborted == aborted_before + 2
    # Nothing holds a page any more: the prefix cache can be emptied and the pool is free.
    assert (await client.post("/flush_cache")).status == 200
    load = await (await client.get("/get_load")).json()
    assert load["num_used_pages"] == 0 and load["kv_usage"] == 0


async def test_validation_then_valid_and_metrics_move(served):
    client, oa, engine = served
    before = await (await client.get("/metrics")).text()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        await oa.chat.completions.create(model=engine.served_model_name, messages=MSG, top_p=0)
    with pytest.raises(openai.BadRequestError, match="context length"):
        await oa.completions.create(model=engine.served_model_name, prompt=[5] * 128)
    resp = await client.post("/generate", json={"input_ids": [5, 512]})
    assert resp.status == 400
    chat = await oa.chat.completions.create(model=engine.served_model_name, messages=MSG,
                                            max_tokens=5, temperature=0)
    assert chat.usage.completion_tokens == 5
    after = await (await client.get("/metrics")).text()
    moved = (metric(after, "pdjax:generation_tokens_total")
             - metric(before, "pdjax:generation_tokens_total"))
    assert moved == 5
    assert (metric(after, "pdjax:prompt_tokens_total") - metric(before, "pdjax:prompt_tokens_total")
            == chat.usage.prompt_tokens)
    assert metric(after, "pdjax:compile_count_total") == 0
    # One prefill forward and 4 decode forwards, each timed, each forecast by the cost model
    # (earlier tests of this module gave it data on both entry points).
    steps = {k: metric(after, f"pdjax:{k}") - metric(before, f"pdjax:{k}")
             for k in ("step_tokens_count", "step_tokens_sum", "step_time_seconds_count",
                       "step_time_predicted_seconds_count")}
    assert steps == {"step_tokens_count": 5, "step_tokens_sum": chat.usage.prompt_tokens + 4,
                     "step_time_seconds_count": 5, "step_time_predicted_seconds_count": 5}
    info = await (await client.get("/get_server_info")).json()
    cost = info["step_cost_model"]
    assert cost["num_observed"] >= 5 and {"decode", "extend"} <= set(cost["entries"])
    for bucket in cost["buckets"]:
        assert bucket["num_samples"] >= 1 and bucket["fixed_s"] == bucket["fixed_s"]  # not NaN
    assert info["target_itl_ms"] is None and info["max_num_batched_tokens"] is None
    # "auto" settings are reported as resolved: the native kernels and unrolled layers on CPU.
    on_cpu = jax.default_backend() == "cpu"
    assert (info["attention_backend"], info["unroll_layers"], info["cpu_matmul_kernel"]) == (
        resolve_impl(None), on_cpu, on_cpu)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/health_generate")).status == 200
