"""FP8 block-scaled checkpoints on the host: the ``quantization_config`` of a config.json, the
numpy block (de)quantization, and ``LazyStack``, a stack of memory-mapped weights that each
device reads its own shard from.

DeepSeek-V3 / V3.2 / GLM-5 ship their linear weights as float8 e4m3 with one float32 scale per
128 x 128 block (``quant_method: fp8``, ``weight_block_size: [128, 128]``; DeepSeek-V3 §3.3)::

    X.weight            float8_e4m3fn [out, in]
    X.weight_scale_inv  float32       [ceil(out/128), ceil(in/128)]

    W[o, i] = X.weight[o, i] * X.weight_scale_inv[o // 128, i // 128]

Edge blocks are partial (``out = 192`` is a block of 128 and one of 64). ``scale_fmt: ue8m0``
says every scale is a power of two. The model keeps the fp8 bytes and their scales on the
device (``linear.Fp8BlockWeight``) and dequantizes one layer at a time (DESIGN.md §2, FP8
weights). Nothing here imports JAX.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

FP8_BLOCK_SIZE = 128
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)      # 448
SCALE_SUFFIX = "_scale_inv"      # the scale of parameter ``w`` is ``w_scale_inv`` (vLLM, SGLang)
SCALE_FMTS = (None, "ue8m0")


def quantization_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``DeepseekConfig`` fields of a config.json's ``quantization_config``:
    ``weight_block_size`` (0: no quantization; 128: FP8 block-scaled), ``scale_fmt``
    (``None`` or ``"ue8m0"``) and ``modules_to_not_convert`` (tuple of module-name substrings
    whose weights stay unquantized, as transformers matches them).

    Raises ``ValueError`` naming the field (``quantization_config.quant_method: 'awq' is not
    supported (fp8 only)``) for any other method, format, block size or activation scheme."""
    q = cfg.get("quantization_config")
    if q is None:
        return {}
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config: expected an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not supported "
                         "(fp8 only)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (e4m3 only)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme: {scheme!r} is not supported "
                         "(dynamic only: activations are not quantized)")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError("quantization_config.weight_block_size: missing (per-tensor FP8 is not "
                         f"supported; block-scaled [{FP8_BLOCK_SIZE}, {FP8_BLOCK_SIZE}] only)")
    if not isinstance(block, list) or block != [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE]:
        raise ValueError(f"quantization_config.weight_block_size: {block!r} is not supported "
                         f"([{FP8_BLOCK_SIZE}, {FP8_BLOCK_SIZE}] only)")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"quantization_config.scale_fmt: {scale_fmt!r} is not supported "
                         "(ue8m0 or none)")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert: expected a list of "
                         f"names, got {skip!r}")
    return dict(weight_block_size=FP8_BLOCK_SIZE, scale_fmt=scale_fmt,
                modules_to_not_convert=tuple(skip))


def num_blocks(n: int, block: int = FP8_BLOCK_SIZE) -> int:
    return -(-n // block)


def expand_scales(scale: np.ndarray, shape: tuple[int, int], block: int = FP8_BLOCK_SIZE
                  ) -> np.ndarray:
    """``scale [..., ceil(R/B), ceil(C/B)]`` -> ``[..., R, C]`` (each block's value repeated;
    edge blocks cut to ``shape``)."""
    out = np.repeat(np.repeat(scale, block, axis=-2), block, axis=-1)
    return out[..., :shape[0], :shape[1]]


def dequantize(q: np.ndarray, scale: np.ndarray, block: int = FP8_BLOCK_SIZE) -> np.ndarray:
    """float32 ``q * scale`` per block: ``q [..., R, C]`` (any float dtype, fp8 included),
    ``scale [..., ceil(R/B), ceil(C/B)]`` -> ``[..., R, C]`` float32."""
    q = np.asarray(q)
    return q.astype(np.float32) * expand_scales(np.asarray(scale, np.float32), q.shape[-2:], block)


def quantize(w: np.ndarray, *, ue8m0: bool = False, block: int = FP8_BLOCK_SIZE
             ) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantize ``w [R, C]`` (float): ``(q [R, C] float8_e4m3fn, scale [ceil(R/B),
    ceil(C/B)] float32)`` with each block's largest magnitude at the e4m3 maximum (448), or
    with ``ue8m0`` the power of two at or above it (DeepSeek-V3.2's scales). An all-zero block
    gets scale 1. ``dequantize(q, scale)`` is within e4m3's rounding of ``w``."""
    w = np.asarray(w, np.float32)
    R, C = w.shape
    rb, cb = num_blocks(R, block), num_blocks(C, block)
    padded = np.zeros((rb * block, cb * block), np.float32)
    padded[:R, :C] = w
    amax = np.abs(padded.reshape(rb, block, cb, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    q = (w / expand_scales(scale, (R, C), block)).astype(FP8_DTYPE)
    return q, scale


def check_ue8m0(scale: np.ndarray, name: str) -> None:
    """``ValueError`` naming ``name`` unless every scale is a positive power of two."""
    mantissa, _ = np.frexp(np.asarray(scale, np.float32))
    if not np.all(mantissa == 0.5):
        raise ValueError(f"{name}: scale_fmt 'ue8m0' needs powers of two, got "
                         f"{np.asarray(scale).ravel()[np.argmax(mantissa != 0.5)]!r}")


class LazyStack:
    """``np.stack(parts)`` without making it: indexing reads only the selected slices of each
    part (memory-mapped weights, their ``.T`` views, or nested ``LazyStack``s), so
    ``jax.make_array_from_callback`` gives every device just its shard's bytes
    (``params.place_params``). ``shape = (len(parts), *parts[0].shape)``; every part has the
    same shape and dtype (``ValueError`` otherwise)."""

    def __init__(self, parts):
        self.parts = list(parts)
        if not self.parts:
            raise ValueError("LazyStack needs at least one part")
        first = self.parts[0]
        for p in self.parts:
            if tuple(p.shape) != tuple(first.shape) or p.dtype != first.dtype:
                raise ValueError(f"LazyStack parts differ: {p.shape} {p.dtype} vs "
                                 f"{first.shape} {first.dtype}")
        self.shape = (len(self.parts), *first.shape)
        self.dtype = np.dtype(first.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, index) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        if index and index[0] is Ellipsis:
            index = (slice(None),) * (self.ndim - len(index) + 1) + index[1:]
        head, rest = (index[0], index[1:]) if index else (slice(None), ())
        if isinstance(head, slice):
            return np.stack([np.asarray(self.parts[i][rest])
                             for i in range(len(self.parts))[head]])
        return np.asarray(self.parts[head][rest])

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)
