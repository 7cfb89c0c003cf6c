"""Output folders a run writes into later (traces, executables, reports): checked when they are
named, so that a path that cannot take them fails at once instead of after the work."""

from __future__ import annotations

import os
import tempfile


def writable_folder(field: str, path: str) -> str:
    """Make the folder ``path`` (and its parents) if missing, and write and remove a scratch
    file in it. ``os.access`` is not asked: it says yes to root on a read-only mount.

    Returns ``path``. Raises ``ValueError`` naming ``field`` when ``path`` is a file or the
    folder cannot be made or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{field}: {path} exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{field}: cannot write in {path} ({e.strerror})") from None
    return path
