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
    with pytest.raises(ValueError, match="architecture: 'MambaForCausalLM' is not supported"):
        load_model(str(d), progress=False)


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings", "bos_token_id",
               "eos_token_id")
_MLA_INT_FIELDS = ("moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                   "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                   "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace",
                   "num_nextn_predict_layers")


def _bad_values(name):
    """(field, bad value, words of its error) for every config.json field family ``name``
    reads: each was int()/float()/bool() of the value, a ValueError without the field's name
    ("invalid literal for int() with base 10: 'big'") or a silent bool("false") == True."""
    cases = [(f, "big", f"{f}: expected an integer, got 'big'") for f in _INT_FIELDS]
    cases += [("hidden_size", 2.5, "hidden_size: expected an integer, got 2.5")]
    cases += [("eos_token_id", [2, "x"], "eos_token_id: expected an integer, got 'x'"),
              ("rms_norm_eps", "tiny", "rms_norm_eps: expected a number, got 'tiny'"),
              ("rope_theta", "1e4", "rope_theta: expected a number, got '1e4'"),
              ("tie_word_embeddings", "false", "tie_word_embeddings: expected true or false"),
              ("architectures", "LlamaForCausalLM", "architectures: expected a list of names"),
              ("rope_parameters", 5, "rope_parameters: expected an object, got 5"),
              ("rope_parameters.factor", "8", "rope_scaling.factor: expected a number, got '8'"),
              ("rope_parameters.factor", None, "rope_scaling.factor: required by rope_type")]
    if name == "llama":
        cases += [(f, "big", f"{f}: expected an integer, got 'big'")
                  for f in ("num_key_value_heads", "head_dim")]
        cases += [("head_dim", 2.5, "head_dim: expected an integer, got 2.5"),
                  ("attention_bias", "no", "attention_bias: expected true or false")]
    else:
        cases += [(f, "big", f"{f}: expected an integer, got 'big'") for f in _MLA_INT_FIELDS]
        cases += [("routed_scaling_factor", "x", "routed_scaling_factor: expected a number"),
                  ("norm_topk_prob", 1, "norm_topk_prob: expected true or false, got 1"),
                  ("rope_interleave", "yes", "rope_interleave: expected true or false"),
                  ("mlp_layer_types", "dense", "mlp_layer_types: expected a list of strings")]
    return cases


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_a_wrongly_typed_config_value_is_named(tiny_checkpoints, tmp_path, name):
    """Every config.json field the model config reads names itself when its value has the wrong
    type: 'config.json: hidden_size: expected an integer, got 'big'' (it was int()'s message
    without the field, or no error for bool("false"))."""
    from pdjax.models.loader import checkpoint_config

    good = json.loads(open(os.path.join(tiny_checkpoints[name], "config.json")).read())
    if name == "llama":
        good["architectures"] = ["LlamaForCausalLM"]
    for field, value, words in _bad_values(name):
        cfg = json.loads(json.dumps(good))
        if field.startswith("rope_parameters."):
            cfg["rope_parameters"][field.split(".")[1]] = value
        elif field == "rope_theta":
            cfg["rope_parameters"]["rope_theta"] = value
        else:
            cfg[field] = value
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as e:
            checkpoint_config(str(tmp_path))
        msg = str(e.value)
        assert msg.startswith(str(tmp_path / "config.json")) and words in msg, (field, msg)


def test_an_unreadable_config_is_named(tiny_checkpoints, tmp_path, monkeypatch):
    """An OSError opening config.json (permissions, I/O) was a traceback at parse time."""
    from pdjax import model_config
    from pdjax.models.loader import checkpoint_config

    d = _copy(tiny_checkpoints["qwen3"], tmp_path)

    def unreadable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(model_config, "open", unreadable, raising=False)
    with pytest.raises(ValueError, match=r"ckpt/config\.json: cannot read \(Permission denied\)"):
        checkpoint_config(str(d))


def _gguf(path, **fields):
    """A GGUF file of llama metadata ``fields`` (name with '.' as '__') and one tensor."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_wrongly_typed_or_missing_gguf_field_is_named(tmp_path):
    """GGUF metadata is the config of a .gguf checkpoint: a field of the wrong type was int()'s
    message without its name ("invalid literal for int() with base 10: 'big'")."""
    from pdjax.models.loader import checkpoint_config

    good = dict(llama__attention__head_count=2, llama__embedding_length=8,
                llama__vocab_size=8, llama__feed_forward_length=16, llama__block_count=1,
                llama__attention__layer_norm_rms_epsilon=1e-5, llama__context_length=64)
    assert checkpoint_config(_gguf(tmp_path / "good.gguf", **good)).max_position_embeddings == 64
    path = _gguf(tmp_path / "bad.gguf", **{**good, "llama__context_length": "big"})
    with pytest.raises(ValueError, match=r"bad\.gguf: llama\.context_length: expected an "
                                         r"integer, got 'big'"):
        checkpoint_config(path)
    del good["llama__block_count"]
    path = _gguf(tmp_path / "short.gguf", **good)
    with pytest.raises(ValueError, match=r"short\.gguf: missing GGUF field 'llama\.block_count'"):
        checkpoint_config(path)
