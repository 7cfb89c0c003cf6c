"""A separate small model as the drafter (``--speculative-algorithm draft``, with
``--speculative-draft-model-path``; DESIGN.md §3, "Speculative decoding").

The draft model has its own ``ModelRunner`` (its own paged KV pool, buckets and warm-up; the
target's vocabulary) and drafts greedily, so its drafts are deterministic and the target's
verify step applies the same lossless rule as for n-gram drafts (a one-hot draft
distribution). Per request it keeps the pages and the count of tokens whose KV it holds::

    target ids     p0 .. pL-2  t        (t: the newest token, position L-1)
    catch-up       extend rows of the ids it has no KV of, up to L-2
    draft step j   decode row: input t (j = 0) or d_j (read on the device from step j-1's
                   sampled ids, no host round trip), position L-1+j, samples d_{j+1}
    after verify   a drafts accepted: KV kept up to position L-1+min(a, k-1) (the drafts it
                   fed as inputs and the target accepted); the rest is overwritten later

Its rollback is the target's: counters only, no copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.kv.allocator import PageAllocator
from pdjax.spec.drafter import Drafter, register_drafter


@dataclasses.dataclass
class _Seq:
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0                 # tokens of the request's ids with KV in ``pages``
    pending: tuple[int, int] | None = None   # (newest position, drafts) of the last proposal


@register_drafter("draft")
class DraftModelDrafter(Drafter):
    """Greedy drafts from the checkpoint at ``model_path`` (any supported architecture with
    the target's vocabulary). ``num_pages`` / ``page_size``: its KV pool; ``max_running_requests``,
    ``chunked_prefill_size``, ``context_length``: its buckets (as the target's); ``dtype``,
    ``attention_impl``: as the target's. Warm-up compiles its buckets in the constructor.
    ``ValueError`` when its vocabulary differs from ``vocab_size``."""

    def __init__(self, model_path: str, *, vocab_size: int, num_pages: int, page_size: int,
                 max_running_requests: int, chunked_prefill_size: int, context_length: int,
                 dtype="float32", attention_impl: str | None = None):
        from pdjax.models.loader import load_model, make_mesh
        from pdjax.runner.model_runner import ModelRunner
        from pdjax.sched.buckets import Buckets

        mesh = make_mesh(1)
        cfg, model = load_model(model_path, dtype=dtype, mesh=mesh, progress=False,
                                attention_impl=attention_impl)
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative_draft_model_path: the draft model's vocabulary "
                             f"({cfg.vocab_size}) differs from the target's ({vocab_size})")
        self.page_size = page_size
        self.chunk_size = chunked_prefill_size
        self.context_length = context_length
        self.buckets = Buckets.create(
            chunked_prefill_size=chunked_prefill_size, max_running_requests=max_running_requests,
            max_pages_per_seq=-(-context_length // page_size),
            traced_pages_bound=(attention_impl or "xla") in getattr(
                model, "TRACED_PAGES_BOUND_IMPLS", ()))
        self.runner = ModelRunner(model, mesh, num_pages=num_pages, page_size=page_size,
                                  kv_dtype=dtype, buckets=self.buckets,
                                  chunk_size=chunked_prefill_size)
        self.runner.warmup(progress=False)
        self.allocator = PageAllocator(num_pages)
        self._seqs: dict[str, _Seq] = {}

    # ------------------------------------------------------------------ pages
    def _grow(self, seq: _Seq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _trim(self, seq: _Seq, num_tokens: int) -> None:
        keep = -(-num_tokens // self.page_size)
        if seq.pages[keep:]:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    # ------------------------------------------------------------------ forwards
    def _catch_up(self, work: list[tuple[_Seq, list[int]]]) -> None:
        """Extend forwards computing the KV of each ``(seq, ids)``'s tokens it lacks (all but
        the newest), as many rows and tokens per forward as the largest bucket holds."""
        from pdjax.sched.batch import BatchRow

        budget, chunk = self.buckets.token_buckets[-1], self.chunk_size
        while True:
            need = [(seq, ids) for seq, ids in work if seq.computed < len(ids) - 1]
            if not need:
                return
            rows, used = [], 0
            for seq, ids in need[:self.buckets.max_rows]:
                n = min(len(ids) - 1 - seq.computed, chunk, budget - used)
                if n <= 0:
                    break
                rows.append((seq, BatchRow(ids[seq.computed:seq.computed + n], seq.computed,
                                           seq.pages)))
                used += n
            pages = max(-(-r.kv_len // self.page_size) for _, r in rows)
            key = self.buckets.pick("prefill_chunk", used, len(rows), pages)
            self.runner.forward(key, self.runner.make_batch(key, [r for _, r in rows]))
            for seq, row in rows:
                seq.computed = row.kv_len

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        from pdjax.sched.batch import BatchRow

        live = []                              # (index, seq, ids, k)
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            ids = req.all_ids
            seq = self._seqs.setdefault(req.rid, _Seq())
            if seq.computed > len(ids) - 1:    # the request was cut back (retraction)
                seq.computed = 0
            k = min(k, self.context_length - len(ids))
            if k <= 0 or not self._grow(seq, len(ids) - 1 + k):
                continue
            live.append((i, seq, ids, k))
        drafts: list[list[int]] = [[] for _ in requests]
        if not live:
            return drafts
        self._catch_up([(seq, ids) for _, seq, ids, _ in live])
        steps = []                             # (sampled ids on the device, row of each live)
        prev, prev_row = None, {}
        for j in range(max(k for *_, k in live)):
            active = [(i, seq, ids) for i, seq, ids, k in live if k > j]
            rows = [BatchRow([ids[-1] if j == 0 else 0], len(ids) - 1 + j, seq.pages)
                    for _, seq, ids in active]
            pages = max(-(-r.kv_len // self.page_size) for r in rows)
            key = self.buckets.pick("decode", len(rows), len(rows), pages)
            fb = self.runner.make_batch(key, rows)
            prev_idx = np.full(key.num_tokens, -1, np.int32)
            if j:
                for r, (i, _, _) in enumerate(active):
                    prev_idx[int(fb.cu_q_lens[r])] = prev_row[i]
            out, _ = self.runner.forward(key, fb, prev_idx=prev_idx, prev_tokens=prev)
            prev, prev_row = out.tokens, {i: r for r, (i, _, _) in enumerate(active)}
            steps.append((out.tokens, dict(prev_row)))
        for tokens, row_of in steps:
            host = np.asarray(tokens)
            for i, r in row_of.items():
                drafts[i].append(int(host[r]))
        for i, seq, ids, k in live:
            seq.pending = (len(ids) - 1, k)
        return drafts

    def on_verified(self, rid: str, num_accepted: int) -> None:
        seq = self._seqs.get(rid)
        if seq is None or seq.pending is None:
            return
        newest, k = seq.pending
        # The newest token's KV and the drafts it fed (d_1..d_{k-1}) that were accepted.
        seq.computed = newest + 1 + min(num_accepted, k - 1)
        seq.pending = None
        self._trim(seq, seq.computed + 1)

    def release(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None and seq.pages:
            self.allocator.free(seq.pages)
