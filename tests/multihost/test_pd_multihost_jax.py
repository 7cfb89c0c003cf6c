"""Multi-host PD over ``--disaggregation-transfer-backend jax`` (DESIGN.md §4, the jax backend;
§6): TP 2 over two processes on 127.0.0.1 (one CPU device each, so each node holds one of the
tiny Llama's two KV heads). Each process runs its own ``jax.experimental.transfer`` server and
offer socket and moves only its own shards, paired by rank:

* a two-node prefill feeding a one-process decode: each prefill node offers its head (one
  head-group unit of K and of V) under its own uuid; the decode pulls both and assembles them;
* a one-process prefill feeding a two-node decode: the prefill offers decode node ``d`` the
  head it holds; node 0's metadata gate has node 1 scatter its units at the same step
  boundary (``kv_stage_in``);
* two nodes to two nodes: prefill node ``r``'s head goes to decode node ``r`` alone; the
  tiny DeepSeek-V3.2's latent and indexer caches (no heads) go from prefill node ``r`` to
  decode node ``r`` too;
* decode node 1 killed: the request ends with an error within the deadlines, the prefill's
  pages come back and it keeps serving another decode.

Greedy outputs equal the colocated engine's (tie-aware, DESIGN.md §5); per room the bytes are
the decode shards' (pages x bytes per page, split per decode node) and the arrays pulled are
the head-group units (2 per buffer). Frames and offers are sealed with a shared secret.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_nodes import decode_nodes, node, node_pair  # noqa: E402
from pd_harness import (PAGE_SIZE, TINY_ARGS, at_baseline,  # noqa: E402
                        free_port, get, greedy_agrees, load, pd_body, pd_pair, pd_server,
                        pd_state, post, running, wait_until)

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 16, 4      # tiny llama, float32 KV
BYTES_PER_PAGE = 2 * LAYERS * PAGE_SIZE * KV_HEADS * HEAD_DIM * ITEMSIZE   # K and V, both heads
SECRET = "multi-host-jax"
JAX = ["--disaggregation-transfer-backend", "jax", "--disaggregation-secret", SECRET,
       "--transfer-timeout-s", "20"]

pytestmark = pytest.mark.slow


def _node(role, model, rank, coord, http, logs, extra=(), **overrides):
    return node(role, model, rank, coord, http, logs, [*JAX, *extra], **overrides)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pd_multihost_jax"))


@pytest.fixture(scope="module")
def prefill2(tiny_checkpoints, logs):
    model = tiny_checkpoints["llama"]
    coord, http, bport = free_port(), free_port(), free_port()
    extra = ["--disaggregation-bootstrap-port", str(bport)]
    node0 = _node("prefill", model, 0, coord, http, logs, extra)
    node1 = _node("prefill", model, 1, coord, 0, logs, extra)
    with node_pair(node0, node1):
        route = wait_until(lambda: (lambda s, b: b if s == 200 else None)(
            *get(f"http://127.0.0.1:{bport}/route")), 10)
        yield types.SimpleNamespace(node0=node0, node1=node1, bport=bport, route=route)


@pytest.fixture(scope="module")
def decode2(tiny_checkpoints, logs):
    yield from decode_nodes(tiny_checkpoints["llama"], logs, JAX)


@pytest.fixture(scope="module")
def decode1(tiny_checkpoints, logs):
    decode = pd_server("decode", "decode", tiny_checkpoints["llama"], logs, extra=JAX)
    with running([decode]):
        yield decode


@pytest.fixture(scope="module")
def prefill1(tiny_checkpoints, logs):
    bport = free_port()
    prefill = pd_server("prefill", "prefill", tiny_checkpoints["llama"], logs,
                        bootstrap_port=bport, extra=JAX)
    with running([prefill]):
        yield prefill


def _reference(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                           sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                            for m in max_new])
    return [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]


def _serve(prefill, decode, bport, colocated, *, seed, lengths, max_new, room0, decode_nodes,
           page_size=PAGE_SIZE, bytes_per_page=BYTES_PER_PAGE):
    """One prompt of each length through ``prefill`` -> ``decode`` (prompt 1 streamed); the
    tokens agree with colocated's (tie-aware, counted per prompt), every room a Success whose
    bytes are the decode shards' (``bytes_per_page`` a page, split evenly over
    ``decode_nodes``) and whose arrays are 4 a chunk (the tiny Llama: K's and V's two
    head-group units; the tiny DeepSeek over two decode nodes: its latent and indexer keys
    once per node). Returns the agreements and the pages moved."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    ref = _reference(colocated, prompts, max_new)
    compared = []
    for k, (ids, m) in enumerate(zip(prompts, max_new)):
        out = pd_pair(prefill, decode, bport, ids, room0 + k, m, stream=(k == 1))
        assert len(out["output_ids"]) == m
        compared.append(greedy_agrees(*ref[k], out["output_ids"]))
    assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 20), \
        (load(prefill), load(decode))
    recent = {r["room"]: r for r in pd_state(prefill)["recent"]}
    moved = 0
    for k, n in enumerate(lengths):
        rec = recent[room0 + k]
        assert rec["state"] == "Success", rec
        pages = -(-n // page_size) - rec["decode_prefix_len"] // page_size
        assert pages >= 1 and rec["pages"] == pages, rec
        assert rec["bytes"] == pages * bytes_per_page, rec
        assert rec["node_bytes"] == [pages * bytes_per_page // decode_nodes] * decode_nodes
        assert rec["copies"] == 4 * len(rec["chunks"]), rec
        moved += pages
    assert load(decode)["num_prompt_tokens_computed"] == 0
    return compared, moved


def test_deepseek_v32_two_nodes_to_two_nodes_over_jax_equals_colocated(tiny_checkpoints,
                                                                       tmp_path):
    """The tiny DeepSeek-V3.2 (MLA latent + DSA indexer keys: no KV heads, a replica on every
    device) from two prefill nodes to two decode nodes: decode node d pulls both caches once,
    from prefill node d; prompts past index_topk, so the sparse selection reads moved keys.
    First in the module: the Llama clusters (module fixtures) are not up yet."""
    import json

    from pdjax.engine import Engine

    model = tiny_checkpoints["deepseek_v32_long"]
    with open(os.path.join(model, "config.json")) as f:
        assert json.load(f)["index_topk"] < 33
    args = dict(page_size=8, max_total_tokens=512, chunked_prefill_size=16,
                max_running_requests=2, context_length=64)
    logs = str(tmp_path)
    coords, https, bport = [free_port() for _ in range(2)], [free_port() for _ in range(2)], \
        free_port()
    extra = ["--disaggregation-bootstrap-port", str(bport)]
    p = [_node("prefill", model, r, coords[0], https[0] if r == 0 else 0, logs, extra, **args)
         for r in range(2)]
    d = [_node("decode", model, r, coords[1], https[1] if r == 0 else 0, logs,
               ["--num-reserved-decode-tokens", "16"], **args) for r in range(2)]
    with Engine(model_path=model, progress=False, **dict(TINY_ARGS, **args)) as colocated, \
            node_pair(p[0], p[1]), node_pair(d[0], d[1]):
        assert wait_until(lambda: get(f"http://127.0.0.1:{bport}/route")[0] == 200, 30)
        bpp = 2 * pd_state(d[0])["kv_bytes_per_page"]          # both nodes' replicas
        compared, _ = _serve(p[0], d[0], bport, colocated, seed=46, lengths=[9, 33, 41],
                             max_new=[5, 6, 4], room0=12000, decode_nodes=2, page_size=8,
                             bytes_per_page=bpp)
        assert max(compared) >= 2, compared
        assert [len(h) for h in pd_state(d[0])["kv_shard_heads"]] == [1, 1]


def test_two_node_prefill_to_one_decode_over_jax_equals_colocated(prefill2, decode1,
                                                                  colocated):
    route = prefill2.route
    assert route is not None and route["tp_size"] == 2, route
    ranks = sorted(route["ranks"], key=lambda r: r["tp_rank"])
    assert [[b["shard_heads"] for b in r["kv_buffers"]] for r in ranks] == [
        [[[0, 1]]] * 2, [[[1, 1]]] * 2]
    assert len({r["session_id"] for r in ranks}) == 2          # an offer socket per node
    before = pd_state(prefill2.node0)["engine"]["bytes"]
    compared, pages = _serve(prefill2.node0, decode1, prefill2.bport, colocated, seed=42,
                             lengths=[5, 17, 45], max_new=[6, 8, 5], room0=8000,
                             decode_nodes=1)
    assert min(compared) >= 1, compared
    # Prefill node 0 offered its own head only; node 1 the other.
    assert pd_state(prefill2.node0)["engine"]["bytes"] - before == pages * BYTES_PER_PAGE // 2
    assert pd_state(decode1)["transfer_backend"] == "jax"


def test_one_prefill_to_two_node_decode_over_jax_equals_colocated(prefill1, decode2,
                                                                  colocated):
    compared, pages = _serve(prefill1, decode2.node0, prefill1.bootstrap_port, colocated,
                             seed=43, lengths=[6, 19, 41], max_new=[7, 5, 6], room0=9000,
                             decode_nodes=2)
    assert max(compared) >= 2, compared      # the decode's own steps, over both nodes' heads
    state = pd_state(decode2.node0)
    assert [(n["node_rank"], n["generation"]) for n in state["nodes"]] == [(1, 0)]
    assert state["nodes"][0]["session_id"] != state["session_id"]      # its own offer socket
    assert state["kv_shard_heads"] == [[[0, 1]]] * 2                    # node 0: head 0
    assert state["num_rejected_messages"] == 0


def test_two_node_prefill_to_two_node_decode_over_jax_equals_colocated(prefill2, decode2,
                                                                      colocated):
    p0 = prefill2.node0
    before = pd_state(p0)["engine"]["bytes"]
    compared, pages = _serve(p0, decode2.node0, prefill2.bport, colocated, seed=44,
                             lengths=[7, 23, 38], max_new=[6, 7, 5], room0=10000,
                             decode_nodes=2)
    assert max(compared) >= 2, compared
    # Prefill node r's head went to decode node r alone: node 0 offered half the bytes.
    assert pd_state(p0)["engine"]["bytes"] - before == pages * BYTES_PER_PAGE // 2


def test_a_killed_decode_node_fails_the_request_and_the_prefill_keeps_serving(
        prefill2, decode2, decode1, colocated):
    """kill -9 of decode node 1: a request to that decode ends with an error naming the node
    (the offer to the dead node is never acked, or node 0 loses the node) within the
    deadlines, both sides' pages come back (decode node 0 stays up, unhealthy), and the
    prefill then serves the one-process decode."""
    p0, bport = prefill2.node0, prefill2.bport
    os.killpg(decode2.node1.proc.pid, signal.SIGKILL)
    rng = random.Random(45)
    ids = [rng.randrange(3, 440) for _ in range(21)]
    body = pd_body(ids, 11000, bport, max_new_tokens=4)
    import concurrent.futures
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, p0.url + "/generate", body, 120.0)
        d_status, d_out = post(decode2.node0.url + "/generate", body, 120.0)
        p_status, p_out = p.result()
    assert d_status != 200 and "node 1" in str(d_out), (d_status, d_out)
    assert time.monotonic() - t0 < 90
    assert wait_until(lambda: at_baseline(p0), 60), load(p0)
    # Decode node 0 lost its node (503 naming it) but its engine thread runs: no page held.
    status, body = get(decode2.node0.url + "/health")
    assert status == 503 and "node 1" in str(body), (status, body)
    assert wait_until(lambda: at_baseline(decode2.node0), 30), load(decode2.node0)
    assert load(decode2.node0)["num_metadata_slots_used"] == 0
    (ref,) = _reference(colocated, [ids], [4])
    out = pd_pair(p0, decode1, bport, ids, 11001, 4)
    assert greedy_agrees(*ref, out["output_ids"]) >= 1
    assert wait_until(lambda: at_baseline(p0) and at_baseline(decode1), 20)
