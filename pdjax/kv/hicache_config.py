"""The settings of HiCache's storage tier (``--hicache-storage-backend``,
``--hicache-storage-backend-extra-config``), checked at parse time (``pdjax.config``; DESIGN.md
§3, "Storage tier"). In the control layer, apart from ``pdjax.kv.hicache`` (the transfer
layer, which builds the backends from what this returns). Pure Python.
"""

from __future__ import annotations

import json
import os
from typing import Any

STORAGE_BACKENDS = ("file", "mooncake")


def parse_storage_config(backend: str | None, extra_config: str) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` (a JSON object) checked for ``backend``:
    ``file`` needs ``"path"`` (a folder; made if missing), ``mooncake`` takes
    ``"master_server_address"`` (host:port) and optional ``"metadata_server"``,
    ``"local_hostname"``, ``"global_segment_size"`` / ``"local_buffer_size"`` (bytes),
    ``"protocol"``. Every backend takes ``"model_id"`` (default: the checkpoint folder's name;
    part of the records' fingerprint). ``ValueError`` naming the field."""
    name = "hicache_storage_backend_extra_config"
    if backend is None:
        if extra_config:
            raise ValueError(f"{name}: set without hicache_storage_backend")
        return {}
    if backend not in STORAGE_BACKENDS:
        raise ValueError(f"hicache_storage_backend: must be one of {STORAGE_BACKENDS}, "
                         f"got {backend!r}")
    try:
        cfg = json.loads(extra_config) if extra_config else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: must be a JSON object, got {type(cfg).__name__}")
    known = {"file": {"path", "model_id"},
             "mooncake": {"master_server_address", "metadata_server", "local_hostname",
                          "global_segment_size", "local_buffer_size", "protocol",
                          "model_id"}}[backend]
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown} for backend {backend!r} "
                         f"(known: {sorted(known)})")
    for k in ("path", "model_id", "master_server_address", "metadata_server",
              "local_hostname", "protocol"):
        if k in cfg and (not isinstance(cfg[k], str) or not cfg[k]):
            raise ValueError(f"{name}: {k!r} must be a non-empty string, got {cfg[k]!r}")
    for k in ("global_segment_size", "local_buffer_size"):
        if k in cfg and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int)
                         or cfg[k] < 1):
            raise ValueError(f"{name}: {k!r} must be a positive integer (bytes), "
                             f"got {cfg[k]!r}")
    if backend == "file":
        if "path" not in cfg:
            raise ValueError(f"{name}: backend 'file' needs \"path\" (a folder)")
        if os.path.exists(cfg["path"]) and not os.path.isdir(cfg["path"]):
            raise ValueError(f"{name}: path {cfg['path']!r} is not a folder")
    if backend == "mooncake":
        if "master_server_address" not in cfg:
            raise ValueError(f"{name}: backend 'mooncake' needs \"master_server_address\" "
                             f"(host:port of mooncake_master)")
    return cfg
