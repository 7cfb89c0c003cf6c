"""PD with FP8 GQA KV (issue 40, ``fp8_kv``): the tiny Llama's e4m3 K/V and their float32
per-token scales move from prefill to decode as they are (bytes per page = values + scales),
the decode's greedy tokens equal a colocated FP8-KV engine's, and a bf16-KV decode is refused
by the FP8 prefill before any byte moves, naming both KV formats."""

import json
import os

import pytest
from pd_harness import (fp8_kv_pd, at_baseline, greedy_agrees, load, pd_body,
                        pd_state, post, wait_until)

pytestmark = pytest.mark.slow      # starts processes

ARGS = dict(page_size=8, max_total_tokens=512, chunked_prefill_size=16, max_running_requests=2,
            context_length=64)


@pytest.fixture(scope="module")
def gqa_fp8_pd(tiny_checkpoints, tmp_path_factory):
    with fp8_kv_pd(tiny_checkpoints["llama"], str(tmp_path_factory.mktemp("pd_gqa_fp8_kv")),
                   **ARGS) as servers:
        yield servers


def test_fp8_values_and_scales_move_as_they_are(gqa_fp8_pd):
    with open(os.path.join(gqa_fp8_pd["model"], "config.json")) as f:
        cfg = json.load(f)
    lengths = [9, 17, 33, 41]
    prompts = [[(7 * i + 3 * n) % 400 + 3 for i in range(n)] for n in lengths]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    ref = gqa_fp8_pd["colocated"].generate(input_ids=prompts, return_logprob=True,
                                           top_logprobs_num=2, sampling_params=sp)
    compared = 0
    for p, r in zip(prompts, ref):
        status, out = post(gqa_fp8_pd["router"].url + "/generate",
                           {"input_ids": p, "sampling_params": sp})
        assert status == 200, out
        compared += greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"],
                                  out["output_ids"])
    assert compared >= 0.8 * 6 * len(prompts)
    # XLA:CPU updates a float8 pool through a wide copy (runner/pool_copy.py): pages written
    # into it during a step would be lost, so the receiving decode stages.
    assert pd_state(gqa_fp8_pd["decode"])["transfer_path"] == "staging"
    # Bytes per page from the config alone: K and V of every layer, each token's KV heads as
    # head_dim e4m3 values and one float32 scale.
    ps, kvh = ARGS["page_size"], cfg["num_key_value_heads"]
    per_page = cfg["num_hidden_layers"] * ps * 2 * kvh * (cfg["head_dim"] + 4)
    assert wait_until(lambda: at_baseline(gqa_fp8_pd["prefill"]), 30), load(gqa_fp8_pd["prefill"])
    state = pd_state(gqa_fp8_pd["prefill"])
    assert state["kv_bytes_per_page"] == per_page
    recs = {rec["prompt_len"]: rec for rec in state["recent"]}
    for n in lengths:
        rec = recs[n]
        assert rec["state"] == "Success"
        pages = -(-n // ps) - rec["decode_prefix_len"] // ps
        assert rec["pages"] == pages and rec["bytes"] == pages * per_page


def test_bf16_decode_is_refused_naming_both_formats(gqa_fp8_pd):
    prefill, decode = gqa_fp8_pd["prefill"], gqa_fp8_pd["decode_bf16"]
    moved = sum(r["bytes"] for r in pd_state(prefill)["recent"])
    body = pd_body(list(range(3, 20)), 9100, gqa_fp8_pd["bport"], max_new_tokens=4)
    status, out = post(decode.url + "/generate", body)
    text = json.dumps(out)
    assert status >= 400 or "error" in text, out
    assert "kv_dtype: prefill 'fp8:gqa80' != decode 'bfloat16'" in text, text
    assert sum(r["bytes"] for r in pd_state(prefill)["recent"]) == moved
    assert wait_until(lambda: at_baseline(decode), 10)


def test_a_decode_request_without_bootstrap_fields_names_the_field(gqa_fp8_pd):
    """Sent straight to a decode server, a request without the bootstrap fields is a 400
    whose ``param`` names the missing field (it was null), and the server keeps serving."""
    decode = gqa_fp8_pd["decode"]
    for body, field in (({"input_ids": [3, 4, 5]}, "bootstrap_room"),
                        ({"input_ids": [3, 4, 5], "bootstrap_room": 77}, "bootstrap_host")):
        status, out = post(decode.url + "/generate", body)
        assert status == 400, out
        assert out["error"]["param"] == field and f"{field}: required" in out["error"]["message"]
    assert wait_until(lambda: at_baseline(decode), 10)
