"""Prompt logprobs (``logprob_start_len``): which positions of a scheduled batch want one,
their dispatch on the device, and writing them into the requests once read (DESIGN.md §3).

Position ``p`` of a prompt gets the logprob of ``prompt_ids[p]`` under the logits at
``p - 1``; a chunk's last position predicts the next chunk's first token, and position 0 has
no logprob (its entry is None):

    chunk 1: positions [s, s+n)  -> logprobs of p in (s, s+n] (p = s+n from the last row)
    chunk 2: positions [s+n, ...) -> its first p was done by chunk 1
"""

from __future__ import annotations

import numpy as np

from pdjax.sched.dp_batch import row_starts
from pdjax.sched.scheduler import ScheduledBatch, ScheduledRow


def wants_prompt_logprobs(row: ScheduledRow) -> bool:
    """Whether ``row`` computes a prompt logprob its request asked for."""
    req = row.req
    # ">=": a chunk's last position predicts the next chunk's first token, which is the
    # first one wanted when logprob_start_len sits on the chunk boundary.
    return (req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids
            and row.start + row.num_tokens >= req.logprob_start_len)


def dispatch_prompt_logprobs(runner, batch: ScheduledBatch, fb, hidden):
    """Dispatch the logprobs of prompt tokens p >= logprob_start_len (from the logits at
    p - 1) on the device (``runner.prompt_logprobs_at`` over the forward's ``hidden``);
    returns ``(wanted, device arrays or None)`` for ``apply_prompt_logprobs``. ``wanted``:
    (req, position p or None for position 0's empty entry)."""
    starts = row_starts(fb)         # DP attention: rows start in their rank's segment
    wanted, rows = [], []     # rows: flat row of position p - 1
    for i, row in enumerate(batch.rows):
        if not wants_prompt_logprobs(row):
            continue
        req, s, n = row.req, row.start, row.num_tokens
        lo = max(req.logprob_start_len, s)
        for p in range(lo, min(s + n, req.num_prompt_tokens)):
            if p == 0:
                wanted.append((req, None))
            elif p - 1 >= s:
                wanted.append((req, p))
                rows.append(int(starts[i]) + p - 1 - s)
            else:
                # p - 1 lies in the previous chunk: its logits were taken then.
                pass
        # The next chunk's first token is predicted by this chunk's last position.
        p = s + n
        if p < req.num_prompt_tokens and p >= req.logprob_start_len:
            wanted.append((req, p))
            rows.append(int(starts[i]) + n - 1)
    if not rows:
        return wanted, None
    targets = [req.prompt_ids[p] for req, p in wanted if p is not None]
    want_top = any(req.top_logprobs_num > 0 for req, _ in wanted)
    return wanted, runner.prompt_logprobs_at(hidden, rows, targets, want_top)


def apply_prompt_logprobs(wanted, arrays) -> None:
    """Append the read logprobs (``arrays``: logprob ``[n]``, top ids and values ``[n, k]``)
    to the requests of ``wanted``, in order."""
    if arrays is not None:
        lp, ids, vals = (np.asarray(a) for a in arrays)
    j = 0
    for req, p in wanted:
        if p is None:
            req.append_prompt_logprobs(None, None)
            continue
        k = min(req.top_logprobs_num, ids.shape[1])
        req.append_prompt_logprobs(
            float(lp[j]), [(int(a), float(b)) for a, b in zip(ids[j, :k], vals[j, :k])])
        j += 1
