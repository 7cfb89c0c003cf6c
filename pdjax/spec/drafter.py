"""Drafters: what proposes the tokens a verify step checks (DESIGN.md §3, "Speculative
decoding"). Pure Python; never imports JAX.

The interface is batched and stateful per request, so that every kind of drafter fits it:

- prompt lookup (``NgramDrafter``, here): no model; the draft continues the latest earlier
  occurrence of the request's last few tokens. Deterministic, so its draft distribution is a
  one-hot and the sampler's lossless rule needs no draft probabilities.
- a separate draft model (``DraftModelDrafter``, ``draft_model.py``): ``propose`` rolls its
  own paged KV back to the common prefix with ``all_ids`` (the counters move, whole pages past
  it are freed, the slots are overwritten later), then runs one batched extend and ``k - 1``
  batched decode forwards of the small model; its pages are freed by ``release``. It drafts
  greedily, so its draft distribution is a one-hot too.
- MTP (``MTPDrafter``, ``mtp.py``; DeepSeek-V3 / V3.2 / GLM-5 ``num_nextn_predict_layers``):
  the checkpoint's multi-token prediction layer, over its own paged KV, reads the target's
  normed hidden states, which every target forward writes into the ``mtp_hidden`` cache buffer
  (so they roll back, hit the prefix cache and travel in PD with the KV pages); ``propose``
  catches up on the positions computed since, then chains ``k - 1`` greedy steps.

A drafter never sees a rejected token: ``on_verified`` gets the tokens the request kept.
"""

from __future__ import annotations

import abc
from typing import Callable


class Drafter(abc.ABC):
    """Proposes draft tokens for running requests.

    ``propose(requests, max_tokens)``: for each ``Request`` (its ``all_ids`` are known, no
    placeholder), at most ``max_tokens[i]`` draft tokens continuing ``all_ids`` (a list of
    ints; may be empty: that request decodes plainly this step).
    ``on_verified(rid, num_accepted)``: the verify step of ``rid`` kept ``num_accepted`` of its
    drafts (the request's ``output_ids`` already hold them and the target's own token).
    ``release(rid)``: the request ended or was retracted; drop its state.
    ``warmup()``: compile what ``propose`` runs (the engine calls it at its warm-up).
    """

    name: str = ""

    @abc.abstractmethod
    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        ...

    def on_verified(self, rid: str, num_accepted: int) -> None:
        return None

    def release(self, rid: str) -> None:
        return None

    def warmup(self) -> None:
        return None


_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register_drafter(name: str):
    """Class decorator: make ``create_drafter(name, ...)`` build this drafter."""
    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def create_drafter(name: str, **kwargs) -> Drafter:
    """The drafter registered as ``name`` built with ``kwargs``; ``ValueError`` naming
    ``speculative_algorithm`` for an unknown one."""
    if name not in _REGISTRY:
        raise ValueError(f"speculative_algorithm must be one of {sorted(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name](**kwargs)


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023; vLLM's ``ngram``, SGLang's ``NGRAM``): find the
    latest earlier occurrence of the request's last ``n`` tokens, for ``n`` from
    ``max_match_window`` down to ``min_match_window``, and propose the tokens that followed it.

    Per request an index ``{n-gram: end position of its latest occurrence}`` is kept for each
    ``n`` and extended with the tokens appended since the last call, so a step costs
    O(new tokens x windows), not a scan of the context. Only n-grams with a continuation are
    indexed (end <= len - 2), so the suffix itself is never its own match::

        ids:   a b c d e f a b c ?        suffix "a b c" (n = 3) ends at 8
        index: "a b c" -> 2               draft = ids[3:3 + k] = d e f ...
    """

    def __init__(self, min_match_window: int = 1, max_match_window: int = 12):
        if not (isinstance(min_match_window, int) and min_match_window >= 1):
            raise ValueError(f"speculative_ngram_min_match_window_size must be >= 1, got "
                             f"{min_match_window!r}")
        if not (isinstance(max_match_window, int) and max_match_window >= min_match_window):
            raise ValueError(f"speculative_ngram_max_match_window_size must be >= the min "
                             f"({min_match_window}), got {max_match_window!r}")
        self.min_n, self.max_n = min_match_window, max_match_window
        self._state: dict[str, tuple[list[dict], list[int]]] = {}   # rid -> (indexes, [done])

    def _index(self, rid: str, ids: list[int]) -> list[dict]:
        indexes, done = self._state.setdefault(
            rid, ([{} for _ in range(self.max_n - self.min_n + 1)], [0]))
        stop = len(ids) - 1                     # n-grams ending before the last token
        if stop < done[0]:                      # the ids changed under us (retraction): redo
            indexes[:] = [{} for _ in indexes]
            done[0] = 0
        for end in range(done[0], stop):
            for i, n in enumerate(range(self.min_n, self.max_n + 1)):
                if end + 1 >= n:
                    indexes[i][tuple(ids[end + 1 - n:end + 1])] = end
        done[0] = max(done[0], stop)
        return indexes

    def draft_for(self, rid: str, ids: list[int], k: int) -> list[int]:
        """At most ``k`` tokens continuing ``ids`` (``[]`` when no window matches)."""
        if k <= 0 or len(ids) < self.min_n + 1:
            return []
        indexes = self._index(rid, ids)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            end = indexes[n - self.min_n].get(tuple(ids[-n:]))
            if end is not None:
                return list(ids[end + 1:end + 1 + k])
        return []

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        return [self.draft_for(r.rid, r.all_ids, k) for r, k in zip(requests, max_tokens)]

    def release(self, rid: str) -> None:
        self._state.pop(rid, None)
