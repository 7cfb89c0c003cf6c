"""Shared pieces of the kernels' tuning tables: power-of-two rounding and the token-block
configuration used by the MLA sparse attention and indexer kernels."""

from __future__ import annotations

import dataclasses


def pow2_ceil(x: int) -> int:
    """Smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TokenBlockSizes:
    """Static block configuration of a kernel that walks cached tokens in blocks.

    Attributes:
      block_tokens: cached tokens (or top-k entries) handled per step / program.
      heads_per_block: heads per GPU program or tile (TPU programs take every head).
      num_warps, num_stages: Triton launch parameters (GPU only).

    Raises ``ValueError`` naming the field when one is not a positive int.
    """

    block_tokens: int
    heads_per_block: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_tokens", "heads_per_block", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {v!r}")
