"""This server's KV pool as the transfer engine sees it: direct or staged (DESIGN.md §4).

Two ways to expose the model runner's KV buffers (``runner.kv_buffers()``: every buffer of the
model's ``cache_spec``, each layer-major ``[layers, num_pages, page_size, ...]``; GQA:
``k_cache``/``v_cache``, MLA: ``latent`` and the DSA ``indexer_k``) to one-sided writes:

    direct   the JAX arrays themselves are registered by address (``kv_export``). XLA does
             not promise that a donated buffer keeps its address, so ``check_addresses()``
             runs after every donated step; a move re-registers and tells the caller, who
             fails the transfers in flight.
    staging  host mirrors (numpy, same shape and layout) are registered instead. The prefill
             copies the pages it is about to send from the cache into its mirror
             (``stage_out``); the decode copies pages that arrived in its mirror into the
             cache with a donated jit (``stage_in``). Used where addresses cannot be exported
             or checked (e.g. a tiled device layout), or when forced.

Both ways give the peer the same ``KVLayout`` shape (layer-major, same bytes per page), so a
direct prefill pairs with a staging decode and vice versa; only the addresses differ.

``mode`` comes from ``--disaggregation-transfer-path`` (``auto`` | ``direct`` | ``staging``;
``auto`` = direct when the export works). JAX is imported
lazily; the runner's staging gather/scatter are compiled once per page bucket in ``warmup``.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

from pdjax.pd.kv_buffers import KVBufferDesc
from pdjax.transfer.engine import TransferEngine
from pdjax.models.cache_spec import kv_format
from pdjax.transfer.kv_copies import KVLayout, register_kv_layout, unregister_kv_layout
from pdjax.transfer.kv_export import changed_addresses, export_kv_layout, kv_layout_fingerprint

logger = logging.getLogger(__name__)

TRANSFER_PATHS = ("auto", "direct", "staging")


def page_buckets(max_pages: int) -> list[int]:
    """Page counts the staging gather and scatter are compiled for: powers of two up to the
    first one >= ``max_pages``."""
    out, b = [], 1
    while b < max_pages:
        out.append(b)
        b *= 2
    out.append(b)
    return out


def _aligned_zeros(shape, dtype) -> np.ndarray:
    """A zeroed numpy array whose data starts on a 64-byte boundary (RDMA-friendly)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _mirror_desc(m: np.ndarray, row_heads: int) -> KVBufferDesc:
    """One unsharded host mirror ``[L, pages, page_size, (heads, head_dim | row)]``, a row
    holding ``row_heads`` heads."""
    bytes_per_page = math.prod(m.shape[2:]) * m.dtype.itemsize
    heads = m.shape[3] if m.ndim >= 5 else row_heads
    return KVBufferDesc(shard_addrs=(int(m.ctypes.data),), num_layers=m.shape[0],
                        num_pages=m.shape[1], bytes_per_page=bytes_per_page, num_heads=heads,
                        head_bytes=bytes_per_page // (m.shape[2] * heads))


class LocalKV:
    """The runner's KV cache registered with ``engine`` (see the module docstring).

    ``layout``: the ``KVLayout`` peers address (the runner's buffers in order, each shard with
    the KV head range it holds; ``head_repeat`` is how often ``tp_model_config`` repeated each
    KV head, 1 = none). ``fingerprint`` and
    ``kv_dtype`` are what the peer must match. ``bytes_per_page``: bytes of one page over all
    buffers and layers. Raises ``ValueError`` for an unknown ``mode``, or when ``direct`` is
    forced and the arrays cannot be exported.

    Peers read pages from this pool (a prefill sends a chunk while the next one computes) or
    write pages into it (a decode) while steps run, so the direct path needs every step to
    update the pool in place (``runner.require_in_place_kv``, ``runner/pool_copy.py``): a
    step that copies the pool loses pages written meanwhile, and one that uses the pool as
    scratch in mid-step also gives readers garbage. Where one does not, ``auto`` takes the
    staging path and ``direct`` raises ``ValueError``.
    """

    def __init__(self, runner, engine: TransferEngine, mode: str = "auto",
                 max_pages_per_seq: int = 64, head_repeat: int = 1):
        if mode not in TRANSFER_PATHS:
            raise ValueError(f"transfer path must be one of {TRANSFER_PATHS}, got {mode!r}")
        self.runner = runner
        self.engine = engine
        arrays = self._arrays()
        self.head_repeat = head_repeat
        # Heads side by side in a row (GQA's [.., KVH * D]), per buffer.
        self.row_heads = [s.row_heads for s in runner.cache_specs]
        self.fingerprint = kv_layout_fingerprint(arrays, head_repeat=head_repeat,
                                                 row_heads=self.row_heads)
        # The KV format (dtype, or the FP8 record) a peer must share: cache_spec.kv_format.
        self.kv_dtype = kv_format(runner.cache_specs)
        # DP attention: the pool is page-sharded, a rank's pages per device (kv_export)
        self.dp_size = int(getattr(runner, "dp_size", 1))
        self.num_pages = int(arrays[0].shape[1]) // (len(arrays[0].addressable_shards)
                                                    // self.dp_size if self.dp_size > 1 else 1)
        self.max_pages_per_seq = max(1, int(max_pages_per_seq))
        self.mirrors: list[np.ndarray] = []
        self.mode = "staging"
        why_not_direct = "forced"
        if mode != "staging":
            try:
                self.layout = export_kv_layout(arrays, head_repeat=head_repeat,
                                               row_heads=self.row_heads,
                                               dp_size=self.dp_size)
                runner.require_in_place_kv()
                self.mode = "direct"
            except ValueError as e:
                if mode == "direct":
                    raise
                why_not_direct = str(e)
                logger.warning("direct KV path not possible (%s): using the staging path", e)
        if self.mode == "staging":
            if len(arrays[0].addressable_shards) != 1:
                raise ValueError(f"the staging path supports one shard per KV array (tp_size "
                                 f"1), and the direct path is not possible: {why_not_direct}")
            self.mirrors = [_aligned_zeros(a.shape, a.dtype) for a in arrays]
            self.layout = KVLayout("layer_major", tuple(
                _mirror_desc(m, h) for m, h in zip(self.mirrors, self.row_heads)))
        register_kv_layout(engine, self.layout)
        # a page lives in the shards of its DP rank only (dp_size 1: every shard)
        self.bytes_per_page = sum(b.num_layers * b.bytes_per_page * len(b.shard_addrs)
                                  // b.dp_size for b in self.layout.buffers)
        self.num_address_changes = 0

    def _arrays(self) -> list:
        return self.runner.kv_buffers()

    @property
    def num_layer_buffers(self) -> int:
        """Copy targets per page run: one per layer of every KV kind (and shard)."""
        return sum(b.num_layers * len(b.shard_addrs) for b in self.layout.buffers)

    # -- direct path ---------------------------------------------------------------------
    def check_addresses(self) -> bool:
        """After a donated step: True when the cache moved (it is then re-registered).

        The staging path never moves (its mirrors are numpy) and always returns False.
        """
        if self.mode != "direct":
            return False
        arrays = self._arrays()
        if not changed_addresses(arrays, self.layout):
            return False
        unregister_kv_layout(self.engine, self.layout)
        self.layout = export_kv_layout(arrays, head_repeat=self.head_repeat,
                                       row_heads=self.row_heads, dp_size=self.dp_size)
        register_kv_layout(self.engine, self.layout)
        self.num_address_changes += 1
        logger.warning("KV cache moved after a donated step: re-registered (%d so far)",
                       self.num_address_changes)
        return True

    # -- staging path --------------------------------------------------------------------
    def _padded(self, pages: Sequence[int]) -> np.ndarray:
        n = len(pages)
        size = next(b for b in page_buckets(max(n, self.max_pages_per_seq)) if b >= n)
        idx = np.zeros(size, np.int32)          # padding reads/writes the null page 0
        idx[:n] = pages
        return idx

    def warmup(self) -> None:
        """Compile the staging gather and scatter for every page bucket (no-op when direct)."""
        if self.mode != "staging":
            return
        for b in page_buckets(self.max_pages_per_seq):
            idx = np.zeros(b, np.int32)
            self.runner.scatter_pages(idx, self.runner.gather_pages(idx))

    def stage_out(self, pages: Sequence[int]) -> None:
        """Prefill, staging: copy ``pages`` of the cache into the mirrors (blocking)."""
        if self.mode != "staging" or len(pages) == 0:
            return
        idx = self._padded(pages)
        n = len(pages)
        for mirror, part in zip(self.mirrors, self.runner.gather_pages(idx)):
            mirror[:, np.asarray(pages)] = part[:, :n]

    def stage_in(self, pages: Sequence[int], room: int | None = None) -> None:
        """Decode, staging: copy ``pages`` that arrived in the mirrors into the cache.
        ``room``: the bootstrap_room they belong to, for data planes whose arrivals are kept
        per room (the jax backend's); a write into the mirrors lands by address, so unused."""
        if self.mode != "staging" or len(pages) == 0:
            return
        idx = self._padded(pages)
        parts = [m[:, idx] for m in self.mirrors]
        for part in parts:
            part[:, len(pages):] = 0          # padding rows write zeros into the null page
        self.runner.scatter_pages(idx, parts)

    def close(self) -> None:
        try:
            unregister_kv_layout(self.engine, self.layout)
        except Exception:       # the engine may already be closed
            pass
