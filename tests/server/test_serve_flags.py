"""``python -m pdjax.serve``'s parse step, in this process: every setting a server would fail on
after loading its model (an ERROR line or a traceback, exit 1) is one line
``error: FIELD: ...`` and exit 2 before anything loads (issue 44)."""

import json
import os
import shutil

import pytest

from pdjax.serve import parse_args


def _parse_error(capsys, argv) -> str:
    """The one stderr line of ``parse_args(argv)``, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err   # no usage block
    return err.strip()


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("argv,line", [
    (["--port", "x"], "error: port: invalid int value: 'x'"),
    (["--role", "bogus"], "error: role: invalid choice: 'bogus'"),
    (["--unroll-layers", "--bogus"], "error: unrecognized arguments: --bogus"),
    (["--page-size", "0"], "error: page_size: must be a positive integer, got 0"),
    (["--max-running-requests"], "error: max_running_requests: expected one argument"),
])
def test_every_flag_error_is_one_line(capsys, argv, line):
    """argparse's own errors too: no usage block, the flag as its field's name."""
    assert _parse_error(capsys, argv).startswith(line)


@pytest.mark.parametrize("model,tp,line", [
    ("llama", 7, "error: tp_size: must be in [1, 4] (devices available), got 7"),
    ("llama", 3, "error: tp_size: 3 must divide num_attention_heads (4)"),
    ("deepseek_v3", 3, "error: tp_size: 3 must divide"),
])
def test_a_tp_size_the_devices_or_heads_refuse_fails_at_parse(capsys, tiny_checkpoints, model,
                                                               tp, line):
    """It was 'failed to start' and exit 1 once the engine had started."""
    argv = ["--model-path", tiny_checkpoints[model], "--tp-size", str(tp)]
    assert _parse_error(capsys, argv).startswith(line)


def test_a_tp_size_that_replicates_kv_heads_is_accepted(tiny_checkpoints):
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["llama"], "--tp-size", "4"])
    assert args.tp_size == 4


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.parametrize("flag", ["--model-path", "--speculative-draft-model-path"])
def test_missing_or_cut_weight_files_fail_at_parse(capsys, tiny_checkpoints, tmp_path, flag):
    """Headers and sizes only (no tensor read); each was a load error after the engine had
    started, or (a cut file) an error from deep in safetensors."""
    d = _copy(tiny_checkpoints["llama"], tmp_path)
    shard = d / "model-00002-of-00006.safetensors"
    field = flag[2:].replace("-", "_")
    extra = (["--speculative-algorithm", "draft", "--model-path", tiny_checkpoints["qwen3"]]
             if field != "model_path" else [])

    def error():
        return _parse_error(capsys, [flag, str(d), *extra])

    size = shard.stat().st_size
    _truncate(shard, size - 1)
    assert error() == (f"error: {field}: {shard}: truncated: its tensors end at byte "
                       f"{size:,}, the file has {size - 1:,}")
    shard.write_bytes(b"\x00garbage")
    assert error().startswith(f"error: {field}: {shard}: cannot read safetensors (header ")
    shard.unlink()
    assert error() == f"error: {field}: {shard}: file not found (listed in the index)"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "00002" not in v}
    index["weight_map"]["model.layers.9.extra.weight"] = "model-00001-of-00006.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert error() == (f"error: {field}: {d / 'model.safetensors.index.json'}: tensor "
                       "'model.layers.9.extra.weight' listed but not found in "
                       "model-00001-of-00006.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    assert error().startswith(f"error: {field}: {d / 'model.safetensors.index.json'}: "
                              "malformed index (TypeError('weight_map is not an object")
    if field == "model_path":        # random weights read no file
        assert parse_args(["--port", "0", flag, str(d), "--load-format", "dummy"]).load_format \
            == "dummy"
    single = _copy(tiny_checkpoints["qwen3"], tmp_path, "single")
    _truncate(single / "model.safetensors", 1000)
    assert _parse_error(capsys, [flag, str(single), *extra]).startswith(
        f"error: {field}: {single / 'model.safetensors'}: truncated: its header ends at byte")


def test_a_cut_gguf_fails_at_parse(capsys, tmp_path):
    """(Its header parse already fails on a cut file; kept with the other weight files.)"""
    from pdjax.models.checkpoint import default_model_path

    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(default_model_path()) - 4096))
    line = _parse_error(capsys, ["--model-path", str(cut)])
    assert line.startswith(f"error: model_path: {cut}: cannot read GGUF ("), line


def test_aot_executables_without_a_manifest_fail_at_parse(capsys, tmp_path):
    """A folder python -m pdjax.aot --serialize did not write was a ValueError when the
    runner was built, after the model had loaded."""
    assert _parse_error(capsys, ["--aot-executables", "/nonexistent"]) == (
        "error: aot_executables: /nonexistent: no such folder (python -m pdjax.aot "
        "--serialize DIR writes one)")
    assert _parse_error(capsys, ["--aot-executables", str(tmp_path)]).startswith(
        f"error: aot_executables: no readable manifest.json in {tmp_path}: ")
    (tmp_path / "manifest.json").write_text("[]")
    assert _parse_error(capsys, ["--aot-executables", str(tmp_path)]).startswith(
        f"error: aot_executables: {tmp_path / 'manifest.json'}: not a manifest")


def test_a_tokenizer_fault_fails_at_parse(capsys, tiny_checkpoints, tmp_path):
    """Each was a transformers traceback from the tokenizer thread after the model loaded."""
    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    assert _parse_error(capsys, ["--model-path", str(d)]).startswith(
        f"error: model_path: {d / 'tokenizer.json'}: not a tokenizer (")
    (d / "tokenizer.json").unlink()
    assert _parse_error(capsys, ["--model-path", str(d)]) == (
        f"error: model_path: {d}: no tokenizer (tokenizer.json, tokenizer.model, or vocab.json "
        "and merges.txt)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _parse_error(capsys, ["--model-path", tiny_checkpoints["qwen3"], "--tokenizer-path",
                                 str(empty)]).startswith(f"error: tokenizer_path: {empty}: no "
                                                         "tokenizer")
    good = _copy(tiny_checkpoints["qwen3"], tmp_path, "good")
    (good / "tokenizer_config.json").write_text("{")
    assert _parse_error(capsys, ["--model-path", str(good)]).startswith(
        f"error: model_path: {good / 'tokenizer_config.json'}: cannot read (")
    # Its own folder with a good tokenizer is accepted.
    args = parse_args(["--port", "0", "--model-path", str(good), "--tokenizer-path",
                       tiny_checkpoints["qwen3"]])
    assert args.tokenizer_path == tiny_checkpoints["qwen3"]


def test_a_wrongly_typed_config_value_fails_at_parse(capsys, tiny_checkpoints, tmp_path):
    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": "big"}))
    assert _parse_error(capsys, ["--model-path", str(d)]) == (
        f"error: model_path: {d / 'config.json'}: hidden_size: expected an integer, got 'big'")


def test_buffers_no_device_holds_fail_at_parse(capsys, tiny_checkpoints, monkeypatch):
    """Rows and tokens past a device's memory ended in XLA's out-of-memory at warm-up; the
    estimate (lower bounds) refuses them and accepts the defaults. A 256 MiB device here."""
    from pdjax.runner import model_runner

    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 256 * 2 ** 20)
    llama = ["--model-path", tiny_checkpoints["llama"]]
    # 100,000 rows of 512 logits: 2 x 4 B (logits + a sampling temporary) + 5 B of penalty
    # tables each, 0.62 GiB.
    assert _parse_error(capsys, [*llama, "--max-running-requests", "100000"]).startswith(
        "error: max_running_requests: 100,000 rows need at least 0.6 GiB of logits and penalty "
        "tables on each device, with the weights (0.0 GiB) and the KV pool (0.0 GiB), more than "
        "its 0.2 GiB")
    for flag in ("--chunked-prefill-size", "--max-num-batched-tokens"):
        field = flag[2:].replace("-", "_")
        assert _parse_error(capsys, [*llama, flag, "100000000"]).startswith(
            f"error: {field}: 100,000,000 needs at least 166.9 GiB of activations and logits")
    assert _parse_error(capsys, [*llama, "--max-total-tokens", "4000000"]).startswith(
        "error: max_total_tokens: a KV pool of 4,000,016 tokens needs 1.9 GiB on each device")
    assert parse_args(["--port", "0", *llama]).max_running_requests == 16


def test_what_the_engine_refused_at_start_fails_at_parse(capsys, tiny_checkpoints, tmp_path):
    """The same gap in other flags (each was 'failed to start', exit 1, after the model
    loaded): a kernel the platform lacks, an MTP run without an MTP layer, a draft model of
    another vocabulary."""
    llama = ["--model-path", tiny_checkpoints["llama"]]
    assert _parse_error(capsys, [*llama, "--cpu-matmul-kernel", "--tp-size", "2"]) == (
        "error: cpu_matmul_kernel: it runs on one device; tp_size is 2")
    assert _parse_error(capsys, [*llama, "--attention-backend", "cpu", "--tp-size", "2"]) == (
        "error: attention_backend: 'cpu' runs on one device; tp_size is 2 (use 'xla' or 'auto')")
    assert _parse_error(capsys, [*llama, "--speculative-algorithm", "mtp"]).startswith(
        "error: speculative_algorithm: 'mtp' needs a DeepSeek-V3 / V3.2 / GLM-5 checkpoint with "
        "num_nextn_predict_layers >= 1")
    draft = _copy(tiny_checkpoints["qwen3"], tmp_path)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1024}))
    assert _parse_error(capsys, [*llama, "--speculative-algorithm", "draft",
                                 "--speculative-draft-model-path", str(draft)]) == (
        "error: speculative_draft_model_path: the draft model's vocabulary (1024) differs from "
        "the target's (512)")


def test_role_pd_checks_its_childrens_ports_at_parse(capsys):
    """``--role pd`` serves its prefill and decode on --port + 1 and + 2: a port past 65535,
    the bootstrap port or one in use failed in the children (exit 1, after the router had
    started; found by a new-user trial)."""
    import socket

    from pdjax.ports import free_port

    assert _parse_error(capsys, ["--role", "pd", "--port", "65535"]) == (
        "error: port: --role pd runs its prefill server on --port + 1, and 65536 is past 65535")
    # bootstrap port 0 (any free one) started, and the router, told 0, failed every request
    # with a 400 blaming the client (a new-user trial)
    assert _parse_error(capsys, ["--role", "pd", "--port", str(free_port()),
                                 "--disaggregation-bootstrap-port", "0"]) == (
        "error: disaggregation_bootstrap_port: --role pd tells its router the prefill's "
        "bootstrap port before it starts, so it must be a port (1-65535), not 0")
    port = free_port()
    assert _parse_error(capsys, ["--role", "pd", "--port", str(port),
                                 "--disaggregation-bootstrap-port", str(port + 2)]) == (
        "error: port: --role pd runs its decode server on --port + 2, and it is "
        "--disaggregation-bootstrap-port")
    with socket.socket() as held:
        for _ in range(50):        # a free port whose next one this test can hold
            port = free_port()
            try:
                held.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
        held.listen()
        line = _parse_error(capsys, ["--role", "pd", "--port", str(port),
                                     "--disaggregation-bootstrap-port", str(free_port())])
    assert line.startswith(f"error: port: cannot listen on 127.0.0.1:{port + 1}"), line
    assert line.endswith("(--role pd runs its prefill server on --port + 1)"), line
