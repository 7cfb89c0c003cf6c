"""One step's rows per DP attention rank -> the DP flat batch, as numpy (DESIGN.md §2, §6).
Never imports JAX.

Every rank's rows are laid out by ``batch.build_flat_batch`` with the same padding (one
bucket for the whole group: the SPMD step runs one shape), then stacked; the token stream is
the ranks' segments end to end, the metadata keeps a leading ``[dp]`` axis::

    rank:          0                      1 (idle)              2
    input_ids:     [a0 b0 c0 c1 0 0 0 0 | 0 0 0 0 0 0 0 0 | d0 d1 d2 0 0 0 0 0]   [dp * T]
    positions:     [[..T..], [..T..], [..T..]]                                       [dp, T]
    page_indices:  rank r's own page ids (0 .. Np - 1; 0 its null page)          [dp, R, P]
    logits_indices: rank r's entries + r * T (the global token index)              [dp * N]

An idle rank's segment is padding only: its tokens write slot 0 of its null page, its rows
have kv_len 0 (``build_flat_batch`` of no rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.sched.batch import BatchRow, FlatBatch, build_flat_batch


@dataclasses.dataclass
class DpFlatBatch:
    """``FlatBatch``'s arrays for ``dp`` ranks (all int32): ``input_ids [dp * T]``,
    ``positions`` / ``slot_mapping [dp, T]``, ``cu_q_lens [dp, R + 1]``, ``kv_lens [dp, R]``,
    ``page_indices [dp, R, P]``, ``distribution [dp, 3]``, ``logits_indices [dp * N]``
    (global token indices). ``ranks``: each rank's own ``FlatBatch``. ``logits_row_spans
    [rank][row] = (start, stop)`` into ``logits_indices``."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    distribution: np.ndarray
    logits_indices: np.ndarray
    logits_row_spans: list[list[tuple[int, int]]]
    ranks: list[FlatBatch]

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_tokens(self) -> list[int]:
        """Real tokens of each rank."""
        return [b.num_tokens for b in self.ranks]


def build_dp_batch(rows_per_rank: list[list[BatchRow]], *, page_size: int,
                   num_tokens_pad: int, num_rows_pad: int, pages_per_seq_pad: int,
                   num_logits_pad: int | None = None,
                   chunk_size: int | None = None) -> DpFlatBatch:
    """Lay out ``rows_per_rank[r]`` (rank ``r``'s rows, page ids its own; ``[]``: an idle
    rank) as one DP flat batch, every rank padded to ``(num_tokens_pad, num_rows_pad,
    pages_per_seq_pad)`` and ``num_logits_pad`` logits rows (default ``num_rows_pad``).
    ``ValueError`` naming the rank when its rows do not fit the padding (``build_flat_batch``'s
    checks) or when there is no rank."""
    if not rows_per_rank:
        raise ValueError("rows_per_rank: a DP batch needs at least one rank")
    ranks = []
    for r, rows in enumerate(rows_per_rank):
        try:
            ranks.append(build_flat_batch(rows, page_size=page_size,
                                          num_tokens_pad=num_tokens_pad,
                                          num_rows_pad=num_rows_pad,
                                          pages_per_seq_pad=pages_per_seq_pad,
                                          num_logits_pad=num_logits_pad,
                                          chunk_size=chunk_size))
        except ValueError as e:
            raise ValueError(f"rank {r}: {e}") from None
    T = num_tokens_pad
    N = len(ranks[0].logits_indices)
    logits = np.concatenate([b.logits_indices + r * T for r, b in enumerate(ranks)])
    spans = [[(s + r * N, e + r * N) for s, e in b.logits_row_spans]
             for r, b in enumerate(ranks)]
    return DpFlatBatch(
        input_ids=np.concatenate([b.input_ids for b in ranks]),
        positions=np.stack([b.positions for b in ranks]),
        slot_mapping=np.stack([b.slot_mapping for b in ranks]),
        cu_q_lens=np.stack([b.cu_q_lens for b in ranks]),
        kv_lens=np.stack([b.kv_lens for b in ranks]),
        page_indices=np.stack([b.page_indices for b in ranks]),
        distribution=np.stack([b.distribution for b in ranks]),
        logits_indices=logits.astype(np.int32), logits_row_spans=spans, ranks=ranks)
