"""The model-loading API: ``load_model`` (any registered architecture, from an HF folder or a
GGUF file, onto a mesh) and ``load_tokenizer`` (with the chat template).

The file formats live in ``checkpoint.py``, each family's weight mapping in its own module,
and the architecture -> family table in ``registry.py``. The path, mesh and dtype helpers of
``checkpoint.py`` are re-exported here so that callers need one import.
"""

from __future__ import annotations

import hashlib
import os

from jax.sharding import Mesh

from pdjax.models.checkpoint import (DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE,  # noqa: F401
                                     checkpoint_architecture, default_model_path, is_gguf,
                                     make_mesh, resolve_dtype, resolve_model_path)
from pdjax.models.registry import model_loader


def load_model(model_path: str | None = None, *, dtype="auto", mesh: Mesh | None = None,
               progress: bool = True, **model_kwargs):
    """Load a checkpoint onto ``mesh`` (default: one device). Returns ``(run_cfg, model)``.

    The family comes from the checkpoint's architecture (``registry.py``): Llama / Qwen2 /
    Qwen3 give ``(ModelConfig, LlamaForCausalLM)`` (``run_cfg.num_kv_heads`` may be larger
    than the checkpoint's when TP replicates KV heads), DeepSeek-V3 / V3.2 / GLM-5 give
    ``(DeepseekConfig, DeepseekForCausalLM)``. Raises ``ValueError`` naming the file, tensor
    or architecture that is wrong.
    """
    mesh = mesh if mesh is not None else make_mesh(1)
    path = resolve_model_path(model_path)
    load = model_loader(checkpoint_architecture(path))
    return load(path, dtype=dtype, mesh=mesh, progress=progress, **model_kwargs)


# --------------------------------------------------------------------------- tokenizer

def _cache_dir() -> str:
    root = os.environ.get("PDJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdjax")
    return os.path.join(root, "tokenizers")


def load_tokenizer(model_path: str | None = None):
    """The model's tokenizer and chat template (a transformers fast tokenizer).

    For GGUF files the tokenizer embedded in the file is converted once by transformers and
    cached under ``$PDJAX_CACHE_DIR`` (default ``~/.cache/pdjax``), keyed by file size and
    modification time.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(model_path)
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    os.makedirs(cached, exist_ok=True)
    tok.save_pretrained(cached)
    return tok
