"""The model-loading API: ``load_model`` (any registered architecture, from an HF folder, a
GGUF file or a pdjax Orbax checkpoint, onto a mesh) and ``load_tokenizer`` (with the chat
template).

    path ─> checkpoint_architecture ─> registry.model_family ─> read_params ─> build_model
                                                                (or restore_params for Orbax)

``load_format="dummy"`` reads only the config and makes random weights on the devices
(``load_dummy_model``; vLLM's and SGLang's ``--load-format dummy``). The file formats live in ``checkpoint.py`` and ``orbax_checkpoint.py``, each family's weight
mapping in its own module, and the architecture -> family table in ``registry.py``. The path,
mesh and dtype helpers of ``checkpoint.py`` are re-exported here so callers need one import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

from flax import nnx
from jax.sharding import Mesh, NamedSharding

from pdjax.jax_setup import pdjax_cache_dir
from pdjax.models.checkpoint import (  # noqa: F401 (path, mesh and dtype helpers re-exported)
    checkpoint_architecture, default_model_path, is_gguf, make_mesh, read_gguf, read_gguf_config,
    read_hf_tensors, resolve_dtype, resolve_model_path)
from pdjax.models.orbax_checkpoint import is_orbax_checkpoint, read_marker, restore_params
from pdjax.models.params import abstract_params, place_params, random_params
from pdjax.models.platform import prepare_model
from pdjax.models.registry import ModelFamily, Params, model_family

logger = logging.getLogger(__name__)


def read_params(path: str, progress: bool = True) -> tuple[ModelFamily, object, Params, str]:
    """Read an HF folder or GGUF file (``path`` already resolved) into the stacked params of
    its own config. Returns ``(family, cfg, params, source)``; ``ValueError`` naming the file,
    tensor or architecture that is wrong."""
    family = model_family(checkpoint_architecture(path))
    if is_gguf(path):
        cfg, tensors = read_gguf(path, progress)
    else:
        cfg = family.read_config(path)
        # The MLA family reads lazily (its FP8 checkpoints: each device reads only its shard;
        # stack_hf_tensors widens the rest to float32 itself).
        tensors = read_hf_tensors(path, progress, lazy=family.name == "deepseek")
    return family, cfg, family.stack_params(cfg, tensors, path), path


def _family_model(family: ModelFamily, run_cfg, dtype, model_kwargs):
    return lambda: family.model_class(run_cfg, dtype=dtype, rngs=nnx.Rngs(0), **model_kwargs)


def with_kernels(cfg, attention_impl: str | None = None, pallas_interpret: bool = False):
    """``cfg`` (either family's config) running the attention kernel ``attention_impl``
    (resolved by the platform profile, ``platform.PlatformProfile``; None: the platform's
    default) and, with ``pallas_interpret``, its Pallas kernels interpreted (CPU tests).
    Every layer reads its kernel from the config it already receives."""
    return dataclasses.replace(cfg, attention_impl=attention_impl,
                               pallas_interpret=pallas_interpret)


def run_config(family: ModelFamily, cfg, tp_size: int, ep_size: int = 1,
               moe_a2a_backend: str = "none", dp_size: int = 1,
               attention_impl: str | None = None, pallas_interpret: bool = False):
    """The config ``family``'s model runs at TP ``tp_size``, EP ``ep_size`` (``--ep-size``:
    ``family.expert_parallel``; 1: ``family.run_config``) and DP attention ``dp_size``
    (``--dp-size``: ``family.dp_attention``, applied first, as it changes which weights TP
    splits), with the kernels ``attention_impl`` / ``pallas_interpret`` (``with_kernels``).
    ``ValueError`` naming the field when the layout cannot split the model (``ep_size`` on a
    family without routed experts, ``dp_size`` on a family without DP attention included)."""
    if dp_size != 1:
        if family.dp_attention is None:
            raise ValueError(f"enable_dp_attention: {family.name} models cannot use DP "
                             "attention (built for the MLA family, whose latent KV every TP "
                             "device holds whole)")
        cfg = family.dp_attention(cfg, tp_size, dp_size)
    if ep_size == 1:
        run_cfg = family.run_config(cfg, tp_size)
    elif family.expert_parallel is None:
        raise ValueError(f"ep_size: {family.name} models have no routed experts (ep_size "
                         f"{ep_size} needs an MoE model)")
    else:
        run_cfg = family.expert_parallel(cfg, tp_size, ep_size, moe_a2a_backend)
    if dp_size != 1:            # the checks that need the EP layout too
        run_cfg = family.dp_attention(run_cfg, tp_size, dp_size)
    return with_kernels(run_cfg, attention_impl, pallas_interpret)


def build_model(family: ModelFamily, cfg, params: Params, mesh: Mesh, dtype="auto",
                ep_size: int = 1, moe_a2a_backend: str = "none", dp_size: int = 1,
                attention_impl: str | None = None, pallas_interpret: bool = False,
                **model_kwargs):
    """Place the stacked ``params`` of ``cfg`` on ``mesh`` as ``family``'s module.

    Returns ``(run_cfg, model)``: ``run_cfg`` is ``run_config(family, cfg, tp, ep_size,
    moe_a2a_backend, dp_size, attention_impl, pallas_interpret)`` (Llama: KV heads
    replicated up to the TP size when fewer; MoE under EP: ``moe_ep.py``). ``ValueError``
    when TP / EP does not split the model or a parameter is missing or mis-shaped."""
    tp_size = mesh.shape["tp"]
    run_cfg = run_config(family, cfg, tp_size, ep_size, moe_a2a_backend, dp_size,
                         attention_impl, pallas_interpret)
    params = family.adapt_params(params, cfg, run_cfg)
    make = _family_model(family, run_cfg, resolve_dtype(dtype), model_kwargs)
    return run_cfg, place_params(make, params, family.param_specs(run_cfg, tp_size), mesh)


def load_orbax_model(path: str, *, dtype="auto", mesh: Mesh, ep_size: int = 1,
                     moe_a2a_backend: str = "none", dp_size: int = 1,
                     attention_impl: str | None = None, pallas_interpret: bool = False,
                     **model_kwargs):
    """Restore a pdjax Orbax checkpoint (``orbax_checkpoint.py``) onto ``mesh``.

    When the run config equals the checkpoint's (no KV-head replication), every parameter is
    restored with its target sharding and dtype, so each device gets only its shard; otherwise
    the arrays come to the host and take the ``build_model`` path."""
    family = model_family(read_marker(path)["architecture"])
    cfg = family.read_config(path)
    tp_size = mesh.shape["tp"]
    kernels = dict(attention_impl=attention_impl, pallas_interpret=pallas_interpret)
    run_cfg = run_config(family, cfg, tp_size, ep_size, moe_a2a_backend, dp_size, **kernels)
    if run_cfg != with_kernels(cfg, **kernels):
        logger.info("%s: TP %d (EP %d) changes the layout; restoring through the host", path,
                    tp_size, ep_size)
        return build_model(family, cfg, restore_params(path), mesh, dtype, ep_size,
                           moe_a2a_backend, dp_size, **kernels, **model_kwargs)
    make = _family_model(family, run_cfg, resolve_dtype(dtype), model_kwargs)
    specs = family.param_specs(run_cfg, tp_size)
    targets = {k: a.update(sharding=NamedSharding(mesh, specs[k]))
               for k, a in abstract_params(make).items()}
    return run_cfg, place_params(make, restore_params(path, targets), specs, mesh)


def load_dummy_model(path: str, *, dtype="auto", mesh: Mesh, ep_size: int = 1,
                     moe_a2a_backend: str = "none", dp_size: int = 1,
                     attention_impl: str | None = None, pallas_interpret: bool = False,
                     **model_kwargs):
    """A model of the config at ``path`` (an HF folder with only a config.json is enough, a
    GGUF file or an Orbax checkpoint also do) with random weights made on the devices of
    ``mesh`` (``params.random_params``): no tensor is read. For benchmarks of a model's shape
    without its weights (``scripts/gpu_check.sh``). Returns ``(run_cfg, model)`` like
    ``load_model``; ``ValueError`` naming the config field that is wrong."""
    family = model_family(checkpoint_architecture(path))
    run_cfg = run_config(family, checkpoint_config(path), mesh.shape["tp"], ep_size,
                         moe_a2a_backend, dp_size, attention_impl, pallas_interpret)
    make = _family_model(family, run_cfg, resolve_dtype(dtype), model_kwargs)
    specs = family.param_specs(run_cfg, mesh.shape["tp"])
    return run_cfg, place_params(make, random_params(make, specs, mesh), specs, mesh)


def checkpoint_config(path: str):
    """The config of the checkpoint at ``path`` (already resolved) as written, before
    ``run_config`` adapts it to a TP size; read from metadata only (GGUF header, or the
    config.json of an HF folder or an Orbax checkpoint), no tensor is loaded."""
    if is_gguf(path):
        return read_gguf_config(path)
    return model_family(checkpoint_architecture(path)).read_config(path)


def load_model(model_path: str | None = None, *, dtype="auto", mesh: Mesh | None = None,
               progress: bool = True, load_format: str = "auto", unroll_layers: bool = False,
               cpu_matmul_kernel: bool = False, ep_size: int = 1,
               moe_a2a_backend: str = "none", dp_size: int = 1,
               attention_impl: str | None = None, pallas_interpret: bool = False,
               **model_kwargs):
    """Load a checkpoint onto ``mesh`` (default: one device). Returns ``(run_cfg, model)``.

    The family comes from the checkpoint's architecture (``registry.py``): Llama / Qwen2 /
    Qwen3 give ``(ModelConfig, LlamaForCausalLM)`` (``run_cfg.num_kv_heads`` may be larger
    than the checkpoint's when TP replicates KV heads), DeepSeek-V3 / V3.2 / GLM-5 give
    ``(DeepseekConfig, DeepseekForCausalLM)``. ``model_path`` may be an HF folder, a GGUF file
    or a pdjax Orbax checkpoint. ``load_format``: ``auto`` reads the weights, ``dummy`` makes
    random ones of the checkpoint's config (``load_dummy_model``). ``unroll_layers`` /
    ``cpu_matmul_kernel``: the weight layout of the platform profile, applied once loaded
    (``platform.prepare_model``). ``ep_size`` / ``moe_a2a_backend``: expert parallelism
    over the ``tp`` mesh (``moe_ep.py``; MoE models only). ``dp_size``: DP attention over
    the ``tp`` mesh (``dp_attention.py``; the MLA family only). ``attention_impl`` /
    ``pallas_interpret``: the kernels, carried by ``run_cfg`` (``with_kernels``).
    ``model_kwargs``: the model class's own (``mtp=True``). Raises ``ValueError`` naming the
    file, tensor, architecture or layout that is wrong.
    """
    mesh = mesh if mesh is not None else make_mesh(1)
    path = resolve_model_path(model_path)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format: must be one of auto, dummy; got {load_format!r}")
    ep = dict(ep_size=ep_size, moe_a2a_backend=moe_a2a_backend, dp_size=dp_size,
              attention_impl=attention_impl, pallas_interpret=pallas_interpret)
    if load_format == "dummy":
        run_cfg, model = load_dummy_model(path, dtype=dtype, mesh=mesh, **ep, **model_kwargs)
    elif is_orbax_checkpoint(path):
        run_cfg, model = load_orbax_model(path, dtype=dtype, mesh=mesh, **ep, **model_kwargs)
    else:
        family, cfg, params, _ = read_params(path, progress)
        run_cfg, model = build_model(family, cfg, params, mesh, dtype, **ep, **model_kwargs)
    prepare_model(model, unroll_layers=unroll_layers, cpu_matmul_kernel=cpu_matmul_kernel)
    return run_cfg, model


# --------------------------------------------------------------------------- tokenizer

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
    cached = os.path.join(pdjax_cache_dir("tokenizers"), key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    os.makedirs(cached, exist_ok=True)
    tok.save_pretrained(cached)
    return tok
