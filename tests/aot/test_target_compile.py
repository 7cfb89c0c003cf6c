"""The compile of every kernel the tiny models use for TPU and GPU, as CI runs it:
``python -m pdjax.aot`` compiles the core entries of the tiny Llama, DeepSeek-V3.2 and GLM-5
for TPU v5e and v6e in ``.venv-tpu`` (jax[tpu]: libtpu's real compiler, Mosaic for the Pallas
kernels) and for an H200 in ``.venv-cuda`` (jax[cuda12]: XLA, Triton and ptxas, no GPU or
driver). Both virtualenvs are made by ``scripts/aot_env.sh``. A kernel that stops compiling
fails this test, naming the entry. And the engine's TPU KV layouts (GQA rows, latent rows of
whole lanes) are read without a copy of the pool (``tpu_relayout_child.py``).

Without the virtualenvs the test fails (run ``bash scripts/aot_env.sh tpu`` and ``... cuda``;
the README's test command does)."""

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "pdjax", "aot", "configs")
# Small shapes: the kernels are the same, the compile is shorter.
SETTINGS = ["--entries", "core", "--max-total-tokens", "1024", "--context-length", "128",
            "--chunked-prefill-size", "32", "--max-running-requests", "4"]
# target -> (platform, pdjax.aot's target flag, the device kind the report names)
TARGETS = {
    "v5e:2x2": ("tpu", "--topology", "TPU v5"),
    "v6e:2x2": ("tpu", "--topology", "TPU v6"),
    "h200": ("gpu", "--gpu", "NVIDIA H200"),
}
KERNELS = {     # the Pallas kernels each forward must hold, without the platform suffix
    "tiny-llama": {"ragged_paged_attention"},
    "tiny-deepseek-v3.2": {"mla_sparse_attention", "indexer_scores"},
    "tiny-glm-5": {"mla_sparse_attention", "indexer_scores"},
}
VENVS = {"tpu": ".venv-tpu", "gpu": ".venv-cuda"}
ENVS = {"tpu": {"TPU_SKIP_MDS_QUERY": "1"},
        "gpu": {"CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}}


def _python(platform: str) -> str:
    python = os.path.join(ROOT, VENVS[platform], "bin", "python")
    if not os.path.exists(python):
        kind = "tpu" if platform == "tpu" else "cuda"
        pytest.fail(f"no {VENVS[platform]}: run bash scripts/aot_env.sh {kind} "
                    "(scripts/run_tests.sh does)")
    return python


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("model", list(KERNELS))
def test_core_entries_compile_for_target(tmp_path, model, target):
    platform, flag, device_kind = TARGETS[target]
    out = tmp_path / "aot.json"
    env = {**os.environ, "PYTHONPATH": ROOT, **ENVS[platform]}
    proc = subprocess.run(
        [_python(platform), "-m", "pdjax.aot", "--model-path", os.path.join(CONFIGS, model),
         flag, target, "--json", str(out), *SETTINGS],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.exists() else None
    failed = [] if report is None else [(e["name"], e["error"]) for e in report["entries"]
                                        if e["error"] is not None]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["device_kind"].startswith(device_kind), report["device_kind"]
    kinds = {e["kind"] for e in report["entries"]}
    assert {"decode", "extend", "prompt_logprobs", "resample", "gather_pages"} <= kinds
    forwards = [e for e in report["entries"] if e["kind"] in ("decode", "extend")]
    kernels = {f"{k}_{platform}" for k in KERNELS[model]}
    for entry in forwards:       # the target's Pallas kernels are in the executable, not a fallback
        assert kernels <= set(entry["kernels"]), entry
        assert entry["argument_bytes"] > 0 and entry["temp_bytes"] > 0
    budget = report["budget"]
    assert budget["kv_pages"] > 0 and budget["fits_one_context"]
    assert budget["weight_bytes"] > 0 and budget["kv_bytes_per_page"] > 0


def test_engine_cache_layouts_are_read_without_a_pool_copy():
    """The compiler's temp of a paged read is far below the pool with the engine's layouts
    (GQA rows of 128 lanes, MLA latent rows padded to 640) and its TPU staging gather, and at
    least half the pool with the 576-lane latent rows and XLA's gather they replaced: those
    copy the pool, every step or every transfer."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TPU_SKIP_MDS_QUERY": "1"}
    proc = subprocess.run([_python("tpu"), os.path.join(ROOT, "tests", "aot",
                                                        "tpu_relayout_child.py"),
                           "v6e:2x2"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    for engine_layout in ("rpa_rows", "mla_640", "gather_640", "gather_rows_slices"):
        assert cases[engine_layout]["temp"] < cases[engine_layout]["pool"] / 8, cases
    for old_layout in ("mla_576", "gather_576", "gather_rows_xla"):
        assert cases[old_layout]["temp"] >= cases[old_layout]["pool"] / 2, cases
