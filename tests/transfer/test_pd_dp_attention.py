"""PD with DP attention (issue 41 step 3; DESIGN.md §4, §6), tiny DeepSeek-V3.2 (MLA latent
+ DSA indexer caches), Mooncake, direct path, DP servers on 4 simulated CPU devices: a TP 1
prefill writes each request's pages into the shard of the rank a TP 4 DP 4 decode assigned
it at admission; a TP 4 DP 4 prefill sends its rank's pages to a TP 1 decode and to the DP
decode. The decode's greedy tokens equal the colocated engine's (tie-aware) with fewer
requests in flight than ranks and more, and the pools are back at baseline after."""

import concurrent.futures
import os

import pytest
from pd_harness import (at_baseline, child_env, free_port, greedy_agrees, load, pd_pair,
                        pd_server, pd_state, running, wait_until)

pytestmark = pytest.mark.slow

# DP attention ranks of the DP servers (4 in the suite's runs; PDJAX_TEST_DP=8 runs the
# deployment's size, 8 simulated devices a DP server, by hand)
DP = int(os.environ.get("PDJAX_TEST_DP", "4"))
# 37 pages a rank: at 32 a rank some DP step temporaries had a KV buffer's exact size
# (98,304 B, 49,152 B) and the in-place check of runner/pool_copy.py took them for copies of
# the pool; 37 shares no factor with them
ARGS = dict(page_size=8, max_total_tokens=37 * 8 * DP, chunked_prefill_size=16,
            max_running_requests=8, context_length=64)
SAMPLING = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_pd(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_dp"))
    model = tiny_checkpoints["deepseek_v32"]
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **ARGS)
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport, **ARGS)
    dp_flags = dict(tp_size=DP, extra=[
        "--enable-dp-attention", "--dp-size", str(DP), "--disaggregation-transfer-backend",
        "mooncake", "--disaggregation-transfer-path", "direct"], env=child_env(
        XLA_FLAGS=f"--xla_cpu_multi_thread_eigen=false "
                  f"--xla_force_host_platform_device_count={DP}"))
    decode = pd_server("decode_dp4", "decode", model, logs, **dp_flags, **ARGS)
    bport_dp = free_port()
    prefill_dp = pd_server("prefill_dp4", "prefill", model, logs, bootstrap_port=bport_dp,
                           **dp_flags, **ARGS)
    decode_tp1 = pd_server("decode_tp1", "decode", model, logs, **ARGS)
    dp2_flags = dict(dp_flags, extra=[x if x != str(DP) else "2" for x in dp_flags["extra"]])
    decode_dp2 = pd_server("decode_dp2", "decode", model, logs, **dp2_flags, **ARGS)
    try:
        with running([prefill, decode, prefill_dp, decode_tp1, decode_dp2]):
            yield dict(prefill=prefill, decode=decode, bport=bport, colocated=colocated,
                       prefill_dp=prefill_dp, bport_dp=bport_dp, decode_tp1=decode_tp1,
                       decode_dp2=decode_dp2)
    finally:
        colocated.shutdown()


def _prompts(lengths, salt):
    return [[(7 * i + 3 * n + salt) % 500 + 3 for i in range(n)] for n in lengths]


def _run(dp_pd, prompts, room0, prefill="prefill", decode="decode", bport="bport"):
    ref = dp_pd["colocated"].generate(input_ids=prompts, return_logprob=True,
                                      top_logprobs_num=2, sampling_params=SAMPLING)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(
            lambda kp: pd_pair(dp_pd[prefill], dp_pd[decode], dp_pd[bport], kp[1],
                               room0 + kp[0], SAMPLING["max_new_tokens"]),
            enumerate(prompts)))
    compared = sum(greedy_agrees(r["output_ids"], r["meta_info"]["output_top_logprobs"],
                                 o["output_ids"]) for r, o in zip(ref, outs))
    assert compared >= 0.8 * SAMPLING["max_new_tokens"] * len(prompts)
    return outs


def _back_at_baseline(dp_pd, *names):
    servers = [dp_pd[n] for n in names or ("prefill", "decode")]

    def ok():
        return all(at_baseline(s) and all(r["num_requests"] == r["num_pinned_pages"] == 0
                                           for r in load(s).get("dp_ranks", []))
                   for s in servers)
    assert wait_until(ok, 15), [load(s) for s in servers]


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


@pytest.mark.parametrize("decode", ["decode_tp1", "decode"])
def test_prefill_with_dp_attention(dp_pd, decode):
    """A DP 4 prefill computes each prompt on one rank and sends that rank's pages, to a
    TP 1 decode and to the DP 4 decode; 2 requests (fewer than ranks), then 6 (more)."""
    room = 300 if decode == "decode_tp1" else 400
    _run(dp_pd, _prompts([9, 33], 2), room, "prefill_dp", decode, "bport_dp")
    _run(dp_pd, _prompts([9, 17, 24, 33, 41, 12], 3), room + 10, "prefill_dp", decode,
         "bport_dp")
    _back_at_baseline(dp_pd, "prefill_dp", decode)
    p_state = pd_state(dp_pd["prefill_dp"])
    assert all(heads == [[0, 1]] * DP for heads in p_state["kv_shard_heads"])
    recs = [r for r in p_state["recent"] if r["room"] >= room + 10]
    assert len(recs) == 6 and all(r["state"] == "Success" for r in recs), recs
    # the prompts were computed on several ranks (global page // pages a rank)
    per_rank = ARGS["max_total_tokens"] // ARGS["page_size"] // DP
    ranks = {p // per_rank for r in recs for c in r["chunks"] for p in c["src"]}
    assert len(ranks) >= 2, ranks
    assert load(dp_pd[decode])["num_prompt_tokens_computed"] == 0


def test_decode_prefix_hit_stays_on_its_rank(dp_pd):
    """The same prompt twice: the second time the DP decode finds its prefix cached on one
    rank, assigns the request there, and takes only the rest of the prompt from the
    prefill into that rank's shard."""
    prompt = _prompts([41], 5)
    _run(dp_pd, prompt, 500)
    _back_at_baseline(dp_pd)
    _run(dp_pd, prompt, 501)
    _back_at_baseline(dp_pd)
    recs = {r["room"]: r for r in pd_state(dp_pd["prefill"])["recent"]}
    first, again = recs[500], recs[501]
    assert first["decode_prefix_len"] == 0 and again["decode_prefix_len"] >= 32, again
    assert again["pages"] == -(-41 // ARGS["page_size"]) - again["decode_prefix_len"] // 8
    per_rank = ARGS["max_total_tokens"] // ARGS["page_size"] // DP
    dst = [p for c in first["chunks"] + again["chunks"] for p in c["dst"]]
    assert len({p // per_rank for p in dst}) == 1, dst     # both on the prefix's rank


def test_decode_with_two_devices_a_rank(dp_pd):
    """TP 4 DP 2: each rank's pages on 2 devices (copies), both written."""
    assert all(heads == [[0, 1]] * DP for heads in pd_state(dp_pd["decode_dp2"])["kv_shard_heads"])
    assert len(load(dp_pd["decode_dp2"])["dp_ranks"]) == 2
    _run(dp_pd, _prompts([9], 6), 600, decode="decode_dp2")
    _run(dp_pd, _prompts([9, 17, 33, 41], 7), 610, decode="decode_dp2")
    _back_at_baseline(dp_pd, "prefill", "decode_dp2")
