"""Metadata shared by the TPU and GPU kernels: which query blocks each path covers.

``distribution = (i, j, k)`` splits the requests into three paths (DESIGN.md §2):

    requests   [0 ........ i) [i ........ j) [j ........ k) [k .. R)
    path        decode          prefill         mixed          padding
    tokens     [0 .. cu[i])   [cu[i] .. cu[j]) [cu[j] .. cu[k])  (rows past cu[k] are padding)

Each path runs its own kernel instance with its own block sizes over a static grid. Program
``b`` of a path takes query block ``first_block + b`` (blocks of ``q_tokens`` tokens aligned
to 0, so a block may straddle two requests or two paths); programs past ``num_blocks`` do
nothing. For every program the wrapper precomputes the requests it meets,
``[blk_seqs[2b], blk_seqs[2b+1])``, so the kernels never search ``cu_q_lens`` themselves.
Rows a path does not own are ignored when ``merge_paths`` picks each token's output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.ragged_paged_attention.tuning import PATHS, get_block_sizes

# Finite, so that exp(m_prev - m_new) stays 1 (not NaN) for rows that saw no key yet.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def path_seq_range(distribution: jax.Array, path: str) -> tuple[jax.Array, jax.Array]:
    """``(first, end)`` request indices of ``path``, int32 scalars."""
    idx = PATHS.index(path)
    lo = jnp.int32(0) if idx == 0 else distribution[idx - 1]
    hi = distribution[idx]
    lo = jnp.minimum(lo, hi)        # tolerate a malformed, non-monotone triple
    return lo, hi


def grid_size(path: str, num_tokens: int, num_seqs: int, q_tokens: int) -> int:
    """Static number of programs that always covers the path's query blocks.

    Decode rows come first and have one token each, so the decode path needs at most
    ``min(T, R)`` tokens from 0; the other paths may start anywhere in ``[0, T)``.
    """
    if path == "decode":
        return max(1, cdiv(min(num_tokens, num_seqs), q_tokens))
    return max(1, cdiv(num_tokens, q_tokens))


def block_metadata(cu_q_lens: jax.Array, distribution: jax.Array, path: str, *,
                   q_tokens: int, num_tokens: int, grid: int) -> tuple[jax.Array, jax.Array]:
    """Per-path and per-program metadata for one kernel instance.

    Returns:
      head: ``[3]`` int32 ``(first_block, num_blocks, 0)``; program ``b`` handles query block
        ``first_block + b`` when ``b < num_blocks``.
      blk_seqs: ``[2 * grid]`` int32, for program ``b`` the requests ``[blk_seqs[2b],
        blk_seqs[2b+1])`` of this path that own a token of its block (empty when idle).
    """
    s_lo, s_hi = path_seq_range(distribution, path)
    t_lo = jnp.clip(cu_q_lens[s_lo], 0, num_tokens)
    t_hi = jnp.clip(cu_q_lens[s_hi], t_lo, num_tokens)
    first_block = t_lo // q_tokens
    num_blocks = jnp.where(t_hi > t_lo, (t_hi + q_tokens - 1) // q_tokens - first_block, 0)
    num_blocks = jnp.minimum(num_blocks, grid)

    b = jnp.arange(grid, dtype=jnp.int32)
    start = jnp.maximum((first_block + b) * q_tokens, t_lo)
    end = jnp.minimum((first_block + b + 1) * q_tokens, t_hi)
    num_seqs = cu_q_lens.shape[0] - 1
    # First request whose tokens end after `start`; requests that start before `end`.
    seq_lo = jnp.searchsorted(cu_q_lens[1:], start, side="right").astype(jnp.int32)
    seq_hi = jnp.searchsorted(cu_q_lens[:num_seqs], end, side="left").astype(jnp.int32)
    seq_lo = jnp.clip(seq_lo, s_lo, s_hi)
    seq_hi = jnp.clip(seq_hi, seq_lo, s_hi)
    active = (b < num_blocks) & (end > start)
    seq_lo = jnp.where(active, seq_lo, 0)
    seq_hi = jnp.where(active, seq_hi, 0)
    head = jnp.stack([first_block, num_blocks, jnp.int32(0)]).astype(jnp.int32)
    blk_seqs = jnp.stack([seq_lo, seq_hi], axis=1).reshape(-1).astype(jnp.int32)
    return head, blk_seqs


def merge_paths(outputs: dict[str, jax.Array], cu_q_lens: jax.Array,
                distribution: jax.Array) -> jax.Array:
    """Pick each token's row from the path that owns it; padding rows become 0.

    Args:
      outputs: path name -> ``[T, num_q_heads, head_dim]``; rows a path does not own may hold
        anything (NaN included).
    """
    any_out = next(iter(outputs.values()))
    num_tokens = any_out.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None, None]
    out = jnp.zeros_like(any_out)
    for path in reversed(PATHS):
        if path not in outputs:
            continue
        s_lo, s_hi = path_seq_range(distribution, path)
        own = (t >= cu_q_lens[s_lo]) & (t < cu_q_lens[s_hi])
        out = jnp.where(own, outputs[path], out)
    return out


def check_kernel_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        k_scale, v_scale) -> None:
    """Static checks shared by the kernels; raises ``ValueError`` naming the field."""
    from pdjax.pallas_kernels.ragged_paged_attention.reference import validate_inputs

    validate_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if k_cache.dtype not in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn):
        raise ValueError(
            f"k_cache/v_cache must be float32, bfloat16 or float8_e4m3fn, got {k_cache.dtype}")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a Python float or None (static), got {type(value)}")


def run_kernel_paths(platform: str, call_path, q, k_cache, v_cache, layer, kv_lens,
                     page_indices, cu_q_lens, distribution, *, block_sizes, **kwargs):
    """The host-side wrapper both kernels share: check the contract, clamp the page table
    (an out-of-range index would be an out-of-bounds DMA / load; the reference clamps too),
    flatten it, run ``call_path`` once per path of ``PATHS`` with that path's block sizes
    (``block_sizes[path]`` or the ``platform``'s tuning table), and merge the paths' rows.

    ``call_path(path, bs, q, k_cache, v_cache, layer [] int32, kv_lens, flat_pages [R * P],
    cu_q_lens, distribution, **kwargs)`` (the caches in the layout the kernel took) returns ``[T, num_q_heads, head_dim]``; ``kwargs``
    carries ``sm_scale``, ``sliding_window``, ``soft_cap``, ``k_scale``, ``v_scale`` and
    ``interpret``. Raises ``ValueError`` naming the field."""
    from pdjax.pallas_kernels.ragged_paged_attention.reference import num_kv_heads_of

    check_kernel_inputs(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, distribution,
                        kwargs["k_scale"], kwargs["v_scale"])
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size = k_cache.shape[1:3]
    num_kv_heads = num_kv_heads_of(k_cache, head_dim)
    kv_bits = jnp.dtype(k_cache.dtype).itemsize * 8
    flat_pages = jnp.clip(page_indices, 0, num_pages - 1).reshape(-1)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    outputs = {}
    for path in PATHS:
        bs = (block_sizes or {}).get(path) or get_block_sizes(
            platform, path, head_dim=head_dim, group=num_q_heads // num_kv_heads,
            page_size=page_size, kv_bits=kv_bits, max_pages=page_indices.shape[1],
            num_tokens=num_tokens)
        outputs[path] = call_path(path, bs, q, k_cache, v_cache, layer, kv_lens, flat_pages,
                                  cu_q_lens, distribution, **kwargs)
    return merge_paths(outputs, cu_q_lens, distribution)
