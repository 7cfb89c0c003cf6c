"""PD across TP sizes and a fleet, as real processes on 127.0.0.1.

Four servers from one start: prefill TP 1 (P1), prefill TP 2 (P2), decode TP 1 (D1), decode
TP 2 (D2), each TP 2 process with 2 simulated CPU devices. The tiny Llama has 2 KV heads, so
a TP 2 shard holds one head and a TP 1 shard both: P2 -> D1 and P1 -> D2 move head slices
(one copy per page, layer, token slot and head), P2 -> D2 and P1 -> D1 whole page runs. Then
the four behind ``pdjax.router`` (load-aware) and behind sglang-router (PyPI) in PD mode.
"""

import concurrent.futures
import random
import sys

import pytest
from pd_harness import (PAGE_SIZE, TINY_ARGS, Server, at_baseline, child_env, count_runs,
                        free_port, get, greedy_agrees, load, metric_value, pd_pair, pd_server,
                        pd_state, post, wait_until)

pytestmark = pytest.mark.slow

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 16, 4      # tiny llama, float32 KV
BYTES_PER_PAGE = 2 * LAYERS * PAGE_SIZE * KV_HEADS * HEAD_DIM * ITEMSIZE   # K and V


def _tp2_env():
    return child_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                               "--xla_force_host_platform_device_count=2")


@pytest.fixture(scope="module")
def fleet(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_fleet"))
    model = tiny_checkpoints["llama"]
    bp1, bp2 = free_port(), free_port()
    servers = {
        "P1": pd_server("prefill_tp1", "prefill", model, logs, bootstrap_port=bp1),
        "P2": pd_server("prefill_tp2", "prefill", model, logs, bootstrap_port=bp2,
                        env=_tp2_env(), tp_size=2),
        "D1": pd_server("decode_tp1", "decode", model, logs),
        "D2": pd_server("decode_tp2", "decode", model, logs, env=_tp2_env(), tp_size=2),
    }
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **TINY_ARGS)
    routers = []
    try:
        for s in servers.values():
            s.wait_healthy()
        port = free_port()
        ours = Server("pdjax-router", [
            sys.executable, "-m", "pdjax.router", "--prefill", servers["P1"].url, str(bp1),
            "--prefill", servers["P2"].url, str(bp2), "--decode", servers["D1"].url,
            "--decode", servers["D2"].url, "--port", str(port),
            "--load-poll-interval-secs", "0.2"], port, logs, child_env())
        routers.append(ours)
        port = free_port()
        theirs = Server("sglang-router", [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", servers["P1"].url, str(bp1), "--prefill", servers["P2"].url, str(bp2),
            "--decode", servers["D1"].url, "--decode", servers["D2"].url,
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warn"], port, logs,
            child_env())
        routers.append(theirs)
        for r in routers:
            r.wait_healthy(120)
        yield dict(servers=servers, bports={"P1": bp1, "P2": bp2}, colocated=colocated,
                   router=ours, sglang_router=theirs)
    except BaseException:
        for s in list(servers.values()) + routers:
            print(f"==== {s.name} log ====\n{s.log_tail(80)}")
        raise
    finally:
        for s in routers + list(servers.values()):
            s.stop()
        colocated.shutdown()


def _reference(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                           sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                            for m in max_new])
    return [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]


def _served(server, role):
    """Successful transfers this server took part in (its own metrics)."""
    text = get(server.url + "/metrics")[1]
    return metric_value(text, "pdjax:kv_transfer_pages_total", role=role)


def test_mixed_tp_pairs_equal_colocated_with_planned_bytes_and_copies(fleet):
    s, bports = fleet["servers"], fleet["bports"]
    assert pd_state(s["P2"])["kv_shard_heads"] == [[[0, 1], [1, 1]]] * 2
    assert pd_state(s["D1"])["kv_shard_heads"] == [[[0, 2]]] * 2
    rng = random.Random(14)
    lengths = [5, 17, 33, 45]
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    max_new = [6, 8, 5, 7]
    ref = _reference(fleet["colocated"], prompts, max_new)
    pairs = [("P2", "D1"), ("P1", "D2"), ("P2", "D2"), ("P1", "D1")]
    room = 1000
    for p_name, d_name in pairs:
        for k, (ids, m) in enumerate(zip(prompts, max_new)):
            room += 1
            out = pd_pair(s[p_name], s[d_name], bports[p_name], ids, room, m,
                           stream=(k == 1))
            greedy_agrees(*ref[k], out["output_ids"])
            assert len(out["output_ids"]) == m
    # Per room on the prefill: bytes = pages x the decode's bytes per page over its shards
    # (the same total for any TP: no KV head is replicated here), copies as planned.
    for p_name, d_name in pairs:
        recent = {r["room"]: r for r in pd_state(s[p_name])["recent"]}
        first = 1001 + pairs.index((p_name, d_name)) * len(prompts)
        for k, n in enumerate(lengths):
            rec = recent[first + k]
            assert rec["state"] == "Success", rec
            pages = -(-n // PAGE_SIZE) - rec["decode_prefix_len"] // PAGE_SIZE
            assert rec["pages"] == pages and rec["bytes"] == pages * BYTES_PER_PAGE
            runs = sum(count_runs(c["src"], c["dst"]) for c in rec["chunks"])
            if p_name[1] != d_name[1]:
                # 2 buffers x 2 head slices (one per head), one copy per page, layer, token.
                assert rec["copies"] == 2 * KV_HEADS * pages * LAYERS * PAGE_SIZE
            else:
                shards = int(p_name[1])
                assert rec["copies"] == runs * LAYERS * 2 * shards
    for name in s:
        assert wait_until(lambda: at_baseline(s[name]), 10), load(s[name])
        assert "pdjax:kv_transfer_failed_total{" not in get(s[name].url + "/metrics")[1]
    assert load(s["D1"])["num_prompt_tokens_computed"] == 0
    assert load(s["D2"])["num_prompt_tokens_computed"] == 0


@pytest.mark.parametrize("router", ["router", "sglang_router"])
def test_fleet_32_concurrent_requests_equal_colocated_on_every_server(fleet, router):
    s = fleet["servers"]
    url = fleet[router].url
    before = {n: _served(s[n], "prefill" if n[0] == "P" else "decode") for n in s}
    rng = random.Random(32 if router == "router" else 33)
    prompts = [[rng.randrange(3, 440) for _ in range(rng.randrange(3, 60))] for _ in range(32)]
    max_new = [3 + i % 6 for i in range(32)]

    def one(i):
        body = {"input_ids": prompts[i],
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new[i]}}
        status, out = post(url + "/generate", body, timeout_s=300)
        assert status == 200, out
        return out

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    ref = _reference(fleet["colocated"], prompts, max_new)
    compared = sum(greedy_agrees(ids, top, res["output_ids"])
                   for (ids, top), res in zip(ref, results))
    assert compared >= 0.9 * sum(max_new)
    after = {n: _served(s[n], "prefill" if n[0] == "P" else "decode") for n in s}
    served = {n: after[n] - before[n] for n in s}
    assert all(v > 0 for v in served.values()), served
    # Every page a prefill sent, a decode received.
    assert served["P1"] + served["P2"] == served["D1"] + served["D2"]
    if router == "router":
        state = get(url + "/get_load")[1]["router"]
        chosen = [w["num_chosen"] for w in state["prefill"] + state["decode"]]
        assert all(c > 0 for c in chosen) and sum(chosen) >= 2 * 32, chosen
    for name in s:
        assert wait_until(lambda: at_baseline(s[name]), 10), load(s[name])
