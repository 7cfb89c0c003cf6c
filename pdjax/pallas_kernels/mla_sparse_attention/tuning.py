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

from pdjax.pallas_kernels.block_sizes import TokenBlockSizes, pow2_ceil


class MlaBlockSizes(TokenBlockSizes):
    """Block configuration of this kernel (fields and checks: ``TokenBlockSizes``)."""


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
        heads = min(64, max(16, pow2_ceil(num_heads)))
        tokens = 32 if dim > 256 else 64
        tokens = max(16, min(tokens, pow2_ceil(span)))
        return MlaBlockSizes(block_tokens=tokens, heads_per_block=heads,
                             num_warps=8 if dim > 256 else 4, num_stages=2)
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
