"""Small building blocks: RMSNorm and rotary embeddings (plain, linear, llama3, YaRN).

RoPE follows transformers' ``modeling_rope_utils`` (the oracle in tests): inverse frequencies
in float32, ``rotate_half`` (non-interleaved) application, YaRN's attention factor applied to
cos/sin.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` computed in float32; returns ``x.dtype``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, params: dict) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the cos/sin scale (YaRN's mscale).

    Raises ``ValueError`` for an unknown ``rope_type``.
    """
    rope_type = params.get("rope_type", "default")
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
    inv_freq = (1.0 / (theta ** exponent)).astype(np.float32)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope_type == "yarn":
        orig = float(params["original_max_position_embeddings"])

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = params.get("attention_factor")
        if attn is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def corr_dim(rot):
            return head_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
        extrap = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrap) + inv_freq * extrap
        return inv.astype(np.float32), float(attn)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float) -> jax.Array:
    """Rotate ``x [T, heads, head_dim]`` by ``positions [T]`` (rotate-half layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)                           # [T, D]
    cos = (jnp.cos(emb) * scale)[:, None, :]
    sin = (jnp.sin(emb) * scale)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
