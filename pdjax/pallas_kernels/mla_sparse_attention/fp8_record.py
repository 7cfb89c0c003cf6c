"""The FP8 latent KV record of MLA (``--kv-cache-dtype fp8_e4m3``): quantize on write,
dequantize on read, and the planes that hold it.

FlashMLA's FP8 KV record (DeepSeek-V3.2), one per token per layer::

    [ c_kv: 512 float8_e4m3fn | scales: 4 float32 (one per 128 values) | k_pe: 64 bfloat16 ]
      512 B                     16 B                                      128 B   = 656 B

``c_kv[g*128:(g+1)*128] ~= q[g*128:(g+1)*128] * scale[g]``; the rotary part stays bf16 (its
range is the position's, FP8 would lose it). pdjax keeps the same numbers in parallel
layer-major planes that share the page table, so each plane is a plain typed array the kernels
index (no byte reinterpretation in a kernel):

    GPU / CPU (row_align 1): exactly the 656 bytes per token per layer
        "latent"        [L, N, ps, C]    float8_e4m3fn
        "latent_scale"  [L, N, ps, G]    float32          G = ceil(C / 128)
        "latent_rope"   [L, N, ps, R]    bfloat16
    TPU (row_align 128, whole lanes): 768 bytes for DeepSeek (bf16 KV: 1280)
        "latent"        [L, N, ps, C']   float8_e4m3fn    C' = C rounded up to 128
        "latent_rope"   [L, N, ps, W]    bfloat16         [ k_pe: R | scales: G | 0 ... ]
                                                          W = R + G rounded up to 128

The scales are powers of two (UE8M0, as DeepSeek's ``scale_fmt: ue8m0``): the smallest
``2^e >= amax / 448``. That keeps them exact in bfloat16, which is what lets the TPU split
carry them in the rope plane's spare lanes as the same numbers, and makes the dequantize a
shift. Error bound per value (e4m3: 3 mantissa bits, subnormal step ``2^-9``)::

    |x - dequantize(quantize(x))| <= |x| * 2^-4 + scale * 2^-10

plus the bf16 rounding of ``k_pe`` (``|x| * 2^-8``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdjax.pallas_kernels.lanes import TPU_LANES

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0              # largest finite float8_e4m3fn
SCALE_GROUP = 128            # latent values per scale
ROPE_DTYPE = jnp.bfloat16
SCALE_DTYPE = jnp.float32


class Fp8Latent(NamedTuple):
    """The planes of an FP8 latent cache (see the module docstring). ``scale`` is None in the
    TPU split, where the scales sit in ``rope[..., R:R + G]``."""

    latent: jax.Array
    scale: jax.Array | None
    rope: jax.Array


def num_scale_groups(kv_lora_rank: int) -> int:
    """``G = ceil(kv_lora_rank / 128)``: scales per token."""
    return -(-kv_lora_rank // SCALE_GROUP)


@dataclasses.dataclass(frozen=True)
class Fp8LatentLayout:
    """Plane widths of the FP8 record for a model with ``kv_lora_rank`` (C) and
    ``rope_dim`` (R) on a platform whose rows are padded to ``row_align`` lanes."""

    kv_lora_rank: int
    rope_dim: int
    row_align: int = 1

    def __post_init__(self):
        if self.kv_lora_rank < 1 or self.rope_dim < 1:
            raise ValueError(f"kv_lora_rank, rope_dim must be >= 1, got "
                             f"{self.kv_lora_rank}, {self.rope_dim}")
        if self.row_align not in (1, TPU_LANES):
            raise ValueError(f"row_align: the FP8 record is laid out for 1 (GPU, CPU) or "
                             f"{TPU_LANES} (TPU) lanes, got {self.row_align}")

    @property
    def groups(self) -> int:
        return num_scale_groups(self.kv_lora_rank)

    @property
    def split_scales(self) -> bool:
        """True: scales in a float32 plane of their own (656-byte record, rows unpadded);
        False: in the rope plane's spare lanes (TPU, whole lanes)."""
        return self.row_align == 1

    def planes(self) -> tuple[tuple[str, int, jnp.dtype], ...]:
        """``(buffer name, row width, dtype)`` of each plane, in cache order."""
        a = self.row_align
        latent = ("latent", -(-self.kv_lora_rank // a) * a, jnp.dtype(FP8_DTYPE))
        if self.split_scales:
            return (latent, ("latent_scale", self.groups, jnp.dtype(SCALE_DTYPE)),
                    ("latent_rope", self.rope_dim, jnp.dtype(ROPE_DTYPE)))
        width = -(-(self.rope_dim + self.groups) // a) * a
        return (latent, ("latent_rope", width, jnp.dtype(ROPE_DTYPE)))

    def bytes_per_token(self) -> int:
        """Bytes of one token's record in one layer (656 for DeepSeek on GPU)."""
        return sum(w * d.itemsize for _, w, d in self.planes())


def is_fp8_latent(caches: dict) -> bool:
    """Whether a cache dict holds the FP8 record (has a ``"latent_rope"`` plane)."""
    return "latent_rope" in caches


def latent_view(caches: dict):
    """The latent cache as the MLA kernels take it: the ``"latent"`` array, or an
    ``Fp8Latent`` of the FP8 planes."""
    if not is_fp8_latent(caches):
        return caches["latent"]
    return Fp8Latent(caches["latent"], caches.get("latent_scale"), caches["latent_rope"])


def ue8m0_scale(amax: jax.Array) -> jax.Array:
    """The smallest power of two ``>= amax / 448`` (float32; 1 where ``amax`` is 0)."""
    amax = amax.astype(jnp.float32)
    ratio = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    mant, exp = jnp.frexp(ratio)            # ratio = mant * 2^exp, mant in [0.5, 1): exact
    exp = jnp.where(mant == 0.5, exp - 1, exp)
    return jnp.ldexp(jnp.ones_like(ratio), exp)


def quantize_groups(x: jax.Array, group: int = SCALE_GROUP) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> (``q [..., D]`` float8_e4m3fn, ``scale [..., ceil(D / group)]``
    float32): one power-of-two scale per ``group`` values (the last group may be short)."""
    d = x.shape[-1]
    g = -(-d // group)
    xf = x.astype(jnp.float32)
    padded = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, g * group - d)])
    blocks = padded.reshape(*x.shape[:-1], g, group)
    scale = ue8m0_scale(jnp.max(jnp.abs(blocks), axis=-1))
    q = jnp.clip(blocks / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(*x.shape[:-1], g * group)[..., :d], scale


def dequantize_groups(q: jax.Array, scale: jax.Array, group: int = SCALE_GROUP) -> jax.Array:
    """Inverse of ``quantize_groups``: ``q [..., D]`` times its group's scale, float32."""
    d = q.shape[-1]
    full = jnp.repeat(scale.astype(jnp.float32), group, axis=-1)[..., :d]
    return q.astype(jnp.float32) * full


def quantize_rows(layout: Fp8LatentLayout, c_kv: jax.Array, k_pe: jax.Array) -> dict:
    """The planes' rows of ``T`` tokens: ``c_kv [T, C]``, ``k_pe [T, R]`` -> ``{buffer name:
    [T, width]}`` in each plane's dtype, pad lanes zero."""
    c, r = layout.kv_lora_rank, layout.rope_dim
    if c_kv.shape[-1] != c or k_pe.shape[-1] != r:
        raise ValueError(f"c_kv/k_pe widths {c_kv.shape[-1]}/{k_pe.shape[-1]} != layout "
                         f"{c}/{r}")
    q, scale = quantize_groups(c_kv)
    widths = {name: (w, d) for name, w, d in layout.planes()}

    def pad(x, name):
        w, d = widths[name]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w - x.shape[-1])]).astype(d)

    out = {"latent": pad(q, "latent")}
    if layout.split_scales:
        out["latent_scale"] = scale.astype(SCALE_DTYPE)
        out["latent_rope"] = k_pe.astype(ROPE_DTYPE)
    else:       # the scales are powers of two: exact in bf16
        out["latent_rope"] = pad(jnp.concatenate([k_pe.astype(jnp.float32), scale], -1),
                                 "latent_rope")
    return out


def dequantize_rows(latent: jax.Array, scale: jax.Array | None, rope: jax.Array, *,
                    kv_lora_rank: int, rope_dim: int) -> jax.Array:
    """Rows gathered from the planes (any leading shape, ``scale`` None for the TPU split)
    -> ``[..., C + R]`` float32 latent rows ``[c_kv | k_pe]``."""
    c, r = kv_lora_rank, rope_dim
    g = num_scale_groups(c)
    if scale is None:
        scale = rope[..., r:r + g]
    c_kv = dequantize_groups(latent[..., :c], scale)
    return jnp.concatenate([c_kv, rope[..., :r].astype(jnp.float32)], axis=-1)


def write_rows(caches: dict, layout: Fp8LatentLayout, layer, c_kv: jax.Array, k_pe: jax.Array,
               slot_mapping: jax.Array) -> dict:
    """Quantize ``T`` tokens' ``c_kv [T, C]`` / ``k_pe [T, R]`` and scatter them into every
    plane of ``caches`` at ``layer`` and the slots ``slot_mapping [T]`` (out-of-range slots,
    the padding rows', are dropped as by ``.at[].set``). Returns the updated dict."""
    rows = quantize_rows(layout, c_kv, k_pe)
    caches = dict(caches)
    for name, value in rows.items():
        buf = caches[name]
        ps = buf.shape[2]
        caches[name] = buf.at[layer, slot_mapping // ps, slot_mapping % ps].set(value)
    return caches


def layout_of(latent: Fp8Latent, kv_lora_rank: int, rope_dim: int) -> Fp8LatentLayout:
    """The layout these planes were built with (checked); ``ValueError`` naming the plane."""
    align = 1 if latent.scale is not None else TPU_LANES
    layout = Fp8LatentLayout(kv_lora_rank, rope_dim, align)
    arrays = {"latent": latent.latent, "latent_scale": latent.scale, "latent_rope": latent.rope}
    for name, width, dtype in layout.planes():
        a = arrays[name]
        if a is None or a.ndim != 4 or a.shape[3] != width or a.dtype != dtype:
            got = None if a is None else (a.shape, a.dtype)
            raise ValueError(f"kv_cache.{name}: expected [L, N, page_size, {width}] {dtype} "
                             f"for kv_lora_rank {kv_lora_rank}, rope {rope_dim}, got {got}")
        if a.shape[:3] != latent.latent.shape[:3]:
            raise ValueError(f"kv_cache.{name}: leading dims {a.shape[:3]} != latent's "
                             f"{latent.latent.shape[:3]}")
    return layout
