"""The scheduler's page books for KV that moves between servers (DESIGN.md §4): requests whose
KV is arriving (``waiting_remote``) and finished requests whose KV is still leaving
(``held``). A ``KVConnector`` (``pdjax.sched.kv_connector``) moves requests in and out of them
only through the calls below; ``Scheduler.check_invariants`` counts every page they hold.

``RemoteKV`` is a mixin of ``pdjax.sched.scheduler.Scheduler``: it reads the scheduler's
allocator, prefix cache, queues and ``_release``. Pure Python; never imports JAX.

    waiting --admission, connector has n tokens--> waiting_remote --finished_recving--> running
    none --reserve_remote--> waiting_remote --commit_remote(first token)--> running
                                    '--drop_remote--> free (or the connector's, e.g. quarantine)
    running --finish, connector.request_finished True--> held --finished_sending--> released
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Mapping

from pdjax.request import Request
from pdjax.sched.kv_connector import KVConnectorOutput


class RemoteKV:
    """``Scheduler``'s remote-KV methods; the state (``connector``, ``_held``,
    ``_waiting_remote``) is created in ``Scheduler.__init__``."""

    @property
    def held(self) -> Mapping[str, Request]:
        """Finished requests whose pages are kept until ``finished_sending`` (read-only view)."""
        return MappingProxyType(self._held)

    @property
    def waiting_remote(self) -> Mapping[str, Request]:
        """Requests with reserved pages whose KV is arriving (read-only view, rid -> request)."""
        return MappingProxyType(self._waiting_remote)

    # ------------------------------------------------------------------ the connector's calls
    def build_connector_meta(self, batch) -> object | None:
        """What the transfer worker must move after ``batch`` (``KVConnector.build_meta``)."""
        return self.connector.build_meta(batch)

    def update_from_kv_output(self, output: KVConnectorOutput | None) -> None:
        """Apply what the worker finished (vLLM's ``_update_from_kv_xfer_finished``): a held
        request named in ``finished_sending`` gives its pages back (full pages into the prefix
        cache); a request in ``waiting_remote`` named in ``finished_recving`` joins the running
        batch with the arrived tokens computed (its full pages shared in the prefix cache).
        Unknown rids are ignored (an abort came first). Then ``connector.update(output)``."""
        if not output:
            return
        for rid in output.finished_sending:
            req = self._held.pop(rid, None)
            if req is not None:
                self._release(req)
        for rid in output.finished_recving:
            req = self._waiting_remote.pop(rid, None)
            if req is None:
                continue
            loaded = len(req.pages) * self.page_size
            req.start_running(req.num_cached_tokens)
            req.set_num_computed_tokens(loaded)
            req.set_reported_cached_tokens(loaded)
            self.running.append(req)
            self._share_computed(req, loaded)
        self.connector.update(output)

    def _admit_remote(self, req: Request, num_external_tokens: int) -> None:
        """Admission found ``num_external_tokens`` tokens past ``req``'s local prefix at the
        connector: allocate their pages (already made free) and park ``req`` until they
        arrive. ``ValueError`` for a count that is not whole pages inside the prompt."""
        ps = self.page_size
        local = len(req.pages) * ps
        if num_external_tokens % ps or local + num_external_tokens >= req.num_prompt_tokens:
            raise ValueError(f"connector: {num_external_tokens} external tokens after {local} "
                             f"local ones must be whole pages of {ps} leaving a prompt token "
                             f"of {req.num_prompt_tokens} to compute")
        req.pages += self.allocator.alloc(num_external_tokens // ps)
        req.reserve_prebuilt(local)
        self._waiting_remote[req.rid] = req
        self.connector.update_state_after_alloc(req, num_external_tokens)

    # ------------------------------------------------------------------ self-admitted requests
    def reserve_remote(self, req: Request, extra_free_pages: int = 0) -> bool:
        """Admission by a connector (PD decode): match the prompt in the prefix cache (full
        pages), lock the match and allocate the pages for the rest of the prompt, provided
        ``extra_free_pages`` more (reserved for decode tokens) could also be freed. Returns
        False (no change) otherwise. Afterwards ``req.num_cached_tokens`` = matched prefix
        tokens (a multiple of page_size), ``req.pages`` covers the whole prompt and the request
        is in ``waiting_remote``. ``ValueError`` if ``req`` is already known or too long."""
        if req.rid in self.requests or req.rid in self._waiting_remote or req.rid in self._held:
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
        self._waiting_remote[req.rid] = req
        return True

    def commit_remote(self, req: Request, first_token_id: int) -> None:
        """A reserved request joins the running batch: its prompt KV is in its pages, its first
        output token is ``first_token_id`` (sampled by the prefill server). The next decode
        step computes that token's KV; the prompt is never recomputed.
        ``ValueError`` if ``req`` is not in ``waiting_remote``."""
        if self._waiting_remote.get(req.rid) is not req:
            raise ValueError(f"rid {req.rid!r} has no reserved pages")
        del self._waiting_remote[req.rid]
        req.arrival_time = req.arrival_time or time.monotonic()
        req.start_prebuilt(first_token_id, self.step_id)
        self.requests[req.rid] = req
        self.running.append(req)

    def drop_remote(self, req: Request, free: bool = True) -> list[int]:
        """A reserved request leaves without its KV (a failed transfer): the matched prefix is
        unlocked, its own pages never enter the prefix cache. ``free`` False hands them to the
        caller instead of the free list (a connector keeps them where a late write may still
        land, reports them in ``owned_pages`` and gives them back with ``free_pages``).
        Returns the own pages. ``ValueError`` if ``req`` is not in ``waiting_remote``."""
        if self._waiting_remote.get(req.rid) is not req:
            raise ValueError(f"rid {req.rid!r} has no reserved pages")
        del self._waiting_remote[req.rid]
        own = req.pages[self.num_shared_pages(req):]
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        if free and own:
            self.allocator.free(own)
        req.pages = []
        return own

    def free_pages(self, pages: list[int]) -> int:
        """Give back pages ``drop_remote(free=False)`` handed out; returns how many."""
        if pages:
            self.allocator.free(pages)
        return len(pages)
