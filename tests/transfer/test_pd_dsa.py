"""PD disaggregation of a tiny DSA model (GLM-5 style: MLA latent cache + lightning-indexer key
cache, top-k shared across layers): greedy tokens equal the colocated engine's, and the bytes
moved per page are the latent plus the indexer bytes."""

import json
import os

import pytest
from pd_harness import (at_baseline, child_env, count_runs, free_port, greedy_agrees, pd_body,
                        pd_router, pd_server, pd_state, post, running, wait_until)

pytestmark = pytest.mark.slow

ARGS = dict(page_size=8, max_total_tokens=512, chunked_prefill_size=16, max_running_requests=2,
            context_length=64)


@pytest.fixture(scope="module")
def dsa_pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_dsa"))
    model = tiny_checkpoints["glm_moe_dsa_long"]
    from pdjax.engine import Engine

    # The colocated engine compiles first, so the servers find every shape in the
    # persistent compilation cache.
    colocated = Engine(model_path=model, progress=False, **ARGS)
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, **ARGS)
    decode = pd_server("decode", "decode", model, logs, **ARGS)
    # A TP 2 prefill for the same decode: the latent and indexer caches are not
    # head-sharded, so each of its 2 devices holds a full replica.
    bport2 = free_port()
    prefill_tp2 = pd_server("prefill_tp2", "prefill", model, logs, bootstrap_port=bport2,
                            tp_size=2, env=child_env(
                                XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                                          "--xla_force_host_platform_device_count=2"), **ARGS)
    router = pd_router("router", prefill, bport, decode, logs)
    try:
        with running([prefill, decode, router, prefill_tp2]):
            yield dict(prefill=prefill, decode=decode, router=router, colocated=colocated,
                       model=model, prefill_tp2=prefill_tp2, bport_tp2=bport2)
    finally:
        colocated.shutdown()


def test_dsa_pd_matches_colocated_and_moves_latent_plus_indexer_bytes(dsa_pd):
    with open(os.path.join(dsa_pd["model"], "config.json")) as f:
        cfg = json.load(f)
    types = cfg["indexer_types"]
    # Prompts longer than index_topk (16), so the sparse selection matters, at page and
    # chunk boundaries.
    lengths = [9, 17, 24, 33, 41]
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in lengths]
    assert max(lengths) > cfg["index_topk"]
    ref = dsa_pd["colocated"].generate(
        input_ids=prompts, return_logprob=True, top_logprobs_num=2,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    compared = 0
    for p, r in zip(prompts, ref):
        status, out = post(dsa_pd["router"].url + "/generate",
                           {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                "ignore_eos": True}})
        assert status == 200, out
        compared += greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"],
                                  out["output_ids"])
    assert compared >= 0.8 * 6 * len(prompts)

    # Bytes per page, from the HF config alone: the latent cache of every layer plus the
    # indexer keys of the layers that run their own indexer (f32 on CPU).
    ps = ARGS["page_size"]
    latent = cfg["num_hidden_layers"] * ps * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    indexer = sum(t == "full" for t in types) * ps * cfg["index_head_dim"] * 4
    # The router answers when the decode is done; the last room may still be closing on the
    # prefill (it joins ``recent`` at the prefill's next poll).
    assert wait_until(lambda: at_baseline(dsa_pd["prefill"]), 10)
    state = pd_state(dsa_pd["prefill"])
    assert state["kv_bytes_per_page"] == latent + indexer
    assert state["num_layer_buffers"] == cfg["num_hidden_layers"] + sum(t == "full" for t in types)
    recs = {r["prompt_len"]: r for r in state["recent"]}
    for n in lengths:
        rec = recs[n]
        assert rec["state"] == "Success"
        pages = -(-n // ps) - rec["decode_prefix_len"] // ps
        assert rec["pages"] == pages and rec["bytes"] == pages * (latent + indexer)
    assert wait_until(lambda: at_baseline(dsa_pd["prefill"]) and at_baseline(dsa_pd["decode"]), 10)


def test_dsa_tp2_prefill_to_tp1_decode_moves_whole_replica_pages(dsa_pd):
    """MLA rule: a replicated latent/indexer cache pairs across TP sizes; each page
    is read from one replica as whole-page runs, so bytes and copies equal the TP 1 pair's."""
    import concurrent.futures

    p2, decode = dsa_pd["prefill_tp2"], dsa_pd["decode"]
    state = pd_state(p2)
    assert all(heads == [[0, 1], [0, 1]] for heads in state["kv_shard_heads"])
    lengths = [17, 33]
    prompts = [[(5 * i + 7 * n) % 500 + 3 for i in range(n)] for n in lengths]
    ref = dsa_pd["colocated"].generate(
        input_ids=prompts, return_logprob=True, top_logprobs_num=2,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    for k, (p, r) in enumerate(zip(prompts, ref)):
        body = pd_body(p, 7000 + k, dsa_pd["bport_tp2"], max_new_tokens=6, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, p2.url + "/generate", body)
            status, out = post(decode.url + "/generate", body)
            assert status == 200 and fut.result()[0] == 200, (out, fut.result())
        greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"], out["output_ids"])
    d_bpp = pd_state(decode)["kv_bytes_per_page"]
    buffers = pd_state(decode)["num_layer_buffers"]            # one shard: layers per buffer
    assert state["kv_bytes_per_page"] == 2 * d_bpp             # two replicas on the prefill
    recs = {r["room"]: r for r in pd_state(p2)["recent"]}
    ps = ARGS["page_size"]
    for k, n in enumerate(lengths):
        rec = recs[7000 + k]
        assert rec["state"] == "Success", rec
        pages = -(-n // ps) - rec["decode_prefix_len"] // ps
        runs = sum(count_runs(c["src"], c["dst"]) for c in rec["chunks"])
        assert rec["pages"] == pages and rec["bytes"] == pages * d_bpp
        assert rec["copies"] == runs * buffers
    assert wait_until(lambda: at_baseline(p2) and at_baseline(decode), 10)
