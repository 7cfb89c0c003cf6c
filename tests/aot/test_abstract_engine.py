"""The abstract engine of ``pdjax.aot`` builds exactly what a server compiles: on the CPU (a
Target of the host's devices) every forward it lowers has the ModelRunner's module text, and
its serialized executables are what a runner started with ``aot_executables`` runs."""

import json
import os
import subprocess
import sys

import jax
import pytest

from pdjax.aot import report
from pdjax.aot.__main__ import main as aot_main
from pdjax.aot.engine import AbstractEngine, Entry
from pdjax.aot.targets import Target
from pdjax.config import ServerArgs
from pdjax.models.loader import load_model, make_mesh
from pdjax.runner.executables import ExecutableStore, fingerprint
from pdjax.runner.model_runner import ModelRunner

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIGS = os.path.join(ROOT, "pdjax", "aot", "configs")
TINY_LLAMA = os.path.join(CONFIGS, "tiny-llama")
SETTINGS = dict(model_path=TINY_LLAMA, max_total_tokens=512, context_length=128,
                chunked_prefill_size=64, max_running_requests=4, attention_backend="xla",
                unroll_layers=False, cpu_matmul_kernel=False, dtype="float32",
                load_format="dummy", grammar_backend="none")


def cpu_target(tp: int = 1) -> Target:
    return Target("cpu", "cpu", tuple(jax.devices("cpu")), "cpu", 1 << 30)


def dummy_runner(engine: AbstractEngine, **kwargs) -> ModelRunner:
    args = engine.args
    _, model = load_model(TINY_LLAMA, dtype="float32", mesh=make_mesh(args.tp_size),
                          load_format="dummy", attention_impl="xla")
    return ModelRunner(model, make_mesh(args.tp_size), num_pages=args.num_pages,
                       page_size=args.page_size, kv_dtype=engine.config.kv_dtype,
                       buckets=engine.buckets, chunk_size=args.chunked_prefill_size, **kwargs)


@pytest.mark.parametrize("tp", [1, 2])
def test_forwards_lower_to_the_runners_modules(tp):
    engine = AbstractEngine(ServerArgs(**SETTINGS, tp_size=tp), cpu_target())
    runner = dummy_runner(engine)
    forwards = [e for e in engine.entries("all") if e.key is not None]
    assert {e.key for e in forwards} == set(engine.buckets.all_keys())
    for entry in forwards[:: max(1, len(forwards) // 4)]:
        assert fingerprint(entry.lower()) == fingerprint(runner.lower(entry.key)), entry.name
    # The budget's sizes are the runner's real arrays' (per device).
    kv = sum(a.addressable_shards[0].data.nbytes for a in runner.caches.values())
    assert engine.kv_bytes_per_page_per_chip() * engine.args.num_pages == kv
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(runner.state))
    assert engine.weight_bytes_per_chip() == weights


@pytest.mark.slow      # starts a process
def test_serialized_executables_match_by_module(tmp_path):
    """serialize_child.py, in its own process (deserialized CPU executables break one)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "serialize_child.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["manifest_entries"] == got["entries"] >= 8     # two resamples share a module
    # XLA CPU executables lose their kernels when deserialized: the store refuses the platform,
    # and another device kind's manifest is refused by name.
    assert got["cpu_reason"] == "CPU executables do not survive serialization"
    assert "device_kind" in got["foreign_reason"]
    # The matching itself: the same bucket is found, another bucket is compiled instead.
    assert got["loaded"] and not got["other_loaded"] and got["num_loaded"] == 1
    # A runner pointed at the folder on the CPU compiles and runs as usual.
    assert got["runner_loaded"] == 0 and got["warmup_done"] and 0 <= got["token"] < 512
    with pytest.raises(ValueError, match="aot_executables"):
        ExecutableStore(str(tmp_path / "missing"), device_kind="cpu")


def test_failed_compile_names_the_entry_and_fails_the_run(monkeypatch, capsys):
    engine = AbstractEngine(ServerArgs(**SETTINGS), cpu_target())

    def broken():
        raise RuntimeError("Mosaic failed to compile TPU kernel: offsets not aligned")
    result = engine.compile_entry(Entry("decode", "decode T=4 R=4 P=8", broken))
    assert not result.ok and "Mosaic failed" in result.error and result.name == "decode T=4 R=4 P=8"
    assert "FAILED" in report.format_entries([result])
    assert aot_main(["--topology", "v9x:1x1", "--model-path", TINY_LLAMA]) == 2
    assert "topology" in capsys.readouterr().err


def test_budget_arithmetic():
    engine = AbstractEngine(ServerArgs(**SETTINGS), cpu_target())
    results = [engine.compile_entry(e) for e in engine.entries("core")]
    budget = report.hbm_budget(engine, results, mem_fraction=0.5)
    page = engine.kv_bytes_per_page_per_chip()
    usable = (1 << 30) // 2
    want = (usable - engine.weight_bytes_per_chip() - max(0, budget.other_argument_bytes)
            - budget.largest_temp_bytes) // page
    assert budget.kv_pages == want > 0 and budget.fits_one_context
    assert budget.largest_temp_bytes == max(r.temp_bytes for r in results)
    with pytest.raises(ValueError, match="mem_fraction"):
        report.hbm_budget(engine, results, mem_fraction=1.5)


def test_the_hicache_host_pool_is_a_budget_line_and_its_scatter_is_checked():
    """``--enable-hierarchical-cache``: the host pool (``--hicache-ratio`` x the pages that fit,
    or ``--hicache-size`` GiB) is a host-memory line of the budget, and the page scatter that
    loads it (donated pool) is checked for a pool copy like the forwards (not marked here)."""
    engine = AbstractEngine(ServerArgs(**SETTINGS, enable_hierarchical_cache=True,
                                       hicache_ratio=1.5), cpu_target())
    results = [engine.compile_entry(e) for e in engine.entries("core")]
    scatter = [r for r in results if r.kind == "scatter_pages"]
    assert scatter and all(r.ok and r.pool_copy is None for r in scatter)
    budget = report.hbm_budget(engine, results, mem_fraction=0.5)
    page = engine.kv_bytes_per_page_per_chip()          # TP 1: a chip holds the whole page
    slots, nbytes = report.host_kv_pool(engine, budget)
    assert slots == int(1.5 * budget.kv_pages) > 0 and nbytes == slots * page
    text = report.format_budget(engine, budget)
    assert f"host memory (HiCache L2, not HBM): {slots} pages" in text
    sized = AbstractEngine(ServerArgs(**SETTINGS, enable_hierarchical_cache=True,
                                      hicache_size=1), cpu_target())
    assert report.host_kv_pool(sized, budget) == ((1 << 30) // page, (1 << 30) // page * page)
    assert report.host_kv_pool(AbstractEngine(ServerArgs(**SETTINGS), cpu_target()),
                               budget) is None


def test_buckets_override_is_checked():
    from pdjax.sched.buckets import Buckets

    args = ServerArgs(**SETTINGS)
    default = AbstractEngine(args, cpu_target()).buckets
    few = Buckets(token_buckets=(default.token_buckets[-1],),
                  request_buckets=(default.request_buckets[-1],),
                  pages_per_seq_buckets=default.pages_per_seq_buckets[-1:],
                  max_rows=default.max_rows)
    engine = AbstractEngine(args, cpu_target(), buckets=few)
    assert [e.key for e in engine.entries("all") if e.key is not None] == few.all_keys()
    short = Buckets(token_buckets=(16,), request_buckets=few.request_buckets,
                    pages_per_seq_buckets=few.pages_per_seq_buckets, max_rows=few.max_rows)
    with pytest.raises(ValueError, match="token_buckets"):
        AbstractEngine(args, cpu_target(), buckets=short)


def test_the_servers_mem_fraction_static_is_the_budgets_fraction():
    import argparse

    from pdjax.aot.__main__ import _check_outputs
    ns = argparse.Namespace(mem_fraction=0.9, mem_fraction_static=0.6, dp=1, json=None,
                            serialize=None)
    _check_outputs(ns)
    assert ns.mem_fraction == 0.6


def test_bad_settings_are_refused_before_compiling(capsys, tmp_path, monkeypatch):
    base = ["--topology", "v5e:2x2", "--model-path", TINY_LLAMA]
    for extra, field in ((["--mem-fraction", "1.5"], "mem_fraction"),
                         (["--mem-fraction", "0"], "mem_fraction"), (["--dp", "0"], "dp"),
                         (["--mem-fraction-static", "1.5"], "mem_fraction_static"),
                         (["--json", str(tmp_path / "no" / "x.json")], "json"),
                         (["--json", str(tmp_path)], "json"),
                         (["--json", "/proc/x.json"], "json"),
                         (["--serialize", __file__], "serialize"),
                         (["--serialize", "/proc/nope"], "serialize"),
                         (["--serialize", "/proc/self"], "serialize"),
                         (["--model-path", os.path.join(ROOT, "README.md")], "model_path"),
                         (["--model-path", str(tmp_path)], "model_path")):
        assert aot_main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {field}") and err.count("\n") == 1, (extra, err)
    # Buffers no chip holds (the CPU target: 1 GiB) are refused as a server refuses them
    # (they compiled, out of memory, entry after entry).
    from pdjax.aot import targets

    monkeypatch.setattr(targets, "tpu_target", lambda name: cpu_target())
    for flag in ("--chunked-prefill-size", "--max-running-requests"):
        assert aot_main(base + [flag, "1000000"]) == 2, flag
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag[2:].replace('-', '_')}: 1,000,000 ") and \
            "more than its 1.0 GiB" in err, err
    with pytest.raises(SystemExit) as e:        # argparse's own: one line too, no usage block
        aot_main(base + ["--page-size", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: page_size: invalid int value: 'x'\n"
    # A pool larger than a chip by itself is refused before compiling (it compiled, and the
    # compiler's out-of-memory lines scrolled by with exit 0).
    with pytest.raises(ValueError, match=r"^max_total_tokens: a KV pool of 33,554,4\d\d tokens "
                                         r"needs .* GiB on each device, more than its 1.0 GiB"):
        AbstractEngine(ServerArgs(**{**SETTINGS, "max_total_tokens": 2 ** 25}), cpu_target())
    with pytest.raises(ValueError, match="attention_backend: 'tpu' does not run on cpu"):
        AbstractEngine(ServerArgs(**{**SETTINGS, "attention_backend": "tpu"}), cpu_target())
    from pdjax.engine.settings import resolve_engine_config

    mla = os.path.join(CONFIGS, "tiny-deepseek-v3.2")
    # MLA takes the FP8 latent record on the kernels (issue 40); a GQA fp8 cache's per-token
    # scales are read by the xla path on TPU (the TPU kernel reads none yet); MLA on the CPU
    # path too.
    assert resolve_engine_config(ServerArgs(model_path=mla, kv_cache_dtype="fp8_e4m3"),
                                 "tpu").attention_impl == "tpu"
    assert resolve_engine_config(ServerArgs(model_path=TINY_LLAMA, kv_cache_dtype="fp8_e4m3"),
                                 "tpu").attention_impl == "xla"
    assert resolve_engine_config(ServerArgs(model_path=mla, kv_cache_dtype="fp8_e4m3"),
                                 "cpu").attention_impl in ("cpu", "xla")


def test_mtp_adds_its_layer_and_hidden_state_buffer():
    """With ``--speculative-algorithm mtp`` the abstract engine builds the target as the server
    does (DESIGN.md §3): the MTP layer's weights and the ``mtp_hidden`` buffer count in the
    budget (DeepSeek-V3: 7168 bf16 values a token beside the latent of 61 layers)."""
    path = os.path.join(CONFIGS, "deepseek-v3")
    args = dict(model_path=path, max_total_tokens=4096, context_length=1024,
                chunked_prefill_size=256, max_running_requests=4, attention_backend="xla",
                dtype="bfloat16", load_format="dummy", grammar_backend="none")
    plain = AbstractEngine(ServerArgs(**args), cpu_target())
    mtp = AbstractEngine(ServerArgs(**args, speculative_algorithm="mtp"), cpu_target())
    assert [s.name for s in mtp.cache_specs] == ["latent", "mtp_hidden"]
    page = plain.args.page_size
    assert (mtp.kv_bytes_per_page_per_chip() - plain.kv_bytes_per_page_per_chip()
            == page * 7168 * 2)
    assert plain.kv_bytes_per_page_per_chip() == page * 61 * 576 * 2
    # One more MoE decoder layer and enorm, hnorm, eh_proj, shared_head.norm.
    extra = mtp.weight_bytes_per_chip() - plain.weight_bytes_per_chip()
    assert extra > 256 * 3 * 7168 * 2048 * 2 + 2 * 7168 * 7168 * 2
    with pytest.raises(ValueError, match="speculative_algorithm 'mtp'"):
        AbstractEngine(ServerArgs(**{**SETTINGS, "speculative_algorithm": "mtp"}), cpu_target())
