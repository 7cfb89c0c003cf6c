"""Compiled executables on disk: ``python -m pdjax.aot --serialize DIR`` writes them, a server
started with ``--aot-executables DIR`` loads them instead of compiling (``ModelRunner``,
DESIGN.md §7).

    DIR/manifest.json     {"format", "jax", "jaxlib", "platform", "device_kind", "entries":
                           {name: {"file", "kind", "fingerprint"}}}
    DIR/<n>.xla           jax.experimental.serialize_executable payload of one entry

An entry is matched by the fingerprint of its lowered module (BLAKE2b of the StableHLO text):
the runner lowers every bucket anyway, and any difference in shapes, shardings, dtypes, model
or kernels gives another text, so a stale or foreign executable is never run; it is compiled
instead. The payload is only valid for the same jax/jaxlib and device kind (checked from the
manifest). These files come from the operator's own build step, like a compilation cache; they
never travel over a network socket.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import jax

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"


def fingerprint(lowered) -> str:
    """BLAKE2b-128 hex of ``lowered``'s module text (``jax.stages.Lowered``)."""
    return hashlib.blake2b(lowered.as_text().encode(), digest_size=16).hexdigest()


def _versions() -> dict:
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def save_executables(engine, results, out_dir: str) -> str:
    """Write every compiled entry of ``results`` (``AbstractEngine.compile_entry``) of
    ``engine`` to ``out_dir``; returns the manifest's path. Entries whose executable cannot be
    serialized are left out with a warning."""
    from jax.experimental.serialize_executable import serialize

    os.makedirs(out_dir, exist_ok=True)
    by_name = {e.name: e for e in engine.entries("all")}
    entries = {}
    for i, r in enumerate(x for x in results if x.ok):
        try:
            payload, _, _ = serialize(r.executable)
        except Exception as e:  # noqa: BLE001 (some backends cannot serialize)
            logger.warning("%s: not serialized (%s)", r.name, e)
            continue
        with engine.device_context():
            fp = fingerprint(by_name[r.name].lower())
        file = f"{i:03d}.xla"
        with open(os.path.join(out_dir, file), "wb") as f:
            f.write(payload)
        entries[r.name] = {"file": file, "kind": r.kind, "fingerprint": fp}
    manifest = {"format": FORMAT, **_versions(), "platform": engine.target.platform,
                "device_kind": engine.target.device_kind, "entries": entries}
    path = os.path.join(out_dir, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
    return path


def read_manifest(directory: str) -> dict:
    """The manifest of a folder written by ``save_executables`` (a JSON object with an
    ``entries`` object). Raises ``ValueError`` naming ``aot_executables`` when the folder or
    its manifest is missing or not one."""
    if not os.path.isdir(directory):
        raise ValueError(f"aot_executables: {directory}: no such folder (python -m pdjax.aot "
                         "--serialize DIR writes one)")
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"aot_executables: no readable {MANIFEST} in {directory}: {e}") \
            from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), dict):
        raise ValueError(f"aot_executables: {path}: not a manifest of python -m pdjax.aot "
                         "--serialize (no 'entries' object)")
    return manifest


class ExecutableStore:
    """The executables of ``directory`` that may run on this process's devices (``devices``:
    the mesh's, in its order; default: every local device).

    ``load(lowered)`` returns the deserialized executable whose fingerprint equals
    ``lowered``'s, or None (not there, or written for another jax, jaxlib or device kind:
    ``reason`` says which). ``ValueError`` for a directory without a readable manifest.
    """

    def __init__(self, directory: str, device_kind: str, devices=None):
        self.manifest = read_manifest(directory)
        self.directory = directory
        self.devices = None if devices is None else list(devices)
        self.by_fingerprint = {e["fingerprint"]: e for e in self.manifest.get("entries", {})
                               .values()}
        want = {**_versions(), "device_kind": device_kind, "format": FORMAT}
        self.reason = next((f"{k} {self.manifest.get(k)!r} != {v!r}" for k, v in want.items()
                            if self.manifest.get(k) != v), None)
        if self.reason is None and self.manifest.get("platform") == "cpu":
            # XLA CPU's deserialized executables lose their JIT-compiled kernels ("Function
            # wrapped_convert not found" at the first run): accelerators only.
            self.reason = "CPU executables do not survive serialization"
        self.num_loaded = 0

    def load(self, lowered):
        if self.reason is not None:
            return None
        entry = self.by_fingerprint.get(fingerprint(lowered))
        if entry is None:
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        with open(os.path.join(self.directory, os.path.basename(entry["file"])), "rb") as f:
            payload = f.read()
        compiled = deserialize_and_load(payload, lowered.in_tree, lowered.out_tree,
                                        execution_devices=self.devices)
        self.num_loaded += 1
        return compiled
