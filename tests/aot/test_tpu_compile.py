"""The TPU compile of every kernel the tiny models use, as CI runs it: ``python -m pdjax.aot``
in ``.venv-tpu`` (jax[tpu], made by ``scripts/aot_env.sh``) compiles the core entries of the
tiny Llama, DeepSeek-V3.2 and GLM-5 for TPU v5e and v6e with libtpu's real compiler (Mosaic for
the Pallas kernels). A kernel that stops compiling fails this test, naming the entry. And the
engine's KV layouts (GQA rows, latent rows of whole lanes) are read without a copy of the pool
(``tpu_relayout_child.py``).

Without ``.venv-tpu`` the test fails (run ``bash scripts/aot_env.sh``; the README's test
command does)."""

import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TPU_PYTHON = os.path.join(ROOT, ".venv-tpu", "bin", "python")
CONFIGS = os.path.join(ROOT, "pdjax", "aot", "configs")
# Small shapes: the kernels are the same, the compile is shorter.
SETTINGS = ["--entries", "core", "--max-total-tokens", "1024", "--context-length", "128",
            "--chunked-prefill-size", "32", "--max-running-requests", "4"]
KERNELS = {
    "tiny-llama": {"ragged_paged_attention_tpu"},
    "tiny-deepseek-v3.2": {"mla_sparse_attention_tpu", "indexer_scores_tpu"},
    "tiny-glm-5": {"mla_sparse_attention_tpu", "indexer_scores_tpu"},
}


@pytest.fixture(scope="module")
def tpu_python():
    if not os.path.exists(TPU_PYTHON):
        pytest.fail("no .venv-tpu: run bash scripts/aot_env.sh (scripts/run_tests.sh does)")
    return TPU_PYTHON


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("model", list(KERNELS))
def test_core_entries_compile_for_tpu(tpu_python, tmp_path, model, topology):
    out = tmp_path / "aot.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "TPU_SKIP_MDS_QUERY": "1"}
    proc = subprocess.run(
        [tpu_python, "-m", "pdjax.aot", "--model-path", os.path.join(CONFIGS, model),
         "--topology", topology, "--json", str(out), *SETTINGS],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.exists() else None
    failed = [] if report is None else [(e["name"], e["error"]) for e in report["entries"]
                                        if e["error"] is not None]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["device_kind"].startswith("TPU v")
    kinds = {e["kind"] for e in report["entries"]}
    assert {"decode", "extend", "prompt_logprobs", "resample", "gather_pages"} <= kinds
    forwards = [e for e in report["entries"] if e["kind"] in ("decode", "extend")]
    for entry in forwards:       # the Pallas TPU kernels are in the executable, not a fallback
        assert KERNELS[model] <= set(entry["kernels"]), entry
        assert entry["argument_bytes"] > 0 and entry["temp_bytes"] > 0
    budget = report["budget"]
    assert budget["kv_pages"] > 0 and budget["fits_one_context"]
    assert budget["weight_bytes"] > 0 and budget["kv_bytes_per_page"] > 0


def test_engine_cache_layouts_are_read_without_a_pool_copy(tpu_python):
    """The compiler's temp of a paged read is far below the pool with the engine's layouts
    (GQA rows of 128 lanes, MLA latent rows padded to 640), and at least half the pool with
    the 576-lane latent rows they replaced: those are copied whole, every step."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TPU_SKIP_MDS_QUERY": "1"}
    proc = subprocess.run([tpu_python, os.path.join(ROOT, "tests", "aot", "tpu_relayout_child.py"),
                           "v6e:2x2"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    for engine_layout in ("rpa_rows", "mla_640", "gather_640"):
        assert cases[engine_layout]["temp"] < cases[engine_layout]["pool"] / 8, cases
    for old_layout in ("mla_576", "gather_576"):
        assert cases[old_layout]["temp"] >= cases[old_layout]["pool"] / 2, cases
