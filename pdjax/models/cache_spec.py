"""Description of a model's paged KV cache as a list of buffers, each with its own page bytes.

A GQA model has two buffers (``k_cache``, ``v_cache``); an MLA model has one latent buffer and,
with DSA, an indexer key buffer that covers only the layers that run their own indexer. Every
buffer is one layer-major array ``[layers, num_pages, page_size, *row]`` (the layout the
``lax.scan`` over layers carries, DESIGN.md §2), and all buffers share the page table: page
``p`` of a request means page ``p`` in every buffer.

    buffer "latent"     [L,  num_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    buffer "indexer_k"  [Li, num_pages, page_size, index_head_dim]       (Li = full layers)
    buffer "mtp_hidden" [1,  num_pages, page_size, hidden_size]   (MTP on: each token's normed
                                                                   last hidden state)

    bytes of one page in one layer  = page_size * prod(row) * itemsize   (bytes_per_page_layer)
    bytes of one page, all layers   = layers * bytes_per_page_layer     (bytes_per_page)

The model runner allocates one zero array per spec; the PD transfer copies, for each run of
pages, ``run_len * bytes_per_page_layer`` bytes per (buffer, layer) and registers the
per-buffer byte lengths (DESIGN.md §4).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class CacheBufferSpec:
    """One layer-major KV buffer.

    Attributes:
      name: key of the buffer in the model's cache dict (``"latent"``, ``"indexer_k"``, ...).
      shape: ``(layers, num_pages, page_size, *row)``.
      dtype: element dtype.
      partition: TP partition spec of the array (``P()`` = replicated on every rank).
      row_heads: heads side by side in a row (``shape[3:]``): GQA's KV heads, which TP splits
        between shards; 1 for a buffer with one head (replicated).
    """

    name: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    partition: P = P()
    row_heads: int = 1

    def __post_init__(self):
        if len(self.shape) < 4 or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"CacheBufferSpec {self.name!r}: shape must be (layers, num_pages, "
                             f"page_size, *row) of positive ints, got {self.shape}")
        if self.row_heads < 1 or self.shape[3] % self.row_heads:
            raise ValueError(f"CacheBufferSpec {self.name!r}: row_heads {self.row_heads} does "
                             f"not divide the row of {self.shape}")

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def num_pages(self) -> int:
        return self.shape[1]

    @property
    def page_size(self) -> int:
        return self.shape[2]

    @property
    def bytes_per_page_layer(self) -> int:
        """Bytes of one page of one layer (the unit one PD copy moves per page)."""
        return math.prod(self.shape[2:]) * jnp.dtype(self.dtype).itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all layers of this buffer."""
        return self.num_layers * self.bytes_per_page_layer

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def zeros(self, sharding=None) -> jax.Array:
        """A zero array of this shape and dtype (placed with ``sharding`` when given)."""
        x = jnp.zeros(self.shape, self.dtype)
        return x if sharding is None else jax.device_put(x, sharding)


def bytes_per_page(specs: tuple[CacheBufferSpec, ...] | list[CacheBufferSpec]) -> int:
    """Bytes of one page summed over every buffer and layer (what PD moves per page)."""
    return sum(s.bytes_per_page for s in specs)


def gqa_cache_spec(num_layers: int, num_kv_heads: int, head_dim: int, *, num_pages: int,
                   page_size: int, dtype=jnp.float32,
                   rows: bool = False) -> tuple[CacheBufferSpec, ...]:
    """The two buffers of a GQA model, in the same description as the MLA caches.

    ``k_cache``, ``v_cache``: with ``rows`` (the TPU layout) ``[L, N, ps, KVH * D]``, a
    token's KV heads side by side in one row, the row split between heads over ``tp``;
    otherwise ``[L, N, ps, KVH, D]``, heads split over ``tp``. The same memory as ``[L, N, ps, KVH, D]``,
    but on TPU a page of rows is whole (16, 128) tiles whenever ``KVH * D`` (per shard) is a
    multiple of 128, where a 5-dim pool puts (KVH, D) in the tiled dimensions (Llama-3-70B at
    TP 8, one KV head per shard, needed 53 GB of temporaries on v6e; DESIGN.md §7)::

        row of token t:  [ head 0: D lanes | head 1: D lanes | ... ]   (shard j: heads j*KVH/tp..)

    With ``dtype`` float8_e4m3fn the values come with real scales (``fp8_kv``): two more
    buffers ``k_scale``, ``v_scale`` ``[L, N, ps, KVH]`` float32, one scale per token per KV
    head, split over ``tp`` with their heads (KV format ``fp8:gqa<bytes>``, ``kv_format``).
    """
    dtype = jnp.dtype(dtype)
    if not rows:      # CPU and GPU: [L, N, ps, KVH, D] (the same memory)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        part = P(None, None, None, "tp", None)
        specs = (CacheBufferSpec("k_cache", shape, dtype, part),
                 CacheBufferSpec("v_cache", shape, dtype, part))
    else:
        shape = (num_layers, num_pages, page_size, num_kv_heads * head_dim)
        part = P(None, None, None, "tp")
        specs = (CacheBufferSpec("k_cache", shape, dtype, part, num_kv_heads),
                 CacheBufferSpec("v_cache", shape, dtype, part, num_kv_heads))
    if dtype != jnp.dtype(jnp.float8_e4m3fn):
        return specs
    scale = (num_layers, num_pages, page_size, num_kv_heads)
    return specs + tuple(CacheBufferSpec(name, scale, jnp.dtype(jnp.float32),
                                         P(None, None, None, "tp"), num_kv_heads)
                         for name in GQA_SCALE_BUFFERS)


# The per-token scale buffers of an FP8 GQA cache (``fp8_kv``), in the model's cache dict.
GQA_SCALE_BUFFERS = ("k_scale", "v_scale")


# Planes of one FP8 record (fp8_record.py): named together in the KV format.
_RECORD_OF = {"latent": "mla", "latent_scale": "mla", "latent_rope": "mla",
              "indexer_k": "idx", "indexer_k_scale": "idx",
              "k_cache": "gqa", "v_cache": "gqa", "k_scale": "gqa", "v_scale": "gqa"}
KV_FORMAT_MAX_LEN = 32       # the PD wire field's limit (pd/protocol.py, pd/bootstrap.py)


def kv_format(specs: tuple[CacheBufferSpec, ...] | list[CacheBufferSpec]) -> str:
    """The KV format two PD servers must share, named for people (at most 32 characters).

    Buffers of one element dtype: that dtype's name (``"bfloat16"``, ``"float8_e4m3fn"``: the
    names PD used before records existed). A model with FP8 records: ``"fp8:"`` and each
    record by its bytes a token a layer, then the dtypes of the other buffers, joined by
    ``+``: ``"fp8:mla656+idx132"`` (FlashMLA's latent record and DSA's FP8 indexer keys, GPU
    / CPU), ``"fp8:mla768+bfloat16"`` (the TPU split, bf16 indexer keys), ``"+bfloat16"``
    more with MTP's hidden-state buffer; GQA's e4m3 K and V with a float32 scale per token
    per KV head ``"fp8:gqa408"`` (SmolLM2: 2 x (3 heads x 64 + 3 x 4) bytes; the plain
    cast without scales was ``"float8_e4m3fn"``). Raises ``ValueError`` for no buffers or a name past
    32 characters."""
    if not specs:
        raise ValueError("specs: no KV buffers")
    names = {s.name for s in specs}
    if "latent_rope" not in names and len({jnp.dtype(s.dtype) for s in specs}) == 1:
        return jnp.dtype(specs[0].dtype).name
    records = {"mla"} if "latent_rope" in names else set()
    if "indexer_k_scale" in names:
        records.add("idx")
    if "k_scale" in names:
        records.add("gqa")
    parts: list[str] = []
    for s in specs:
        record = _RECORD_OF.get(s.name)
        if record in records:
            row = sum(math.prod(p.shape[3:]) * jnp.dtype(p.dtype).itemsize for p in specs
                      if _RECORD_OF.get(p.name) == record)
            part = f"{record}{row}"
        else:
            part = jnp.dtype(s.dtype).name
        if part not in parts:
            parts.append(part)
    name = "fp8:" + "+".join(parts)
    if len(name) > KV_FORMAT_MAX_LEN:
        raise ValueError(f"specs: KV format {name!r} is longer than {KV_FORMAT_MAX_LEN} "
                         f"characters")
    return name
