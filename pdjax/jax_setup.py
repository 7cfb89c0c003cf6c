"""Process-wide JAX settings: the persistent compilation cache (DESIGN.md §2)."""

from __future__ import annotations

import os

import jax


def pdjax_cache_dir(*parts: str) -> str:
    """``$PDJAX_CACHE_DIR`` (default ``~/.cache/pdjax``) joined with ``parts``: the root of
    pdjax's on-disk caches (compilation cache, converted tokenizers, built CPU kernels)."""
    root = os.environ.get("PDJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdjax")
    return os.path.join(root, *parts)


def default_compilation_cache_dir() -> str:
    return pdjax_cache_dir("jax_compilation_cache")


def enable_compilation_cache(cache_dir: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache for every compile, however small or fast.

    ``cache_dir`` defaults to ``$JAX_COMPILATION_CACHE_DIR`` or ``~/.cache/pdjax/...``.
    Returns the directory used.
    """
    cache_dir = cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_compilation_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir
