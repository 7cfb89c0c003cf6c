"""PD faults and the data plane under stress, on real processes:

* P2 (prefill): fragmented free list, engine batches of at most 16 copies, 6 s bootstrap
  timeout; D2 (decode): fragmented free list, the staging path, 0.5 s heartbeats, 4 s drain
  timeout; P3 (prefill): the test-only ``mooncake-corrupt`` backend over the staging path.
* The test process also plays a rogue decode and a rogue prefill over the real protocol.

Each fault must give the client a clear error within its timeout, leave no page held on the
surviving servers, and leave them serving.
"""

import concurrent.futures
import random
import time

import pytest
import zmq
from pd_harness import (PAGE_SIZE, TINY_ARGS, at_baseline, count_runs, free_port, load,
                        pd_body, pd_server, pd_state, post, running, wait_until)
from rogue_prefill import RoguePrefill

from pdjax.pd.bootstrap import BootstrapServer, PrefillRankInfo, fetch_prefill_info
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.lifecycle import KVPoll
from pdjax.pd.protocol import (Abort, AbortAck, RegisterDecode, RegisterResult, TransferRequest,
                               TransferStatus)
from pdjax.pd.wire import prompt_digest
from pdjax.transfer.channel import MessageChannel
from pdjax.transfer.metadata import MetadataBuffers

pytestmark = pytest.mark.slow
MAX_BATCH = 16
DRAIN_S = 8.0     # the abort lease: long enough that an ack or a count beats it under load


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_faults"))
    model = tiny_checkpoints["llama"]
    b2, b3 = free_port(), free_port()
    common = ["--heartbeat-interval-s", "0.5", "--drain-timeout-s", str(DRAIN_S),
              "--waiting-timeout-s", "30", "--transfer-timeout-s", "30"]
    p2 = pd_server("p2", "prefill", model, logs, bootstrap_port=b2,
                   extra=common + ["--bootstrap-timeout-s", "6"],
                   hooks=["--shuffle-free-pages", "1"],
                   disaggregation_transfer_max_batch=MAX_BATCH)
    d2 = pd_server("d2", "decode", model, logs, extra=common + ["--bootstrap-timeout-s", "10"],
                   hooks=["--shuffle-free-pages", "2"],
                   disaggregation_transfer_path="staging")
    p3 = pd_server("p3", "prefill", model, logs, bootstrap_port=b3, extra=common,
                   hooks=["--corrupt-backend"],
                   disaggregation_transfer_backend="mooncake-corrupt",
                   disaggregation_transfer_path="staging")
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **TINY_ARGS)
    try:
        with running([p2, d2, p3]):
            yield dict(p2=p2, d2=d2, p3=p3, colocated=colocated, logs=logs)
    finally:
        colocated.shutdown()


_rooms = iter(range(10_000, 1 << 40, 7919))


def _dispatch(prefill, decode, ids, max_new=8, room=None, rid=None):
    """What a PD router does: the same body to both, concurrently; returns both answers."""
    room = room or next(_rooms)
    body = pd_body(ids, room, prefill.bootstrap_port, max_new_tokens=max_new)
    if rid:
        body["rid"] = rid
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(post, prefill.url + "/generate", body)
        fd = pool.submit(post, decode.url + "/generate", body)
        return fp.result(), fd.result()


def _greedy(colocated, ids, max_new=8):
    return colocated.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                              "max_new_tokens": max_new})["output_ids"]


def _error_text(body) -> str:
    return body["error"]["message"] if isinstance(body, dict) and "error" in body else str(body)


def _serves(cluster, prefill="p2"):
    rng = random.Random(time.monotonic_ns())
    ids = [rng.randrange(3, 440) for _ in range(37)]
    (ps, pb), (ds, db) = _dispatch(cluster[prefill], cluster["d2"], ids, 6)
    assert ps == 200 and ds == 200, (pb, db)
    return ids, db["output_ids"]


def test_fragmented_free_lists_copy_counts_and_batch_limit(cluster):
    """Shuffled free lists on both sides: copies = contiguous runs x layer buffers, and no
    engine batch exceeds the per-peer limit; the staging decode still matches colocated."""
    p2, d2 = cluster["p2"], cluster["d2"]
    rng = random.Random(21)
    # The longest prompt and its 8 new tokens fill the 256-token context (a 400 past it).
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in (45, 77, 130, 161, 199, 248)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: _dispatch(p2, d2, p, 8), prompts))
    for p, ((ps, pb), (ds, db)) in zip(prompts, answers):
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == _greedy(cluster["colocated"], p)
        assert pb["output_ids"] == db["output_ids"][:1]
    state = pd_state(p2)
    assert state["max_batch"] == MAX_BATCH and state["transfer_path"] == "direct"
    assert pd_state(d2)["transfer_path"] == "staging"
    buffers = state["num_layer_buffers"]
    pages = runs = batches = 0
    for rec in state["recent"]:
        assert rec["state"] == "Success"
        rec_runs = sum(count_runs(c["src"], c["dst"]) for c in rec["chunks"])
        assert rec["copies"] == rec_runs * buffers
        pages += rec["pages"]
        runs += rec_runs
        # One engine call per chunk (+1 copy for the metadata row on the last), cut in 16s.
        batches += sum(-(-(c["copies"] + c["last"]) // MAX_BATCH) for c in rec["chunks"])
    assert pages == sum(-(-len(p) // PAGE_SIZE) for p in prompts)
    assert runs > 0.7 * pages                 # fragmented: most pages are their own run
    assert state["engine"]["largest_batch"] == MAX_BATCH
    assert state["engine"]["batches"] == batches
    assert state["engine"]["copies"] == runs * buffers + len(prompts)
    assert wait_until(lambda: at_baseline(p2) and at_baseline(d2), 10)
    assert load(d2)["num_prompt_tokens_computed"] == 0


def test_corrupting_backend_changes_the_output(cluster):
    """P3 flips one byte (the top exponent bit of one K element) per engine call: the decode
    uses the transferred KV, so its tokens after the first (sampled on the prefill) change."""
    p3, d2 = cluster["p3"], cluster["d2"]
    assert pd_state(p3)["transfer_backend"] == "mooncake-corrupt"
    assert pd_state(p3)["transfer_path"] == "staging"
    rng = random.Random(22)
    for n in (40, 97):
        ids = [rng.randrange(3, 440) for _ in range(n)]
        ref = _greedy(cluster["colocated"], ids, 10)
        (ps, pb), (ds, db) = _dispatch(p3, d2, ids, 10)
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"][0] == ref[0]
        assert db["output_ids"][1:] != ref[1:]
    # The same prompts through the honest prefill are right again (D2 is unharmed).
    ids, out = _serves(cluster)
    assert out == _greedy(cluster["colocated"], ids, 6)
    assert wait_until(lambda: at_baseline(p3) and at_baseline(d2), 10)


def test_duplicate_rooms_are_refused_at_once(cluster):
    p2, d2, colocated = cluster["p2"], cluster["d2"], cluster["colocated"]
    ids = list(range(100, 150))
    room = next(_rooms)
    body = pd_body(ids, room, p2.bootstrap_port, max_new_tokens=5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, d2.url + "/generate", body)      # waits for its KV
        assert wait_until(lambda: any(r["room"] == room and r["state"] == "Transferring"
                                      for r in pd_state(d2)["rooms"]), 10)
        t0 = time.monotonic()
        status, dup = post(d2.url + "/generate", body)
        assert status == 409 and "duplicate" in _error_text(dup) and time.monotonic() - t0 < 2
        # The original request still completes once its prefill half arrives.
        status, pre = post(p2.url + "/generate", body)
        assert status == 200, pre
        status, out = first.result()
        assert status == 200 and out["output_ids"] == _greedy(colocated, ids, 5)
        # On the prefill: a room still waiting for its decode cannot be taken twice.
        room2 = next(_rooms)
        body2 = dict(pd_body(ids, room2, p2.bootstrap_port), rid="dup-room-original")
        waiting = pool.submit(post, p2.url + "/generate", body2)
        assert wait_until(lambda: load(p2)["num_pd_rooms"] == 1, 5)
        status, dup = post(p2.url + "/generate", dict(body2, rid="dup-room-copy"))
        assert status == 409 and "duplicate" in _error_text(dup)
        post(p2.url + "/abort_request", {"rid": "dup-room-original"})
        status, out = waiting.result()
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_until(lambda: at_baseline(p2) and at_baseline(d2), 10)


def test_decode_abort_during_transfer_waits_for_the_prefill_ack(cluster):
    p2, d2 = cluster["p2"], cluster["d2"]
    ids = list(range(200, 290))
    room = next(_rooms)
    body = dict(pd_body(ids, room, p2.bootstrap_port), rid="abort-me")
    acks = pd_state(d2)["num_quarantine_released_by_ack"]
    cached = load(d2)["num_cached_pages"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, d2.url + "/generate", body)
        assert wait_until(lambda: any(r["room"] == room and r["state"] == "Transferring"
                                      for r in pd_state(d2)["rooms"]), 10)
        held = load(d2)["num_pinned_pages"]
        assert held >= -(-len(ids) // PAGE_SIZE)
        t0 = time.monotonic()
        status, res = post(d2.url + "/abort_request", {"rid": "abort-me"})
        assert status == 200 and res["num_aborted"] == 1
        status, out = pending.result()
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    # The pages come back on the prefill's ack, well before the drain timeout.
    assert wait_until(lambda: pd_state(d2)["num_quarantine_released_by_ack"] == acks + 1, DRAIN_S)
    assert time.monotonic() - t0 < DRAIN_S
    assert wait_until(lambda: at_baseline(d2), 5)
    assert load(d2)["num_cached_pages"] == cached     # aborted pages never enter the cache
    # The prefill learned of the abort: its half of the room fails at once, and the room is
    # not taken again (409 naming it, the reused-room rule).
    status, late = post(p2.url + "/generate", body)
    assert status == 409 and "aborted by the decode server" in _error_text(late)
    assert f"bootstrap_room {room}" in _error_text(late)
    assert wait_until(lambda: at_baseline(p2), 5)
    _serves(cluster)


def test_prefill_bootstrap_timeout(cluster):
    """A prefill request whose decode never sends a page list is never computed and fails."""
    p2 = cluster["p2"]
    computed = load(p2)["num_prompt_tokens_computed"]
    t0 = time.monotonic()
    status, out = post(p2.url + "/generate", pd_body([5, 6, 7, 8, 9], next(_rooms),
                                                      p2.bootstrap_port))
    elapsed = time.monotonic() - t0
    assert status == 500 and "bootstrap timeout" in _error_text(out)
    assert 5.5 < elapsed < 10
    assert load(p2)["num_prompt_tokens_computed"] == computed
    assert wait_until(lambda: at_baseline(p2), 5)


class RogueDecode:
    """The test process as a decode engine: its own PULL socket and the real messages."""

    def __init__(self, prefill_bootstrap_port: int):
        self.got: list = []
        self.channel = MessageChannel("127.0.0.1", self.got.append, "rogue-decode")
        info = fetch_prefill_info("127.0.0.1", prefill_bootstrap_port, 10)
        rank = info.rank(0)
        self.fingerprint = rank.layout_fingerprint
        self.prefill = f"tcp://{rank.rank_ip}:{rank.rank_port}"
        self.engine_id = f"rogue-{time.monotonic_ns()}"

    def register(self, page_size=PAGE_SIZE, num_pages=8, bufs=None) -> RegisterResult:
        # A TP 1 decode of the tiny llama: K and V, 2 layers, 2 KV heads of 16 float32.
        bufs = bufs or tuple(KVBufferDesc(shard_addrs=(1 << 20 + i,), num_layers=2,
                                          num_pages=num_pages,
                                          bytes_per_page=PAGE_SIZE * 2 * 16 * 4, num_heads=2,
                                          head_bytes=16 * 4)
                             for i in range(2))
        msg = RegisterDecode(
            decode_engine_id=self.engine_id, reply_endpoint=self.channel.endpoint,
            engine_session_id="127.0.0.1:1", tp_rank=0, tp_size=1, kv_buffers=bufs,
            kv_layout="layer_major", metadata_addr=1 << 30,
            metadata_bytes_per_slot=MetadataBuffers(1, 20).bytes_per_slot,
            metadata_num_slots=4, page_size=page_size, kv_dtype="float32",
            layout_fingerprint=self.fingerprint)
        self.channel.send(self.prefill, msg)
        return self.wait(RegisterResult)

    def wait(self, kind, room=None, timeout_s=5.0):
        def find():
            return next((m for m in self.got if isinstance(m, kind)
                         and (room is None or m.bootstrap_room == room)), None)
        msg = wait_until(find, timeout_s)
        assert msg is not None, f"no {kind.__name__} in {self.got}"
        self.got.remove(msg)
        return msg


def test_rogue_decode_out_of_pool_pages_write_failure_and_refused_pairing(cluster):
    p2 = cluster["p2"]
    rogue = RogueDecode(p2.bootstrap_port)
    try:
        refused = rogue.register(page_size=8)
        assert not refused.accepted and "page_size" in refused.reason
        # TP 2 shards (one of the 2 KV heads each) whose heads are half as wide as the
        # prefill's: the head-slice plan cannot map them, so the pairing is refused.
        narrow = tuple(KVBufferDesc(shard_addrs=((1 << 20) + 4096 * i, (1 << 21) + 4096 * i),
                                    num_layers=2, num_pages=8, bytes_per_page=PAGE_SIZE * 8 * 4,
                                    num_heads=2, shard_heads=((0, 1), (1, 1)), head_bytes=32)
                       for i in range(2))
        refused = rogue.register(bufs=narrow)
        assert not refused.accepted and "kv_buffers[0].head_bytes: 64 != 32" in refused.reason
        assert rogue.register().accepted
        rejected = pd_state(p2)["num_rejected_messages"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # Destination pages outside the registered pool (8 pages: 1..7 are valid).
            room = next(_rooms)
            client = pool.submit(post, p2.url + "/generate",
                                 pd_body(list(range(3, 11)), room, p2.bootstrap_port))
            assert wait_until(lambda: load(p2)["num_pd_rooms"] == 1, 5)
            prompt = dict(prompt_len=8, prompt_digest=prompt_digest(range(3, 11)))
            rogue.channel.send(rogue.prefill, TransferRequest(
                bootstrap_room=room, dst_pages=(3, 8), dst_metadata_slot=0, decode_prefix_len=0,
                decode_engine_id=rogue.engine_id, **prompt))
            status_msg = rogue.wait(TransferStatus, room)
            assert status_msg.state == KVPoll.Failed and "outside [1, 8)" in status_msg.reason
            status, out = client.result(timeout=5)
            assert status == 500 and "dst_pages" in _error_text(out)
            # A valid page list, but the "decode" is not a transfer engine: the write fails;
            # a second page list for the same room is a duplicate.
            room = next(_rooms)
            client = pool.submit(post, p2.url + "/generate",
                                 pd_body(list(range(3, 11)), room, p2.bootstrap_port))
            assert wait_until(lambda: load(p2)["num_pd_rooms"] == 1, 5)
            req = TransferRequest(bootstrap_room=room, dst_pages=(3, 4), dst_metadata_slot=1,
                                  decode_prefix_len=0, decode_engine_id=rogue.engine_id, **prompt)
            rogue.channel.send(rogue.prefill, req)
            rogue.channel.send(rogue.prefill, req)
            status, out = client.result(timeout=15)
            assert status == 500 and "KV write to decode" in _error_text(out)
            assert rogue.wait(TransferStatus, room).state == KVPoll.Failed
        assert wait_until(lambda: pd_state(p2)["num_rejected_messages"] >= rejected + 2, 5)
        assert wait_until(lambda: at_baseline(p2), 5)
    finally:
        rogue.channel.close()
    _serves(cluster)


def test_malformed_control_frames_are_dropped(cluster):
    p2, d2 = cluster["p2"], cluster["d2"]
    frames = [[b"\xc1 not msgpack"], [b"\x93\x01\x02\x03"], [b"\x82\xa1v\x63\xa1t\xa5abort"],
              [b"\x81\xa1v\x01", b"second frame"],
              [TransferStatus(bootstrap_room=123456789, state=KVPoll.Success).encode()]]
    ctx = zmq.Context()
    try:
        for server in (p2, d2):
            state = pd_state(server)
            before = state["num_rejected_messages"]
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(state["zmq_endpoint"])
            for f in frames:
                sock.send_multipart(f)
            assert wait_until(lambda: pd_state(server)["num_rejected_messages"]
                              == before + len(frames), 5), pd_state(server)
            sock.close()
    finally:
        ctx.term()
    ids, out = _serves(cluster)
    assert out == _greedy(cluster["colocated"], ids, 6)


def test_rogue_prefill_abort_and_the_metadata_gate(cluster):
    """A prefill Abort fails the decode request at once (its pages are free: the prefill has
    stopped writing) and is acknowledged; a Success status whose metadata row was never
    written is caught by the metadata gate."""
    d2 = cluster["d2"]
    fingerprint = fetch_prefill_info("127.0.0.1", cluster["p3"].bootstrap_port).layout_fingerprint
    rogue = RoguePrefill(fingerprint)
    try:
        ids = list(range(7, 57))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            room = next(_rooms)
            client = pool.submit(post, d2.url + "/generate", pd_body(ids, room, rogue.port))
            req = rogue.wait(TransferRequest, room)
            assert len(req.dst_pages) == -(-len(ids) // PAGE_SIZE) and req.decode_prefix_len == 0
            assert len(set(req.dst_pages)) == len(req.dst_pages)
            rogue.channel.send(rogue.decode_endpoint, Abort(bootstrap_room=room,
                                                            sender_id="rogue-prefill",
                                                            reason="prompt too long here"))
            status, out = client.result(timeout=5)
            assert status == 500 and "aborted by the prefill server: prompt too long here" \
                in _error_text(out)
            assert rogue.wait(AbortAck, room) is not None
            assert load(d2)["num_quarantined_pages"] == 0
            # Success without the metadata row: the gate refuses to commit.
            room = next(_rooms)
            client = pool.submit(post, d2.url + "/generate", pd_body(ids, room, rogue.port))
            rogue.wait(TransferRequest, room)
            rogue.channel.send(rogue.decode_endpoint, TransferStatus(bootstrap_room=room,
                                                                     state=KVPoll.Success))
            status, out = client.result(timeout=5)
            assert status == 500 and "metadata gate" in _error_text(out) \
                and "never written" in _error_text(out)
    finally:
        rogue.close()
    assert wait_until(lambda: at_baseline(d2), 5)
    _serves(cluster)


def test_page_size_mismatch_is_a_clear_error(cluster):
    """A prefill whose page size differs (the test process plays it): the decode refuses to
    pair and the client hears why at once; the prefill-side check is in the rogue test."""
    d2 = cluster["d2"]
    fake = BootstrapServer("127.0.0.1", 0)
    port = fake.start()
    try:
        fake.add_rank(PrefillRankInfo(rank_ip="127.0.0.1", rank_port=free_port(), tp_rank=0,
                                      tp_size=1, page_size=8, kv_dtype="float32",
                                      layout_fingerprint="0" * 16))
        t0 = time.monotonic()
        status, out = post(d2.url + "/generate", pd_body([1, 2, 3], next(_rooms), port))
        assert status == 500 and "page_size: prefill 8 != decode 4" in _error_text(out)
        assert time.monotonic() - t0 < 5
    finally:
        fake.stop()
    assert wait_until(lambda: at_baseline(d2), 5)
    _serves(cluster)


def test_prefill_killed_mid_transfer_then_restarted_pairs_again(cluster):
    p2, d2 = cluster["p2"], cluster["d2"]
    ids = list(range(300, 377))
    room = next(_rooms)
    timeouts = pd_state(d2)["num_quarantine_released_by_timeout"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, d2.url + "/generate", pd_body(ids, room, p2.bootstrap_port))
        assert wait_until(lambda: any(r["room"] == room and r["state"] == "Transferring"
                                      for r in pd_state(d2)["rooms"]), 10)
        p2.kill()
        t0 = time.monotonic()
        status, out = pending.result(timeout=10)
    assert status == 500 and "lost connection with prefill" in _error_text(out)
    assert time.monotonic() - t0 < 5
    # Nothing acknowledges the abort: the pages wait for the drain timeout, then come back.
    assert load(d2)["num_quarantined_pages"] == -(-len(ids) // PAGE_SIZE)
    assert wait_until(lambda: pd_state(d2)["num_quarantine_released_by_timeout"]
                      == timeouts + 1, DRAIN_S + 3)
    assert wait_until(lambda: at_baseline(d2), 5)
    # A restarted prefill (same ports, new ZMQ port and transfer session) pairs again.
    p2.start()
    p2.wait_healthy()
    ids, out = _serves(cluster)
    assert out == _greedy(cluster["colocated"], ids, 6)
    assert load(d2)["num_prompt_tokens_computed"] == 0
    assert wait_until(lambda: at_baseline(p2) and at_baseline(d2), 10)
