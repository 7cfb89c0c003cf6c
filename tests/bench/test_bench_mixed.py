"""scripts/bench_mixed.py (offline EngineCore, mixed on vs off in one process): every JSON field,
the forward kinds of the arrival window, and an XLA trace per setting. The ITL figures are
printed, not asserted (CPU timing on a shared machine)."""

import json

import bench_mixed

from bench_settings import TINY_FLAGS

SETTING_FIELDS = ("steady_itl_ms", "arrival_itl_ms", "ratio_p50_to_steady_p50",
                  "ratio_p99_to_steady_p99", "ratio_max_to_steady_p50", "long_prompt_ttft_ms",
                  "arrival_p99_per_round_ms", "window_forward_modes", "window_host_overhead")


def test_bench_mixed_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "mixed.json"
    result = bench_mixed.main([
        "--model-path", tiny_checkpoints["llama"], *TINY_FLAGS,
        "--batch-size", "4", "--decode-prompt-len", "16", "--long-prompt-len", "100",
        "--steady-steps", "8", "--repeats", "4", "--output-file", str(out),
        "--profile-dir", str(tmp_path / "trace"), "--profile-steps", "2"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for f in ("date", "model", "batch_size", "long_prompt_len", "chunked_prefill_size",
              "compiles_after_warmup", "arrival_p99_on_over_off", "arrival_p50_on_over_off",
              "ttft_on_over_off", "profile_traces", "machine", "mixed_off", "mixed_on"):
        assert f in result, f
    assert result["compiles_after_warmup"] == 0
    off, on = result["mixed_off"], result["mixed_on"]
    for r in (off, on):
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
    print("\nbench_mixed figures (ms):",
          {name: {k: round(result[name]["arrival_itl_ms"][k], 3) for k in ("p50", "p99", "max")}
           for name in ("mixed_off", "mixed_on")},
          "steady p50:", {name: round(result[name]["steady_itl_ms"]["p50"], 3)
                          for name in ("mixed_off", "mixed_on")},
          "arrival p99 on/off:", round(result["arrival_p99_on_over_off"], 3))
