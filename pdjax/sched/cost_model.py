"""Step cost model: predicts one forward's time from the forwards already timed (DESIGN.md §3).

Sarathi-Serve (OSDI 2024, §4.3) sizes the token budget of a hybrid step so that the step ends
inside the time-between-tokens target, choosing the budget by offline profiling (and lists a
dynamic choice as future work). Here the profile is fitted online, from every timed forward.

For every bucket key (entry point and padded shape, ``pdjax.sched.buckets.BucketKey``) a
least-squares fit with exponential forgetting (the load of the machine drifts) is kept:

    t(key, n, c, q) = a_key + b_key * n + g_key * c + h_key * q
        n: new tokens of the step (padding excluded)
        c: cached tokens, sum over rows of the row's start (context read, not written)
        q: chunk attention pairs, sum over the rows of more than one token (prompt chunks) of
           the context each new token attends, n_r * start_r + n_r (n_r + 1) / 2: a chunk's
           attention grows with its tokens times its context, which n and c alone cannot
           price once a chunk may end anywhere inside its bucket

A key with few samples leans on a pooled fit per entry point, over every bucket of that entry,

    t(entry, T, n, c, q) = a + a_T * T + b * n + g * c + h * q   T: the bucket's padded
                                                                    token count

which is also the key fit's ridge prior, so a bucket never timed still gets a prediction from its
neighbours, and a bucket timed once is not judged on one sample. The fits learn the shape of
the cost; a load factor (an exponential average of measured / fitted time over every forward)
scales every prediction, so a shared machine whose load doubles a step's time is tracked
within a few steps (on the replayed SmolLM2 trace of tests/sched/data the median error of the
online prediction drops from 0.2-0.4 to about 0.1 with it). Features are scaled
(``n / token_scale``, ``c / cached_scale``, ``q / (token_scale * cached_scale)``) so the ridge
weights mean the same for every term.

A point prediction is exceeded by about half the steps it plans. ``margin(forward_mode)`` is an
upper quantile (``plan_quantile``, 0.98 by default) of the recent ratios measured / predicted of
that mode's entry point, each prediction made just before its forward was observed; the
scheduler plans ``prediction x margin`` against its target, so about that share of steps ends
inside it.

Thread-safe (the HTTP thread reads ``describe()`` while the engine thread observes).
Pure Python; never imports JAX.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Callable, Hashable

from pdjax.sched.buckets import ENTRY_OF_MODE


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve ``a x = b`` (small, symmetric positive definite) by Gaussian elimination."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        if p == 0.0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / m[r][r] if m[r][r] else 0.0
    return x


class _RidgeFit:
    """Normal equations of a linear fit, each old sample down-weighted by ``forget`` per new
    one; ``solve(prior, strength)`` minimises ``sum w (x.theta - y)^2 + strength |theta - prior|^2``
    with every coefficient >= 0 (a cost term is never negative, so a fit on noisy or collinear
    samples cannot extrapolate to a negative or shrinking cost)."""

    def __init__(self, dim: int, forget: float):
        self.dim, self.forget = dim, forget
        self.xtx = [[0.0] * dim for _ in range(dim)]
        self.xty = [0.0] * dim
        self.num_samples = 0

    def add(self, x: list[float], y: float) -> None:
        f = self.forget
        for i in range(self.dim):
            self.xty[i] = f * self.xty[i] + x[i] * y
            row = self.xtx[i]
            for j in range(self.dim):
                row[j] = f * row[j] + x[i] * x[j]
        self.num_samples += 1

    def solve(self, prior: list[float], strength: float) -> list[float]:
        # Clamp and refit: negative coefficients are pinned at 0 and the rest solved again.
        free = list(range(self.dim))
        theta = [0.0] * self.dim
        while free:
            a = [[self.xtx[i][j] + (strength if i == j else 0.0) for j in free] for i in free]
            b = [self.xty[i] + strength * prior[i] for i in free]
            x = _solve(a, b)
            if all(v >= 0 for v in x):
                for i, v in zip(free, x):
                    theta[i] = v
                break
            free = [i for i, v in zip(free, x) if v >= 0]
        return theta


class StepCostModel:
    """Online forward-time model per bucket key; see the module docstring.

    Args:
      pick_key: ``(forward_mode, num_tokens, num_rows, pages_per_seq) -> key`` (the engine's
        ``Buckets.pick``); keys must be hashable and have ``entry`` and ``num_tokens``.
      token_buckets: the compiled token buckets (ascending), which the scheduler snaps chunks to.
      token_scale, cached_scale: feature scales in tokens (any positive value works; the
        defaults suit contexts of a few thousand tokens).
      key_forget, pool_forget: per-sample forgetting factors in (0, 1].
      prior_strength: ridge weight pulling a key's fit towards the pooled fit (in samples of
        scaled features).
      load_smoothing: weight of the newest forward in the load factor, in (0, 1].
      plan_quantile: the quantile of measured / predicted that ``margin`` returns, in (0, 1).
      residual_window: how many recent forwards per entry point ``margin`` looks at (>= 1);
        with fewer than ``min(8, residual_window)`` of them the margin is 1.
    Raises ``ValueError`` naming the argument for a bad value.
    """

    def __init__(self, pick_key: Callable[..., Hashable], token_buckets: tuple[int, ...], *,
                 token_scale: float = 256.0, cached_scale: float = 4096.0,
                 key_forget: float = 0.97, pool_forget: float = 0.95,
                 prior_strength: float = 0.05, load_smoothing: float = 0.5,
                 plan_quantile: float = 0.98, residual_window: int = 128):
        for name, v in (("token_scale", token_scale), ("cached_scale", cached_scale),
                        ("prior_strength", prior_strength)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        for name, v in (("key_forget", key_forget), ("pool_forget", pool_forget),
                        ("load_smoothing", load_smoothing)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if not 0 < plan_quantile < 1:
            raise ValueError(f"plan_quantile must be in (0, 1), got {plan_quantile!r}")
        if not isinstance(residual_window, int) or residual_window < 1:
            raise ValueError(f"residual_window must be a positive integer, got {residual_window!r}")
        if not token_buckets or list(token_buckets) != sorted(token_buckets):
            raise ValueError(f"token_buckets must be a non-empty ascending list, got {token_buckets!r}")
        self.pick_key = pick_key
        self.token_buckets = tuple(token_buckets)
        self.token_scale, self.cached_scale = float(token_scale), float(cached_scale)
        self.pair_scale = self.token_scale * self.cached_scale
        self.key_forget, self.pool_forget = key_forget, pool_forget
        self.prior_strength = prior_strength
        self.load_smoothing = load_smoothing
        self.load_factor = 1.0        # recent measured / fitted time, over every entry point
        self.plan_quantile = plan_quantile
        self.residual_window = residual_window
        self._residuals: dict[str, collections.deque[float]] = {}   # measured / predicted
        self._keys: dict[Hashable, _RidgeFit] = {}
        self._pools: dict[str, _RidgeFit] = {}
        self._coef: dict[Hashable, list[float] | None] = {}     # solved fits, cleared on observe
        self._lock = threading.Lock()
        self.num_observed = 0

    # ------------------------------------------------------------------ fitting
    def _features(self, num_tokens: int, num_cached_tokens: int, num_chunk_pairs: int
                  ) -> list[float]:
        return [1.0, num_tokens / self.token_scale, num_cached_tokens / self.cached_scale,
                num_chunk_pairs / self.pair_scale]

    def observe(self, key: Hashable, num_tokens: int, num_cached_tokens: int,
                seconds: float, num_chunk_pairs: int = 0) -> None:
        """Add one timed forward of bucket ``key``: ``num_tokens`` new tokens (padding
        excluded), ``num_cached_tokens`` context tokens read, ``num_chunk_pairs`` the chunks'
        attention pairs (``q`` above; ``ScheduledBatch.num_chunk_pairs``), ``seconds`` wall
        time of the forward with its device work finished. Non-finite or negative times are
        ignored."""
        if not (seconds >= 0 and seconds < float("inf")):
            return
        x = self._features(num_tokens, num_cached_tokens, num_chunk_pairs)
        t = key.num_tokens / self.token_scale
        with self._lock:
            coef = self._key_coef(key)
            fitted = None if coef is None else sum(a * b for a, b in zip(coef, x))
            if fitted is not None and fitted > 0:
                # What predict_key said for this forward (before this sample moves the fit).
                res = self._residuals.get(key.entry)
                if res is None:
                    res = self._residuals[key.entry] = collections.deque(maxlen=self.residual_window)
                res.append(seconds / (fitted * self.load_factor))
                ratio = min(4.0, max(0.25, seconds / fitted))
                a = self.load_smoothing
                self.load_factor = (1 - a) * self.load_factor + a * ratio
            fit = self._keys.get(key)
            if fit is None:
                fit = self._keys[key] = _RidgeFit(4, self.key_forget)
            fit.add(x, seconds)
            pool = self._pools.get(key.entry)
            if pool is None:
                pool = self._pools[key.entry] = _RidgeFit(5, self.pool_forget)
            pool.add([1.0, t, *x[1:]], seconds)
            self._coef.clear()
            self.num_observed += 1

    def _pool_coef(self, entry: str) -> list[float] | None:
        if ("pool", entry) not in self._coef:
            pool = self._pools.get(entry)
            self._coef[("pool", entry)] = None if pool is None else pool.solve([0.0] * 5, 1e-3)
        return self._coef[("pool", entry)]

    def _key_coef(self, key: Hashable) -> list[float] | None:
        """``[a, b, g, h]`` of ``key`` in scaled units, or None when its entry has no data."""
        if key in self._coef:
            return self._coef[key]
        pool = self._pool_coef(key.entry)
        if pool is None:
            coef = None
        else:
            prior = [pool[0] + pool[1] * key.num_tokens / self.token_scale, *pool[2:]]
            fit = self._keys.get(key)
            coef = prior if fit is None else fit.solve(prior, self.prior_strength)
        self._coef[key] = coef
        return coef

    # ------------------------------------------------------------------ prediction
    def predict_key(self, key: Hashable, num_tokens: int, num_cached_tokens: int,
                    num_chunk_pairs: int = 0) -> float | None:
        """Predicted seconds of a forward of bucket ``key``; None before any data on its entry
        point. Never negative."""
        with self._lock:
            coef = self._key_coef(key)
            load = self.load_factor
        if coef is None:
            return None
        x = self._features(num_tokens, num_cached_tokens, num_chunk_pairs)
        return max(0.0, sum(a * b for a, b in zip(coef, x)) * load)

    def predict(self, forward_mode: str, num_tokens: int, num_rows: int, pages_per_seq: int,
                num_cached_tokens: int, num_chunk_pairs: int = 0) -> float | None:
        """Predicted seconds of a step the scheduler is planning (``forward_mode`` as in
        ``ScheduledBatch``); None when nothing is known yet or no bucket holds the step."""
        try:
            key = self.pick_key(forward_mode, num_tokens, num_rows, pages_per_seq)
        except ValueError:
            return None
        return self.predict_key(key, num_tokens, num_cached_tokens, num_chunk_pairs)

    def margin(self, forward_mode: str) -> float:
        """Factor (>= 1) a planned step's prediction is multiplied by before it is compared with
        a target: the ``plan_quantile`` of measured / predicted over the last
        ``residual_window`` forwards of ``forward_mode``'s entry point (``ENTRY_OF_MODE``); 1
        while fewer than ``min(8, residual_window)`` are known. ``ValueError`` for an unknown
        mode."""
        if forward_mode not in ENTRY_OF_MODE:
            raise ValueError(f"forward_mode must be one of {tuple(ENTRY_OF_MODE)}, got {forward_mode!r}")
        return self._entry_margin(ENTRY_OF_MODE[forward_mode])

    def _entry_margin(self, entry: str) -> float:
        with self._lock:
            res = sorted(self._residuals.get(entry, ()))
        if len(res) < min(8, self.residual_window):
            return 1.0
        # Nearest rank: the smallest ratio with at least plan_quantile of them at or below it.
        return max(1.0, res[max(0, math.ceil(self.plan_quantile * len(res)) - 1)])

    def describe(self) -> dict[str, Any]:
        """The current coefficients, for ``/get_server_info``: per entry point the pooled fit,
        per key its own (seconds, seconds per token, per cached token, per chunk pair)."""
        with self._lock:
            pools = {e: self._pool_coef(e) for e in sorted(self._pools)}
            keys = {k: (self._key_coef(k), self._keys[k].num_samples) for k in self._keys}
        s_n, s_c, s_q = self.token_scale, self.cached_scale, self.pair_scale
        out: dict[str, Any] = {"num_observed": self.num_observed, "load_factor": self.load_factor,
                               "plan_quantile": self.plan_quantile, "entries": {}, "buckets": []}
        for e, c in pools.items():
            out["entries"][e] = {"fixed_s": c[0], "per_bucket_token_s": c[1] / s_n,
                                 "per_token_s": c[2] / s_n, "per_cached_token_s": c[3] / s_c,
                                 "per_chunk_pair_s": c[4] / s_q,
                                 "num_samples": self._pools[e].num_samples,
                                 "margin": self._entry_margin(e)}
        for k, (c, num) in sorted(keys.items(), key=lambda kv: repr(kv[0])):
            desc = {f: getattr(k, f) for f in getattr(k, "__dataclass_fields__", {})} or {"key": repr(k)}
            desc.update(fixed_s=c[0], per_token_s=c[1] / s_n, per_cached_token_s=c[2] / s_c,
                        per_chunk_pair_s=c[3] / s_q, num_samples=num)
            out["buckets"].append(desc)
        return out
