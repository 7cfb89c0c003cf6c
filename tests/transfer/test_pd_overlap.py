"""PD with overlapped scheduling on the decode server (the default) gives what
``--disable-overlap-schedule`` gives: one prefill, two decode servers (overlap on / off), a
router in front of each pair; greedy, seeded, stop tokens, ``max_new_tokens`` 1 and 2,
logprobs; an abort mid-stream brings every page back."""

import concurrent.futures
import http.client
import json
import random

import pytest
from pd_harness import (at_baseline, free_port, generate, pd_body, pd_router, pd_server, post,
                        running, wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_overlap"))
    model = tiny_checkpoints["llama"]
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport)
    on = pd_server("decode_overlap", "decode", model, logs)
    off = pd_server("decode_sync", "decode", model, logs, extra=["--disable-overlap-schedule"])
    routers = {name: pd_router(f"router_{name}", prefill, bport, dec, logs)
               for name, dec in (("on", on), ("off", off))}
    with running([prefill, on, off, *routers.values()]):
        yield dict(prefill=prefill, on=on, off=off, routers=routers, bport=bport)



def test_overlap_on_equals_off(pair):
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in (5, 16, 33, 47)]
    greedy = {"temperature": 0, "ignore_eos": True}
    cases = [{**greedy, "max_new_tokens": 1}, {**greedy, "max_new_tokens": 2},
             {**greedy, "max_new_tokens": 9},
             {"temperature": 0.9, "top_p": 0.9, "top_k": 30, "seed": 77, "max_new_tokens": 9,
              "ignore_eos": True, "repetition_penalty": 1.3, "frequency_penalty": 0.4}]
    compared = 0
    for ids in prompts:
        free = generate(pair["routers"]["off"], ids, {**greedy, "max_new_tokens": 9})["output_ids"]
        stop_case = {**greedy, "max_new_tokens": 9, "stop_token_ids": [free[2]]}
        for sp in cases + [stop_case]:
            off = generate(pair["routers"]["off"], ids, sp, return_logprob=True, top_logprobs_num=2)
            on = generate(pair["routers"]["on"], ids, sp, return_logprob=True, top_logprobs_num=2)
            assert on["output_ids"] == off["output_ids"], (ids, sp)
            assert on["meta_info"]["finish_reason"] == off["meta_info"]["finish_reason"]
            assert len(on["output_ids"]) == (sp["max_new_tokens"] if sp is not stop_case
                                            else free.index(free[2]) + 1)
            for (a, ta, _), (b, tb, _) in zip(off["meta_info"]["output_token_logprobs"],
                                              on["meta_info"]["output_token_logprobs"]):
                assert ta == tb and abs(a - b) < 1e-5
            compared += len(on["output_ids"])
    assert compared >= 4 * (1 + 2 + 9 + 9 + 3)
    for s in ("prefill", "on", "off"):
        assert wait_until(lambda: at_baseline(pair[s]), 10), s


def test_abort_mid_stream_on_the_overlapped_decode(pair):
    prefill, dec = pair["prefill"], pair["on"]
    ids = list(range(100, 140))
    body = pd_body(ids, 987654321, pair["bport"], max_new_tokens=200, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fp = pool.submit(post, prefill.url + "/generate", body)
        conn = http.client.HTTPConnection("127.0.0.1", dec.port, timeout=60)
        conn.request("POST", "/generate", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = 0
        while events < 3:
            line = resp.readline()
            assert line, "stream ended early"
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                assert not json.loads(line[6:])["meta_info"]["finish_reason"]
                events += 1
        conn.close()                       # the client leaves mid-stream: the request aborts
        assert fp.result()[0] == 200
    assert wait_until(lambda: at_baseline(dec) and at_baseline(prefill), 10)
    # And the server keeps serving the same tokens as the synchronous one.
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    assert generate(pair["routers"]["on"], ids, sp)["output_ids"] == \
        generate(pair["routers"]["off"], ids, sp)["output_ids"]
