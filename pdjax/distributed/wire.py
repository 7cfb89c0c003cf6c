"""The leader -> follower messages of multi-host serving: msgpack maps, numpy arrays as raw
bytes with their dtype and shape, never pickle (DESIGN.md §6). No JAX here.

Every message is a map with ``"v"`` (``PROTOCOL_VERSION``) and ``"op"``; ``decode`` refuses
a frame that is not one (``WireError``), and ``decode_array`` one whose dtype is not in
``ARRAY_DTYPES`` or whose bytes do not fill its shape. Range checks of the values against the
runner's shapes live with the runner (``node.py``), which knows them.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
ARRAY_DTYPES = ("bool", "int32", "uint32", "float32")
MAX_ARRAY_DIMS = 3
OPS = ("hello", "welcome", "refuse", "warmup", "forward", "resample", "prompt_logprobs",
       "penalty_slot", "shutdown", "heartbeat", "barrier", "kv_peer", "kv_write", "kv_ranks",
       "kv_check", "kv_stage_in", "kv_drop")
# ServerArgs fields every node must agree on: they fix the model, the mesh and every bucket
# shape, so a difference would make the nodes compile different programs.
AGREED_FIELDS = ("nnodes", "tp_size", "page_size", "max_total_tokens", "max_running_requests",
                 "chunked_prefill_size", "max_num_batched_tokens", "max_prefill_tokens",
                 "context_length", "dtype", "kv_cache_dtype", "attention_backend",
                 "pallas_interpret", "enable_mixed_chunk", "load_format")


class WireError(ValueError):
    """A frame from the socket that is not a valid message (the text says why)."""


def encode_array(a: np.ndarray) -> dict[str, Any]:
    a = np.asarray(a)             # tobytes() is C order; 0-d arrays stay 0-d
    if a.dtype.name not in ARRAY_DTYPES:
        raise WireError(f"array dtype {a.dtype.name} is not one of {ARRAY_DTYPES}")
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


def decode_array(obj: Any, name: str) -> np.ndarray:
    """The array ``encode_array`` wrote; ``WireError`` naming ``name`` when malformed."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError(f"{name}: not an array")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in ARRAY_DTYPES:
        raise WireError(f"{name}: dtype {dtype!r} is not one of {ARRAY_DTYPES}")
    if (not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise WireError(f"{name}: bad shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
        raise WireError(f"{name}: {len(data) if isinstance(data, bytes) else 'no'} bytes do not "
                        f"fill shape {shape} of {dtype}")
    return np.frombuffer(data, dtype).reshape(shape).copy()


def encode(op: str, **fields) -> bytes:
    if op not in OPS:
        raise WireError(f"unknown op {op!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any]:
    """The message in ``frame``; ``WireError`` when it is not msgpack, not a map, of another
    protocol version or of an unknown op."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:
        raise WireError(f"not a msgpack frame: {e}") from None
    if not isinstance(msg, dict):
        raise WireError("message is not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    if msg.get("op") not in OPS:
        raise WireError(f"unknown op {msg.get('op')!r}")
    return msg


def get_int(msg: dict, name: str, lo: int, hi: int) -> int:
    """``msg[name]`` as an int in ``[lo, hi)``; ``WireError`` naming it otherwise."""
    v = msg.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise WireError(f"{name}: {v!r} is not an integer in [{lo}, {hi})")
    return v


def get_int_list(msg: dict, name: str, lo: int, hi: int, max_len: int) -> list[int]:
    v = msg.get(name)
    if not isinstance(v, list) or len(v) > max_len:
        raise WireError(f"{name}: not a list of at most {max_len} integers")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x < hi:
            raise WireError(f"{name}: {x!r} is not an integer in [{lo}, {hi})")
    return v


def node_identity(args, model_digest: str, version: str,
                  weights: str = "") -> dict[str, Any]:
    """What a node announces at start-up: its rank, pdjax version, model digest, weights
    fingerprint (``weights_fingerprint``) and every ``AGREED_FIELDS`` value of its
    ``ServerArgs``."""
    return {"node_rank": args.node_rank, "version": version, "model": model_digest,
            "weights": weights, **{name: getattr(args, name) for name in AGREED_FIELDS}}


def identity_mismatches(leader: dict[str, Any], follower: dict[str, Any]) -> list[str]:
    """``"field: leader X, node N Y"`` for every field (model, weights, version,
    ``AGREED_FIELDS``) where the two identities differ; empty when they agree."""
    out = []
    for name in ("model", "weights", "version") + AGREED_FIELDS:
        if leader.get(name) != follower.get(name):
            out.append(f"{name}: node 0 has {leader.get(name)!r}, node "
                       f"{follower.get('node_rank')!r} has {follower.get(name)!r}")
    return out


def config_digest(cfg) -> str:
    """BLAKE2b-128 hex of a model config's repr (frozen dataclasses: a stable text)."""
    return hashlib.blake2b(repr(cfg).encode(), digest_size=16).hexdigest()


# The files of a checkpoint that hold weights: by suffix (HF, GGUF, numpy), and the array
# files of a pdjax orbax checkpoint (under ``params/``; its "_"-named metadata left out).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".npy", ".msgpack")
WEIGHT_SAMPLE_BYTES = 4096


def weights_fingerprint(model_path: str) -> str:
    """BLAKE2b-128 hex of this node's view of the checkpoint's weight files (``model_path``: a
    resolved checkpoint folder, or one file such as a GGUF): each file's path under the
    folder, its size in bytes, and ``WEIGHT_SAMPLE_BYTES`` read at its start,
    middle and end (cheap: three reads per file, whatever its size). Nodes that loaded
    different weights (another snapshot, a re-quantised copy, a truncated download) differ
    here even with equal configs; a change elsewhere in a file of the same size is not seen.
    Only weight files count (``WEIGHT_SUFFIXES``, orbax arrays), so a tokenizer or a README
    may differ."""
    import os

    if os.path.isfile(model_path):
        base, paths = os.path.dirname(model_path), [model_path]
    else:
        base, paths = model_path, []
        for root, dirs, files in os.walk(model_path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            orbax = os.path.relpath(root, model_path).split(os.sep)[0] == "params"
            paths += [os.path.join(root, name) for name in sorted(files)
                      if name.lower().endswith(WEIGHT_SUFFIXES)
                      or (orbax and not name.startswith(("_", ".")))]
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        size = os.path.getsize(path)
        h.update(f"{os.path.relpath(path, base)}|{size}|".encode())
        with open(path, "rb") as f:
            for at in sorted({0, max(0, size // 2 - WEIGHT_SAMPLE_BYTES // 2),
                              max(0, size - WEIGHT_SAMPLE_BYTES)}):
                f.seek(at)
                h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()
