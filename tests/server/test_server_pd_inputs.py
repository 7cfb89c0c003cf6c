"""PD inputs: native and OpenAI fields through the same checks, the default max_new_tokens on a
short context, the fake PD host refused from clients, and the n / batch limits."""

import json

import pytest
from server_fakes import FakeEngine

from pdjax.server import validation as limits

pytestmark = pytest.mark.asyncio

GEN, CMPL = "/generate", "/v1/completions"

# (sampling field, a value of the wrong type): each must be a 400 naming the field on both APIs.
WRONG_TYPES = [("skip_special_tokens", 3), ("skip_special_tokens", "yes"), ("ignore_eos", 1),
               ("temperature", "hot"), ("top_p", [1]), ("top_k", 2.5), ("min_p", {}),
               ("seed", 1.5), ("stop", 3), ("stop", [""]), ("stop_token_ids", 3),
               ("stop_token_ids", ["a"]), ("frequency_penalty", "x"),
               ("repetition_penalty", True), ("n", 1.0), ("speculative", "no"),
               ("speculative", 0)]


@pytest.mark.parametrize("field,value", WRONG_TYPES, ids=[f"{f}={v!r}" for f, v in WRONG_TYPES])
async def test_native_fields_get_the_openai_checks(make_client, field, value):
    client, engine = await make_client()
    native = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, field: value}}
    openai = {"model": "fake-model", "prompt": "Hello", "max_tokens": 4, field: value}
    for path, body in ((GEN, native), (CMPL, openai)):
        resp = await client.post(path, json=body)
        assert resp.status == 400, (path, await resp.text())
        assert field in (await resp.json())["error"]["message"]
    assert engine.submitted == []
    resp = await client.post(GEN, json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert resp.status == 200


async def test_default_max_new_tokens_is_clamped_to_a_short_context(make_client):
    client, engine = await make_client(FakeEngine(context_length=64))
    resp = await client.post(GEN, json={"text": "hi"})
    assert resp.status == 200, await resp.text()
    prompt_len = len(engine.submitted[0].input_ids)
    assert engine.submitted[0].sampling_params.max_new_tokens == 64 - prompt_len
    # A batch with per-prompt params: each default is clamped to its own prompt.
    resp = await client.post(GEN, json={"input_ids": [[5] * 10, [6] * 60],
                                        "sampling_params": [{}, {"temperature": 0}]})
    assert resp.status == 200, await resp.text()
    assert [r.sampling_params.max_new_tokens for r in engine.submitted[1:]] == [54, 4]
    # What the client asked for is checked, never changed.
    resp = await client.post(GEN, json={"text": "hi", "sampling_params": {"max_new_tokens": 65}})
    assert resp.status == 400 and "max_new_tokens" in (await resp.json())["error"]["message"]
    resp = await client.post(GEN, json={"text": "hi", "sampling_params": {"max_new_tokens": 50}})
    assert resp.status == 200
    assert engine.submitted[-1].sampling_params.max_new_tokens == 50
    # Under a long context the default stays 128.
    client, engine = await make_client(FakeEngine(context_length=1024))
    assert (await client.post(GEN, json={"text": "hi"})).status == 200
    assert engine.submitted[0].sampling_params.max_new_tokens == 128


async def test_fake_bootstrap_host_is_refused_from_clients(make_client):
    client, engine = await make_client()
    for path, body in ((GEN, {"text": "Hello", "bootstrap_host": "2.2.2.2", "bootstrap_room": 5}),
                       (GEN, {"input_ids": [[1, 2], [3]], "bootstrap_host": ["h", "2.2.2.2"]}),
                       (CMPL, {"model": "fake-model", "prompt": "Hello",
                               "bootstrap_host": "2.2.2.2", "bootstrap_room": 9})):
        resp = await client.post(path, json=body)
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
        assert "reserved" in err["message"] and err["param"].startswith("bootstrap_host")
    assert engine.submitted == []


async def test_batch_and_sample_limits(make_client):
    client, engine = await make_client()
    too_many = [[7]] * (limits.MAX_BATCH_SIZE + 1)
    cases = [(GEN, {"input_ids": too_many}, "input_ids"),
             (GEN, {"text": ["a"] * (limits.MAX_BATCH_SIZE + 1)}, "text"),
             (GEN, {"input_ids": [[7]] * 20, "sampling_params": {"n": 64}}, "sampling_params.n"),
             (GEN, {"text": "a", "sampling_params": {"n": limits.MAX_N + 1}}, "n"),
             (CMPL, {"model": "fake-model", "prompt": [[7]] * (limits.MAX_BATCH_SIZE + 1)},
              "prompt"),
             (CMPL, {"model": "fake-model", "prompt": [[7]] * 17, "n": 64}, "n")]
    for path, body, field in cases:
        resp = await client.post(path, data=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400, (field, await resp.text())
        assert field in (await resp.json())["error"]["message"]
    assert engine.submitted == []
    # At the limit it is served: 16 prompts x n = 64 is exactly MAX_SAMPLES.
    resp = await client.post(GEN, json={"input_ids": [[7]] * 16,
                                        "sampling_params": {"n": 64, "max_new_tokens": 1}})
    assert resp.status == 200 and len(await resp.json()) == limits.MAX_SAMPLES


class _PrefillEngine(FakeEngine):
    """A FakeEngine that records the rooms the server reports as refused (pd_reject)."""

    def __init__(self, **kw):
        super().__init__(disaggregation_mode="prefill", **kw)
        self.rejected = []

    def pd_reject(self, rooms, message, status_code=400):
        self.rejected.append((list(rooms), message, status_code))


async def test_refused_pd_requests_report_their_rooms(make_client):
    engine = _PrefillEngine(context_length=64)
    client, _ = await make_client(engine)
    resp = await client.post(GEN, json={"input_ids": [3] * 80, "bootstrap_host": "127.0.0.1",
                                        "bootstrap_room": 77})
    assert resp.status == 400
    resp = await client.post(GEN, json={"input_ids": [[3], [4]], "bootstrap_room": [5, 6],
                                        "sampling_params": {"temperature": float("nan")}})
    assert resp.status == 400
    assert [(r, s) for r, _, s in engine.rejected] == [([77], 400), ([5, 6], 400)]
    assert "context length" in engine.rejected[0][1]



async def test_speculative_opt_out_reaches_the_engine(make_client):
    """``"speculative": false`` (issue 33) passes through both APIs as a sampling param."""
    client, engine = await make_client()
    resp = await client.post(GEN, json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 4, "speculative": False}})
    assert resp.status == 200, await resp.text()
    resp = await client.post(CMPL, json={"model": "fake-model", "prompt": "Hello",
                                         "max_tokens": 4, "speculative": False})
    assert resp.status == 200, await resp.text()
    resp = await client.post(GEN, json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert [r.sampling_params.speculative for r in engine.submitted] == [False, False, True]
