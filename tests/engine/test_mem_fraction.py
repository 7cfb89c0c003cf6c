"""``--mem-fraction-static`` (SGLang's flag): the KV pool takes what the loaded weights leave of
that fraction of a device's memory, in whole pages (``engine/kv_budget.py``)."""

import jax
import pytest
from flax import nnx

from pdjax.config import ServerArgs
from pdjax.engine import Engine
from pdjax.engine.kv_budget import device_bytes_in_use, tokens_for_fraction
from pdjax.runner import model_runner

ARGS = dict(page_size=8, chunked_prefill_size=32, max_running_requests=4, context_length=128)


def test_tokens_for_fraction_is_the_budget_in_whole_pages():
    # 0.5 of 1 GiB minus 100 MiB of weights, 1 MiB pages: 412 pages, the null page among them.
    assert tokens_for_fraction(0.5, 1 << 30, 100 << 20, 1 << 20, 16) == 411 * 16
    # DP: pages rounded down to a multiple of the ranks (413 -> 412 for 4 ranks).
    assert tokens_for_fraction(0.5, 1 << 30, (100 << 20) - (1 << 20), 1 << 20, 16, 4) == 411 * 16
    with pytest.raises(ValueError, match=r"mem_fraction_static: 0.1 of 1.00 GiB .* after "
                                         r"0.098 GiB of weights"):
        tokens_for_fraction(0.1, 1 << 30, 100 << 20, 1 << 20, 16)


@pytest.mark.parametrize("value", [0, 1.5, -0.2, True, "0.5"])
def test_a_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="^mem_fraction_static: must be"):
        ServerArgs(mem_fraction_static=value)


def test_the_engine_sizes_its_pool_from_device_memory(tiny_checkpoints, monkeypatch):
    """A device of 96 MiB (patched: CPU reports the host's RAM) and a fraction of 0.25: the
    pool's pages are those 24 MiB less the weights, over one page's bytes, whatever
    --max-total-tokens says; the engine serves with that pool."""
    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 96 << 20)
    engine = Engine(model_path=tiny_checkpoints["llama"], progress=False, max_total_tokens=64,
                    mem_fraction_static=0.25, **ARGS)
    try:
        core = engine.core
        runner = core.runner
        page_bytes = runner.kv_bytes_per_page
        used = device_bytes_in_use(jax.tree.leaves(runner.state), jax.devices()[0])
        assert 0 < used < 24 << 20
        pages = ((24 << 20) - used) // page_bytes
        assert core.args.max_total_tokens == (pages - 1) * ARGS["page_size"]
        assert core.sched_config.num_pages == runner.num_pages == pages
        pool = sum(model_runner.shard_bytes(c) for c in runner.caches.values())
        assert used + pool <= 24 << 20 < used + pool + page_bytes
        out = engine.generate(input_ids=[[5, 6, 7, 8]],
                              sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out[0]["output_ids"]) == 3
    finally:
        engine.shutdown()


def test_too_small_a_fraction_names_the_flag(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 96 << 20)
    with pytest.raises(ValueError, match="mem_fraction_static: 1e-05 of 0.09 GiB"):
        Engine(model_path=tiny_checkpoints["llama"], progress=False, mem_fraction_static=1e-5,
               **ARGS)


def test_server_info_reports_the_sized_pool(tiny_checkpoints, monkeypatch):
    """/get_server_info's max_total_tokens is the pool as sized, not the flag's default that
    --mem-fraction-static replaced (it said 16384 for a 13,264-token pool)."""
    from pdjax.engine import AsyncEngine

    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 96 << 20)
    engine = AsyncEngine(ServerArgs(model_path=tiny_checkpoints["llama"], mem_fraction_static=0.25,
                                    skip_warmup_progress=True, **ARGS), progress=False)
    engine.start()
    try:
        assert engine.wait_ready(900)
        info = engine.server_info()
        tokens = engine.core.args.max_total_tokens
        assert tokens != 16384 and info["max_total_tokens"] == tokens
        assert info["max_total_num_tokens"] == tokens == info["num_total_pages"] * ARGS["page_size"]
    finally:
        engine.shutdown()


def test_a_fraction_too_small_for_the_weights_is_one_line_at_parse_time(tiny_checkpoints,
                                                                         monkeypatch, capsys):
    """Refused before the model loads (it was an ERROR log line after 25 s of loading), from
    the config's weights; a fraction that fits parses, whatever --max-total-tokens says."""
    from pdjax.serve import parse_args

    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 96 << 20)
    base = ["--port", "0", "--model-path", tiny_checkpoints["llama"], "--page-size", "8"]
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--mem-fraction-static", "1e-5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: mem_fraction_static: 1e-05 of 0.09 GiB per device"), err
    args = parse_args(base + ["--mem-fraction-static", "0.5", "--max-total-tokens", "100000000"])
    assert args.mem_fraction_static == 0.5
