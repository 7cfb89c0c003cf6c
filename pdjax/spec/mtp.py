"""The MTP drafter (``--speculative-algorithm mtp``, DESIGN.md §3, "Speculative decoding"):
the multi-token prediction layer of a DeepSeek-V3 / V3.2 / GLM-5 checkpoint
(``num_nextn_predict_layers``) chained greedily for ``k`` drafts.

MTP at position ``i`` reads the target's normed last hidden state at ``i`` and the token at
``i + 1``, and predicts the token at ``i + 2`` (DeepSeek-V3 §2.2). The target writes every
token's hidden state into its ``"mtp_hidden"`` cache buffer as it computes it (verify rows
included), so the drafter needs nothing from the engine but the request's page table.

Per request the drafter keeps how many positions its own KV pool holds (``fed``) and the ids
those depend on. For a request whose ``all_ids`` has ``L`` tokens (the target has computed
positions ``< L - 1``; the newest token is at ``L - 1``), ``propose`` rolls back to the
positions still valid (the common prefix with ``all_ids``, by truncation: the counter moves,
whole pages past it go back, no copy), catches up on positions ``fed .. L - 2`` in one batched
extend forward (the target's hidden there and the tokens after them), whose last row gives
draft 1; then ``k - 1`` decode forwards each take the previous forward's token and output
hidden on the device::

    position          ...  L-3   L-2   L-1   L    L+1            (k = 3)
    all_ids           ...  a     b     t     .
    catch-up          (h[L-3], b) (h[L-2], t)        -> d1        (h: the target's hidden)
    chain                               (o1, d1) (o2, d2)  -> d2, d3   (o: MTP outputs)

The chained rows' KV (positions ``L - 1`` ...) is written with MTP outputs, not the target's
hidden states, so it never counts as fed: the next ``propose`` writes those positions again
from the target's. Greedy drafts: a one-hot draft distribution, so the verify step applies the
same lossless rule as for n-gram drafts.

Under DP attention (DESIGN.md §6) the MTP pool is split as the target's: a request's MTP pages
are on the rank of its target pages (a request retracted and assigned another rank starts
over there), and its rows run on that rank, reading the target's hidden states on the rank's
own devices (``MTPRunner``).

In PD the prefill server (started with ``--speculative-algorithm mtp`` too) writes the
prompt's hidden states into the same buffer, which travels with the KV pages; the decode
server's first ``propose`` catches up on the whole prompt from them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.kv.allocator import PageAllocator
from pdjax.runner.mtp_runner import MTPRunner
from pdjax.sched.batch import BatchRow
from pdjax.sched.buckets import Buckets
from pdjax.sched.dp_batch import rank_sizes, row_starts
from pdjax.sched.dp_kv_cache_manager import RankedPageAllocator
from pdjax.spec.drafter import register_drafter
from pdjax.spec.own_pages import (OwnPoolDrafter, cdiv, chain_drafts, common_prefix,
                                  feed_in_chunks, reserve_pages, truncate_pages)


@dataclasses.dataclass
class _MTPState:
    ids: list[int]          # all_ids[:fed + 1]: what the fed positions depend on
    fed: int                # positions 0..fed-1 hold MTP KV made from the target's hidden
    pages: list[int]        # pages of the MTP pool covering the positions written
    rank: int = 0           # DP attention: the rank of the target's pages (and of these)


@register_drafter("mtp")
class MTPDrafter(OwnPoolDrafter):
    """Greedy drafts from the target's own MTP layer.

    ``target``: the target's ``ModelRunner`` (its model built with ``mtp=True``).
    ``num_pages``: the MTP KV pool (page 0 is the null page; pages of the target's
    ``page_size``). ``max_running_requests``, ``context_length``, ``chunked_prefill_size``,
    ``max_num_batched_tokens``: the engine's limits, which size the buckets (as the draft
    model's). ``runner``: the MTP layer's runner when built already (default: an
    ``MTPRunner`` of ``target`` and ``num_pages``; the page book-keeping reads only its
    ``dp_size`` and ``pages_per_rank``, so tests of it pass a stand-in).
    """

    def __init__(self, target, *, num_pages: int, max_running_requests: int,
                 context_length: int, chunked_prefill_size: int,
                 max_num_batched_tokens: int | None = None, runner: MTPRunner | None = None):
        self.page_size = target.page_size
        self.chunk_size = chunked_prefill_size
        self.buckets = Buckets.create(
            chunked_prefill_size=chunked_prefill_size, max_running_requests=max_running_requests,
            max_pages_per_seq=cdiv(context_length, self.page_size),
            max_num_batched_tokens=max_num_batched_tokens)
        self.runner = runner if runner is not None else MTPRunner(
            target, num_pages=num_pages, buckets=self.buckets, chunk_size=chunked_prefill_size)
        # DP attention: the target's ranks and pages per rank (global page ids: rank * Np + p)
        self.dp_size = self.runner.dp_size
        self.pages_per_rank = self.runner.pages_per_rank
        self.allocator = (PageAllocator(num_pages) if self.dp_size == 1 else
                          RankedPageAllocator(self.dp_size, self.pages_per_rank))
        self._state: dict[str, _MTPState] = {}

    # ------------------------------------------------------------------ interface
    def warmup(self) -> None:
        """Compile every bucket of the MTP layer (the engine calls this at its warm-up)."""
        self.runner.warmup()

    def fed_len(self, rid: str) -> int:
        """Positions of ``rid`` whose MTP KV was made from the target's hidden states."""
        st = self._state.get(rid)
        return st.fed if st is not None else 0

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        live = []            # (index, state, all_ids, target pages) of requests drafting now
        for i, (req, k) in enumerate(zip(requests, max_tokens)):
            ids = list(req.all_ids)
            L = len(ids)
            # The target's hidden states of positions < L - 1 must exist.
            if k <= 0 or L < 2 or req.num_computed_tokens < L - 1:
                continue
            st = self._state.setdefault(req.rid, _MTPState([], 0, []))
            rank = req.pages[0] // self.pages_per_rank if self.dp_size > 1 else 0
            if rank != st.rank:         # assigned another rank (retracted): start over there
                self._truncate(st, 0)
                st.rank = rank
            self._truncate(st, min(st.fed, common_prefix(st.ids, ids) - 1, L - 2))
            # Pages up front: positions < L - 1 fed, then the k - 1 chained drafts.
            if self._reserve(st, L - 1 + k - 1):
                live.append((i, st, ids, list(req.pages)))
        def decode(run: list[int], j: int, prev: list) -> list[tuple]:
            return self._decode([(live[n][1], len(live[n][2]) + j - 2, src)
                                 for n, src in zip(run, prev)])

        chains = chain_drafts(self._feed(live), [max_tokens[i] for i, _, _, _ in live], decode)
        drafts: list[list[int]] = [[] for _ in requests]
        for (i, _, _, _), chain in zip(live, chains):
            drafts[i] = chain
        return drafts

    # ------------------------------------------------------------------ pages
    def _truncate(self, st: _MTPState, n: int) -> None:
        """Keep the MTP KV of positions ``< n``; whole pages past it go back."""
        n = max(n, 0)
        st.fed = n
        del st.ids[n + 1:]
        truncate_pages(self.allocator, st.pages, n, self.page_size)


    def _reserve(self, st: _MTPState, num_positions: int) -> bool:
        return reserve_pages(self.allocator, st.pages, num_positions, self.page_size,
                             st.rank if self.dp_size > 1 else None)

    # ------------------------------------------------------------------ forwards
    def _slots(self, target_pages: list[int], start: int, n: int) -> list[int]:
        """Target slots of positions ``start .. start + n - 1`` (DP attention: its rank's own
        page ids, as the target's forward wrote them)."""
        ps, npr = self.page_size, self.pages_per_rank
        local = [p % npr for p in target_pages] if self.dp_size > 1 else target_pages
        return [local[p // ps] * ps + p % ps for p in range(start, start + n)]

    def _run(self, mode: str, rows: list[BatchRow], slots: list[list[int]],
             prev_idx: list[int] | None = None, prev=None) -> list[tuple]:
        """One MTP forward of ``rows`` (decode-length rows first), dispatched without waiting;
        ``slots[i]``: the target slots row ``i``'s tokens read; ``prev_idx[i]``: the row of
        ``prev`` a decode row's token and hidden come from. Per row ``(tokens, hidden,
        row)``: where its draft and output hidden lie."""
        num_tokens, num_rows = sum(len(r.input_ids) for r in rows), len(rows)
        if self.dp_size > 1:        # one bucket for every rank, sized by the busiest
            num_tokens, num_rows = rank_sizes(rows, self.pages_per_rank)
        key = self.buckets.pick(mode, num_tokens, num_rows,
                                max(cdiv(r.kv_len, self.page_size) for r in rows))
        fb = self.runner.make_batch(key, rows)
        starts = row_starts(fb)             # DP attention: in the row's rank's segment
        hidden_slots = np.zeros(self.runner.stream_len(key), np.int32)
        for i, row_slots in enumerate(slots):
            hidden_slots[int(starts[i]):int(starts[i]) + len(row_slots)] = row_slots
        idx = None
        if prev_idx is not None:
            idx = np.full(len(hidden_slots), -1, np.int32)
            for i, p in enumerate(prev_idx):      # decode rows: one token each
                idx[int(starts[i])] = p
        tokens, hidden = self.runner.forward(key, fb, hidden_slots, idx, prev)
        return [(tokens, hidden, start) for start, _ in fb.logits_row_spans]

    def _feed(self, live: list) -> list[tuple]:
        """Catch each ``(index, state, all_ids, target pages)`` up to position
        ``len(all_ids) - 2`` (pages reserved), one chunk per request per extend forward;
        where each one's first draft lies (``_run``)."""
        def extend(chunks: list[tuple[int, int]]) -> list[tuple]:
            rows, slots = [], []
            for n, size in chunks:
                _, st, ids, target_pages = live[n]
                # Position p carries the token at p + 1.
                rows.append(BatchRow(ids[st.fed + 1:st.fed + 1 + size], st.fed, st.pages))
                slots.append(self._slots(target_pages, st.fed, size))
            srcs = self._run("prefill_chunk", rows, slots)
            for n, size in chunks:
                _, st, ids, _ = live[n]
                st.fed += size
                st.ids = ids[:st.fed + 1]
            return srcs

        return feed_in_chunks([len(ids) - 1 - st.fed for _, st, ids, _ in live], self.chunk_size,
                              self.buckets.max_rows, self.buckets.token_buckets[-1], extend)

    def _decode(self, rows: list) -> list[tuple]:
        """Decode forwards of ``(state, position, src)`` rows: the token and hidden at ``src``
        (``_run``'s) enter at ``position``. Rows chained to the same forward run together
        (one forward per source, usually one)."""
        out: list = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for n, (_, _, src) in enumerate(rows):
            groups.setdefault(id(src[0]), []).append(n)
        for members in groups.values():
            tokens, hidden, _ = rows[members[0]][2]
            batch = [BatchRow([0], rows[n][1], rows[n][0].pages) for n in members]
            srcs = self._run("decode", batch, [[0]] * len(batch),
                             [rows[n][2][2] for n in members], (tokens, hidden))
            for n, src in zip(members, srcs):
                out[n] = src
        return out
