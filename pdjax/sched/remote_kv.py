"""The scheduler's page books for KV that moves between servers (DESIGN.md §4): requests whose
KV is arriving (``waiting``), those whose KV has arrived and wait for a running slot
(``arrived``), and finished requests whose KV is still leaving or may still be written
(``held``). ``Scheduler`` holds one ``RemoteKV`` and changes it only through the calls below
(on the connector's answers and its worker's ``KVConnectorOutput``); ``Scheduler.
check_invariants`` counts every page it holds. Pure Python; never imports JAX.

    waiting --admission: connector has n tokens--> RemoteKV.waiting --finished_recving-->
        arrived (first token, when n was the rest of the prompt) --a running slot--> running
    RemoteKV.waiting --failed_recving / abort--> request_finished: True -> held, False -> free
    running --finish, request_finished True--> held --finished_sending--> released

A request in ``waiting`` has the pages of its whole prompt (or of its local prefix plus the
external tokens) and has computed nothing: released, its own pages go back to the free list,
never into the prefix cache (its KV may be partial or foreign).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterator, Mapping

from pdjax.request import Request
from pdjax.sched.kv_cache_manager import KVCacheManager
from pdjax.sched.kv_connector import FirstToken, KVConnector, NullConnector


class RemoteKV:
    """The remote-KV books of one scheduler and its ``connector`` (see the module docstring).

    ``kv``: the scheduler's ``KVCacheManager`` (a request's pages come from its allocator
    and go back through its ``release``). ``num_reserved_decode_tokens``: when a request's
    whole prompt arrives from elsewhere, admission also keeps free ``ceil(min(this, tokens it
    may still generate) / page_size)`` pages for it and for every running or arriving request
    (SGLang's ``pop_preallocated`` on a PD decode server, simplified; 0: none)."""

    def __init__(self, kv: KVCacheManager, num_reserved_decode_tokens: int = 0,
                 connector: KVConnector | None = None):
        self.connector: KVConnector = connector if connector is not None else NullConnector()
        self._kv = kv
        self._page_size = kv.page_size
        self.num_reserved_decode_tokens = num_reserved_decode_tokens
        self._held: dict[str, Request] = {}        # finished; pages kept until finished_sending
        self._waiting: dict[str, Request] = {}     # pages reserved, KV arriving
        # KV arrived (with the first token when the whole prompt came), in arrival order:
        # they join the running batch when it has a slot.
        self._arrived: dict[str, FirstToken | None] = {}
        # Requests whose connector answered "not yet" at their last admission attempt: no
        # reason to step for them until the connector wakes the engine.
        self.not_yet: set[str] = set()

    # ------------------------------------------------------------------ views
    @property
    def held(self) -> Mapping[str, Request]:
        """Finished requests whose pages are kept until ``finished_sending`` (read-only)."""
        return MappingProxyType(self._held)

    @property
    def waiting(self) -> Mapping[str, Request]:
        """Requests with reserved pages whose KV has not joined the running batch yet
        (read-only view, rid -> request; those whose KV arrived are in ``arrived`` too)."""
        return MappingProxyType(self._waiting)

    @property
    def arrived(self) -> Mapping[str, FirstToken | None]:
        """rid -> first token (None: a partial prompt) of the requests whose KV arrived and
        that wait for a running slot, oldest first (read-only)."""
        return MappingProxyType(self._arrived)

    def requests(self) -> Iterator[Request]:
        """Every request whose pages the books hold (held and waiting)."""
        yield from self._held.values()
        yield from self._waiting.values()

    # ------------------------------------------------------------------ admission
    @staticmethod
    def check_external(req: Request, num_local: int, num_external: int, page_size: int) -> bool:
        """Whether ``num_external`` tokens after ``num_local`` local ones are the rest of
        ``req``'s prompt (True) or whole pages leaving a prompt token to compute (False).
        ``ValueError`` for any other count."""
        if num_local + num_external == req.num_prompt_tokens:
            return True
        if num_external % page_size or num_local + num_external >= req.num_prompt_tokens:
            raise ValueError(f"connector: {num_external} external tokens after {num_local} "
                             f"local ones must be the rest of the prompt of "
                             f"{req.num_prompt_tokens} tokens or whole pages of {page_size} "
                             f"leaving a prompt token to compute")
        return False

    def reserved_decode_pages(self, req: Request, running: list[Request]) -> int:
        """Pages to keep free for decode tokens when ``req``'s whole prompt is admitted from
        elsewhere (``num_reserved_decode_tokens``): for ``req`` and every running or arriving
        request; a request with no output yet counts its first token as generated."""
        n, ps = self.num_reserved_decode_tokens, self._page_size
        if not n:
            return 0

        def need(r: Request) -> int:
            mnt = r.sampling_params.max_new_tokens
            left = n if mnt is None else max(0, min(n, mnt - max(1, len(r.output_ids))))
            return -(-left // ps)

        # DP attention: only the requests of req's rank draw on its pages
        others = self._kv.same_pool(req, [*running, *self._waiting.values()])
        return need(req) + sum(map(need, others))

    def admit(self, req: Request, num_external: int) -> None:
        """``req`` holds its local prefix pages (``req.pages``); allocate the pages of its
        ``num_external`` tokens (the rest of the prompt, or whole pages), park it in
        ``waiting`` and tell the connector. The pages must be free already."""
        ps = self._page_size
        local = len(req.pages) * ps
        whole = self.check_external(req, local, num_external, ps)   # 0: all local, but whole
        # through the manager: under DP attention the pages come from the request's rank
        if not self._kv.grow(req, req.num_prompt_tokens if whole else local + num_external):
            raise RuntimeError(f"{req.rid}: admitted without free pages for its prompt")
        req.reserve_prebuilt(local)
        self._waiting[req.rid] = req
        self.not_yet.discard(req.rid)
        self.connector.update_state_after_alloc(req, num_external)

    # ------------------------------------------------------------------ the worker's output
    def arrive(self, rid: str, first: FirstToken | None) -> Request | None:
        """The KV of ``rid`` (in ``waiting``) arrived; ``first``: its first token when the
        whole prompt came. Returns the request, or None for an rid that is not waiting (an
        abort came first) or arrived already."""
        req = self._waiting.get(rid)
        if req is None or rid in self._arrived:
            return None
        self._arrived[rid] = first
        return req

    def is_whole_prompt(self, req: Request) -> bool:
        """Whether ``req`` (in ``waiting``) was admitted for the whole rest of its prompt."""
        return len(req.pages) * self._page_size >= req.num_prompt_tokens

    def take_arrived(self) -> tuple[Request, FirstToken | None]:
        """The oldest arrived request, out of the books (the scheduler runs it)."""
        rid = next(iter(self._arrived))
        return self._waiting.pop(rid), self._arrived.pop(rid)

    def sent(self, rid: str) -> None:
        """The KV of held ``rid`` has left (or can no longer be written): pages back."""
        req = self._held.pop(rid, None)
        if req is not None:
            self._kv.release(req)

    # ------------------------------------------------------------------ endings
    def end_waiting(self, req: Request) -> None:
        """``req`` (in ``waiting``) leaves without running (failed, aborted, nothing to
        decode): the connector's ``request_finished`` keeps its pages (``held``) or they go
        back now."""
        del self._waiting[req.rid]
        self._arrived.pop(req.rid, None)
        self.finished(req)

    def finished(self, req: Request) -> None:
        """A request with pages ended: ``held`` if the connector keeps them, else released."""
        if self.connector.request_finished(req):
            self._held[req.rid] = req
        else:
            self._kv.release(req)

    def owns(self, req: Request) -> bool:
        return self._waiting.get(req.rid) is req
