"""scripts/bench_faults.py at a tiny size: 2 prefill + 2 decode servers and the router, one
kill -9 and restart of prefill 0 and decode 0 during the load. Nothing is lost or wrong, every
failure is a clear error, and no page leaks."""

import json

import pytest

import bench_faults

pytestmark = pytest.mark.slow


def test_fault_plan_holds_requests_back_until_each_round():
    """Every kill round comes before the load can end: before round r at most ``concurrency``
    requests past its mark may start (all 16 could before, and a fast fleet finished them
    before the first kill)."""
    assert bench_faults.fault_plan(16, 1, 4) == ([8], [12, 16])
    assert bench_faults.fault_plan(500, 2, 64) == ([166, 333], [230, 397, 500])
    marks, gates = bench_faults.fault_plan(5, 3, 8)
    assert marks == [1, 2, 3] and gates == [5, 5, 5, 5]
    for n, rounds, c in ((16, 1, 4), (500, 2, 64), (40, 3, 2)):
        marks, gates = bench_faults.fault_plan(n, rounds, c)
        assert all(m < g < n for m, g in zip(marks, gates) if m + c < n)


def test_bench_faults_tiny_run(tiny_checkpoints, tmp_path):
    out = tmp_path / "faults.json"
    rc = bench_faults.main(["--model-path", tiny_checkpoints["llama"], "--num-requests", "16",
                            "--concurrency", "4", "--kill-rounds", "1", "--down-s", "1",
                            "--log-dir", str(tmp_path / "logs"), "--output-file", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, result
    assert result["num_requests"] == 16 and result["not_sent"] == 0
    assert result["ok"] + result["failed"] == 16 and result["ok"] > 0
    assert result["lost"] == 0 and result["wrong"] == 0 and result["pages_leaked"] == {}
    assert len(result["faults"]) == 1 and result["request_after_faults"] == 200
    assert set(result["health_after"].values()) == {200}
    # Every failure names its cause (the router's 502 names the worker that went away).
    assert all(k.startswith("failed: ") and len(k) > 20 for k in result["errors"]), result
