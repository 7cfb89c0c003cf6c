"""Every bad input gets HTTP 400 naming the field, and the next valid request still works."""

import json
import random

import pytest

pytestmark = pytest.mark.asyncio

CTX = 256              # FakeEngine's default context length
VOCAB = 400            # the test tokenizer's vocabulary
MSG = [{"role": "user", "content": "Hello"}]
NAN = float("nan")

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
GEN = "/generate"

VALID = {CMPL: {"model": "fake-model", "prompt": "Hello", "max_tokens": 4},
         CHAT: {"model": "fake-model", "messages": MSG, "max_tokens": 4},
         GEN: {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}}


def with_(path, **fields):
    body = dict(VALID[path])
    body.update(fields)
    return body


CASES = [
    # (path, body (bytes = raw), text the error message must contain)
    (CMPL, b"{not json", "malformed JSON"),
    (CHAT, b'{"messages": [', "malformed JSON"),
    (GEN, b"", "empty"),
    (CMPL, b"[1, 2]", "JSON object"),
    (CMPL, {"model": "fake-model"}, "prompt"),
    (CMPL, with_(CMPL, prompt=""), "prompt"),
    (CMPL, with_(CMPL, prompt=[]), "prompt"),
    (CMPL, with_(CMPL, prompt=5), "prompt"),
    (CMPL, with_(CMPL, prompt=[1, -2]), "prompt"),
    (CMPL, with_(CMPL, prompt=[[1, VOCAB]]), "prompt"),
    (CMPL, with_(CMPL, prompt=[3] * CTX), "context length"),
    (CMPL, with_(CMPL, prompt="Hello " * 300), "context length"),
    (CMPL, with_(CMPL, temperature="hot"), "temperature"),
    (CMPL, with_(CMPL, temperature=NAN), "temperature"),
    (CMPL, with_(CMPL, temperature=float("inf")), "temperature"),
    (CMPL, with_(CMPL, temperature=-0.5), "temperature"),
    (CMPL, with_(CMPL, top_p=0), "top_p"),
    (CMPL, with_(CMPL, top_p=1.5), "top_p"),
    (CMPL, with_(CMPL, top_p=NAN), "top_p"),
    (CMPL, with_(CMPL, top_k=0), "top_k"),
    (CMPL, with_(CMPL, top_k=-2), "top_k"),
    (CMPL, with_(CMPL, top_k=2.5), "top_k"),
    (CMPL, with_(CMPL, min_p=2), "min_p"),
    (CMPL, with_(CMPL, n=0), "n"),
    (CMPL, with_(CMPL, n=-1), "n"),
    (CMPL, with_(CMPL, max_tokens=-1), "max_tokens"),
    (CMPL, with_(CMPL, max_tokens=10 ** 12), "max_tokens"),
    (CMPL, with_(CMPL, max_tokens=CTX + 1), "max_tokens"),
    (CMPL, with_(CMPL, max_tokens="8"), "max_tokens"),
    (CMPL, with_(CMPL, max_tokens=1.5), "max_tokens"),
    (CMPL, with_(CMPL, stream="yes"), "stream"),
    (CMPL, with_(CMPL, stream_options={"include_usage": True}), "stream_options"),
    (CMPL, with_(CMPL, stream=True, stream_options={"bogus": 1}), "stream_options.bogus"),
    (CMPL, with_(CMPL, stop=[""]), "stop"),
    (CMPL, with_(CMPL, stop=5), "stop"),
    (CMPL, with_(CMPL, stop_token_ids=[-1]), "stop_token_ids"),
    (CMPL, with_(CMPL, seed="x"), "seed"),
    (CMPL, with_(CMPL, frequency_penalty=3), "frequency_penalty"),
    (CMPL, with_(CMPL, presence_penalty="a"), "presence_penalty"),
    (CMPL, with_(CMPL, repetition_penalty=0), "repetition_penalty"),
    (CMPL, with_(CMPL, ignore_eos="no"), "ignore_eos"),
    (CMPL, with_(CMPL, logprobs=21), "logprobs"),
    (CMPL, with_(CMPL, logprobs=True), "logprobs"),
    (CMPL, with_(CMPL, echo=True, logprobs=1), "echo"),
    (CMPL, with_(CMPL, suffix="tail"), "suffix"),
    (CMPL, with_(CMPL, best_of=2), "best_of"),
    (CMPL, with_(CMPL, logit_bias={str(VOCAB): 10}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={"5": 100.5}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={"5": "up"}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={"-5": 1}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={"five": 1}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={"5": 1, "05": 2}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (CMPL, with_(CMPL, logit_bias=[5, 10]), "logit_bias"),
    (CHAT, with_(CHAT, logit_bias={"5": NAN}), "logit_bias"),
    (GEN, {"text": "Hi", "sampling_params": {"logit_bias": {str(VOCAB + 3): 1}}}, "logit_bias"),
    (CMPL, with_(CMPL, stop_token_ids=[VOCAB]), "stop_token_ids: token id 400 is outside"),
    (CHAT, with_(CHAT, stop_token_ids=[5, VOCAB + 1]), "stop_token_ids: token id 401"),
    (GEN, {"text": "Hi", "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    (CMPL, with_(CMPL, frobnicate=1), "frobnicate"),
    (CMPL, with_(CMPL, bootstrap_room=-1), "bootstrap_room"),
    (CMPL, with_(CMPL, bootstrap_room=2 ** 63), "bootstrap_room"),
    (CMPL, with_(CMPL, n=2, bootstrap_room=[1]), "bootstrap_room"),
    (CMPL, with_(CMPL, n=2, bootstrap_room=[3, 3]), "bootstrap_room"),
    (CMPL, with_(CMPL, bootstrap_port=0), "bootstrap_port"),
    (CMPL, with_(CMPL, bootstrap_host=7), "bootstrap_host"),
    (CMPL, with_(CMPL, rid=""), "rid"),
    (CHAT, {"model": "fake-model"}, "messages"),
    (CHAT, with_(CHAT, messages=[]), "messages"),
    (CHAT, with_(CHAT, messages="hi"), "messages"),
    (CHAT, with_(CHAT, messages=[{"role": "bot", "content": "x"}]), "role"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": 5}]), "content"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "image_url"),
    (CHAT, with_(CHAT, messages=[{"role": "tool", "content": "x"}]), "tool_call_id"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
     "tool_call_id"),
    (CHAT, with_(CHAT, messages=[{"role": "function", "content": "x", "name": "f"}]), "function"),
    (CHAT, with_(CHAT, messages=[{"role": "assistant", "content": "x",
                                  "tool_calls": [{"id": "1"}]}]), "tool_calls"),
    (CHAT, with_(CHAT, messages=[{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "tool_calls[0].function.arguments"),
    (CHAT, with_(CHAT, messages=[{"role": "assistant", "tool_calls": [     # was a 500
        {"id": "1", "type": "function", "function": {"name": "f",
                                                     "arguments": "[" * 5000 + "]" * 5000}}]}]),
     "tool_calls[0].function.arguments"),
    (GEN, {"text": "hi", "sampling_params": {"json_schema": "[" * 5000 + "]" * 5000}},
     "nested too deeply"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "tool_calls"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "x", "reasoning_content": "r"}]),
     "reasoning_content"),
    (CHAT, with_(CHAT, messages=[{"role": "assistant", "content": "x", "reasoning_content": 5}]),
     "reasoning_content"),
    # No --tool-call-parser on this server: tools that may be called are refused.
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
     "--tool-call-parser"),
    (CHAT, with_(CHAT, tool_choice="auto"), "tool_choice"),
    (CHAT, with_(CHAT, tools={"type": "function"}), "tools"),
    (CHAT, with_(CHAT, tools=[{"type": "code", "function": {"name": "f"}}]), "tools[0].type"),
    (CHAT, with_(CHAT, tools=[{"type": "function"}]), "tools[0].function"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "bad name"}}]),
     "tools[0].function.name"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f",
                                                                  "parameters": []}}]),
     "tools[0].function.parameters"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]),
     "tools[0].function.extra"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}] * 2), "distinct"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                 tool_choice="always"), "tool_choice"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                 tool_choice={"type": "function", "name": "f"}), "tool_choice"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                 tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                 parallel_tool_calls="yes"), "parallel_tool_calls"),
    (CHAT, with_(CHAT, separate_reasoning="yes"), "separate_reasoning"),
    (CHAT, with_(CHAT, stream_reasoning=1), "stream_reasoning"),
    (CHAT, with_(CHAT, chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    (CHAT, with_(CHAT, functions=[{"name": "f"}]), "functions"),
    (CMPL, with_(CMPL, tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, with_(CHAT, response_format={"type": "xml"}), "response_format.type"),
    (CHAT, with_(CHAT, response_format="json"), "response_format must be an object"),
    (CHAT, with_(CHAT, response_format={"type": "json_schema"}), "response_format.json_schema"),
    (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "json_schema.name"),
    (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer",
                                                                        "minimum": "zero"}}}}}),
     "response_format"),
    (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), "response_format"),
    (CHAT, with_(CHAT, response_format={"type": "json_object", "json_schema": {}}),
     "response_format.json_schema"),
    (CHAT, with_(CHAT, audio={"voice": "x"}), "audio"),
    (CHAT, with_(CHAT, max_completion_tokens=-5), "max_completion_tokens"),
    (CHAT, with_(CHAT, top_logprobs=2), "top_logprobs"),
    (CHAT, with_(CHAT, logprobs=True, top_logprobs=30), "top_logprobs"),
    (CHAT, with_(CHAT, logprobs="yes"), "logprobs"),
    (CHAT, with_(CHAT, n=0), "n"),
    (CHAT, with_(CHAT, temperature=-1), "temperature"),
    (CHAT, with_(CHAT, chat_template_kwargs=3), "chat_template_kwargs"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "Hello " * 300}]), "context length"),
    (GEN, {"sampling_params": {}}, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, "text"),
    (GEN, {"text": ""}, "text"),
    (GEN, {"text": []}, "text"),
    (GEN, {"text": ["ok", ""]}, "text[1]"),
    (GEN, {"text": 3}, "text"),
    (GEN, {"input_ids": []}, "input_ids"),
    (GEN, {"input_ids": ["a"]}, "input_ids"),
    (GEN, {"input_ids": [1, -1]}, "input_ids"),
    (GEN, {"input_ids": [[1], [VOCAB]]}, "input_ids[1]"),
    (GEN, {"input_ids": [1] * CTX}, "context length"),
    # Refused before tokenizing (a 50 MB prompt took 66 s and 16 GB to tokenize, then a 400).
    (GEN, {"text": "ab " * 1_000_000}, "3000000 characters, at least"),
    (CHAT, with_(CHAT, messages=[{"role": "user", "content": "ab " * 1_000_000}]),
     "characters, at least"),
    (GEN, with_(GEN, sampling_params={"temperature": -1}), "temperature"),
    (GEN, with_(GEN, sampling_params={"temperature": NAN}), "temperature"),
    (GEN, with_(GEN, sampling_params={"temperature": 1e39}), "temperature must be finite in float32"),
    (GEN, with_(GEN, sampling_params={"top_p": 0}), "top_p"),
    (GEN, with_(GEN, sampling_params={"top_k": 0}), "top_k"),
    (GEN, with_(GEN, sampling_params={"max_new_tokens": -3}), "max_new_tokens"),
    (GEN, with_(GEN, sampling_params={"max_new_tokens": 10 ** 9}), "max_new_tokens"),
    (GEN, with_(GEN, sampling_params={"n": 0}), "n"),
    (GEN, with_(GEN, sampling_params={"regex": "(a+"}), "sampling_params.regex"),
    (GEN, with_(GEN, sampling_params={"regex": "a", "ebnf": "root ::= \"a\""}), "at most one"),
    (GEN, with_(GEN, sampling_params={"json_schema": "{nope"}), "sampling_params.json_schema"),
    (GEN, with_(GEN, sampling_params={"ebnf": "root ::= undefined_rule"}), "sampling_params.ebnf"),
    (GEN, with_(GEN, sampling_params={"regex": 5}), "regex must be a string"),
    (GEN, with_(GEN, sampling_params="greedy"), "sampling_params"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "n"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    (GEN, with_(GEN, return_logprob="yes"), "return_logprob"),
    (GEN, with_(GEN, return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
    (GEN, with_(GEN, return_logprob=True, logprob_start_len=99), "logprob_start_len"),
    (GEN, with_(GEN, return_logprob=True, logprob_start_len=-2), "logprob_start_len"),
    (GEN, with_(GEN, rid=5), "rid"),
    (GEN, {"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    (GEN, {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    (GEN, with_(GEN, stream=1), "stream"),
    (GEN, with_(GEN, bootstrap_port=70000), "bootstrap_port"),
    (GEN, with_(GEN, bootstrap_room="r"), "bootstrap_room"),
    (GEN, {"text": ["a", "b"], "bootstrap_room": [1, 2, 3]}, "bootstrap_room"),
    (GEN, with_(GEN, image_data="http://x/y.png"), "image_data"),
    (GEN, with_(GEN, lora_path="x"), "lora_path"),
    (GEN, with_(GEN, mystery=True), "mystery"),
    (GEN, with_(GEN, separate_reasoning=True), "--reasoning-parser"),
    (GEN, with_(GEN, separate_reasoning="yes"), "separate_reasoning"),
    # Found by a fresh user (each was a 500, or worse, before the fix):
    (CMPL, with_(CMPL, seed=-5), "seed"),
    (GEN, with_(GEN, sampling_params={"max_new_tokens": 4, "seed": -1}), "seed"),
    (CHAT, with_(CHAT, seed=2 ** 64), "seed"),
    (CMPL, b'{"model": "fake-model", "prompt": "\\ud800 x", "max_tokens": 4}', "prompt"),
    (GEN, b'{"text": "a \\udfff"}', "text"),
    (CHAT, b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    (CMPL, b"[" * 100000, "malformed JSON"),
    # Not UTF-8: named as such (json.loads guessed UTF-16 and named its codec).
    (CHAT, b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     "not valid UTF-8: byte 0xff at offset 66"),
    # OpenAI's own refusals, accepted before:
    (CHAT, with_(CHAT, messages=[{"role": "user"}]), "messages[0].content is required"),
    (CHAT, with_(CHAT, messages=[{"role": "system", "content": None},
                                 {"role": "user", "content": "Hi"}]),
     "messages[0].content is required"),
    (CHAT, with_(CHAT, user=5), "user must be a string"),
    (CMPL, with_(CMPL, user=["me"]), "user must be a string"),
    (CMPL, with_(CMPL, safety_identifier=1), "safety_identifier must be a string"),
    (CHAT, with_(CHAT, metadata={"k": 1}), "metadata must be an object of string values"),
    (CHAT, with_(CHAT, metadata="tag"), "metadata must be an object"),
]


@pytest.mark.parametrize("path,body,needle", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[2]}" for i, c in enumerate(CASES)])
async def test_bad_request_then_valid_one(make_client, path, body, needle):
    client, engine = await make_client()
    data = body if isinstance(body, bytes) else json.dumps(body)   # NaN/Infinity as JS literals
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert needle in err["message"], err
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert engine.submitted == []                      # nothing reached the engine
    resp = await client.post(path, json=VALID[path])
    assert resp.status == 200, await resp.text()
    assert len(engine.submitted) == 1


async def test_null_fields_and_defaults_are_accepted(make_client):
    client, engine = await make_client()
    body = with_(CHAT, tools=None, tool_choice="none", response_format={"type": "text"},
                 logit_bias={}, stop=None, seed=None, user="u1", n=None, top_k=-1,
                 stream_options=None, parallel_tool_calls=False, max_tokens=None,
                 max_completion_tokens=3, metadata={"team": "infra"}, service_tier="auto",
                 prompt_cache_key="k", safety_identifier="s1",
                 messages=[{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": None},
                           {"role": "user", "content": "Again"}])
    resp = await client.post(CHAT, json=body)
    assert resp.status == 200, await resp.text()
    assert engine.submitted[-1].sampling_params.max_new_tokens == 3
    resp = await client.post(CMPL, json=with_(CMPL, best_of=1, suffix=None, echo=True))
    body = await resp.json()
    assert body["choices"][0]["text"].startswith("Hello")


async def test_logit_bias_reaches_the_engine_from_every_endpoint(make_client):
    client, engine = await make_client()
    for path, body in ((CMPL, with_(CMPL, logit_bias={"5": 10, "399": -100})),
                       (CHAT, with_(CHAT, logit_bias={"5": 10, "399": -100})),
                       (GEN, {"text": "Hi", "sampling_params": {"logit_bias": {"5": 10,
                                                                               "399": -100}}})):
        resp = await client.post(path, json=body)
        assert resp.status == 200, (path, await resp.text())
        assert engine.submitted[-1].sampling_params.logit_bias == {5: 10.0, 399: -100.0}


async def test_garbage_never_breaks_the_server(make_client):
    client, engine = await make_client()
    rng = random.Random(0)
    atoms = [None, True, 0, -1, 2 ** 70, 1.5, NAN, "", "x", [], {}, [[]], [None], {"a": {}}]
    fields = ["prompt", "messages", "text", "input_ids", "sampling_params", "n", "max_tokens",
              "temperature", "stop", "logprobs", "top_logprobs", "stream", "rid",
              "bootstrap_room", "logit_bias", "stream_options", "model", "echo"]
    for _ in range(150):
        path = rng.choice([CMPL, CHAT, GEN])
        body = {f: rng.choice(atoms) for f in rng.sample(fields, rng.randint(1, 5))}
        resp = await client.post(path, data=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
        assert resp.status in (200, 400, 404), (path, body, resp.status, await resp.text())
        if resp.status == 404:          # only an unknown model is "not found"
            assert (await resp.json())["error"]["param"] == "model", body
    for path in (CMPL, CHAT, GEN):
        assert (await client.post(path, json=VALID[path])).status == 200


# Every integer field, on every endpoint: (path, field named in the error, body for a value v).
# A regression: ``top_k = 10**30`` was a 500 ("Python int too large to convert to C long").
_LP = {"return_logprob": True}
INT_FIELDS = [
    (GEN, "top_k", lambda v: {"text": "Hi", "sampling_params": {"top_k": v}}),
    (GEN, "n", lambda v: {"text": "Hi", "sampling_params": {"n": v}}),
    (GEN, "seed", lambda v: {"text": "Hi", "sampling_params": {"seed": v}}),
    (GEN, "max_new_tokens", lambda v: {"text": "Hi", "sampling_params": {"max_new_tokens": v}}),
    (GEN, "stop_token_ids", lambda v: {"text": "Hi", "sampling_params": {"stop_token_ids": [v]}}),
    (GEN, "logit_bias", lambda v: {"text": "Hi", "sampling_params": {"logit_bias": {str(v): 1}}}),
    (GEN, "logit_bias", lambda v: {"text": "Hi", "sampling_params": {"logit_bias": {v: 1}}}),
    (GEN, "top_logprobs_num", lambda v: {"text": "Hi", **_LP, "top_logprobs_num": v}),
    (GEN, "logprob_start_len", lambda v: {"text": "Hi", **_LP, "logprob_start_len": v}),
    (GEN, "input_ids", lambda v: {"input_ids": [1, v]}),
    (GEN, "input_ids", lambda v: {"input_ids": [[1], [v]]}),
    (GEN, "bootstrap_room", lambda v: {"text": "Hi", "bootstrap_room": v}),
    (GEN, "bootstrap_room", lambda v: {"text": ["a", "b"], "bootstrap_room": [1, v]}),
    (GEN, "bootstrap_port", lambda v: {"text": "Hi", "bootstrap_port": v}),
    (CMPL, "top_k", lambda v: with_(CMPL, top_k=v)),
    (CMPL, "n", lambda v: with_(CMPL, n=v)),
    (CMPL, "seed", lambda v: with_(CMPL, seed=v)),
    (CMPL, "max_tokens", lambda v: with_(CMPL, max_tokens=v)),
    (CMPL, "stop_token_ids", lambda v: with_(CMPL, stop_token_ids=[v])),
    (CMPL, "logit_bias", lambda v: with_(CMPL, logit_bias={str(v): 1})),
    (CMPL, "logprobs", lambda v: with_(CMPL, logprobs=v)),
    (CMPL, "prompt", lambda v: with_(CMPL, prompt=[1, v])),
    (CMPL, "prompt", lambda v: with_(CMPL, prompt=[[1], [v]])),
    (CMPL, "bootstrap_room", lambda v: with_(CMPL, bootstrap_room=v)),
    (CMPL, "bootstrap_port", lambda v: with_(CMPL, bootstrap_port=v)),
    (CHAT, "top_k", lambda v: with_(CHAT, top_k=v)),
    (CHAT, "n", lambda v: with_(CHAT, n=v)),
    (CHAT, "seed", lambda v: with_(CHAT, seed=v)),
    (CHAT, "max_tokens", lambda v: with_(CHAT, max_tokens=v)),
    (CHAT, "max_completion_tokens", lambda v: with_(CHAT, max_completion_tokens=v)),
    (CHAT, "stop_token_ids", lambda v: with_(CHAT, stop_token_ids=[v])),
    (CHAT, "logit_bias", lambda v: with_(CHAT, logit_bias={str(v): 1})),
    (CHAT, "top_logprobs", lambda v: with_(CHAT, logprobs=True, top_logprobs=v)),
    (CHAT, "bootstrap_room", lambda v: with_(CHAT, bootstrap_room=v)),
    ("/detokenize", "tokens", lambda v: {"tokens": [1, v]}),
]
HUGE = [2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, -(2 ** 63) - 1, -(10 ** 30)]
DIGITS = "9" * 5000          # over Python's 4300-digit int parsing limit


@pytest.mark.parametrize("path,field,make", INT_FIELDS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{i}"
                              for i, (p, f, _) in enumerate(INT_FIELDS)])
async def test_every_integer_field_is_range_checked(make_client, path, field, make):
    """An integer outside the field's range (int32 token ids and counts, int64 seeds and rooms)
    is a 400 naming the field, never a 500 or a value the engine cannot hold; the server keeps
    serving. ``seed`` and ``max_new_tokens`` accept 2**31 (their ranges are wider)."""
    client, engine = await make_client()
    for v in HUGE:
        if v == 2 ** 31 and field in ("seed", "bootstrap_room"):
            continue
        data = json.dumps(make(v))
        resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
        assert resp.status == 400, (path, field, v, await resp.text())
        err = (await resp.json())["error"]
        assert field in err["message"] and err["code"] == 400, (v, err)
    assert engine.submitted == []
    if path != "/detokenize":
        resp = await client.post(path, json=VALID[path])
        assert resp.status == 200, await resp.text()


async def test_an_integer_of_5000_digits_is_a_400(make_client):
    """Python refuses to parse an int of over 4300 digits: in the JSON body or in a
    ``logit_bias`` key it is still a 400, never a 500."""
    client, engine = await make_client()
    for path, raw in ((GEN, '{"text": "Hi", "sampling_params": {"top_k": %s}}' % DIGITS),
                      (CMPL, '{"prompt": "Hi", "logit_bias": {"%s": 1}}' % DIGITS),
                      (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], '
                             '"logit_bias": {"%s": 1}}' % DIGITS)):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400, (path, await resp.text())
    assert engine.submitted == []


async def test_the_router_answers_400_for_every_out_of_range_integer(make_client):
    """Through the PD router (its own sample-count checks, then the workers' parsers): an
    out-of-range integer is the workers' 400 naming the field, on every endpoint."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdjax.router import PDRouter, create_router_app

    prefill, p_engine = await make_client()
    decode, d_engine = await make_client()
    router = PDRouter([(str(prefill.make_url("")), 8998)], [str(decode.make_url(""))])
    rclient = TestClient(TestServer(create_router_app(router)))
    await rclient.start_server()
    try:
        for path, field, make in INT_FIELDS:
            if field.startswith("bootstrap_"):
                continue                  # the router sets them itself
            for v in (10 ** 30, -(10 ** 30)):
                resp = await rclient.post(path, json=make(v))
                assert resp.status == 400, (path, field, v, await resp.text())
                assert field in (await resp.json())["error"]["message"]
        assert p_engine.submitted == [] and d_engine.submitted == []
        resp = await rclient.post(GEN, json={"text": "Hi", "sampling_params": {"top_k": 5}})
        assert resp.status == 200, await resp.text()
    finally:
        await rclient.close()


async def test_the_largest_seed_with_n_samples_wraps_within_63_bits(make_client):
    """``seed`` may be 2**63 - 1; sample ``j`` of ``n`` uses ``seed + j``, which wraps below
    2**63 instead of failing the request."""
    client, engine = await make_client()
    top = 2 ** 63 - 1
    for path, body in ((CMPL, with_(CMPL, seed=top, n=3)), (CHAT, with_(CHAT, seed=top, n=3)),
                       (GEN, {"text": "Hi", "sampling_params": {"seed": top, "n": 3}})):
        engine.submitted.clear()
        resp = await client.post(path, json=body)
        assert resp.status == 200, (path, await resp.text())
        assert sorted(r.sampling_params.seed for r in engine.submitted) == [0, 1, top]


VALID_AFTER = {"/tokenize": {"messages": MSG}}

# (path, body, the error's ``param``, text its message must contain): each was accepted, or a
# 400 naming no field or another one, before (issue 44).
PARAM_CASES = [
    # vLLM's 400: the prompt plus the max_tokens asked for exceed the context.
    (CMPL, with_(CMPL, prompt=[3] * 200, max_tokens=57), "max_tokens",
     "max_tokens: this model's maximum context length is 256 tokens. However, you requested "
     "257 tokens (200 in the prompt, 57 in the completion)"),
    (CMPL, with_(CMPL, prompt=[[3] * 10, [3] * 250], max_tokens=7), "max_tokens",
     "you requested 257 tokens (250 in the prompt, 7 in the completion)"),
    (CHAT, with_(CHAT, max_tokens=CTX - 3), "max_tokens", "in the messages"),
    (CHAT, with_(CHAT, max_completion_tokens=CTX - 3), "max_completion_tokens",
     "max_completion_tokens: this model's maximum context length is 256 tokens"),
    (GEN, {"input_ids": [3] * 250, "sampling_params": {"max_new_tokens": 7}}, "max_new_tokens",
     "you requested 257 tokens (250 in the prompt, 7 in the completion)"),
    (GEN, {"input_ids": [[3], [3] * 250], "sampling_params": [{"max_new_tokens": 7},
                                                               {"max_new_tokens": 7}]},
     "max_new_tokens", "257 tokens"),
    # Grammars past llguidance's lexer / parser limits: compiled and followed a few tokens while
    # parsing (a 400 with a null param from the first generated token before).
    (GEN, with_(GEN, sampling_params={"regex": "a{1000000}"}), "sampling_params",
     "sampling_params.regex: the regex is too complex to follow (lexer error"),
    (GEN, with_(GEN, sampling_params={"ebnf": 'root ::= "a"{1000000}'}), "sampling_params",
     "sampling_params.ebnf: the ebnf is too complex to follow (parser error"),
    (GEN, with_(GEN, sampling_params={"json_schema": {"type": "string",
                                                      "pattern": "^(ab){300000}$"}}),
     "sampling_params", "sampling_params.json_schema: the json schema is too complex"),
    (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "pattern": "^a{1000000}$"}}}}}), "response_format",
     "response_format: the json schema is too complex to follow"),
    # chat_template_kwargs: each key named (a 400 naming messages, from a TypeError, before).
    (CHAT, with_(CHAT, chat_template_kwargs={"add_generation_prompt": "yes"}),
     "chat_template_kwargs.add_generation_prompt",
     "chat_template_kwargs.add_generation_prompt must be a boolean, got 'yes'"),
    (CHAT, with_(CHAT, chat_template_kwargs={"continue_final_message": 1}),
     "chat_template_kwargs.continue_final_message", "must be a boolean"),
    (CHAT, with_(CHAT, chat_template_kwargs={"enable_thinking": "no"}),
     "chat_template_kwargs.enable_thinking", "must be a boolean"),
    (CHAT, with_(CHAT, chat_template_kwargs={"continue_final_message": True}),
     "chat_template_kwargs.continue_final_message", "needs add_generation_prompt false"),
    (CHAT, with_(CHAT, chat_template_kwargs={"tokenize": True}),
     "chat_template_kwargs.tokenize", "set by the server"),
    (CHAT, with_(CHAT, chat_template_kwargs={"chat_template": "{{ 7 }}"}),
     "chat_template_kwargs.chat_template", "its own template"),
    (CHAT, with_(CHAT, chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools",
     "pass tools as the tools field"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": 1}},
     "chat_template_kwargs.add_generation_prompt", "must be a boolean"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"return_dict": True}},
     "chat_template_kwargs.return_dict", "set by the server"),
]


@pytest.mark.parametrize("path,body,param,needle", PARAM_CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[2]}"
                              for i, c in enumerate(PARAM_CASES)])
async def test_bad_field_is_a_400_whose_param_names_it(make_client, path, body, param, needle):
    client, engine = await make_client()
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param and needle in err["message"], err
    assert engine.submitted == []
    resp = await client.post(path, json=VALID_AFTER.get(path, VALID.get(path)))
    assert resp.status == 200, await resp.text()


async def test_chat_template_kwargs_reach_the_template(make_client):
    """``add_generation_prompt`` false (a TypeError before: the server passed it too) and
    ``continue_final_message`` render as transformers renders them; ``/tokenize`` agrees."""
    client, engine = await make_client()
    turns = MSG + [{"role": "assistant", "content": "Hi th"}]
    for kwargs, ends in (({}, "<|im_start|>assistant\n"),
                         ({"add_generation_prompt": False}, "Hi th<|im_end|>\n"),
                         ({"add_generation_prompt": False, "continue_final_message": True},
                          "Hi th")):
        resp = await client.post(CHAT, json=with_(CHAT, messages=turns,
                                                  chat_template_kwargs=kwargs))
        assert resp.status == 200, (kwargs, await resp.text())
        assert engine.prompts[-1].endswith(ends), (kwargs, engine.prompts[-1])
        resp = await client.post("/tokenize", json={"messages": turns,
                                                    "chat_template_kwargs": kwargs})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["tokens"] == engine.submitted[-1].input_ids


async def test_max_tokens_that_fit_the_context_and_the_default_clamp(make_client):
    """Up to the context's end is served as asked; an unset max_new_tokens is still cut to
    what the prompt leaves (``clamp_default_max_new``)."""
    client, engine = await make_client()
    for path, body, want in (
            (CMPL, with_(CMPL, prompt=[3] * 200, max_tokens=56), 56),
            (GEN, {"input_ids": [3] * 200, "sampling_params": {"max_new_tokens": 56}}, 56),
            (GEN, {"input_ids": [3] * 250}, 6),
            (GEN, {"input_ids": [3] * 250, "sampling_params": {"max_new_tokens": None}}, None),
            (CHAT, with_(CHAT, max_tokens=None), None)):
        resp = await client.post(path, json=body)
        assert resp.status == 200, (path, await resp.text())
        assert engine.submitted[-1].sampling_params.max_new_tokens == want, path


@pytest.mark.parametrize("path", [CHAT, CMPL])
async def test_a_model_this_server_does_not_serve_is_404(make_client, path):
    """OpenAI and vLLM answer an unknown ``model`` with 404 (the openai client raises
    ``NotFoundError``); nothing reaches the engine and the server keeps serving."""
    client, engine = await make_client()
    resp = await client.post(path, json=with_(path, model="gpt-4"))
    assert resp.status == 404, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == "model" and "'gpt-4' does not exist" in err["message"], err
    assert engine.submitted == []
    resp = await client.post(path, json=VALID[path])
    assert resp.status == 200, await resp.text()
