"""One step's rows per DP attention rank -> the DP flat batch, as numpy (DESIGN.md §2, §6).
Never imports JAX.

Every rank's rows are laid out by ``batch.build_flat_batch`` with the same padding (one
bucket for the whole group: the SPMD step runs one shape), then stacked; the token stream is
the ranks' segments end to end, the metadata keeps a leading ``[dp]`` axis::

    rank:          0                      1 (idle)              2
    input_ids:     [a0 b0 c0 c1 0 0 0 0 | 0 0 0 0 0 0 0 0 | d0 d1 d2 0 0 0 0 0]   [dp * T]
    positions:     [[..T..], [..T..], [..T..]]                                       [dp, T]
    page_indices:  rank r's own page ids (0 .. Np - 1; 0 its null page)          [dp, R, P]
    logits_indices: the rows' logits rows in the order the rows came (global token
                    indices), so logits row i is the caller's row i, as in FlatBatch     [N]

An idle rank's segment is padding only: its tokens write slot 0 of its null page, its rows
have kv_len 0 (``build_flat_batch`` of no rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.sched.batch import BatchRow, FlatBatch, build_flat_batch


@dataclasses.dataclass
class DpFlatBatch(FlatBatch):
    """``FlatBatch``'s arrays for ``dp`` ranks (all int32): ``input_ids [dp * T]``,
    ``positions`` / ``slot_mapping [dp, T]``, ``cu_q_lens [dp, R + 1]``, ``kv_lens [dp, R]``,
    ``page_indices [dp, R, P]``, ``distribution [dp, 3]``, ``logits_indices [N]`` (global
    token indices, the rows' logits in the order the rows were given, then padding 0s).
    Per given row ``i``: ``logits_row_spans[i] = (start, stop)`` into ``logits_indices``,
    ``row_starts[i]`` the global index of its first token. ``ranks``: each rank's own
    ``FlatBatch``; ``num_tokens``: real tokens in all."""

    row_starts: list[int]
    ranks: list[FlatBatch]

    @property
    def dp_size(self) -> int:
        return len(self.ranks)


def local_rows(rows: list[BatchRow], pages_per_rank: int) -> tuple[list[BatchRow], list[int]]:
    """Rows whose pages are global ids (``sched/dp_kv_cache_manager.py``: page ``g`` is page
    ``g % pages_per_rank`` of rank ``g // pages_per_rank``) -> the same rows with their
    rank's page ids, and each row's rank. ``ValueError`` for a row without pages or with
    pages on two ranks."""
    out, ranks = [], []
    for i, row in enumerate(rows):
        if not row.pages:
            raise ValueError(f"row {i} has no pages: its rank is unknown")
        rank = row.pages[0] // pages_per_rank
        local = [p - rank * pages_per_rank for p in row.pages]
        if not all(0 < p < pages_per_rank for p in local):
            raise ValueError(f"row {i}: pages {row.pages} are not all on rank {rank}")
        out.append(dataclasses.replace(row, pages=local))
        ranks.append(rank)
    return out, ranks


def build_dp_batch(rows: list[BatchRow], row_ranks: list[int], *, dp_size: int,
                   page_size: int, num_tokens_pad: int, num_rows_pad: int,
                   pages_per_seq_pad: int, num_logits_pad: int | None = None,
                   chunk_size: int | None = None) -> DpFlatBatch:
    """Lay out ``rows`` (page ids their rank's), row ``i`` on rank ``row_ranks[i]``, as one
    DP flat batch: every rank's rows in their given order (decode rows first, as
    ``build_flat_batch`` wants), padded to ``(num_tokens_pad, num_rows_pad,
    pages_per_seq_pad)``; a rank without rows is all padding. ``num_logits_pad``: logits rows
    in all (default ``dp_size * num_rows_pad``). ``ValueError`` naming the rank when its rows
    do not fit the padding (``build_flat_batch``'s checks), for a rank outside ``[0,
    dp_size)`` or more logits rows than ``num_logits_pad``."""
    if len(row_ranks) != len(rows):
        raise ValueError(f"row_ranks: {len(row_ranks)} ranks for {len(rows)} rows")
    per_rank: list[list[BatchRow]] = [[] for _ in range(dp_size)]
    where = []
    for i, (row, rank) in enumerate(zip(rows, row_ranks)):
        if not 0 <= rank < dp_size:
            raise ValueError(f"row_ranks: row {i} on rank {rank}, outside [0, {dp_size})")
        where.append((rank, len(per_rank[rank])))
        per_rank[rank].append(row)
    T = num_tokens_pad
    N = dp_size * num_rows_pad if num_logits_pad is None else num_logits_pad
    ranks = []
    for r, rank_rows in enumerate(per_rank):
        try:
            ranks.append(build_flat_batch(rank_rows, page_size=page_size, num_tokens_pad=T,
                                          num_rows_pad=num_rows_pad,
                                          pages_per_seq_pad=pages_per_seq_pad,
                                          num_logits_pad=max(N, num_rows_pad),
                                          chunk_size=chunk_size))
        except ValueError as e:
            raise ValueError(f"rank {r}: {e}") from None
    logits, spans, starts = [], [], []
    for rank, j in where:
        b = ranks[rank]
        s, e = b.logits_row_spans[j]
        spans.append((len(logits), len(logits) + e - s))
        logits.extend(int(t) + rank * T for t in b.logits_indices[s:e])
        starts.append(rank * T + int(b.cu_q_lens[j]))
    if len(logits) > N:
        raise ValueError(f"{len(logits)} logits rows exceed the bucket {N}")
    logits_indices = np.zeros(N, np.int32)
    logits_indices[:len(logits)] = logits
    return DpFlatBatch(
        input_ids=np.concatenate([b.input_ids for b in ranks]),
        positions=np.stack([b.positions for b in ranks]),
        slot_mapping=np.stack([b.slot_mapping for b in ranks]),
        cu_q_lens=np.stack([b.cu_q_lens for b in ranks]),
        kv_lens=np.stack([b.kv_lens for b in ranks]),
        page_indices=np.stack([b.page_indices for b in ranks]),
        distribution=np.stack([b.distribution for b in ranks]),
        logits_indices=logits_indices, logits_row_spans=spans, row_starts=starts,
        ranks=ranks, num_tokens=sum(b.num_tokens for b in ranks), num_rows=len(rows))


def rank_sizes(rows: list[BatchRow], pages_per_rank: int) -> tuple[int, int]:
    """``(tokens, rows)`` of the busiest rank for ``rows`` (global page ids): what one bucket
    must hold when every rank is padded alike."""
    tokens: dict[int, int] = {}
    count: dict[int, int] = {}
    for row in rows:
        rank = row.pages[0] // pages_per_rank
        tokens[rank] = tokens.get(rank, 0) + len(row.input_ids)
        count[rank] = count.get(rank, 0) + 1
    return max(tokens.values(), default=0), max(count.values(), default=0)


def row_starts(fb) -> list[int] | np.ndarray:
    """Index in the token stream of each row's first token: ``cu_q_lens`` of a
    ``FlatBatch``, ``row_starts`` of a ``DpFlatBatch`` (its rank's segment)."""
    return fb.row_starts if isinstance(fb, DpFlatBatch) else fb.cu_q_lens
