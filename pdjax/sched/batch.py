"""ScheduledBatch -> flat token stream metadata as numpy (DESIGN.md §2). Never imports JAX.

A row is one request's slice of new tokens this step. Rows are laid out decode rows first:

    rows:        r0(decode) r1(decode) r2(prefill chunk, 5 tokens)      pad...
    input_ids:   [a0,       b0,        c0 c1 c2 c3 c4,                  0 0 0]
    cu_q_lens:   [0, 1, 2, 7, 7, 7 ...]          (padding rows have q_len 0 and kv_len 0)
    slot of the token at position p of a row:  pages[p // page_size] * page_size + p % page_size
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class BatchRow:
    """``input_ids`` new tokens starting at position ``start_pos``; ``pages`` cover every
    position ``< start_pos + len(input_ids)``. ``logits_start``: first row token whose logits
    are wanted (default: only the last)."""

    input_ids: list[int]
    start_pos: int
    pages: list[int]
    logits_start: int | None = None

    @property
    def kv_len(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclasses.dataclass
class FlatBatch:
    """Numpy int32 arrays with DESIGN.md §2 names, padded to ``(T, R, P)``; ``logits_indices``
    is padded to ``N`` (repeats of 0). ``logits_row_spans[r] = (start, stop)`` into it."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    distribution: np.ndarray
    logits_indices: np.ndarray
    logits_row_spans: list[tuple[int, int]]
    num_tokens: int
    num_rows: int


def build_flat_batch(rows: list[BatchRow], *, page_size: int, num_tokens_pad: int,
                     num_rows_pad: int, pages_per_seq_pad: int, num_logits_pad: int | None = None,
                     chunk_size: int | None = None) -> FlatBatch:
    """Lay ``rows`` out as one padded flat batch; raises ``ValueError`` if they do not fit.

    ``distribution = (i, j, k)``: rows ``[0:i]`` have q_len 1 (decode), ``[i:j]`` are full
    chunks of ``chunk_size`` tokens, ``[j:k]`` the rest; callers order rows that way.
    """
    num_tokens = sum(len(r.input_ids) for r in rows)
    if num_tokens > num_tokens_pad:
        raise ValueError(f"{num_tokens} tokens exceed the token bucket {num_tokens_pad}")
    if len(rows) > num_rows_pad:
        raise ValueError(f"{len(rows)} rows exceed the request bucket {num_rows_pad}")
    T, R, P = num_tokens_pad, num_rows_pad, pages_per_seq_pad
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)          # padding writes slot 0 of the null page 0
    cu_q_lens = np.full(R + 1, num_tokens, np.int32)
    kv_lens = np.zeros(R, np.int32)
    page_indices = np.zeros((R, P), np.int32)
    logits, spans = [], []
    t = 0
    for r, row in enumerate(rows):
        n = len(row.input_ids)
        if n == 0:
            raise ValueError(f"row {r} has no tokens")
        need = -(-row.kv_len // page_size)
        if need > len(row.pages):
            raise ValueError(f"row {r}: kv_len {row.kv_len} needs {need} pages, has {len(row.pages)}")
        if need > P:
            raise ValueError(f"row {r}: {need} pages exceed the pages-per-sequence bucket {P}")
        pages = np.asarray(row.pages[:need], np.int32)
        pos = np.arange(row.start_pos, row.kv_len, dtype=np.int32)
        cu_q_lens[r] = t
        input_ids[t:t + n] = row.input_ids
        positions[t:t + n] = pos
        slot_mapping[t:t + n] = pages[pos // page_size] * page_size + pos % page_size
        kv_lens[r] = row.kv_len
        page_indices[r, :need] = pages
        first = n - 1 if row.logits_start is None else row.logits_start
        spans.append((len(logits), len(logits) + n - first))
        logits.extend(range(t + first, t + n))
        t += n
    q_lens = [len(r.input_ids) for r in rows]
    i = 0
    while i < len(rows) and q_lens[i] == 1:
        i += 1
    j = i
    while chunk_size and j < len(rows) and q_lens[j] == chunk_size:
        j += 1
    n_logits = num_logits_pad if num_logits_pad is not None else R
    if len(logits) > n_logits:
        raise ValueError(f"{len(logits)} logits rows exceed the bucket {n_logits}")
    logits_indices = np.zeros(n_logits, np.int32)
    logits_indices[:len(logits)] = logits
    return FlatBatch(input_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_indices,
                     np.asarray([i, j, len(rows)], np.int32), logits_indices, spans,
                     num_tokens, len(rows))
