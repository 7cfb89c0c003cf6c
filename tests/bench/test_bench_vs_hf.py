"""scripts/bench_vs_hf.py: pdjax's offline Engine vs transformers' batched generate."""

import pytest
import json

import bench_vs_hf

from bench_settings import TINY_FLAGS

pytestmark = pytest.mark.slow      # a benchmark script's small mode (the full run only)


def test_bench_vs_hf_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "vs_hf.json"
    shapes = TINY_FLAGS[2:]                      # page size, pool, rows, chunk, context
    result = bench_vs_hf.main(["--model-path", tiny_checkpoints["llama"], "--num-prompts", "4",
                               "--input-len", "24", "--output-len", "8", *shapes,
                               "--output-file", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for f in ("date", "model", "dtype", "num_prompts", "input_len", "output_len",
              "total_input_tokens", "total_output_tokens", "pdjax_time_s", "hf_time_s",
              "pdjax_output_throughput", "hf_output_throughput",
              "throughput_ratio_pdjax_over_hf", "num_prompts_exact_match",
              "num_prompts_match_tie_aware", "tokens_match", "positions_compared",
              "first_mismatch_positions", "pdjax_compiles_after_warmup", "pdjax_step_times",
              "pdjax_warmup_s", "hf_load_s", "machine"):
        assert f in result, f
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (4 * 24, 4 * 8)
    assert result["tokens_match"] is True and result["num_prompts_match_tie_aware"] == 4
    assert result["positions_compared"] >= 4 * 4
    assert result["pdjax_output_throughput"] > 0 and result["hf_output_throughput"] > 0
    assert abs(result["throughput_ratio_pdjax_over_hf"]
               - result["pdjax_output_throughput"] / result["hf_output_throughput"]) < 1e-9
    assert result["pdjax_compiles_after_warmup"] == 0
    st = result["pdjax_step_times"]
    assert st["num_steps"] >= 8 and 0 < st["host_overhead_fraction"] < 1
    print("\nbench_vs_hf tok/s: pdjax", round(result["pdjax_output_throughput"]),
          "transformers", round(result["hf_output_throughput"]))


def test_compare_is_tie_aware():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ours = [[1, 2, 9, 9], [5, 6, 7, 8]]
    gaps = [[1.0, 0.0005, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]   # prompt 0: near-tie at position 1
    c = bench_vs_hf.compare(ours, ref, gaps, tie_gap=1e-3)
    assert c["num_prompts_exact_match"] == 1 and c["num_prompts_match_tie_aware"] == 2
    assert c["tokens_match"] is True and c["first_mismatch_positions"] == [2, None]
    assert c["positions_compared"] == 2 + 4
    c = bench_vs_hf.compare(ours, ref, [[1.0] * 4] * 2, tie_gap=1e-3)
    assert c["tokens_match"] is False and c["num_prompts_match_tie_aware"] == 1
