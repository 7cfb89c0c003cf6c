"""PD hardening without processes: a lone decode request the scheduler finishes inside schedule()
is handed back for its final output; sealed control frames (HMAC, replay, time window) over
real ZMQ sockets; the router's sample limits and its 4xx pass-through against fake workers."""

import asyncio
import time

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdjax.pd.frame_auth import AuthError, FrameAuthenticator, FrameSealer
from pdjax.pd.protocol import Heartbeat
from pdjax.pd.wire import prompt_digest
from pdjax.request import FinishReason, Request, RequestState, SamplingParams
from pdjax.router import PDRouter, create_router_app
from pdjax.sched.scheduler import Scheduler, SchedulerConfig
from pdjax.server.validation import checked_num_samples
from pdjax.transfer.channel import MessageChannel
from pdjax.transfer.pd_metrics import PDMetrics

from kv_fakes import WholePromptConnector, admit_whole, arrive

PS = 4


def _req(rid, n, seed=0):
    rng = np.random.default_rng(seed)
    return Request(rid, [int(t) for t in rng.integers(3, 400, n)],
                   SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))


def test_scheduler_hands_back_a_lone_request_it_cannot_grow():
    # 7 usable pages: A (8 prompt tokens + 1 output) runs; B's reservation takes the other 5.
    s = Scheduler(SchedulerConfig(num_pages=8, page_size=PS, max_running_requests=4,
                                  chunked_prefill_size=16), connector=WholePromptConnector())
    a, b = _req("a", 8), _req("b", 20, seed=1)
    admit_whole(s, a)
    arrive(s, a, 7)
    admit_whole(s, b)
    assert s.allocator.num_free == 0
    assert s.schedule() is None                  # A needs a third page; nothing can give one
    assert s.pop_finished() == [a] and s.pop_finished() == []
    assert a.state == RequestState.FINISHED
    assert a.finish_reason == FinishReason.of_length(1)
    assert a.rid not in s.requests and not s.running and a.pages == []
    assert s.allocator.num_free + s.prefix_cache.num_evictable_pages == 2
    s.check_invariants()


def test_prompt_digest_depends_on_every_token_and_its_position():
    ids = list(range(40))
    d = prompt_digest(ids)
    assert len(d) == 16 and prompt_digest(np.asarray(ids)) == d
    assert prompt_digest(ids[:-1] + [41]) != d
    assert prompt_digest(ids[1:] + ids[:1]) != d
    assert prompt_digest(ids + [0]) != d


def test_frame_authenticator_rejects_tamper_replay_stale_and_wrong_secret():
    now = [1000.0]
    seal = FrameSealer("s3cret", clock=lambda: now[0])
    auth = FrameAuthenticator("s3cret", window_s=30, clock=lambda: now[0])
    body = Heartbeat("x", "decode", 1).encode()
    f1, f2 = seal.seal(body), seal.seal(body)
    assert auth.open(f1) == body and auth.open(f2) == body
    for frame, reason in ((f1, "replay"), (f2, "replay"),
                          (f1[:-1] + bytes([f1[-1] ^ 1]), "hmac"),
                          (f1[:20] + bytes([f1[20] ^ 1]) + f1[21:], "hmac"),
                          (FrameSealer("other").seal(body), "hmac"), (body, "hmac"), (b"", "hmac")):
        with pytest.raises(AuthError) as e:
            auth.open(frame)
        assert e.value.reason == reason, (frame, e.value)
    old = seal.seal(body)
    now[0] += 31
    with pytest.raises(AuthError) as e:
        auth.open(old)
    assert e.value.reason == "stale"
    assert auth.open(seal.seal(body)) == body          # fresh frames still pass
    with pytest.raises(ValueError, match="disaggregation_secret"):
        FrameSealer("")


def _wait(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


def test_channels_with_a_secret_count_each_rejection():
    import zmq

    got, rejected = [], []
    rx = MessageChannel("127.0.0.1", got.append, "rx", secret="k1",
                        on_reject=lambda reason, kind: rejected.append(kind))
    good = MessageChannel("127.0.0.1", lambda m: None, "good", secret="k1")
    wrong = MessageChannel("127.0.0.1", lambda m: None, "wrong", secret="k2")
    plain = MessageChannel("127.0.0.1", lambda m: None, "plain")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(rx.endpoint)
        hb = Heartbeat("good", "prefill", 7)
        assert good.send(rx.endpoint, hb)
        assert _wait(lambda: got == [hb])
        frame = good.seal(Heartbeat("good", "prefill", 8))
        raw.send(frame)
        assert _wait(lambda: len(got) == 2)
        raw.send(frame)                                         # replayed
        raw.send(frame[:-2] + b"\x00\x00")                      # tampered
        wrong.send(rx.endpoint, hb)                             # wrong secret
        plain.send(rx.endpoint, hb)                             # no secret
        stale = FrameSealer("k1", clock=lambda: time.time() - 3600).seal(hb.encode())
        raw.send(stale)
        assert _wait(lambda: len(rejected) == 5)
        assert sorted(rejected) == ["hmac", "hmac", "hmac", "replay", "stale"]
        assert rx.rejected_by_kind == {"hmac": 3, "replay": 1, "stale": 1}
        assert len(got) == 2
        # Without a secret on either side frames are plain msgpack, as before.
        plain_rx = MessageChannel("127.0.0.1", got.append, "plain-rx")
        try:
            assert plain.send(plain_rx.endpoint, hb) and _wait(lambda: len(got) == 3)
        finally:
            plain_rx.close()
    finally:
        raw.close()
        ctx.term()
        for c in (rx, good, wrong, plain):
            c.close()


def test_a_send_to_a_peer_that_died_fails_instead_of_queueing_forever():
    """A killed peer's endpoint: the send fails (False, within the send timeout) so the
    sender can drop the peer and bootstrap again; before, it was queued for a reconnect that
    never came (a bench_faults run lost two requests for 180 s after a prefill restart)."""
    from pdjax.transfer.channel import SEND_TIMEOUT_MS

    got = []
    rx = MessageChannel("127.0.0.1", got.append, "rx")
    tx = MessageChannel("127.0.0.1", lambda m: None, "tx")
    try:
        hb = Heartbeat("tx", "decode", 1)
        assert tx.send(rx.endpoint, hb) and _wait(lambda: got == [hb])
        endpoint = rx.endpoint
        rx.close()
        time.sleep(0.3)                    # the PUSH side sees the connection drop
        t0 = time.monotonic()
        assert not tx.send(endpoint, Heartbeat("tx", "decode", 2))
        assert time.monotonic() - t0 <= SEND_TIMEOUT_MS / 1000 + 1.0
        # A live peer still gets its messages at once.
        rx2 = MessageChannel("127.0.0.1", got.append, "rx2")
        try:
            assert tx.send(rx2.endpoint, hb) and _wait(lambda: len(got) == 2)
        finally:
            rx2.close()
    finally:
        tx.close()


def test_metrics_count_auth_rejections_by_reason():
    from pdjax.metrics import Metrics

    m = Metrics()
    pd = PDMetrics(m, "prefill")
    pd.on_auth_rejected("replay")
    pd.on_auth_rejected("replay")
    text = m.render()[0].decode()
    assert 'pdjax:pd_auth_rejected_total{reason="replay",role="prefill"} 2.0' in text


def test_router_refuses_oversized_sample_counts_before_drawing_rooms():
    assert checked_num_samples("/generate", {"text": ["a", "b"], "sampling_params": {"n": 3}}) == 6
    for body, field in (({"text": "a", "sampling_params": {"n": 10 ** 20}}, "sampling_params.n"),
                        ({"input_ids": [[1]] * 1025}, "input_ids"),
                        ({"text": ["a"] * 40, "sampling_params": {"n": 30}}, "sampling_params.n"),
                        ({"input_ids": [[1]], "sampling_params": [{"n": 65}]},
                         "sampling_params.n")):
        with pytest.raises(ValueError, match=field):
            checked_num_samples("/generate", body)
    with pytest.raises(ValueError, match="^n:"):
        checked_num_samples("/v1/chat/completions", {"n": 2 * 10 ** 6})
    with pytest.raises(ValueError, match="prompt"):
        checked_num_samples("/v1/completions", {"prompt": ["a"] * 1025})


def _worker(status: int, message: str, delay_s: float = 0.0):
    async def handle(request):
        await asyncio.sleep(delay_s)
        if status == 200:
            return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {}})
        return web.json_response({"error": {"message": message, "code": status}}, status=status)

    app = web.Application()
    app.router.add_post("/generate", handle)
    return TestServer(app)


@pytest.mark.asyncio
# A decode that answers 200 after its prefill failed takes 30 s: the router must answer from
# the failure and cancel it (a 0.3 s delay could lose that race on a loaded machine). A failed
# decode waits for its prefill's verdict (PREFILL_VERDICT_S), so those delays need no margin.
@pytest.mark.parametrize("p,d,want,needle", [
    ((400, "prompt too long", 0.0), (200, "", 30.0), 400, "prompt too long"),
    ((200, "", 0.3), (400, "temperature must be finite", 0.0), 400, "temperature"),
    ((400, "bad field", 0.2), (500, "PD transfer failed: refused", 0.0), 400, "bad field"),
    ((500, "boom", 0.0), (200, "", 30.0), 502, "boom"),
    ((200, "", 0.0), (500, "decode broke", 0.1), 502, "decode broke"),
])
async def test_router_passes_worker_4xx_through_and_502s_failures(p, d, want, needle):
    pw, dw = _worker(*p), _worker(*d)
    await pw.start_server()
    await dw.start_server()
    router = PDRouter([(str(pw.make_url("")), 8998)], [str(dw.make_url(""))])
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(rs.make_url("/generate"), json={"text": "hi"}) as r:
                    body = await r.json()
                    assert r.status == want, body
                    assert needle in body["error"]["message"]
            async with s.post(rs.make_url("/generate"), data=b"[" * 100000) as r:
                assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
            async with s.post(rs.make_url("/generate"),
                              json={"text": "hi", "sampling_params": {"n": 10 ** 20}}) as r:
                assert r.status == 400
    finally:
        await rs.close()
        await pw.close()
        await dw.close()


def test_reported_cached_tokens_are_the_prefill_hit_not_the_decode_hit():
    """A decode request whose prompt hit 8 tokens of the decode's own prefix cache
    reports ``reported_cached_tokens`` (what ``_commit`` sets from the metadata row and the
    decode's hit); page accounting keeps the decode's."""
    s = Scheduler(SchedulerConfig(num_pages=33, page_size=PS, max_running_requests=4,
                                  chunked_prefill_size=16), connector=WholePromptConnector())
    warm = _req("warm", 12)
    admit_whole(s, warm)
    arrive(s, warm, 5)
    s.finish_request(warm, FinishReason.of_length(1))   # 3 full prompt pages cached
    for prefill_hit, want in ((0, 0), (4, 4), (99, 10)):
        req = Request(f"r{prefill_hit}", warm.prompt_ids[:8] + [9, 9],
                      SamplingParams(max_new_tokens=4))
        admit_whole(s, req)
        assert req.num_cached_tokens == 8                     # the decode's own prefix hit
        arrive(s, req, 3, cached_tokens=prefill_hit)
        assert req.num_cached_tokens_reported == want          # clamped to the prompt (10)
        s.check_invariants()
        s.finish_request(req, FinishReason.of_length(1))
        s.check_invariants()
    colocated = _req("c", 10)
    assert colocated.num_cached_tokens_reported == 0 and colocated.reported_cached_tokens is None
