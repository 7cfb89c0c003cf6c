"""Verifying drafts inside the jitted step (DESIGN.md §3, "Speculative decoding").

A verify row of a request carries its newest token and ``k`` drafts, so it has ``k + 1``
logits rows, a *span*, each sampled with the request's own parameters at its own output
position. ``draft_next[l]`` is the draft the sample of logits row ``l`` must equal for row
``l + 1`` to count (-1 on the last row of a span, and on every row that verifies nothing)::

    row tokens      t   d1  d2  d3          (t: newest known token, d: drafts)
    logits rows     0   1   2   3
    draft_next      d1  d2  d3  -1
    sampled         d1  d2  x   .           x != d3: rows 0..2 emitted, row 3 not
    emitted tokens  d1 d2 x                 (2 drafts accepted + the target's own token)

Greedy rows: the longest prefix of drafts equal to the argmax, plus the argmax after it.
Sampled rows, with a deterministic drafter (one-hot draft distribution q): accepting draft d
with probability min(1, p(d) / q(d)) = p(d) and otherwise drawing from norm(max(0, p - q)),
p with d removed (Leviathan et al. 2023, §2.3; Chen et al. 2023, Algorithm 2), is the same as
drawing x ~ p and accepting iff x == d, the rejected case leaving x distributed as that
residual. So each row draws from p with its seed at its own position, and the emitted prefix
is exactly what the lossless rule emits; a seeded request even draws the same tokens as
without speculation. Penalties see the drafts before a row as output tokens (``draft_counts``),
as the step without speculation would have seen those tokens once accepted.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def span_starts(draft_next):
    """``[R]`` bool: logits row ``l`` starts a span (the row before it verifies nothing)."""
    cont = draft_next >= 0
    return jnp.concatenate([jnp.ones((1,), bool), ~cont[:-1]])


def verify_emitted(tokens, draft_next):
    """``emitted [R]`` bool for sampled ``tokens [R]`` i32 and ``draft_next [R]`` i32: no row
    of the same span before ``l`` sampled something other than its draft."""
    bad = ((draft_next >= 0) & (tokens != draft_next)).astype(jnp.int32)
    before = jnp.cumsum(bad) - bad                   # rejections strictly before row l
    at_start = lax.cummax(jnp.where(span_starts(draft_next), before, 0))
    return before == at_start


def draft_counts(counts, draft_next):
    """``counts [R, V]`` i32 plus, for each row, the drafts of the rows before it in its span
    (the output tokens it would follow once they are accepted)."""
    R = draft_next.shape[0]
    span = jnp.cumsum(span_starts(draft_next).astype(jnp.int32))
    iota = jnp.arange(R)
    before = ((span[:, None] == span[None, :]) & (iota[None, :] < iota[:, None])
              & (draft_next >= 0)[None, :])
    rows = jnp.broadcast_to(iota[:, None], (R, R))
    ids = jnp.broadcast_to(jnp.maximum(draft_next, 0)[None, :], (R, R))
    return counts.at[rows, ids].add(before.astype(counts.dtype))
