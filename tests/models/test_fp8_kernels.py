"""The FP8 tiny models and the MoE with the Pallas GEMM kernels (interpreted on CPU): the
grouped GEMM under ``grouped_swiglu`` (bf16 and FP8 experts, one device and TP 2), the
block-scaled GEMM under ``linear``, and the whole model's logits against the reference path."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernel_cases import interpret_mode, kernel_device
from mla_utils import PAGE, new_caches, prompts, run_rows
from model_utils import assign_pages
from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import dequantize, quantize
from pdjax.models.linear import Fp8BlockWeight, linear, with_fp8_kernel
from pdjax.models.loader import load_model, make_mesh
from pdjax.models.moe import grouped_swiglu
from pdjax.sched.batch import BatchRow

pytestmark = [pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.slow]   # interpret-mode kernels inside the model

E, H, F = 4, 256, 256
SIZES = [5, 0, 9, 2]          # 16 routed rows of 19: 3 rows in no expert


def _experts(seed, fp8):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal((E, a, b)).astype(np.float32) * 0.1
          for a, b in ((H, F), (H, F), (F, H))]
    if not fp8:
        return [jnp.asarray(w) for w in ws], ws
    out, deq = [], []
    for w in ws:
        pairs = [quantize(w[e], ue8m0=True) for e in range(E)]
        out.append(Fp8BlockWeight(jnp.asarray(np.stack([p[0] for p in pairs])),
                                  jnp.asarray(np.stack([p[1] for p in pairs]))))
        deq.append(np.stack([dequantize(*p) for p in pairs]))
    return out, deq


def _kernel_cfg(tiny_checkpoints, impl, interpret=False) -> DeepseekConfig:
    """A tiny MLA config that runs ``impl``'s kernels (the grouped GEMM reads its choice
    from the run config)."""
    cfg = DeepseekConfig.from_hf_dir(tiny_checkpoints["deepseek_v32"])
    return dataclasses.replace(cfg, attention_impl=impl, pallas_interpret=interpret)


def _numpy_swiglu(xs, ws, sizes):
    xs = np.asarray(xs, np.float64)
    out, start = np.zeros_like(xs), 0
    for e, n in enumerate(sizes):
        r = xs[start:start + n]
        g, u = r @ ws[0][e], r @ ws[1][e]
        out[start:start + n] = (g / (1 + np.exp(-g)) * u) @ ws[2][e]
        start += n
    return out


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_grouped_swiglu_kernel_matches_reference(tiny_checkpoints, impl, fp8):
    weights, dense = _experts(1, fp8)
    xs = jnp.asarray(np.random.default_rng(2).standard_normal((19, H)), jnp.float32)
    gs = jnp.asarray(SIZES, jnp.int32)
    with kernel_device(impl):
        out = grouped_swiglu(_kernel_cfg(tiny_checkpoints, impl, interpret_mode(impl)), xs, gs,
                             *weights)
        ref = grouped_swiglu(_kernel_cfg(tiny_checkpoints, "reference"), xs, gs, *weights)
    want = _numpy_swiglu(xs, dense, SIZES)
    assert np.abs(np.asarray(out) - want).max() < 1e-3 * (np.abs(want).max() + 1)
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() < 1e-3 * (np.abs(want).max() + 1)
    assert not np.asarray(out)[sum(SIZES):].any()


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_grouped_swiglu_kernel_at_tp2(tiny_checkpoints, fp8):
    """Weights split over F as param_groups lays them out: the kernel per shard, then psum."""
    weights, dense = _experts(3, fp8)
    mesh = make_mesh(2)
    split = lambda spec: NamedSharding(mesh, spec)                      # noqa: E731
    placed = [jax.device_put(w, split(s)) for w, s in
              zip(weights, (P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None)))]
    xs = jnp.asarray(np.random.default_rng(4).standard_normal((19, H)), jnp.float32)
    gs = jnp.asarray(SIZES, jnp.int32)
    cfg = _kernel_cfg(tiny_checkpoints, "tpu", True)
    f = jax.jit(lambda *a: grouped_swiglu(cfg, *a))
    with jax.set_mesh(mesh):
        out = f(xs, gs, *placed)
        text = f.lower(xs, gs, *placed).as_text(debug_info=True)
    assert "grouped_matmul_tpu" in text and "all_reduce" in text and "shard_map" in text
    want = _numpy_swiglu(xs, dense, SIZES)
    assert np.abs(np.asarray(out) - want).max() < 1e-3 * (np.abs(want).max() + 1)


@pytest.mark.parametrize("tp_dim,spec", [(-1, P(None, "tp")), (-2, P("tp", None)),
                                         (None, P())])
def test_fp8_linear_kernel_per_tp_shard(tp_dim, spec):
    """linear() on a kernel-marked Fp8BlockWeight, column- and row-parallel at TP 2 and
    replicated, equals x @ the dequantized weight."""
    rng = np.random.default_rng(5)
    q, s = quantize(rng.standard_normal((256, 512)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((3, 7, 256)), jnp.float32)
    mesh = make_mesh(2)
    w = Fp8BlockWeight(jax.device_put(jnp.asarray(q), NamedSharding(mesh, spec)),
                       jax.device_put(jnp.asarray(s), NamedSharding(mesh, spec)))
    w = with_fp8_kernel({"g": {"w": w}}, {"g": (1, {"w": ((256, 512), spec)})}, "tpu",
                        interpret=True)["g"]["w"]
    assert (w.impl, w.tp_dim, w.interpret) == ("tpu", tp_dim, True)
    with jax.set_mesh(mesh):
        out = jax.jit(linear)(x, w)
    want = np.asarray(x, np.float64) @ dequantize(q, s)
    assert out.shape == (3, 7, 512)
    assert np.abs(np.asarray(out) - want).max() < 1e-3


@pytest.mark.parametrize("name,impl", [("deepseek_v32_fp8", "tpu"), ("glm_moe_dsa_fp8", "gpu")])
def test_fp8_model_with_gemm_kernels_matches_reference(tiny_checkpoints, name, impl):
    """The FP8 tiny model with the attention, grouped GEMM and FP8 GEMM kernels (interpreted)
    gives the reference path's logits (whose greedy tokens test_fp8 checks against
    transformers), on a prefill and a decode step; the lowered forward holds both GEMMs."""
    path = tiny_checkpoints[name]
    _, ref_model = load_model(path, dtype="float32", progress=False)
    _, model = load_model(path, dtype="float32", progress=False, attention_impl=impl,
                          pallas_interpret=True)
    from pdjax.pallas_kernels.lanes import kv_row_align
    prompt = prompts(3, (13,))[0]
    pages = assign_pages([len(prompt) + 1], PAGE, 64, seed=1)[0]
    out = []
    for m, align in ((ref_model, 1), (model, kv_row_align(impl))):
        caches = new_caches(m, row_align=align)
        got, caches = run_rows(m, [BatchRow(prompt, 0, pages, logits_start=0)], caches,
                               tokens=16, pages=4)
        step, _ = run_rows(m, [BatchRow([int(np.argmax(got[0][-1]))], len(prompt), pages)],
                           caches, tokens=16, pages=4)
        out.append(np.concatenate([got[0], step[0]]))
    assert out[0].shape[0] == len(prompt) + 1
    assert np.abs(out[0] - out[1]).max() < 2e-3 * (np.abs(out[0]).max() + 1)
    assert (out[0].argmax(-1) == out[1].argmax(-1)).all()
    from mla_utils import _forward, _inputs
    _, (ids, md, li) = _inputs([BatchRow(prompt, 0, pages)], PAGE, 16, 4, None)
    text = _forward.lower(model, ids, new_caches(model, row_align=kv_row_align(impl)), md,
                          li).as_text(debug_info=True)
    names = set(re.findall(r"(grouped_matmul_(?:tpu|gpu))/pallas_call", text))
    assert names == {f"grouped_matmul_{impl}"}
    # The FP8 dense linears went through the kernel too: more GEMM calls than the MoE's 3.
    assert len(re.findall(rf"grouped_matmul_{impl}/pallas_call", text)) > 3


@pytest.mark.parametrize("tp,ep,backend", [(4, 2, "none"), (2, 2, "ragged")])
def test_expert_parallel_layer_with_the_kernel(tiny_checkpoints, tp, ep, backend):
    """moe_ep calls grouped_swiglu inside its shard_map (manual over "tp"): the kernel runs on
    the device's local experts as they are, and the layer equals the unsplit reference."""
    from jax.sharding import Mesh

    from pdjax.models.deepseek_config import DeepseekConfig
    from pdjax.models.moe import moe_forward
    from pdjax.models.moe_ep import expert_parallel_config, expert_shards, moe_forward_ep

    cfg = DeepseekConfig.from_hf_dir(tiny_checkpoints["deepseek_v32"])
    rng = np.random.default_rng(8)
    E, Hd, Fm = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    Fs = Fm * cfg.n_shared_experts
    w = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)       # noqa: E731
    p = {"router": w(Hd, E), "router_bias": rng.uniform(0, 0.2, E).astype(np.float32),
         "w_gate": w(E, Hd, Fm), "w_up": w(E, Hd, Fm), "w_down": w(E, Fm, Hd),
         "sh_gate": w(Hd, Fs), "sh_up": w(Hd, Fs), "sh_down": w(Fs, Hd)}
    h = rng.normal(0, 1, (11, Hd)).astype(np.float32)
    ref = np.asarray(jax.jit(lambda x: moe_forward(cfg, x, p))(h))
    run_cfg = expert_parallel_config(cfg, tp, ep, backend)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    placed = {name: jax.device_put(
        expert_shards(v, run_cfg.moe_tp_size, -2 if name == "w_down" else -1)
        if name in ("w_gate", "w_up", "w_down") else v,
        NamedSharding(mesh, P("tp") if name in ("w_gate", "w_up", "w_down") else P()))
        for name, v in p.items()}
    run_cfg = dataclasses.replace(run_cfg, attention_impl="tpu", pallas_interpret=True)
    f = jax.jit(lambda x, q: moe_forward_ep(run_cfg, x, q))
    x = jax.device_put(h, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        out = np.asarray(f(x, placed))
        text = f.lower(x, placed).as_text(debug_info=True)
    assert "grouped_matmul_tpu" in text
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_slice_layer_keeps_kernel_weights_stacked():
    """A layer scan's slice: kernel-run FP8 weights become layer views (the float8 stack
    whole, this layer's scales), the others are sliced; a view multiplies like the slice."""
    from pdjax.models.linear import slice_layer
    rng = np.random.default_rng(9)
    pairs = [quantize(rng.standard_normal((256, 128)).astype(np.float32)) for _ in range(3)]
    stack = Fp8BlockWeight(jnp.asarray(np.stack([p[0] for p in pairs])),
                           jnp.asarray(np.stack([p[1] for p in pairs])))
    values = {"w": stack, "norm": jnp.arange(6.0).reshape(3, 2)}
    groups = {"g": (3, {"w": ((256, 128), P()), "norm": ((2,), P())})}
    plain = slice_layer(values, jnp.int32(1))
    assert plain["w"].layer is None and plain["w"].q.shape == (256, 128)
    marked = with_fp8_kernel({"g": values}, groups, "gpu", interpret=True)["g"]
    view = slice_layer(marked, jnp.int32(1))
    assert view["w"].q.shape == (3, 256, 128) and view["w"].scale_inv.shape == (2, 1)
    assert view["w"].shape == (256, 128) and view["norm"].tolist() == [2.0, 3.0]
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    want = np.asarray(x, np.float64) @ dequantize(*pairs[1])
    for w in (view["w"], plain["w"], dataclasses.replace(view["w"], impl=None)):
        assert np.abs(np.asarray(linear(x, w)) - want).max() < 1e-3


def test_layer_views_at_tp2(tiny_checkpoints):
    """Layer views under TP 2: the stack [L, K, N] split on its last axis (column-parallel
    linear) and the expert stacks [L, E, H, F] / [L, E, F, H] split on F, per shard."""
    from pdjax.models.linear import slice_layer
    rng = np.random.default_rng(12)
    mesh = make_mesh(2)
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    L = 2
    dense = [quantize(rng.standard_normal((256, 256)).astype(np.float32)) for _ in range(L)]
    lin = Fp8BlockWeight(put(np.stack([d[0] for d in dense]), P(None, None, "tp")),
                         put(np.stack([d[1] for d in dense]), P(None, None, "tp")))
    layers = [_experts(20 + i, True) for i in range(L)]
    experts = [Fp8BlockWeight(put(np.stack([ly[0][j].q for ly in layers]), spec),
                              put(np.stack([ly[0][j].scale_inv for ly in layers]), spec))
               for j, spec in enumerate((P(None, None, None, "tp"), P(None, None, None, "tp"),
                                         P(None, None, "tp", None)))]
    groups = {"g": (L, {"lin": ((256, 256), P(None, "tp")),
                        "w_gate": ((E, H, F), P(None, None, "tp")),
                        "w_up": ((E, H, F), P(None, None, "tp")),
                        "w_down": ((E, F, H), P(None, "tp", None))})}
    params = {"g": {"lin": lin, "w_gate": experts[0], "w_up": experts[1], "w_down": experts[2]}}
    xs = jnp.asarray(rng.standard_normal((19, H)), jnp.float32)
    gs = jnp.asarray(SIZES, jnp.int32)
    cfg = _kernel_cfg(tiny_checkpoints, "tpu", True)

    def f(params, xs, gs, layer):
        v = slice_layer(with_fp8_kernel(params, groups, "tpu", interpret=True)["g"], layer)
        return linear(xs, v["lin"]), grouped_swiglu(cfg, xs, gs, v["w_gate"], v["w_up"],
                                                     v["w_down"])

    with jax.set_mesh(mesh):
        lin_out, moe_out = jax.jit(f)(params, xs, gs, jnp.int32(1))
    want = np.asarray(xs, np.float64) @ dequantize(*dense[1])
    assert np.abs(np.asarray(lin_out) - want).max() < 1e-3
    want = _numpy_swiglu(xs, layers[1][1], SIZES)
    assert np.abs(np.asarray(moe_out) - want).max() < 1e-3 * (np.abs(want).max() + 1)


@pytest.mark.parametrize("name,impl", [("deepseek_v32_fp8", "gpu"), ("glm_moe_dsa_fp8", "tpu")])
def test_engine_with_gemm_kernels_gives_transformers_greedy_tokens(tiny_checkpoints, tmp_path,
                                                                   name, impl):
    """pdjax.Engine on the FP8 tiny model with the Pallas kernels forced (interpreted): the
    greedy tokens of transformers on the same weights dequantized to float32, tie-aware."""
    import torch
    import transformers

    import make_tiny_checkpoint as mk
    from model_utils import assert_tokens_match, hf_greedy, top2_gaps
    from pdjax.engine.offline import Engine

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mk.write_dequantized(tiny_checkpoints[name], str(tmp_path / name)),
        dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(4)
    prompts_ = [rng.integers(5, 400, n).tolist() for n in (6, 14)]
    eng = Engine(tiny_checkpoints[name], dtype="float32", page_size=8, max_total_tokens=256,
                 max_running_requests=2, chunked_prefill_size=16, context_length=32,
                 attention_backend=impl, pallas_interpret=True, progress=False)
    try:
        outs = eng.generate(input_ids=prompts_, sampling_params={
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    finally:
        eng.shutdown()
    compared = 0
    for p, out in zip(prompts_, outs):
        ref, logits = hf_greedy(hf, p, 6, eos_token_id=None, pad_token_id=0)
        compared += assert_tokens_match(out["output_ids"], ref, top2_gaps(logits),
                                        what=f"{name} {impl}")
    assert compared >= 6
