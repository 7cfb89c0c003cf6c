"""Whole TPU lanes for the rows of the KV buffers that TP does not split.

On TPU, XLA tiles an array's two minor dimensions in tiles of 128 lanes. A donated KV buffer
whose rows are not a whole number of lanes (MLA's latent, ``kv_lora_rank + rope`` = 576) is
laid out compactly as an argument, and every step that reads or writes it copies the whole
pool into the tiled layout and back (a 1.19 GiB latent pool: 1.28 GiB of temp for one XLA
gather of 128 pages; none with 640-lane rows, DESIGN.md §7). So on TPU the rows of the
replicated buffers (the MLA latent, the DSA indexer keys) are padded to whole lanes. The pad
lanes are written as zeros, and every reader pads its query with zeros to the row's width, so
scores are unchanged; values are the leading ``kv_lora_rank`` lanes as before.

    latent row on TPU:  [ c_kv: 512 | k_pe: 64 | 0: 64 ]   640 lanes = 5 whole lanes
    latent row elsewhere: [ c_kv: 512 | k_pe: 64 ]          576

GQA rows (``[.., KVH * D]``) are split between heads over ``tp`` and are not padded: with
``head_dim`` 128 (every supported GQA model but SmolLM2) they are whole lanes already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TPU_LANES = 128


def kv_row_align(platform: str) -> int:
    """Lanes a replicated KV row is padded to on ``platform``: 128 on TPU, 1 (none) elsewhere."""
    return TPU_LANES if platform == "tpu" else 1


def aligned_width(width: int, align: int) -> int:
    """``width`` rounded up to a multiple of ``align`` (>= 1); raises ``ValueError`` otherwise."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return -(-width // align) * align


def pad_last_dim(x: jax.Array, width: int) -> jax.Array:
    """``x`` with its last dimension zero-padded to ``width`` (``x`` itself when it is that
    wide). Raises ``ValueError`` when ``x`` is wider."""
    pad = width - x.shape[-1]
    if pad < 0:
        raise ValueError(f"last dimension {x.shape[-1]} is wider than the row ({width})")
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def pad_query_to_rows(q: jax.Array, cache: jax.Array) -> jax.Array:
    """``q [..., D]`` zero-padded to the width ``W`` of the rows of ``cache [L, N, page_size,
    W]`` when they are wider (whole lanes on TPU): the pad lanes meet zeros, so scores are
    unchanged. Any other ``cache`` leaves ``q`` as it is (the kernels' contract checks name
    it)."""
    if cache.ndim == 4 and cache.shape[3] > q.shape[-1]:
        return pad_last_dim(q, cache.shape[3])
    return q
