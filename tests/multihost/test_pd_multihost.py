"""Multi-host PD roles (DESIGN.md §6), TP 2 over two processes on 127.0.0.1 (one CPU
device each, so each node holds one of the tiny Llama's two KV heads), over Mooncake TCP:

* a prefill of two ``--role prefill --nnodes 2`` nodes sending to a TP 1 decode process: each
  node registers its own shards and transfer session with the bootstrap server and writes its
  own head slices into the decode's pages;
* a TP 1 prefill sending to a decode of two ``--role decode --nnodes 2`` nodes: each decode
  node reports its session and shards to node 0, whose registration carries them all; the
  prefill writes each node's head slice into that node's buffers, in the pages node 0's
  scheduler reserved;
* the two-node prefill sending to the two-node decode: pages move rank to rank, each prefill
  node writing its head into the decode node that holds it, the metadata row last from
  prefill node 0 once both prefill nodes wrote.

Greedy outputs equal the colocated engine's (DESIGN.md §5), and per room the bytes and copies
are those of the plan: pages x the decode's bytes per page, one copy per page, layer, token
slot and head slice (a whole-shard slice: per contiguous run and layer). Every control frame
is sealed with a shared secret. The clusters are module-scoped: each starts (and compiles)
once, and the last test pairs the first two tests' multi-host sides.
"""

from __future__ import annotations

import os
import random
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_nodes import decode_nodes, node, node_pair  # noqa: E402
from pd_harness import (PAGE_SIZE, at_baseline,  # noqa: E402
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
    return node(role, model, rank, coord, http, logs, ["--disaggregation-secret", SECRET, *extra],
                **overrides)


def _route(bport):
    """The prefill's ``GET /route`` once every node registered (503 before), else None."""
    status, body = get(f"http://127.0.0.1:{bport}/route")
    return body if status == 200 else None


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pd_multihost"))


def _reference(engine, prompts, max_new):
    outs = engine.generate(input_ids=prompts, return_logprob=True, top_logprobs_num=2,
                           sampling_params=[{"temperature": 0, "max_new_tokens": m}
                                            for m in max_new])
    return [(o["output_ids"], o["meta_info"]["output_top_logprobs"]) for o in outs]


@pytest.fixture(scope="module")
def prefill2(tiny_checkpoints, logs):
    """A prefill over two nodes, once node 1 registered (it retries until node 0's bootstrap
    server is up, after warm-up, so within ~1 s)."""
    model = tiny_checkpoints["llama"]
    coord, http, bport = free_port(), free_port(), free_port()
    node0 = _prefill_node(model, 0, coord, http, bport, logs)
    node1 = _prefill_node(model, 1, coord, 0, bport, logs)
    with node_pair(node0, node1):
        route = wait_until(lambda: _route(bport), 10)
        yield types.SimpleNamespace(node0=node0, node1=node1, bport=bport, route=route)


@pytest.fixture(scope="module")
def decode2(tiny_checkpoints, logs):
    yield from decode_nodes(tiny_checkpoints["llama"], logs, ["--disaggregation-secret", SECRET])


@pytest.fixture(scope="module")
def decode1(tiny_checkpoints, logs):
    decode = pd_server("decode", "decode", tiny_checkpoints["llama"], logs,
                       extra=["--disaggregation-secret", SECRET])
    with running([decode]):
        yield decode


@pytest.fixture(scope="module")
def prefill1(tiny_checkpoints, logs):
    bport = free_port()
    prefill = pd_server("prefill", "prefill", tiny_checkpoints["llama"], logs,
                        bootstrap_port=bport, extra=["--disaggregation-secret", SECRET])
    with running([prefill]):
        yield prefill


def _runs(chunk) -> int:
    """Contiguous (src, dst) page runs of one chunk."""
    src, dst = chunk["src"], chunk["dst"]
    return len(src) and 1 + sum(1 for i in range(1, len(src))
                                if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)


def _serve(prefill, decode, bport, colocated, *, seed, lengths, max_new, room0, stream_k):
    """One prompt of each length through ``prefill`` -> ``decode`` in rooms ``room0 + k``
    (prompt ``stream_k`` streamed), every output of its length. Returns the prefill's records
    of the rooms (each a Success moving ``pages`` pages of the prompt's own, past the decode's
    prefix hit), the pages, the tie-aware agreement with colocated per prompt, and the
    prefill engine's bytes before."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in lengths]
    ref = _reference(colocated, prompts, max_new)
    before = pd_state(prefill)["engine"]["bytes"]
    compared = []
    for k, (ids, m) in enumerate(zip(prompts, max_new)):
        out = pd_pair(prefill, decode, bport, ids, room0 + k, m, stream=(k == stream_k))
        assert len(out["output_ids"]) == m
        compared.append(greedy_agrees(*ref[k], out["output_ids"]))
    assert wait_until(lambda: at_baseline(prefill), 10), load(prefill)
    recent = {r["room"]: r for r in pd_state(prefill)["recent"]}
    recs, pages = [recent[room0 + k] for k in range(len(lengths))], []
    for rec, n in zip(recs, lengths):
        assert rec["state"] == "Success", rec
        pages.append(-(-n // PAGE_SIZE) - rec["decode_prefix_len"] // PAGE_SIZE)
        assert pages[-1] >= 1 and rec["pages"] == pages[-1], rec
        assert rec["bytes"] == pages[-1] * BYTES_PER_PAGE, rec
    return recs, pages, compared, before


def test_two_node_prefill_to_one_decode_equals_colocated(prefill2, decode1, colocated):
    node0, decode, bport = prefill2.node0, decode1, prefill2.bport
    # Each node registered its own shards (one head each) and its own session.
    route = prefill2.route
    assert route is not None and route["tp_size"] == 2, route
    ranks = sorted(route["ranks"], key=lambda r: r["tp_rank"])
    assert [[b["shard_heads"] for b in r["kv_buffers"]] for r in ranks] == [
        [[[0, 1]]] * 2, [[[1, 1]]] * 2]
    assert len({r["session_id"] for r in ranks}) == 2
    recs, pages, compared, before = _serve(node0, decode, bport, colocated, seed=1364,
                                           lengths=[5, 17, 45], max_new=[6, 8, 5],
                                           room0=5000, stream_k=1)
    assert min(compared) >= 1, compared
    for rec, n_pages in zip(recs, pages):
        assert rec["node_bytes"] == [n_pages * BYTES_PER_PAGE], rec      # one decode process
        # 2 buffers x 2 head slices (one per node), a copy per page, layer and token.
        assert rec["copies"] == 2 * KV_HEADS * n_pages * LAYERS * PAGE_SIZE, rec
    # Node 0 wrote its half itself (plus the metadata rows); node 1 the other half.
    moved = pd_state(node0)["engine"]["bytes"] - before
    half = sum(pages) * BYTES_PER_PAGE // 2
    assert half <= moved < 2 * half, (moved, half)
    for server in (node0, decode):
        assert wait_until(lambda: at_baseline(server), 10), load(server)
    assert load(decode)["num_prompt_tokens_computed"] == 0


def test_one_prefill_to_two_node_decode_equals_colocated(prefill1, decode2, colocated):
    node0, prefill, bport = decode2.node0, prefill1, prefill1.bootstrap_port
    recs, pages, compared, before = _serve(prefill, node0, bport, colocated, seed=1365,
                                           lengths=[6, 19, 41], max_new=[7, 5, 6],
                                           room0=6000, stream_k=2)
    # Beyond the prefill's first token: the decode's own steps, over both nodes' heads.
    assert max(compared) >= 2, compared
    for rec, n_pages in zip(recs, pages):
        # Each decode node's shard (one head of K and V) got its half, in its session.
        assert rec["node_bytes"] == [n_pages * BYTES_PER_PAGE // 2] * 2, rec
        # 2 buffers x 2 head slices (one per decode node), a copy per page, layer, token.
        assert rec["copies"] == 2 * KV_HEADS * n_pages * LAYERS * PAGE_SIZE, rec
    # The decode registered both nodes' shards: the prefill wrote every byte it counted.
    assert sum(rec["bytes"] for rec in recs) <= pd_state(prefill)["engine"]["bytes"] - before
    _decode_at_baseline(node0, f"127.0.0.1:{bport}", only=True)


def _decode_at_baseline(node0, bootstrap, only):
    """The decode's pages back, no prompt computed, its pairing with ``bootstrap`` (``only``:
    the only prefill it paired with) and every other one ready, node 1 reported once."""
    assert wait_until(lambda: at_baseline(node0), 10), load(node0)
    assert load(node0)["num_prompt_tokens_computed"] == 0
    assert load(node0)["num_metadata_slots_used"] == 0
    d_state = pd_state(node0)
    peers = {p["bootstrap"]: p["state"] for p in d_state["peers"]}
    assert set(peers.values()) == {"ready"} and bootstrap in peers, peers
    assert not only or len(peers) == 1, peers
    assert d_state["num_rejected_messages"] == 0, d_state
    nodes = d_state["nodes"]      # node 1 reported once: its cache never moved
    assert [(n["node_rank"], n["generation"]) for n in nodes] == [(1, 0)], nodes
    assert nodes[0]["session_id"] != d_state["session_id"], nodes   # its own engine
    assert d_state["kv_shard_heads"] == [[[0, 1]]] * 2      # node 0: head 0 of K, V


def test_two_node_prefill_to_two_node_decode_equals_colocated(prefill2, decode2, colocated):
    p0, d0, bport = prefill2.node0, decode2.node0, prefill2.bport
    recs, pages, compared, before = _serve(p0, d0, bport, colocated, seed=1366,
                                           lengths=[7, 23, 38], max_new=[6, 7, 5],
                                           room0=7000, stream_k=0)
    assert max(compared) >= 2, compared
    for rec, n_pages in zip(recs, pages):
        # Prefill node r's head lands in decode node r's shard: half the bytes per decode node.
        assert rec["node_bytes"] == [n_pages * BYTES_PER_PAGE // 2] * 2, rec
        # Head slices are whole shards on both sides: per chunk, 2 buffers x 2 slices (one per
        # node pair) x a copy per contiguous page run and layer.
        for chunk in rec["chunks"]:
            assert chunk["copies"] == 2 * KV_HEADS * LAYERS * _runs(chunk), chunk
        assert rec["copies"] == sum(c["copies"] for c in rec["chunks"]), rec
    # Prefill node 0 wrote only its head (into decode node 0) and the metadata rows.
    moved = pd_state(p0)["engine"]["bytes"] - before
    half = sum(pages) * BYTES_PER_PAGE // 2
    assert half <= moved < 2 * half, (moved, half)
    # This prefill and test 2's one-process one, when it ran, are both paired and ready.
    _decode_at_baseline(d0, f"127.0.0.1:{bport}", only=False)
