"""scripts/bench_mixed.py (offline EngineCore; mixed off, on, and on with an ITL target, in one
process): every JSON field, the forward kinds of the arrival window, the gap plot, the step
trace, and an XLA trace per setting. The ITL figures are printed, not asserted (CPU timing on
a shared machine)."""

import json
import struct

import bench_mixed
import pytest

from bench_settings import TINY_FLAGS

pytestmark = pytest.mark.slow      # a benchmark script's small mode (the full run only)

SETTING_FIELDS = ("steady_itl_ms", "arrival_itl_ms", "ratio_p50_to_steady_p50",
                  "ratio_p99_to_steady_p99", "ratio_max_to_steady_p50", "long_prompt_ttft_ms",
                  "arrival_p99_per_round_ms", "window_forward_modes", "window_host_overhead",
                  "window_throughput_tok_s", "itl_bound_ms", "target_itl_ms", "target_over_bound",
                  "arrival_share_over_target")


def _round(steady_s, arrival_s):
    return {"steady_itl_s": steady_s, "arrival_itl_s": arrival_s, "ttft_s": 1.0,
            "window_steps": {"mixed": len(arrival_s)}, "window_throughput": 10.0,
            "window_host": {"num_steps": 1, "host_time_per_step_ms": 1.0,
                            "forward_time_per_step_ms": 9.0}}


def test_summarize_setting_bound_and_gaps_over_the_target():
    # steady gaps all 40 ms: p99 40, bound 60 ms; arrival gaps 50, 55, 65, 70 ms over two rounds
    rounds = [_round([0.040] * 5, [0.050, 0.065]), _round([0.040] * 5, [0.055, 0.070])]
    r = bench_mixed.summarize_setting(rounds, target_itl_ms=62.0)
    assert r["itl_bound_ms"] == pytest.approx(60.0)
    assert r["target_over_bound"] == pytest.approx(62.0 / 60.0)
    assert r["arrival_share_over_target"] == pytest.approx(0.5)      # 65 and 70 of 4 gaps
    assert r["arrival_itl_ms"]["num_samples"] == 4
    assert r["arrival_p99_per_round_ms"] == pytest.approx([64.85, 69.85])
    untargeted = bench_mixed.summarize_setting(rounds)
    assert untargeted["itl_bound_ms"] == pytest.approx(60.0)
    assert untargeted["target_over_bound"] is None and untargeted["arrival_share_over_target"] is None


def test_bench_mixed_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "mixed.json"
    result = bench_mixed.main([
        "--model-path", tiny_checkpoints["llama"], *TINY_FLAGS,
        "--context-length", "512",   # decode requests outlast a prompt advancing by 1 token
        "--batch-size", "4", "--decode-prompt-len", "16", "--long-prompt-len", "100",
        "--steady-steps", "8", "--repeats", "4", "--output-file", str(out),
        "--profile-dir", str(tmp_path / "trace"), "--profile-steps", "2",
        "--target-factors", "2,4", "--plot-file", str(tmp_path / "gaps.png"),
        "--step-trace-file", str(tmp_path / "steps.json")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for f in ("date", "model", "batch_size", "long_prompt_len", "chunked_prefill_size",
              "compiles_after_warmup", "arrival_p99_on_over_off", "arrival_p50_on_over_off",
              "ttft_on_over_off", "profile_traces", "machine", "mixed_off", "mixed_on",
              "mixed_on_target", "steady_decode_step_ms", "target_itl_ms", "target_sweep",
              "arrival_p99_target_over_off", "ttft_target_over_off", "throughput_target_over_off",
              "cost_model"):
        assert f in result, f
    assert result["compiles_after_warmup"] == 0
    # 3 token buckets (16, 32, 64) x 1 pages-per-seq bucket (the CPU attention's traced
    # bound: the context's 16 pages) of the extend entry (prefill_chunk and mixed batches)
    assert result["cost_model_seed_forwards"] == 3
    assert result["target_factor"] == 2.0
    assert [r["target_itl_ms"] for r in result["target_sweep"]] == pytest.approx(
        [2 * result["steady_decode_step_ms"], 4 * result["steady_decode_step_ms"]])
    assert result["cost_model"]["extend"]["num_samples"] > 6
    assert result["mixed_on_target"]["target_itl_ms"] == result["target_itl_ms"]
    assert 0 <= result["mixed_on_target"]["arrival_share_over_target"] <= 1
    assert result["mixed_off"]["arrival_share_over_target"] is None
    off, on, tgt = result["mixed_off"], result["mixed_on"], result["mixed_on_target"]
    for r in (off, on, tgt):
        for f in SETTING_FIELDS:
            assert f in r, f
        for k in ("p50", "p99", "max"):
            assert r["steady_itl_ms"][k] > 0 and r["arrival_itl_ms"][k] > 0
        assert r["steady_itl_ms"]["num_samples"] == 4 * 4 * 7          # rounds x B x gaps
        assert len(r["arrival_p99_per_round_ms"]) == 4
        assert 0 < r["window_host_overhead"]["host_overhead_fraction"] < 1
    # 100 prompt tokens, chunk 64: off alternates prefill chunks (2 per round) with decode
    # steps; on carries the 4 decode rows in every chunk's forward (chunks of 60, then 40).
    assert off["window_forward_modes"] == {"prefill_chunk": 2 * 4, "decode": 1 * 4}
    assert on["window_forward_modes"] == {"mixed": 2 * 4}
    # gaps overlapping the prefill, per request and round: off, [.. chunk 1, decode] and
    # [decode, chunk 2, decode]; on, one per mixed forward
    assert off["arrival_itl_ms"]["num_samples"] == 4 * 4 * 2
    assert on["arrival_itl_ms"]["num_samples"] == 4 * 4 * 2
    assert len(result["profile_traces"]) == 2                          # mixed_off, mixed_on
    # Under a target the window holds only mixed forwards (decode rows ride in every one).
    assert set(tgt["window_forward_modes"]) == {"mixed"}
    assert sum(tgt["window_forward_modes"].values()) >= 2 * 4
    png = (tmp_path / "gaps.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 400
    steps = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert {s["key"]["entry"] for s in steps} == {"decode", "extend"}
    assert all(s["measured_s"] > 0 and s["num_tokens"] <= s["key"]["num_tokens"] for s in steps)
    print("\nbench_mixed figures (ms):",
          {name: {k: round(result[name]["arrival_itl_ms"][k], 3) for k in ("p50", "p99", "max")}
           for name in ("mixed_off", "mixed_on")},
          "steady p50:", {name: round(result[name]["steady_itl_ms"]["p50"], 3)
                          for name in ("mixed_off", "mixed_on")},
          "arrival p99 on/off:", round(result["arrival_p99_on_over_off"], 3))
