"""The router's request arithmetic and limits without processes: sample counts, prefill
arguments and the merge of the prefill's prompt logprobs; oversized sample counts refused
before rooms are drawn; a worker's 4xx passed through and its failures answered 502, against
fake workers."""

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdjax.router import PDRouter, create_router_app, parse_prefill_args
from pdjax.router.pd_router import _merge_input_logprobs
from pdjax.server.validation import checked_num_samples, num_samples


def test_router_sample_counts_ports_and_logprob_merge():
    assert num_samples("/generate", {"text": "a"}) == 1
    assert num_samples("/generate", {"text": ["a", "b"], "sampling_params": {"n": 3}}) == 6
    assert num_samples("/generate", {"input_ids": [[1], [2]]}) == 2
    assert num_samples("/generate", {"input_ids": [1, 2, 3]}) == 1
    assert num_samples("/v1/completions", {"prompt": ["a", "b"], "n": 2}) == 4
    assert num_samples("/v1/completions", {"prompt": [1, 2]}) == 1
    assert num_samples("/v1/chat/completions", {"messages": [], "n": 2}) == 2
    assert parse_prefill_args([["http://p:1"], ["http://q:2", "8998"], ["http://r:3", "none"]]) \
        == [("http://p:1", None), ("http://q:2", 8998), ("http://r:3", None)]
    with pytest.raises(ValueError, match="bootstrap port"):
        parse_prefill_args([["http://p:1", "x"]])
    d = {"meta_info": {"input_token_logprobs": []}}
    p = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None]],
                       "input_top_logprobs": [None, []]}}
    merged = _merge_input_logprobs([d], [p])[0]["meta_info"]
    assert merged["input_token_logprobs"] == [[None, 5, None], [-1.5, 6, None]]
    assert merged["input_top_logprobs"] == [None, []]


def test_router_refuses_oversized_sample_counts_before_drawing_rooms():
    assert checked_num_samples("/generate", {"text": ["a", "b"], "sampling_params": {"n": 3}}) == 6
    for body, field in (({"text": "a", "sampling_params": {"n": 10 ** 20}}, "sampling_params.n"),
                        ({"input_ids": [[1]] * 1025}, "input_ids"),
                        ({"text": ["a"] * 40, "sampling_params": {"n": 30}}, "sampling_params.n"),
                        ({"input_ids": [[1]], "sampling_params": [{"n": 65}]},
                         "sampling_params.n")):
        with pytest.raises(ValueError, match=field):
            checked_num_samples("/generate", body)
    with pytest.raises(ValueError, match="^n:"):
        checked_num_samples("/v1/chat/completions", {"n": 2 * 10 ** 6})
    with pytest.raises(ValueError, match="prompt"):
        checked_num_samples("/v1/completions", {"prompt": ["a"] * 1025})


def _worker(status: int, message: str, delay_s: float = 0.0):
    async def handle(request):
        await asyncio.sleep(delay_s)
        if status == 200:
            return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {}})
        return web.json_response({"error": {"message": message, "code": status}}, status=status)

    app = web.Application()
    app.router.add_post("/generate", handle)
    return TestServer(app)


@pytest.mark.asyncio
# A decode that answers 200 after its prefill failed takes 30 s: the router must answer from
# the failure and cancel it (a 0.3 s delay could lose that race on a loaded machine). A failed
# decode waits for its prefill's verdict (PREFILL_VERDICT_S), so those delays need no margin.
@pytest.mark.parametrize("p,d,want,needle", [
    ((400, "prompt too long", 0.0), (200, "", 30.0), 400, "prompt too long"),
    ((200, "", 0.3), (400, "temperature must be finite", 0.0), 400, "temperature"),
    ((400, "bad field", 0.2), (500, "PD transfer failed: refused", 0.0), 400, "bad field"),
    ((500, "boom", 0.0), (200, "", 30.0), 502, "boom"),
    ((200, "", 0.0), (500, "decode broke", 0.1), 502, "decode broke"),
])
async def test_router_passes_worker_4xx_through_and_502s_failures(p, d, want, needle):
    pw, dw = _worker(*p), _worker(*d)
    await pw.start_server()
    await dw.start_server()
    router = PDRouter([(str(pw.make_url("")), 8998)], [str(dw.make_url(""))])
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(rs.make_url("/generate"), json={"text": "hi"}) as r:
                    body = await r.json()
                    assert r.status == want, body
                    assert needle in body["error"]["message"]
            async with s.post(rs.make_url("/generate"), data=b"[" * 100000) as r:
                assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
            async with s.post(rs.make_url("/generate"),
                              json={"text": "hi", "sampling_params": {"n": 10 ** 20}}) as r:
                assert r.status == 400
    finally:
        await rs.close()
        await pw.close()
        await dw.close()
