"""scripts/bench_load.py: load time of a source checkpoint vs its Orbax conversion."""

import pytest
import json

import bench_load

pytestmark = pytest.mark.slow      # a benchmark script's small mode (the full run only)


def test_bench_load_small(tiny_checkpoints, tmp_path):
    out = tmp_path / "load.json"
    result = bench_load.main(["--model-path", tiny_checkpoints["llama"], "--repeats", "2",
                              "--orbax-dir", str(tmp_path / "ckpt"), "--output-file", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert len(result["source_load_s"]) == len(result["orbax_load_s"]) == 2
    assert result["convert_s"] > 0 and all(v > 0 for v in result["orbax_load_s"])
    assert result["median_source_load_s"] == sorted(result["source_load_s"])[1]
    assert abs(result["speedup_orbax_over_source"]
               - result["median_source_load_s"] / result["median_orbax_load_s"]) < 1e-9
    again = bench_load.main(["--model-path", tiny_checkpoints["llama"], "--repeats", "1",
                             "--orbax-dir", str(tmp_path / "ckpt")])
    assert again["convert_s"] is None          # an existing conversion is reused
