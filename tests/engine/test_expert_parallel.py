"""``--ep-size`` / ``--moe-a2a-backend`` through ``pdjax.Engine`` and the serve flags: tiny
DeepSeek-V3.2 and GLM-5 (float32 and FP8 weights) with their routed experts split by expert
over the simulated CPU devices (conftest: 4) give transformers' greedy tokens (tie-aware) and
TP 1's; each device reads only its own experts' FP8 bytes; a layout that cannot work is one
``error: FIELD: ...`` line at parse time.

The tiny checkpoints have 4 attention heads, so TP 8 runs 8-head copies of them, made here,
in a child process with 8 simulated devices (``eight_devices.py``)."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers

import make_tiny_checkpoint as mk
from eight_devices import generate_on_eight_devices
from model_utils import (assert_speculation_keeps_tokens, assert_tokens_match, hf_greedy,
                         top2_gaps)
from pdjax.engine.offline import Engine
from pdjax.models.fp8 import LazyStack
from pdjax.models.loader import load_model, make_mesh
from pdjax.serve import parse_args

NEW = 8


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in (5, 13, 21)]


_ENGINE = dict(dtype="float32", page_size=8, max_total_tokens=512, max_running_requests=4,
               chunked_prefill_size=16, context_length=32, progress=False)


def _generate(path, prompts, **kwargs):
    """Greedy outputs of an engine over ``path``; prompt + output stay under index_topk (32),
    so the DSA indexer's ties at 0 cannot select differently (test_fp8.py's setting)."""
    eng = Engine(path, **_ENGINE, **kwargs)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs]


def _check(outs, hf, prompts, what, tp1=None):
    compared = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, logits = hf_greedy(hf, p, NEW, eos_token_id=None, pad_token_id=0)
        gaps = top2_gaps(logits)
        compared += assert_tokens_match(out, ref, gaps, what=f"{what} vs transformers")
        if tp1 is not None:
            assert_tokens_match(out, tp1[i], gaps, what=f"{what} vs TP 1")
    assert compared >= 3 * NEW // 2, f"{what}: only {compared} positions compared"


@pytest.fixture(scope="module")
def oracles(tiny_checkpoints, tmp_path_factory):
    """name -> transformers model (FP8 checkpoints: their weights dequantized to float32)."""
    root = tmp_path_factory.mktemp("dequantized")
    out = {}
    for name in ("deepseek_v32", "glm_moe_dsa", "deepseek_v32_fp8", "glm_moe_dsa_fp8"):
        path = tiny_checkpoints[name]
        if name.endswith("_fp8"):
            path = mk.write_dequantized(path, str(root / name))
        out[name] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
    return out


@pytest.mark.slow
def test_ep4_ragged_matches_transformers_and_tp1(tiny_checkpoints, oracles):
    """DeepSeek-V3.2 at TP 4, EP 4, ragged dispatch (its padded CPU stand-in), against
    transformers and TP 1 (slow: two engines compile, about 100 s cold; the fast tier's EP
    checks are the layer's, tests/models/test_moe_ep.py)."""
    prompts = _prompts()
    path = tiny_checkpoints["deepseek_v32"]
    tp1 = _generate(path, prompts)
    _check(_generate(path, prompts, tp_size=4, ep_size=4, moe_a2a_backend="ragged"),
           oracles["deepseek_v32"], prompts, "deepseek_v32 tp4 ep4 ragged", tp1)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,ep,backend", [
    ("deepseek_v32", 4, 2, "none"),          # ep < tp: each expert over 2 devices
    ("deepseek_v32", 4, 4, "none"),
    ("glm_moe_dsa", 4, 4, "ragged"),
    ("glm_moe_dsa", 4, 2, "ragged"),
    ("glm_moe_dsa", 2, 2, "none"),
    ("deepseek_v32_fp8", 2, 2, "ragged"),    # FP8: TP 4 would cut the dense layers' blocks
    ("glm_moe_dsa_fp8", 2, 2, "none"),
])
def test_ep_matches_transformers_and_tp1(tiny_checkpoints, oracles, name, tp, ep, backend):
    prompts = _prompts(tp + ep)
    path = tiny_checkpoints[name]
    tp1 = _generate(path, prompts)
    _check(_generate(path, prompts, tp_size=tp, ep_size=ep, moe_a2a_backend=backend),
           oracles[name], prompts, f"{name} tp{tp} ep{ep} {backend}", tp1)


@pytest.mark.parametrize("ep,expect", [
    # EP 2 on TP 2: device b holds experts [4b, 4b + 4), whole width.
    (2, {"gate_up": [(0, 4), (0, 4), (4, 8), (4, 8)], "down": [(0, 4), (4, 8)]}),
])
def test_each_device_reads_only_its_experts(tiny_checkpoints, monkeypatch, ep, expect):
    """The FP8 expert stacks [2 layers, 8 experts, ...] are read by expert, half per device,
    never whole (plain TP reads them by width: test_fp8.py)."""
    reads = {"gate_up": [], "down": []}
    original = LazyStack.__getitem__

    def spy(self, index):
        if self.shape in ((2, 8, 192, 256), (2, 8, 256, 192)):
            kind = "gate_up" if self.shape[-1] == 256 else "down"
            assert index[-1] == slice(None) and index[-2] == slice(None), index
            reads[kind].append((index[1].start or 0, index[1].stop))
        return original(self, index)

    monkeypatch.setattr(LazyStack, "__getitem__", spy)
    _, model = load_model(tiny_checkpoints["deepseek_v32_fp8"], dtype="float32",
                          progress=False, mesh=make_mesh(2), ep_size=ep)
    assert {k: sorted(v) for k, v in reads.items()} == expect
    q = model.moe.w_gate[...]
    assert q.shape == (2, 8, 192, 256)
    assert [s.data.shape for s in q.addressable_shards] == [(2, 4, 192, 256)] * 2


def test_ep_below_tp_lays_out_expert_slices(tiny_checkpoints):
    """EP 2 on TP 4: the stacks are [2 layers, 2 x 8 entries, ...] (entry t * 8 + e =
    expert e's width slice t), each device 4 entries: experts of one EP rank, one slice."""
    _, model = load_model(tiny_checkpoints["deepseek_v32"], dtype="float32", progress=False,
                          mesh=make_mesh(4), ep_size=2)
    assert model.moe.w_gate[...].shape == (2, 16, 64, 16)
    assert model.moe.w_down[...].shape == (2, 16, 16, 64)
    shards = model.moe.w_gate[...].addressable_shards
    assert [s.data.shape for s in shards] == [(2, 4, 64, 16)] * 4


@pytest.mark.slow
def test_mtp_speculation_under_ep(tiny_checkpoints, oracles):
    """The MTP layer's MoE runs EP too (its stacks re-laid like the main layers'): at TP 2,
    EP 2, ragged, speculating keeps the tokens of not speculating, which are transformers'."""
    prompts = _prompts(5)
    eng = Engine(tiny_checkpoints["deepseek_v32"], dtype="float32", page_size=8,
                 max_total_tokens=512, max_running_requests=4, chunked_prefill_size=16,
                 context_length=32, progress=False, tp_size=2, ep_size=2,
                 moe_a2a_backend="ragged", speculative_algorithm="mtp",
                 speculative_num_draft_tokens=3, speculative_disable_adaptive=True)
    try:
        params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
        out, _ = assert_speculation_keeps_tokens(eng, prompts, params, "mtp under ep 2")
    finally:
        eng.shutdown()
    _check([o["output_ids"] for o in out], oracles["deepseek_v32"], prompts, "mtp ep 2")


@pytest.mark.slow
@pytest.mark.parametrize("name,layouts", [
    ("deepseek_v32", [[8, 8, "none"], [8, 2, "ragged"]]),
    ("glm_moe_dsa", [[8, 8, "ragged"], [8, 4, "none"]]),
])
def test_tp8_on_eight_devices(tmp_path_factory, name, layouts):
    """TP 8 with EP 8 and EP below TP, on 8-head copies of the tiny checkpoints (same
    experts, routing and MLA widths), against transformers and TP 1."""
    cls, overrides, save = mk.CONFIGS[name]
    heads8 = f"{name}_heads8"
    mk.CONFIGS[heads8] = (cls, dict(overrides, num_attention_heads=8, num_key_value_heads=8),
                          save)
    try:
        path = mk.make_checkpoint(heads8, str(tmp_path_factory.mktemp("heads8")))
    finally:
        del mk.CONFIGS[heads8]
    prompts = _prompts(8)
    outs = generate_on_eight_devices(path, {
        f"{tp},{ep},{backend}": dict(_ENGINE, tp_size=tp, ep_size=ep, moe_a2a_backend=backend)
        for tp, ep, backend in [[1, 1, "none"], *layouts]}, prompts, NEW)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tp1 = outs.pop("1,1,none")
    for layout, got in outs.items():
        _check(got, hf, prompts, f"{heads8} tp,ep,backend {layout}", tp1)


# --------------------------------------------------------------------------- parse time

def _parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def _six_experts(src, tmp_path):
    dst = tmp_path / "six_experts"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(n_routed_experts=6, n_group=2, topk_group=1)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_layouts_that_cannot_work_fail_at_parse(capsys, tiny_checkpoints, tmp_path):
    ds = tiny_checkpoints["deepseek_v32"]
    cases = [
        (["--model-path", ds, "--tp-size", "4", "--ep-size", "3"],
         "error: ep_size: 3 must divide tp_size (4)"),
        (["--model-path", _six_experts(ds, tmp_path), "--load-format", "dummy",
          "--tp-size", "4", "--ep-size", "4"],
         "error: ep_size: 4 must divide n_routed_experts (6)"),
        (["--model-path", tiny_checkpoints["llama"], "--tp-size", "2", "--ep-size", "2"],
         "error: ep_size: llama models have no routed experts"),
        (["--model-path", ds, "--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "x"],
         "error: moe_a2a_backend: invalid choice: 'x'"),
        (["--model-path", tiny_checkpoints["deepseek_v32_fp8"], "--tp-size", "4",
          "--ep-size", "2"], "error: tp_size: 4 cuts the FP8 scale blocks"),
    ]
    for argv, line in cases:
        assert _parse_error(capsys, argv).startswith(line), argv


def test_a_working_layout_parses(tiny_checkpoints):
    args = parse_args(["--port", "0", "--model-path", tiny_checkpoints["glm_moe_dsa"],
                       "--tp-size", "4", "--ep-size", "2", "--moe-a2a-backend", "ragged"])
    assert (args.tp_size, args.ep_size, args.moe_a2a_backend) == (4, 2, "ragged")


def test_engine_takes_the_same_names(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"^ep_size: 3 must divide tp_size \(4\)"):
        Engine(tiny_checkpoints["deepseek_v32"], tp_size=4, ep_size=3, progress=False)
    with pytest.raises(ValueError, match=r"^ep_size: llama models have no routed experts"):
        Engine(tiny_checkpoints["llama"], tp_size=2, ep_size=2, progress=False)


# --------------------------------------------------------------------------- pdjax.aot

def test_aot_takes_ep_size(capsys):
    """``pdjax.aot`` builds the EP model (its expert stacks split by expert over ``tp``) and
    refuses a layout that cannot work in one line, before any target is made."""
    import jax
    from jax.sharding import PartitionSpec as P

    from pdjax.aot.__main__ import main as aot_main
    from pdjax.aot.engine import AbstractEngine
    from pdjax.aot.targets import Target
    from pdjax.config import ServerArgs

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tiny = os.path.join(root, "pdjax", "aot", "configs", "tiny-deepseek-v3.2")
    assert aot_main(["--topology", "v5e:2x2", "--model-path", tiny, "--tp-size", "4",
                     "--ep-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ep_size: 3 must divide tp_size (4)") and err.count("\n") == 1
    target = Target("cpu", "cpu", tuple(jax.devices("cpu")), "cpu", 1 << 30)
    args = ServerArgs(model_path=tiny, tp_size=4, ep_size=2, moe_a2a_backend="ragged",
                      max_total_tokens=512, context_length=128, chunked_prefill_size=64,
                      max_running_requests=4, attention_backend="xla", dtype="float32",
                      load_format="dummy", grammar_backend="none")
    engine = AbstractEngine(args, target)
    assert (engine.model_cfg.ep_size, engine.model_cfg.moe_tp_size,
            engine.model_cfg.moe_a2a_backend) == (2, 2, "ragged")
    w = engine.state["moe"]["w_gate"].get_value()
    assert w.shape == (2, 16, 64, 16) and w.sharding.spec == P(None, "tp", None, None)


@pytest.mark.parametrize("ep", [2, 4])
def test_orbax_checkpoint_loads_under_ep(tiny_checkpoints, tmp_path, ep):
    """A pdjax Orbax checkpoint (saved in the HF expert order) restores through the host into
    the EP layout: every expert stack equals the one loaded from the HF folder."""
    from pdjax.convert import convert

    src = tiny_checkpoints["deepseek_v32"]
    dst = convert(src, str(tmp_path / "ckpt"), progress=False)
    _, from_hf = load_model(src, dtype="float32", progress=False, mesh=make_mesh(4),
                            ep_size=ep)
    _, from_orbax = load_model(dst, dtype="float32", progress=False, mesh=make_mesh(4),
                               ep_size=ep)
    for name in ("w_gate", "w_up", "w_down"):
        a, b = getattr(from_hf.moe, name)[...], getattr(from_orbax.moe, name)[...]
        assert a.shape == b.shape and a.shape[1] == 8 * (4 // ep)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
