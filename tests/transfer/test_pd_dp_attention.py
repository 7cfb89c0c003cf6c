"""PD into a decode with DP attention (issue 41 step 3; DESIGN.md §4, §6): a TP 1 prefill
of the tiny DeepSeek-V3.2 (MLA latent + DSA indexer caches) writes each request's pages into
the shard of the rank the decode (TP 4, DP 4 on 4 simulated CPU devices, Mooncake, direct
path) assigned it at admission; the decode's greedy tokens equal the colocated engine's
(tie-aware) with fewer requests in flight than ranks and more, and both pools are back at
baseline after."""

import concurrent.futures

import pytest
from pd_harness import (at_baseline, child_env, free_port, greedy_agrees, load, pd_pair,
                        pd_server, pd_state, running, wait_until)

pytestmark = pytest.mark.slow

ARGS = dict(page_size=8, max_total_tokens=1184, chunked_prefill_size=16,
            max_running_requests=8, context_length=64)
DP = 4
# 148 pages, 37 a rank: a KV buffer's size shares no factor with the DP step's temporaries
# (at 32 pages a rank an [N * Ts, 384] f32 temp had a buffer's size, and the in-place check
# of runner/pool_copy.py, which reads sizes, took it for a copy of the pool)
SAMPLING = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_dp"))
    model = tiny_checkpoints["deepseek_v32"]
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **ARGS)
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, **ARGS)
    decode = pd_server(
        "decode_dp4", "decode", model, logs, tp_size=DP,
        extra=["--enable-dp-attention", "--dp-size", str(DP),
               "--disaggregation-transfer-backend", "mooncake",
               "--disaggregation-transfer-path", "direct"],
        env=child_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                                f"--xla_force_host_platform_device_count={DP}"), **ARGS)
    try:
        with running([prefill, decode]):
            yield dict(prefill=prefill, decode=decode, bport=bport, colocated=colocated)
    finally:
        colocated.shutdown()


def _prompts(lengths, salt):
    return [[(7 * i + 3 * n + salt) % 500 + 3 for i in range(n)] for n in lengths]


def _run(dp_pd, prompts, room0):
    ref = dp_pd["colocated"].generate(input_ids=prompts, return_logprob=True,
                                      top_logprobs_num=2, sampling_params=SAMPLING)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(
            lambda kp: pd_pair(dp_pd["prefill"], dp_pd["decode"], dp_pd["bport"], kp[1],
                               room0 + kp[0], SAMPLING["max_new_tokens"]),
            enumerate(prompts)))
    compared = sum(greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"],
                                 o["output_ids"]) for r, o in zip(ref, outs))
    assert compared >= 0.8 * SAMPLING["max_new_tokens"] * len(prompts)
    return outs


def _back_at_baseline(dp_pd):
    def ok():
        ld = load(dp_pd["decode"])
        return (at_baseline(dp_pd["prefill"]) and at_baseline(dp_pd["decode"])
                and all(r["num_requests"] == 0 for r in ld["dp_ranks"]))
    assert wait_until(ok, 15), (load(dp_pd["prefill"]), load(dp_pd["decode"]))


def test_decode_layout_is_page_sharded(dp_pd):
    state = pd_state(dp_pd["decode"])
    ld = load(dp_pd["decode"])
    assert len(ld["dp_ranks"]) == DP
    # one shard per rank of every buffer (latent, indexer keys), one head each
    assert all(heads == [[0, 1]] * DP for heads in state["kv_shard_heads"])


def test_fewer_requests_than_ranks(dp_pd):
    prompts = _prompts([9, 33], 0)                 # 2 requests, 4 ranks: 2 idle
    _run(dp_pd, prompts, 100)
    _back_at_baseline(dp_pd)


def test_more_requests_than_ranks_and_bytes(dp_pd):
    lengths = [9, 17, 24, 33, 41, 12]              # 6 requests over 4 ranks
    _run(dp_pd, _prompts(lengths, 1), 200)
    _back_at_baseline(dp_pd)
    p_bpp = pd_state(dp_pd["prefill"])["kv_bytes_per_page"]
    # each page goes to its rank's one shard: the bytes of one TP 1 page
    assert pd_state(dp_pd["decode"])["kv_bytes_per_page"] == p_bpp
    recs = {r["room"]: r for r in pd_state(dp_pd["prefill"])["recent"]}
    for k, n in enumerate(lengths):
        rec = recs[200 + k]
        assert rec["state"] == "Success", rec
        pages = -(-n // ARGS["page_size"]) - rec["decode_prefix_len"] // ARGS["page_size"]
        assert rec["pages"] == pages and rec["bytes"] == pages * p_bpp, rec
    assert load(dp_pd["decode"])["num_prompt_tokens_computed"] == 0
