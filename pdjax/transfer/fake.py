"""The ``fake`` transfer backend: accepts writes, copies nothing, counts them.

Used for warm-up requests (bootstrap host ``2.2.2.2``, SGLang's convention for a
server's own warm-up, DESIGN.md §4) and in tests of the PD queues that must not depend on a real
data plane. ``set_failure`` makes every later write raise ``TransferError``, for fault tests.
Pure Python; never imports JAX.
"""

from __future__ import annotations

import itertools

from pdjax.transfer.engine import DEFAULT_MAX_BATCH, TransferEngine, TransferError

_ids = itertools.count()


class FakeTransferEngine(TransferEngine):
    """Counts writes and moves no bytes.

    ``session_id`` is ``"fake:<hostname>:<n>"``, unique per process. ``check_sources`` defaults
    to False because warm-up requests may use the fake engine before any memory is registered.
    """

    backend = "fake"
    data_plane = "fake"

    def __init__(self, hostname: str = "fake", *, max_batch: int = DEFAULT_MAX_BATCH,
                 check_sources: bool = False):
        super().__init__(max_batch=max_batch, check_sources=check_sources)
        self._session_id = f"fake:{hostname}:{next(_ids)}"
        self._failure: str | None = None

    @property
    def session_id(self) -> str:
        return self._session_id

    def set_failure(self, reason: str | None) -> None:
        """While ``reason`` is not None, every write raises ``TransferError(reason)``."""
        self._failure = reason

    def _register(self, addr: int, length: int) -> None:
        pass

    def _unregister(self, addr: int) -> None:
        pass

    def _write_batch(self, peer_session_id, srcs, dsts, lens) -> None:
        if self._failure is not None:
            raise TransferError(f"fake write to {peer_session_id} failed: {self._failure}")
