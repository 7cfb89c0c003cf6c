"""Ragged paged attention kernels against the jnp reference.

On CPU both Pallas kernels run in interpret mode; on a GPU host (scripts/gpu_check.sh) the GPU
kernel runs compiled through Triton and the TPU kernel stays interpreted. Every configuration
is compiled once for a fixed shape envelope and fed several batches (decode only, prefill only,
mixed, page-boundary lengths, padding); unused pages and cache slots past ``kv_lens`` hold NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import ON_GPU, interpret_mode, kernel_device, lowering_context, paged_layout
from pdjax.pallas_kernels import cpu_build
from pdjax.pallas_kernels import ragged_paged_attention as rpa_package
from pdjax.pallas_kernels.ragged_paged_attention import (
    ATTENTION_IMPLS, cpu_kernel_available, cpu_kernel_status, ragged_paged_attention,
    resolve_impl)
from pdjax.pallas_kernels.ragged_paged_attention import kernel_cpu
from pdjax.pallas_kernels.ragged_paged_attention import xla as xla_module
from pdjax.pallas_kernels.ragged_paged_attention.common import (
    block_metadata, grid_size, merge_paths)
from pdjax.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference)
from pdjax.pallas_kernels.ragged_paged_attention.tuning import (
    PATHS, BlockSizes, fallback_block_sizes, get_block_sizes, gpu_group_pad)
from pdjax.pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

# jax 0.11 warns on every Triton lowering; the GPU kernel picks Triton on purpose (kernel_gpu.py).
pytestmark = [pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.slow]   # slow tier: interpret-mode kernels, TPU/GPU lowering

# Fixed envelope so that each configuration compiles once.
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, PAGE_SIZE, NUM_LAYERS = 48, 8, 6, 16, 2
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ + 3

# name -> ((q_len, kv_len) per request, distribution (decode_end, prefill_end, num_seqs)).
BATCHES = {
    "decode": ([(1, 1), (1, 15), (1, 16), (1, 17), (1, 31), (1, 32), (1, 33), (1, 96)],
               (8, 8, 8)),
    "prefill": ([(16, 16), (32, 80)], (0, 2, 2)),
    "mixed": ([(1, 20), (1, 64), (1, 16), (16, 32), (5, 5), (7, 40), (3, 17), (1, 96)],
              (3, 4, 8)),
    "page_boundaries": ([(15, 31), (17, 33), (16, 48)], (0, 0, 3)),
    "padding": ([(1, 9), (4, 4), (9, 25)], (1, 1, 3)),
}


def make_batch(seqs, distribution, *, num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype,
               k_scale=None, v_scale=None, seed=0, rows=True):
    """Inputs in the fixed envelope; pages are a random permutation, NaN where unused. The
    caches are the engine's rows ``[L, N, ps, KVH * D]``, or with ``rows=False`` the same
    values as ``[L, N, ps, KVH, D]``."""
    rng = np.random.default_rng(seed)
    lay = paged_layout(rng, seqs, num_seqs=NUM_SEQS, num_pages=NUM_PAGES,
                       pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE)
    assert lay.cu_q_lens[-1] <= NUM_TOKENS and lay.kv_lens.max() <= PAGES_PER_SEQ * PAGE_SIZE
    shape = (NUM_LAYERS, NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
    # |v| <= 0.5 bounds every output by 0.5, where one bf16 ulp (1.95e-3) is within the 2e-3
    # bf16 tolerance: two correct bf16 results may differ by one rounding step.
    q = rng.standard_normal((NUM_TOKENS, num_q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    if k_scale is not None:
        k, v = k / k_scale, v / v_scale
    lay.poison(k)
    lay.poison(v)
    if rows:
        k, v = k.reshape(*shape[:3], -1), v.reshape(*shape[:3], -1)
    return (jnp.asarray(q, dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype),
            jnp.int32(1), jnp.asarray(lay.kv_lens), jnp.asarray(lay.page_indices),
            jnp.asarray(lay.cu_q_lens), jnp.asarray(distribution, jnp.int32))


@dataclasses.dataclass(frozen=True)
class Config:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: object
    kv_dtype: object
    small_blocks: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def tol(self) -> float:
        return 1e-5 if self.dtype == jnp.float32 else 2e-3


# GQA ratios 1/3/4/8, head_dim 64/128, f32 / bf16 / fp8 KV, default tuning or small blocks.
CONFIGS = {
    "gqa3_d64_f32": Config(9, 3, 64, jnp.float32, jnp.float32),            # the default model
    "mha_d128_f32": Config(4, 4, 128, jnp.float32, jnp.float32, small_blocks=True),
    "gqa4_d64_bf16_window_softcap": Config(8, 2, 64, jnp.bfloat16, jnp.bfloat16,
                                           small_blocks=True, sliding_window=20, soft_cap=15.0),
    "gqa8_d128_fp8_kv": Config(8, 1, 128, jnp.bfloat16, jnp.float8_e4m3fn, k_scale=0.5,
                               v_scale=0.25),
}

# Small blocks make query blocks straddle requests and paths, and KV steps straddle pages.
SMALL_BLOCKS = {
    "tpu": {"decode": BlockSizes(4, 32), "prefill": BlockSizes(8, 32), "mixed": BlockSizes(8, 16)},
    "gpu": {"decode": BlockSizes(1, 16), "prefill": BlockSizes(8, 32), "mixed": BlockSizes(4, 16)},
}


@functools.lru_cache(maxsize=None)
def kernel_fn(impl: str, cfg: Config, interpret):
    """Jitted kernel through the public dispatch (or the module with small blocks)."""
    opts = dict(sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
                soft_cap=cfg.soft_cap, k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    if not cfg.small_blocks:
        return jax.jit(functools.partial(ragged_paged_attention, impl=impl, interpret=interpret,
                                         **opts))
    if impl == "tpu":
        from pdjax.pallas_kernels.ragged_paged_attention.kernel_tpu import (
            ragged_paged_attention_tpu as fn)
    else:
        from pdjax.pallas_kernels.ragged_paged_attention.kernel_gpu import (
            ragged_paged_attention_gpu as fn)
    return jax.jit(functools.partial(fn, interpret=interpret, block_sizes=SMALL_BLOCKS[impl],
                                     **opts))


@functools.lru_cache(maxsize=None)
def reference_fn(cfg: Config):
    ref = jax.jit(functools.partial(
        ragged_paged_attention_reference, sm_scale=cfg.head_dim ** -0.5,
        sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap, k_scale=cfg.k_scale,
        v_scale=cfg.v_scale))

    def run(*args):
        with jax.default_matmul_precision("highest"):      # no TF32 in the oracle on GPU
            return ref(*args)
    return run


def lowered_kernels(fn, args) -> set[str]:
    """Names of the kernel pallas_calls in the lowered module (proof the kernel path ran);
    compiled on a GPU, the module must also hold the three Triton custom calls."""
    text = fn.lower(*args).as_text(debug_info=True)
    names = set(re.findall(r"(ragged_paged_attention_(?:tpu|gpu)_\w+)/pallas_call", text))
    if any(name.startswith("ragged_paged_attention_gpu") for name in names) and ON_GPU:
        assert text.count("__gpu$xla.gpu.triton") == 3
    return names


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_matches_reference(impl, config):
    with kernel_device(impl):
        _check_against_reference(impl, CONFIGS[config])


def _check_against_reference(impl: str, cfg: Config):
    fn = kernel_fn(impl, cfg, interpret_mode(impl))
    ref = reference_fn(cfg)
    shapes = dict(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, dtype=cfg.dtype, kv_dtype=cfg.kv_dtype,
                  k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    first = make_batch(*BATCHES["mixed"], **shapes)
    assert lowered_kernels(fn, first) == {f"ragged_paged_attention_{impl}_{p}" for p in PATHS}
    for seed, (name, (seqs, distribution)) in enumerate(BATCHES.items()):
        args = make_batch(seqs, distribution, seed=seed, **shapes)
        out = np.asarray(fn(*args).astype(jnp.float32))
        want = np.asarray(ref(*args).astype(jnp.float32))
        real_tokens = int(args[6][distribution[2]])
        assert np.isfinite(want).all()
        assert np.isfinite(out).all(), f"{name}: NaN/Inf in kernel output"
        err = float(np.abs(out - want).max())
        assert err <= cfg.tol, f"{name}: max abs err {err:.3g} > {cfg.tol}"
        # Padding rows are exactly 0 and real rows are not trivially 0.
        assert not out[real_tokens:].any()
        assert np.abs(out[:real_tokens]).max() > 0.01


@functools.lru_cache(maxsize=None)
def xla_fn(cfg: Config, q_block=None, kv_pages_per_block=None):
    return jax.jit(functools.partial(
        ragged_paged_attention_xla, sm_scale=cfg.head_dim ** -0.5,
        sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap, k_scale=cfg.k_scale,
        v_scale=cfg.v_scale, q_block=q_block, kv_pages_per_block=kv_pages_per_block))


def _check_xla(cfg: Config, fn, name, seqs, distribution, seed):
    shapes = dict(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, dtype=cfg.dtype, kv_dtype=cfg.kv_dtype,
                  k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    args = make_batch(seqs, distribution, seed=seed, **shapes)
    out = np.asarray(fn(*args).astype(jnp.float32))
    want = np.asarray(reference_fn(cfg)(*args).astype(jnp.float32))
    real_tokens = int(args[6][distribution[2]])
    assert np.isfinite(out).all(), f"{name}: NaN/Inf in the xla path"
    err = float(np.abs(out - want).max())
    assert err <= cfg.tol, f"{name}: max abs err {err:.3g} > {cfg.tol}"
    assert not out[real_tokens:].any()
    assert np.abs(out[:real_tokens]).max() > 0.01


# (q_block, kv_pages_per_block): the defaults (one tile, one KV block here), and small blocks
# so that tiles split requests, slide back at the end of the stream and KV blocks split pages.
XLA_BLOCKS = [(None, None), (8, 1), (16, 2)]


@pytest.mark.parametrize("blocks", XLA_BLOCKS, ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_xla_path_matches_reference(config, blocks):
    """The per-request path equals the per-token oracle on every batch kind (GQA 1/3/4/8,
    bf16 and fp8 KV, sliding window and soft cap), NaN in every unused slot."""
    cfg = CONFIGS[config]
    fn = xla_fn(cfg, *blocks)
    for seed, (name, (seqs, distribution)) in enumerate(BATCHES.items()):
        _check_xla(cfg, fn, name, seqs, distribution, seed)


# One prefill row swept over q_len x cached prefix around the page (16) and tile (8, 16)
# boundaries, behind two decode rows; the tail (0 padding tokens) is also covered at q_len 46.
SWEEP = [(q, q + prefix) for q in (1, 7, 8, 9, 15, 16, 17, 31, 33, 46)
         for prefix in (0, 1, 15, 16, 17, 50)]


@pytest.mark.parametrize("config", ["gqa3_d64_f32", "gqa4_d64_bf16_window_softcap"])
def test_xla_path_sweeps_q_and_kv_lens(config):
    cfg = CONFIGS[config]
    fn = xla_fn(cfg, 8, 1)
    for seed, (q_len, kv_len) in enumerate(SWEEP):
        seqs = [(1, 33), (1, 16), (q_len, kv_len)]
        _check_xla(cfg, fn, f"q_len {q_len} kv_len {kv_len}", seqs, (2, 2, 3), seed)
        # The same row as a full-chunk prefill row (distribution j) behind no decode rows.
        _check_xla(cfg, fn, f"prefill q_len {q_len} kv_len {kv_len}", [(q_len, kv_len)],
                   (0, 1, 1), seed)


def test_xla_path_small_bucket_tiles_match_reference():
    """A 16-token stream takes the default tiles of 8 rows (``SMALL_BUCKET_TOKENS``): a chunk
    behind decode rows spans two of them (the second slides back), a lone prefill row too."""
    cfg = CONFIGS["gqa3_d64_f32"]
    shapes = dict(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, dtype=cfg.dtype, kv_dtype=cfg.kv_dtype)
    for seed, (seqs, distribution) in enumerate((
            ([(1, 20), (1, 64), (1, 16), (13, 40)], (3, 3, 4)),
            ([(1, 33), (1, 17), (1, 50), (1, 9), (1, 70), (1, 24), (1, 31), (8, 96)], (7, 7, 8)),
            ([(16, 40)], (0, 1, 1)))):
        args = list(make_batch(seqs, distribution, seed=seed, **shapes))
        args[0] = args[0][:16]
        out = np.asarray(xla_fn(cfg)(*args))
        want = np.asarray(reference_fn(cfg)(*args))
        assert out.shape == (16, cfg.num_q_heads, cfg.head_dim)
        assert float(np.abs(out - want).max()) <= cfg.tol, seqs
        assert np.abs(out).max() > 0.01


# Decode-only batches: every real row has q_len 1; padding rows have kv_len 0. Lengths straddle
# the 16-token pages and the 1-, 2- and 4-page KV blocks; "long" has no short row, so that a
# sliding window starts the block loop past block 0.
DECODE_BATCHES = {
    "decode": BATCHES["decode"],
    "padding": ([(1, 9), (1, 40), (1, 17)], (3, 3, 3)),
    "long": ([(1, 60), (1, 90), (1, 75), (1, 64), (1, 65)], (5, 5, 5)),
    "empty": ([], (0, 0, 0)),
}
# Above DECODE_FOLD_MAX_KV_HEADS the decode rows take head-major blocks by default.
DECODE_CONFIGS = {**CONFIGS, "mha8_d64_f32": Config(8, 8, 64, jnp.float32, jnp.float32)}


def require_cpu_kernel():
    """The native kernel's tests run on the CPU backend (the GPU check host runs this file
    with a GPU default backend, where the kernel is not registered); there the kernel must
    build: a missing compiler or a failed build fails these tests, it does not skip them."""
    if jax.default_backend() != "cpu":
        pytest.skip("the native kernel is registered for the CPU platform only")
    assert cpu_kernel_available(), f"native CPU kernel unavailable: {cpu_kernel_status()[1]}"


@pytest.mark.parametrize("layout", ["default", "head_major", "native"])
@pytest.mark.parametrize("pages_per_block", [None, 1, 2], ids=str)
@pytest.mark.parametrize("config", list(DECODE_CONFIGS))
def test_xla_decode_only_matches_reference(config, pages_per_block, layout, monkeypatch):
    """``decode_only=True`` (the decode entry point): the decode path equals the per-token
    oracle for GQA 1/3/4/8 and 8 KV heads, bf16 and fp8 KV, sliding window and soft cap, on
    stream lengths T = R (the decode bucket) and T > R (padding tokens), NaN in every unused
    slot; in all three layouts (KV heads folded into the key axis, the default up to
    ``DECODE_FOLD_MAX_KV_HEADS``; head-major blocks; the native CPU kernel, which keeps the jnp
    path for the fp8 cache it does not take)."""
    if layout == "head_major":
        monkeypatch.setattr(xla_module, "DECODE_FOLD_MAX_KV_HEADS", 0)
    if layout == "native":
        require_cpu_kernel()
    cfg = DECODE_CONFIGS[config]
    shapes = dict(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, dtype=cfg.dtype, kv_dtype=cfg.kv_dtype,
                  k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    fn = jax.jit(functools.partial(
        ragged_paged_attention_xla, sm_scale=cfg.head_dim ** -0.5,
        sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap, k_scale=cfg.k_scale,
        v_scale=cfg.v_scale, decode_pages_per_block=pages_per_block, decode_only=True,
        native_decode=layout == "native"))
    for seed, (name, (seqs, distribution)) in enumerate(DECODE_BATCHES.items()):
        for num_tokens in (NUM_SEQS, NUM_TOKENS):
            args = list(make_batch(seqs, distribution, seed=seed, **shapes))
            args[0] = args[0][:num_tokens]
            out = np.asarray(fn(*args).astype(jnp.float32))
            want = np.asarray(reference_fn(cfg)(*args).astype(jnp.float32))
            assert out.shape == (num_tokens, cfg.num_q_heads, cfg.head_dim)
            assert np.isfinite(out).all(), f"{name}: NaN/Inf in the decode path"
            err = float(np.abs(out - want).max())
            assert err <= cfg.tol, f"{name} T={num_tokens}: max abs err {err:.3g} > {cfg.tol}"
            assert not out[len(seqs):].any(), f"{name}: padding rows are not 0"
            if seqs:
                assert np.abs(out[:len(seqs)]).max() > 0.01


def test_xla_path_is_the_cpu_default():
    """On CPU ``impl=None`` runs the xla path (with the native decode kernel where it builds):
    no per-token gather of ``[T, pages, ...]``."""
    cfg = CONFIGS["gqa3_d64_f32"]
    args = make_batch(*BATCHES["mixed"], num_q_heads=9, num_kv_heads=3, head_dim=64,
                      dtype=jnp.float32, kv_dtype=jnp.float32)
    auto = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125))
    if jax.default_backend() == "cpu":
        native = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.125,
                                           native_decode=cpu_kernel_available()))
        np.testing.assert_array_equal(np.asarray(auto(*args)), np.asarray(native(*args)))
        np.testing.assert_allclose(np.asarray(auto(*args)), np.asarray(xla_fn(cfg)(*args)),
                                   atol=cfg.tol, rtol=0)
    # The per-token oracle gathers [T=48, pages_per_block, ...]; the xla path never does
    # outside its decode rows (at most min(T, R) = 8 of them).
    def gather_rows(fn):
        text = jax.jit(fn).lower(*args).as_text()
        return {int(m) for m in re.findall(r"tensor<(\d+)x\d+x16x3x64xf32>", text)}
    assert NUM_TOKENS in gather_rows(functools.partial(ragged_paged_attention_reference,
                                                       sm_scale=0.125))
    assert NUM_TOKENS not in gather_rows(functools.partial(ragged_paged_attention_xla,
                                                           sm_scale=0.125))


@pytest.mark.parametrize("token_rows", [False, True], ids=["tiles", "token_rows"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cpu_impl_matches_reference(config, token_rows, monkeypatch):
    """``impl="cpu"`` equals the oracle on every batch kind, both ways it runs: native decode
    rows beside jnp tiles for the rest (a stream longer than ``NATIVE_TOKEN_ROWS_MAX``), and
    every token a kernel row (``token_rows``, a stream up to it: the limit raised here past
    the batches' 48 tokens); the lowered program calls the kernel once, ``impl="xla"`` never."""
    require_cpu_kernel()
    if token_rows:
        monkeypatch.setattr(xla_module, "NATIVE_TOKEN_ROWS_MAX", NUM_TOKENS)
    else:
        assert xla_module.NATIVE_TOKEN_ROWS_MAX < NUM_TOKENS
    cfg = CONFIGS[config]
    opts = dict(sm_scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
                soft_cap=cfg.soft_cap, k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    fn = jax.jit(functools.partial(ragged_paged_attention, impl="cpu", **opts))
    for seed, (name, (seqs, distribution)) in enumerate(BATCHES.items()):
        _check_xla(cfg, fn, name, seqs, distribution, seed)
    args = make_batch(*BATCHES["mixed"], num_q_heads=cfg.num_q_heads,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                      kv_dtype=cfg.kv_dtype, k_scale=cfg.k_scale, v_scale=cfg.v_scale)
    text = fn.lower(*args).as_text()
    assert text.count(kernel_cpu.FFI_TARGET) == (0 if cfg.kv_dtype == jnp.float8_e4m3fn else 1)
    # The tiles' request loop is a while loop; the token-rows program has none.
    assert ("stablehlo.while" in text) is (not token_rows or cfg.kv_dtype == jnp.float8_e4m3fn)
    xla = jax.jit(functools.partial(ragged_paged_attention, impl="xla", **opts))
    assert kernel_cpu.FFI_TARGET not in xla.lower(*args).as_text()


def test_token_rows_positions_and_padding():
    """``token_rows``: each token gets its row's page table and kv_len ``position + 1`` (a
    decode row its own kv_len, a chunk's tokens counting up to its row's kv_len); tokens past
    the last row, and rows past ``num_seqs``, get 0."""
    kv_lens = jnp.asarray([5, 9, 20, 7], jnp.int32)
    pages = jnp.arange(4 * 3, dtype=jnp.int32).reshape(4, 3)
    cu = jnp.asarray([0, 1, 2, 6, 6], jnp.int32)          # two decode rows, a 4-token chunk
    kv, table = xla_module.token_rows(kv_lens, pages, cu, jnp.asarray([2, 3, 3], jnp.int32), 8)
    np.testing.assert_array_equal(np.asarray(kv), [5, 9, 17, 18, 19, 20, 0, 0])
    np.testing.assert_array_equal(np.asarray(table)[:6], np.asarray(pages)[[0, 1, 2, 2, 2, 2]])
    kv, _ = xla_module.token_rows(kv_lens, pages, cu, jnp.asarray([2, 2, 2], jnp.int32), 8)
    np.testing.assert_array_equal(np.asarray(kv), [5, 9, 0, 0, 0, 0, 0, 0])


def _decode_kernel_args(rows, kv_len, *, num_kv_heads=3, group=3, head_dim=64, seed=0):
    """A 2-layer cache of 4-token pages (NaN everywhere) and ``rows`` decode rows of
    ``kv_len`` keys (an int, or one per row) on scattered pages, filled in for layer 1 only."""
    rng = np.random.default_rng(seed)
    page_size, layers = 4, 2
    kv_lens = np.broadcast_to(np.asarray(kv_len, np.int32), (rows,))
    need = -(-int(kv_lens.max()) // page_size)
    num_pages = 1 + rows * need
    k = np.full((layers, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    table = rng.permutation(np.arange(1, num_pages)).reshape(rows, need).astype(np.int32)
    for r in range(rows):
        for t in range(kv_lens[r]):
            page, slot = table[r, t // page_size], t % page_size
            k[1, page, slot] = rng.standard_normal((num_kv_heads, head_dim))
            v[1, page, slot] = rng.uniform(-0.5, 0.5, (num_kv_heads, head_dim))
    q = rng.standard_normal((rows, num_kv_heads * group, head_dim)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(1),
            jnp.asarray(kv_lens), jnp.asarray(table))


@pytest.mark.parametrize("rows,kv_len", [(1, 7), (40, 13)])
def test_cpu_kernel_work_split_matches_jnp(rows, kv_len):
    """One row splits into one item per KV head; 40 rows (more than 4 per thread on any
    pool) are one item per row. Both equal the jnp decode path, for 1 to 8 KV heads and head
    dims 8 and 72 (not multiples of the 64-float register chunks), with a sliding window."""
    require_cpu_kernel()
    for num_kv_heads, group, head_dim, window in ((3, 3, 64, None), (1, 4, 8, 5),
                                                  (8, 1, 72, None), (2, 2, 16, 3)):
        args = _decode_kernel_args(rows, kv_len, num_kv_heads=num_kv_heads, group=group,
                                   head_dim=head_dim)
        opts = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
        for num_rows in (rows, rows // 2):
            got = kernel_cpu.decode_attention_cpu(*args, num_rows, **opts)
            want = xla_module.decode_attention(*args, num_rows, **opts)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
            assert not np.asarray(got)[num_rows:].any()
            if num_rows:
                assert np.abs(np.asarray(got)[:num_rows]).max() > 0.01


@pytest.mark.parametrize("long_row", [0, 17, 39])
def test_cpu_kernel_unbalanced_rows_match_jnp(long_row):
    """40 rows, one of them far longer than the rest (a prompt token after decode rows): that
    row splits into one item per KV head and the items run longest first. Every row still
    equals the jnp decode path, wherever the long row sits, with rows past num_rows 0."""
    require_cpu_kernel()
    kv_lens = np.full(40, 5, np.int32)
    kv_lens[long_row] = 97
    kv_lens[3] = 0
    args = _decode_kernel_args(40, kv_lens)
    opts = dict(sm_scale=64 ** -0.5, sliding_window=None)
    for num_rows in (40, long_row + 1):
        got = np.asarray(kernel_cpu.decode_attention_cpu(*args, num_rows, **opts))
        want = np.asarray(xla_module.decode_attention(*args, num_rows, **opts))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        assert not got[num_rows:].any() and not got[3].any()
        assert np.abs(got[long_row]).max() > 0.01


def _token_group_kernel_args(rows, *, num_kv_heads, group, head_dim, seed=0):
    """Kernel rows as ``token_rows`` lays out a mixed step: ``rows`` is a list of
    ``(request, kv_len)``, every row of a request sharing that request's page table (4-token
    pages, scattered; the cache NaN outside the filled keys, layer 1 only)."""
    rng = np.random.default_rng(seed)
    page_size, layers = 4, 2
    longest = {}
    for req, kv_len in rows:
        longest[req] = max(longest.get(req, 0), kv_len)
    need = max(-(-n // page_size) for n in longest.values())
    num_pages = 1 + len(longest) * need
    k = np.full((layers, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    free = iter(rng.permutation(np.arange(1, num_pages)))
    tables = {}
    for req, n in longest.items():
        tables[req] = np.asarray([next(free) for _ in range(need)], np.int32)
        for t in range(n):
            page, slot = tables[req][t // page_size], t % page_size
            k[1, page, slot] = rng.standard_normal((num_kv_heads, head_dim))
            v[1, page, slot] = rng.uniform(-0.5, 0.5, (num_kv_heads, head_dim))
    q = rng.standard_normal((len(rows), num_kv_heads * group, head_dim)).astype(np.float32)
    kv_lens = np.asarray([n for _, n in rows], np.int32)
    table = np.stack([tables[req] for req, _ in rows])
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(1),
            jnp.asarray(kv_lens), jnp.asarray(table))


def test_cpu_kernel_token_groups_match_jnp():
    """Consecutive rows of one prompt chunk (one page table, kv_len one more each) run as
    token groups of up to 8 tokens that read their keys once for all their rows: a 13-token
    chunk (groups of 8 and 5) and a 2-token one after 3 decode rows, a row of the first
    request that does not continue the chunk, and padding rows. Every row equals the jnp
    decode path, for several head layouts, with and without a sliding window (the rows of a
    group then start at different keys) and a soft cap, in float32 and bfloat16."""
    require_cpu_kernel()
    chunk = [(0, 40 + i) for i in range(13)]
    rows = [(1, 9), (2, 30), (3, 1)] + chunk + [(4, 6), (4, 7), (0, 20), (0, 21)]
    rows += [(5, 0)] * 3
    for num_kv_heads, group, head_dim, window, cap in ((3, 3, 64, None, None),
                                                       (3, 3, 64, 6, None),
                                                       (1, 4, 8, None, 5.0), (2, 2, 16, 3, 5.0),
                                                       (8, 1, 72, None, None)):
        q, k, v, layer, kv_lens, table = _token_group_kernel_args(
            rows, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
        opts = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)
        for dtype, atol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)):
            kc, vc = k.astype(dtype), v.astype(dtype)
            num_rows = len(rows) - 3
            got = np.asarray(kernel_cpu.decode_attention_cpu(q, kc, vc, layer, kv_lens, table,
                                                             num_rows, **opts))
            want = np.asarray(xla_module.decode_attention(q, kc, vc, layer, kv_lens, table,
                                                          num_rows, **opts))
            np.testing.assert_allclose(got, want, atol=atol, rtol=0)
            assert not got[num_rows:].any()
            assert np.abs(got[:num_rows]).max(axis=(1, 2)).min() > 0.01


def test_cpu_kernel_token_group_reads_each_row_through_its_own_pages():
    """A row's output depends only on the table slots it reads. Three rows at kv_lens 3, 4
    and 5 (4-token pages) that agree on those slots form one token group even though the first
    row's second slot, which it never reads, names another page (as a per-row zero-padded
    table would): every row still equals the jnp decode path over its own table."""
    require_cpu_kernel()
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 10, 4, 3, 64)).astype(np.float32)
    v = rng.uniform(-0.5, 0.5, (1, 10, 4, 3, 64)).astype(np.float32)
    table = np.asarray([[7, 9], [7, 8], [7, 8]], np.int32)
    kv_lens = np.asarray([3, 4, 5], np.int32)
    q = rng.standard_normal((3, 9, 64)).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(0), jnp.asarray(kv_lens),
            jnp.asarray(table), 3)
    got = np.asarray(kernel_cpu.decode_attention_cpu(*args, sm_scale=0.125))
    want = np.asarray(xla_module.decode_attention(*args, sm_scale=0.125))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_cpu_kernel_clamps_indices_from_the_host():
    """Page ids, layer, kv_lens and num_rows out of range address nothing outside the
    buffers: page ids clamp to ``[0, num_pages)`` (as the Pallas kernels clamp them), the layer
    to the stack, kv_len to the table's pages and num_rows to the rows."""
    require_cpu_kernel()
    q, k, v, layer, kv_lens, table = _decode_kernel_args(3, 8)
    opts = dict(sm_scale=0.125)
    base = np.asarray(kernel_cpu.decode_attention_cpu(q, k, v, layer, kv_lens, table, 3, **opts))
    num_pages = k.shape[1]
    # The last page id of every row pushed past either end of the pool.
    hostile = table.at[:, -1].set(jnp.asarray([num_pages, 10 ** 9, -5], jnp.int32))
    clamped = jnp.clip(hostile, 0, num_pages - 1)
    got = kernel_cpu.decode_attention_cpu(q, k, v, layer, kv_lens, hostile, 3, **opts)
    want = kernel_cpu.decode_attention_cpu(q, k, v, layer, kv_lens, clamped, 3, **opts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref = xla_module.decode_attention(q, k, v, layer, kv_lens, clamped, 3, **opts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    # Layer 7 of 2 reads layer 1; kv_len 10**6 reads the table's 2 pages; num_rows 99 is 3.
    big = jnp.full((3,), 10 ** 6, jnp.int32)
    got = kernel_cpu.decode_attention_cpu(q, k, v, jnp.int32(7), big, table, 99, **opts)
    np.testing.assert_array_equal(np.asarray(got), base)


def test_cpu_kernel_build_is_cached_and_reports_failure(tmp_path):
    """A second build of the same source reuses the library (no compile); a compiler that
    fails raises with its output, and ``impl="cpu"`` names the reason when the kernel is off."""
    require_cpu_kernel()
    cxx = cpu_build.compiler()
    first = cpu_build.build_library(kernel_cpu.KERNEL_SOURCE, cxx, str(tmp_path))
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build_library(kernel_cpu.KERNEL_SOURCE, cxx, str(tmp_path)) == first
    assert first.stat().st_mtime_ns == mtime
    with pytest.raises(RuntimeError, match="failed"):
        cpu_build.build_library(kernel_cpu.KERNEL_SOURCE, "/bin/false", str(tmp_path / "bad"))


def test_cpu_kernel_switch_and_fallback():
    """``PDJAX_CPU_KERNEL=0``: auto resolves to ``xla`` and ``impl="cpu"`` is an error that
    says why; the matmul kernel is off too (a fresh process: the status is decided once per
    process)."""
    code = ("from pdjax.pallas_kernels.ragged_paged_attention import resolve_impl\n"
            "from pdjax.pallas_kernels.dense_cpu import matmul_kernel_status\n"
            "print(resolve_impl(None))\n"
            "try:\n    resolve_impl('cpu')\nexcept ValueError as e:\n    print(e)\n"
            "print(matmul_kernel_status())\n")
    env = {**os.environ, "PDJAX_CPU_KERNEL": "0", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout.splitlines()
    assert out == ["xla", "impl='cpu': the native CPU kernel is unavailable "
                          "(PDJAX_CPU_KERNEL=0)", "(False, 'PDJAX_CPU_KERNEL=0')"]


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_layer_selects_cache_slice(impl):
    """The stacked pool is indexed by ``layer``: layer 0 and 1 give the reference's answers."""
    cfg = CONFIGS["gqa3_d64_f32"]
    fn = kernel_fn(impl, cfg, interpret_mode(impl))
    ref = reference_fn(cfg)
    outs = []
    with kernel_device(impl):
        args = list(make_batch(*BATCHES["mixed"], num_q_heads=9, num_kv_heads=3, head_dim=64,
                               dtype=jnp.float32, kv_dtype=jnp.float32))
        for layer in (0, 1):
            args[3] = jnp.int32(layer)
            out = np.asarray(fn(*args))
            np.testing.assert_allclose(out, np.asarray(ref(*args)), atol=1e-5, rtol=0)
            outs.append(out)
    assert np.abs(outs[0] - outs[1]).max() > 0.1


def test_tpu_kernel_race_detector_all_paths():
    """``InterpretParams(detect_races=True)`` on tiny shapes with every path active."""
    with kernel_device("tpu"):
        _check_tpu_races()


def _check_tpu_races():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from pdjax.pallas_kernels.ragged_paged_attention.kernel_tpu import (
        ragged_paged_attention_tpu)

    rng = np.random.default_rng(3)
    # requests: 2 decode rows, 1 prefill chunk, 1 mixed row; page_size 4, 1 KV head, D 8.
    q_lens, kv_lens = np.array([1, 1, 6, 3], np.int32), np.array([5, 9, 10, 3], np.int32)
    page_indices = np.array([[1, 2, 0], [3, 4, 5], [6, 7, 8], [9, 0, 0]], np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    distribution = jnp.array([2, 3, 4], jnp.int32)
    k = rng.standard_normal((1, 11, 4, 1, 8)).astype(np.float32)
    v = rng.standard_normal((1, 11, 4, 1, 8)).astype(np.float32)
    k[:, [0, 10]] = np.nan
    v[:, [0, 10]] = np.nan
    args = (jnp.asarray(rng.standard_normal((12, 2, 8)), jnp.float32), jnp.asarray(k),
            jnp.asarray(v), jnp.int32(0), jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu_q_lens), distribution)
    blocks = {"decode": BlockSizes(2, 8), "prefill": BlockSizes(4, 4), "mixed": BlockSizes(2, 8)}
    for path, bs in blocks.items():
        grid = grid_size(path, 12, 4, bs.q_tokens)
        head, _ = block_metadata(args[6], distribution, path, q_tokens=bs.q_tokens,
                                 num_tokens=12, grid=grid)
        assert int(head[1]) >= 1, f"path {path} has no active program"
    out = ragged_paged_attention_tpu(
        *args, sm_scale=0.35, interpret=pltpu.InterpretParams(detect_races=True),
        block_sizes=blocks)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    want = ragged_paged_attention_reference(*args, sm_scale=0.35)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=0)


def test_race_detector_sees_a_missing_dma_wait():
    """Control for the test above: a DMA whose destination is read before the wait is caught."""
    with kernel_device("tpu"):
        _racy_kernel()


def _racy_kernel():
    from jax.experimental import pallas as pl
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]            # read while the DMA may still be writing
        copy.wait()

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    pl.pallas_call(
        racy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
    )(x).block_until_ready()
    assert tpu_interpreter.races.races_found


@pytest.mark.parametrize("path", PATHS)
def test_gpu_programs_write_disjoint_tiles(path):
    """The GPU kernel has no shared scratch or async copies; its only hazard would be two
    programs storing the same output tile. Active programs own distinct query blocks that
    together cover exactly the path's tokens."""
    for seqs, distribution in BATCHES.values():
        cu = np.concatenate([[0], np.cumsum([s[0] for s in seqs] + [0] * (NUM_SEQS - len(seqs)))])
        cu_q_lens, dist = jnp.asarray(cu, jnp.int32), jnp.asarray(distribution, jnp.int32)
        for q_tokens in (1, 4, 8, 16):
            grid = grid_size(path, NUM_TOKENS, NUM_SEQS, q_tokens)
            head, blk_seqs = block_metadata(cu_q_lens, dist, path, q_tokens=q_tokens,
                                            num_tokens=NUM_TOKENS, grid=grid)
            first, num = int(head[0]), int(head[1])
            blocks = [first + b for b in range(num)]
            assert len(set(blocks)) == len(blocks) and num <= grid
            idx = PATHS.index(path)
            s_lo = 0 if idx == 0 else distribution[idx - 1]
            t_lo, t_hi = cu[s_lo], cu[distribution[idx]]
            covered = {t for blk in blocks for t in range(blk * q_tokens, (blk + 1) * q_tokens)}
            assert set(range(t_lo, t_hi)) <= covered
            # Each active program meets exactly the requests owning its tokens.
            for b in range(num):
                lo, hi = int(blk_seqs[2 * b]), int(blk_seqs[2 * b + 1])
                owners = {r for r in range(s_lo, distribution[idx])
                          for t in range(cu[r], cu[r + 1])
                          if (first + b) * q_tokens <= t < (first + b + 1) * q_tokens}
                assert set(range(lo, hi)) == owners


def test_merge_paths_picks_owner_and_zeroes_padding():
    cu_q_lens = jnp.array([0, 1, 2, 6, 9, 9], jnp.int32)
    distribution = jnp.array([2, 3, 4], jnp.int32)
    outs = {p: jnp.full((11, 1, 1), float(i + 1)) for i, p in enumerate(PATHS)}
    outs["decode"] = outs["decode"].at[5].set(jnp.nan)     # a row decode does not own
    merged = np.asarray(merge_paths(outs, cu_q_lens, distribution))[:, 0, 0]
    np.testing.assert_array_equal(merged, [1, 1, 2, 2, 2, 2, 3, 3, 3, 0, 0])


def test_resolve_impl(monkeypatch):
    assert ATTENTION_IMPLS == ("auto", "reference", "xla", "cpu", "tpu", "gpu")
    cpu = "cpu" if cpu_kernel_available() else "xla"
    platform_impl = {"cpu": cpu, "tpu": "tpu", "gpu": "gpu"}[jax.default_backend()]
    assert resolve_impl(None) == resolve_impl("auto") == platform_impl
    for impl in ("reference", "xla", "tpu", "gpu"):
        assert resolve_impl(impl) == impl
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")
    # Without the native kernel, auto keeps the jnp path and asking for it by name says why.
    monkeypatch.setattr(rpa_package, "cpu_kernel_available", lambda: False)
    monkeypatch.setattr(rpa_package, "cpu_kernel_status", lambda: (False, "no compiler"))
    if jax.default_backend() == "cpu":
        assert resolve_impl(None) == "xla"
    with pytest.raises(ValueError, match=r"impl='cpu'.*unavailable \(no compiler\)"):
        resolve_impl("cpu")


def test_dispatch_reference_and_bad_inputs():
    args = make_batch(*BATCHES["padding"], num_q_heads=9, num_kv_heads=3, head_dim=64,
                      dtype=jnp.float32, kv_dtype=jnp.float32)
    out = ragged_paged_attention(*args, sm_scale=0.125, impl="reference")
    want = ragged_paged_attention_reference(*args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    with pytest.raises(ValueError, match="impl must be one of"):
        ragged_paged_attention(*args, sm_scale=0.125, impl="cuda")
    bad_q = jnp.zeros((NUM_TOKENS, 8, 64), jnp.float32)                 # 8 % 3 != 0
    for impl in ("tpu", "gpu"):
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            ragged_paged_attention(bad_q, *args[1:], sm_scale=0.125, impl=impl, interpret=True)
        with pytest.raises(ValueError, match="k_scale"):
            ragged_paged_attention(*args, sm_scale=0.125, impl=impl, interpret=True,
                                   k_scale=jnp.float32(0.5))
    wide_q = jnp.zeros((NUM_TOKENS, 9, 128), jnp.float32)            # 128 does not split 192
    for impl in ("reference", "xla", "tpu", "gpu"):
        with pytest.raises(ValueError, match=r"head_dim of q \(128\) does not fit k_cache"):
            ragged_paged_attention(wide_q, *args[1:], sm_scale=0.125, impl=impl, interpret=True)
    odd_d = [jnp.zeros((NUM_TOKENS, 9, 48), jnp.float32),
             jnp.zeros((1, 4, PAGE_SIZE, 3, 48), jnp.float32)]
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        ragged_paged_attention(odd_d[0], odd_d[1], odd_d[1], *args[3:], sm_scale=0.1,
                               impl="gpu", interpret=True)


@pytest.mark.parametrize("impl", ["reference", "xla", "cpu", "tpu", "gpu"])
def test_rows_and_head_split_caches_give_the_same_output(impl):
    """The engine's rows ``[L, N, ps, KVH * D]`` and the same memory as ``[L, N, ps, KVH, D]``
    are one cache to every implementation: the outputs are equal, bit for bit."""
    if impl == "cpu":
        require_cpu_kernel()
    shapes = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.float32,
                  kv_dtype=jnp.float32)
    as_rows = make_batch(*BATCHES["mixed"], **shapes)
    as_heads = make_batch(*BATCHES["mixed"], **shapes, rows=False)
    assert as_rows[1].shape == (NUM_LAYERS, NUM_PAGES, PAGE_SIZE, 128)
    assert as_heads[1].shape == (NUM_LAYERS, NUM_PAGES, PAGE_SIZE, 2, 64)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125, impl=impl,
                                   interpret=True))
    with kernel_device(impl):
        out = np.asarray(fn(*as_rows))
        np.testing.assert_array_equal(out, np.asarray(fn(*as_heads)))
    assert np.isfinite(out).all() and np.abs(out).max() > 0.01


def test_tuning_table_and_fallback():
    # Table hit for the default model, fitted to the bucket.
    bs = get_block_sizes("tpu", "decode", head_dim=64, group=3, page_size=16, kv_bits=16,
                         max_pages=512, num_tokens=16)
    assert bs == BlockSizes(q_tokens=8, kv_tokens=256)
    # Unknown shapes: the fallback rule, made legal for the backend.
    assert fallback_block_sizes("tpu", "prefill", 256, 32) == BlockSizes(128, 64)
    tpu = get_block_sizes("tpu", "mixed", head_dim=96, group=5, page_size=12, kv_bits=32,
                          max_pages=3, num_tokens=20)
    assert tpu.kv_tokens % 12 == 0 and tpu.kv_tokens <= 36 and tpu.q_tokens == 20
    for path in PATHS:
        gpu = get_block_sizes("gpu", path, head_dim=128, group=7, page_size=12, kv_bits=32,
                              max_pages=9, num_tokens=1000)
        rows = gpu.q_tokens * gpu_group_pad(7, gpu.q_tokens)
        assert rows & (rows - 1) == 0 and 16 <= rows <= 128
        assert gpu.kv_tokens >= 16 and gpu.kv_tokens & (gpu.kv_tokens - 1) == 0
        assert gpu.num_stages * gpu.kv_tokens * 2 * 128 * 4 <= 96 * 1024
    with pytest.raises(ValueError, match="path must be one of"):
        get_block_sizes("gpu", "chunk", head_dim=64, group=3, page_size=16, kv_bits=16,
                        max_pages=4, num_tokens=16)
    with pytest.raises(ValueError, match="q_tokens"):
        BlockSizes(q_tokens=0, kv_tokens=16)


def _engine_attention_shapes():
    """Every attention shape ``(T, R, P)`` of the buckets the engine compiles with default
    ServerArgs for SmolLM2 (8k context). The kernels see only shapes (the entry point reaches
    them as ``distribution`` values), so entry points with equal shapes lower identically."""
    from pdjax.config import ServerArgs
    from pdjax.sched.buckets import Buckets

    args = ServerArgs()
    keys = Buckets.create(chunked_prefill_size=args.chunked_prefill_size,
                          max_running_requests=args.max_running_requests,
                          max_pages_per_seq=-(-8192 // args.page_size)).all_keys()
    shapes = sorted({(k.num_tokens, k.num_rows, k.pages_per_seq) for k in keys})
    assert {k.entry for k in keys} == {"decode", "extend"}
    return shapes, args


@pytest.mark.parametrize("impl,platform,custom_call", [
    ("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_kernels_lower_for_every_engine_bucket(impl, platform, custom_call):
    """Cross-lowering on CPU catches Pallas-level lowering errors for every engine shape
    (SmolLM2: 9 query heads over 3 KV heads, head_dim 64, 30 layers, bf16 KV)."""
    with lowering_context(platform):
        _lower_engine_buckets(impl, platform, custom_call)


def _lower_engine_buckets(impl, platform, custom_call):
    shapes_trp, args = _engine_attention_shapes()
    assert len(shapes_trp) >= 3
    S = jax.ShapeDtypeStruct
    pool = S((30, args.num_pages, args.page_size, 3, 64), jnp.bfloat16)

    def arg_shapes(num_tokens, num_rows, pages_per_seq, kv_pool):
        return (S((num_tokens, 9, 64), jnp.bfloat16), kv_pool, kv_pool, S((), jnp.int32),
                S((num_rows,), jnp.int32), S((num_rows, pages_per_seq), jnp.int32),
                S((num_rows + 1,), jnp.int32), S((3,), jnp.int32))

    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125, impl=impl))
    for trp in shapes_trp:
        text = fn.trace(*arg_shapes(*trp, pool)).lower(lowering_platforms=(platform,)).as_text()
        assert text.count(custom_call) == 3, trp          # decode, prefill, mixed kernels
    # fp8 KV with scales, sliding window and soft cap lower too (largest shape).
    fp8_pool = S(pool.shape, jnp.float8_e4m3fn)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125, impl=impl,
                                   sliding_window=128, soft_cap=30.0, k_scale=0.5, v_scale=0.5))
    lowered = fn.trace(*arg_shapes(*shapes_trp[-1], fp8_pool)).lower(
        lowering_platforms=(platform,))
    assert lowered.as_text().count(custom_call) == 3


def test_package_import_is_light():
    """The GPU check host has only jax, numpy and pytest: importing the kernels (and pdjax)
    must not pull in flax, zmq or transformers."""
    code = ("import sys, pdjax.pallas_kernels.ragged_paged_attention as m; "
            "import pdjax.pallas_kernels.ragged_paged_attention.kernel_gpu, "
            "pdjax.pallas_kernels.ragged_paged_attention.kernel_tpu; "
            "print(sorted(n for n in ('flax', 'zmq', 'transformers', 'torch', 'aiohttp', "
            "'msgpack') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == "[]"


def test_xla_path_picks_long_or_short_tiles_per_request(monkeypatch):
    """Default tiles: each request takes long tiles (q_len and kv_len over the thresholds) or
    short ones (lax.cond per request); both kinds in one batch equal the oracle. The thresholds
    are scaled down to the test envelope (48 tokens, 96 cached tokens per request)."""
    for name, value in (("DEFAULT_Q_BLOCK", 16), ("DEFAULT_KV_BLOCK_TOKENS", 32),
                        ("LONG_TILE_MIN_KV", 64), ("SHORT_Q_BLOCK", 8),
                        ("SHORT_KV_BLOCK_TOKENS", 16)):
        monkeypatch.setattr(xla_module, name, value)
    for config in ("gqa3_d64_f32", "gqa4_d64_bf16_window_softcap"):
        cfg = CONFIGS[config]
        fn = jax.jit(functools.partial(
            ragged_paged_attention_xla, sm_scale=cfg.head_dim ** -0.5,
            sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap))
        # Two decode rows; long: (20, 90) and (17, 70); short: (5, 60), (4, 20) (q_len) and
        # (16, 40) (kv_len under the threshold).
        seqs = [(1, 40), (1, 77), (20, 90), (5, 60), (17, 70), (4, 20)]
        _check_xla(cfg, fn, "long and short tiles", seqs, (2, 2, 6), seed=3)
        _check_xla(cfg, fn, "short only", [(16, 40), (16, 80), (16, 33)], (0, 3, 3), seed=4)
