"""ServerArgs in groups and the one factory that resolves them (engine/settings.py): flat and
grouped construction agree, the CLI flags are one per setting, and every "auto" resolves in
``resolve_engine_config``."""

import argparse
import dataclasses
import pickle

import jax.numpy as jnp
import pytest

from pdjax.config import ARG_GROUPS, CacheArgs, ServerArgs
from pdjax.engine.settings import resolve_engine_config
from pdjax.models import platform as platform_module
from pdjax.pallas_kernels.ragged_paged_attention import cpu_kernel_available


def test_flat_and_grouped_settings_are_one_value():
    args = ServerArgs(page_size=8, max_total_tokens=64, role="decode", port=5, tp_size=1)
    assert args.cache == CacheArgs(page_size=8, max_total_tokens=64)
    assert (args.page_size, args.cache.page_size, args.num_pages) == (8, 8, 9)
    assert args.disaggregation.role == args.role == "decode" and args.server.port == 5
    moved = dataclasses.replace(args, port=7, context_length=1024)
    assert (moved.port, moved.context_length, moved.page_size, moved.role) == (7, 1024, 8,
                                                                             "decode")
    assert pickle.loads(pickle.dumps(args)) == args
    assert ServerArgs(cache=CacheArgs(page_size=32)).page_size == 32
    assert ServerArgs.default("context_length") is None and ServerArgs.default("port") == 30000
    flat = args.to_flat_dict()
    assert len(flat) == sum(len(dataclasses.fields(c)) for c in ARG_GROUPS.values())
    assert flat["page_size"] == 8 and flat["drain_timeout_s"] == 30.0
    with pytest.raises(TypeError, match="unknown setting"):
        ServerArgs(pagesize=8)
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of"):
        ServerArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="max_total_tokens"):
        ServerArgs(page_size=64, max_total_tokens=100)
    with pytest.raises(AttributeError):
        args.no_such_setting


def test_one_cli_flag_per_setting_and_the_alias():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    names = {f.name for f in ServerArgs.settings()}
    # Tri-state (auto by default) settings also have their --no- flag.
    assert flags == {"--" + n.replace("_", "-") for n in names} | {
        "--disaggregation-mode", "--no-unroll-layers", "--no-cpu-matmul-kernel"}
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--page-size", "32", "--enable-mixed-chunk", "--disaggregation-mode", "prefill",
         "--target-itl-ms", "25.5", "--attention-backend", "xla"]))
    assert (args.page_size, args.enable_mixed_chunk, args.role, args.target_itl_ms,
            args.attention_backend) == (32, True, "prefill", 25.5, "xla")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])
    assert ServerArgs.from_cli_args(parser.parse_args(
        ["--role", "decode", "--disaggregation-mode", "decode"])).role == "decode"
    with pytest.raises(ValueError, match="^disaggregation_mode: 'prefill' .* contradicts role "
                                         "'decode'"):
        ServerArgs.from_cli_args(parser.parse_args(
            ["--role", "decode", "--disaggregation-mode", "prefill"]))


def test_resolve_engine_config(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    cfg = resolve_engine_config(ServerArgs(model_path=path, page_size=8, max_total_tokens=512,
                                           chunked_prefill_size=32))
    assert cfg.model_path == path and cfg.dtype == jnp.float32 and cfg.kv_dtype == jnp.float32
    assert cfg.attention_impl == ("cpu" if cpu_kernel_available() else "xla") and cfg.overlap
    s = cfg.scheduler
    assert (s.num_pages, s.page_size, s.chunked_prefill_size, s.page_aligned_chunks) == (
        65, 8, 32, False)
    from pdjax.models.loader import checkpoint_config
    assert s.max_context_len == checkpoint_config(path).max_position_embeddings
    prefill = resolve_engine_config(ServerArgs(
        model_path=path, role="prefill", context_length=64, kv_cache_dtype="bfloat16",
        attention_backend="reference", dtype="bfloat16"))
    assert (prefill.scheduler.max_context_len, prefill.kv_dtype, prefill.dtype) == (
        64, jnp.bfloat16, jnp.bfloat16)
    assert prefill.attention_impl == "reference" and not prefill.overlap
    assert prefill.scheduler.page_aligned_chunks


def test_a_context_over_the_models_positions_is_served_with_a_warning(tiny_checkpoints,
                                                                      caplog):
    path = tiny_checkpoints["llama"]        # max_position_embeddings 512
    with caplog.at_level("WARNING", logger="pdjax.engine.settings"):
        assert resolve_engine_config(ServerArgs(model_path=path, context_length=512)) \
            .scheduler.max_context_len == 512
        assert not caplog.records
        cfg = resolve_engine_config(ServerArgs(model_path=path, context_length=1000))
    assert cfg.scheduler.max_context_len == 1000
    assert "context_length 1000 is over the model's max_position_embeddings 512" in caplog.text


def test_single_device_kernel_is_not_picked_for_tensor_parallel(tiny_checkpoints, monkeypatch):
    """The native CPU kernel has no sharding rule: under tp_size > 1 auto falls back to the
    jnp path, and asking for it by name is an error naming the field."""
    monkeypatch.setattr(platform_module, "resolve_impl", lambda impl, platform=None: "cpu")
    path = tiny_checkpoints["llama"]
    assert resolve_engine_config(ServerArgs(model_path=path, tp_size=2)).attention_impl == "xla"
    assert resolve_engine_config(ServerArgs(model_path=path)).attention_impl == "cpu"
    with pytest.raises(ValueError, match="^attention_backend: 'cpu' runs on one device"):
        resolve_engine_config(ServerArgs(model_path=path, tp_size=2, attention_backend="cpu"))


def test_unroll_layers_auto_follows_platform_and_family(tiny_checkpoints):
    """``unroll_layers`` None (auto) unrolls the Llama family on CPU only and never DeepSeek;
    True / False are kept; the CLI has ``--unroll-layers`` / ``--no-unroll-layers`` with auto
    by default; anything but a bool or None is a ValueError naming the field."""
    import jax

    on_cpu = jax.default_backend() == "cpu"
    for name, auto in (("llama", on_cpu), ("qwen3", on_cpu), ("deepseek_v3", False)):
        path = tiny_checkpoints[name]
        assert resolve_engine_config(ServerArgs(model_path=path)).unroll_layers is auto, name
        assert resolve_engine_config(ServerArgs(model_path=path,
                                                unroll_layers=False)).unroll_layers is False
    assert resolve_engine_config(ServerArgs(model_path=tiny_checkpoints["llama"],
                                            unroll_layers=True)).unroll_layers is True
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for argv, want in (([], None), (["--unroll-layers"], True), (["--no-unroll-layers"], False)):
        assert ServerArgs.from_cli_args(parser.parse_args(argv)).unroll_layers is want
    with pytest.raises(ValueError, match="^unroll_layers: must be true, false or null"):
        ServerArgs(unroll_layers=1)


def test_cpu_matmul_kernel_auto_and_refusals(tiny_checkpoints):
    """``cpu_matmul_kernel`` None (auto) packs the Llama family on one CPU device (the kernel
    must build there), never DeepSeek, never under ``tp_size > 1``; asked for where it cannot
    run it is a ValueError naming the field and the reason; the CLI has both flags."""
    import jax

    from pdjax.pallas_kernels.dense_cpu import matmul_kernel_status

    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:
        assert matmul_kernel_status()[0], matmul_kernel_status()[1]
    for name, auto in (("llama", on_cpu), ("qwen3", on_cpu), ("deepseek_v3", False)):
        path = tiny_checkpoints[name]
        assert resolve_engine_config(ServerArgs(model_path=path)).cpu_matmul_kernel is auto, name
        assert resolve_engine_config(ServerArgs(
            model_path=path, cpu_matmul_kernel=False)).cpu_matmul_kernel is False
    llama = tiny_checkpoints["llama"]
    assert resolve_engine_config(ServerArgs(model_path=llama, tp_size=2)).cpu_matmul_kernel is False
    refusals = [(dict(model_path=tiny_checkpoints["deepseek_v3"]), "only Llama-family"),
                (dict(model_path=llama, tp_size=2), "one device; tp_size is 2")]
    if not on_cpu:
        refusals = [(dict(model_path=llama), "not cpu")]
    for kwargs, reason in refusals:
        with pytest.raises(ValueError, match=f"cpu_matmul_kernel: .*{reason}"):
            resolve_engine_config(ServerArgs(cpu_matmul_kernel=True, **kwargs))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for argv, want in (([], None), (["--cpu-matmul-kernel"], True),
                       (["--no-cpu-matmul-kernel"], False)):
        assert ServerArgs.from_cli_args(parser.parse_args(argv)).cpu_matmul_kernel is want
    with pytest.raises(ValueError, match="^cpu_matmul_kernel: must be true, false or null"):
        ServerArgs(cpu_matmul_kernel="yes")


def test_the_offline_engine_refuses_what_no_device_holds_before_loading(tiny_checkpoints,
                                                                        monkeypatch):
    """``build_runner`` runs the parse-time device checks too (``pdjax.Engine`` has no parse
    step): 100,000 rows of a 256 MiB device were XLA's out-of-memory at warm-up, after the
    weights had loaded; now a ValueError naming the setting before the model loads."""
    from pdjax.engine import Engine
    from pdjax.models import loader
    from pdjax.runner import model_runner

    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 256 * 2 ** 20)

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    monkeypatch.setattr("pdjax.engine.runner_setup.load_model", no_load)
    with pytest.raises(ValueError, match=r"^max_running_requests: 100,000 rows need at least "
                                         r"0\.6 GiB .* more than its 0\.2 GiB"):
        Engine(tiny_checkpoints["llama"], max_running_requests=100_000, progress=False)
    with pytest.raises(ValueError, match=r"^tp_size: must be in \[1, 4\] \(devices available\)"):
        Engine(tiny_checkpoints["llama"], tp_size=8, progress=False)


def test_fp8_gqa_kv_takes_an_attention_path_that_reads_its_scales(tiny_checkpoints):
    """The TPU kernel does not read the per-token FP8 scales of a GQA cache: on a TPU target
    ``auto`` picks ``xla`` for such a cache, and ``tpu`` by name is refused at parse time
    (it failed at the first compile); MLA keeps its kernel, which reads its FP8 record."""
    llama = tiny_checkpoints["llama"]

    def impl(path, **kw):
        return resolve_engine_config(ServerArgs(model_path=path, page_size=16, **kw),
                                     platform="tpu").attention_impl

    assert impl(llama) == "tpu"
    assert impl(llama, kv_cache_dtype="fp8_e4m3") == "xla"
    with pytest.raises(ValueError, match=r"^attention_backend: 'tpu' does not read an FP8 KV "
                                         r"cache .* use one of reference, xla, cpu, gpu"):
        impl(llama, kv_cache_dtype="fp8_e4m3", attention_backend="tpu")
    assert impl(tiny_checkpoints["deepseek_v32"], kv_cache_dtype="fp8_e4m3") == "tpu"


def test_a_narrow_kv_dtype_on_cpu_warns_that_each_step_copies_the_pool(tiny_checkpoints,
                                                                       caplog):
    """XLA:CPU copies a bf16 / fp8 buffer on every write: a 65k-token fp8 pool made 32 decode
    tokens of the tiny llama take 4.7 s against 0.03 s with float32 KV (a new user's chat
    request on SmolLM2 took 263 s). The server says so at start; float32 KV does not warn."""
    import logging

    path = tiny_checkpoints["llama"]
    for kv, warns in (("fp8_e4m3", True), ("bfloat16", True), ("float32", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdjax.engine.settings"):
            resolve_engine_config(ServerArgs(model_path=path, kv_cache_dtype=kv), platform="cpu")
            resolve_engine_config(ServerArgs(model_path=path, kv_cache_dtype=kv), platform="gpu")
        hits = [r for r in caplog.records if "copies a" in r.getMessage()]
        assert len(hits) == (1 if warns else 0), (kv, [r.getMessage() for r in hits])
