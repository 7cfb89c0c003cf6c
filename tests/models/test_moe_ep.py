"""Expert parallelism (``models/moe_ep.py``): one MoE layer split by expert over the simulated
CPU devices (conftest: 4) equals the unsplit ``moe.moe_forward``, for both dispatch backends,
``ep == tp`` and ``ep < tp``, uneven routing (every copy to one rank's experts), FP8 expert
stacks, and the layout / config checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.models.deepseek_config import DeepseekConfig
from pdjax.models.fp8 import LazyStack, quantize
from pdjax.models.linear import Fp8BlockWeight
from pdjax.models.moe import moe_forward
from pdjax.models.moe_ep import (check_expert_parallel, expert_parallel_config, expert_shards,
                                 moe_forward_ep)

NUM_DEVICES = 4


def _cfg(tiny_checkpoints, name="deepseek_v32") -> DeepseekConfig:
    return DeepseekConfig.from_hf_dir(tiny_checkpoints[name])


def _layer(cfg, seed=0, bias=None):
    rng = np.random.default_rng(seed)
    E, Hd, Fm = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    Fs = Fm * cfg.n_shared_experts

    def w(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)

    return {"router": w(Hd, E), "router_bias": bias if bias is not None else
            rng.uniform(0, 0.2, E).astype(np.float32),
            "w_gate": w(E, Hd, Fm), "w_up": w(E, Hd, Fm), "w_down": w(E, Fm, Hd),
            "sh_gate": w(Hd, Fs), "sh_up": w(Hd, Fs), "sh_down": w(Fs, Hd)}


def _mesh(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    return Mesh(np.array(jax.devices()[:tp]), ("tp",))


def _run_ep(cfg, p, h, tp, ep, backend):
    run_cfg = expert_parallel_config(cfg, tp, ep, backend)
    mesh = _mesh(tp)
    placed = {}
    for name, value in p.items():
        if name in ("w_gate", "w_up", "w_down"):
            axis = -2 if name == "w_down" else -1
            if isinstance(value, Fp8BlockWeight):
                value = Fp8BlockWeight(
                    jax.device_put(expert_shards(np.asarray(value.q), run_cfg.moe_tp_size,
                                                 axis), NamedSharding(mesh, P("tp"))),
                    jax.device_put(expert_shards(np.asarray(value.scale_inv),
                                                 run_cfg.moe_tp_size, axis),
                                   NamedSharding(mesh, P("tp"))), value.block_size)
            else:
                value = jax.device_put(expert_shards(value, run_cfg.moe_tp_size, axis),
                                       NamedSharding(mesh, P("tp")))
        else:
            value = jax.device_put(value, NamedSharding(mesh, P()))
        placed[name] = value
    x = jax.device_put(h, NamedSharding(mesh, P()))
    return np.asarray(jax.jit(lambda x, q: moe_forward_ep(run_cfg, x, q))(x, placed))


@pytest.mark.parametrize("tp,ep", [(4, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("backend", ["none", "ragged"])
def test_ep_layer_equals_unsplit(tiny_checkpoints, tp, ep, backend):
    cfg = _cfg(tiny_checkpoints)
    p = _layer(cfg)
    h = np.random.default_rng(1).normal(0, 1, (13, cfg.hidden_size)).astype(np.float32)
    ref = np.asarray(jax.jit(lambda x: moe_forward(cfg, x, p))(h))
    out = _run_ep(cfg, p, h, tp, ep, backend)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["none", "ragged"])
def test_every_copy_to_one_rank(tiny_checkpoints, backend):
    """A router bias sends every token's copies to rank 0's experts (0 and 1 at EP 4): the
    other ranks compute nothing, rank 0 gets the whole batch; still the unsplit output."""
    cfg = _cfg(tiny_checkpoints)
    bias = np.zeros(cfg.n_routed_experts, np.float32)
    bias[:2] = 100.0
    p = _layer(cfg, bias=bias)
    h = np.random.default_rng(2).normal(0, 1, (9, cfg.hidden_size)).astype(np.float32)
    from pdjax.models.moe import route
    experts, _ = route(cfg, jnp.asarray(h), p["router"], p["router_bias"])
    assert set(np.asarray(experts).ravel()) == {0, 1}
    ref = np.asarray(jax.jit(lambda x: moe_forward(cfg, x, p))(h))
    out = _run_ep(cfg, p, h, 4, 4, backend)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_fp8_expert_stacks(tiny_checkpoints):
    """FP8 block-scaled experts: each device holds its experts' float8 values and scales."""
    cfg = _cfg(tiny_checkpoints, "deepseek_v32_fp8")
    p = _layer(cfg)
    for name in ("w_gate", "w_up", "w_down"):
        q, s = zip(*(quantize(w, block=cfg.weight_block_size) for w in p[name]))
        p[name] = Fp8BlockWeight(jnp.asarray(np.stack(q)), jnp.asarray(np.stack(s)),
                                 cfg.weight_block_size)
    h = np.random.default_rng(3).normal(0, 1, (7, cfg.hidden_size)).astype(np.float32)
    ref = np.asarray(jax.jit(lambda x: moe_forward(cfg, x, p))(h))
    for tp, ep in ((4, 4), (4, 2)):
        out = _run_ep(cfg, p, h, tp, ep, "ragged")
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_expert_shards_layout():
    """Entry ``t * E + e`` is expert ``e``'s width slice ``t``; a lazy stack stays lazy and
    gives the same bytes."""
    w = np.arange(2 * 4 * 3 * 8, dtype=np.float32).reshape(2, 4, 3, 8)     # [L, E, Hd, Fm]
    out = expert_shards(w, 2, -1)
    assert out.shape == (2, 8, 3, 4)
    np.testing.assert_array_equal(out[1, 1 * 4 + 3], w[1, 3, :, 4:])
    np.testing.assert_array_equal(out[0, 2], w[0, 2, :, :4])
    lazy = LazyStack([LazyStack(list(layer)) for layer in w])
    np.testing.assert_array_equal(np.asarray(expert_shards(lazy, 2, -1)), out)
    down = expert_shards(w.transpose(0, 1, 3, 2), 2, -2)                     # [L, 2E, Fm/2, Hd]
    np.testing.assert_array_equal(down[1, 4 + 3], w[1, 3, :, 4:].T)


@pytest.mark.parametrize("tp,ep,backend,message", [
    (4, 3, "none", r"^ep_size: 3 must divide tp_size \(4\)"),
    (8, 8, "none", None),
    (16, 16, "none", r"^ep_size: 16 must divide n_routed_experts \(8\)"),
    (4, 2, "bogus", r"^moe_a2a_backend: must be one of none, ragged"),
    (4, 0, "none", r"^ep_size: must be a positive integer"),
])
def test_layout_checks(tiny_checkpoints, tp, ep, backend, message):
    cfg = _cfg(tiny_checkpoints)
    if message is None:
        run = expert_parallel_config(cfg, tp, ep, backend)
        assert (run.ep_size, run.moe_tp_size, run.moe_a2a_backend) == (8, 1, "none")
        return
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(cfg, tp, ep, backend)


def test_fp8_slices_must_hold_whole_blocks(tiny_checkpoints):
    cfg = _cfg(tiny_checkpoints, "deepseek_v32_fp8")          # moe_intermediate_size 256
    expert_parallel_config(cfg, 4, 2)                          # 2 slices of 128: whole blocks
    with pytest.raises(ValueError, match=r"^ep_size: tp_size / ep_size \(4\) cuts the FP8"):
        check_expert_parallel(cfg, 8, 2)                      # 4 slices of 64


def test_no_routed_experts(tiny_checkpoints):
    cfg = dataclasses.replace(_cfg(tiny_checkpoints), mlp_layer_types=("dense",) * 3)
    with pytest.raises(ValueError, match=r"^ep_size: .* has no routed experts"):
        check_expert_parallel(cfg, 4, 2)


@pytest.mark.parametrize("tp,ep,backend", [(4, 2, "ragged"), (4, 4, "none")])
def test_fp8_layer_views_under_ep(tiny_checkpoints, tp, ep, backend):
    """Kernel-run FP8 expert stacks reach the EP shard_map as layer views
    (``linear.slice_layer``: the whole ``[L, moe_tp * E, ...]`` stack and the layer index,
    read in place by the grouped GEMM, interpreted here), split on their expert axis: layer 1
    equals the unsplit reference of layer 1's weights."""
    from pdjax.models.linear import slice_layer

    cfg = _cfg(tiny_checkpoints, "deepseek_v32_fp8")
    run_cfg = expert_parallel_config(cfg, tp, ep, backend)
    mesh = _mesh(tp)
    layers = [_layer(cfg, seed=s) for s in (4, 5)]
    B = cfg.weight_block_size
    stacks, ref_p = {}, dict(layers[1])
    for name in ("w_gate", "w_up", "w_down"):
        axis = -2 if name == "w_down" else -1
        qs, ss = [], []
        for i, layer in enumerate(layers):
            q, s = zip(*(quantize(w, block=B) for w in layer[name]))
            qs.append(np.stack(q))
            ss.append(np.stack(s))
            if i == 1:
                ref_p[name] = Fp8BlockWeight(jnp.asarray(qs[-1]), jnp.asarray(ss[-1]), B)
        split = NamedSharding(mesh, P(None, "tp"))
        stacks[name] = Fp8BlockWeight(
            jax.device_put(expert_shards(np.stack(qs), run_cfg.moe_tp_size, axis), split),
            jax.device_put(expert_shards(np.stack(ss), run_cfg.moe_tp_size, axis), split), B,
            impl="tpu", interpret=True)
    rest = {k: jax.device_put(np.stack([layer[k] for layer in layers]),
                              NamedSharding(mesh, P())) for k in layers[0]
            if k not in stacks}
    h = np.random.default_rng(6).normal(0, 1, (9, cfg.hidden_size)).astype(np.float32)
    ref = np.asarray(jax.jit(lambda x: moe_forward(cfg, x, ref_p))(h))
    kernel_cfg = dataclasses.replace(run_cfg, attention_impl="tpu", pallas_interpret=True)

    def f(x, params):
        m = slice_layer(params, jnp.int32(1))
        assert m["w_gate"].layer is not None            # a view, the stack kept whole
        return moe_forward_ep(kernel_cfg, x, m)

    with jax.set_mesh(mesh):
        out = np.asarray(jax.jit(f)(jax.device_put(h, NamedSharding(mesh, P())),
                                    {**stacks, **rest}))
    np.testing.assert_allclose(out, ref, atol=1e-3, rtol=1e-3)
