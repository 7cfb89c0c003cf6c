"""Block sizes for the MLA attention kernels.

One program owns one query token (all its heads, or ``heads_per_block`` of them on GPU) and
walks its candidate cache positions ``block_tokens`` at a time: the top-k list (sparse) or
positions ``0..p`` (dense). Entries are starting points from VMEM/register budgets, not yet
measured on hardware.

Legal sizes:
  * TPU: ``block_tokens`` is a multiple of ``page_size`` (dense chunks DMA whole pages). The
    top-k list is padded to a multiple of it and laid out ``[chunks, block_tokens]``.
  * GPU (Triton): ``block_tokens`` and ``heads_per_block`` are powers of two >= 16.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MlaBlockSizes:
    """Static block configuration.

    Attributes:
      block_tokens: cached tokens (top-k entries) gathered per online-softmax step.
      heads_per_block: query heads per GPU program (TPU programs take every head).
      num_warps, num_stages: Triton launch parameters (GPU only).
    """

    block_tokens: int
    heads_per_block: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_tokens", "heads_per_block", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MlaBlockSizes.{name} must be a positive int, got {v!r}")


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def get_block_sizes(backend: str, *, num_heads: int, dim: int, page_size: int,
                    span: int) -> MlaBlockSizes:
    """Legal block sizes for one call.

    Args:
      backend: ``"tpu"`` or ``"gpu"``.
      num_heads: query heads; dim: ``kv_lora_rank + rope_dim``; page_size: cache page size;
      span: top-k width (sparse) or page-table width in tokens (dense).

    Raises:
      ValueError: unknown backend.
    """
    if backend == "tpu":
        # 128 rows of 576 bf16 = 144 KiB per buffer (x2 slots); whole pages.
        want = 256 if dim <= 256 else 128
        return MlaBlockSizes(block_tokens=max(page_size, want // page_size * page_size))
    if backend == "gpu":
        heads = min(64, max(16, _pow2_ceil(num_heads)))
        tokens = 32 if dim > 256 else 64
        tokens = max(16, min(tokens, _pow2_ceil(span)))
        return MlaBlockSizes(block_tokens=tokens, heads_per_block=heads,
                             num_warps=8 if dim > 256 else 4, num_stages=2)
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
