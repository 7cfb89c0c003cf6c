"""Suite-wide setup: 4 simulated CPU devices (TP tests), the persistent compilation cache, and
tiny random Hugging Face checkpoints made once per session with transformers."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from pdjax.jax_setup import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
CHECKPOINT_DIR = os.path.join(ROOT, "tests", ".checkpoints")


@pytest.fixture(scope="session")
def tiny_checkpoints() -> dict[str, str]:
    """name -> folder of every tiny checkpoint in scripts/make_tiny_checkpoint.py."""
    import make_tiny_checkpoint

    return {name: make_tiny_checkpoint.make_checkpoint(name, CHECKPOINT_DIR)
            for name in make_tiny_checkpoint.CONFIGS}
