"""scripts/bench_serving.py against a live colocated server: every JSON field, real counts."""

import json

import bench_serving
import pytest
from bench_common import STAT_KEYS, summarize_ms

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")
TOP_FIELDS = ("date", "backend", "base_url", "model", "dataset_name", "num_prompts", "request_rate",
              "max_concurrency", "warmup_requests", "completed", "failed", "duration",
              "total_input_tokens", "total_output_tokens", "request_throughput",
              "input_throughput", "output_throughput", "total_throughput", "concurrency",
              "server_compile_count", "compile_count_during_bench", "server_step_times",
              "profile_dir", "machine", "errors")


def _check_fields(result):
    for f in TOP_FIELDS:
        assert f in result, f
    for lat in LATENCIES:
        for stat in STAT_KEYS:
            assert f"{stat}_{lat}_ms" in result, (stat, lat)


def test_random_dataset_pdjax_backend_with_profile(deployment, tmp_path):
    out = tmp_path / "serving.json"
    prof = tmp_path / "trace"
    result = bench_serving.main([
        "--base-url", deployment["colocated"], "--num-prompts", "6", "--random-input-len", "24",
        "--random-output-len", "8", "--request-rate", "40", "--max-concurrency", "4",
        "--warmup-requests", "1", "--output-file", str(out), "--profile", "--profile-dir", str(prof)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    _check_fields(result)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_input_tokens"] == 6 * 24          # token-id prompts: exact lengths
    assert result["total_output_tokens"] == 6 * 8          # ignore_eos: exact lengths
    for lat in LATENCIES:
        assert 0 < result[f"median_{lat}_ms"] <= result[f"p99_{lat}_ms"] <= result[f"max_{lat}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2e_latency_ms"]
    assert abs(result["output_throughput"] * result["duration"] - 48) < 1e-6
    assert result["server_compile_count"] == 0 and result["compile_count_during_bench"] == 0
    st = result["server_step_times"]
    assert st["num_steps"] >= 8                            # at least one step per output token
    assert st["host_time_per_step_ms"] > 0 and st["forward_time_per_step_ms"] > 0
    assert 0 < st["host_overhead_fraction"] < 1
    assert result["profile_dir"] == str(prof)
    assert list(prof.rglob("*.xplane.pb")), "no XLA trace written"


def test_sharegpt_dataset_openai_backend(deployment, tmp_path, tiny_checkpoints):
    convs = [{"conversations": [
        {"from": "human", "value": f"Once upon a time there was robot number {i} who counted pages."},
        {"from": "gpt", "value": "The quick brown fox jumps over the lazy dog. " * (1 + i % 3)}]}
        for i in range(8)] + [{"conversations": [{"from": "human", "value": "one turn only"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    out = tmp_path / "serving.json"
    result = bench_serving.main([
        "--backend", "openai", "--base-url", deployment["colocated"], "--dataset-name", "sharegpt",
        "--dataset-path", str(path), "--num-prompts", "4", "--sharegpt-output-len", "6",
        "--tokenizer", tiny_checkpoints["llama"], "--warmup-requests", "0",
        "--output-file", str(out)])
    _check_fields(result)
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_output_tokens"] == 4 * 6
    assert result["server_compile_count"] is None          # openai backend: no /metrics read
    assert json.loads(out.read_text())["dataset_name"] == "sharegpt"


def test_calculate_metrics_arithmetic():
    outs = [bench_serving.RequestOutput(success=True, prompt_len=10, output_len=5, ttft_s=0.1,
                                        latency_s=0.5, itl_s=[0.1] * 4),
            bench_serving.RequestOutput(success=True, prompt_len=20, output_len=3, ttft_s=0.3,
                                        latency_s=0.5, itl_s=[0.1, 0.1]),
            bench_serving.RequestOutput(success=False, error="HTTP 500")]
    m = bench_serving.calculate_metrics(outs, duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0
    assert m["total_throughput"] == 19.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)       # (0.5-0.1)/4 and (0.5-0.3)/2
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    s = summarize_ms([0.001 * i for i in range(1, 101)])
    assert s["median"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01) and s["max"] == pytest.approx(100.0)
    assert summarize_ms([]) == {k: None for k in STAT_KEYS}


def test_through_pd_router_with_decode_metrics(deployment, tmp_path):
    result = bench_serving.main([
        "--base-url", deployment["router"], "--metrics-url", deployment["decode"],
        "--num-prompts", "3", "--random-input-len", "40", "--random-output-len", "5",
        "--warmup-requests", "0", "--output-file", str(tmp_path / "pd.json")])
    _check_fields(result)
    assert (result["completed"], result["total_output_tokens"]) == (3, 15)
    assert result["compile_count_during_bench"] == 0
    # the decode server ran the decode steps: 3 requests x 4 tokens after the transferred first
    assert result["server_step_times"]["num_steps"] >= 4
