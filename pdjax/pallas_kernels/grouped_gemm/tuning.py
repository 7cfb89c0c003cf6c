"""Tile sizes of the grouped matmul kernels: ``tile_m`` rows x ``tile_n`` output columns, the
reduction walked ``tile_k`` at a time. Starting points from register / VMEM budgets, not yet
measured on hardware.

Legal sizes:
  * GPU (Triton): powers of two >= 16; with FP8 weights ``tile_k`` and ``tile_n`` divide the
    128 scale block, so one scale covers a weight tile. Edges are masked.
  * TPU (Mosaic): ``tile_m`` a multiple of 8; ``tile_n`` a multiple of 128 or all of N;
    ``tile_k`` a multiple of 128 dividing K, or all of K (the reduction has no masked edge).
"""

from __future__ import annotations

import dataclasses

from pdjax.pallas_kernels.block_sizes import pow2_ceil


@dataclasses.dataclass(frozen=True)
class GmmTiles:
    """Static tiles of one call; ``num_warps`` / ``num_stages``: Triton launch parameters.
    Raises ``ValueError`` naming the field when one is not a positive int."""

    tile_m: int
    tile_k: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("tile_m", "tile_k", "tile_n", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GmmTiles.{name} must be a positive int, got {v!r}")


def get_tiles(backend: str, *, num_rows: int, k: int, n: int, fp8: bool,
              num_groups: int = 1) -> GmmTiles:
    """Legal tiles for one call (``backend``: ``"tpu"`` or ``"gpu"``; ``num_groups``: the
    experts); ``ValueError`` for another backend.

    Row tiles follow the rows an expert gets on average: a decode step spreads few rows over
    many experts (DeepSeek-V3.2: 1,024 rows over 256 experts), where a tall tile would
    multiply mostly other experts' (masked) rows; an extend step gives each expert dozens."""
    per_group = -(-num_rows // max(1, num_groups))
    if backend == "gpu":
        tm = max(16, min(64, pow2_ceil(per_group), pow2_ceil(num_rows)))
        return GmmTiles(tile_m=tm, tile_k=min(128, max(16, pow2_ceil(k))),
                        tile_n=min(128, max(16, pow2_ceil(n))), num_warps=4, num_stages=3)
    if backend == "tpu":
        # Whole 16-row bf16 tiles; long K steps keep the grid (0.35 us a step) short.
        tm = min(256, max(16, pow2_ceil(2 * per_group)), -(-num_rows // 16) * 16)
        tn = next((t for t in (512, 256, 128) if n % t == 0), n)
        tk = next((t for t in (2048, 1024, 512, 256, 128) if k % t == 0), k)
        return GmmTiles(tile_m=tm, tile_k=tk, tile_n=tn)
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
