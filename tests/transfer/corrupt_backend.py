"""The test-only ``mooncake-corrupt`` transfer backend, registered by the tests through
``pdjax.transfer.engine.register_backend`` (``register()``; ``pd_child.py`` does it in a
server child process). Not part of the package: production has no corrupting backend."""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np

from pdjax.transfer.engine import register_backend
from pdjax.transfer.mooncake import MooncakeTransferEngine

logger = logging.getLogger(__name__)

NAME = "mooncake-corrupt"


def register(corrupt_offset: int = 1) -> None:
    """Register ``mooncake-corrupt``, flipping byte ``corrupt_offset`` of each first KV copy."""

    def factory(**kwargs) -> CorruptingMooncakeTransferEngine:
        return CorruptingMooncakeTransferEngine(corrupt_offset=corrupt_offset, **kwargs)

    register_backend(NAME, factory)


class CorruptingMooncakeTransferEngine(MooncakeTransferEngine):
    """Mooncake, then one flipped byte in the destination of the first KV copy of every
    ``batch_write``.

    It exists to prove that the decode side really uses the transferred KV (a transfer
    backend that flips one byte of the KV must change the output). After the real write
    has landed, it reads byte ``corrupt_offset`` (clamped to the copy) of the first copy whose
    *source* lies in a region registered with label ``corrupt_label`` (default ``"kv"``, so the
    metadata row is never touched), XORs it with ``corrupt_xor`` and writes that one byte over
    the destination through Mooncake from a private scratch buffer, so it works across
    processes. With the defaults (offset 1, mask 0x40) the byte is the high byte of the first
    bf16/fp16 element, and the flip toggles the top exponent bit: the value is scaled by
    2**64 or 2**-64 (``pd_child.py`` passes the offset of the high byte of the cache's dtype).
    ``corruptions`` counts the flipped bytes.
    """

    backend = "mooncake-corrupt"

    def __init__(self, hostname: str = "127.0.0.1", *, corrupt_label: str = "kv",
                 corrupt_offset: int = 1, corrupt_xor: int = 0x40, **kwargs):
        super().__init__(hostname, **kwargs)
        if not isinstance(corrupt_offset, int) or corrupt_offset < 0:
            raise ValueError(f"corrupt_offset: expected an int >= 0, got {corrupt_offset!r}")
        if not isinstance(corrupt_xor, int) or not 1 <= corrupt_xor <= 0xFF:
            raise ValueError(f"corrupt_xor: expected an int in [1, 255], got {corrupt_xor!r}")
        self.corrupt_label = corrupt_label
        self.corrupt_offset = corrupt_offset
        self.corrupt_xor = corrupt_xor
        self.corruptions = 0
        self._scratch = np.zeros(64, dtype=np.uint8)
        self._scratch_lock = threading.Lock()
        self.register_memory(self._scratch.ctypes.data, self._scratch.nbytes, label="scratch")
        logger.warning("transfer backend %s is TEST ONLY: it corrupts one KV byte per write",
                       self.backend)

    def batch_write(self, peer_session_id, copies) -> None:
        super().batch_write(peer_session_id, copies)
        for src, dst, length in copies:
            region = self.find_region(int(src), int(length))
            if region is not None and region.label == self.corrupt_label:
                offset = min(self.corrupt_offset, int(length) - 1)
                with self._scratch_lock:
                    # The source is local memory registered here, so reading it is safe.
                    original = ctypes.string_at(int(src) + offset, 1)[0]
                    self._scratch[0] = original ^ self.corrupt_xor
                    self._write_batch(peer_session_id, [self._scratch.ctypes.data],
                                      [int(dst) + offset], [1])
                    self.corruptions += 1
                return
