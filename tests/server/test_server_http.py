"""The HTTP server over a fake engine: generation endpoints, streaming, aborts, metrics, info."""

import asyncio
import math
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, build_tokenizer, parse_sse, pieces_to_ids

from pdjax.server.registry import STATE_KEY

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "Hello"}]


def reply_ids(tok, text):
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


async def wait_for(cond, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def deltas_of(events, kind):
    """Concatenated text per choice index from OpenAI stream events."""
    out = {}
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        c = e["choices"][0]
        piece = c["delta"].get("content", "") if kind == "chat" else c["text"]
        out.setdefault(c["index"], []).append(piece)
    return out


# -------------------------------------------------------------------------------------------
# Basic generation
# -------------------------------------------------------------------------------------------

async def test_completion_text_usage_and_finish(make_client):
    client, engine = await make_client()
    tok = engine.tokenizer
    resp = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hello",
                                                      "max_tokens": 50})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == engine.reply
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == tok.eos_token_id
    prompt_len = len(tok.encode("Hello"))
    n_out = len(reply_ids(tok, engine.reply))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": n_out,
                             "total_tokens": prompt_len + n_out,
                             "prompt_tokens_details": {"cached_tokens": min(4, prompt_len - 1)}}
    # max_tokens cuts the reply: finish_reason length, exactly that many tokens.
    resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["text"] == tok.decode(reply_ids(tok, engine.reply)[:3])
    # The default max_tokens of /v1/completions is 16 (OpenAI's).
    long_engine = FakeEngine(reply="One two three four five six seven eight nine ten. " * 3)
    client2, _ = await make_client(long_engine)
    body = await (await client2.post("/v1/completions", json={"prompt": "Hi"})).json()
    assert body["usage"]["completion_tokens"] == 16


async def test_chat_uses_template_and_model_names(make_client):
    client, engine = await make_client()
    resp = await client.post("/v1/chat/completions", json={"model": "fake-org/fake-model",
                                                           "messages": CHAT})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-org/fake-model"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": engine.reply,
                                             "tool_calls": None}
    expected_prompt = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                           tokenize=False)
    assert expected_prompt.endswith("<|im_start|>assistant\n")
    assert engine.submitted[-1].input_ids == engine.tokenizer.encode(expected_prompt,
                                                                     add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(engine.submitted[-1].input_ids)
    # developer role maps to system; text parts are joined.
    resp = await client.post("/v1/chat/completions", json={"messages": [
        {"role": "developer", "content": "answer briefly"},
        {"role": "user", "content": [{"type": "text", "text": "Hel"},
                                     {"type": "text", "text": "lo"}]}]})
    assert resp.status == 200
    assert engine.submitted[-1].input_ids == engine.submitted[-2].input_ids


async def test_generate_single_and_batch_with_n(make_client):
    client, engine = await make_client()
    tok = engine.tokenizer
    resp = await client.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}, "rid": "my-rid"})
    body = await resp.json()
    assert resp.status == 200 and isinstance(body, dict)
    assert body["text"] == tok.decode(reply_ids(tok, engine.reply)[:4])
    assert body["output_ids"] == reply_ids(tok, engine.reply)[:4]
    meta = body["meta_info"]
    assert meta["id"] == "my-rid" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(tok.encode("Hello")) and meta["completion_tokens"] == 4

    # Batch of 2 prompts x n=2: SGLang order k = j * batch + i, rids rid_k.
    resp = await client.post("/generate", json={
        "input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2, "n": 2},
        "rid": "b"})
    body = await resp.json()
    assert resp.status == 200 and len(body) == 4
    assert [o["meta_info"]["id"] for o in body] == ["b_0", "b_1", "b_2", "b_3"]
    assert [o["meta_info"]["prompt_tokens"] for o in body] == [3, 2, 3, 2]
    subs = {r.rid: r for r in engine.submitted}
    assert subs["b_0"].input_ids == [5, 6, 7] and subs["b_1"].input_ids == [8, 9]
    assert subs["b_2"].input_ids == [5, 6, 7] and subs["b_3"].input_ids == [8, 9]
    # Per-prompt sampling params in a batch.
    resp = await client.post("/generate", json={
        "text": ["Hello", "One"], "sampling_params": [{"max_new_tokens": 1},
                                                      {"max_new_tokens": 3}]})
    body = await resp.json()
    assert [o["meta_info"]["completion_tokens"] for o in body] == [1, 3]


async def test_generate_logprobs_in_sglang_format(make_client):
    client, engine = await make_client()
    resp = await client.post("/generate", json={
        "input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
        "return_text_in_logprobs": True})
    meta = (await resp.json())["meta_info"]
    out = reply_ids(engine.tokenizer, engine.reply)[:3]
    texts = [engine.tokenizer.decode([t]) for t in out]
    assert meta["output_token_logprobs"] == [
        [pytest.approx(-0.5 - 0.01 * i), out[i], texts[i]] for i in range(3)]
    assert meta["input_token_logprobs"] == [
        [pytest.approx(-1.0 - 0.001 * p), t, engine.tokenizer.decode([t])]
        for p, t in zip(range(1, 4), [12, 13, 14])]
    assert len(meta["output_top_logprobs"]) == 3
    assert [e[1] for e in meta["output_top_logprobs"][0]] == [out[0], out[0] + 1]
    assert meta["output_top_logprobs"][1][1][0] == pytest.approx(-0.51 - 1)
    assert len(meta["input_top_logprobs"]) == 3
    # Without return_logprob no logprob fields appear.
    resp = await client.post("/generate", json={"input_ids": [11, 12]})
    meta = (await resp.json())["meta_info"]
    assert "output_token_logprobs" not in meta


async def test_openai_logprobs(make_client):
    client, engine = await make_client()
    tok = engine.tokenizer
    out = reply_ids(tok, engine.reply)
    body = await (await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 3, "logprobs": 2})).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in out[:3]]
    assert lp["token_logprobs"] == [pytest.approx(-0.5), pytest.approx(-0.51), pytest.approx(-0.52)]
    assert list(lp["top_logprobs"][0].values()) == [pytest.approx(-0.5), pytest.approx(-1.5)]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    body = await (await client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in out[:2]]
    assert content[0]["bytes"] == list(tok.decode([out[0]]).encode())
    assert content[1]["top_logprobs"] == [{"token": tok.decode([out[1]]),
                                           "logprob": pytest.approx(-0.51),
                                           "bytes": list(tok.decode([out[1]]).encode())}]
    body = await (await client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2})).json()
    assert body["choices"][0]["logprobs"] is None


# -------------------------------------------------------------------------------------------
# Streaming
# -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_stream_equals_non_stream_with_usage(make_client, kind):
    text = "The capital of France is Paris. Price 5€ 😀 é!"
    engine = FakeEngine(reply=text, tokens_per_step=2)
    client, _ = await make_client(engine)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    base = {"prompt": "Hello"} if kind == "completion" else {"messages": CHAT}
    base.update(max_tokens=100, n=2, stop=["Paris"])
    plain = await (await client.post(path, json=base)).json()
    resp = await client.post(path, json={**base, "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    streamed = deltas_of(events, kind)
    for choice in plain["choices"]:
        got = "".join(streamed[choice["index"]])
        want = choice["text"] if kind == "completion" else choice["message"]["content"]
        assert got == want == "The capital of France is "
        assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "Paris"
    finals = [e["choices"][0] for e in events[:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]
    assert all(e["usage"] is None for e in events[:-2])
    if kind == "chat":
        assert [e["choices"][0]["delta"] for e in events[:2]] == [
            {"role": "assistant", "content": ""}] * 2


async def test_generate_stream_is_cumulative_and_matches(make_client):
    client, engine = await make_client(FakeEngine(reply="Hello € world", tokens_per_step=1))
    plain = await (await client.post("/generate", json={"text": "Hi"})).json()
    resp = await client.post("/generate", json={"text": "Hi", "stream": True})
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all("\ufffd" not in t for t in texts)
    assert texts[-1] == plain["text"] == "Hello € world"
    assert events[-2]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
    # A batch stream tags each event with its sample index.
    resp = await client.post("/generate", json={"text": ["Hi", "One"], "stream": True,
                                                "sampling_params": {"max_new_tokens": 3}})
    events = parse_sse(await resp.text())
    final = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(final) == [0, 1]
    assert all(e["meta_info"]["completion_tokens"] == 3 for e in final.values())


async def test_stop_string_split_across_tokens_never_leaks(make_client):
    tok = build_tokenizer()
    pieces = ["Hello", " wor", "ld", " S", "T", "O", "P", " and", " more", " words"]
    ids = pieces_to_ids(tok, pieces) + [tok.eos_token_id]
    engine = FakeEngine(reply_ids=lambda req: ids)
    client, _ = await make_client(engine)
    resp = await client.post("/v1/completions", json={"prompt": "Hi", "stop": "STOP",
                                                      "stream": True, "max_tokens": 50,
                                                      "rid": "stop-test"})
    events = parse_sse(await resp.text())
    pieces_out = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces_out) == "Hello world "
    assert not any(set(p) & set("STOP") for p in pieces_out)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"][0]["matched_stop"] == "STOP"
    # The server aborted the request in the engine (which would have gone on) and freed it.
    await wait_for(lambda: "stop-test" in engine.aborted)
    await wait_for(lambda: engine.get_load()["num_used_pages"] == 0)
    body = await (await client.post("/v1/completions", json={
        "prompt": "Hi", "stop": ["STOP"], "max_tokens": 50})).json()
    assert body["choices"][0]["text"] == "Hello world "
    assert body["usage"]["completion_tokens"] == len(pieces_to_ids(tok, pieces[:7]))


async def test_broken_utf8_never_streamed(make_client):
    tok = build_tokenizer()
    text = "é😀€ ok 😀"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)            # multi-byte characters span several tokens
    client, _ = await make_client(FakeEngine(reply=text))
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    events = parse_sse(await resp.text())
    pieces = deltas_of(events, "chat")[0]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


async def test_stream_error_event_and_http_errors(make_client):
    engine = FakeEngine()
    client, _ = await make_client(engine)
    engine.fail_after = 3
    resp = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20})
    assert resp.status == 500
    assert "injected engine failure" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    events = parse_sse(await resp.text())
    assert resp.status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "injected engine failure"
    assert "".join(deltas_of(events[:-2], "chat")[0]) == engine.tokenizer.decode(
        reply_ids(engine.tokenizer, engine.reply)[:3])
    # A failure before the first token is a plain HTTP error, even for a stream.
    engine.fail_after = 0
    resp = await client.post("/generate", json={"text": "Hi", "stream": True})
    assert resp.status == 500
    engine.fail_after = None
    engine.reject = ValueError("prompt does not fit the KV pool")
    resp = await client.post("/generate", json={"text": "Hi"})
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "prompt does not fit the KV pool"
    engine.reject = None
    assert (await client.post("/generate", json={"text": "Hi"})).status == 200


async def test_a_request_failed_by_its_grammar_mid_generation_names_the_field(make_client):
    """A grammar that compiled but refuses a token later (the grammar library's limits) ends
    the request as a 400 whose ``param`` is the grammar's field, streamed or not (it was null)."""
    from pdjax.request import FinishReason

    engine = FakeEngine()
    client, _ = await make_client(engine)
    message = "response_format: token 7 was not allowed (limit reached)"
    engine.fail_after, engine.fail_with = 2, FinishReason.abort(message, 400, "response_format")
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT})
    assert resp.status == 400
    assert (await resp.json())["error"] == {"message": message, "type": "invalid_request_error",
                                             "param": "response_format", "code": 400}
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    events = parse_sse(await resp.text())
    assert events[-2]["error"]["param"] == "response_format" and events[-1] == "[DONE]"
    engine.fail_after = 0                 # before the first token: a plain HTTP error
    resp = await client.post("/generate", json={"text": "Hi", "stream": True})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "response_format"


# -------------------------------------------------------------------------------------------
# Aborts
# -------------------------------------------------------------------------------------------

async def test_client_disconnect_mid_stream_aborts_and_frees_pages(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    baseline = engine.get_load()
    resp = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "stream": True, "n": 2, "max_tokens": 5000,
        "stream_options": {"include_usage": True}, "rid": "gone", "ignore_eos": True})
    assert resp.status == 200
    for _ in range(6):
        assert (await resp.content.readline()).startswith((b"data: ", b"\n"))
    await wait_for(lambda: engine.get_load()["num_used_pages"] > 0)
    resp.close()                     # the client goes away mid-stream
    await wait_for(lambda: {"gone_0", "gone_1"} <= set(engine.aborted))
    await wait_for(lambda: engine.get_load() == baseline)
    assert engine.get_load()["kv_usage"] == 0.0
    state = client.server.app[STATE_KEY]
    await wait_for(lambda: state.num_inflight == 0)
    assert not state._by_rid


async def test_client_disconnect_non_stream_aborts(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    task = asyncio.ensure_future(client.post("/generate", json={
        "text": "Hi", "rid": "slow", "sampling_params": {"max_new_tokens": 5000,
                                                          "ignore_eos": True}}))
    await wait_for(lambda: engine.num_live == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: "slow" in engine.aborted)
    await wait_for(lambda: engine.num_live == 0)


async def test_abort_request_endpoint(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    task = asyncio.ensure_future(client.post("/generate", json={
        "text": "Hi", "rid": "victim", "sampling_params": {"max_new_tokens": 5000,
                                                            "ignore_eos": True, "n": 2}}))
    await wait_for(lambda: engine.num_live == 2)
    resp = await client.post("/abort_request", json={"rid": "victim"})
    assert (await resp.json()) == {"success": True, "num_aborted": 2}
    body = await (await task).json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in body] == ["abort", "abort"]
    assert {"victim_0", "victim_1"} <= set(engine.aborted)
    assert engine.num_live == 0
    resp = await client.post("/abort_request", json={"rid": 5})
    assert resp.status == 400
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 200


async def test_duplicate_rid_in_flight_is_rejected(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    body = {"text": "Hi", "rid": "dup", "sampling_params": {"max_new_tokens": 5000,
                                                            "ignore_eos": True}}
    task = asyncio.ensure_future(client.post("/generate", json=body))
    await wait_for(lambda: engine.num_live == 1)
    resp = await client.post("/generate", json=body)
    assert resp.status == 400 and "dup" in (await resp.json())["error"]["message"]
    await client.post("/abort_request", json={"rid": "dup"})
    assert (await task).status == 200


# -------------------------------------------------------------------------------------------
# n > 1 and PD fields
# -------------------------------------------------------------------------------------------

async def test_n2_gives_each_sample_its_own_room_and_seed(make_client):
    client, engine = await make_client()
    resp = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "n": 2, "seed": 7, "max_tokens": 3, "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998, "bootstrap_room": [111, 222]})
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    subs = engine.submitted[-2:]
    assert [r.rid for r in subs] == [f"{body['id']}_0", f"{body['id']}_1"]
    assert [r.bootstrap_room for r in subs] == [111, 222]
    assert [r.bootstrap_host for r in subs] == ["10.0.0.1"] * 2
    assert [r.bootstrap_port for r in subs] == [8998] * 2
    assert [r.sampling_params.seed for r in subs] == [7, 8]
    assert subs[0].sampling_params is not subs[1].sampling_params
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens"] == len(subs[0].input_ids)
    # A scalar room gives sample k the room + k (SGLang); completions with 2 prompts x n=2.
    resp = await client.post("/v1/completions", json={
        "prompt": ["Hello", "One"], "n": 2, "max_tokens": 2, "bootstrap_room": 1000,
        "bootstrap_host": "10.0.0.2"})
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    subs = engine.submitted[-4:]
    assert [r.bootstrap_room for r in subs] == [1000, 1001, 1002, 1003]
    tok = engine.tokenizer
    assert [r.input_ids for r in subs] == [tok.encode("Hello")] * 2 + [tok.encode("One")] * 2
    # /generate, PD fields per sample, bootstrap_port null means the server's default.
    resp = await client.post("/generate", json={
        "text": "Hi", "sampling_params": {"n": 2, "max_new_tokens": 1},
        "bootstrap_host": ["h1", "h2"], "bootstrap_port": None, "bootstrap_room": [5, 6]})
    assert resp.status == 200
    subs = engine.submitted[-2:]
    assert [(r.bootstrap_host, r.bootstrap_port, r.bootstrap_room) for r in subs] == [
        ("h1", None, 5), ("h2", None, 6)]


# -------------------------------------------------------------------------------------------
# Metrics, health, info, control
# -------------------------------------------------------------------------------------------

def scrape(text):
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else str(sorted(s.labels.items())))
            values[key] = s.value
    return values


async def test_metrics_parse_and_move(make_client):
    client, engine = await make_client()
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    before = scrape(await resp.text())
    assert before["pdjax:prompt_tokens_total"] == 0
    assert before["pdjax:compile_count_total"] == 0
    body = await (await client.post("/v1/completions", json={"prompt": "Hello", "n": 2,
                                                            "max_tokens": 4})).json()
    body2 = await (await client.post("/v1/completions", json={"prompt": "Hello",
                                                             "max_tokens": 50})).json()
    engine.metrics.compile_count.inc()
    after = scrape(await (await client.get("/metrics")).text())
    prompt_len = len(engine.tokenizer.encode("Hello"))
    assert after["pdjax:prompt_tokens_total"] == 3 * prompt_len
    assert after["pdjax:generation_tokens_total"] == (body["usage"]["completion_tokens"]
                                                       + body2["usage"]["completion_tokens"])
    assert after["pdjax:num_requests_total[('finish_reason', 'length')]"] == 2
    assert after["pdjax:num_requests_total[('finish_reason', 'stop')]"] == 1
    assert after["pdjax:time_to_first_token_seconds_count"] == 3
    assert after["pdjax:e2e_request_latency_seconds_count"] == 3
    assert after["pdjax:inter_token_latency_seconds_count"] == (
        after["pdjax:generation_tokens_total"] - 3)
    assert after["pdjax:cached_tokens_total"] == 3 * min(4, prompt_len - 1)
    assert after["pdjax:compile_count_total"] == 1
    assert after["pdjax:num_running_reqs"] == 0 and after["pdjax:kv_usage"] == 0


async def test_metrics_gauges_follow_load(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    task = asyncio.ensure_future(client.post("/generate", json={
        "text": "Hi", "rid": "g", "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}))
    await wait_for(lambda: engine.num_live == 1)
    values = scrape(await (await client.get("/metrics")).text())
    assert values["pdjax:num_running_reqs"] == 1
    assert values["pdjax:num_used_pages"] >= 1
    assert values["pdjax:kv_usage"] == pytest.approx(values["pdjax:num_used_pages"] / 128)
    await client.post("/abort_request", json={"rid": "g"})
    await task
    values = scrape(await (await client.get("/metrics")).text())
    assert values["pdjax:num_running_reqs"] == 0
    assert values["pdjax:num_requests_total[('finish_reason', 'abort')]"] == 1


async def test_health_and_health_generate(make_client):
    engine = FakeEngine(ready=False, disaggregation_mode="prefill")
    client, _ = await make_client(engine)
    assert (await client.get("/health")).status == 503
    assert (await client.get("/health_generate")).status == 503
    resp = await client.post("/generate", json={"text": "Hi"})
    assert resp.status == 503 and "warming up" in (await resp.json())["error"]["message"]
    engine.is_ready = True
    assert (await client.get("/health")).status == 200
    resp = await client.get("/health_generate")
    assert resp.status == 200
    req = engine.submitted[-1]
    assert req.sampling_params.max_new_tokens == 1 and req.bootstrap_host == "2.2.2.2"
    assert 0 < req.bootstrap_room < 2 ** 63
    values = scrape(await (await client.get("/metrics")).text())
    assert values["pdjax:prompt_tokens_total"] == 0         # health checks are not traffic
    engine.fail_after = 0
    assert (await client.get("/health_generate")).status == 503


async def test_info_endpoints(make_client):
    client, engine = await make_client(served_model_name="my-name")
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "my-name"
    assert models["data"][0]["max_model_len"] == engine.context_length
    for path in ("/model_info", "/get_model_info"):
        info = await (await client.get(path)).json()
        assert info["model_path"] == "fake-org/fake-model" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = await (await client.get(path)).json()
        assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
        assert info["version"] == "0.0-test"
        assert info["internal_states"][0]["num_total_pages"] == 128
    assert (await (await client.get("/get_load")).json())["num_total_pages"] == 128
    resp = await client.post("/v1/chat/completions", json={"model": "my-name", "messages": CHAT})
    assert resp.status == 200
    resp = await client.post("/v1/chat/completions", json={"model": "fake-model",
                                                           "messages": CHAT})
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
    assert (await client.get("/nope")).status == 404


async def test_tokenize_and_detokenize(make_client):
    client, engine = await make_client()
    tok = engine.tokenizer
    text = "Hello world, the quick brown fox."
    body = await (await client.post("/tokenize", json={"prompt": text})).json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"]) > 3
    assert body["max_model_len"] == engine.context_length and "token_strs" not in body
    body = await (await client.post("/tokenize", json={"prompt": text, "return_token_strs": True,
                                                       "add_special_tokens": False})).json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    # messages: the ids a chat request would submit.
    resp = await client.post("/v1/chat/completions", json={"messages": CHAT})
    assert resp.status == 200
    chat = await (await client.post("/tokenize", json={"messages": CHAT})).json()
    assert chat["tokens"] == engine.submitted[-1].input_ids
    bare = await (await client.post("/tokenize", json={"messages": CHAT,
                                                       "add_generation_prompt": False})).json()
    assert chat["tokens"][:len(bare["tokens"])] == bare["tokens"]
    assert len(bare["tokens"]) < len(chat["tokens"])
    back = await (await client.post("/detokenize", json={"tokens": chat["tokens"]})).json()
    assert back["prompt"] == tok.decode(chat["tokens"]) and "<|im_start|>assistant" in back["prompt"]
    assert (await (await client.post("/detokenize", json={"tokens": []})).json()) == {"prompt": ""}
    for path, bad, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
            ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
            ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"messages": CHAT, "chat_template_kwargs": 3}, "chat_template_kwargs"),
            ("/detokenize", {"tokens": [1, len(tok)]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, "tokens"),
            ("/detokenize", {"tokens": [True]}, "tokens")):
        resp = await client.post(path, json=bad)
        assert resp.status == (404 if param == "model" else 400), (path, bad)
        assert (await resp.json())["error"]["param"] == param, (path, bad)
    assert (await client.post("/tokenize", data=b"{not json")).status == 400
    n = len(engine.submitted)
    await client.post("/tokenize", json={"prompt": text})
    assert len(engine.submitted) == n  # nothing reached the engine


async def test_tokenize_and_parsers_through_the_pd_router(make_client):
    """The router answers the stateless endpoints from its first prefill server, status and
    body unchanged (``--role pd`` serves only the router's URL)."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdjax.router import PDRouter, create_router_app

    prefill, engine = await make_client(reasoning_parser="qwen3")
    decode, _ = await make_client()
    router = PDRouter([(str(prefill.make_url("")), 8998)], [str(decode.make_url(""))])
    rclient = TestClient(TestServer(create_router_app(router)))
    await rclient.start_server()
    try:
        text = "Hello world, the quick brown fox."
        for path, body in (("/tokenize", {"prompt": text}), ("/tokenize", {"messages": CHAT}),
                           ("/detokenize", {"tokens": engine.tokenizer.encode(text)}),
                           ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [-1]}),
                           ("/separate_reasoning",
                            {"text": "<think>a\n</think>\nb", "reasoning_parser": "qwen3"}),
                           ("/parse_function_call", {"text": "x", "tools": [],
                                                     "tool_call_parser": "nope"})):
            direct = await prefill.post(path, json=body)
            routed = await rclient.post(path, json=body)
            assert routed.status == direct.status, (path, body)
            assert await routed.json() == await direct.json(), (path, body)
        resp = await rclient.post("/tokenize", json={"prompt": text})
        assert (await resp.json())["tokens"] == engine.tokenizer.encode(text)
        resp = await rclient.post("/tokenize", data=b"{not json")
        assert resp.status == 400 and "malformed JSON" in (await resp.json())["error"]["message"]
        assert engine.submitted == []
        await prefill.close()
        resp = await rclient.post("/tokenize", json={"prompt": text})
        assert resp.status == 502 and (await resp.json())["error"]["type"] == "router_error"
    finally:
        await rclient.close()


async def test_the_router_answers_a_clients_mistakes_as_the_servers_do(make_client):
    """A bad body, an unknown path or method at the PD router: the servers' JSON error body
    typed by status, not ``router_error``, and not counted as a routing error (they were
    plain text, ``router_error`` and counted: a new user's report)."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdjax.router import PDRouter, create_router_app

    prefill, engine = await make_client()
    decode, _ = await make_client()
    router = PDRouter([(str(prefill.make_url("")), 8998)], [str(decode.make_url(""))])
    rclient = TestClient(TestServer(create_router_app(router)))
    await rclient.start_server()
    try:
        for method, path, data, status, kind in (
                ("post", "/generate", b"{not json", 400, "invalid_request_error"),
                ("post", "/v1/completions", b"\xff\xfe", 400, "invalid_request_error"),
                ("post", "/v1/completions", b'{"prompt": "a", "n": 0}', 400,
                 "invalid_request_error"),
                ("get", "/nope", None, 404, "not_found_error"),
                ("get", "/generate", None, 405, "invalid_request_error")):
            resp = await getattr(rclient, method)(path, data=data)
            assert resp.status == status, (path, data, await resp.text())
            err = (await resp.json())["error"]
            assert err["type"] == kind and err["code"] == status, err
        metrics = await (await rclient.get("/metrics")).text()
        # n = 0 was routed and refused by the servers (their 4xx, passed on): no failure.
        assert "pdjax_router_errors_total 0" in metrics
        assert "pdjax_router_requests_total 1" in metrics
        assert engine.submitted == []
    finally:
        await rclient.close()


async def test_flush_cache_and_profile(make_client, tmp_path):
    client, engine = await make_client()
    resp = await client.post("/flush_cache")
    assert resp.status == 200
    resp = await client.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 3})
    trace_dir = (await resp.json())["trace_dir"]
    assert trace_dir.startswith(str(tmp_path))
    resp = await client.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert resp.status == 400 and "already" in (await resp.json())["error"]["message"]
    assert (await client.post("/start_profile", json={"num_steps": 0})).status == 400
    resp = await client.post("/stop_profile")
    assert (await resp.json())["trace_dir"] == trace_dir
    assert os.path.exists(os.path.join(trace_dir, "trace.json"))
    assert (await client.post("/stop_profile")).status == 400


async def test_api_key(make_client):
    client, _ = await make_client(api_key="sekret")
    body = {"prompt": "Hi", "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 401
    resp = await client.post("/v1/completions", json=body,
                             headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    resp = await client.post("/v1/completions", json=body,
                             headers={"Authorization": "Bearer sekret"})
    assert resp.status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_drain_rejects_new_requests_and_lets_running_finish(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    state = client.server.app[STATE_KEY]
    running = asyncio.ensure_future(client.post("/generate", json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}))
    await wait_for(lambda: engine.num_live == 1)
    drain = asyncio.ensure_future(state.drain(timeout_s=10.0))
    await wait_for(lambda: state.draining)
    resp = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert resp.status == 503
    assert (await client.get("/health")).status == 503
    body = await (await running).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    await asyncio.wait_for(drain, 5)


async def test_drain_timeout_aborts_the_rest(make_client):
    engine = FakeEngine(step_s=0.01, context_length=100000)
    client, _ = await make_client(engine)
    state = client.server.app[STATE_KEY]
    running = asyncio.ensure_future(client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 90000, "ignore_eos": True, "stream": True}))
    await wait_for(lambda: engine.num_live == 1)
    await asyncio.wait_for(state.drain(timeout_s=0.2), 5)
    resp = await running
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert engine.num_live == 0 and len(engine.aborted) == 1
    assert math.isclose(engine.get_load()["kv_usage"], 0.0)
