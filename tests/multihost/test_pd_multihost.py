"""Multi-host PD roles (DESIGN.md §6, issue 14), TP 2 over two processes on 127.0.0.1 (one CPU
device each, so each node holds one of the tiny Llama's two KV heads), over Mooncake TCP:

* a prefill of two ``--role prefill --nnodes 2`` nodes sending to a TP 1 decode process: each
  node registers its own shards and transfer session with the bootstrap server and writes its
  own head slices into the decode's pages;
* a TP 1 prefill sending to a decode of two ``--role decode --nnodes 2`` nodes: each decode
  node reports its session and shards to node 0, whose registration carries them all; the
  prefill writes each node's head slice into that node's buffers, in the pages node 0's
  scheduler reserved.

Greedy outputs equal the colocated engine's (DESIGN.md §5), and per room the bytes and copies
are those of the plan: pages x the decode's bytes per page, one copy per page, layer, token
slot and head slice. Every control frame is sealed with a shared secret.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_harness import (PAGE_SIZE, TINY_ARGS, Server, at_baseline, child_env,  # noqa: E402
                        free_port, get, greedy_agrees, load, pd_pair, pd_server, pd_state,
                        running, wait_until)

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 16, 4      # tiny llama, float32 KV

pytestmark = pytest.mark.slow
SECRET = "multi-host-prefill"      # node 1's PUT /route and RankWriteDone are authenticated too

BYTES_PER_PAGE = 2 * LAYERS * PAGE_SIZE * KV_HEADS * HEAD_DIM * ITEMSIZE   # K and V, both heads


def _prefill_node(model, rank, coord, http, bport, logs):
    return _node("prefill", model, rank, coord, http, logs,
                 ["--disaggregation-bootstrap-port", str(bport)])


def _node(role, model, rank, coord, http, logs, extra=(), **overrides):
    argv = [sys.executable, "-m", "pdjax.serve", "--role", role, "--model-path", model,
            "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
            f"127.0.0.1:{coord}", "--tp-size", "2", "--port", str(http),
            "--skip-warmup-progress", "--dist-timeout-s", "10",
            "--disaggregation-secret", SECRET, *extra]
    # Two decode-row buckets instead of four: the follower compiles every shape itself (the
    # persistent cache holds node 0's), the test's longest wait.
    for k, v in dict(TINY_ARGS, max_running_requests=2, **overrides).items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return Server(f"{role}_node{rank}", argv, http, logs, child_env())


def _route(bport):
    """The prefill's ``GET /route`` once every node registered (503 before), else None."""
    status, body = get(f"http://127.0.0.1:{bport}/route")
    return body if status == 200 else None


def test_two_node_prefill_to_one_decode_equals_colocated(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    logs = str(tmp_path)
    coord, http, bport = free_port(), free_port(), free_port()
    node0 = _prefill_node(model, 0, coord, http, bport, logs)
    node1 = _prefill_node(model, 1, coord, 0, bport, logs)
    decode = pd_server("decode", "decode", model, logs,
                       extra=["--disaggregation-secret", SECRET])
    from pdjax.engine import Engine

    rng = random.Random(1364)
    lengths, max_new = [5, 17, 45], [6, 8, 5]
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    with Engine(model_path=model, progress=False, **TINY_ARGS) as colocated:
        outs = colocated.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                                  sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                                   for m in max_new])
    ref = [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]
    try:
        with running([node0, decode]):
            # Each node registered its own shards (one head each) and its own session; node 1
            # retries until node 0's bootstrap server is up (after warm-up), so within ~1 s.
            route = wait_until(lambda: _route(bport), 10)
            assert route is not None and route["tp_size"] == 2, route
            ranks = sorted(route["ranks"], key=lambda r: r["tp_rank"])
            assert [[b["shard_heads"] for b in r["kv_buffers"]] for r in ranks] == [
                [[[0, 1]]] * 2, [[[1, 1]]] * 2]
            assert len({r["session_id"] for r in ranks}) == 2
            for k, (ids, m) in enumerate(zip(prompts, max_new)):
                out = pd_pair(node0, decode, bport, ids, 5000 + k, m, stream=(k == 1))
                assert greedy_agrees(*ref[k], out["output_ids"]) >= 1
                assert len(out["output_ids"]) == m
            recent = {r["room"]: r for r in pd_state(node0)["recent"]}
            for k, n in enumerate(lengths):
                rec = recent[5000 + k]
                assert rec["state"] == "Success", rec
                pages = -(-n // PAGE_SIZE) - rec["decode_prefix_len"] // PAGE_SIZE
                assert rec["pages"] == pages and rec["bytes"] == pages * BYTES_PER_PAGE, rec
                # 2 buffers x 2 head slices (one per node), a copy per page, layer and token.
                assert rec["copies"] == 2 * KV_HEADS * pages * LAYERS * PAGE_SIZE, rec
            # Node 0 wrote its half itself (plus the metadata rows); node 1 the other half.
            engine = pd_state(node0)["engine"]
            half = sum(recent[5000 + k]["pages"] for k in range(len(lengths))) * BYTES_PER_PAGE // 2
            assert half <= engine["bytes"] < 2 * half, engine
            for server in (node0, decode):
                assert wait_until(lambda: at_baseline(server), 10), load(server)
            assert load(decode)["num_prompt_tokens_computed"] == 0
    except BaseException:
        print(f"==== node1 log ====\n{node1.log_tail(80)}")
        raise
    finally:
        node1.stop()


def test_one_prefill_to_two_node_decode_equals_colocated(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    logs = str(tmp_path)
    coord, http, bport = free_port(), free_port(), free_port()
    # A decode computes no prompt: one token bucket (16) is enough, one shape less to compile.
    decode_args = dict(extra=["--num-reserved-decode-tokens", "16"], chunked_prefill_size=16)
    node0 = _node("decode", model, 0, coord, http, logs, **decode_args)
    node1 = _node("decode", model, 1, coord, 0, logs, **decode_args)
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport,
                        extra=["--disaggregation-secret", SECRET])
    from pdjax.engine import Engine

    rng = random.Random(1365)
    lengths, max_new = [6, 19, 41], [7, 5, 6]
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    with Engine(model_path=model, progress=False, **TINY_ARGS) as colocated:
        outs = colocated.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                                  sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                                   for m in max_new])
    ref = [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]
    try:
        with running([node0, prefill]):
            compared = []
            for k, (ids, m) in enumerate(zip(prompts, max_new)):
                out = pd_pair(prefill, node0, bport, ids, 6000 + k, m, stream=(k == 2))
                assert len(out["output_ids"]) == m
                compared.append(greedy_agrees(*ref[k], out["output_ids"]))
            # Beyond the prefill's first token: the decode's own steps, over both nodes' heads.
            assert max(compared) >= 2, compared
            assert wait_until(lambda: at_baseline(prefill), 10), load(prefill)
            recent = {r["room"]: r for r in pd_state(prefill)["recent"]}
            for k, n in enumerate(lengths):
                rec = recent[6000 + k]
                assert rec["state"] == "Success", rec
                pages = -(-n // PAGE_SIZE) - rec["decode_prefix_len"] // PAGE_SIZE
                assert pages >= 1 and rec["pages"] == pages, rec
                assert rec["bytes"] == pages * BYTES_PER_PAGE, rec
                # Each decode node's shard (one head of K and V) got its half, in its session.
                assert rec["node_bytes"] == [pages * BYTES_PER_PAGE // 2] * 2, rec
                # 2 buffers x 2 head slices (one per decode node), a copy per page, layer, token.
                assert rec["copies"] == 2 * KV_HEADS * pages * LAYERS * PAGE_SIZE, rec
            # The decode registered both nodes' shards: the prefill wrote every byte it counted.
            engine = pd_state(prefill)["engine"]
            total = sum(recent[6000 + k]["bytes"] for k in range(len(lengths)))
            assert total <= engine["bytes"], engine
            assert wait_until(lambda: at_baseline(node0), 10), load(node0)
            assert load(node0)["num_prompt_tokens_computed"] == 0
            assert load(node0)["num_metadata_slots_used"] == 0
            d_state = pd_state(node0)
            assert [p["state"] for p in d_state["peers"]] == ["ready"], d_state["peers"]
            assert d_state["num_rejected_messages"] == 0, d_state
            nodes = d_state["nodes"]      # node 1 reported once: its cache never moved
            assert [(n["node_rank"], n["generation"]) for n in nodes] == [(1, 0)], nodes
            assert nodes[0]["session_id"] != d_state["session_id"], nodes   # its own engine
            assert d_state["kv_shard_heads"] == [[[0, 1]]] * 2      # node 0: head 0 of K, V
    except BaseException:
        print(f"==== decode node1 log ====\n{node1.log_tail(80)}")
        raise
    finally:
        node1.stop()
