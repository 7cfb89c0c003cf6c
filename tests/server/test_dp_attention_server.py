"""The HTTP server over a real ``AsyncEngine`` with DP attention (tiny DeepSeek-V3.2, TP 4,
EP 4, DP 4 on the suite's 4 simulated CPU devices): ``/generate`` answers with TP 1's tokens
(the engine tests compare those with transformers), ``/get_load`` reports each rank's requests
and pages, ``/metrics`` counts the DP gather bytes of the forwards."""

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from model_utils import assert_output_agrees
from pdjax.config import ServerArgs
from pdjax.engine import AsyncEngine
from pdjax.engine.offline import Engine
from pdjax.models.dp_attention import dp_collective_bytes
from pdjax.server.app import create_app

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]     # compiles a DP engine (~80 s cold)

SETTINGS = dict(dtype="float32", page_size=8, max_total_tokens=1024, max_running_requests=4,
                chunked_prefill_size=16, context_length=32, enable_mixed_chunk=True)


@pytest.fixture(scope="module")
def dp_engine(tiny_checkpoints):
    args = ServerArgs(model_path=tiny_checkpoints["deepseek_v32"], tp_size=4, ep_size=4,
                      enable_dp_attention=True, dp_size=4, skip_warmup_progress=True,
                      **SETTINGS)
    engine = AsyncEngine(args, progress=False)
    create_app(engine)
    engine.start()
    assert engine.wait_ready(900)
    yield engine
    engine.shutdown()


@pytest_asyncio.fixture
async def served(make_client, dp_engine):
    client, engine = await make_client(dp_engine)
    yield client, engine


def _metric(text, name):
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


async def test_generate_load_and_gather_bytes(served, tiny_checkpoints):
    client, engine = served
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 400, n).tolist() for n in (7, 12)]
    tp1 = Engine(tiny_checkpoints["deepseek_v32"], progress=False, **SETTINGS)
    try:
        ref = tp1.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            return_logprob=True, top_logprobs_num=2)
    finally:
        tp1.shutdown()
    before = _metric(await (await client.get("/metrics")).text(), "pdjax:dp_gather_bytes_total")
    resp = await client.post("/generate", json={
        "input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 2})
    assert resp.status == 200, await resp.text()
    outs = await resp.json()
    compared = sum(assert_output_agrees(r, o, f"prompt {i}: DP 4 vs TP 1")
                   for i, (r, o) in enumerate(zip(ref, outs)))
    assert compared >= 6
    info = await (await client.get("/get_server_info")).json()
    assert (info["enable_dp_attention"], info["dp_size"], info["tp_size"]) == (True, 4, 4)
    load = await (await client.get("/get_load")).json()
    ranks = load["dp_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["num_requests"] == 0 for r in ranks)          # both finished
    used = sorted(r["num_used_pages"] for r in ranks)
    assert used[:2] == [0, 0] and all(u > 0 for u in used[2:]), ranks   # two ranks ran them
    after = _metric(await (await client.get("/metrics")).text(), "pdjax:dp_gather_bytes_total")
    cfg = engine.core.model_cfg
    per_token = dp_collective_bytes(cfg, 1, 4)
    moved = after - before
    assert moved > 0 and moved % per_token == 0
    # at least one prefill step (a bucket of >= 12 tokens a rank) and 5 decode steps
    assert moved >= per_token * (12 + 5)


async def test_regex_rows_on_several_ranks(served):
    """Structured outputs under DP attention: grammar masks are filled per logits row, which
    stays the batch's row order whatever rank a row runs on; three regex requests at once
    (on three ranks) each match in full."""
    import asyncio
    import re

    client, _ = served
    regex = r"(yes|no|maybe)\. [0-9]{1,2}"

    async def one(seed):
        resp = await client.post("/generate", json={
            "input_ids": [5 + seed, 17, 42], "sampling_params": {
                "max_new_tokens": 20, "temperature": 1.0, "seed": seed, "regex": regex}})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    outs = await asyncio.gather(*(one(seed) for seed in range(3)))
    for out in outs:
        assert re.fullmatch(regex, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
