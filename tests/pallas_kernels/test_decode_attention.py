"""The decode path (``decode.py``, multiply-and-reduce over the gathered pages) equals the
per-token oracle on decode batches, and the xla impl uses it for decode-only steps."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import CONFIGS, NUM_SEQS, NUM_TOKENS, make_batch, reference_fn

from pdjax.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pdjax.pallas_kernels.ragged_paged_attention.decode import ragged_paged_attention_decode

# (kv_len per decode row, rows): page boundaries (16), several KV blocks (pages_per_block 1
# and 2 below), a one-token context, padding rows after the real ones, and a row of kv_len 0.
DECODE_BATCHES = {
    "full": [1, 15, 16, 17, 31, 32, 33, 96],
    "padding": [9, 40, 3],
    "one": [1],
    "long": [96, 95, 80, 64, 49, 48, 47, 2],
}


@functools.lru_cache(maxsize=None)
def decode_fn(name: str, pages_per_block):
    cfg = CONFIGS[name]
    return jax.jit(functools.partial(
        ragged_paged_attention_decode, sm_scale=cfg.head_dim ** -0.5,
        sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap, k_scale=cfg.k_scale,
        v_scale=cfg.v_scale, pages_per_block=pages_per_block))


def _args(cfg, kv_lens, seed, num_tokens=None):
    seqs = [(1, n) for n in kv_lens]
    n = len(seqs)
    args = list(make_batch(seqs, (n, n, n), seed=seed, num_q_heads=cfg.num_q_heads,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           dtype=cfg.dtype, kv_dtype=cfg.kv_dtype, k_scale=cfg.k_scale,
                           v_scale=cfg.v_scale))
    if num_tokens is not None:
        args[0] = args[0][:num_tokens]
    return args


@pytest.mark.parametrize("pages_per_block", [None, 1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_decode_path_matches_reference(config, pages_per_block):
    """GQA 1/3/4/8, bf16 and fp8 KV, sliding window and soft cap, NaN in every unused slot;
    T = 48 tokens over R = 8 rows (tokens past the rows are 0) and T = R."""
    cfg = CONFIGS[config]
    fn = decode_fn(config, pages_per_block)
    ref = reference_fn(cfg)
    for seed, (name, kv_lens) in enumerate(DECODE_BATCHES.items()):
        for num_tokens in (NUM_TOKENS, NUM_SEQS):
            args = _args(cfg, kv_lens, seed, num_tokens)
            out = np.asarray(fn(*args).astype(jnp.float32))
            want = np.asarray(ref(*args).astype(jnp.float32))
            assert out.shape == (num_tokens, cfg.num_q_heads, cfg.head_dim)
            assert np.isfinite(out).all(), f"{name}: NaN/Inf in the decode path"
            err = float(np.abs(out - want).max())
            assert err <= cfg.tol, f"{name} T={num_tokens}: max abs err {err:.3g} > {cfg.tol}"
            assert not out[len(kv_lens):].any()
            assert np.abs(out[:len(kv_lens)]).max(axis=(1, 2)).min() > 0.01


def test_decode_row_of_kv_len_zero_is_zero():
    cfg = CONFIGS["gqa3_d64_f32"]
    args = _args(cfg, [20, 5, 33], seed=3)
    args[4] = args[4].at[1].set(0)                   # row 1: no context (a padding row)
    out = np.asarray(decode_fn("gqa3_d64_f32", None)(*args))
    want = np.asarray(reference_fn(cfg)(*args))
    assert not out[1].any()
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)


def test_decode_path_rejects_bad_block():
    cfg = CONFIGS["gqa3_d64_f32"]
    with pytest.raises(ValueError, match="pages_per_block"):
        ragged_paged_attention_decode(*_args(cfg, [4], seed=0), sm_scale=0.125,
                                      pages_per_block=0)


def test_xla_impl_runs_the_decode_path_for_decode_only_steps():
    """``impl="xla", decode_only=True`` (the engine's decode entry point) is the decode path:
    same values, and no batched ``dot_general`` (the reference's einsums) in its lowering."""
    cfg = CONFIGS["gqa3_d64_f32"]
    args = _args(cfg, DECODE_BATCHES["full"], seed=1, num_tokens=NUM_SEQS)
    xla = functools.partial(ragged_paged_attention, sm_scale=0.125, impl="xla", decode_only=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(xla)(*args)),
                                  np.asarray(decode_fn("gqa3_d64_f32", None)(*args)))
    text = jax.jit(xla).lower(*args).as_text()
    assert not re.search(r"stablehlo\.dot_general", text)
    ref_text = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125,
                                         impl="reference")).lower(*args).as_text()
    assert re.search(r"stablehlo\.dot_general", ref_text)
