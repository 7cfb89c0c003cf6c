"""The PD page sets of the scheduler (DESIGN.md §4): pages a PD role keeps outside the normal
request lifecycle -- a prefill's finished requests whose KV is still being copied, and a
decode's pages reserved before the KV arrives or quarantined after a failed transfer.

``PDPageSets`` is a mixin of ``pdjax.sched.scheduler.Scheduler``: it reads the scheduler's
allocator, prefix cache, queues and ``_release``, and ``Scheduler.check_invariants`` counts
every page it holds. Pure Python; never imports JAX.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Hashable, Mapping

from pdjax.request import Request


class PDPageSets:
    """``Scheduler``'s PD methods; the state (``_held``, ``_hold_on_finish``, ``_prealloc``,
    ``_quarantined``) is created in ``Scheduler.__init__``."""

    # ------------------------------------------------------------------ PD page sets
    # The transfer roles change these sets only through the methods below (DESIGN.md §4);
    # ``check_invariants`` counts every one of them.
    # Prefill: a request whose KV is being copied to a decode server finishes after its first
    # token, but its pages must not be evicted or reused until the copy ends (DESIGN.md §4
    # step 7): ``hold_on_finish`` -> held -> ``release_held`` (``cancel_hold`` before it
    # finished).
    # Decode: pages are reserved before the KV arrives (``reserve_prebuilt``), then the request
    # joins the running batch with its first token and no prompt recompute (``add_prebuilt``,
    # the commit), or gives the pages back without caching them (``release_prebuilt``), or
    # parks them where a late write may still land (``quarantine_prebuilt``) until
    # ``release_quarantine``.
    #
    #     waiting/none --reserve_prebuilt--> prealloc --add_prebuilt--> running
    #                                           |--release_prebuilt--> free
    #                                           '--quarantine_prebuilt--> quarantined --> free

    @property
    def held(self) -> Mapping[str, Request]:
        """Finished requests whose pages are kept (read-only view, rid -> request)."""
        return MappingProxyType(self._held)

    @property
    def prealloc(self) -> Mapping[str, Request]:
        """Decode requests with reserved pages whose KV is arriving (read-only view)."""
        return MappingProxyType(self._prealloc)

    def hold_on_finish(self, rid: str) -> None:
        """Keep ``rid``'s pages when it finishes (it becomes held until ``release_held``).
        Call before the request is added; an abort drops the mark."""
        self._hold_on_finish.add(rid)

    def cancel_hold(self, rid: str) -> None:
        """Undo ``hold_on_finish`` for a request that never finished (e.g. refused on add)."""
        self._hold_on_finish.discard(rid)

    def release_held(self, rid: str) -> bool:
        """Give back the pages of a held finished request (full pages into the prefix cache).
        Returns False if ``rid`` is not held."""
        req = self._held.pop(rid, None)
        if req is None:
            return False
        self._release(req)
        return True

    def reserve_prebuilt(self, req: Request, extra_free_pages: int = 0) -> bool:
        """Decode admission: match the prompt in the prefix cache (full pages), lock the match
        and allocate the pages for the rest of the prompt, provided ``extra_free_pages`` more
        (reserved for decode tokens) could also be freed. Returns False (no change) otherwise.
        Afterwards ``req.num_cached_tokens`` = matched prefix tokens (a multiple of page_size)
        and ``req.pages`` covers the whole prompt; the request is in ``prealloc``.
        Raises ``ValueError`` if ``req`` is already known or its prompt is too long."""
        if req.rid in self.requests or req.rid in self._prealloc or req.rid in self._held:
            raise ValueError(f"rid {req.rid!r} is already in use")
        if req.num_prompt_tokens >= self.max_request_tokens:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens is at or over the "
                             f"context length {self.max_request_tokens}")
        ps = self.page_size
        pages, node = self.prefix_cache.match_prefix(req.prompt_ids,
                                                     max_pages=req.num_prompt_tokens // ps)
        self.prefix_cache.lock(node)
        new = -(-req.num_prompt_tokens // ps) - len(pages)
        if not self._make_free(new + max(0, extra_free_pages)):
            self.prefix_cache.unlock(node)
            return False
        req.prefix_node = node
        req.pages = list(pages) + self.allocator.alloc(new)
        req.reserve_prebuilt(len(pages) * ps)
        self._prealloc[req.rid] = req
        return True

    def decode_reserve_pages(self, req: Request, num_reserved_decode_tokens: int) -> int:
        """Pages to keep free for decode tokens when ``req`` is admitted: for ``req`` and every
        running or reserved request, ``ceil(min(num_reserved_decode_tokens, tokens it may still
        generate) / page_size)`` (SGLang's ``pop_preallocated``, simplified; a request that has
        no output yet counts its first token as generated)."""
        ps = self.page_size

        def need(r: Request) -> int:
            mnt = r.sampling_params.max_new_tokens
            left = (num_reserved_decode_tokens if mnt is None else
                    max(0, min(num_reserved_decode_tokens, mnt - max(1, len(r.output_ids)))))
            return -(-left // ps)

        return need(req) + sum(map(need, self.running)) + sum(map(need, self._prealloc.values()))

    def add_prebuilt(self, req: Request, first_token_id: int) -> None:
        """Commit a reserved request into the running batch: its prompt KV is in its pages, its
        first output token is ``first_token_id`` (sampled by the prefill server). The next
        decode step computes that token's KV; the prompt is never recomputed.
        Raises ``ValueError`` if ``req`` is not in ``prealloc``."""
        if self._prealloc.get(req.rid) is not req:
            raise ValueError(f"rid {req.rid!r} has no reserved pages")
        del self._prealloc[req.rid]
        req.arrival_time = req.arrival_time or time.monotonic()
        req.start_prebuilt(first_token_id, self.step_id)
        self.requests[req.rid] = req
        self.running.append(req)

    def release_prebuilt(self, req: Request) -> list[int]:
        """Give back a reserved request's pages without caching them (failed transfer that
        nothing writes any more): the matched prefix is unlocked, the request's own pages are
        freed. Returns the own pages. ``ValueError`` if ``req`` is not in ``prealloc``."""
        return self._drop_prebuilt(req, None)

    def quarantine_prebuilt(self, req: Request, quarantine_key: Hashable) -> list[int]:
        """Like ``release_prebuilt``, but the own pages wait under ``quarantine_key`` until
        ``release_quarantine`` (a late write may still land in them). Returns them.
        ``ValueError`` if ``req`` is not in ``prealloc`` or the key is in use."""
        if quarantine_key is None:
            raise ValueError("quarantine_key: required")
        return self._drop_prebuilt(req, quarantine_key)

    def _drop_prebuilt(self, req: Request, quarantine_key: Hashable | None) -> list[int]:
        if self._prealloc.get(req.rid) is not req:
            raise ValueError(f"rid {req.rid!r} has no reserved pages")
        if quarantine_key is not None and quarantine_key in self._quarantined:
            raise ValueError(f"quarantine key {quarantine_key!r} is already in use")
        del self._prealloc[req.rid]
        own = req.pages[self.num_shared_pages(req):]
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        if quarantine_key is not None:
            self._quarantined[quarantine_key] = list(own)
        elif own:
            self.allocator.free(own)
        req.pages = []
        return own

    def release_quarantine(self, quarantine_key: Hashable) -> int:
        """Free quarantined pages; returns how many (0 for an unknown key)."""
        pages = self._quarantined.pop(quarantine_key, None)
        if not pages:
            return 0
        self.allocator.free(pages)
        return len(pages)

    @property
    def has_quarantine(self) -> bool:
        """Whether any quarantine key is open (even one holding no page)."""
        return bool(self._quarantined)

    @property
    def num_quarantined_pages(self) -> int:
        return sum(len(p) for p in self._quarantined.values())
