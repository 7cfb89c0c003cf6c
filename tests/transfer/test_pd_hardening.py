"""PD hardening on three real processes: prefill HP (context 64, the secret from
``PDJAX_DISAGGREGATION_SECRET``), decode HD (a 32-page pool, ``--disaggregation-secret``,
4 s drain timeout) and the pdjax router; the test process also plays a prefill (with the
secret) that never writes KV, and a client without it.

After every fault both servers answer /health, and on both the free pages, pinned pages, PD
rooms, metadata slots, quarantined pages and held requests are back at their baseline.
"""

import concurrent.futures
import random
import time

import pytest
import zmq
from pd_harness import (PAGE_SIZE, child_env, free_port, get, load, metric_value, pd_body,
                        pd_router, pd_server, pd_state, post, running, wait_until)
from rogue_prefill import RoguePrefill

from pdjax.pd.bootstrap import _http, _url, fetch_prefill_info
from pdjax.pd.frame_auth import FrameSealer
from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.pd.protocol import Heartbeat, RegisterDecode, TransferRequest
from pdjax.transfer.channel import MessageChannel
from pdjax.transfer.metadata import MetadataBuffers

pytestmark = pytest.mark.slow
SECRET = "issue-16-shared-secret"
DRAIN_S = 8.0     # the abort lease: long enough that an ack or a count beats it under load
D_PAGES = 32                 # HD: --max-total-tokens 128 in pages of 4
P_CONTEXT = 64


@pytest.fixture(scope="module")
def hard(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd_hardening"))
    model = tiny_checkpoints["llama"]
    bport = free_port()
    common = ["--heartbeat-interval-s", "0.5", "--drain-timeout-s", str(DRAIN_S),
              "--waiting-timeout-s", "20", "--transfer-timeout-s", "30",
              "--bootstrap-timeout-s", "20"]
    p = pd_server("hp", "prefill", model, logs, bootstrap_port=bport, extra=common,
                  env=child_env(PDJAX_DISAGGREGATION_SECRET=SECRET), context_length=P_CONTEXT)
    d = pd_server("hd", "decode", model, logs, extra=common + ["--disaggregation-secret", SECRET],
                  max_total_tokens=D_PAGES * PAGE_SIZE)
    router = pd_router("hrouter", p, bport, d, logs)
    with running([p, d, router]):
        yield dict(p=p, d=d, router=router, bport=bport)


_rooms = iter(range(70_001, 1 << 40, 104_729))
_rng = random.Random(16)


def _ids(n):
    return [_rng.randrange(3, 440) for _ in range(n)]


def _msg(body) -> str:
    return body["error"]["message"] if isinstance(body, dict) and "error" in body else str(body)


def _dispatch(hard, ids, room=None, timeout_s=60.0, **sampling):
    """What a PD router does, from the test process: the same body to both, concurrently."""
    body = pd_body(ids, room or next(_rooms), hard["bport"], **sampling)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(post, hard["p"].url + "/generate", body, timeout_s)
        fd = pool.submit(post, hard["d"].url + "/generate", body, timeout_s)
        return fp.result(), fd.result()


BASELINE_KEYS = ("num_free_pages", "num_pinned_pages", "num_pd_rooms", "num_running_reqs",
                 "num_metadata_slots_used")


def _snapshot(server) -> dict:
    ld = load(server)
    return {k: ld.get(k, 0) for k in BASELINE_KEYS + ("num_quarantined_pages", "num_held_reqs")}


def _idle(server) -> bool:
    ld = load(server)
    return (ld["num_pinned_pages"] == 0 and ld["num_pd_rooms"] == 0
            and ld["num_running_reqs"] == 0 and ld["num_metadata_slots_used"] == 0
            and ld.get("num_quarantined_pages", 0) == 0 and ld.get("num_held_reqs", 0) == 0
            and ld.get("num_bound_rooms", 0) == 0
            and ld["num_free_pages"] + ld["num_evictable_pages"] == ld["num_total_pages"])


def _assert_baseline(hard, before=None, timeout_s=10.0):
    """Both servers healthy and idle; with ``before`` (snapshots taken before a fault that
    served nothing), every counter equal to it, free pages included."""
    for name in ("p", "d"):
        server = hard[name]
        assert wait_until(lambda: _idle(server), timeout_s), (name, load(server))
        assert get(server.url + "/health")[0] == 200
        if before is not None:
            assert _snapshot(server) == before[name], (name, _snapshot(server), before[name])


def _before(hard):
    """Idle, prefix caches flushed (so that a page a failure leaks into the cache shows up as
    a missing free page), and the snapshot of both servers."""
    _assert_baseline(hard)
    for name in ("p", "d"):
        assert post(hard[name].url + "/flush_cache", {})[0] == 200
    snap = {name: _snapshot(hard[name]) for name in ("p", "d")}
    for name in ("p", "d"):
        assert snap[name]["num_free_pages"] == load(hard[name])["num_total_pages"]
    return snap


@pytest.fixture(scope="module")
def rogue(hard):
    fingerprint = fetch_prefill_info("127.0.0.1", hard["bport"]).layout_fingerprint
    r = RoguePrefill(fingerprint, secret=SECRET, ack_aborts=True)
    yield r
    r.close()


# ---------------------------------------------------------------------------------------------
# 1-4: wrong KV, hangs, lost errors


def test_reused_room_never_decodes_another_prompt(hard):
    """A decode-only request holds room R; a pair with another prompt of the same
    length reuses R. The prefill refuses to write it (the digest differs) and both fail, with
    409 Conflict naming the room (the client's mistake; it was a 500)."""
    p, d = hard["p"], hard["d"]
    before = _before(hard)
    room = next(_rooms)
    first, other = _ids(40), _ids(40)
    assert first != other
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lone = pool.submit(post, d.url + "/generate", pd_body(first, room, hard["bport"]))
        assert wait_until(lambda: any(r["room"] == room and r["state"] == "Transferring"
                                      for r in pd_state(d)["rooms"]), 10)
        body = pd_body(other, room, hard["bport"])
        ds, db = post(d.url + "/generate", body)
        assert ds == 409 and "duplicate" in _msg(db) and f"bootstrap_room {room}" in _msg(db)
        ps, pb = post(p.url + "/generate", body)
        assert ps == 409 and "another prompt" in _msg(pb), pb
        status, out = lone.result(timeout=10)
    assert status == 409 and "another prompt" in _msg(out), out
    assert f"bootstrap_room {room}" in _msg(out)
    # The room stays failed on the prefill: a late page list for it fails at once, too.
    t0 = time.monotonic()
    ds, db = post(d.url + "/generate", body)
    assert ds == 409 and "another prompt" in _msg(db) and time.monotonic() - t0 < 5, db
    _assert_baseline(hard, before)


def test_two_pairs_reusing_one_room_at_once_get_409_never_500(hard):
    """A regression: two direct prefill+decode pairs send different prompts with one
    client-chosen room at the same instant. Whatever order the four requests land in, every
    answer is a 200 or a 409 naming the room (one side used to answer 500 "bound to another
    prompt"); at most one pair succeeds, on both sides, and both servers come back to
    baseline."""
    p, d = hard["p"], hard["d"]
    _before(hard)
    for _ in range(3):
        room = next(_rooms)
        prompts = [_ids(30), _ids(30)]
        bodies = [pd_body(ids, room, hard["bport"]) for ids in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [(k, pool.submit(post, url + "/generate", bodies[k], 60.0))
                    for k in (0, 1) for url in (p.url, d.url)]
            results = [(k, f.result()) for k, f in futs]
        ok_pairs = set()
        for k, (status, out) in results:
            assert status in (200, 409), (k, status, out)
            if status == 409:
                assert f"bootstrap_room {room}" in _msg(out), out
            else:
                ok_pairs.add(k)
        assert len(ok_pairs) <= 1, results
        if ok_pairs:                      # the pair that won answered on both sides
            (k,) = ok_pairs
            assert [r[1][0] for r in results if r[0] == k] == [200, 200], results
    _assert_baseline(hard)            # idle: what a success cached is evictable


def test_room_reused_after_its_transfer_completed_gets_409_at_once(hard):
    """A regression: a pair succeeds on room R, then each half of another pair reuses R. The
    prefill keeps R for the bootstrap timeout, so both halves get 409 naming the room at once
    (the prefill half used to wait 20 s for a page list that never came and answer 500; a
    decode half whose page list met the finished room waited out its transfer timeout)."""
    room = next(_rooms)
    (ps, pb), (ds, db) = _dispatch(hard, _ids(30), room=room)
    assert ps == 200 and ds == 200, (pb, db)
    assert pd_state(hard["p"])["num_completed_rooms"] >= 1
    for order in ((hard["p"], hard["d"]), (hard["d"], hard["p"])):
        for server in order:
            t0 = time.monotonic()
            status, out = post(server.url + "/generate", pd_body(_ids(30), room, hard["bport"]),
                               30.0)
            assert status == 409, (server.url, status, out)
            assert f"bootstrap_room {room}" in _msg(out) and "already" in _msg(out), out
            assert time.monotonic() - t0 < 5
    _assert_baseline(hard)


def test_lone_decode_request_that_cannot_grow_is_answered(hard, rogue):
    """A decode-only request reserves 15 of the 32 decode pages; a running request
    then fills the other 17 and cannot get one more. It finishes with reason length and its
    client gets the answer (it used to wait forever)."""
    d = hard["d"]
    _assert_baseline(hard)
    holder_room = next(_rooms)
    holder = dict(pd_body(_ids(60), holder_room, rogue.port), rid="holds-15-pages")
    prompt = _ids(20)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, d.url + "/generate", holder)
        rogue.wait(TransferRequest, holder_room, timeout_s=10.0)
        assert load(d)["num_pinned_pages"] == 15
        # max_new_tokens null: up to the context (an explicit 60 does not fit the prefill's
        # 64-token context after the prompt: a 400, as vLLM answers)
        (ps, pb), (ds, db) = _dispatch(hard, prompt, timeout_s=60, max_new_tokens=None,
                                       ignore_eos=True)
        assert ps == 200 and ds == 200, (pb, db)
        # 17 pages hold 68 tokens: the 69th token is sampled, then no page is left for it.
        grown = (D_PAGES - 15) * PAGE_SIZE + 1 - len(prompt)
        assert db["meta_info"]["finish_reason"] == {"type": "length", "length": grown}
        assert db["meta_info"]["completion_tokens"] == len(db["output_ids"]) == grown
        assert post(d.url + "/abort_request", {"rid": "holds-15-pages"})[0] == 200
        status, out = held.result(timeout=10)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    _assert_baseline(hard)


def test_prefill_refusal_reaches_the_decode_at_once(hard):
    """A prompt over the prefill's context (but not the decode's) is refused by the
    prefill with 400; the decode hears of it through the room and answers the same 400 at
    once (it used to wait out its 30 s transfer timeout and answer 500)."""
    before = _before(hard)
    ids = _ids(80)
    t0 = time.monotonic()
    (ps, pb), (ds, db) = _dispatch(hard, ids)
    assert ps == 400 and "context length" in _msg(pb), pb
    assert ds == 400 and "context length" in _msg(db) and "refused" in _msg(db), db
    assert time.monotonic() - t0 < 5
    # The decode's half may also arrive after the refusal was recorded: same answer.
    room = next(_rooms)
    status, _ = post(hard["p"].url + "/generate", pd_body(ids, room, hard["bport"]))
    assert status == 400
    status, out = post(hard["d"].url + "/generate", pd_body(ids, room, hard["bport"]))
    assert status == 400 and "refused" in _msg(out)
    _assert_baseline(hard, before)


def test_router_passes_client_errors_through(hard):
    """Through the router a 4xx from either server is that 4xx with its message,
    whichever answers first; never 502."""
    router = hard["router"].url
    before = _before(hard)
    cases = [({"input_ids": _ids(8), "sampling_params": {"temperature": float("nan")}},
              "temperature"),
             ({"input_ids": _ids(80), "sampling_params": {"max_new_tokens": 4}}, "context length"),
             ({"input_ids": _ids(130)}, "context length"),
             ({"input_ids": _ids(8), "sampling_params": {"max_new_tokens": 4}, "bogus": 1},
              "bogus")]
    for body, needle in cases:
        for _ in range(2):
            status, out = post(router + "/generate", body)
            assert status == 400 and needle in _msg(out), (body.keys(), status, out)
    _assert_baseline(hard, before)
    status, out = post(router + "/generate", {"input_ids": _ids(12),
                                              "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(out["output_ids"]) == 3
    _assert_baseline(hard)


def test_cached_tokens_report_what_the_request_reused(hard):
    """``cached_tokens`` is the longer of the prefill's prefix hit (as
    colocated) and the decode's (DESIGN.md §4): a flushed prefill behind a warm decode used
    to say 0 where the decode reused the whole prompt's full pages."""
    router, p, d = hard["router"].url, hard["p"], hard["d"]
    ids = _ids(40)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    hit = (len(ids) - 1) // PAGE_SIZE * PAGE_SIZE       # colocated: 36, one token left to run
    status, out = post(router + "/generate", body)
    assert status == 200 and out["meta_info"]["cached_tokens"] == 0
    _assert_baseline(hard)
    assert post(d.url + "/flush_cache", {})[0] == 200          # prefill warm, decode cold
    status, out = post(router + "/generate", body)
    assert status == 200 and out["meta_info"]["cached_tokens"] == hit
    _assert_baseline(hard)
    assert post(p.url + "/flush_cache", {})[0] == 200          # prefill cold, decode warm
    status, out = post(router + "/generate", body)
    assert status == 200 and out["meta_info"]["cached_tokens"] == len(ids)   # 10 full pages
    _assert_baseline(hard)
    # The case, through the OpenAI API: 9 prompt tokens, the decode reuses 8.
    short = _ids(9)
    cmpl = {"prompt": short, "max_tokens": 2, "temperature": 0}
    status, out = post(router + "/v1/completions", cmpl)
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _assert_baseline(hard)
    assert post(p.url + "/flush_cache", {})[0] == 200
    status, out = post(router + "/v1/completions", cmpl)
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == 9
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    _assert_baseline(hard)


# ---------------------------------------------------------------------------------------------
# 7-9, 11: inputs that must be refused


def test_router_bounds_samples_and_nesting(hard):
    """``n`` and batch sizes over the limits, and deep nesting, are 400 at once."""
    router = hard["router"].url
    before = _before(hard)
    for body, field in (({"text": "a", "sampling_params": {"n": 10 ** 20}}, "n"),
                        ({"text": "a", "sampling_params": {"n": 2 * 10 ** 6}}, "n"),
                        ({"text": ["a"] * 2000}, "text"),
                        ({"input_ids": [[5]] * 40, "sampling_params": {"n": 30}}, "n")):
        t0 = time.monotonic()
        status, out = post(router + "/generate", body)
        assert status == 400 and field in _msg(out), out
        assert time.monotonic() - t0 < 2
    status, out = post(router + "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 20})
    assert status == 400 and "n" in _msg(out)
    import urllib.request

    for raw in (b"[" * 100000, b'{"a":' * 50000):
        req = urllib.request.Request(router + "/generate", data=raw, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10)
            raise AssertionError("nested JSON was accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 400 and b"malformed JSON" in e.read()
    assert get(router + "/health")[0] == 200
    _assert_baseline(hard, before)


def test_fake_bootstrap_host_is_refused_from_clients(hard):
    """2.2.2.2 is the servers' own warm-up host; from a client it is a 400."""
    before = _before(hard)
    for server in (hard["d"], hard["p"]):
        body = dict(pd_body(_ids(10), next(_rooms), hard["bport"]), bootstrap_host="2.2.2.2")
        status, out = post(server.url + "/generate", body)
        assert status == 400 and "reserved" in _msg(out), out
    _assert_baseline(hard, before)
    for server in (hard["d"], hard["p"]):
        assert get(server.url + "/health_generate", 60)[0] == 200


def test_control_plane_needs_the_secret(hard):
    """Bootstrap writes and ZMQ frames without the secret, with a wrong one, replayed,
    tampered or stale are refused and counted; pairing keeps working."""
    p, d, bport = hard["p"], hard["d"], hard["bport"]
    before = _before(hard)
    topology = fetch_prefill_info("127.0.0.1", bport).to_json()
    forged = dict(topology["ranks"][0], rank_port=1)
    for secret in (None, "wrong"):
        status, text = _http("PUT", _url("127.0.0.1", bport, "/route"), forged, 5, secret)
        assert status == 401 and b"unauthorized" in text
    assert fetch_prefill_info("127.0.0.1", bport).to_json() == topology

    endpoint = pd_state(p)["zmq_endpoint"]
    hb = Heartbeat("intruder", "decode", 1)
    answers: list = []
    plain = MessageChannel("127.0.0.1", answers.append, "no-secret")
    forged_decode = RegisterDecode(
        decode_engine_id="intruder", reply_endpoint=plain.endpoint,
        engine_session_id="127.0.0.1:1", tp_rank=0, tp_size=1,
        kv_buffers=(KVBufferDesc((1 << 20,), 2, 8, 512),), kv_layout="layer_major",
        metadata_addr=1 << 30, metadata_bytes_per_slot=MetadataBuffers(1, 20).bytes_per_slot,
        metadata_num_slots=4, page_size=PAGE_SIZE, kv_dtype="float32",
        layout_fingerprint=topology["layout_fingerprint"])
    wrong = MessageChannel("127.0.0.1", lambda m: None, "wrong-secret", secret="wrong")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        plain.send(endpoint, forged_decode)                 # a forged registration
        wrong.send(endpoint, hb)
        sealed = FrameSealer(SECRET).seal(hb.encode())
        sock.send(sealed)                                   # accepted (a heartbeat)
        sock.send(sealed)                                   # replayed
        sock.send(sealed[:-1] + bytes([sealed[-1] ^ 0xFF]))  # tampered
        sock.send(FrameSealer(SECRET, clock=lambda: time.time() - 600).seal(hb.encode()))
        want = {"bootstrap": 2, "hmac": 3, "replay": 1, "stale": 1}
        assert wait_until(lambda: pd_state(p)["num_auth_rejected"] == want, 5), \
            pd_state(p)["num_auth_rejected"]
        wrong.send(pd_state(d)["zmq_endpoint"], hb)
        assert wait_until(lambda: pd_state(d)["num_auth_rejected"] == {"hmac": 1}, 5)
        assert answers == [] and "intruder" not in pd_state(p)["peers"]
    finally:
        sock.close()
        ctx.term()
        plain.close()
        wrong.close()
    metrics = get(p.url + "/metrics")[1]
    for reason, count in want.items():
        assert metric_value(metrics, "pdjax:pd_auth_rejected_total", role="prefill",
                            reason=reason) == count
    assert pd_state(p)["authenticated"] and pd_state(d)["authenticated"]
    for server in (p, d):                   # the secret is never shown
        status, info = get(server.url + "/get_server_info")
        assert status == 200 and "disaggregation_secret" not in info and SECRET not in str(info)
    _assert_baseline(hard, before)
    (ps, pb), (ds, db) = _dispatch(hard, _ids(30), max_new_tokens=4)
    assert ps == 200 and ds == 200 and len(db["output_ids"]) == 4, (pb, db)
    _assert_baseline(hard)


def test_quarantined_pages_make_a_new_request_wait(hard, rogue):
    """25 of the 32 decode pages wait out the drain lease of an aborted transfer (the
    rogue prefill never acks); a new request that needs them waits in the queue and is served
    when they come back, instead of failing at once with "does not fit"."""
    d = hard["d"]
    _assert_baseline(hard)
    rogue.ack_aborts = False
    timeouts = pd_state(d)["num_quarantine_released_by_timeout"]
    room = next(_rooms)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, d.url + "/generate",
                              dict(pd_body(_ids(100), room, rogue.port), rid="quarantine-me"))
        rogue.wait(TransferRequest, room, timeout_s=10.0)
        t_abort = time.monotonic()      # before the decode starts the lease: a true bound
        assert post(d.url + "/abort_request", {"rid": "quarantine-me"})[0] == 200
        status, out = pending.result(timeout=10)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert load(d)["num_quarantined_pages"] == 25
    (ps, pb), (ds, db) = _dispatch(hard, _ids(40), max_new_tokens=4)
    assert ps == 200 and ds == 200 and len(db["output_ids"]) == 4, (pb, db)
    assert time.monotonic() - t_abort > DRAIN_S - 0.5        # it waited for the lease
    assert pd_state(d)["num_quarantine_released_by_timeout"] == timeouts + 1
    rogue.ack_aborts = True
    _assert_baseline(hard)
