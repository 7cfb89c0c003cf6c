"""Bootstrap server and client over 127.0.0.1."""

import json
import time
import urllib.request

import pytest

from pdjax.pd.bootstrap import (BootstrapError, BootstrapServer, IncompatiblePeerError,
                                PrefillRankInfo, PrefillServerInfo, check_bootstrap_health,
                                check_compatible, fetch_prefill_info,
                                register_prefill_rank)
from pdjax.pd.protocol import PROTOCOL_VERSION

HOST = "127.0.0.1"


def _rank(tp_rank, tp_size=2, **over):
    fields = dict(rank_ip=HOST, rank_port=17000 + tp_rank, tp_rank=tp_rank, tp_size=tp_size,
                  page_size=16, kv_dtype="bfloat16", layout_fingerprint="f00dfeed")
    fields.update(over)
    return PrefillRankInfo(**fields)


def _raw(method, port, path, body=None):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    data = body
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method)
    try:
        with opener.open(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def server():
    srv = BootstrapServer(HOST, 0)
    port = srv.start()
    assert port > 0 and srv.port == port
    yield srv
    srv.stop()


def test_503_until_all_ranks_then_topology(server):
    port = server.port
    assert check_bootstrap_health(HOST, port)
    assert _raw("GET", port, "/health") == (200, "OK")
    status, text = _raw("GET", port, "/route")
    assert status == 503 and "registered tp ranks: []" in text

    register_prefill_rank(HOST, port, _rank(1), timeout_s=5)
    status, text = _raw("GET", port, "/route")
    assert status == 503 and "[1]" in text
    with pytest.raises(BootstrapError, match="not ready within 0.3 s.*HTTP 503"):
        fetch_prefill_info(HOST, port, timeout_s=0.3, poll_interval_s=0.05)

    register_prefill_rank(HOST, port, _rank(0), timeout_s=5)
    info = fetch_prefill_info(HOST, port, timeout_s=5)
    assert info == PrefillServerInfo(tp_size=2, page_size=16, kv_dtype="bfloat16",
                                     layout_fingerprint="f00dfeed",
                                     protocol_version=PROTOCOL_VERSION,
                                     ranks=(_rank(0), _rank(1)))
    assert info.rank(1).rank_port == 17001
    status, text = _raw("GET", port, "/route?tp_rank=1")
    assert status == 200 and json.loads(text)["rank_port"] == 17001
    assert _raw("GET", port, "/route?tp_rank=5")[0] == 404
    assert _raw("POST", port, "/route", {})[0] == 405
    check_compatible(info, page_size=16, kv_dtype="bfloat16", layout_fingerprint="f00dfeed")


def test_fetch_waits_for_late_registration(server):
    import threading

    timer = threading.Timer(0.3, register_prefill_rank, (HOST, server.port, _rank(0, tp_size=1)))
    timer.start()
    t0 = time.monotonic()
    info = fetch_prefill_info(HOST, server.port, timeout_s=10, poll_interval_s=0.05)
    assert 0.25 < time.monotonic() - t0 < 5
    assert [r.tp_rank for r in info.ranks] == [0]
    timer.join()


def test_reregistration_after_restart_replaces_the_rank(server):
    register_prefill_rank(HOST, server.port, _rank(0, tp_size=1))
    register_prefill_rank(HOST, server.port, _rank(0, tp_size=1, rank_port=18888))
    assert fetch_prefill_info(HOST, server.port, 5).rank(0).rank_port == 18888


def test_bad_and_conflicting_registrations(server):
    port = server.port
    status, text = _raw("PUT", port, "/route", b"{not json")
    assert status == 400
    status, text = _raw("PUT", port, "/route", dict(_rank(0).to_json(), tp_rank=2))
    assert status == 400 and "'tp_rank'" in text
    status, text = _raw("PUT", port, "/route", dict(_rank(0).to_json(), rank_port="x"))
    assert status == 400 and "'rank_port'" in text
    status, text = _raw("PUT", port, "/route", dict(_rank(0).to_json(), pickle=1))
    assert status == 400 and "unknown field" in text

    register_prefill_rank(HOST, port, _rank(0))
    with pytest.raises(ValueError, match="409.*'page_size'"):
        register_prefill_rank(HOST, port, _rank(1, page_size=32), timeout_s=2)
    assert [r.tp_rank for r in server.registered_ranks()] == [0]


def test_compatibility_check_names_every_mismatch():
    info = PrefillServerInfo(tp_size=1, page_size=16, kv_dtype="bfloat16",
                             layout_fingerprint="aaaa", protocol_version=PROTOCOL_VERSION,
                             ranks=(_rank(0, tp_size=1, layout_fingerprint="aaaa"),))
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(info, page_size=32, kv_dtype="bfloat16", layout_fingerprint="aaaa")
    assert str(e.value) == ("prefill and decode servers cannot pair: "
                            "page_size: prefill 16 != decode 32")
    with pytest.raises(IncompatiblePeerError, match="kv_dtype.*layout_fingerprint"):
        check_compatible(info, page_size=16, kv_dtype="float32", layout_fingerprint="bbbb")
    assert issubclass(IncompatiblePeerError, ValueError)


def test_two_data_planes_never_pair():
    """A jax prefill and a Mooncake decode paired, and every request waited 70 s for a pull
    that never came (a new user's report): the transfer backend is a shared field of the
    bootstrap info, and a mismatch is refused (a prefill that names none, or a fake side,
    is not compared)."""
    def info(backend):
        rank = _rank(0, tp_size=1, layout_fingerprint="aaaa", transfer_backend=backend)
        return PrefillServerInfo.from_json(PrefillServerInfo(
            tp_size=1, page_size=16, kv_dtype="bfloat16", layout_fingerprint="aaaa",
            protocol_version=PROTOCOL_VERSION, ranks=(rank,),
            transfer_backend=backend).to_json())
    same = dict(page_size=16, kv_dtype="bfloat16", layout_fingerprint="aaaa")
    with pytest.raises(IncompatiblePeerError,
                       match="transfer_backend: prefill 'jax' != decode 'mooncake'"):
        check_compatible(info("jax"), transfer_backend="mooncake", **same)
    check_compatible(info("jax"), transfer_backend="jax", **same)
    check_compatible(info(""), transfer_backend="mooncake", **same)      # an older prefill
    check_compatible(info("mooncake"), transfer_backend="fake", **same)
    with pytest.raises(ValueError, match="transfer_backend"):
        PrefillRankInfo.from_json(dict(_rank(0).to_json(), transfer_backend=5))


def test_page_size_mismatch_through_the_server(server):
    register_prefill_rank(HOST, server.port, _rank(0, tp_size=1, page_size=16))
    info = fetch_prefill_info(HOST, server.port, timeout_s=5)
    with pytest.raises(IncompatiblePeerError, match="page_size: prefill 16 != decode 8"):
        check_compatible(info, page_size=8, kv_dtype="bfloat16", layout_fingerprint="f00dfeed")


def test_unreachable_server_times_out_clearly():
    srv = BootstrapServer(HOST, 0)
    port = srv.start()
    srv.stop()
    assert not check_bootstrap_health(HOST, port, timeout_s=0.5)
    with pytest.raises(BootstrapError, match="not ready within 0.3 s.*(Connection|refused)"):
        fetch_prefill_info(HOST, port, timeout_s=0.3, poll_interval_s=0.05)
    with pytest.raises(BootstrapError, match="could not register"):
        register_prefill_rank(HOST, port, _rank(0, tp_size=1), timeout_s=0.3)


def test_port_in_use_is_reported():
    a = BootstrapServer(HOST, 0)
    port = a.start()
    try:
        with pytest.raises(OSError):
            BootstrapServer(HOST, port).start()
    finally:
        a.stop()


def test_rank_info_validation():
    with pytest.raises(ValueError, match="'tp_size'"):
        _rank(0, tp_size=0)
    with pytest.raises(ValueError, match="'kv_dtype'"):
        _rank(0, kv_dtype="")
    with pytest.raises(ValueError, match="'rank_port'"):
        _rank(0, rank_port=True)
    with pytest.raises(ValueError, match="'ranks'"):
        PrefillServerInfo.from_json({"tp_size": 2, "page_size": 16, "kv_dtype": "bfloat16",
                                     "layout_fingerprint": "f00dfeed",
                                     "protocol_version": PROTOCOL_VERSION,
                                     "ranks": [_rank(0).to_json()]})


def test_server_restarts_after_stop():
    srv = BootstrapServer(HOST, 0)
    port = srv.start()
    srv.stop()
    srv.port = port
    assert srv.start() == port          # the same port binds again (a restarted prefill)
    try:
        assert check_bootstrap_health(HOST, port)
    finally:
        srv.stop()
