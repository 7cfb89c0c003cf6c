"""Orbax checkpoints (``python -m pdjax.convert``): a converted model gives the same logits as
its source, restores shard by shard onto simulated devices, and bad checkpoints are named."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.model_config import ModelConfig
from pdjax.convert import convert, main
from pdjax.models.attention import AttentionMetadata
from model_utils import allocate_caches
from pdjax.models.checkpoint import default_model_path, read_gguf, read_gguf_config
from pdjax.models.loader import load_model, load_tokenizer, make_mesh
from pdjax.models.orbax_checkpoint import MARKER_FILE
from pdjax.sched.batch import BatchRow, build_flat_batch

PAGE = 4


@jax.jit
def _forward(model, input_ids, caches, md):
    hidden, _ = model.paged_forward(input_ids, caches, md)
    return model.compute_logits(hidden)


def _logits(model, prompts):
    """Logits ``[tokens, V]`` of every prompt token, the prompts as one prefill batch."""
    rows, nxt = [], 1
    for p in prompts:
        n = -(-len(p) // PAGE)
        rows.append(BatchRow(p, 0, list(range(nxt, nxt + n))))
        nxt += n
    fb = build_flat_batch(rows, page_size=PAGE, num_tokens_pad=64, num_rows_pad=4,
                          pages_per_seq_pad=8, num_logits_pad=4)
    md = AttentionMetadata(*(jnp.asarray(a) for a in (
        fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices,
        fb.distribution)))
    caches = allocate_caches(model.cache_spec(32, PAGE, jnp.float32))
    out = np.asarray(_forward(model, jnp.asarray(fb.input_ids), caches, md))
    return out[:sum(len(p) for p in prompts)]


PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 13], [300, 2, 77, 78, 79, 1, 400]]


@pytest.mark.parametrize("name", ["llama", "qwen2", "deepseek_v32"])
def test_round_trip_logits_equal_the_source(tiny_checkpoints, tmp_path, name):
    src = tiny_checkpoints[name]
    dst = convert(src, str(tmp_path / "ckpt"), progress=False)
    assert os.path.isfile(os.path.join(dst, MARKER_FILE))
    cfg_src, model_src = load_model(src, dtype="float32", progress=False)
    cfg_dst, model_dst = load_model(dst, dtype="float32", progress=False)
    assert cfg_dst == cfg_src
    a, b = _logits(model_src, PROMPTS), _logits(model_dst, PROMPTS)
    assert a.shape == (16, cfg_src.vocab_size)
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    text = "Prefill computes the prompt."
    assert load_tokenizer(dst).encode(text) == load_tokenizer(src).encode(text)


@pytest.mark.slow      # converts the default model (SmolLM2): a heavy model check
def test_default_gguf_round_trip(tmp_path):
    """SmolLM2 from its Q4_1 GGUF: convert (dequantized once) and load give the same logits,
    and the written config.json reads back as the GGUF's own config."""
    dst = str(tmp_path / "smollm2")
    assert main(["--default", dst]) == 0
    gguf_cfg, _ = read_gguf(default_model_path(), progress=False)
    assert ModelConfig.from_hf_dir(dst) == gguf_cfg
    assert read_gguf_config(default_model_path()) == gguf_cfg     # metadata alone, same config
    _, model_src = load_model(None, dtype="float32", progress=False)
    _, model_dst = load_model(dst, dtype="float32", progress=False)
    prompt = load_tokenizer(dst).encode("The capital of France is")
    np.testing.assert_allclose(_logits(model_dst, [prompt]), _logits(model_src, [prompt]),
                               atol=1e-6, rtol=0)


def test_sharded_restore_puts_each_shard_on_its_own_device(tiny_checkpoints, tmp_path,
                                                          monkeypatch):
    src = tiny_checkpoints["llama"]           # 4 heads, 2 KV heads: TP 2 needs no replication
    dst = convert(src, str(tmp_path / "ckpt"), progress=False)
    mesh = make_mesh(2)
    import pdjax.models.loader as loader_mod

    restored = {}
    real_restore = loader_mod.restore_params
    monkeypatch.setattr(loader_mod, "restore_params",
                        lambda *a, **k: restored.setdefault("params", real_restore(*a, **k)))
    # With the engine's kernel choice (the config carries it, as the layout): still sharded.
    cfg, model = load_model(dst, dtype="float32", mesh=mesh, progress=False,
                            attention_impl="xla")
    assert cfg.attention_impl == model.cfg.attention_impl == "xla"
    # The model holds the very arrays Orbax restored onto the devices (no trip via the host).
    assert model.layers.wq[...] is restored["params"]["layers.wq"]
    assert model.lm_head[...] is restored["params"]["lm_head"]
    wq = model.layers.wq[...]
    full = wq.shape
    shards = wq.addressable_shards
    assert sorted(s.device.id for s in shards) == [d.id for d in mesh.devices.flat]
    assert all(s.data.shape == (full[0], full[1], full[2] // 2) for s in shards)
    embed = model.embed_tokens[...]
    assert all(s.data.shape == embed.shape for s in embed.addressable_shards)   # replicated
    _, model_tp1 = load_model(src, dtype="float32", progress=False)
    np.testing.assert_allclose(_logits(model, PROMPTS), _logits(model_tp1, PROMPTS),
                               atol=1e-4, rtol=0)


def test_restore_with_kv_head_replication(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama_tied"]      # 1 KV head: TP 2 replicates it
    dst = convert(src, str(tmp_path / "ckpt"), progress=False)
    cfg_dst, model_dst = load_model(dst, dtype="float32", mesh=make_mesh(2), progress=False)
    cfg_src, model_src = load_model(src, dtype="float32", mesh=make_mesh(2), progress=False)
    assert cfg_dst == cfg_src and cfg_dst.num_kv_heads == 2
    np.testing.assert_allclose(_logits(model_dst, PROMPTS), _logits(model_src, PROMPTS),
                               atol=1e-6, rtol=0)


def test_restore_casts_to_the_requested_dtype(tiny_checkpoints, tmp_path):
    dst = convert(tiny_checkpoints["llama"], str(tmp_path / "ckpt"), progress=False)
    _, model = load_model(dst, dtype="bfloat16", progress=False)
    assert model.layers.wq[...].dtype == jnp.bfloat16


def test_bad_checkpoints_are_named(tiny_checkpoints, tmp_path):
    dst = convert(tiny_checkpoints["llama"], str(tmp_path / "ckpt"), progress=False)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        convert(tiny_checkpoints["llama"], dst, progress=False)
    marker_path = os.path.join(dst, MARKER_FILE)
    with open(marker_path) as f:
        marker = json.load(f)
    with open(marker_path, "w") as f:
        json.dump(dict(marker, version=99), f)
    with pytest.raises(ValueError, match="'version' 99 is not supported"):
        load_model(dst, progress=False)
    shape = marker["params"]["layers.wq"][0]
    marker["params"]["layers.wq"][0] = [shape[0], shape[1], shape[2] + 1]
    with open(marker_path, "w") as f:
        json.dump(marker, f)
    with pytest.raises(ValueError, match=r"parameter 'layers.wq' has shape"):
        load_model(dst, progress=False)
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_hf_config_dict_round_trip(tiny_checkpoints, name):
    cfg = ModelConfig.from_hf_dir(tiny_checkpoints[name])
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_help_describes_the_command_in_a_whole_sentence(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "write a pdjax Orbax checkpoint from any model pdjax loads (an HF safetensors " \
           "folder or a GGUF file;" in text and "for the default SmolLM2 model)." in text
