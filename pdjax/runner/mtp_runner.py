"""The forwards of a DeepSeek-V3 / GLM-5 multi-token prediction (MTP) layer, for the MTP
drafter (``--speculative-algorithm mtp``, DESIGN.md §3, "Speculative decoding").

The MTP parameters live in the target model (``DeepseekForCausalLM(mtp=True)``, sharing its
embedding and LM head), so an ``MTPRunner`` holds no parameters of its own: every forward
takes the target runner's state. It owns the MTP layer's KV buffers (``mtp_cache_spec``: one
layer's latent, and indexer keys with DSA) in a page pool of its own, and reads the target's
``"mtp_hidden"`` buffer, where every target forward wrote each token's normed last hidden state
at the token's slot::

    MTP token at position i:  id = token at i + 1,  hidden = target's hidden at i
                              (read at hidden_slots[t], a slot of the target's page table)
                          or  id, hidden = row prev_idx[t] of the previous MTP forward's
                              (tokens, hidden) outputs, on the device (chained drafts)
    output of logits row r:   argmax token [max_rows] int32, normed hidden [max_rows, Hd]

Under DP attention (the target's ``dp_size > 1``) the MTP layer runs as the target's layers do
(``dp_attention.dp_decoder_layers``): its pool is page-sharded, ``num_pages / dp`` pages a
rank, a request's MTP pages on the rank of its target pages (global ids as
``sched/dp_kv_cache_manager.py``'s); the batch is a ``DpFlatBatch``; ``hidden_slots`` are
rank-local slots in the stream's layout, read on each rank's own devices
(``dp_rows.dp_read_rows``); a bucket's rows and tokens are a rank's, its output rows
``dp * num_rows`` in the rows' order.

One jit per entry point (``decode``, ``extend``) and ``BucketKey``, compiled by ``warmup``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax.models.attention import AttentionMetadata
from pdjax.models.dp_rows import dp_read_rows
from pdjax.pallas_kernels.lanes import kv_row_align
from pdjax.sched.batch import FlatBatch, build_flat_batch
from pdjax.sched.buckets import BucketKey, Buckets
from pdjax.sched.dp_batch import build_dp_batch, local_rows


def _mtp_step(graphdef, max_rows, decode_only, state, caches, target_hidden, input_ids,
              hidden_slots, prev_idx, prev_tokens, prev_hidden, md, logits_indices):
    """One greedy MTP forward. ``input_ids``, ``hidden_slots``, ``prev_idx`` ``[T]`` int32;
    ``prev_tokens [M]`` int32 and ``prev_hidden [M, Hd]``: the previous forward's outputs
    (``M = max_rows``); ``target_hidden [1, pages, page_size, >= Hd]``. Returns
    ``(tokens [M] int32, hidden [M, Hd], caches)``, rows past ``logits_indices`` zero."""
    model = nnx.merge(graphdef, state)
    Hd = model.cfg.hidden_size
    chained = prev_idx >= 0
    src = jnp.maximum(prev_idx, 0)
    ids = jnp.where(chained, prev_tokens[src], input_ids)
    page_size = target_hidden.shape[2]
    dp = getattr(model.cfg, "dp_size", 1)
    if dp > 1:      # rank-local slots, each rank's read on its own devices
        h = dp_read_rows(model.cfg, target_hidden, 0, hidden_slots.reshape(dp, -1))[:, :Hd]
    else:
        h = target_hidden[0, hidden_slots // page_size, hidden_slots % page_size, :Hd]
    h = jnp.where(chained[:, None], prev_hidden[src].astype(h.dtype), h)
    if decode_only:
        md = dataclasses.replace(md, decode_only=True)
    out, caches = model.mtp_forward(ids, h, caches, md)
    rows = out[logits_indices]                                                   # [R, Hd]
    tokens = jnp.argmax(model.mtp_logits(rows), axis=-1).astype(jnp.int32)
    R = rows.shape[0]
    tokens = jnp.zeros((max_rows,), jnp.int32).at[:R].set(tokens)
    hidden = jnp.zeros((max_rows, Hd), rows.dtype).at[:R].set(rows)
    return tokens, hidden, caches


class MTPRunner:
    """The MTP layer's KV pool and forwards beside a target ``ModelRunner``.

    ``target``: the target's runner (its model built with ``mtp=True``; ``ValueError``
    otherwise). ``num_pages`` / page size (the target's): the MTP KV pool (page 0 is the null
    page; under DP attention ``num_pages / dp`` a rank, each rank's page 0 its null page;
    ``ValueError`` there when it is not the target's ``num_pages``: a request's MTP pages are
    on the rank of its target pages, read from their ids).
    ``buckets``: the shapes to compile (the engine's limits, as the draft model's; under DP
    attention a rank's).
    """

    def __init__(self, target, *, num_pages: int, buckets: Buckets,
                 chunk_size: int | None = None):
        model = nnx.merge(target.graphdef, target.state)
        if not getattr(model, "mtp_enabled", False):
            raise ValueError("speculative_algorithm 'mtp': the target model has no MTP layer "
                             "(a DeepSeek-V3 / V3.2 / GLM-5 checkpoint with "
                             "num_nextn_predict_layers >= 1, loaded with mtp=True)")
        self.target = target
        self.cfg = target.cfg
        self.page_size = target.page_size
        self.num_pages = num_pages
        self.buckets = buckets
        self.dp_size = getattr(target, "dp_size", 1)
        self.pages_per_rank = num_pages // self.dp_size
        if self.dp_size > 1 and num_pages != target.num_pages:
            # a request's MTP pages are on the rank of its target pages, which is read from
            # the target's page ids with this pool's pages per rank
            raise ValueError(f"num_pages: the MTP pool under DP attention has the target's "
                             f"{target.num_pages} pages, got {num_pages}")
        self.max_rows = buckets.max_rows * self.dp_size     # output rows: every rank's
        self.chunk_size = chunk_size
        mesh = target.mesh
        kv_dtype = next(s.dtype for s in target.cache_specs if s.name == "mtp_hidden")
        self.cache_specs = tuple(model.mtp_cache_spec(     # DP: a rank's pool a device
            self.pages_per_rank, self.page_size, kv_dtype,
            row_align=kv_row_align(mesh.devices.flat[0].platform)))
        replicated = NamedSharding(mesh, P())
        shardings = {s.name: NamedSharding(mesh, s.partition) for s in self.cache_specs}
        self.caches = {s.name: s.zeros(shardings[s.name]) for s in self.cache_specs}
        hd, dtype = self.cfg.hidden_size, model.embed_tokens[...].dtype
        self.no_prev = (jax.device_put(jnp.zeros((self.max_rows,), jnp.int32), replicated),
                        jax.device_put(jnp.zeros((self.max_rows, hd), dtype), replicated))
        self._jit = jax.jit(_mtp_step, static_argnums=(0, 1, 2), donate_argnums=(4,),
                            out_shardings=(replicated, replicated, shardings))

    def stream_len(self, key: BucketKey) -> int:
        """Tokens of bucket ``key``'s flat stream (``dp`` segments under DP attention)."""
        return key.num_tokens * self.dp_size

    def make_batch(self, key: BucketKey, rows) -> FlatBatch:
        """``rows`` (``BatchRow``s, decode-length rows first) laid out in bucket ``key``; under
        DP attention a ``DpFlatBatch``, each row on the rank of its (global) MTP pages."""
        if self.dp_size > 1:
            local, ranks = local_rows(list(rows), self.pages_per_rank)
            return build_dp_batch(local, ranks, dp_size=self.dp_size, page_size=self.page_size,
                                  num_tokens_pad=key.num_tokens, num_rows_pad=key.num_rows,
                                  pages_per_seq_pad=key.pages_per_seq,
                                  num_logits_pad=self.dp_size * key.num_rows,
                                  chunk_size=self.chunk_size)
        return build_flat_batch(list(rows), page_size=self.page_size,
                                num_tokens_pad=key.num_tokens, num_rows_pad=key.num_rows,
                                pages_per_seq_pad=key.pages_per_seq, num_logits_pad=key.num_rows,
                                chunk_size=self.chunk_size)

    def forward(self, key: BucketKey, fb: FlatBatch, hidden_slots: np.ndarray,
                prev_idx: np.ndarray | None = None, prev=None):
        """Dispatch one MTP forward without waiting; returns ``(tokens [M], hidden [M, Hd])``
        on the device, row ``r`` for the batch's row ``r``. ``hidden_slots [T]`` int32: the
        target slot whose hidden state each token reads (padding: 0, the null page; under DP
        attention ``T = stream_len``, slots of the token's rank);
        ``prev_idx [T]`` int32 (default all -1) with ``prev = (tokens, hidden)`` of an earlier
        forward: a token whose id and hidden come from that row."""
        if prev_idx is None:
            prev_idx = np.full(self.stream_len(key), -1, np.int32)
        prev_tokens, prev_hidden = prev if prev is not None else self.no_prev
        md = AttentionMetadata(fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens,
                               fb.page_indices, fb.distribution)
        # DP attention's shard_maps trace under the target's kernel mesh, as its forwards do
        mesh = (self.target.jits.kernel_mesh() if self.dp_size > 1
                else contextlib.nullcontext())
        with mesh:
            tokens, hidden, self.caches = self._jit(
                self.target.graphdef, self.max_rows, key.entry == "decode", self.target.state,
                self.caches, self.target.caches["mtp_hidden"], fb.input_ids, hidden_slots,
                prev_idx, prev_tokens, prev_hidden, md, fb.logits_indices)
        return tokens, hidden

    def warmup(self) -> None:
        """Compile (and run once, on padding) every bucket."""
        for key in self.buckets.all_keys():
            fb = self.make_batch(key, [])
            self.forward(key, fb, np.zeros(self.stream_len(key), np.int32))
        jax.block_until_ready(self.caches)
