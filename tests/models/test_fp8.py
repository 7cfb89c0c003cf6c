"""FP8 block-scaled checkpoints (DeepSeek-V3.2 with ue8m0 scales, GLM-5): the safetensors
reader, block (de)quantization, weights kept FP8 on the devices, greedy parity with
transformers on the same weights dequantized to float32 (colocated and TP 2), and every bad
input a clear error before anything is placed on a device."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import make_tiny_checkpoint as mk
from model_utils import assert_tokens_match, hf_greedy, top2_gaps
from pdjax.engine.offline import Engine
from pdjax.models.checkpoint import read_safetensors_lazy
from pdjax.models.deepseek import DeepseekForCausalLM
from pdjax.models.deepseek_weights import param_partition_specs
from pdjax.models.fp8 import FP8_DTYPE, LazyStack, dequantize, quantize
from pdjax.models.loader import checkpoint_config, load_model, make_mesh
from pdjax.models.params import abstract_params
from pdjax.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_NAMES = ("deepseek_v32_fp8", "glm_moe_dsa_fp8")
NEW = 8


# --------------------------------------------------------------------------- reader

def test_lazy_reader_views_fp8_bf16_and_f32_without_copying(tmp_path):
    rng = np.random.default_rng(0)
    q, scale = quantize(rng.standard_normal((192, 200)).astype(np.float32))
    tensors = {"a.weight": q, "a.weight_scale_inv": scale,
               "b": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
               "c": np.arange(7, dtype=np.float32)}
    mk.write_safetensors(str(tmp_path / "m.safetensors"), tensors)
    got = read_safetensors_lazy(str(tmp_path / "m.safetensors"))
    assert set(got) == set(tensors)
    for key, want in tensors.items():
        assert got[key].dtype == want.dtype and got[key].shape == want.shape
        assert np.array_equal(got[key].view(np.uint8), want.view(np.uint8))
        assert isinstance(got[key].base, np.memmap) or isinstance(got[key], np.memmap)
        assert not got[key].flags.writeable
    assert got["a.weight"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_lazy_reader_refuses_a_bad_file(tmp_path):
    file = tmp_path / "m.safetensors"
    mk.write_safetensors(str(file), {"x": np.ones((4, 4), np.float32)})
    raw = file.read_bytes()
    file.write_bytes(raw[:-8])                       # the data is cut short
    with pytest.raises(ValueError, match=r"tensor 'x': data_offsets \[0, 64\] do not hold"):
        read_safetensors_lazy(str(file))
    file.write_bytes(b"\xff" * 8 + raw[8:])          # a header length past the file
    with pytest.raises(ValueError, match="cannot read safetensors"):
        read_safetensors_lazy(str(file))


def test_quantize_partial_blocks_and_ue8m0():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((192, 200)).astype(np.float32) * 3
    for ue8m0 in (False, True):
        q, scale = quantize(w, ue8m0=ue8m0)
        assert q.dtype == FP8_DTYPE and q.shape == (192, 200) and scale.shape == (2, 2)
        back = dequantize(q, scale)
        # e4m3 keeps 3 mantissa bits (a relative error of at most 2^-4 per value); below
        # 2^-6 it is subnormal, in steps of 2^-9 (times the block's scale).
        step = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:192, :200] * 2.0 ** -10
        assert np.all(np.abs(back - w) <= np.abs(w) * 2.0 ** -4 + step)
        # The edge block [128:, 128:] (64 x 72) has its own scale from its own values.
        amax = np.abs(w[128:, 128:]).max()
        assert scale[1, 1] >= amax / 448 and (not ue8m0 or scale[1, 1] < 2 * amax / 448)
        if ue8m0:
            assert np.all(np.frexp(scale)[0] == 0.5)


def test_lazy_stack_indexes_like_np_stack():
    parts = [np.arange(12, dtype=np.float32).reshape(3, 4) + 100 * i for i in range(5)]
    lazy, full = LazyStack([p.T for p in parts]), np.stack([p.T for p in parts])
    assert lazy.shape == full.shape == (5, 4, 3) and lazy.nbytes == full.nbytes
    for index in [(slice(None), slice(0, 2), slice(None)), (slice(1, 4), slice(2, 4), slice(1, 3)),
                  (2,), Ellipsis]:
        assert np.array_equal(lazy[index], full[index])
    nested = LazyStack([LazyStack([p, p + 1]) for p in parts])
    assert np.array_equal(nested[1:3, 1, :, 2:], np.stack([np.stack([p, p + 1]) for p in parts])[1:3, 1, :, 2:])


# --------------------------------------------------------------------------- on the devices

def _param_bytes_per_device(model) -> int:
    _, state = nnx.split(model)
    return sum(v.get_value().addressable_shards[0].data.nbytes
               for _, v in nnx.to_flat_state(state))


@pytest.mark.parametrize("name", FP8_NAMES)
def test_weights_stay_fp8_at_about_half_the_bf16_bytes(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    cfg, model = load_model(path, dtype="bfloat16", progress=False, mesh=make_mesh(2))
    assert isinstance(model, DeepseekForCausalLM) and cfg.weight_block_size == 128
    assert cfg.scale_fmt == ("ue8m0" if name == "deepseek_v32_fp8" else None)
    for group, names in (("attn", ("w_qa", "w_qb", "w_kva", "w_o")),
                         ("dense", ("w_gate", "w_up", "w_down")),
                         ("moe", ("w_gate", "w_up", "w_down", "sh_gate", "sh_up", "sh_down")),
                         ("indexer", ("wq_b", "wk"))):
        for n in names:
            w, s = getattr(getattr(model, group), n)[...], getattr(getattr(model, group),
                                                                     n + "_scale_inv")[...]
            assert w.dtype == FP8_DTYPE and s.dtype == np.float32
            assert s.shape[-2:] == tuple(-(-d // 128) for d in w.shape[-2:])
    assert model.moe.w_gate[...].shape == (2, 8, 192, 256)
    # TP 2 splits the expert width: each device holds 128 of the 256 columns and 1 of 2 blocks.
    assert model.moe.w_gate[...].addressable_shards[0].data.shape == (2, 8, 192, 128)
    assert model.moe.w_gate_scale_inv[...].addressable_shards[0].data.shape == (2, 8, 2, 1)
    assert model.moe.router[...].dtype == np.float32
    assert model.embed_tokens[...].dtype == jax.numpy.bfloat16

    fp8_bytes = _param_bytes_per_device(model)
    twin = dataclasses.replace(cfg, weight_block_size=0)
    bf16 = abstract_params(lambda: DeepseekForCausalLM(twin, dtype=jax.numpy.bfloat16,
                                                       rngs=nnx.Rngs(0)))
    specs = param_partition_specs(twin, 2)
    bf16_bytes = sum(a.size * a.dtype.itemsize // (2 if "tp" in specs[k] else 1)
                     for k, a in bf16.items())
    assert 0.45 < fp8_bytes / bf16_bytes < 0.6, (fp8_bytes, bf16_bytes)


@pytest.fixture(scope="module")
def dequantized_oracles(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_twins")
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
                mk.write_dequantized(tiny_checkpoints[name], str(root / name)),
                dtype=torch.float32, attn_implementation="eager").eval()
            for name in FP8_NAMES}


@pytest.mark.slow      # an engine and transformers per case: a heavy model check
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", FP8_NAMES)
def test_engine_greedy_matches_transformers_on_dequantized_weights(
        tiny_checkpoints, dequantized_oracles, name, tp):
    """Prompt + output stay under index_topk (32): every cached token is selected, so the
    indexer's ties at 0 cannot pick differently."""
    hf = dequantized_oracles[name]
    rng = np.random.default_rng(tp)
    prompts = [rng.integers(5, 400, n).tolist() for n in (5, 13, 21)]
    # Few shapes to compile: one token bucket (the 21-token prompt is prefilled in 2 chunks)
    # and one pages-per-sequence bucket.
    eng = Engine(tiny_checkpoints[name], dtype="float32", tp_size=tp, page_size=8,
                 max_total_tokens=512, max_running_requests=4, chunked_prefill_size=16,
                 context_length=32, progress=False)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
    finally:
        eng.shutdown()
    compared = 0
    for p, out in zip(prompts, outs):
        ref, logits = hf_greedy(hf, p, NEW, eos_token_id=None, pad_token_id=0)
        compared += assert_tokens_match(out["output_ids"], ref, top2_gaps(logits),
                                        what=f"{name} tp{tp}")
    assert compared >= 3 * NEW // 2


# --------------------------------------------------------------------------- bad input

def _variant(src: str, dst, edit_tensors=None, edit_quant=None) -> str:
    """A copy of FP8 checkpoint ``src`` in ``dst`` with its tensors or quantization_config
    changed."""
    dst = str(dst)
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = {k: np.array(v) for k, v in
                   read_safetensors_lazy(os.path.join(src, "model.safetensors")).items()}
        edit_tensors(tensors)
        mk.write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    if edit_quant is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit_quant(cfg["quantization_config"])
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


W = "model.layers.1.mlp.experts.3.down_proj.weight"


def _bad_scale_shape(t):
    t[W + "_scale_inv"] = np.ones((2, 1), np.float32)


def _no_scale(t):
    del t[W + "_scale_inv"]


def _not_pow2(t):
    t[W + "_scale_inv"] = t[W + "_scale_inv"] * 1.5


def _unquantized(t):
    t[W] = t[W].astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("edit,words", [
    (_bad_scale_shape, f"tensor '{W}_scale_inv' has shape (2, 1), expected (2, 2): the "
                       f"128x128 blocks of '{W}' (192, 256)"),
    (_no_scale, f"missing tensor '{W}_scale_inv' (the block scales of the float8 '{W}')"),
    (_not_pow2, "scale_fmt 'ue8m0' needs powers of two"),
    (_unquantized, f"tensor '{W}' is bfloat16, expected float8_e4m3fn"),
])
def test_bad_tensors_are_clear_errors_before_any_device_array(tiny_checkpoints, tmp_path,
                                                              edit, words):
    path = _variant(tiny_checkpoints["deepseek_v32_fp8"], tmp_path / "bad", edit_tensors=edit)
    before = len(jax.live_arrays())
    with pytest.raises(ValueError) as e:
        load_model(path, dtype="float32", progress=False)
    assert words in str(e.value), str(e.value)
    assert len(jax.live_arrays()) == before


@pytest.mark.parametrize("edit,words", [
    (lambda q: q.update(quant_method="awq"),
     "quantization_config.quant_method: 'awq' is not supported (fp8 only)"),
    (lambda q: q.update(quant_method="gptq"),
     "quantization_config.quant_method: 'gptq' is not supported (fp8 only)"),
    (lambda q: q.update(weight_block_size=[64, 64]),
     "quantization_config.weight_block_size: [64, 64] is not supported ([128, 128] only)"),
    (lambda q: q.update(fmt="e5m2"), "quantization_config.fmt: 'e5m2' is not supported"),
    (lambda q: q.update(scale_fmt="e4m3"), "quantization_config.scale_fmt: 'e4m3'"),
])
def test_bad_quantization_config_is_refused_at_parse_time(tiny_checkpoints, tmp_path, edit,
                                                          words):
    path = _variant(tiny_checkpoints["glm_moe_dsa_fp8"], tmp_path / "bad", edit_quant=edit)
    with pytest.raises(ValueError, match="config.json: " + words.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        checkpoint_config(path)
    with pytest.raises(ValueError, match="quantization_config"):
        Engine(path, dtype="float32", progress=False)


@pytest.mark.slow          # starts a process (the fast tier starts none)
def test_serve_refuses_awq_in_one_line(tiny_checkpoints, tmp_path):
    path = _variant(tiny_checkpoints["glm_moe_dsa_fp8"], tmp_path / "awq",
                    edit_quant=lambda q: q.update(quant_method="awq"))
    proc = subprocess.run([sys.executable, "-m", "pdjax.serve", "--model-path", path, "--port",
                           str(free_port())], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"error: model_path: {path}/config.json: quantization_config.quant_method: 'awq' is "
            "not supported (fp8 only)") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_llama_with_a_quantization_config_is_refused(tiny_checkpoints, tmp_path):
    dst = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: FP8 weights are supported for "
                                         "DeepseekV3ForCausalLM"):
        checkpoint_config(str(dst))


def test_a_tp_size_that_cuts_a_block_is_refused_before_placing(tiny_checkpoints):
    """TP 4 splits the 256-wide q_b_proj output into shards of 64: half a 128-block each."""
    before = len(jax.live_arrays())
    with pytest.raises(ValueError, match=r"tp_size: 4 cuts the FP8 scale blocks of "
                                         r"self_attn.q_b_proj: its 256 output features split "
                                         r"into shards of 64, not a multiple of the 128-wide"):
        load_model(tiny_checkpoints["deepseek_v32_fp8"], dtype="float32", progress=False,
                   mesh=make_mesh(4))
    assert len(jax.live_arrays()) == before


def test_fp8_tensors_without_quantization_config_are_refused(tiny_checkpoints, tmp_path):
    dst = _variant(tiny_checkpoints["glm_moe_dsa_fp8"], tmp_path / "noq")
    cfg = json.loads(open(os.path.join(dst, "config.json")).read())
    del cfg["quantization_config"]
    open(os.path.join(dst, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="but config.json has no quantization_config"):
        load_model(dst, dtype="float32", progress=False)


def test_orbax_conversion_keeps_fp8_and_scales(tiny_checkpoints, tmp_path):
    """pdjax.convert writes the float8 bytes and their scales as they are; the Orbax
    checkpoint restores them, sharded, bit for bit."""
    from pdjax.convert import convert

    src = tiny_checkpoints["glm_moe_dsa_fp8"]
    dst = convert(src, str(tmp_path / "orbax"), progress=False)
    with open(os.path.join(dst, "pdjax_checkpoint.json")) as f:
        marker = json.load(f)["params"]
    assert marker["moe.w_down"] == [[2, 8, 256, 192], "float8_e4m3fn"]
    assert marker["moe.w_down_scale_inv"] == [[2, 8, 2, 2], "float32"]
    _, ours = load_model(src, dtype="float32", progress=False, mesh=make_mesh(2))
    _, back = load_model(dst, dtype="float32", progress=False, mesh=make_mesh(2))
    for group, name in (("moe", "w_down"), ("attn", "w_qb"), ("indexer", "wk")):
        for n in (name, name + "_scale_inv"):
            a, b = getattr(getattr(ours, group), n)[...], getattr(getattr(back, group), n)[...]
            assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_each_device_reads_only_its_shard(tiny_checkpoints, monkeypatch):
    """At TP 2 the routed experts' float8 stacks are read in halves, one per device, never
    whole: gate/up [2 layers, 8, 192, 256] by columns, down [2, 8, 256, 192] by rows."""
    reads = {"gate_up": [], "down": []}
    original = LazyStack.__getitem__

    def spy(self, index):
        if self.shape == (2, 8, 192, 256):
            reads["gate_up"].append((index[-1].start or 0, index[-1].stop))
        elif self.shape == (2, 8, 256, 192):
            reads["down"].append((index[-2].start or 0, index[-2].stop))
        return original(self, index)

    monkeypatch.setattr(LazyStack, "__getitem__", spy)
    load_model(tiny_checkpoints["deepseek_v32_fp8"], dtype="float32", progress=False,
               mesh=make_mesh(2))
    assert sorted(reads["gate_up"]) == [(0, 128), (0, 128), (128, 256), (128, 256)]
    assert sorted(reads["down"]) == [(0, 128), (128, 256)]
