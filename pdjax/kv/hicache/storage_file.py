"""HiCache's ``file`` storage backend: one file per stored page in a folder
(``--hicache-storage-backend file`` with ``{"path": ...}``; SGLang's ``HiCacheFile``;
DESIGN.md §3, "Storage tier").

    <path>/<key as hex>.kv        in a subfolder named by the key's last 16 bytes' first
                                  byte: <path>/<2 hex digits>/<hex>.kv

A write goes to ``<final>.<pid>.<thread>.tmp`` in the same folder and is renamed over the
final name (atomic on POSIX), so a reader sees a whole record or none; a crash leaves at most
a ``.tmp`` file, which no key names. No fsync: a record torn by a power loss fails its
checksum (``storage.PageCodec``) and is recomputed. The root folder is made at start only: a
folder removed at runtime makes every read a miss and every write an ``OSError`` (the tier
logs it and serves by recomputing) until it is back. Pure Python.
"""

from __future__ import annotations

import os
import threading


class FileStorage:
    """Records in folder ``path`` (made if missing; ``OSError`` if it cannot be, or is not
    writable)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PermissionError(f"hicache storage folder {self.path} is not writable")

    def _file(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.path, h[-32:-30], h + ".kv")

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self._file(key))

    def get(self, key: bytes) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: bytes, record: bytes) -> None:
        final = self._file(key)
        folder = os.path.dirname(final)
        try:
            os.mkdir(folder)            # not makedirs: a removed root stays removed
        except FileExistsError:
            pass
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def delete(self, key: bytes) -> None:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        pass
