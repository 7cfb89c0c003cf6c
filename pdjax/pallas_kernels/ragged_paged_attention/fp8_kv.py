"""FP8 GQA KV with real scales: float8_e4m3fn values and one float32 scale per token per KV
head (DESIGN.md §5).

The cache of an FP8 GQA model is four buffers sharing the page table (``gqa_cache_spec``)::

    k_cache  [L, N, ps, KVH, D] (or rows [.., KVH * D])  float8_e4m3fn   k / k_scale
    k_scale  [L, N, ps, KVH]                             float32         amax(|k|) / 448
    v_cache, v_scale                                     the same for V

A token's head is quantized on its own at the KV write, so a write never touches the values or
scales of other tokens (a scale per page would have to requantize the page's earlier tokens
when a larger value arrives) and a read dequantizes with one multiply per (token, head): the
attention paths fold the K scale into the scores and the V scale into the probabilities, or
multiply the gathered block. The scale costs 4 bytes per (token, head) beside ``D`` bytes of
values (6.25% at head_dim 64, 3.1% at 128). Plain amax / 448 scales (not powers of two): the
relative error of a value is that of e4m3 (at most 2**-4), the token's largest value maps to
448 exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)       # 448
# A head of all zeros gets this scale (any positive value; its values quantize to 0).
_MIN_AMAX = 1e-30


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` (any float dtype) -> ``(values [..., D] float8_e4m3fn, scale [...]
    float32)`` with ``values * scale ~= x``: ``scale = amax(|x|) / 448`` over the last axis
    (one head of one token). NaN in ``x`` propagates to its scale."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.maximum(amax, _MIN_AMAX) / FP8_MAX
    values = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, scale


def dequantize_kv(values: jax.Array, scale: jax.Array) -> jax.Array:
    """``values [..., D]`` times ``scale [...]`` as float32 ``[..., D]``."""
    return values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def check_scale_caches(k_cache: jax.Array, k_scales, v_scales) -> None:
    """Static checks of per-token scale caches beside a ``[L, N, ps, KVH, D]`` (5-dim view)
    cache: both or neither given, each ``[L, N, ps, KVH]`` float32, the cache float8_e4m3fn.
    Raises ``ValueError`` naming the field."""
    if k_scales is None and v_scales is None:
        return
    if k_scales is None or v_scales is None:
        raise ValueError("k_scales and v_scales: give both or neither")
    want = tuple(k_cache.shape[:4])
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(s.shape) != want or s.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {list(want)} (layers, num_pages, "
                             f"page_size, num_kv_heads), got {s.dtype} {list(s.shape)}")
    if k_cache.dtype != FP8_DTYPE:
        raise ValueError(f"k_scales/v_scales come with a float8_e4m3fn cache, got "
                         f"k_cache {k_cache.dtype}")


def load_kv(cache: jax.Array, scales: jax.Array | None, static_scale: float | None, layer,
            pages: jax.Array) -> jax.Array:
    """Gather ``cache[layer, pages]`` (``[L, N, ps, KVH, D]``) as float32, dequantized:
    times ``scales[layer, pages]`` per (token, head) when given, times ``static_scale`` when
    given. Returns ``[*pages.shape, ps, KVH, D]`` float32."""
    x = cache[layer, pages].astype(jnp.float32)
    if scales is not None:
        x = x * scales[layer, pages][..., None]
    if static_scale is not None:
        x = x * static_scale
    return x
