"""Block sizes for the ragged paged attention kernels, one table per backend and path.

A block is ``q_tokens`` query tokens (all query heads of one KV head group) against
``kv_tokens`` cached tokens per inner step. The table is keyed by the shapes that change the
best choice; anything not in it gets a size from ``fallback_block_sizes``, a rule that always
returns a legal size. Entries are starting points chosen from register/VMEM budgets, not yet
measured on hardware: ``scripts/gpu_kernel_bench.py`` prints the figures to tune them with.

Legal sizes:
  * TPU (Mosaic): ``kv_tokens`` is a multiple of ``page_size`` (whole pages are DMA'd);
    ``q_tokens`` is the number of decode rows (decode path) or query tokens per block.
  * GPU (Triton): ``kv_tokens`` is a power of two >= 16 (any page size: rows are gathered);
    ``q_tokens * group_pad`` (``group_pad`` = the GQA group rounded up to a power of two, at
    least 16 rows for tensor-core dots) is a power of two. The GPU table is keyed by page
    size 16 whatever the cache's page size, and ``num_warps`` is raised until the float32
    accumulator tile takes at most 64 registers a thread (a 128 x 128 tile needs 8 warps).
"""

from __future__ import annotations

import dataclasses

from pdjax.pallas_kernels.block_sizes import pow2_ceil

PATHS = ("decode", "prefill", "mixed")
BACKENDS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static block configuration of one kernel path.

    Attributes:
      q_tokens: query tokens per block (decode path: decode rows per block).
      kv_tokens: cached tokens visited per online-softmax step.
      num_warps: Triton warps per program (GPU only).
      num_stages: Triton software-pipelining stages (GPU only).
    """

    q_tokens: int
    kv_tokens: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("q_tokens", "kv_tokens", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


# (backend, path, head_dim, page_size, kv_bits) -> BlockSizes. GQA group sizes are folded in
# by ``_fit_gpu``/``_fit_tpu`` below, so one entry serves every group size.
_TABLE: dict[tuple[str, str, int, int, int], BlockSizes] = {
    # TPU: decode takes 8 rows per program and 256 (head_dim 64) / 128 (head_dim 128) cached
    # tokens per step; prefill uses 128-token query blocks (MXU-sized); mixed sits in between.
    ("tpu", "decode", 64, 16, 16): BlockSizes(8, kv_tokens=256),
    ("tpu", "decode", 128, 16, 16): BlockSizes(8, kv_tokens=128),
    ("tpu", "prefill", 64, 16, 16): BlockSizes(128, kv_tokens=256),
    ("tpu", "prefill", 128, 16, 16): BlockSizes(128, kv_tokens=128),
    ("tpu", "mixed", 64, 16, 16): BlockSizes(32, kv_tokens=256),
    ("tpu", "mixed", 128, 16, 16): BlockSizes(32, kv_tokens=128),
    # GPU (H100/H200 class): decode is one request per program, 128 KV rows per step;
    # prefill tiles of 128 query rows (tokens x padded group) with 64 KV rows.
    ("gpu", "decode", 64, 16, 16): BlockSizes(1, kv_tokens=128, num_warps=4, num_stages=3),
    ("gpu", "decode", 128, 16, 16): BlockSizes(1, kv_tokens=64, num_warps=4, num_stages=3),
    ("gpu", "decode", 64, 16, 8): BlockSizes(1, kv_tokens=128, num_warps=4, num_stages=3),
    ("gpu", "decode", 128, 16, 8): BlockSizes(1, kv_tokens=128, num_warps=4, num_stages=3),
    ("gpu", "prefill", 64, 16, 16): BlockSizes(32, kv_tokens=64, num_warps=4, num_stages=2),
    ("gpu", "prefill", 128, 16, 16): BlockSizes(32, kv_tokens=64, num_warps=8, num_stages=2),
    ("gpu", "mixed", 64, 16, 16): BlockSizes(16, kv_tokens=64, num_warps=4, num_stages=2),
    ("gpu", "mixed", 128, 16, 16): BlockSizes(16, kv_tokens=64, num_warps=4, num_stages=2),
}


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def gpu_group_pad(group: int, q_tokens: int) -> int:
    """Rows per query token in a GPU tile: the GQA group rounded up to a power of two, raised
    so that a tile has at least 16 rows (the smallest Triton tensor-core dot)."""
    return max(pow2_ceil(group), pow2_ceil(-(-16 // q_tokens)))


def _fit_tpu(bs: BlockSizes, page_size: int, max_pages: int, num_tokens: int,
             path: str) -> BlockSizes:
    pages = max(1, min(bs.kv_tokens // page_size, max_pages))
    q_tokens = max(1, min(bs.q_tokens, num_tokens))
    if path != "decode" and q_tokens < num_tokens:
        q_tokens = max(8, q_tokens - q_tokens % 8)       # sublane-aligned query blocks
    return dataclasses.replace(bs, q_tokens=q_tokens, kv_tokens=pages * page_size)


# Shared memory the Triton pipeliner may spend on K/V stages (H100/H200 have 227 KiB per block;
# leave room for the Q tile and layout conversions).
_GPU_KV_SMEM_BYTES = 96 * 1024
# Accumulator floats per thread the Triton kernel holds without spilling: a [128, 128] tile
# over 4 warps (128 per thread) spills on sm_90 (ptxas: 255 registers, ~200 bytes of spill
# stores, compiled for H100/H200 by pdjax.aot.kernel_matrix); over 8 warps (64) it does not,
# nor does [64, 128] over 4 warps.
_GPU_ACC_PER_THREAD = 64
_GPU_MAX_WARPS = 8


def _fit_gpu(bs: BlockSizes, group: int, head_dim: int, kv_bits: int, num_tokens: int,
             path: str) -> BlockSizes:
    if path == "decode":
        q_tokens = 1
    else:
        # Keep tiles at <= 128 rows (<= 64 for head_dim > 128) whatever the group size.
        max_rows = 128 if head_dim <= 128 else 64
        q_tokens = _pow2_floor(max(1, min(bs.q_tokens, max_rows // pow2_ceil(group))))
        q_tokens = min(q_tokens, pow2_ceil(num_tokens))
    kv_tokens = max(16, _pow2_floor(bs.kv_tokens))
    stage_bytes = 2 * head_dim * kv_bits // 8          # one K row and one V row
    while kv_tokens > 16 and bs.num_stages * kv_tokens * stage_bytes > _GPU_KV_SMEM_BYTES:
        kv_tokens //= 2
    # Enough warps that the float32 accumulator tile [rows, head_dim] stays in registers.
    rows = q_tokens * gpu_group_pad(group, q_tokens)
    num_warps = max(bs.num_warps, min(_GPU_MAX_WARPS, pow2_ceil(
        -(-rows * head_dim // (32 * _GPU_ACC_PER_THREAD)))))
    return dataclasses.replace(bs, q_tokens=q_tokens, kv_tokens=kv_tokens, num_warps=num_warps)


def fallback_block_sizes(backend: str, path: str, head_dim: int, page_size: int) -> BlockSizes:
    """The rule for shapes missing from the table.

    TPU: about 32 KiB of K per head per step (``kv_tokens`` ~ 16384 // head_dim tokens, whole
    pages); 8 decode rows, 128-token prefill and 32-token mixed query blocks.
    GPU: 64 KV rows per step (128 for head_dim <= 64 decode), halved while the pipelined K/V
    stages would take more than 96 KiB of shared memory; 32-token prefill and 16-token mixed
    query blocks; 8 warps for head_dim > 128.
    """
    if backend == "tpu":
        kv_tokens = max(page_size, (16384 // head_dim) // page_size * page_size)
        q_tokens = {"decode": 8, "prefill": 128, "mixed": 32}[path]
        return BlockSizes(q_tokens, kv_tokens=kv_tokens)
    kv_tokens = 128 if (path == "decode" and head_dim <= 64) else 64
    q_tokens = {"decode": 1, "prefill": 32, "mixed": 16}[path]
    warps = 8 if head_dim > 128 else 4
    return BlockSizes(q_tokens, kv_tokens=kv_tokens, num_warps=warps,
                      num_stages=3 if path == "decode" else 2)


def get_block_sizes(backend: str, path: str, *, head_dim: int, group: int, page_size: int,
                    kv_bits: int, max_pages: int, num_tokens: int) -> BlockSizes:
    """Block sizes for one kernel call, legal for the given shapes.

    Args:
      backend: ``"tpu"`` or ``"gpu"``.
      path: ``"decode"``, ``"prefill"`` or ``"mixed"`` (DESIGN.md §2 ``distribution``).
      head_dim, group (query heads per KV head), page_size, kv_bits (8 for fp8, 16 for bf16,
        32 for f32), max_pages (page table width), num_tokens (the ``T`` of this bucket).

    Raises:
      ValueError: unknown backend or path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # The GPU kernel gathers K/V rows one by one, so its tiles do not depend on the page size.
    bs = _TABLE.get((backend, path, head_dim, 16 if backend == "gpu" else page_size, kv_bits))
    if bs is None:
        bs = fallback_block_sizes(backend, path, head_dim, page_size)
    if backend == "tpu":
        return _fit_tpu(bs, page_size, max_pages, num_tokens, path)
    return _fit_gpu(bs, group, head_dim, kv_bits, num_tokens, path)
