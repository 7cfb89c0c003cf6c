"""The jitted functions of one model on one mesh, and the abstract inputs of every bucket.

``EntryPoints`` is what the model runner compiles, without any device array: the model enters
as its ``graphdef`` and a state whose leaves may be arrays or ``jax.ShapeDtypeStruct``s with
shardings, the KV cache and the penalty tables as shapes (``abstract_device_state``). So the
same code lowers a bucket for the devices the process runs on (``ModelRunner``, which then
holds the arrays) and for compile-only devices of another accelerator (``pdjax.aot``: a TPU
topology or a GPU target config on a CPU host, DESIGN.md §7). Every output sharding names
``mesh``, never a default device.

Entry points (DESIGN.md §2): ``decode`` and ``extend`` (prefill chunks and mixed batches) per
``BucketKey``; ``resample`` per (entry, logits rows) (the split grammar path, §3);
``prompt_logprobs`` per extend token count; ``init_penalty_slot``; and the staging path's page
``gather`` / ``scatter`` per page count (§4).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax.models.attention import AttentionMetadata
from pdjax.runner import device_sampler
from pdjax.runner.device_sampler import SamplingInputs, StepOutputs
from pdjax.sched.batch import FlatBatch, build_flat_batch
from pdjax.sched.dp_batch import build_dp_batch, local_rows
from pdjax.sched.buckets import BucketKey


def abstract(tree):
    """``jax.ShapeDtypeStruct`` (shape, dtype, sharding) of every array in ``tree``: what a
    lowering needs, readable while another thread donates the arrays themselves. Leaves that
    are already ``ShapeDtypeStruct``s stay as they are."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


def real_logits_rows(logits_indices: jax.Array) -> jax.Array:
    """How many entries of a ``FlatBatch.logits_indices`` ``[N]`` int32 (traced) are real:
    ``build_flat_batch`` lists them as strictly increasing token indices and pads with 0s
    after them, so the count is one more than the number of rises (1 when there is none).
    The LM head multiplies only those rows (``compute_logits(num_rows=...)``): a mixed step of
    8 decode rows and a prompt chunk has 9 logits rows in a bucket of 16, and SmolLM2's head
    over the 7 padding rows cost about 3.7 ms of a 35 ms step on this CPU."""
    return 1 + jnp.sum(logits_indices[1:] > logits_indices[:-1]).astype(jnp.int32)


def _forward(graphdef, state, caches, penalty_counts, prompt_seen, input_ids, prev_idx,
             prev_tokens, md, logits_indices, sp, max_rows):
    # Placeholders: a decode row whose input token the previous step sampled (overlap, not yet
    # known on the host) names that token's row in the previous step's ``tokens``.
    input_ids = jnp.where(prev_idx >= 0, prev_tokens[jnp.maximum(prev_idx, 0)], input_ids)
    model = nnx.merge(graphdef, state)
    hidden, caches = model.paged_forward(input_ids, caches, md)
    logits = model.compute_logits(hidden[logits_indices],
                                  num_rows=real_logits_rows(logits_indices))
    out, penalty_counts = device_sampler.sample(logits, sp, prompt_seen, penalty_counts, max_rows)
    return out, hidden, caches, penalty_counts, logits


# Two entry points over the same model, each its own jit (its own executables per bucket):
# decode, and extend (prefill_chunk and mixed batches: the same function of the same shapes).
def _decode(graphdef, max_rows, state, caches, penalty_counts, prompt_seen, input_ids, prev_idx,
            prev_tokens, md, logits_indices, sp):
    md = dataclasses.replace(md, decode_only=True)      # static: no code for longer rows
    out, _, caches, counts, logits = _forward(graphdef, state, caches, penalty_counts,
                                              prompt_seen, input_ids, prev_idx, prev_tokens, md,
                                              logits_indices, sp, max_rows)
    return out, None, caches, counts, logits


def _extend(graphdef, max_rows, *args):
    return _forward(graphdef, *args, max_rows)


def _resample(max_rows, logits, sp, prompt_seen, penalty_counts, first: StepOutputs, redo):
    """Sample rows ``redo [R]`` bool of a forward's ``logits [R, V]`` again with ``sp`` (the
    split grammar path, DESIGN.md §3); the other rows keep ``first``'s results."""
    out, penalty_counts = device_sampler.sample(logits, sp, prompt_seen, penalty_counts, max_rows)
    R = logits.shape[0]
    redo_padded = jnp.zeros((max_rows,), bool).at[:R].set(redo)
    merged = StepOutputs(jnp.where(redo_padded, out.tokens, first.tokens),
                         jnp.where(redo, out.token_logprob, first.token_logprob),
                         jnp.where(redo[:, None], out.top_ids, first.top_ids),
                         jnp.where(redo[:, None], out.top_logprobs, first.top_logprobs),
                         jnp.where(redo, out.emitted, first.emitted))
    return merged, penalty_counts


def _prompt_logprobs(graphdef, state, hidden, indices, target_ids, want_top):
    logits = nnx.merge(graphdef, state).compute_logits(hidden[indices])
    return device_sampler.prompt_logprobs(logits, target_ids, want_top)


def _gather_pages(caches, idx):
    return {k: jnp.take(v, idx, axis=1) for k, v in caches.items()}


def _gather_pages_by_slices(caches, idx):
    """``_gather_pages`` (pages ``idx`` [n] int32 of every buffer: ``[L, N, ...] ->
    [L, n, ...]``) as one dynamic slice per page in a loop, for TPU: there XLA's gather along
    the page axis holds a temp of one to one and a half buffers (Llama-3-8B's 4 GiB K and V
    pools on v6e: 4.0-6.0 GiB for 2 to 128 pages; BENCHMARKS.md), the loop only its output.
    On the CPU the gather is faster (64 of 1,024 SmolLM2 pages: 13.6 against 22.8 ms) and on
    the GPU it holds no temp, so they keep it. A page id past the pool is clamped, as a
    dynamic slice does; the callers range-check them first."""
    def gather(v):
        def copy_page(i, out):
            page = jax.lax.dynamic_slice_in_dim(v, idx[i], 1, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(out, page, i, axis=1)
        out = jnp.zeros((v.shape[0], idx.shape[0], *v.shape[2:]), v.dtype)
        return jax.lax.fori_loop(0, idx.shape[0], copy_page, out)
    return {k: gather(v) for k, v in caches.items()}


def _scatter_pages(caches, idx, parts):
    return {k: v.at[:, idx].set(parts[k].astype(v.dtype)) for k, v in caches.items()}


class EntryPoints:
    """The jits of one model on ``mesh``, and ``lower_*`` methods that trace them from shapes.

    Args:
      graphdef: the model's ``nnx.split`` graph definition.
      mesh: the ``tp`` mesh every output sharding names (real or compile-only devices).
      cache_specs: the model's ``CacheBufferSpec``s (``model.cache_spec(...)``).
      max_rows: logits rows of the largest bucket (``Buckets.max_rows``).
      vocab_size: the model's vocabulary (penalty tables, sampling inputs).
      page_size, chunk_size: what ``build_flat_batch`` lays a bucket's example batch out with.
      verify_width: logits rows per request row of an ``extend`` bucket: 1, or the tokens of a
        speculative verify row (``speculative_num_draft_tokens``), each of which is sampled
        (DESIGN.md §3, "Speculative decoding"). The sampled ids are padded to
        ``max_logits_rows = max_rows * verify_width * dp_size``.
      dp_size, pages_per_rank: DP attention (``models/dp_attention.py``): a bucket's
        ``num_tokens`` / ``num_rows`` are each rank's padding, the token stream is ``dp_size``
        such segments, the metadata per rank (``sched/dp_batch.py``), and batch rows carry
        global page ids (``sched/dp_kv_cache_manager.py``), ``pages_per_rank`` a rank.
    """

    def __init__(self, graphdef, mesh: Mesh, cache_specs, *, max_rows: int, vocab_size: int,
                 page_size: int, chunk_size: int | None = None, verify_width: int = 1,
                 dp_size: int = 1, pages_per_rank: int | None = None):
        self.graphdef = graphdef
        self.mesh = mesh
        self.cache_specs = tuple(cache_specs)
        self.max_rows = max_rows
        self.verify_width = verify_width
        self.dp_size = dp_size
        self.pages_per_rank = pages_per_rank
        self.max_logits_rows = max_rows * verify_width * dp_size
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.cache_shardings = {s.name: NamedSharding(mesh, s.partition)
                                for s in self.cache_specs}
        self.replicated = NamedSharding(mesh, P())
        # One penalty slot per request that can run at once, plus the null slot 0.
        self.num_penalty_slots = max_rows + 1
        replicated = self.replicated
        self.forwards = {
            name: jax.jit(fn, static_argnums=(0, 1), donate_argnums=(3, 4),
                          out_shardings=(replicated, None, self.cache_shardings, replicated,
                                         None))
            for name, fn in (("decode", _decode), ("extend", _extend))}
        self.resample = jax.jit(_resample, static_argnums=0, donate_argnums=4,
                                out_shardings=(replicated, replicated))
        self.prompt_logprobs = jax.jit(_prompt_logprobs, static_argnums=0,
                                       out_shardings=replicated)
        self.init_penalty_slot = jax.jit(device_sampler.init_penalty_slot, donate_argnums=(0, 1),
                                         out_shardings=(replicated, replicated))
        self.gather_pages = jax.jit(_gather_pages_by_slices if self._platform() == "tpu"
                                    else _gather_pages)
        self.scatter_pages = jax.jit(_scatter_pages, donate_argnums=0,
                                     out_shardings=self.cache_shardings)

    # ------------------------------------------------------------------ abstract inputs
    def abstract_device_state(self):
        """``(caches, penalty_counts, prompt_seen, no_prev_tokens)`` as shapes with their
        shardings: the KV buffers (``{name: [layers, num_pages, page_size, *row]}``), the
        penalty tables ``[S, V]`` int32 and bool, and the previous step's ids ``[max_logits_rows]``
        int32. ``ModelRunner`` allocates zeros of exactly these."""
        S = jax.ShapeDtypeStruct
        caches = {s.name: S(s.shape, s.dtype, sharding=self.cache_shardings[s.name])
                  for s in self.cache_specs}
        table = (self.num_penalty_slots, self.vocab_size)
        return (caches, S(table, jnp.int32, sharding=self.replicated),
                S(table, jnp.bool_, sharding=self.replicated),
                S((self.max_logits_rows,), jnp.int32, sharding=self.replicated))

    def example_batch(self, key: BucketKey, rows=()) -> FlatBatch:
        """The flat batch of ``rows`` laid out in bucket ``key`` (empty: all padding); under
        DP attention a ``DpFlatBatch``, each row on the rank of its pages."""
        if self.dp_size > 1:
            local, ranks = local_rows(list(rows), self.pages_per_rank)
            return build_dp_batch(local, ranks, dp_size=self.dp_size, page_size=self.page_size,
                                  num_tokens_pad=key.num_tokens, num_rows_pad=key.num_rows,
                                  pages_per_seq_pad=key.pages_per_seq,
                                  num_logits_pad=self.logits_rows(key),
                                  chunk_size=self.chunk_size)
        return build_flat_batch(list(rows), page_size=self.page_size,
                                num_tokens_pad=key.num_tokens, num_rows_pad=key.num_rows,
                                pages_per_seq_pad=key.pages_per_seq,
                                num_logits_pad=self.logits_rows(key), chunk_size=self.chunk_size)

    def logits_rows(self, key: BucketKey) -> int:
        """Logits (and sampling) rows of bucket ``key``: its rows; for ``extend`` (the entry
        verify rows run through) with ``verify_width > 1``, up to ``verify_width`` per row but
        no more than its tokens (each logits row is a distinct token), so a small bucket keeps
        a small sampler (the LM head and the sampler cost grow with these rows). Under DP
        attention, that many for each rank (``key`` is a rank's padding)."""
        if key.entry != "extend" or self.verify_width == 1:
            return key.num_rows * self.dp_size
        return self.dp_size * max(key.num_rows,
                                  min(key.num_rows * self.verify_width, key.num_tokens))

    def stream_len(self, key: BucketKey) -> int:
        """Tokens of bucket ``key``'s flat stream: ``num_tokens``, times ``dp_size`` under DP
        attention (one padded segment a rank)."""
        return key.num_tokens * self.dp_size

    def _platform(self) -> str:
        """``"cpu"``, ``"gpu"`` (CUDA) or ``"tpu"``: the mesh's devices (real or compile-only)."""
        platform = self.mesh.devices.flat[0].platform
        return "gpu" if platform == "cuda" else platform

    def kernel_mesh(self):
        """The mesh context the Pallas kernels' TP ``shard_map`` reads (``tp_shard.py``) on an
        accelerator; on the CPU (the jnp paths, partitioned by XLA) no context, as before."""
        if self._platform() == "cpu":
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    # ------------------------------------------------------------------ lowerings
    # Example inputs are numpy arrays: only their shapes and dtypes reach the trace, and no
    # device (a compile-only one cannot hold an array) is asked to hold them.
    def lower_forward(self, key: BucketKey, state, caches, penalty_counts, prompt_seen,
                      no_prev_tokens):
        """The lowered forward of bucket ``key`` (``jax.stages.Lowered``); every argument may
        be arrays or shapes (``abstract``)."""
        fb = self.example_batch(key)
        md = AttentionMetadata(*(np.asarray(a) for a in (
            fb.positions, fb.slot_mapping, fb.cu_q_lens, fb.kv_lens, fb.page_indices,
            fb.distribution)))
        sampling = device_sampler.build_sampling_inputs([], self.logits_rows(key),
                                                        vocab_size=self.vocab_size)
        state, caches, counts, seen, no_prev = abstract(
            (state, caches, penalty_counts, prompt_seen, no_prev_tokens))
        with self.kernel_mesh():
            return self.forwards[key.entry].trace(
                self.graphdef, self.max_logits_rows, state, caches, counts, seen,
                np.asarray(fb.input_ids), np.full(self.stream_len(key), -1, np.int32),
                no_prev, md, np.asarray(fb.logits_indices),
                SamplingInputs(*(np.asarray(a) for a in sampling))).lower()

    def lower_resample(self, first: StepOutputs, logits, prompt_seen, penalty_counts):
        """The lowered ``resample`` for a forward's outputs ``first`` and ``logits [R, V]``
        (arrays, or shapes with the forward's own output shardings)."""
        num_rows = logits.shape[0]
        sampling = device_sampler.build_sampling_inputs([], num_rows, vocab_size=self.vocab_size)
        seen, counts = abstract((prompt_seen, penalty_counts))
        return self.resample.trace(
            self.max_logits_rows, logits, SamplingInputs(*(np.asarray(a) for a in sampling)),
            seen, counts, first, np.zeros(num_rows, bool)).lower()

    def lower_prompt_logprobs(self, state, hidden):
        """The lowered prompt-logprobs of ``hidden [T, H]`` (an extend forward's output)."""
        n = hidden.shape[0]
        with self.kernel_mesh():
            return self.prompt_logprobs.trace(
                self.graphdef, abstract(state), abstract(hidden), np.zeros(n, np.int32),
                np.zeros(n, np.int32), np.asarray(True)).lower()

    def lower_init_penalty_slot(self, prompt_seen, penalty_counts):
        S = jax.ShapeDtypeStruct
        return self.init_penalty_slot.trace(
            abstract(prompt_seen), abstract(penalty_counts), S((), jnp.int32),
            S((self.vocab_size,), jnp.bool_), S((self.vocab_size,), jnp.int32)).lower()

    def lower_gather_pages(self, caches, num_pages: int):
        """The lowered staging gather of ``num_pages`` pages of ``caches``."""
        return self.gather_pages.trace(abstract(caches), self._page_idx(num_pages)).lower()

    def lower_scatter_pages(self, caches, num_pages: int):
        """The lowered staging scatter of ``num_pages`` pages into ``caches``."""
        caches = abstract(caches)
        parts = {name: jax.ShapeDtypeStruct((c.shape[0], num_pages, *c.shape[2:]), c.dtype,
                                            sharding=c.sharding)
                 for name, c in caches.items()}
        return self.scatter_pages.trace(caches, self._page_idx(num_pages), parts).lower()

    def _page_idx(self, num_pages: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_pages,), jnp.int32, sharding=self.replicated)
