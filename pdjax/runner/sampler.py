"""The numpy sampler: the test oracle of the device sampler (``device_sampler.py``).

The engine samples on the device; this module computes the same definitions on the host in
float64, one row at a time, so tests can check the device sampler against it: greedy,
temperature, top-k, top-p, min-p, frequency/presence/repetition penalties (as in SGLang/vLLM:
penalties see the output tokens; repetition also the prompt), output logprobs (raw log-softmax of
the model's logits, before any penalty or temperature) and top-k logprobs. The definitions are
written out in ``device_sampler``'s module docstring.

Reproducibility: a request's n-th token is drawn from ``u = device_sampler.uniform_for(seed,
n)``, the very uniform the device sampler uses, so the same seed gives the same tokens whatever
else shares the batch, and both samplers agree draw for draw.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.request import Request
from pdjax.runner.device_sampler import LOGIT_LIMIT, uniform_for


@dataclasses.dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    # Distance of the draw from the nearest CDF boundary, relative to the total mass (inf for
    # greedy): below ~1e-5 float32 and float64 may pick neighbouring tokens (a numeric tie).
    margin: float = float("inf")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 for stable logprobs; input ``[..., V]``."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one row, ``(token_id, logprob)`` in descending order."""
    if k <= 0:
        return []
    k = min(k, logprobs.shape[-1])
    idx = np.argpartition(-logprobs, k - 1)[:k]
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in idx]


def apply_penalties(logits: np.ndarray, req: Request) -> np.ndarray:
    sp = req.sampling_params
    if sp.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.all_ids, np.int64))
        vals = logits[seen]
        with np.errstate(over="ignore"):
            logits[seen] = np.clip(np.where(vals > 0, vals / sp.repetition_penalty,
                                            vals * sp.repetition_penalty),
                                   -LOGIT_LIMIT, LOGIT_LIMIT)
    if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
        ids, counts = np.unique(np.asarray(req.output_ids, np.int64), return_counts=True)
        logits[ids] -= sp.frequency_penalty * counts + sp.presence_penalty
    return logits


def apply_logit_bias(logits: np.ndarray, logit_bias: dict[int, float] | None) -> np.ndarray:
    """``logits [V]`` with ``logit_bias`` (``{token_id: bias}``) added in place."""
    for tok, bias in (logit_bias or {}).items():
        logits[tok] += bias
    return logits


def keep_threshold(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> float:
    """Smallest probability kept by top-k, min-p and top-p (ties at it are all kept)."""
    s = -np.sort(-probs)
    k = top_k if 0 < top_k < s.size else s.size
    thr = max(s[k - 1], min_p * s[0])
    pre = np.where(s >= thr, s, 0.0)
    excl = np.cumsum(pre) - pre
    m = max(int(((pre > 0) & (excl < top_p * pre.sum())).sum()), 1)
    return max(thr, s[m - 1])


def sample_token(logits: np.ndarray, req: Request, bitmask: np.ndarray | None = None,
                 eos_token_ids=()) -> SampleResult:
    """Sample the next token of ``req`` from its logits row ``[V]`` float32. ``bitmask``: the
    row's grammar mask ``[ceil(V/32)]`` int32 (``pdjax.constrained.grammar.apply_bitmask``),
    applied first, then the stop tokens held back below ``min_new_tokens`` (``eos_token_ids``
    and ``stop_token_ids``; kept if they are all the row allows), then
    ``sampling_params.logit_bias``, then the penalties; logprobs stay those of the raw
    logits."""
    sp = req.sampling_params
    lp = log_softmax(logits) if req.return_logprob else None
    x = logits.astype(np.float64)
    if bitmask is not None:
        from pdjax.constrained.grammar import apply_bitmask

        x = apply_bitmask(x, bitmask)
    held = list(sp.held_stop_ids(len(req.output_ids), eos_token_ids))
    if held:
        masked = x.copy()
        masked[held] = -np.inf
        if (masked > -np.inf).any():
            x = masked
    x = apply_logit_bias(x.copy(), sp.logit_bias)
    x = apply_penalties(x, req)
    margin = float("inf")
    if sp.is_greedy:
        token = int(np.argmax(x))
    else:
        x = x / sp.temperature
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        q = np.where(probs >= keep_threshold(probs, sp.top_k, sp.top_p, sp.min_p), probs, 0.0)
        cdf = np.cumsum(q)
        target = uniform_for(req.seed_for_sampling, len(req.output_ids)) * cdf[-1]
        raw = int(min(np.searchsorted(cdf, target, side="right"), q.size - 1))
        kept = np.nonzero(q[:raw + 1])[0]
        token = int(kept[-1])
        margin = float(np.abs(cdf[q > 0] - target).min() / cdf[-1])
    if lp is None:
        return SampleResult(token, 0.0, [], margin)
    return SampleResult(token, float(lp[token]), top_logprobs(lp, req.top_logprobs_num), margin)
