"""The draft-model drafter (``--speculative-algorithm draft``, DESIGN.md §3, "Speculative
decoding"): a small model with its own paged KV proposes ``k`` tokens greedily.

Greedy drafting is deterministic, so the draft distribution is a one-hot and the verify step
applies the same lossless rule as for n-gram drafts (no draft probabilities).

Per request the drafter keeps the token ids whose KV its pool holds (``ids``) and their pages.
``propose`` first rolls each request back to the common prefix of ``ids`` and ``all_ids``
(a truncation: the counter moves, whole pages past it go back, no slot is copied), feeds the
missing tokens in one batched extend forward (more when a prompt is longer than a chunk), then
runs ``k - 1`` batched decode forwards, taking the argmax each time::

    all_ids        a b c d e X                 the target kept d e of drafts d e f g, then X
    ids (before)   a b c d e f                 KV of a b c and the drafts fed back, d e f
    common prefix  a b c d e | f dropped       kv counter -> 5; f's slot is overwritten later
    extend         X                           -> d1       (logits of the last fed token)
    decode         d1 -> d2, d2 -> d3 ...       ids = a b c d e X d1 d2 ...

The last token of ``all_ids`` is always fed (when ``ids`` already hold it, it is fed again:
the same KV is written to the same slot), since its logits give the first draft. A decode
forward takes its input tokens from the forward before it on the device (``prev_idx``, as the
engine's overlapped steps do), so the host waits once per ``propose``, for all the drafts.

Shapes stay bounded: the drafter has its own ``ModelRunner`` whose ``Buckets`` are made from
the engine's limits as the target's are (token buckets powers of two up to the chunk, decode
rows powers of two up to ``max_running_requests``, pages per sequence geometric up to the
context); ``warmup`` compiles them all when the engine warms up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.kv.allocator import PageAllocator
from pdjax.models.checkpoint import make_mesh, resolve_dtype
from pdjax.models.loader import load_model
from pdjax.models.registry import model_family
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import Buckets
from pdjax.spec.drafter import register_drafter
from pdjax.spec.own_pages import (OwnPoolDrafter, cdiv, chain_drafts, common_prefix,
                                  feed_in_chunks, read_token, truncate_pages)


@dataclasses.dataclass
class _DraftState:
    ids: list[int]          # tokens whose KV the draft pool holds, positions 0..len-1
    pages: list[int]        # pages covering those positions (ceil(len / page_size) of them)


@register_drafter("draft")
class DraftModelDrafter(OwnPoolDrafter):
    """Greedy drafts from a separate small model (any architecture ``load_model`` reads).

    ``model_path``: the draft checkpoint (``speculative_draft_model_path``); its vocabulary
    must equal the target's ``target_vocab_size`` (``ValueError`` naming
    ``speculative_draft_model_path`` otherwise). ``num_pages`` / ``page_size``: the draft's
    own KV pool (page 0 is the null page). ``max_running_requests``, ``context_length``,
    ``chunked_prefill_size``, ``max_num_batched_tokens``: the engine's limits, which size the
    buckets. ``dtype`` / ``kv_dtype`` / ``attention_impl``: as the target's (resolved);
    ``mesh``: default one device (TP 1).
    """

    def __init__(self, model_path: str, *, target_vocab_size: int, num_pages: int,
                 page_size: int, max_running_requests: int, context_length: int,
                 chunked_prefill_size: int, max_num_batched_tokens: int | None = None,
                 dtype="auto", kv_dtype=None, attention_impl: str | None = None, mesh=None,
                 progress: bool = False, **model_kwargs):
        if not model_path:
            raise ValueError("speculative_draft_model_path is required with "
                             "speculative_algorithm 'draft'")
        if attention_impl is not None:
            model_kwargs["attention_impl"] = attention_impl
        mesh = mesh if mesh is not None else make_mesh(1)
        self.cfg, model = load_model(model_path, dtype=dtype, mesh=mesh, progress=progress,
                                     **model_kwargs)
        if self.cfg.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_draft_model_path {model_path!r}: the draft model's "
                             f"vocabulary ({self.cfg.vocab_size}) differs from the target's "
                             f"({target_vocab_size})")
        kv_dtype = kv_dtype if kv_dtype is not None else resolve_dtype(dtype)
        self.page_size = page_size
        self.chunk_size = chunked_prefill_size
        self.buckets = Buckets.create(
            chunked_prefill_size=chunked_prefill_size, max_running_requests=max_running_requests,
            max_pages_per_seq=cdiv(context_length, page_size),
            max_num_batched_tokens=max_num_batched_tokens,
            traced_pages_bound=attention_impl
            in model_family(self.cfg.architecture).traced_pages_bound_impls)
        self.runner = ModelRunner(model, mesh, num_pages=num_pages,
                                  page_size=page_size, kv_dtype=kv_dtype, buckets=self.buckets,
                                  chunk_size=chunked_prefill_size)
        self.allocator = PageAllocator(num_pages)
        self._state: dict[str, _DraftState] = {}

    # ------------------------------------------------------------------ interface
    def warmup(self) -> None:
        """Compile every bucket of the draft model (the engine calls this at its warm-up)."""
        self.runner.warmup(progress=False)

    def cached_len(self, rid: str) -> int:
        """Tokens of ``rid`` whose KV the draft pool holds."""
        st = self._state.get(rid)
        return len(st.ids) if st is not None else 0

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        live = []               # (index, state, all_ids) of requests that draft this step
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            if k <= 0 or not req.all_ids:
                continue
            ids = list(req.all_ids)
            st = self._state.setdefault(req.rid, _DraftState([], []))
            self._truncate(st, min(common_prefix(st.ids, ids), len(ids) - 1))
            # Every page this step needs, up front: the ids and the k - 1 drafts fed back.
            # A request the pool cannot hold drafts nothing (the others still do).
            if self._reserve(st, len(ids) + k - 1):
                live.append((i, st, ids))
        # Draft j of each request as (device tokens, row): the decode forwards take their
        # input token from the forward before on the device, and the host reads every draft
        # once, at the end.
        def decode(run: list[int], j: int, prev: list) -> list[tuple]:
            return self._decode([(live[n][1], len(live[n][2]) + j - 1, src)
                                 for n, src in zip(run, prev)])

        chains = chain_drafts(self._feed(live), [max_tokens[i] for i, _, _ in live], decode)
        drafts: list[list[int]] = [[] for _ in requests]
        for (i, st, _), chain in zip(live, chains):
            drafts[i] = chain
            st.ids.extend(chain[:-1])             # the drafts fed back hold KV now
        return drafts

    # ------------------------------------------------------------------ pages
    def _truncate(self, st: _DraftState, n: int) -> None:
        """Keep the KV of ``st.ids[:n]``: the counter moves, whole pages past it go back."""
        del st.ids[n:]
        truncate_pages(self.allocator, st.pages, n, self.page_size)


    # ------------------------------------------------------------------ forwards
    def _run(self, mode: str, rows: list[BatchRow], prev_idx: list[int] | None = None,
             prev_tokens=None) -> list[tuple]:
        """One greedy forward of ``rows`` (ordered as ``build_flat_batch`` wants), dispatched
        without waiting; per row, where its argmax token after its last token lies:
        ``(tokens, logits row)``, ``tokens`` the forward's ``StepOutputs.tokens`` on the
        device. ``prev_idx`` (per row, decode): the row of ``prev_tokens`` holding the row's
        input token (its ``input_ids`` entry is then a placeholder), or -1."""
        key = self.buckets.pick(mode, sum(len(r.input_ids) for r in rows), len(rows),
                                max(cdiv(r.kv_len, self.page_size) for r in rows))
        fb = self.runner.make_batch(key, rows)
        idx = None
        if prev_idx is not None:
            idx = np.full(key.num_tokens, -1, np.int32)
            idx[:len(prev_idx)] = prev_idx        # decode: token t is row t
        out, _ = self.runner.forward(key, fb, prev_idx=idx, prev_tokens=prev_tokens)
        return [(out.tokens, start) for start, _ in fb.logits_row_spans]

    def _feed(self, live: list) -> list[tuple]:
        """Feed each ``(index, state, all_ids)`` its tokens past ``state.ids`` (pages
        reserved), one chunk per request per extend forward (a request's chunks run in order,
        in successive forwards); where each one's first draft lies (``_run``)."""
        def extend(chunks: list[tuple[int, int]]) -> list[tuple]:
            rows = []
            for n, size in chunks:
                _, st, ids = live[n]
                rows.append(BatchRow(ids[len(st.ids):len(st.ids) + size], len(st.ids), st.pages))
            srcs = self._run("prefill_chunk", rows)
            for (n, _), row in zip(chunks, rows):
                live[n][1].ids.extend(row.input_ids)
            return srcs

        return feed_in_chunks([len(ids) - len(st.ids) for _, st, ids in live], self.chunk_size,
                              self.buckets.max_rows, self.buckets.token_buckets[-1], extend)

    def _decode(self, rows: list) -> list[tuple]:
        """One decode forward of ``(state, position, src)`` rows (pages reserved): the token
        at ``src`` (``_run``'s) enters at ``position``. Tokens of the forward that most rows'
        ``src`` name are read on the device; the others (first drafts from different extend
        forwards) are fetched to the host first."""
        arrays = [src[0] for _, _, src in rows]
        prev = max(arrays, key=lambda a: sum(b is a for b in arrays))
        batch, prev_idx, host = [], [], {}
        for st, pos, (tokens, row) in rows:
            chained = tokens is prev
            batch.append(BatchRow([0 if chained else read_token(host, (tokens, row))], pos,
                                  st.pages))
            prev_idx.append(row if chained else -1)
        return self._run("decode", batch, prev_idx, prev)
