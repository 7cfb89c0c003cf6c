"""Stall-free mixed steps (Sarathi-Serve, OSDI 2024, §4.3): how much of a prefill chunk fits
next to the decode rows inside ``target_itl_ms`` (policy 4 of ``pdjax.sched.scheduler``,
DESIGN.md §3). Pure Python over a ``StepCostModel``'s predictions (``token_buckets``,
``predict``, ``margin``)."""

from __future__ import annotations

from pdjax.request import Request
from pdjax.sched.scheduled_batch import ScheduledRow, chunk_pairs


def fit_target(cost_model, config, rows: list[ScheduledRow], req: Request, n_max: int,
               first: bool) -> int:
    """Tokens of ``req`` (at most ``n_max``) that keep the step inside ``target_itl_ms``
    next to ``rows``: the most whose prediction times the cost model's ``margin`` (an upper
    quantile of its recent errors) fits. The step stays in a compiled token bucket (the
    largest bucket whose smallest fill fits, then a bisection inside it: a prediction grows
    with the tokens); the chunk may end anywhere inside its bucket, since the cost model
    prices the real tokens and each bucket's fixed cost, padding included (the CPU matmul
    skips padding rows, XLA's dots do not). None fits: 0 for a later prefill row; the first
    one still advances (no starvation) by the least there is, one token (one page for
    page-aligned chunks, PD prefill), or by the rest of that token's bucket where the
    prediction says the padding would cost as much as the tokens (within 1%). Nothing timed
    yet: ``n_max``.

        decode rows  | chunk of req ........|  pad
        <- tokens0 ->|<- n --------------->|        (one compiled token bucket)
    """
    ps = config.page_size
    start = req.num_computed_tokens
    tokens0 = sum(r.num_tokens for r in rows)
    cached0 = sum(r.start for r in rows) + start
    pairs0 = sum(chunk_pairs(r.num_tokens, r.start) for r in rows)
    pages0 = max(-(-(r.start + r.num_tokens) // ps) for r in rows)
    target_s = config.target_itl_ms / 1000.0 / cost_model.margin("mixed")

    def predict(n: int) -> float | None:
        pages = max(pages0, -(-(start + n) // ps))
        return cost_model.predict("mixed", tokens0 + n, len(rows) + 1, pages, cached0,
                                  pairs0 + chunk_pairs(n, start))

    def fits(n: int) -> bool:
        t = predict(n)
        return t is not None and t <= target_s

    buckets = cost_model.token_buckets
    for i in reversed(range(len(buckets))):
        lo = max(1, (buckets[i - 1] if i else 0) - tokens0 + 1)
        hi = min(n_max, buckets[i] - tokens0)
        if hi < lo:
            continue
        t = predict(hi)
        if t is None:
            return n_max
        if t <= target_s:
            return hi
        if not fits(lo):
            continue
        while hi - lo > 1:            # lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo
    if not first:
        return 0
    least = min(n_max, ps) if config.page_aligned_chunks else 1
    fill = min(n_max, next((b for b in buckets if b >= tokens0 + least), tokens0 + least)
               - tokens0)
    t_least, t_fill = predict(least), predict(fill)
    if t_least is not None and t_fill is not None and t_fill <= 1.01 * t_least:
        return fill
    return least
