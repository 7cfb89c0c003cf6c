"""Block sizes for the indexer scoring kernels.

A program scores one query token against ``block_tokens`` cached positions (all indexer heads
at once). Starting points from VMEM/register budgets, not yet measured on hardware.

Legal sizes:
  * TPU: ``block_tokens`` is a multiple of ``page_size`` (whole pages are DMA'd).
  * GPU (Triton): ``block_tokens`` and ``heads_per_block`` (the indexer heads padded) are powers
    of two >= 16; ``index_head_dim`` must be a power of two >= 16.
"""

from __future__ import annotations

from pdjax.pallas_kernels.block_sizes import TokenBlockSizes, pow2_ceil


class IndexerBlockSizes(TokenBlockSizes):
    """Block configuration of this kernel (fields and checks: ``TokenBlockSizes``)."""


def get_block_sizes(backend: str, *, num_heads: int, head_dim: int, page_size: int,
                    span: int) -> IndexerBlockSizes:
    """Legal block sizes for one call.

    Args:
      backend: ``"tpu"`` or ``"gpu"``; num_heads/head_dim: indexer heads and width;
      page_size: cache page size; span: page-table width in tokens.

    Raises:
      ValueError: unknown backend.
    """
    if backend == "tpu":
        # 512 keys x 128 dims bf16 = 128 KiB per program; never more than the span.
        block = min(max(page_size, 512 // page_size * page_size), -(-span // page_size) * page_size)
        return IndexerBlockSizes(block_tokens=block)
    if backend == "gpu":
        heads = max(16, pow2_ceil(num_heads))
        tokens = max(16, min(64 if heads > 32 else 128, pow2_ceil(span)))
        return IndexerBlockSizes(block_tokens=tokens, heads_per_block=heads, num_warps=4,
                                 num_stages=2)
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
