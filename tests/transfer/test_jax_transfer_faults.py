"""Faults of the ``jax`` PD data plane with real processes: a decode that does not pull before
the prefill's ack deadline, and a prefill killed while the decode is about to pull. Each
request ends with a clear error within its deadline, every page comes back on both sides
(the pools' counters), and the servers keep serving (a restarted prefill pairs again)."""

import concurrent.futures
import os
import time

import pytest
from pd_harness import (TINY_ARGS, at_baseline, free_port, get, greedy_agrees, load,
                        metric_value, pd_body, pd_server, pd_state, post, running, wait_until)

pytestmark = pytest.mark.slow
TRANSFER_S = 3.0        # --transfer-timeout-s: the decode's pull deadline; the prefill acks
                        # within it plus min(10, it) = 6 s
DRAIN_S = 6.0


@pytest.fixture(scope="module")
def pair(tiny_checkpoints, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("jax_faults"))
    model = tiny_checkpoints["llama"]
    delay = os.path.join(logs, "pull_delay_s")
    common = ["--heartbeat-interval-s", "0.5", "--drain-timeout-s", str(DRAIN_S),
              "--transfer-timeout-s", str(TRANSFER_S)]
    bport = free_port()
    prefill = pd_server("prefill", "prefill", model, logs, bootstrap_port=bport,
                        extra=common + ["--disaggregation-transfer-backend", "jax"])
    decode = pd_server("decode", "decode", model, logs,
                       extra=common + ["--disaggregation-transfer-backend", "jax-slow"],
                       hooks=["--jax-pull-delay-file", delay])
    from pdjax.engine import Engine

    colocated = Engine(model_path=model, progress=False, **TINY_ARGS)
    try:
        with running([prefill, decode]):
            yield dict(prefill=prefill, decode=decode, delay=delay, colocated=colocated)
    finally:
        colocated.shutdown()


_rooms = iter(range(20_000, 1 << 40, 7919))


def _dispatch(prefill, decode, ids, max_new=6, room=None):
    body = pd_body(ids, room or next(_rooms), prefill.bootstrap_port, max_new_tokens=max_new)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(post, prefill.url + "/generate", body)
        fd = pool.submit(post, decode.url + "/generate", body)
        return fp.result(), fd.result()


def _serves(pair, ids):
    (ps, pb), (ds, db) = _dispatch(pair["prefill"], pair["decode"], ids)
    assert ps == 200 and ds == 200, (pb, db)
    _check(pair, ids, db["output_ids"])


def _check(pair, ids, got):
    """``got`` is the colocated engine's greedy output, tie-aware."""
    ref = pair["colocated"].generate(input_ids=ids, return_logprob=True, top_logprobs_num=2,
                                     sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert greedy_agrees(ref["output_ids"], ref["meta_info"]["output_top_logprobs"], got) >= 3


def _message(body) -> str:
    return body["error"]["message"] if isinstance(body, dict) and "error" in body else str(body)


def _set_delay(pair, seconds: float | None) -> None:
    if seconds is None:
        if os.path.exists(pair["delay"]):
            os.remove(pair["delay"])
        return
    with open(pair["delay"], "w") as f:
        f.write(str(seconds))


def test_a_decode_that_does_not_pull_fails_the_room_at_the_prefills_deadline(pair):
    prefill, decode = pair["prefill"], pair["decode"]
    _serves(pair, list(range(100, 141)))
    _set_delay(pair, 14)
    try:
        t0 = time.monotonic()
        (ps, pb), (ds, db) = _dispatch(prefill, decode, list(range(200, 230)))
        took = time.monotonic() - t0
    finally:
        _set_delay(pair, None)
    # The decode's own transfer deadline (3 s) ends the request; the prefill's ack deadline
    # (6 s) ends its offer; either may answer the client first.
    assert ds == 500, db
    assert ("no KV from the prefill within 3 s" in _message(db)
            or "did not ack the pull of 8 pages within 6 s" in _message(db)), db
    assert ps != 200, pb
    assert took < 12, took
    # Every page back on both sides (pinned, held, quarantined: 0; the prompt's pages stay
    # in the prefix caches, evictable): the prefill reset its pull table and acked the
    # decode's abort after its offer ended.
    assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 10)
    assert load(decode)["num_quarantined_pages"] == 0
    state = pd_state(prefill)
    assert state["engine"]["failures"] >= 1
    # Counted as Mooncake's failures are: by reason, on both sides.
    for server, role in ((prefill, "prefill"), (decode, "decode")):
        assert metric_value(get(server.url + "/metrics")[1], "pdjax:kv_transfer_failed_total",
                            role=role) >= 1
    # The late pull (after the delay) finds nothing and ends at the decode's own deadline;
    # meanwhile and after, the pair serves.
    _serves(pair, list(range(300, 333)))
    time.sleep(14 + TRANSFER_S - (time.monotonic() - t0) + 1)
    _serves(pair, list(range(310, 351)))
    assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 10)


def test_prefill_killed_mid_pull_then_restarted_pairs_again(pair):
    prefill, decode = pair["prefill"], pair["decode"]
    ids = list(range(120, 150))
    room = next(_rooms)
    released = pd_state(decode)["num_quarantine_released_by_timeout"]
    _set_delay(pair, 2)
    try:
        body = pd_body(ids, room, prefill.bootstrap_port, max_new_tokens=6)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pool.submit(post, prefill.url + "/generate", body)     # it dies: no answer
            pending = pool.submit(post, decode.url + "/generate", body)
            assert wait_until(lambda: any(r["room"] == room and r["state"] == "Transferring"
                                          for r in pd_state(decode)["rooms"]), 10)
            time.sleep(0.7)                # the offer is at the decode, its pull waiting
            prefill.kill()
            t0 = time.monotonic()
            status, out = pending.result(timeout=20)
    finally:
        _set_delay(pair, None)
    assert status == 500, out
    assert "lost connection with prefill" in _message(out) or "jax pull" in _message(out), out
    assert time.monotonic() - t0 < TRANSFER_S + 5
    # Nothing acknowledges the abort: the pages wait for the drain timeout, then come back.
    assert wait_until(lambda: pd_state(decode)["num_quarantine_released_by_timeout"]
                      >= released + 1 or at_baseline(decode), DRAIN_S + 5)
    assert wait_until(lambda: at_baseline(decode), 10)
    assert load(decode)["num_quarantined_pages"] == 0
    prefill.start()
    prefill.wait_healthy()
    assert wait_until(lambda: _try_serve(pair, list(range(400, 437))), 30, 1.0)
    assert wait_until(lambda: at_baseline(prefill) and at_baseline(decode), 10)


def _try_serve(pair, ids) -> bool:
    (ps, _), (ds, db) = _dispatch(pair["prefill"], pair["decode"], ids)
    if ps != 200 or ds != 200:
        return False
    _check(pair, ids, db["output_ids"])
    return True
