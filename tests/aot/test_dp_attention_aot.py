"""``python -m pdjax.aot --enable-dp-attention --dp-size`` compiles DP attention's step for
TPU (v5e, libtpu's compiler, the Pallas kernels through Mosaic) and an H200 (XLA, Triton) in
``.venv-tpu`` / ``.venv-cuda`` (``scripts/aot_env.sh``), tiny DeepSeek-V3.2 with EP: every
core entry compiles, the forwards hold the MLA and indexer kernels (run per device inside the
DP ``shard_map``), and the budget gives the KV tokens per chip and for the group (per chip
times the ranks: each rank holds only its own requests' KV)."""

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow      # starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "pdjax", "aot", "configs", "tiny-deepseek-v3.2")
SETTINGS = ["--entries", "core", "--max-total-tokens", "1024", "--context-length", "128",
            "--chunked-prefill-size", "32", "--max-running-requests", "4"]
TARGETS = {"h200": (".venv-cuda", "--gpu", {"CUDA_VISIBLE_DEVICES": "-1",
                                            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}),
           "v5e:2x2": (".venv-tpu", "--topology", {"TPU_SKIP_MDS_QUERY": "1"})}


@pytest.mark.parametrize("target", list(TARGETS))
def test_dp_attention_step_compiles(tmp_path, target):
    venv, flag, extra_env = TARGETS[target]
    python = os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(python):
        pytest.fail(f"no {venv}: run bash scripts/aot_env.sh")
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [python, "-m", "pdjax.aot", "--model-path", MODEL, flag, target, "--tp-size", "4",
         "--ep-size", "4", "--enable-dp-attention", "--dp-size", "4", "--json", str(out),
         *SETTINGS],
        env={**os.environ, "PYTHONPATH": ROOT, **extra_env}, cwd=ROOT, capture_output=True,
        text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dp_attention_size"] == 4 and report["ep_size"] == 4
    entries = {e["name"]: e for e in report["entries"]}
    forwards = [e for name, e in entries.items() if name.startswith(("decode", "extend"))]
    assert len(forwards) == 2 and all(e["error"] is None for e in entries.values())
    for e in forwards:
        kernels = {k.rsplit("_", 1)[0] for k in e["kernels"]}
        assert {"mla_sparse_attention", "indexer_scores"} <= kernels, e["kernels"]
    budget = report["budget"]
    assert budget["kv_tokens"] > 0
    assert budget["kv_tokens_group"] == 4 * budget["kv_tokens"]
    assert f"KV tokens          {budget['kv_tokens']} per chip, " \
           f"{budget['kv_tokens_group']} for the group of 4 chips" in proc.stdout
