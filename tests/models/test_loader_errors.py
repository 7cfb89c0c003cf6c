"""Missing or malformed config and weight files raise ValueError naming the file and tensor."""

import json
import os
import shutil

import pytest

from pdjax.models.loader import load_model


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_config(tiny_checkpoints, tmp_path):
    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(ValueError, match=r"config\.json: file not found"):
        load_model(str(d), progress=False)


def test_malformed_config(tiny_checkpoints, tmp_path):
    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: malformed JSON"):
        load_model(str(d), progress=False)
    cfg = json.loads(open(os.path.join(tiny_checkpoints["qwen3"], "config.json")).read())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: missing field 'hidden_size'"):
        load_model(str(d), progress=False)


def test_missing_tensor(tiny_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"ckpt: missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_model(str(d), progress=False)


def test_missing_and_corrupt_shard(tiny_checkpoints, tmp_path):
    d = _copy(tiny_checkpoints["llama"], tmp_path)
    (d / "model-00002-of-00006.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"model-00002-of-00006\.safetensors: cannot read"):
        load_model(str(d), progress=False)
    os.remove(d / "model-00002-of-00006.safetensors")
    with pytest.raises(ValueError, match=r"model-00002-of-00006\.safetensors: file not found"):
        load_model(str(d), progress=False)


def test_wrong_tensor_shape(tiny_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:5]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        load_model(str(d), progress=False)


def test_bad_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match=r"broken\.gguf: cannot read GGUF"):
        load_model(str(bad), progress=False)
    with pytest.raises(ValueError, match=r"nope\.gguf: model path not found"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)


def test_unsupported_architecture(tiny_checkpoints, tmp_path):
    d = _copy(tiny_checkpoints["qwen3"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture 'MambaForCausalLM' is not supported"):
        load_model(str(d), progress=False)
