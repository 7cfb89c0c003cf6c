"""scripts/bench_transfer.py on a live PD deployment (Mooncake over loopback) and a colocated
server: bytes = pages x bytes per page, the decode side agrees, a raw write of the same bytes."""

import pytest
import json
import math

import bench_transfer

from bench_settings import KV_BYTES_PER_PAGE, PAGE_SIZE

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROW_FIELDS = ("input_len", "requests", "transfer_bytes_per_request", "transfer_pages_per_request",
              "transfer_copy_ops_per_request", "transfer_chunks_per_request",
              "decode_received_bytes_per_request", "transfer_failed", "transfer_time_ms",
              "transfer_gbps", "ttft_colocated_ms", "ttft_pd_ms", "ttft_pd_over_colocated",
              "raw_write_time_ms", "raw_write_gbps", "transfer_gbps_pd_over_raw",
              "write_time_ms_per_request", "write_gbps", "write_gbps_pd_over_raw")


def test_bench_transfer_small(deployment, tmp_path):
    out = tmp_path / "transfer.json"
    urls = [f"--{role}-url={url}" for role, url in deployment.items()]
    result = bench_transfer.main(["--input-lens", "20,100", "--requests-per-len", "2",
                                  "--output-len", "2", "--raw-repeats", "3",
                                  "--page-size", str(PAGE_SIZE), "--context-length", "128",
                                  *urls, "--output-file", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for f in ("date", "model", "transfer_backend", "raw_backend", "input_lens", "rows",
              "compile_count", "servers_startup_s", "machine"):
        assert f in result, f
    assert result["compile_count"] == {"prefill": 0, "decode": 0, "colocated": 0}
    for row, n in zip(result["rows"], (20, 100)):
        for f in ROW_FIELDS:
            assert row[f] is not None, f
        pages = math.ceil(n / PAGE_SIZE)
        assert row["transfer_pages_per_request"] == pages
        assert row["transfer_bytes_per_request"] == pages * KV_BYTES_PER_PAGE
        assert row["decode_received_bytes_per_request"] == row["transfer_bytes_per_request"]
        # 4 KV buffers (2 layers x K, V); at least one copy per buffer per chunk
        assert row["transfer_copy_ops_per_request"] >= 4 * row["transfer_chunks_per_request"]
        assert row["transfer_copy_ops_per_request"] % 4 == 0
        assert row["transfer_failed"] == 0
        assert row["transfer_gbps"] > 0 and row["raw_write_gbps"] > 0
        # The batch writes are a part of the transfer's latency (first chunk -> Success).
        assert 0 < row["write_time_ms_per_request"] <= row["transfer_time_ms"]
        assert row["ttft_pd_over_colocated"] > 0
    print("\nbench_transfer:", [{k: r[k] for k in ("input_len", "transfer_time_ms", "raw_write_time_ms",
                                                   "ttft_pd_over_colocated")} for r in result["rows"]])
