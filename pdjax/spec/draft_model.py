"""The draft-model drafter (``--speculative-algorithm draft``, DESIGN.md §3, "Speculative
decoding"): a small model with its own paged KV proposes ``k`` tokens greedily.

Greedy drafting is deterministic, so the draft distribution is a one-hot and the verify step
applies the same lossless rule as for n-gram drafts (no draft probabilities).

Per request the drafter keeps the token ids whose KV its pool holds (``ids``) and their pages.
``propose`` first rolls each request back to the common prefix of ``ids`` and ``all_ids``
(a truncation: the counter moves, whole pages past it go back, no slot is copied), feeds the
missing tokens in one batched extend forward (more when a prompt is longer than a chunk), then
runs ``k - 1`` batched decode forwards, taking the argmax each time::

    all_ids        a b c d e X                 the target kept d e (2 of 3 drafts), then X
    ids (before)   a b c d e f                 KV of the previous step's drafts d e f
    common prefix  a b c d e | f dropped       kv counter -> 5; f's slot is overwritten later
    extend         X                           -> d1       (logits of the last fed token)
    decode         d1 -> d2, d2 -> d3 ...       ids = a b c d e X d1 d2 ...

The last token of ``all_ids`` is always fed (when ``ids`` already hold it, it is fed again:
the same KV is written to the same slot), since its logits give the first draft.

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
from pdjax.runner.model_runner import ModelRunner
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import Buckets
from pdjax.spec.drafter import Drafter, register_drafter


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class _DraftState:
    ids: list[int]          # tokens whose KV the draft pool holds, positions 0..len-1
    pages: list[int]        # pages covering those positions (ceil(len / page_size) of them)


@register_drafter("draft")
class DraftModelDrafter(Drafter):
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
            max_pages_per_seq=_cdiv(context_length, page_size),
            max_num_batched_tokens=max_num_batched_tokens,
            traced_pages_bound=attention_impl in getattr(model, "TRACED_PAGES_BOUND_IMPLS", ()))
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
        drafts: list[list[int]] = [[] for _ in requests]
        live = []               # (index, state, all_ids) of requests still drafting
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            if k <= 0 or not req.all_ids:
                continue
            ids = list(req.all_ids)
            st = self._state.setdefault(req.rid, _DraftState([], []))
            self._truncate(st, min(_common_prefix(st.ids, ids), len(ids) - 1))
            # Every page this step needs, up front: the ids and the k - 1 drafts fed back.
            # A request the pool cannot hold drafts nothing (the others still do).
            if self._reserve(st, len(ids) + k - 1):
                live.append((i, st, ids))
        firsts = self._feed(live)
        steps = []              # (index, state) that got a first draft
        for (i, st, _), tok in zip(live, firsts):
            if tok is not None:
                drafts[i].append(tok)
                steps.append((i, st))
        for j in range(1, max(max_tokens, default=0)):
            rows = [(i, st) for i, st in steps if len(drafts[i]) == j and max_tokens[i] > j]
            if not rows:
                break
            toks = self._decode([(st, drafts[i][-1]) for i, st in rows])
            for (i, _), tok in zip(rows, toks):
                if tok is not None:
                    drafts[i].append(tok)
        return drafts

    def release(self, rid: str) -> None:
        st = self._state.pop(rid, None)
        if st is not None:
            self.allocator.free(st.pages)

    # ------------------------------------------------------------------ pages
    def _truncate(self, st: _DraftState, n: int) -> None:
        """Keep the KV of ``st.ids[:n]``: the counter moves, whole pages past it go back."""
        del st.ids[n:]
        keep = _cdiv(n, self.page_size)
        self.allocator.free(st.pages[keep:])
        del st.pages[keep:]

    def _reserve(self, st: _DraftState, num_tokens: int) -> bool:
        """Pages for positions ``< num_tokens``; False (nothing taken) if the pool is short."""
        need = _cdiv(num_tokens, self.page_size) - len(st.pages)
        if need <= 0:
            return True
        got = self.allocator.alloc(need)
        if got is None:
            return False
        st.pages.extend(got)
        return True

    # ------------------------------------------------------------------ forwards
    def _run(self, mode: str, rows: list[BatchRow]) -> np.ndarray:
        """One greedy forward of ``rows`` (ordered as ``build_flat_batch`` wants); the argmax
        token after each row's last token, ``[len(rows)]``."""
        key = self.buckets.pick(mode, sum(len(r.input_ids) for r in rows), len(rows),
                                max(_cdiv(r.kv_len, self.page_size) for r in rows))
        fb = self.runner.make_batch(key, rows)
        out, _ = self.runner.forward(key, fb)
        tokens = np.asarray(out.tokens)
        return tokens[[start for start, _ in fb.logits_row_spans]]

    def _feed(self, live: list) -> list[int | None]:
        """Feed each ``(index, state, all_ids)`` its tokens past ``state.ids``, one chunk per
        request per extend forward (a request's chunks run in order, in successive forwards);
        the first draft of each, or None where the pool ran out of pages (no drafts)."""
        first: list[int | None] = [None] * len(live)
        pending = list(range(len(live)))        # requests with tokens left to feed
        max_tokens = self.buckets.token_buckets[-1]
        while pending:
            batch, later, budget = [], [], max_tokens
            for n in pending:
                _, st, ids = live[n]
                size = min(len(ids) - len(st.ids), self.chunk_size, budget)
                if size <= 0 or len(batch) == self.buckets.max_rows:
                    later.append(n)
                elif self._reserve(st, len(st.ids) + size):
                    batch.append((n, BatchRow(ids[len(st.ids):len(st.ids) + size],
                                              len(st.ids), st.pages)))
                    budget -= size
                # else: out of pages, this request drafts nothing this step
            if not batch:
                break
            # decode-length rows first, then full chunks, then the rest (build_flat_batch)
            batch.sort(key=lambda e: (len(e[1].input_ids) != 1,
                                      len(e[1].input_ids) != self.chunk_size))
            toks = self._run("prefill_chunk", [row for _, row in batch])
            for (n, row), tok in zip(batch, toks):
                _, st, ids = live[n]
                st.ids.extend(row.input_ids)
                if len(st.ids) == len(ids):
                    first[n] = int(tok)
                else:
                    later.append(n)
            pending = sorted(later)
        return first

    def _decode(self, rows: list) -> list[int | None]:
        """One decode forward of ``(state, token)`` rows: ``token`` enters at position
        ``len(state.ids)``; the next token of each, or None where no page was free."""
        out: list[int | None] = [None] * len(rows)
        run = [n for n, (st, _) in enumerate(rows) if self._reserve(st, len(st.ids) + 1)]
        if not run:
            return out
        toks = self._run("decode", [BatchRow([rows[n][1]], len(rows[n][0].ids), rows[n][0].pages)
                                    for n in run])
        for n, tok in zip(run, toks):
            st, token = rows[n]
            st.ids.append(token)
            out[n] = int(tok)
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
