"""scripts/gpu_check.sh end to end in its CPU dry-run mode (GPU_CHECK_ALLOW_CPU=1: the engine
check on a tiny model, the GPU kernel interpreted), and the wheelhouse it installs from."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

import gpu_wheelhouse

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tiny model of gpu_engine_check.TINY_MODEL (float32): embed and lm_head 512 x 64, final
# norm 64, and per layer (2) two norms of 64, wq/wo 64 x 64, wk/wv 64 x 32, gate/up/down 64 x 128.
TINY_PARAM_BYTES = 4 * (2 * 512 * 64 + 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128))
TINY_EMBED_BYTES = 4 * 512 * 64
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4      # layers x (K, V) x KV heads x head_dim x 4


def test_gpu_check_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_ALLOW_CPU": "1", "PYTHON": sys.executable, "OUT": str(out),
           "GPU_CHECK_WHEELHOUSE": str(tmp_path / "no_wheelhouse")}
    # One quick kernel test: the step runs, the suite itself is tests/pallas_kernels' business.
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"),
                           "-k", "test_resolve_impl"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = (out / "gpu_check.log").read_text()
    for step in ("== environment", "== kernel tests", "== micro-benchmark", "== engine check",
                 "gpu_check: all steps passed"):
        assert step in log
    assert "gpu_wheelhouse: every module is there" in log
    kernel = json.loads((out / "gpu_kernel_bench.json").read_text())
    assert kernel["impl"] == "reference" and len(kernel["results"]) == 3

    r = json.loads((out / "gpu_engine_check.json").read_text())
    assert r["mode"] == "tiny" and r["backend"] == "cpu" and r["dtype"] == "float32"
    assert r["peak_source"] == "nominal" and r["peak_hbm_gbs"] == 20.0
    assert r["model"]["param_bytes"] == TINY_PARAM_BYTES
    assert r["warmup_shapes"] == 3 and r["compiles_after_warmup"] == 0
    assert set(r["engine_start_s"]) == {"xla", "gpu"}
    assert r["imported_host_lacks"] == []       # no ZMQ, gguf, Mooncake, llguidance, pytest

    paths = r["attention_paths"]
    assert paths["tokens_equal"] is True and paths["tokens_match"] is True
    assert [len(p["kernel_ids"]) for p in paths["prompts"]] == [8, 8, 8, 8]
    assert all(p["kernel_ids"] == p["xla_ids"] and p["first_divergence"] is None
               for p in paths["prompts"])

    assert [(d["batch"], d["context"]) for d in r["decode"]] == [(1, 112), (4, 112)]
    for d in r["decode"]:
        b, c, n = d["batch"], d["context"], d["new_tokens"]
        assert d["output_tokens"] == b * n
        # the second round hits the prefix cache for all but the last page of each prompt
        assert b * (c - 16) <= d["cached_tokens"] < b * c
        assert d["decode_steps_timed"] >= n - 3
        assert d["weight_bytes"] == TINY_PARAM_BYTES - TINY_EMBED_BYTES + b * 64 * 4
        assert c + 1 <= d["kv_bytes"] / (b * TINY_KV_BYTES_PER_TOKEN) <= c + n
        assert 0 < d["step_ms_min"] <= d["step_ms_median"] and d["host_ms_per_step"] > 0
        roofline_ms = (d["weight_bytes"] + d["kv_bytes"]) / 20e9 * 1e3
        assert d["roofline_ms"] == pytest.approx(roofline_ms)
        assert d["roofline_fraction"] == pytest.approx(roofline_ms / d["step_ms_median"])
        assert d["roofline_fraction"] > 0
        assert d["achieved_gbs"] == pytest.approx(20.0 * d["roofline_fraction"])

    p = r["prefill"]
    assert p["chunk_tokens"] == 64 and p["chunks_timed"] >= 1
    assert p["step_ms_median"] > 0 and p["tflops"] > 0
    assert p["mfu"] == pytest.approx(p["tflops"] / 0.1)
    assert 0 < r["total_s"]


def _write_wheel(folder, name: str, version: str, body: str) -> str:
    """A minimal pure-Python wheel of one module ``name`` whose ``VALUE`` is ``body``."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VALUE = {body!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as whl:
        for p, text in files.items():
            whl.writestr(p, text)
    return path


@pytest.mark.parametrize("use_pip", [True, False])
def test_wheelhouse_installs_only_missing_modules(tmp_path, use_pip):
    house, site = tmp_path / "house", tmp_path / "site"
    house.mkdir()
    probe = _write_wheel(str(house), "pdjax_probe_mod", "1.0", "from the wheelhouse")
    _write_wheel(str(house), "json", "9.9", "must not shadow the stdlib")
    wheels = (("pdjax_probe_mod", "pdjax-probe-mod>=1"), ("json", "json"))
    installed = gpu_wheelhouse.install(str(house), str(site), wheels, use_pip=use_pip)
    assert installed == [probe]
    assert not (site / "json").exists()
    value = subprocess.run(
        [sys.executable, "-c", "import pdjax_probe_mod, importlib.metadata as m; "
                               "print(pdjax_probe_mod.VALUE, m.version('pdjax_probe_mod'))"],
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert value.stdout.strip() == "from the wheelhouse 1.0"


def test_wheelhouse_names_modules_without_a_wheel(tmp_path):
    with pytest.raises(RuntimeError, match=r"\['pdjax_absent_mod'\] are missing"):
        gpu_wheelhouse.install(str(tmp_path), str(tmp_path / "site"),
                               (("pdjax_absent_mod", "pdjax-absent-mod"), ("json", "json")))
    assert gpu_wheelhouse.install(str(tmp_path), str(tmp_path / "site"), (("json", "json"),)) == []


def test_wheelhouse_holds_pytests_own_requirements():
    """Installed with --no-deps, so every requirement of pytest (on the host's Python 3.12)
    must be a row of WHEELS itself."""
    import importlib.metadata

    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "extra": ""}
    needed = {gpu_wheelhouse._dist_name(r.name)
              for r in map(Requirement, importlib.metadata.requires("pytest"))
              if r.marker is None or r.marker.evaluate(env)}
    rows = {gpu_wheelhouse._dist_name(req) for _, req in gpu_wheelhouse.WHEELS}
    assert "pytest" in rows and needed <= rows, needed - rows


def _simulate(sched, buckets, prompts, new_tokens, rid):
    """Run ``prompts`` through ``sched`` as the engine would (every batch must fit a bucket);
    returns (requests, batches)."""
    from pdjax.request import Request, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    reqs = [Request(f"{rid}{i}", list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    batches = []
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None and len(batches) < 100_000
        buckets.pick(batch.forward_mode, batch.num_tokens, len(batch.rows),
                     batch.pages_per_seq(sched.page_size))
        batches.append((batch.forward_mode, len(batch.rows), batch.num_tokens))
        sched.process_results(batch, {i: 5 for i, r in enumerate(batch.rows) if r.samples},
                              lambda req: ({"type": "length", "length": new_tokens}
                                           if len(req.output_ids) >= new_tokens else None))
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    return reqs, batches


def test_full_plan_fits_an_h100_and_decodes_every_row_together():
    """The Llama-3-8B run that no CPU can do, checked without JAX: its hand-chosen shapes hold
    every batch the settings allow, weights + KV pool fit 92% of an 80 GB GPU, and the real
    scheduler, fed the run's own request sequence, gives every decode case steps where all its
    rows decode (the prefix cache admitting them together) and full prefill chunks."""
    import gpu_engine_check as g
    import numpy as np

    from pdjax.config import ServerArgs
    from pdjax.sched.buckets import Buckets
    from pdjax.sched.scheduler import Scheduler, SchedulerConfig

    plan = g.FULL
    rng = np.random.default_rng(0)
    compare = g.random_prompts(rng, plan.compare_lengths, plan.model["vocab_size"])
    weights = 2 * (2 * 128256 * 4096 + 4096
                   + 32 * (2 * 4096 + 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336))
    assert weights == 16_060_522_496
    kv_per_token = 32 * 2 * 8 * 128 * 2
    for settings in (g.xla_engine_settings(plan, compare), g.kernel_engine_settings(plan, False)):
        settings = dict(settings)
        buckets = settings.pop("buckets")
        args = ServerArgs(**{k: v for k, v in settings.items() if k != "progress"})
        limits = Buckets.create(chunked_prefill_size=args.chunked_prefill_size,
                                max_running_requests=args.max_running_requests,
                                max_pages_per_seq=-(-args.context_length // args.page_size))
        buckets.check_serves(limits)
        assert weights + args.max_total_tokens * kv_per_token < 0.92 * 80e9 - 4e9
        sched = Scheduler(SchedulerConfig(
            num_pages=args.num_pages, page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size, max_context_len=args.context_length))
        _simulate(sched, buckets, compare, plan.compare_tokens, "c")
        if settings["attention_backend"] == "xla":
            assert len(buckets.all_keys()) == 2
            continue
        assert len(buckets.all_keys()) == 6
        for b, c in plan.decode_cases:
            prompts = g.random_prompts(rng, [c] * b, plan.model["vocab_size"])
            _simulate(sched, buckets, prompts, 1, f"w{b}_{c}_")
            reqs, batches = _simulate(sched, buckets, prompts, plan.new_tokens, f"d{b}_{c}_")
            assert sum(r.num_cached_tokens_reported for r in reqs) >= b * (c - plan.page_size)
            full = [x for x in batches if x[0] == "decode" and x[1] == b]
            assert len(full) == plan.new_tokens - 1, (b, c, batches[:5])
        prompts = g.random_prompts(rng, [plan.prefill_len] * plan.prefill_prompts,
                                   plan.model["vocab_size"])
        _, batches = _simulate(sched, buckets, prompts, 1, "p")
        assert [t for m, _, t in batches] == [plan.chunk] * 8
