"""Token sampling on the host (numpy) from the logits of the sampled rows.

Greedy, temperature, top-k, top-p, min-p, frequency/presence/repetition penalties (as in
SGLang/vLLM: penalties see the output tokens; repetition also the prompt), output logprobs
(raw log-softmax of the model's logits, before any penalty or temperature) and top-k logprobs.

Reproducibility: a request's n-th token is drawn from ``np.random.default_rng((seed, n))``,
so the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.request import Request


@dataclasses.dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


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
        logits[seen] = np.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and req.output_ids:
        ids, counts = np.unique(np.asarray(req.output_ids, np.int64), return_counts=True)
        logits[ids] -= sp.frequency_penalty * counts + sp.presence_penalty
    return logits


def sample_token(logits: np.ndarray, req: Request) -> SampleResult:
    """Sample the next token of ``req`` from its logits row ``[V]`` float32."""
    sp = req.sampling_params
    lp = log_softmax(logits) if req.return_logprob else None
    x = apply_penalties(logits.astype(np.float64).copy(), req)
    if sp.is_greedy:
        token = int(np.argmax(x))
    else:
        x = x / sp.temperature
        probs = np.exp(x - x.max())
        if sp.top_k > 0 and sp.top_k < probs.size:
            kth = np.partition(probs, -sp.top_k)[-sp.top_k]
            probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
        if sp.min_p > 0:
            probs = np.where(probs >= sp.min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
        if sp.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = cum - probs[order] < sp.top_p          # always keeps the top token
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        rng = np.random.default_rng((req.seed_for_sampling, len(req.output_ids)))
        u = rng.random()
        token = int(min(np.searchsorted(np.cumsum(probs), u, side="right"), probs.size - 1))
        while probs[token] == 0.0:      # rounding at the top end of the cumulative sum
            token -= 1
    if lp is None:
        return SampleResult(token, 0.0, [])
    return SampleResult(token, float(lp[token]), top_logprobs(lp, req.top_logprobs_num))
