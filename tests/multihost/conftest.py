"""Fixtures of the multi-host PD tests (``test_pd_multihost.py``, ``test_pd_multihost_jax.py``)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "transfer"))
from pd_harness import TINY_ARGS  # noqa: E402


@pytest.fixture(scope="module")
def colocated(tiny_checkpoints):
    """The colocated engine of the tiny Llama, the reference of a module's PD outputs."""
    from pdjax.engine import Engine

    with Engine(model_path=tiny_checkpoints["llama"], progress=False, **TINY_ARGS) as engine:
        yield engine
