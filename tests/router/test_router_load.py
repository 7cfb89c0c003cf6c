"""The pdjax router's load-aware worker choice: the pure pool, then the router against fake
workers (aiohttp test servers) that answer slowly and report a KV usage."""

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdjax.router import PDRouter, create_router_app
from pdjax.router.pool import WorkerPool


def test_pool_prefers_fewest_outstanding_then_kv_usage_then_round_robin():
    pool = WorkerPool(["a", "b", "c"])
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]       # all idle: round robin
    pool.release(1)
    assert pool.acquire() == 1                                   # the only one with 0
    pool.release(0)
    pool.release(2)
    pool.set_kv_usage(0, {"kv_usage": 0.5})
    pool.set_kv_usage(2, {"kv_usage": 0.25})
    assert pool.acquire() == 2                                   # tie on 0: lower KV usage
    assert pool.acquire() == 0
    assert pool.outstanding == [1, 1, 1] and pool.num_chosen == [2, 2, 2]
    # Bad /get_load bodies leave the last value.
    for bad in ({"kv_usage": 2.0}, {"kv_usage": True}, {"kv_usage": "x"}, "oops", None, {}):
        pool.set_kv_usage(2, bad)
    assert pool.kv_usage == [0.5, 0.0, 0.25]
    pool.release(0)
    pool.release(0)                                              # never below zero
    assert pool.outstanding[0] == 0
    rr = WorkerPool(["a", "b"], policy="round_robin")
    rr.outstanding = [9, 0]
    assert [rr.choose() for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="policy"):
        WorkerPool(["a"], policy="random")
    with pytest.raises(ValueError, match="urls"):
        WorkerPool([])


def _worker(kv_usage: float, delay_s: float, served: list, gate=None):
    """A fake server: ``/generate`` records the body, sleeps ``delay_s``, then awaits
    ``gate()`` if given, and answers."""
    async def generate(request):
        served.append(await request.json())
        await asyncio.sleep(delay_s)
        if gate is not None:
            await gate()
        return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {}})

    async def get_load(request):
        return web.json_response({"kv_usage": kv_usage, "num_running_reqs": 0})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_load", get_load)
    return TestServer(app)


@pytest.mark.asyncio
async def test_router_spreads_concurrent_requests_and_breaks_ties_by_kv_usage():
    served = {name: [] for name in ("p0", "p1", "d0", "d1")}
    usage = {"p0": 0.9, "p1": 0.1, "d0": 0.2, "d1": 0.7}
    # Once released (cleared), a side answers only when all 8 concurrent requests have reached
    # it, so every choice is made with the earlier ones in flight, however slow the machine.
    release = {"p": asyncio.Event(), "d": asyncio.Event()}

    def gate(side):
        async def wait():
            if len(served[side + "0"]) + len(served[side + "1"]) == 9:
                release[side].set()
            await asyncio.wait_for(release[side].wait(), 30)
        return wait
    for event in release.values():
        event.set()
    workers = {n: _worker(usage[n], 0.3 if n.startswith("d") else 0.05, served[n], gate(n[0]))
               for n in served}
    for w in workers.values():
        await w.start_server()
    url = {n: str(w.make_url("")).rstrip("/") for n, w in workers.items()}
    router = PDRouter([(url["p0"], 8998), (url["p1"], 8999)], [url["d0"], url["d1"]],
                      load_poll_interval_s=0.05)
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(rs.make_url("/generate"), json={"text": "hi"}) as r:
                    assert r.status == 200, await r.text()

            for _ in range(1500):                      # the poller has read every worker
                if router.decode_pool.kv_usage == [0.2, 0.7] and \
                        router.prefill_pool.kv_usage == [0.9, 0.1]:
                    break
                await asyncio.sleep(0.02)
            assert router.decode_pool.kv_usage == [0.2, 0.7], router.decode_pool.kv_usage
            assert router.prefill_pool.kv_usage == [0.9, 0.1], router.prefill_pool.kv_usage
            # Idle: a single request goes where the KV usage is lowest, on both sides.
            await one()
            assert (len(served["p1"]), len(served["d0"])) == (1, 1)
            assert served["p1"][0]["bootstrap_port"] == 8999
            # 8 at once: each new one goes to the decode with fewer in flight, so 4 and 4.
            for event in release.values():
                event.clear()
            await asyncio.gather(*(one() for _ in range(8)))
            assert len(served["d0"]) + len(served["d1"]) == 9
            assert len(served["d1"]) == 4 and len(served["d0"]) == 5
            assert len(served["p0"]) >= 1 and len(served["p1"]) >= 1
            async with s.get(rs.make_url("/get_load")) as r:
                state = (await r.json())["router"]
            assert state["policy"] == "load_aware"
            assert [w["outstanding"] for w in state["decode"] + state["prefill"]] == [0] * 4
            assert [w["num_chosen"] for w in state["decode"]] == [5, 4]
    finally:
        await rs.close()
        for w in workers.values():
            await w.close()


@pytest.mark.asyncio
async def test_a_prefill_slower_than_its_decode_is_never_cancelled():
    """The decode answered (its KV arrived) while the prefill had not: the router answers the
    client and lets the prefill finish. It used to cancel the prefill 5 s after the decode,
    which the prefill read as a client abort and so failed a room that had succeeded (seen
    in test_pd_e2e under load)."""
    delay_s = 5.5
    outcomes = []

    async def prefill_generate(request):
        body = await request.json()
        await asyncio.sleep(delay_s)
        gone = request.transport is None or request.transport.is_closing()
        outcomes.append((bool(body.get("stream")), "client gone" if gone else "answered"))
        return web.json_response({"text": "", "output_ids": [], "meta_info": {}})

    async def decode_generate(request):
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "ok", "output_ids": [1]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    servers = []
    for handler in (prefill_generate, decode_generate):
        app = web.Application()
        app.router.add_post("/generate", handler)
        servers.append(TestServer(app))
        await servers[-1].start_server()
    p_url, d_url = (str(w.make_url("")).rstrip("/") for w in servers)
    router = PDRouter([(p_url, 8998)], [d_url])
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            async def one(stream):
                async with s.post(rs.make_url("/generate"),
                                  json={"text": "hi", "stream": stream}) as r:
                    assert r.status == 200, await r.text()
                    return await r.read()

            plain, streamed = await asyncio.gather(one(False), one(True))
            assert b'"ok"' in plain and b"[DONE]" in streamed
            for _ in range(200):
                if len(outcomes) == 2:
                    break
                await asyncio.sleep(0.05)
        assert sorted(outcomes) == [(False, "answered"), (True, "answered")]
        assert router.prefill_pool.outstanding == [0]
    finally:
        await rs.close()
        for w in servers:
            await w.close()


def test_pool_skips_a_worker_marked_down_until_it_is_up_or_its_hold_ends():
    pool = WorkerPool(["a", "b"])
    pool.mark_down(0, now=100.0)
    assert [pool.choose(now=100.5) for _ in range(3)] == [1, 1, 1]   # 0 idle but down
    assert pool.choose(now=100.0 + WorkerPool.DOWN_HOLD_S) in (0, 1)  # the hold ended
    pool.mark_down(0, now=200.0)
    pool.mark_down(1, now=200.0)
    assert {pool.choose(now=200.1) for _ in range(4)} == {0, 1}      # all down: all of them
    pool.mark_up(1, polled_at=250.0)
    pool.mark_down(0, now=300.0)
    assert pool.choose(now=300.1) == 1
    # A polling router holds it down until its /get_load answers (a hold that ran out while
    # the worker was still dead sent it a burst of requests).
    pool.mark_down(0, now=400.0, hold_s=float("inf"))
    assert {pool.choose(now=400.0 + 10 * WorkerPool.DOWN_HOLD_S) for _ in range(3)} == {1}
    pool.mark_up(0, polled_at=399.0)          # a poll sent before it went down: stale
    assert pool.choose(now=450.0) == 1
    pool.mark_up(0, polled_at=401.0)
    assert {pool.choose(now=500.0) for _ in range(4)} == {0, 1}


@pytest.mark.asyncio
async def test_a_dead_decode_is_skipped_and_a_stream_it_breaks_ends_with_an_error_event():
    """A regression: a decode that was killed has no requests outstanding, so the fewest-outstanding
    rule sent it every new request (each a 502) until it came back; after one connection
    failure (or a failed ``/get_load``) the router skips it. A decode that dies mid-stream
    leaves the client an SSE error event, not a stream that just stops."""
    served = {name: [] for name in ("p0", "d0", "d1")}
    workers = {n: _worker(0.0, 0.0, served[n]) for n in served}

    async def dying_stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "a", "output_ids": [1], "meta_info": {}}\n\n')
        request.transport.close()              # the process dies: no finish, no [DONE]
        return resp

    broken = web.Application()
    broken.router.add_post("/generate", dying_stream)
    workers["d2"] = TestServer(broken)
    for w in workers.values():
        await w.start_server()
    url = {n: str(w.make_url("")).rstrip("/") for n, w in workers.items()}
    dead = "http://127.0.0.1:1"                    # nothing listens there
    router = PDRouter([(url["p0"], 8998)], [dead, url["d1"]], load_poll_interval_s=60)
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(6):
                async with s.post(rs.make_url("/generate"), json={"text": "hi"}) as r:
                    statuses.append(r.status)
            assert statuses.count(502) <= 1 and statuses.count(200) >= 5, statuses
            assert len(served["d1"]) >= 5
            router.decodes[1] = url["d2"]          # d1's address now leads to a dying decode
            router.decode_pool.mark_down(0)
            async with s.post(rs.make_url("/generate"), json={"text": "hi", "stream": True}) as r:
                assert r.status == 200
                raw = (await r.read()).decode()
            events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            assert '"output_ids": [1]' in events[0]
            assert "failed mid-stream" in events[-1] and '"error"' in events[-1], events
    finally:
        await rs.close()
        for w in workers.values():
            await w.close()


async def test_an_unreachable_decode_is_a_502_at_once(monkeypatch):
    """A decode nothing listens on cannot have failed because of the prefill: the router
    answers 502 'unreachable' at once and cancels the prefill's request, instead of waiting
    PREFILL_VERDICT_S (5 s) for a prefill that only waits for its decode (found by a new-user
    trial; the stream path answered at once already)."""
    from pdjax.router import handlers

    monkeypatch.setattr(handlers, "PREFILL_VERDICT_S", 120.0)
    served = []
    never = asyncio.Event()
    prefill = _worker(0.0, 0.0, served, gate=never.wait)      # holds its answer, as a real
    await prefill.start_server()                              # prefill waits for its decode
    router = PDRouter([(str(prefill.make_url("")).rstrip("/"), 8998)], ["http://127.0.0.1:1"],
                      load_poll_interval_s=60)
    rs = TestServer(create_router_app(router))
    await rs.start_server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(rs.make_url("/generate"), json={"text": "hi"}) as r:
                assert r.status == 502
                message = (await r.json())["error"]["message"]
        assert message.startswith("decode server http://127.0.0.1:1 unreachable: "), message
        assert len(served) == 1 and router.decode_pool.down_at[0] > 0   # marked down
    finally:
        await rs.close()
        await prefill.close()
