"""The test-only ``jax-slow`` transfer backend (``pd_child.py --jax-pull-delay-file PATH``):
the ``jax`` backend whose decode waits, before each pull, the seconds written in PATH while
that file exists, so a test can hold a transfer open (kill the prefill mid-pull, or outlast
the prefill's ack deadline). Not part of the package."""

from __future__ import annotations

import os
import time

from pdjax.transfer.engine import register_backend
from pdjax.transfer.jax_transfer import JaxTransferEngine

NAME = "jax-slow"


class SlowPullJaxTransferEngine(JaxTransferEngine):
    backend = NAME

    def __init__(self, hostname: str = "127.0.0.1", *, delay_file: str, **kwargs):
        super().__init__(hostname, **kwargs)
        self.delay_file = delay_file

    def _pull(self, offer: dict) -> int:
        try:
            with open(self.delay_file) as f:
                time.sleep(float(f.read().strip() or 0))
        except FileNotFoundError:
            pass
        return super()._pull(offer)


def register(delay_file: str) -> None:
    register_backend(NAME, lambda **kw: SlowPullJaxTransferEngine(
        delay_file=os.path.abspath(delay_file), **kw))
