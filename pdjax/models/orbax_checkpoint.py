"""Orbax checkpoints of pdjax's own parameter tree, restored shard by shard onto the mesh.

A checkpoint is a folder (written by ``python -m pdjax.convert``)::

    DST/
      config.json            the HF config (copied, or written from a GGUF file's metadata)
      tokenizer.json ...     the tokenizer and chat template (transformers save_pretrained)
      pdjax_checkpoint.json  {"format": "pdjax-orbax", "version": 1, "architecture": ...,
                              "params": {"layers.wq": [[L, H, QH*D], "float32"], ...}}
      params/                Orbax (StandardCheckpointer) tree of the stacked parameters of
                             the checkpoint's own config, nested by dotted path

The parameters are the family's ``stack_params`` output (already dequantized and stacked, no
TP replication), so a restore skips reading, dequantizing and stacking: each process asks
Orbax for its shards with the target sharding and dtype, and they go straight to the devices.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import jax
import numpy as np

CHECKPOINT_FORMAT = "pdjax-orbax"
CHECKPOINT_VERSION = 1
MARKER_FILE = "pdjax_checkpoint.json"
PARAMS_DIR = "params"


def is_orbax_checkpoint(path: str) -> bool:
    """Whether ``path`` is a folder written by ``save_params`` (it holds the marker file)."""
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def _nest(flat: Mapping[str, object]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _flatten(tree: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def save_params(dst: str, params: Mapping[str, np.ndarray], *, architecture: str,
                source: str) -> None:
    """Write ``params`` (dotted path -> numpy array) and the marker under ``dst`` (a folder
    that may exist but must not hold a checkpoint yet: ``ValueError`` otherwise)."""
    import orbax.checkpoint as ocp

    if is_orbax_checkpoint(dst) or os.path.exists(os.path.join(dst, PARAMS_DIR)):
        raise ValueError(f"{dst}: already holds a checkpoint")
    os.makedirs(dst, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(dst, PARAMS_DIR)),
                      _nest({k: np.asarray(v) for k, v in params.items()}))
    checkpointer.wait_until_finished()
    marker = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
              "architecture": architecture, "source": source,
              "params": {k: [list(np.shape(v)), str(np.asarray(v).dtype)] for k, v in params.items()}}
    with open(os.path.join(dst, MARKER_FILE), "w") as f:
        json.dump(marker, f, indent=1)


def read_marker(path: str) -> dict:
    """The checkpoint's marker, checked; ``ValueError`` naming the file and the bad field."""
    file = os.path.join(path, MARKER_FILE)
    try:
        with open(file) as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{file}: 'format' must be {CHECKPOINT_FORMAT!r}")
    if marker.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{file}: 'version' {marker.get('version')!r} is not supported "
                         f"(this pdjax reads version {CHECKPOINT_VERSION})")
    if not isinstance(marker.get("architecture"), str):
        raise ValueError(f"{file}: missing 'architecture'")
    if not isinstance(marker.get("params"), dict):
        raise ValueError(f"{file}: missing 'params'")
    return marker


def restore_params(path: str, targets: Mapping[str, jax.ShapeDtypeStruct] | None = None,
                   ) -> dict[str, np.ndarray | jax.Array]:
    """Restore the parameters of the checkpoint at ``path``.

    Args:
      targets: per dotted path, the shape, dtype and ``sharding`` to restore into (each process
        then reads only its own shards); None restores every array to host numpy as saved.

    Raises ``ValueError`` when the checkpoint's parameter names or shapes differ from
    ``targets`` (naming the parameter), or the params folder is missing.
    """
    import orbax.checkpoint as ocp

    marker = read_marker(path)
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    if not os.path.isdir(params_dir):
        raise ValueError(f"{params_dir}: folder not found")
    saved = {k: tuple(shape) for k, (shape, _) in marker["params"].items()}
    checkpointer = ocp.StandardCheckpointer()
    if targets is None:
        restored = checkpointer.restore(params_dir)
        return {k: np.asarray(v) for k, v in _flatten(restored).items()}
    missing = sorted(set(targets) - set(saved))
    if missing:
        raise ValueError(f"{path}: checkpoint has no tensor for parameter {missing[0]!r}")
    for key, target in targets.items():
        if saved[key] != tuple(target.shape):
            raise ValueError(f"{path}: parameter {key!r} has shape {saved[key]}, "
                             f"expected {tuple(target.shape)}")
    item = _nest(dict(targets))
    if set(saved) - set(targets):
        # Saved parameters the model does not have (an MTP layer, built only with mtp=True)
        # stay on disk.
        restored = ocp.PyTreeCheckpointer().restore(params_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True))
    else:
        restored = checkpointer.restore(params_dir, item)
    return _flatten(restored)
