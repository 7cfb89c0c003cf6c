"""load_format="dummy": a model of a checkpoint's config with random weights made on the
device (scripts/gpu_engine_check.py's Llama-3-8B shape without its 16 GB of weights)."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from pdjax.config import ServerArgs
from pdjax.models.loader import load_model


def _flat(model) -> dict[str, np.ndarray]:
    _, state = nnx.split(model)
    return {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(state)}


def test_dummy_weights_have_the_checkpoints_shapes_and_are_random(tiny_checkpoints, tmp_path):
    cfg, real = load_model(tiny_checkpoints["llama"], dtype="float32", progress=False)
    folder = tmp_path / "config_only"            # nothing but config.json: no tensor is read
    folder.mkdir()
    shutil.copy(f"{tiny_checkpoints['llama']}/config.json", folder)
    dummy_cfg, dummy = load_model(str(folder), dtype="float32", load_format="dummy")
    assert dummy_cfg == cfg
    real_p, dummy_p = _flat(real), _flat(dummy)
    assert {k: (v.shape, v.dtype) for k, v in dummy_p.items()} == \
        {k: (v.shape, v.dtype) for k, v in real_p.items()}
    # the model's own initializers: normal(0.02) weights, ones for the norms
    assert np.all(dummy_p["layers.input_norm"] == 1) and np.all(dummy_p["norm"] == 1)
    for name in ("layers.wq", "layers.w_down", "embed_tokens", "lm_head"):
        assert dummy_p[name].std() == pytest.approx(0.02, rel=0.1)
        assert not np.allclose(dummy_p[name], real_p[name])
    # deterministic: a second load makes the same values, on the device
    _, again = load_model(str(folder), dtype="float32", load_format="dummy")
    again_p = _flat(again)
    assert all(np.array_equal(again_p[k], v) for k, v in dummy_p.items())
    _, state = nnx.split(again)
    assert all(isinstance(var.get_value(), jax.Array) for _, var in nnx.to_flat_state(state))


def test_dummy_load_in_bfloat16(tiny_checkpoints):
    _, model = load_model(tiny_checkpoints["qwen3"], dtype="bfloat16", load_format="dummy")
    params = _flat(model)
    assert {str(v.dtype) for v in params.values()} == {"bfloat16"}
    assert "layers.q_norm" in params and np.all(params["layers.q_norm"] == 1)


def test_bad_load_format_is_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="^load_format: must be one of auto, dummy; got 'npz'"):
        load_model(tiny_checkpoints["llama"], load_format="npz")
    with pytest.raises(ValueError, match="^load_format: must be one of auto, dummy; got 'npz'"):
        ServerArgs(load_format="npz")
    assert ServerArgs(load_format="dummy").load_format == "dummy"


def test_engine_refuses_buckets_that_cannot_hold_a_batch(tiny_checkpoints):
    from pdjax.engine import Engine
    from pdjax.sched.buckets import Buckets

    small = Buckets(token_buckets=(32,), request_buckets=(1, 4), pages_per_seq_buckets=(8,),
                    max_rows=4)
    with pytest.raises(ValueError, match=r"buckets.token_buckets: the largest, 32, is below the 64"):
        Engine(tiny_checkpoints["llama"], dtype="float32", load_format="dummy", page_size=8,
               max_running_requests=4, chunked_prefill_size=64, context_length=64,
               max_total_tokens=512, progress=False, buckets=small)
