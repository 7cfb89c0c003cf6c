"""FP8 block-scaled checkpoints (DeepSeek-V3.2 with ue8m0 scales, GLM-5) served as they ship:
a colocated server with mixed prefill + decode batches, and a PD prefill + decode pair behind
the router, give the greedy tokens transformers gives on the same weights dequantized to
float32 (tie-aware), and the PD pair moves the same KV bytes per page as for an unquantized
twin (the weights' format does not change the cache)."""

import concurrent.futures
import json
import os

import numpy as np
import pytest
import torch
import transformers
from pd_harness import (at_baseline, pd_router, pd_server, pd_state, post, running,
                        wait_until)

import make_tiny_checkpoint as mk
from model_utils import assert_tokens_match, hf_greedy, top2_gaps
from pdjax.ports import free_port

pytestmark = pytest.mark.slow

NEW = 6
# Prompt + output stay under index_topk (32): every cached token is selected, so the
# indexer's ties at 0 cannot pick differently from transformers.
ARGS = dict(page_size=8, max_total_tokens=512, chunked_prefill_size=16, max_running_requests=4,
            context_length=32, dtype="float32")


@pytest.fixture(scope="module", params=["deepseek_v32_fp8", "glm_moe_dsa_fp8"])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def oracle(name, tiny_checkpoints, tmp_path_factory):
    path = mk.write_dequantized(tiny_checkpoints[name], str(tmp_path_factory.mktemp("deq")))
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def servers(name, tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_fp8"))
    model = tiny_checkpoints[name]
    bport = free_port()
    colocated = pd_server("colocated", "colocated", model, logs, extra=["--enable-mixed-chunk"],
                          **ARGS)
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, **ARGS)
    decode = pd_server("decode", "decode", model, logs, **ARGS)
    router = pd_router("router", prefill, bport, decode, logs)
    with running([colocated, prefill, decode, router]):
        yield dict(colocated=colocated, prefill=prefill, decode=decode, router=router)


def test_fp8_checkpoint_serves_transformers_greedy_tokens_colocated_mixed_and_pd(
        name, servers, oracle, tiny_checkpoints):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 400, n).tolist() for n in (5, 13, 21)]
    refs = [hf_greedy(oracle, p, NEW, eos_token_id=None, pad_token_id=0) for p in prompts]
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}}
    for where in ("colocated", "router"):
        url = servers[where].url + "/generate"
        # Concurrent requests: the colocated server mixes one's prefill chunks with the
        # others' decode rows (--enable-mixed-chunk); the decode runs them side by side.
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: post(url, dict(body, input_ids=p)), prompts))
        compared = 0
        for p, (status, out), (ref, logits) in zip(prompts, outs, refs):
            assert status == 200, out
            compared += assert_tokens_match(out["output_ids"], ref, top2_gaps(logits),
                                            what=f"{name} {where} prompt of {len(p)}")
        assert compared >= len(prompts) * NEW // 2, where
    assert wait_until(lambda: at_baseline(servers["prefill"]), 10)
    state = pd_state(servers["prefill"])
    recs = [r for r in state["recent"] if r["state"] == "Success"]
    assert len(recs) == len(prompts)
    # The KV cache holds activations, not weights: the float32 latent + rope of every layer
    # and every layer's indexer keys, from the HF config alone, as for an unquantized twin.
    with open(os.path.join(tiny_checkpoints[name], "config.json")) as f:
        cfg = json.load(f)
    # GLM-5 runs its own indexer only in the layers its indexer_types call "full".
    types = cfg.get("indexer_types") or ["full"] * cfg["num_hidden_layers"]
    indexers = sum(t == "full" for t in types)
    per_token = (cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
                 + indexers * cfg["index_head_dim"])
    assert state["kv_bytes_per_page"] == ARGS["page_size"] * 4 * per_token
