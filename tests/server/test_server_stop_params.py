"""``min_new_tokens`` (OpenAI: ``min_tokens``) and ``stop_regex`` over HTTP: they reach the
engine from every endpoint, bad values are a 400 naming the field (and the server keeps
serving), and a ``stop_regex`` match ends the text with finish reason ``stop``, streamed or not
(the fake engine answers "Hello world, the quick brown fox.")."""

import json

import pytest

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "Hello"}]
CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
BASE = {CMPL: {"model": "fake-model", "prompt": "Hello", "max_tokens": 12},
        CHAT: {"model": "fake-model", "messages": MSG, "max_tokens": 12},
        GEN: {"text": "Hello", "sampling_params": {"max_new_tokens": 12}}}


def body(path, **fields):
    b = json.loads(json.dumps(BASE[path]))
    if path == GEN:
        b["sampling_params"].update(fields)
    else:
        b.update({"min_tokens" if k == "min_new_tokens" else k: v for k, v in fields.items()})
    return b


async def test_min_tokens_and_stop_regex_reach_the_engine_from_every_endpoint(make_client):
    client, engine = await make_client()
    for path in (CMPL, CHAT, GEN):
        for regex, want in (("a+b", ("a+b",)), (["x\\d", "y"], ("x\\d", "y"))):
            resp = await client.post(path, json=body(path, min_new_tokens=5, stop_regex=regex))
            assert resp.status == 200, (path, await resp.text())
            sp = engine.submitted[-1].sampling_params
            assert (sp.min_new_tokens, sp.stop_regex) == (5, want), path
    resp = await client.post(CMPL, json=body(CMPL))
    assert engine.submitted[-1].sampling_params.min_new_tokens == 0


BAD = [
    (CMPL, {"min_tokens": -1}, "min_tokens", "min_tokens must be"),
    (CMPL, {"min_tokens": 13}, "min_tokens", "min_tokens (13) must be at most max_tokens (12)"),
    (CMPL, {"min_tokens": 17, "max_tokens": None}, "min_tokens", "at most max_tokens (16)"),
    (CHAT, {"min_tokens": "3"}, "min_tokens", "min_tokens must be an integer"),
    (CHAT, {"min_tokens": 13}, "min_tokens", "min_tokens (13) must be at most max_tokens"),
    (CHAT, {"min_tokens": 5, "max_tokens": None, "max_completion_tokens": 4}, "min_tokens",
     "at most max_completion_tokens (4)"),
    (GEN, {"min_new_tokens": 13}, "sampling_params",
     "sampling_params: min_new_tokens must be in [0, max_new_tokens (12)], got 13"),
    (GEN, {"min_new_tokens": 1.5}, "sampling_params", "min_new_tokens must be an integer"),
    (GEN, {"stop_regex": "(a"}, "sampling_params",
     "sampling_params: stop_regex: '(a' is not a valid regular expression"),
    (GEN, {"stop_regex": ["ok", 3]}, "sampling_params", "stop_regex must be a non-empty string"),
    (GEN, {"stop_regex": "a*"}, "sampling_params", "stop_regex: 'a*' matches the empty string"),
    (CMPL, {"stop_regex": "[z-a]"}, "stop_regex", "stop_regex: '[z-a]' is not a valid regular"),
    (CHAT, {"stop_regex": {"re": "a"}}, "stop_regex", "stop_regex must be a string or a list"),
    (CHAT, {"stop_regex": ""}, "stop_regex", "stop_regex must be a non-empty string"),
]


@pytest.mark.parametrize("path,fields,param,needle", BAD,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}" for i, c in enumerate(BAD)])
async def test_bad_values_are_a_400_naming_the_field(make_client, path, fields, param, needle):
    client, engine = await make_client()
    b = json.loads(json.dumps(BASE[path]))
    (b["sampling_params"] if path == GEN else b).update(fields)
    resp = await client.post(path, json=b)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param and needle in err["message"], err
    assert engine.submitted == []
    resp = await client.post(path, json=BASE[path])
    assert resp.status == 200, await resp.text()


async def test_stop_regex_ends_the_text_at_the_first_match(make_client):
    client, engine = await make_client()
    resp = await client.post(GEN, json=body(GEN, stop_regex=["q[a-z]+k", "f.x"]))
    out = await resp.json()
    assert out["text"] == "Hello world, the "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "q[a-z]+k"}
    assert engine.aborted                          # the engine was told to stop
    resp = await client.post(CMPL, json=body(CMPL, stop_regex="w.rld"))
    choice = (await resp.json())["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["matched_stop"]) == \
        ("Hello ", "stop", "w.rld")
    resp = await client.post(CHAT, json=body(CHAT, stop_regex=r",\s"))
    choice = (await resp.json())["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["matched_stop"]) == \
        ("Hello world", "stop", r",\s")


async def test_streamed_stop_regex_never_shows_the_match(make_client):
    client, _ = await make_client()
    resp = await client.post(CMPL, json=body(CMPL, stop_regex="qu[a-z]+ b", stream=True))
    texts, finish = [], None
    async for line in resp.content:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        texts.append(choice["text"])
        finish = choice.get("finish_reason") or finish
    assert "".join(texts) == "Hello world, the " and finish == "stop"
    assert not any("q" in t for t in texts)


async def test_min_new_tokens_past_the_default_clamp_is_a_400(make_client):
    """/generate without max_new_tokens: the default (128) is cut to what the context (256)
    leaves after the prompt; a min_new_tokens above that is a 400 naming it (the cut itself
    raised before)."""
    client, engine = await make_client()
    b = {"input_ids": [3] * 200, "sampling_params": {"min_new_tokens": 60}}
    resp = await client.post(GEN, json=b)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == "min_new_tokens" and "at most 56" in err["message"], err
    b["sampling_params"]["min_new_tokens"] = 56
    resp = await client.post(GEN, json=b)
    assert resp.status == 200, await resp.text()
    sp = engine.submitted[-1].sampling_params
    assert (sp.min_new_tokens, sp.max_new_tokens) == (56, 56)
